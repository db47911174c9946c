"""The JupyterLab path: a real ``jupyter server`` process, its REST API and kernel websocket."""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
import requests
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from sandbox_kernel.backends.docker import DockerBackend
from sandbox_kernel.lifecycle.ownership import list_kernels, remove_kernel
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID

from .conftest import KERNEL, SANDBOX_UID, make_workspace, stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.token = token
        self.headers = {"Authorization": f"token {token}"}

    def api(self, method: str, path: str, **kwargs: object) -> requests.Response:
        response = requests.request(method, f"{self.url}{path}", headers=self.headers, timeout=60, **kwargs)
        response.raise_for_status()
        return response


# How users start a server: analysts run ``jupyter lab`` or ``jupyter notebook``,
# JupyterHub and deployments run ``jupyter server``. Each wraps jupyter_server's
# ServerApp differently (an extension app launches it), so each is tested.
SERVER_COMMANDS = ("server", "lab", "notebook")


def start_server(
    root: Path, log_path: Path, port: int | None = None, command: str = "server", token: str | None = None
) -> tuple[Server, subprocess.Popen[bytes]]:
    """A real ``jupyter <command>`` process serving ``root``, up and answering."""
    token = token or secrets.token_hex(16)
    port = port or free_port()
    env = {**os.environ, "JUPYTER_TOKEN": token}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("jupyter")),
                command,
                "--no-browser",
                "--allow-root",
                f"--port={port}",
                "--ip=127.0.0.1",
                f"--ServerApp.root_dir={root}",
                "--ServerApp.port_retries=0",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = Server(f"http://127.0.0.1:{port}", token)
    deadline = time.monotonic() + 60
    while True:
        try:
            server.api("GET", "/api/status")
            return server, proc
        except requests.RequestException:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_server(proc)
                raise
            time.sleep(0.3)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc, timeout=30)


@pytest.fixture
def jupyter_server(jupyter_dirs: Path, tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    root = make_workspace(tmp_path / "notebooks")
    server, proc = start_server(root, tmp_path / "server.log")
    try:
        yield server, root
    finally:
        stop_server(proc)


async def execute_over_websocket(server: Server, kernel_id: str, code: str) -> tuple[str, str]:
    """Run ``code`` the way JupyterLab does; return (status, stdout)."""
    ws_url = server.url.replace("http", "ws") + f"/api/kernels/{kernel_id}/channels"
    conn = await websocket_connect(HTTPRequest(ws_url, headers=server.headers))
    msg_id = uuid.uuid4().hex
    conn.write_message(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "msg_type": "execute_request",
                    "username": "analyst",
                    "session": uuid.uuid4().hex,
                    "version": "5.3",
                    "date": "",
                },
                "parent_header": {},
                "metadata": {},
                "channel": "shell",
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": True,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
            }
        )
    )
    stdout, status, idle = "", None, False
    deadline = time.monotonic() + 60
    while (status is None or not idle) and time.monotonic() < deadline:
        raw = await conn.read_message()
        assert raw is not None, "the server closed the kernel websocket"
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            stdout += msg["content"]["text"]
        elif kind == "execute_reply":
            status = msg["content"]["status"]
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    conn.close()
    assert status is not None, "no execute_reply within 60 s"
    return status, stdout


def adopting_server_setup(tmp_path: Path) -> tuple[Path, Path]:
    """The documented config line that lets servers adopt persistent kernels, a notebook
    folder with a project in it, and the server's log: (root, log)."""
    config_dir = Path(os.environ["JUPYTER_CONFIG_DIR"])
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "jupyter_server_config.py").write_text(
        'c.ServerApp.kernel_manager_class = "sandbox_kernel.server.SandboxMappingKernelManager"\n'
    )
    root = make_workspace(tmp_path / "notebooks")
    make_workspace(root / "project")
    return root, tmp_path / "server.log"


@pytest.fixture
def reachable(tmp_path: Path) -> Iterator[Path]:
    """A folder any user may pass through, as /home or /srv are (pytest's own temporary
    folders are root's, 0700: a user's folder in one cannot be reached by its owner);
    removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="sandbox-kernel-test-", dir="/tmp"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder)


def contents(server: Server, method: str, path: str, **model: Any) -> dict[str, Any]:
    """A call of the contents REST API, as JupyterLab makes it."""
    answer: dict[str, Any] = server.api(method, f"/api/contents/{path}", json=model or None).json()
    return answer


@pytest.mark.skipif(os.geteuid() != 0, reason="what a server running as root makes")
async def test_what_a_root_server_makes_in_a_users_folder_is_theirs_and_their_kernels_to_change(
    jupyter_dirs: Path, reachable: Path, tmp_path: Path
) -> None:
    """#23 item 3: under a root server, the folders JupyterLab made (New Folder), the files
    uploaded (whole and in chunks), new notebooks and their checkpoints were root's, so
    read-only to the kernel, which runs as the folder's owner. Made through the REST API
    as JupyterLab does, then changed by the sandboxed kernel. A link the folder's owner
    plants where Lab will save is not written through."""
    root = reachable / "srv"
    root.mkdir()
    project = make_workspace(root / "project")
    secret = reachable / "secret"
    secret.write_text("root's\n")
    secret.chmod(0o600)
    server, proc = start_server(root, tmp_path / "server.log")
    try:
        folder = contents(server, "POST", "project", type="directory")["path"]  # "New Folder"
        contents(server, "PUT", "project/data", type="directory")
        contents(server, "PUT", "project/data/sales.csv", type="file", format="text", content="a,b\n1,2\n")
        for chunk, part in ((1, b"head "), (2, b"middle "), (-1, b"tail")):
            encoded = base64.b64encode(part).decode()
            contents(
                server,
                "PUT",
                "project/data/big.txt",
                type="file",
                format="base64",
                content=encoded,
                chunk=chunk,
            )
        notebook = contents(server, "POST", "project", type="notebook")["path"]
        saved = contents(server, "GET", notebook)
        saved["content"]["cells"] = [
            {"cell_type": "code", "source": "1", "metadata": {}, "outputs": [], "execution_count": None}
        ]
        contents(server, "PUT", notebook, type="notebook", content=saved["content"])
        server.api("POST", f"/api/contents/{notebook}/checkpoints")
        made = [
            root / folder,
            project / "data",
            project / "data" / "sales.csv",
            project / "data" / "big.txt",
            root / notebook,
            project / ".ipynb_checkpoints",
            *(project / ".ipynb_checkpoints").iterdir(),
        ]
        owners = {path.name: (path.lstat().st_uid, path.lstat().st_gid) for path in made}
        assert owners == dict.fromkeys(owners, (SANDBOX_UID, SANDBOX_UID))

        session = server.api(
            "POST",
            "/api/sessions",
            json={"path": "project/analysis.ipynb", "type": "notebook", "kernel": {"name": KERNEL}},
        ).json()
        kernel_id = session["kernel"]["id"]
        try:
            new_folder, new_notebook = os.path.basename(folder), os.path.basename(notebook)
            steps = {
                "write in Lab's new folder": f"open({new_folder!r} + '/from-kernel.txt', 'w').write('k')",
                "append to an upload": "open('data/sales.csv', 'a').write('3,4\\n')",
                "append to a chunked upload": "open('data/big.txt', 'a').write(' more')",
                "rewrite Lab's notebook": (
                    f"import json; nb = json.load(open({new_notebook!r})); nb['metadata']['edited'] = 1\n"
                    f"json.dump(nb, open({new_notebook!r}, 'w'))"
                ),
                "remove its checkpoint": (
                    "import os; os.remove('.ipynb_checkpoints/' + os.listdir('.ipynb_checkpoints')[0])"
                ),
            }
            for step, code in steps.items():
                status, out = await execute_over_websocket(server, kernel_id, code + "\nprint('done')")
                assert (status, out) == ("ok", "done\n"), step
            # Sandboxed code may not make links (seccomp); the folder's owner may, on the host.
            status, out = await execute_over_websocket(server, kernel_id, "os.symlink('/etc/passwd', 'x')")
            assert status == "error"
        finally:
            server.api("DELETE", f"/api/sessions/{session['id']}")
        assert (root / folder / "from-kernel.txt").read_text() == "k"
        assert (project / "data" / "sales.csv").read_text() == "a,b\n1,2\n3,4\n"
        assert (project / "data" / "big.txt").read_text() == "head middle tail more"
        assert json.loads((root / notebook).read_text())["metadata"]["edited"] == 1

        # Lab saving where the folder's owner planted a link to a file of root's: refused.
        subprocess.run(["ln", "-s", str(secret), "planted.txt"], cwd=project, user=SANDBOX_UID, check=True)
        with pytest.raises(requests.HTTPError) as refused:
            contents(server, "PUT", "project/planted.txt", type="file", format="text", content="pwned")
        assert refused.value.response.status_code == 403
        with pytest.raises(requests.HTTPError):
            contents(server, "POST", "project", copy_from="project/planted.txt")
        assert secret.read_text() == "root's\n"
        assert sorted(path.name for path in project.iterdir()) == sorted(
            [
                os.path.basename(folder),
                "data",
                os.path.basename(notebook),
                "planted.txt",
                ".ipynb_checkpoints",
            ]
        )
    finally:
        stop_server(proc)


async def test_notebook_session_through_jupyter_server(jupyter_server: tuple[Server, Path]) -> None:
    server, root = jupyter_server
    folder = make_workspace(root / "project")
    (folder / "data.csv").write_text("a,b\n1,2\n")
    assert KERNEL in server.api("GET", "/api/kernelspecs").json()["kernelspecs"]
    session = server.api(
        "POST",
        "/api/sessions",
        json={"path": "project/analysis.ipynb", "type": "notebook", "kernel": {"name": KERNEL}},
    ).json()
    kernel_id = session["kernel"]["id"]
    try:
        status, out = await execute_over_websocket(
            server,
            kernel_id,
            "import os; print(os.uname().release, os.getcwd(), open('data.csv').read().split()[1])\n"
            "open('from-lab.txt', 'w').write('saved')",
        )
        assert status == "ok"
        # The server's root is the workspace, the notebook's folder the working folder.
        assert out.split() == ["4.4.0", "/workspace/project", "1,2"]
        assert (folder / "from-lab.txt").read_text() == "saved"

        server.api("POST", f"/api/kernels/{kernel_id}/restart")
        status, out = await execute_over_websocket(server, kernel_id, "print(os.getcwd())")
        assert status == "error", "a restarted kernel must not remember the old interpreter's names"
        status, out = await execute_over_websocket(server, kernel_id, "print(open('from-lab.txt').read())")
        assert (status, out) == ("ok", "saved\n")
    finally:
        server.api("DELETE", f"/api/sessions/{session['id']}")
    # The audit log names the user the server authenticated, beside the header's claim.
    log = Path(os.environ["JUPYTER_DATA_DIR"]) / "sandbox-kernel" / "audit.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    clients = {line["user"] for line in lines if line["event"] == "client"}
    executions = [line for line in lines if line["event"] == "finished" and line["kernel_id"] == kernel_id]
    assert clients  # (a token without a cookie: a fresh user per connection)
    assert len(executions) == 3
    for line in executions:
        assert line["username_claimed"] == "analyst"
        assert line["user_authenticated"] in clients
        assert line["user_authenticated"] != "analyst"


@pytest.mark.parametrize("command", SERVER_COMMANDS)
async def test_a_persistent_kernel_survives_its_server_and_the_notebook_reconnects(
    command: str, jupyter_dirs: Path, tmp_path: Path, make_kernelspec: Any, docker_client: docker.DockerClient
) -> None:
    """x = 42; ``jupyter <command>`` is killed (SIGKILL); a new one adopts the kernel:
    print(x) gives 42 in the notebook's same session. A clean stop lets go of it too."""
    name = make_kernelspec("py-persistent", config={"lifecycle": "persistent"})
    root, log = adopting_server_setup(tmp_path)
    port = free_port()  # a restarted server comes back on its port
    server, proc = start_server(root, log, port, command)
    session_id = kernel_id = ""
    try:
        session = server.api(
            "POST",
            "/api/sessions",
            json={"path": "project/analysis.ipynb", "type": "notebook", "kernel": {"name": name}},
        ).json()
        session_id, kernel_id = session["id"], session["kernel"]["id"]
        assert await execute_over_websocket(server, kernel_id, "x = 42") == ("ok", "")

        proc.kill()  # no cleanup at all
        proc.wait()
        label = {"label": f"{LABEL_KERNEL_ID}={kernel_id}"}
        (container,) = docker_client.containers.list(filters=label)
        assert container.status == "running"

        for stop in ("SIGKILL above", "clean stop"):
            server, proc = start_server(root, log, port, command)
            sessions = server.api("GET", "/api/sessions").json()
            assert [(s["id"], s["kernel"]["id"]) for s in sessions] == [(session_id, kernel_id)], stop
            assert await execute_over_websocket(server, kernel_id, "print(x)") == ("ok", "42\n"), stop
            assert f"Adopted persistent sandboxed kernel {kernel_id}" in log.read_text(), stop
            if stop == "SIGKILL above":
                stop_server(proc)  # SIGTERM: the server shuts down, the kernel stays
                container.reload()
                assert container.status == "running"

        server.api("DELETE", f"/api/sessions/{session_id}")
        assert (
            docker_client.containers.list(
                all=True, ignore_removed=True, filters={"label": f"{LABEL_KERNEL_ID}={kernel_id}"}
            )
            == []
        )
    finally:
        stop_server(proc)
        for leftover in await list_kernels(DockerBackend()):
            if leftover.kernel_id == kernel_id:
                await remove_kernel(DockerBackend(), leftover, None)


async def test_an_idle_kernel_pauses_under_jupyter_lab_and_the_notebook_resumes_it(
    jupyter_dirs: Path, tmp_path: Path, make_kernelspec: Any, docker_client: docker.DockerClient
) -> None:
    """``jupyter lab`` with pause_after: the idle kernel is saved to disk and stopped; the
    notebook's next cell resumes it (x = 42 is there), also after the server was killed
    and a new one adopted the paused kernel."""
    name = make_kernelspec("py-pausing", config={"lifecycle": "persistent", "pause_after": 2})
    root, log = adopting_server_setup(tmp_path)
    port = free_port()
    server, proc = start_server(root, log, port, "lab")
    session_id = kernel_id = ""

    def container_status() -> str:
        label = {"label": f"{LABEL_KERNEL_ID}={kernel_id}"}
        (container,) = docker_client.containers.list(all=True, filters=label)
        return str(container.status)

    def wait_paused() -> None:
        deadline = time.monotonic() + 60
        while container_status() != "exited":
            assert time.monotonic() < deadline, "the idle kernel was not paused within 60 s"
            time.sleep(0.3)
        assert server.api("GET", f"/api/kernels/{kernel_id}").json()["id"] == kernel_id

    try:
        session = server.api(
            "POST",
            "/api/sessions",
            json={"path": "project/analysis.ipynb", "type": "notebook", "kernel": {"name": name}},
        ).json()
        session_id, kernel_id = session["id"], session["kernel"]["id"]
        assert await execute_over_websocket(server, kernel_id, "x = 42") == ("ok", "")
        wait_paused()
        assert await execute_over_websocket(server, kernel_id, "print(x)") == ("ok", "42\n")
        assert container_status() == "running"

        wait_paused()
        proc.kill()  # the server dies while the kernel is paused
        proc.wait()
        server, proc = start_server(root, log, port, "lab")
        assert f"Adopted persistent sandboxed kernel {kernel_id}" in log.read_text()
        assert container_status() == "exited", "adopting a paused kernel does not resume it"
        assert await execute_over_websocket(server, kernel_id, "print(x)") == ("ok", "42\n")
        server.api("DELETE", f"/api/sessions/{session_id}")
        label = {"label": f"{LABEL_KERNEL_ID}={kernel_id}"}
        assert docker_client.containers.list(all=True, filters=label) == []
    finally:
        stop_server(proc)
        for kernel in await list_kernels(DockerBackend()):
            if kernel.kernel_id == kernel_id:
                await remove_kernel(DockerBackend(), kernel, None)
