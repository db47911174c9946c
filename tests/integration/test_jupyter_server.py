"""The JupyterLab path: a real ``jupyter server`` process, its REST API and kernel websocket."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
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

from sandbox_kernel.docker_backend import DockerBackend
from sandbox_kernel.ownership import list_kernels, remove_kernel
from sandbox_kernel.sandbox_spec import LABEL_KERNEL_ID

from .conftest import KERNEL, make_workspace


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
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
