"""Interrupt, restart, auto-restart, shutdown and input, as a Jupyter client sees them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest
import zmq
from jupyter_client import AsyncKernelManager
from jupyter_client.provisioning import KernelProvisionerFactory

from sandbox_kernel.kernel import launching
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID
from tests.executions import until_idle

from .conftest import (
    KERNEL,
    HostState,
    KernelStarter,
    printing,
    restarting_kernel,
    run,
    run_ok,
    shell_reply,
    wait_for_restart,
)


def kernel_containers(client: docker.DockerClient, kernel_id: str) -> list[str]:
    found = client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"{LABEL_KERNEL_ID}={kernel_id}"}
    )
    return [c.id for c in found]


def test_interrupt_stops_a_busy_cell_and_keeps_state(start_kernel: KernelStarter) -> None:
    km, kc = start_kernel()
    run_ok(kc, "x = 41")
    msg_id = kc.execute("print('started', flush=True)\nwhile True: pass")
    printing(kc, msg_id)
    sent = time.monotonic()
    km.interrupt_kernel()
    reply = shell_reply(kc, 30)
    elapsed = time.monotonic() - sent
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    # Delivered promptly, not hung (a busy machine may take seconds).
    assert elapsed < 10, f"interrupt took {elapsed:.2f} s"
    until_idle(kc, msg_id)
    assert run_ok(kc, "print(x + 1)").strip() == "42"


def test_restart_gives_fresh_interpreter_same_workspace_no_old_container(
    start_kernel: KernelStarter, workspace: Path, docker_client: docker.DockerClient
) -> None:
    km, kc = start_kernel()
    run_ok(kc, "x = 1\nopen('kept.txt', 'w').write('survives restarts')")
    before = kernel_containers(docker_client, km.kernel_id)
    km.restart_kernel(now=False)
    kc.wait_for_ready(timeout=60)  # the same client keeps working: ports are stable
    after = kernel_containers(docker_client, km.kernel_id)
    assert len(before) == len(after) == 1
    assert before != after, "restart must replace the container"
    result = run(kc, "x")
    assert result.status == "error"
    assert result.reply["content"]["ename"] == "NameError"
    assert run_ok(kc, "print(open('kept.txt').read())").strip() == "survives restarts"
    assert (workspace / "kept.txt").read_text() == "survives restarts"


def test_input_reaches_the_client(start_kernel: KernelStarter) -> None:
    _, kc = start_kernel()
    prompts: list[str] = []

    def answer(msg: dict) -> None:
        prompts.append(msg["content"]["prompt"])
        kc.input("Ada")

    result = run(kc, "name = input('name? ')\nprint('hello', name)", allow_stdin=True, stdin_hook=answer)
    assert result.status == "ok"
    assert prompts == ["name? "]
    assert result.stdout.strip() == "hello Ada"


def test_shutdown_leaves_nothing_behind(
    start_kernel: KernelStarter, docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    km, kc = start_kernel()
    runtime_dir = km.provisioner.runtime_dir
    assert runtime_dir is not None
    assert runtime_dir.is_dir()
    assert kernel_containers(docker_client, km.kernel_id)
    kc.stop_channels()
    km.shutdown_kernel()
    assert kernel_containers(docker_client, km.kernel_id) == []
    assert not runtime_dir.exists()
    assert before.new_leftovers() == []
    assert not os.path.exists(km.connection_file)


async def test_dead_container_is_auto_restarted(jupyter_dirs: Path, workspace: Path) -> None:
    client = docker.from_env()
    async with restarting_kernel(workspace) as (km, kc, restarts):
        (first,) = kernel_containers(client, km.kernel_id)
        client.containers.get(first).kill()  # from outside, as an OOM killer or admin would
        await wait_for_restart(km, restarts, 90, "jupyter_client's restarter did not notice the dead kernel")
        await kc.wait_for_ready(timeout=60)
        reply = await kc.execute_interactive("import os; print(os.uname().release)", timeout=30)
        assert reply["content"]["status"] == "ok"
        (second,) = kernel_containers(client, km.kernel_id)
        assert second != first
    assert kernel_containers(client, km.kernel_id) == []


async def test_docker_calls_never_block_the_event_loop(jupyter_dirs: Path, workspace: Path) -> None:
    """A server's loop must keep ticking while kernels start, restart and stop."""
    worst = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        while not stop.is_set():
            before = time.monotonic()
            await asyncio.sleep(0.01)
            worst = max(worst, time.monotonic() - before - 0.01)

    task = asyncio.create_task(ticker())
    km = AsyncKernelManager(kernel_name=KERNEL)
    try:
        await km.start_kernel(cwd=str(workspace))
        await km.restart_kernel(now=True)
        assert await km.is_alive()
    finally:
        await km.shutdown_kernel(now=True)
        stop.set()
        await task
    # A blocking Docker call stalls it for seconds; a busy machine, for a fraction of one.
    assert worst < 1.0, f"the event loop stalled for {worst:.3f} s"


@pytest.mark.parametrize("encryption", ["required"])
def test_curve_encryption_end_to_end(start_kernel: KernelStarter, encryption: str) -> None:
    km, kc = start_kernel(transport_encryption=encryption)
    info = km.get_connection_info()
    assert info.get("curve_publickey")
    assert info.get("curve_secretkey")
    assert run_ok(kc, "print(6 * 7)").strip() == "42"
    # A client that has the session key but not the Curve keys gets no answer.
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 1000
    sock.rcvtimeo = 3000
    sock.connect(f"tcp://127.0.0.1:{info['shell_port']}")
    try:
        try:
            km.session.send(sock, "kernel_info_request", {})
        except zmq.Again:
            pass  # not even queued: no handshake completed
        with pytest.raises(zmq.Again):
            sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


async def test_provisioner_info_reattaches_to_the_running_kernel(jupyter_dirs: Path, workspace: Path) -> None:
    """What a restarted server needs: the saved info reaches the same kernel, state intact."""
    first = AsyncKernelManager(kernel_name=KERNEL)
    await first.start_kernel(cwd=str(workspace))
    kc = first.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    await kc.execute_interactive("x = 42", timeout=30)
    kc.stop_channels()
    saved = json.loads(json.dumps(await first.provisioner.get_provisioner_info()))
    # The first server "exits": its bridge goes away, the container keeps running.
    first.provisioner.bridge.stop()

    second = AsyncKernelManager(kernel_name=KERNEL, kernel_id=saved["kernel_id"])
    second.provisioner = KernelProvisionerFactory.instance().create_provisioner_instance(
        saved["kernel_id"], second.kernel_spec, parent=second
    )
    await second.provisioner.load_provisioner_info(saved)
    second.load_connection_info(saved["connection_info"])
    try:
        assert await second.is_alive()
        kc = second.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=30)
        outputs: list[dict] = []
        reply = await kc.execute_interactive("print(x)", timeout=30, output_hook=outputs.append)
        assert reply["content"]["status"] == "ok"
        assert [m["content"]["text"] for m in outputs if m["msg_type"] == "stream"] == ["42\n"]
        kc.stop_channels()
    finally:
        await second.shutdown_kernel(now=True)
        await first.provisioner.cleanup()


def test_restarting_a_dead_kernel_gives_a_kernel_that_stays_up(
    start_kernel: KernelStarter, docker_client: docker.DockerClient
) -> None:
    """The shutdown_request sent to the dead kernel must not reach (and stop) the new one."""
    km, kc = start_kernel()
    (container,) = kernel_containers(docker_client, km.kernel_id)
    docker_client.containers.get(container).kill()
    time.sleep(1)
    km.restart_kernel(now=False)
    kc.wait_for_ready(timeout=60)
    time.sleep(3)
    assert km.is_alive()
    assert run_ok(kc, "print('alive')").strip() == "alive"


DETACHED_SERVER = """
import asyncio, json, os, sys
from jupyter_client import AsyncKernelManager

async def main():
    km = AsyncKernelManager(kernel_name={kernel!r})
    await km.start_kernel(cwd={cwd!r})
    kc = km.client(); kc.start_channels(); await kc.wait_for_ready(timeout=60)
    await kc.execute_interactive("x = 'from the first server'", timeout=30)
    kc.stop_channels()
    print(json.dumps(await km.provisioner.get_provisioner_info()), flush=True)
    os._exit(0)  # a server that exits without shutting its kernel down

asyncio.run(main())
"""


async def test_a_reattached_kernel_is_not_swept_as_an_orphan(
    jupyter_dirs: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", DETACHED_SERVER.format(kernel=KERNEL, cwd=str(workspace))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    saved = json.loads(out.strip().splitlines()[-1])
    second = AsyncKernelManager(kernel_name=KERNEL, kernel_id=saved["kernel_id"])
    second.provisioner = KernelProvisionerFactory.instance().create_provisioner_instance(
        saved["kernel_id"], second.kernel_spec, parent=second
    )
    await second.provisioner.load_provisioner_info(saved)
    second.load_connection_info(saved["connection_info"])
    other = AsyncKernelManager(kernel_name=KERNEL)
    try:
        monkeypatch.setattr(launching, "_swept_orphans", False)  # as in a fresh server
        await other.start_kernel(cwd=str(workspace))  # sweeps orphans: the adopted kernel is not one
        assert await second.is_alive()
        kc = second.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=30)
        outputs: list[dict] = []
        await kc.execute_interactive("print(x)", timeout=30, output_hook=outputs.append)
        assert [m["content"]["text"] for m in outputs if m["msg_type"] == "stream"] == [
            "from the first server\n"
        ]
        kc.stop_channels()
    finally:
        await other.shutdown_kernel(now=True)
        await second.shutdown_kernel(now=True)
