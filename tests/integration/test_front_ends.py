"""Every way in gets the same sandbox, limits and audit (#21), each driven as its users drive it:

- a kernelspec's argv run directly, as VS Code, Zed, nteract and Emacs' jupyter do (they
  ignore provisioners): write a connection file, run the argv with ``python`` replaced by
  the interpreter, wait until the ports are in use, connect a ``BlockingKernelClient``;
- a plain ``KernelManager``, the session API, ``jupyter sandbox-kernel run`` and the MCP
  server, each under the administrator's config file only (nothing passed by the caller).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import docker
import nbformat
import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.connect import write_connection_file

from sandbox_kernel import SandboxSession
from sandbox_kernel.cli.resources import data_path
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID

from .conftest import KERNEL, SANDBOX_UID, HostState, KernelStarter, printing, run, shell_reply
from .test_mcp import mcp_server
from .test_mcp import run as mcp_run

pytestmark = pytest.mark.integration

SK = Path(sys.executable).with_name("jupyter-sandbox-kernel")
#: What every kernel below must show: the administrator's file, not the kernelspec's default.
ADMIN = {"memory": "768m", "exec_timeout": 30, "max_exec_timeout": 60, "max_memory": "1g"}
INSIDE = (
    "import json, os, platform, resource\n"
    "policy = json.loads(os.environ['SANDBOX_KERNEL_POLICY'])\n"
    "print(json.dumps({'release': platform.release(), 'uid': os.getuid(), 'memory': policy['memory'],"
    " 'exec_timeout': policy['exec_timeout'], 'nproc': resource.getrlimit(resource.RLIMIT_NPROC)[0],"
    " 'host_file': os.path.exists(HOST_FILE)}))"
)


@pytest.fixture
def central_log(jupyter_dirs: Path, tmp_path: Path) -> Path:
    """The administrator's config file (JUPYTER_CONFIG_DIR): a tighter policy, a central audit log."""
    log = tmp_path / "audit" / "central.log"
    log.parent.mkdir()
    config_dir = Path(os.environ["JUPYTER_CONFIG_DIR"])
    config_dir.mkdir(parents=True, exist_ok=True)
    settings = {**ADMIN, "audit_log": str(log)}
    (config_dir / "jupyter_server_config.json").write_text(json.dumps({"SandboxProvisioner": settings}))
    return log


@pytest.fixture
def host_file(tmp_path: Path) -> Path:
    """A file only the host has: no kernel may see it."""
    path = tmp_path / "host-secret.txt"
    path.write_text("host only")
    return path


def inside(host_file: Path) -> str:
    return f"HOST_FILE = {str(host_file)!r}\n{INSIDE}"


def assert_sandboxed(seen: dict[str, Any], pids: int = 256) -> None:
    assert seen["release"] == "4.4.0", "not gVisor's kernel: this ran on the host"
    assert seen["uid"] == SANDBOX_UID
    assert (seen["memory"], seen["exec_timeout"]) == (ADMIN["memory"], ADMIN["exec_timeout"])
    assert seen["nproc"] == pids
    assert not seen["host_file"]


def audited(log: Path, marker: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [line for line in lines if marker in str(line.get("code", ""))]


def install_shipped(jupyter_dirs: Path, name: str) -> dict[str, Any]:
    folder = jupyter_dirs / "kernels" / name
    if not folder.exists():
        shutil.copytree(data_path("kernelspecs") / name, folder)
    spec: dict[str, Any] = json.loads((folder / "kernel.json").read_text())
    return spec


def port_in_use(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


@contextmanager
def launched_directly(
    argv: list[str], cwd: Path, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], BlockingKernelClient, Path]]:
    """A kernelspec's argv run as VS Code runs it: (the process, a ready client, its stderr)."""
    connection_file, info = write_connection_file(str(tmp_path / f"kernel-{time.monotonic_ns()}.json"))
    command = [
        sys.executable if arg == "python" else arg.replace("{connection_file}", connection_file)
        for arg in argv
    ]
    stderr = tmp_path / f"launcher-{time.monotonic_ns()}.err"
    with stderr.open("wb") as err:
        # A group of its own, as front ends start kernels: the test may signal that group.
        process = subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    kc = BlockingKernelClient()
    try:
        deadline = time.monotonic() + 120
        while not port_in_use(info["shell_port"]):  # as VS Code waits for the kernel's ports
            assert process.poll() is None, f"the launcher exited ({process.returncode}): {stderr.read_text()}"
            assert time.monotonic() < deadline, f"no kernel on the ports: {stderr.read_text()}"
            time.sleep(0.1)
        kc.load_connection_file(connection_file)
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        yield process, kc, stderr
    finally:
        kc.stop_channels()
        if process.poll() is None:
            process.terminate()
            process.wait(60)


def kernel_id(stderr: Path) -> str:
    """The kernel id the launcher reported on its stderr."""
    for line in stderr.read_text().splitlines():
        if line.startswith("sandbox-kernel: kernel ") and "is running in gVisor" in line:
            return line.split()[2]
    raise AssertionError(f"the launcher did not say which kernel it runs: {stderr.read_text()}")


def containers_of(client: docker.DockerClient, kernel: str) -> list[Any]:
    return client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"{LABEL_KERNEL_ID}={kernel}"}
    )


def wait_for_no_leftovers(before: HostState, kernel: str = "", timeout: float = 60) -> list[str]:
    """What the launcher's kernel left once it is gone: its container (even while a live
    process, its worker, claims it) and whatever else appeared since ``before``."""
    deadline = time.monotonic() + timeout
    while True:
        left = [f"container {c.name}" for c in containers_of(before.client, kernel)] if kernel else []
        left += before.new_leftovers(settle=1)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


# ---------------------------------------------------------------------- run directly


#: Every kernelspec the package ships (its folder also holds the script that draws their logos).
SHIPPED = sorted(spec.parent.name for spec in data_path("kernelspecs").glob("*/kernel.json"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_kernelspec_run_directly_is_sandboxed_with_the_admins_policy_and_audit(
    name: str,
    jupyter_dirs: Path,
    central_log: Path,
    workspace: Path,
    host_file: Path,
    tmp_path: Path,
    docker_client: docker.DockerClient,
) -> None:
    """The attack: "Sandboxed Python" run by a front end that ignores provisioners was a
    host kernel (host release, uid 0, host files). Now: gVisor, the sandbox uid, the
    administrator's limits, the central audit log."""
    before = HostState(docker_client)
    spec = install_shipped(jupyter_dirs, name)
    with launched_directly(spec["argv"], workspace, tmp_path) as (process, kc, stderr):
        kernel = kernel_id(stderr)
        result = run(kc, inside(host_file) + "\n# marker-" + name, timeout=60)
        assert result.status == "ok", result.outputs
        assert_sandboxed(json.loads(result.stdout))
        assert audited(central_log, "marker-" + name), "the launcher's kernel is not in the central audit log"
    assert process.returncode == 0
    assert wait_for_no_leftovers(before, kernel) == []


def test_the_launcher_interrupts_restarts_by_relaunch_and_shuts_down_as_a_local_kernel(
    jupyter_dirs: Path, central_log: Path, workspace: Path, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    argv = install_shipped(jupyter_dirs, KERNEL)["argv"]
    with launched_directly(argv, workspace, tmp_path) as (process, kc, stderr):
        kernel = kernel_id(stderr)
        assert run(kc, "x = 41").status == "ok"
        # interrupt_mode "signal": the front end sends SIGINT to the process it started.
        msg_id = kc.execute("import time; print('started', flush=True); time.sleep(60)")
        printing(kc, msg_id)
        process.send_signal(signal.SIGINT)
        reply = shell_reply(kc, timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert run(kc, "print(x + 1)").stdout == "42\n"  # the kernel kept its state
        # The front end's shutdown: a shutdown_request; the launcher ends with the kernel.
        kc.shutdown()
        assert process.wait(60) == 0
    assert wait_for_no_leftovers(before, kernel) == []
    # A restart is a relaunch: a fresh sandboxed kernel on a new connection file.
    with launched_directly(argv, workspace, tmp_path) as (_, kc, stderr):
        assert kernel_id(stderr) != kernel
        assert run(kc, "print('x' in dir())").stdout == "False\n"
    assert wait_for_no_leftovers(before, kernel_id(stderr)) == []


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGKILL to its process group"])
def test_a_killed_launcher_leaves_nothing_behind(
    how: str, jupyter_dirs: Path, workspace: Path, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    argv = install_shipped(jupyter_dirs, KERNEL)["argv"]
    with launched_directly(argv, workspace, tmp_path) as (process, kc, stderr):
        assert run(kc, "print(1)").stdout == "1\n"
        kernel = kernel_id(stderr)
        assert len(containers_of(docker_client, kernel)) == 1
        if how == "SIGTERM":
            process.terminate()
        elif how == "SIGKILL":
            process.kill()
        else:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(60)
    assert wait_for_no_leftovers(before, kernel) == []


def test_a_launcher_naming_a_kernelspec_that_runs_on_the_host_refuses(
    jupyter_dirs: Path, workspace: Path, tmp_path: Path
) -> None:
    """A user-level kernelspec with the launcher's argv but no sandbox: never a host kernel."""
    folder = jupyter_dirs / "kernels" / "hostpy"
    folder.mkdir(exist_ok=True)
    argv = ["python", "-m", "sandbox_kernel.launch", "--kernel", "hostpy", "-f", "{connection_file}"]
    (folder / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "Host", "language": "python"})
    )
    connection_file, info = write_connection_file(str(tmp_path / "k.json"))
    command = [sys.executable, *argv[1:-1], connection_file]
    done = subprocess.run(command, cwd=workspace, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Kernelspec 'hostpy' (Host) does not run its kernels in the sandbox" in done.stderr
    assert "Traceback" not in done.stderr
    assert not port_in_use(info["shell_port"])


# ---------------------------------------------------------------------- every other way in


def test_a_plain_kernel_manager_gets_the_admins_policy_and_audit(
    start_kernel: KernelStarter, central_log: Path, host_file: Path
) -> None:
    _, kc = start_kernel()
    result = run(kc, inside(host_file) + "\n# marker-km")
    assert_sandboxed(json.loads(result.stdout))
    assert audited(central_log, "marker-km")


def test_the_session_api_gets_the_admins_policy_and_audit(
    jupyter_dirs: Path, central_log: Path, workspace: Path, host_file: Path
) -> None:
    with SandboxSession(KERNEL, cwd=workspace) as sandbox:
        result = sandbox.run(inside(host_file) + "\n# marker-session")
    assert result.error is None, result.error
    assert_sandboxed(json.loads(result.stdout))
    assert audited(central_log, "marker-session")


def test_the_session_api_refuses_a_host_kernelspec(jupyter_dirs: Path, workspace: Path) -> None:
    from sandbox_kernel.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"'python3'.*does not run its kernels in the sandbox"):
        SandboxSession("python3", cwd=workspace).start()


def test_run_gets_the_admins_policy_and_audit(
    jupyter_dirs: Path, central_log: Path, workspace: Path, host_file: Path
) -> None:
    notebook = workspace / "n.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(inside(host_file) + "\n# marker-run")])
    nbformat.write(nb, notebook)
    done = subprocess.run([str(SK), "run", str(notebook)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("{"))
    assert_sandboxed(json.loads(line))
    assert audited(central_log, "marker-run")


def test_mcp_gets_the_admins_policy_and_audit(
    jupyter_dirs: Path, central_log: Path, workspace: Path, host_file: Path
) -> None:
    async def scenario() -> dict[str, Any]:
        async with mcp_server(workspace) as session:
            return await mcp_run(session, inside(host_file) + "\n# marker-mcp")

    result = asyncio.run(scenario())
    assert_sandboxed(json.loads(result["stdout"]))
    assert audited(central_log, "marker-mcp")
