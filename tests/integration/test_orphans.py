"""A server or program killed with SIGKILL leaves kernels behind; they are found and removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import docker
import pytest

from sandbox_kernel.cli.app import SandboxKernelApp
from sandbox_kernel.kernel import launching
from sandbox_kernel.lifecycle import ownership
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID

from .conftest import KERNEL, HostState, KernelStarter, run_ok
from .test_pause import pause_and_leave

SERVER = """
import sys, jupyter_client
km = jupyter_client.KernelManager(kernel_name={kernel!r})
km.start_kernel(cwd={cwd!r})
print(km.kernel_id, km.provisioner.runtime_dir, flush=True)
sys.stdin.read()  # until killed
"""

#: A program using plain jupyter_client: its kernel spins in a cell when it is killed.
SPINNING_PROGRAM = """
import sys, jupyter_client
km = jupyter_client.KernelManager(kernel_name={kernel!r})
km.start_kernel(cwd={cwd!r})
kc = km.client()
kc.start_channels()
kc.wait_for_ready(timeout=60)
msg_id = kc.execute("while True: pass")
while True:  # until the kernel is busy with the cell
    msg = kc.get_iopub_msg(timeout=60)
    if msg["parent_header"].get("msg_id") == msg_id and msg["content"].get("execution_state") == "busy":
        break
print(km.kernel_id, km.provisioner.runtime_dir, flush=True)
sys.stdin.read()  # until killed
"""


def start_doomed_server(
    workspace: Path, kernel: str = KERNEL, script: str = SERVER
) -> tuple[subprocess.Popen[str], str, Path]:
    """A 'server' process that starts a sandboxed kernel and is then SIGKILLed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script.format(kernel=kernel, cwd=str(workspace))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert proc.stdout is not None
    kernel_id, runtime_dir = proc.stdout.readline().split()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    return proc, kernel_id, Path(runtime_dir)


def cli(*argv: str) -> None:
    """``jupyter sandbox-kernel ARGV``, in-process (subcommands are singletons: reset them)."""
    SandboxKernelApp.clear_instances()
    app = SandboxKernelApp()
    app.initialize(list(argv))
    app.start()


def test_prune_removes_what_a_killed_server_left(
    jupyter_dirs: Path,
    workspace: Path,
    docker_client: docker.DockerClient,
    capsys: pytest.CaptureFixture[str],
    start_kernel: KernelStarter,
) -> None:
    _, live_kc = start_kernel()  # a kernel of a running server: never touched
    before = HostState(docker_client)
    _, kernel_id, runtime_dir = start_doomed_server(workspace)
    assert runtime_dir.is_dir()
    cli("list", "--json")
    listed = {k["kernel_id"]: k for k in json.loads(capsys.readouterr().out)}
    assert listed[kernel_id]["orphaned"] is True
    assert listed[kernel_id]["workspace"] == str(workspace)
    assert [k for k in listed.values() if k["orphaned"] is False], "the live kernel is listed too"

    cli("prune")
    assert f"Removed kernel {kernel_id} (container " in (out := capsys.readouterr().out)
    assert ": server " in out
    assert " is gone" in out
    assert not runtime_dir.exists()
    assert before.new_leftovers() == []
    assert run_ok(live_kc, "print('untouched')").strip() == "untouched"


def test_the_next_server_start_sweeps_orphans(
    jupyter_dirs: Path,
    workspace: Path,
    docker_client: docker.DockerClient,
    monkeypatch: pytest.MonkeyPatch,
    start_kernel: KernelStarter,
    make_kernelspec: Callable[..., str],
) -> None:
    """A server SIGKILLed mid-session: the next start removes its ephemeral kernel with
    its files, and leaves its persistent one running, as designed."""
    before = HostState(docker_client)
    _, kernel_id, runtime_dir = start_doomed_server(workspace)
    persistent = make_kernelspec("py-lasting", config={"lifecycle": "persistent"})
    _, lasting_id, lasting_dir = start_doomed_server(workspace, persistent)
    monkeypatch.setattr(launching, "_swept_orphans", False)  # as in a fresh server process
    start_kernel()
    deadline = time.monotonic() + 60
    while runtime_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not runtime_dir.exists()
    gone = docker_client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"io.sandbox-kernel.kernel-id={kernel_id}"}
    )
    assert gone == []
    leftovers = before.new_leftovers(settle=0)  # the kernel this test started is still running
    assert not [x for x in leftovers if kernel_id in x or runtime_dir.name in x], leftovers
    (lasting,) = docker_client.containers.list(filters={"label": f"io.sandbox-kernel.kernel-id={lasting_id}"})
    assert lasting.status == "running"
    assert (lasting_dir / "provisioner.json").is_file()
    cli("stop", lasting_id)
    assert not lasting_dir.exists()


def test_stop_removes_a_kernel_by_id(
    start_kernel: KernelStarter, docker_client: docker.DockerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    km, _ = start_kernel()
    cli("stop", km.kernel_id[:8])
    assert f"Stopped {km.kernel_id}" in capsys.readouterr().out
    assert (
        docker_client.containers.list(
            all=True, ignore_removed=True, filters={"label": f"io.sandbox-kernel.kernel-id={km.kernel_id}"}
        )
        == []
    )


def test_a_live_process_reaps_the_spinning_kernel_of_a_killed_program(
    jupyter_dirs: Path,
    workspace: Path,
    docker_client: docker.DockerClient,
    monkeypatch: pytest.MonkeyPatch,
    start_kernel: KernelStarter,
    make_kernelspec: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue #8: a jupyter_client program SIGKILLed mid-cell leaves its kernel spinning.
    Any live process with a sandboxed kernel of its own removes it within the reap
    interval, without waiting for a kernel start or a `prune`; a persistent kernel within
    its time-to-live is left alone."""
    interval = 3.0
    monkeypatch.setattr(ownership, "REAP_INTERVAL", interval)
    lasting_spec = make_kernelspec(
        "py-lasting-ttl", config={"lifecycle": "persistent", "persistent_ttl": 3600}
    )
    _, lasting_id, lasting_dir = start_doomed_server(workspace, lasting_spec)
    try:
        _, live_kc = start_kernel()  # this process now watches a kernel of its own

        _, kernel_id, runtime_dir = start_doomed_server(workspace, script=SPINNING_PROGRAM)
        killed = time.monotonic()
        label = {"label": f"io.sandbox-kernel.kernel-id={kernel_id}"}
        (orphan,) = docker_client.containers.list(all=True, ignore_removed=True, filters=label)
        assert orphan.status == "running"
        while time.monotonic() < killed + 90 and (
            docker_client.containers.list(all=True, ignore_removed=True, filters=label)
            or runtime_dir.exists()
        ):
            time.sleep(0.5)
        took = time.monotonic() - killed
        assert docker_client.containers.list(all=True, ignore_removed=True, filters=label) == [], (
            "the orphan still spins"
        )
        assert not runtime_dir.exists()
        # (Removing a spinning sandbox takes a busy machine a while: the bound is for a reaper
        # that waited for something else, a kernel start or a prune, which never came.)
        assert took < interval + 45, f"removed only after {took:.0f} s"
        assert f"Removing orphaned kernel {kernel_id} (container " in caplog.text, "this process reaped it"

        (lasting,) = docker_client.containers.list(
            filters={"label": f"io.sandbox-kernel.kernel-id={lasting_id}"}
        )
        assert lasting.status == "running"
        assert (lasting_dir / "provisioner.json").is_file()
        assert run_ok(live_kc, "print('untouched')").strip() == "untouched"
    finally:
        cli("stop", lasting_id)
    assert not lasting_dir.exists()


def test_prune_still_removes_the_provably_abandoned_with_their_memory(
    jupyter_dirs: Path,
    workspace: Path,
    tmp_path: Path,
    docker_client: docker.DockerClient,
    capsys: pytest.CaptureFixture[str],
    make_kernelspec: Callable[..., str],
) -> None:
    """What no judge may take for abandoned (a paused persistent kernel, see test_pause)
    does not shield what is: an ephemeral kernel paused by a program that then died is an
    orphan, removed with its memory image; a persistent kernel whose container stopped
    with no image of it while no server held it is abandoned."""
    before = HostState(docker_client)
    persistent = make_kernelspec("py-lasting-stopped", config={"lifecycle": "persistent"})
    _, stopped_id, stopped_dir = start_doomed_server(workspace, persistent)
    # (Its first kernel start sweeps too: the persistent kernel is still running then.)
    paused_id = pause_and_leave(tmp_path, KERNEL, workspace)
    (paused,) = docker_client.containers.list(all=True, filters={"label": f"{LABEL_KERNEL_ID}={paused_id}"})
    assert paused.status == "exited"
    container_folder = Path("/var/lib/docker/containers", paused.id)
    (stopped,) = docker_client.containers.list(filters={"label": f"{LABEL_KERNEL_ID}={stopped_id}"})
    stopped.kill()  # its sandbox ended with no server, and nothing of its memory was saved
    stopped.wait(timeout=30)
    cli("list", "--json")
    listed = {k["kernel_id"]: k for k in json.loads(capsys.readouterr().out)}
    assert (listed[paused_id]["status"], listed[paused_id]["paused"]) == ("orphaned", True)
    assert (listed[stopped_id]["status"], listed[stopped_id]["checkpoints"]) == ("exited, abandoned", [])

    cli("prune")

    out = capsys.readouterr().out
    assert f"Removed kernel {paused_id} (container " in out
    assert f"Removed kernel {stopped_id} (container " in out
    for kernel_id in (paused_id, stopped_id):
        label = {"label": f"{LABEL_KERNEL_ID}={kernel_id}"}
        assert docker_client.containers.list(all=True, ignore_removed=True, filters=label) == []
    if os.getuid() == 0:
        assert not container_folder.exists(), "the orphan's memory image went with it"
    assert not stopped_dir.exists()
    assert before.new_leftovers() == []
