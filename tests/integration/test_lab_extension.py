"""What an analyst sees in JupyterLab: the server's sandbox endpoint, asked of a real
``jupyter lab`` about real gVisor kernels, and the prebuilt extension installed with the package."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from .conftest import KERNEL, make_workspace
from .test_jupyter_server import Server, execute_over_websocket, start_server, stop_server

GiB = 1024**3


@pytest.fixture
def lab(jupyter_dirs: Path, tmp_path: Path) -> Iterator[Server]:
    """A real ``jupyter lab``; stopping it shuts its kernels down."""
    config_dir = Path(os.environ["JUPYTER_CONFIG_DIR"])
    config_dir.mkdir(parents=True, exist_ok=True)
    # Runaway kernels are killed 3 s after their wall-clock limit, not 10.
    (config_dir / "jupyter_server_config.json").write_text('{"SandboxProvisioner": {"exec_kill_grace": 3}}')
    root = make_workspace(tmp_path / "notebooks")
    server, proc = start_server(root, tmp_path / "server.log", command="lab")
    try:
        yield server
    finally:
        stop_server(proc)


def start_session(server: Server, kernel_name: str, path: str = "analysis.ipynb") -> str:
    """Open a notebook with ``kernel_name`` as JupyterLab does; the kernel's id."""
    session = server.api(
        "POST", "/api/sessions", json={"path": path, "type": "notebook", "kernel": {"name": kernel_name}}
    ).json()
    return str(session["kernel"]["id"])


def sandbox(server: Server, kernel_id: str) -> dict[str, Any]:
    return dict(server.api("GET", f"/api/sandbox-kernel/kernels/{kernel_id}").json())


def wait_for(
    server: Server, kernel_id: str, check: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    """Ask the endpoint, as the status bar does, until ``check`` holds; the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        answer = sandbox(server, kernel_id)
        if check(answer) or time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


def test_the_status_bar_learns_the_sandbox_policy_and_memory_of_a_kernel(
    lab: Server, make_kernelspec: Callable[..., str]
) -> None:
    limits = {"memory": "1g", "cpus": 0.5, "pids": 128, "tmp_size": "64m", "exec_timeout": 120.0}
    name = make_kernelspec("py-limited", config=limits)
    kernel_id = start_session(lab, name)

    answer = wait_for(lab, kernel_id, lambda a: a["memory"]["used"] is not None, timeout=10)
    assert answer["sandboxed"] is True
    assert answer["runtime"] == "gVisor"
    assert answer["image"] == "sandbox-kernel/python:latest"
    assert (answer["network"], answer["allowed_domains"]) == ("none", [])
    assert {key: answer["limits"][key] for key in limits} == limits
    assert answer["limits"]["idle_timeout"] == 0.0  # the server's default: none
    assert answer["memory"]["limit"] == GiB
    assert 0 < answer["memory"]["used"] < GiB
    assert answer["stopped"] is None


def test_unknown_kernels_are_404_and_strangers_get_nothing(lab: Server) -> None:
    kernel_id = start_session(lab, KERNEL)
    unknown = requests.get(
        f"{lab.url}/api/sandbox-kernel/kernels/{uuid.uuid4()}", headers=lab.headers, timeout=30
    )
    assert unknown.status_code == 404
    for headers in ({}, {"Authorization": "token wrong"}):
        url = f"{lab.url}/api/sandbox-kernel/kernels/{kernel_id}"
        response = requests.get(url, headers=headers, timeout=30)
        assert response.status_code in (401, 403)
        assert "gVisor" not in response.text


def test_a_kernel_outside_the_sandbox_says_so(lab: Server) -> None:
    assert "python3" in lab.api("GET", "/api/kernelspecs").json()["kernelspecs"]
    kernel_id = start_session(lab, "python3", "local.ipynb")
    assert sandbox(lab, kernel_id) == {"sandboxed": False}


async def test_a_kernel_killed_by_its_wall_clock_limit_is_reported_after_its_restart(
    lab: Server, make_kernelspec: Callable[..., str]
) -> None:
    """Jupyter restarts a killed kernel within seconds, before a status bar asking every
    few seconds may look: the stop stays on record, marked as history once the kernel runs again."""
    name = make_kernelspec("py-runaway", config={"exec_timeout": 2})
    kernel_id = start_session(lab, name)
    status, _ = await execute_over_websocket(
        lab,
        kernel_id,
        "import signal\n"
        "signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "while True:\n"
        "    pass",
    )
    assert status == "error"
    wait_for(lab, kernel_id, lambda a: a["stopped"] is not None and not a["stopped"]["current"], 60)
    deadline = time.monotonic() + 60
    while lab.api("GET", f"/api/kernels/{kernel_id}").json()["execution_state"] != "idle":
        assert time.monotonic() < deadline, "the killed kernel was not restarted"
        time.sleep(0.5)
    assert await execute_over_websocket(lab, kernel_id, "print('back')") == ("ok", "back\n")
    answer = sandbox(lab, kernel_id)
    stopped = answer["stopped"]
    assert stopped is not None, answer
    assert not stopped["current"], answer
    assert (stopped["ename"], stopped["limit"]) == ("WallClockLimitExceeded", "wall-clock")
    assert "wall-clock limit of 2 s per execution exceeded" in stopped["reason"]
    assert 0 <= stopped["age"] < 60
    assert answer["memory"]["used"] > 0, "the restarted kernel runs again"


def test_a_kernel_stopped_by_its_idle_limit_stays_reported_as_stopped(
    lab: Server, make_kernelspec: Callable[..., str]
) -> None:
    name = make_kernelspec("py-idle", config={"idle_timeout": 3})
    kernel_id = start_session(lab, name)
    answer = wait_for(lab, kernel_id, lambda a: a["stopped"] is not None, timeout=30)
    assert answer["stopped"] is not None, answer
    assert answer["stopped"]["ename"] == "IdleLimitExceeded"
    assert answer["stopped"]["limit"] == "idle"
    assert answer["stopped"]["current"] is True
    assert answer["memory"]["used"] is None  # nothing runs
    time.sleep(4)  # the kernel is not restarted: still stopped
    assert sandbox(lab, kernel_id)["stopped"]["current"] is True


def test_jupyterlab_loads_the_prebuilt_extension(lab: Server) -> None:
    page = lab.api("GET", "/lab").text
    config = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S)
    assert config is not None
    extensions = {e["name"]: e for e in json.loads(config.group(1))["federated_extensions"]}
    assert "sandbox-kernel" in extensions, "JupyterLab does not load the extension"
    script = lab.api("GET", f"/lab/extensions/sandbox-kernel/{extensions['sandbox-kernel']['load']}")
    assert "sandbox-kernel" in script.text


def test_the_extensions_are_installed_and_enabled(jupyter_dirs: Path) -> None:
    jupyter = str(Path(sys.executable).with_name("jupyter"))

    def listing(*command: str) -> str:
        done = subprocess.run([jupyter, *command], capture_output=True, text=True, check=True, timeout=120)
        return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)

    lab = listing("labextension", "list")
    assert re.search(r"sandbox-kernel v\S+ enabled OK \(python, sandbox-kernel\)", lab), lab
    server = listing("server", "extension", "list")
    assert "sandbox_kernel.jupyter.lab enabled" in server
    assert re.search(r"sandbox_kernel\.jupyter\.lab\s.*OK", server)
