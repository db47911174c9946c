"""Which host folder a kernel works in, and as whom, as an analyst meets it: a real
``jupyter server`` running as root over folders that other accounts made, a
``notebooks/`` + ``data/`` layout, a root-owned folder, and the attacks on the choice:
another local user's folder around or above alice's, a link of someone else's."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from .conftest import KERNEL, KernelStarter, make_workspace, run
from .test_jupyter_server import Server, start_server, stop_server

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.getuid() != 0, reason="a root server's concern: needs useradd and chown"),
]


@pytest.fixture
def local_user() -> Iterator[Callable[[], tuple[int, int]]]:
    """Make host accounts, as `useradd` does for a new analyst: ``(uid, gid)`` each;
    they are deleted afterwards."""
    made: list[str] = []

    def make() -> tuple[int, int]:
        name = f"sk-ws-{secrets.token_hex(3)}"
        subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
        )
        made.append(name)
        ids = subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True).stdout
        gid = subprocess.run(["id", "-g", name], capture_output=True, text=True, check=True).stdout
        return int(ids), int(gid)

    yield make
    for name in made:
        subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", name], check=False, stderr=subprocess.DEVNULL)


def owned(path: Path, ids: tuple[int, int], *files: tuple[str, str]) -> Path:
    """``path`` and its ``files`` (name, text), all belonging to ``ids``, as that account makes them."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, *ids)
    for name, text in files:
        (path / name).write_text(text)
        os.chown(path / name, *ids)
    return path


@pytest.fixture
def root_server(jupyter_dirs: Path, tmp_path: Path) -> Iterator[Callable[[Path], Server]]:
    """A `jupyter server` running as root (as the README's setup runs it) over a folder."""
    procs: list[subprocess.Popen[bytes]] = []

    def serve(root: Path) -> Server:
        server, proc = start_server(root, tmp_path / "server.log")
        procs.append(proc)
        return server

    yield serve
    for proc in procs:
        stop_server(proc)


def open_notebook(server: Server, path: str) -> requests.Response:
    """What JupyterLab asks when a notebook is opened with the sandboxed kernel."""
    return requests.post(
        f"{server.url}/api/sessions",
        headers=server.headers,
        json={"path": path, "type": "notebook", "kernel": {"name": KERNEL}},
        timeout=120,
    )


async def execute(server: Server, kernel_id: str, code: str) -> dict[str, Any]:
    """Run ``code`` over the kernel's websocket as JupyterLab does: status, stdout, error."""
    conn = await websocket_connect(
        HTTPRequest(
            server.url.replace("http", "ws") + f"/api/kernels/{kernel_id}/channels", headers=server.headers
        )
    )
    msg_id = uuid.uuid4().hex
    header = {"msg_id": msg_id, "msg_type": "execute_request", "username": "analyst", "session": msg_id}
    content = {
        "code": code,
        "silent": False,
        "store_history": True,
        "user_expressions": {},
        "allow_stdin": False,
    }
    conn.write_message(
        json.dumps(
            {
                "header": {**header, "version": "5.3", "date": ""},
                "parent_header": {},
                "metadata": {},
                "channel": "shell",
                "content": {**content, "stop_on_error": True},
            }
        )
    )
    result: dict[str, Any] = {"status": None, "stdout": "", "error": None}
    idle = False
    deadline = time.monotonic() + 90
    while (result["status"] is None or not idle) and time.monotonic() < deadline:
        raw = await conn.read_message()
        assert raw is not None, "the server closed the kernel websocket"
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream" and msg["content"]["name"] == "stdout":
            result["stdout"] += msg["content"]["text"]
        elif kind == "error":
            result["error"] = msg["content"]
        elif kind == "execute_reply":
            result["status"] = msg["content"]["status"]
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    conn.close()
    assert result["status"] is not None, "no execute_reply within 90 s"
    return result


async def test_a_notebooks_and_data_layout_made_by_an_analyst_works_under_a_root_server(
    local_user: Callable[[], tuple[int, int]], root_server: Callable[[Path], Server], tmp_path: Path
) -> None:
    """read_csv('../data/x.csv') from notebooks/ finds the file; the kernel runs as the
    analyst who made the folders, and what it writes is theirs."""
    analyst = local_user()
    lab = owned(tmp_path / "lab", analyst)
    owned(lab / "notebooks", analyst)
    owned(lab / "data", analyst, ("sales.csv", "region,revenue\nnorth,10\nsouth,20\n"))
    server = root_server(lab)
    response = open_notebook(server, "notebooks/analysis.ipynb")
    assert response.status_code == 201, response.text
    session = response.json()
    try:
        kernel_id = session["kernel"]["id"]
        out = await execute(
            server,
            kernel_id,
            "import os, pandas as pd\n"
            "df = pd.read_csv('../data/sales.csv')\n"
            "os.makedirs('../results', exist_ok=True)\n"
            "df.groupby('region').sum().to_csv('../results/summary.csv')\n"
            "print(os.getcwd(), os.getuid(), os.getgid(), int(df.revenue.sum()))",
        )
        assert out["status"] == "ok", out
        assert out["stdout"].split() == ["/workspace/notebooks", str(analyst[0]), str(analyst[1]), "30"]
        summary = lab / "results" / "summary.csv"
        assert summary.read_text().splitlines()[1:] == ["north,10", "south,20"]
        assert {(p.stat().st_uid, p.stat().st_gid) for p in (summary, summary.parent)} == {analyst}

        # A path that is not in the sandbox says why, instead of a bare FileNotFoundError.
        out = await execute(server, kernel_id, "import pandas as pd\npd.read_csv('/home/analyst/sales.csv')")
        assert out["status"] == "error"
        assert out["error"]["ename"] == "FileNotFoundError"
        assert out["error"]["evalue"] == (
            "[Errno 2] No such file or directory: '/home/analyst/sales.csv' (outside /workspace, the only "
            "host folder this sandboxed kernel sees; copy the file into the workspace)"
        )
    finally:
        requests.delete(f"{server.url}/api/sessions/{session['id']}", headers=server.headers, timeout=60)


async def test_attack_alice_s_kernel_sees_nothing_of_bob_s_around_her_folder(
    local_user: Callable[[], tuple[int, int]], root_server: Callable[[Path], Server], tmp_path: Path
) -> None:
    """A root server over bob's folder, in which alice has hers: her kernel runs as alice
    with her folder alone mounted, never bob's tree (nor as bob)."""
    alice, bob = local_user(), local_user()
    lab = owned(tmp_path / "lab", bob, ("bob-secret.txt", "bob's"))
    owned(lab / "bob-project", bob, ("plan.txt", "bob's plan"))
    owned(lab / "alice", alice, ("mine.txt", "alice's"))
    server = root_server(lab)
    response = open_notebook(server, "alice/analysis.ipynb")
    assert response.status_code == 201, response.text
    session = response.json()
    try:
        out = await execute(
            server,
            session["kernel"]["id"],
            "import os\n"
            "print(os.getuid(), os.getcwd(), sorted(os.listdir('/workspace')))\n"
            "for path in ['../bob-secret.txt', '/workspace/../bob-project/plan.txt']:\n"
            "    print(os.path.exists(path))",
        )
        assert out["status"] == "ok", out
        assert out["stdout"].split("\n")[:3] == [f"{alice[0]} /workspace ['mine.txt']", "False", "False"]
    finally:
        requests.delete(f"{server.url}/api/sessions/{session['id']}", headers=server.headers, timeout=60)


def test_attack_a_link_of_someone_else_s_to_the_server_root_is_not_followed(
    local_user: Callable[[], tuple[int, int]], root_server: Callable[[Path], Server], tmp_path: Path
) -> None:
    """bob's link to alice's lab, given to a root server as its root: the kernel would run
    as alice in a folder bob chose; it is refused, saying which link."""
    alice, bob = local_user(), local_user()
    lab = owned(tmp_path / "alice-lab", alice)
    owned(lab / "notebooks", alice)
    link = tmp_path / "bobs-link"
    link.symlink_to(lab)
    os.lchown(link, *bob)
    server = root_server(link)
    response = open_notebook(server, "notebooks/analysis.ipynb")
    assert response.status_code == 500
    message = response.json()["message"]
    assert f"through the link {str(link)!r}, owned by uid {bob[0]}" in message, message


def test_a_root_owned_folder_is_refused_in_one_whole_line_saying_what_to_run(
    local_user: Callable[[], tuple[int, int]], root_server: Callable[[Path], Server], tmp_path: Path
) -> None:
    """The first start in a folder root made (a root `git clone` in alice's home, say):
    JupyterLab showed the error cut at 'mode drwxr' (its dialog is about 110 characters
    wide). The line now starts with what to run, naming whom to give the folder to."""
    alice = local_user()
    home = owned(tmp_path / "alice-home", alice)
    project = home / "project"
    (project / "notebooks").mkdir(parents=True)
    server = root_server(project)
    response = open_notebook(server, "notebooks/analysis.ipynb")
    assert response.status_code == 500
    message = response.json()["message"]
    assert "\n" not in message
    user = subprocess.run(
        ["id", "-nu", str(alice[0])], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert message == (
        f"Run `chown -R {user}: {project}` first ({user} owns {home}): the folder is root's, and a "
        "sandboxed kernel never runs as root."
    )

    # Doing what it says is all it takes.
    subprocess.run(["chown", "-R", f"{user}:", str(project)], check=True)
    response = open_notebook(server, "notebooks/analysis.ipynb")
    assert response.status_code == 201, response.text
    requests.delete(f"{server.url}/api/sessions/{response.json()['id']}", headers=server.headers, timeout=60)


def test_a_path_outside_the_workspace_says_why_it_is_missing(
    start_kernel: KernelStarter, workspace: Path
) -> None:
    """Without a server the notebook's folder alone is the workspace: ../data is not there."""
    notebooks = make_workspace(workspace)
    _, kc = start_kernel(cwd=notebooks)
    result = run(kc, "open('../data/x.csv')")
    (error,) = [o for o in result.outputs if o["type"] == "error"]
    assert error["evalue"] == (
        "[Errno 2] No such file or directory: '../data/x.csv' ('/data/x.csv': outside /workspace, the only "
        "host folder this sandboxed kernel sees; copy the file into the workspace)"
    )
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error["traceback"]))
    assert "open('../data/x.csv')" in shown, "the traceback stays"
    # What is missing inside the workspace or /tmp is just missing.
    result = run(kc, "open('nope.csv')")
    (error,) = [o for o in result.outputs if o["type"] == "error"]
    assert error["evalue"] == "[Errno 2] No such file or directory: 'nope.csv'"
