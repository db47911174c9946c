"""A quiet kernel's idle freeze, in real gVisor: its sandbox frozen (the host's cgroup
freezer) once nobody used it for ``freeze_idle_after``, heartbeats answered meanwhile,
thawed by a client's next request, which is answered in order; and what kernel code and
clients can do about it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import pytest
import zmq
from jupyter_client import KernelManager
from jupyter_core.utils import run_sync

from sandbox_kernel.host.cgroups import CgroupFreezer, cpu_seconds
from sandbox_kernel.reattach import reattach_kernel_blocking

from .conftest import KernelStarter, run, run_ok

#: The shortest delay a kernelspec may set: tests wait little.
QUIET = 1


def sandbox_pid(docker_client: docker.DockerClient, km: KernelManager) -> int:
    return int(docker_client.api.inspect_container(km.provisioner.container_id)["State"]["Pid"])


def freezer_state(docker_client: docker.DockerClient, km: KernelManager) -> str | None:
    """What the host's cgroup says (never what the provisioner believes)."""
    freezer = CgroupFreezer.of_pid(sandbox_pid(docker_client, km))
    return freezer.state() if freezer is not None else None


def wait_frozen(docker_client: docker.DockerClient, km: KernelManager, timeout: float = 30) -> float:
    """Seconds until the kernel's sandbox is frozen, as the host's cgroup says and the
    provisioner knows, or fail. (The cgroup can say so a moment before the provisioner's
    thread, whose write froze it, has noted it.)"""
    started = time.monotonic()
    while freezer_state(docker_client, km) != "frozen" or not km.provisioner.watchdog.freezer.frozen:
        assert time.monotonic() - started < timeout, (
            f"not frozen within {timeout} s: the cgroup says {freezer_state(docker_client, km)}, "
            f"the provisioner {'frozen' if km.provisioner.watchdog.freezer.frozen else 'not frozen'}"
        )
        time.sleep(0.1)
    return time.monotonic() - started


def _audit(kernel_id: str) -> list[dict[str, Any]]:
    path = Path(os.environ["JUPYTER_DATA_DIR"]) / "sandbox-kernel" / "audit.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        line for line in lines if line.get("kernel_id") == kernel_id and line["event"] in ("freeze", "thaw")
    ]


def heartbeat(km: KernelManager, timeout: float = 5.0) -> bool:
    """One ping on the kernel's heartbeat channel, as jupyter_client's sends it: answered in time?"""
    context = zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    sock.linger = 0
    try:
        sock.connect(km._make_url("hb"))
        sock.send(b"ping")
        return bool(sock.poll(int(timeout * 1000))) and sock.recv() == b"ping"
    finally:
        sock.close()


@pytest.fixture
def freezing(make_kernelspec: Callable[..., str]) -> Callable[..., str]:
    """A kernelspec whose kernels freeze after QUIET seconds (and more of its config)."""

    def make(name: str = "py-freezing", **config: Any) -> str:
        return make_kernelspec(name, config={"freeze_idle_after": QUIET, **config})

    return make


def test_a_quiet_kernel_freezes_answers_heartbeats_and_a_request_thaws_it_in_order(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    km, kc = start_kernel(freezing())
    run_ok(kc, "x = 41")
    wait_frozen(docker_client, km)
    pid = sandbox_pid(docker_client, km)
    before = cpu_seconds(pid)
    assert heartbeat(km), "the host answers for a frozen kernel"
    time.sleep(3)
    used = (cpu_seconds(pid) or 0) - (before or 0)
    assert used < 0.005, f"a frozen sandbox used {used:.3f} CPU-seconds in 3 s"

    started = time.monotonic()
    result = run(kc, "x += 1\nfor i in range(5): print(i)\nx", timeout=30)
    first = time.monotonic() - started
    assert result.status == "ok", result.reply
    assert result.stdout == "0\n1\n2\n3\n4\n", "its output, in order"
    assert result.outputs[-1]["data"]["text/plain"] == "42"
    assert first < 10, f"the first reply after a thaw took {first:.2f} s"  # not held up
    assert freezer_state(docker_client, km) == "thawed"
    events = _audit(km.kernel_id)
    assert [e["event"] for e in events][:2] == ["freeze", "thaw"]
    assert events[1]["reason"] == "a client's message"
    assert km.is_alive()


def test_a_kernel_running_a_cell_or_waiting_on_input_never_freezes(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    km, kc = start_kernel(freezing())
    result = run(kc, "import time; time.sleep(4); print('done')", timeout=30)
    assert result.stdout == "done\n"
    assert not km.provisioner.watchdog.freezer.frozen, "a long cell ran on"

    msg_id = kc.execute("print('got', input('name? '))", allow_stdin=True)
    assert kc.get_stdin_msg(timeout=30)["content"]["prompt"] == "name? "
    time.sleep(4)  # the cell waits for its user
    assert freezer_state(docker_client, km) == "thawed"
    kc.input("sam")
    reply = kc.get_shell_msg(timeout=30)
    assert (reply["parent_header"]["msg_id"], reply["content"]["status"]) == (msg_id, "ok")
    wait_frozen(docker_client, km)  # and once the cell is done, it does


def test_a_kernelspec_can_opt_out(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    km, kc = start_kernel(freezing("py-never-freezing", freeze_idle_after=0))
    run_ok(kc, "x = 1")
    time.sleep(4)
    assert freezer_state(docker_client, km) == "thawed"
    assert not km.provisioner.watchdog.freezer.frozen


def test_a_frozen_kernel_is_interrupted_restarted_and_shut_down_as_any(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    km, kc = start_kernel(freezing())
    run_ok(kc, "x = 42")
    wait_frozen(docker_client, km)
    km.interrupt_kernel()  # a signal: Docker cannot deliver one to a frozen gVisor sandbox
    assert run_ok(kc, "print(x)", timeout=30).strip() == "42"
    wait_frozen(docker_client, km)
    first_container = km.provisioner.container_id
    km.restart_kernel(now=False)
    kc.wait_for_ready(timeout=60)
    assert km.provisioner.container_id != first_container
    assert run_ok(kc, "print('fresh' if 'x' not in dir() else x)").strip() == "fresh"
    wait_frozen(docker_client, km)
    container_id = km.provisioner.container_id
    started = time.monotonic()
    km.shutdown_kernel(now=False)  # asks the kernel first (a message: it thaws), then removes it
    assert time.monotonic() - started < 20
    assert not docker_client.containers.list(all=True, filters={"id": container_id})


def test_a_persistent_kernel_left_frozen_is_thawed_by_the_next_holder(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    """One server froze it and died; another adopts it: it runs, heartbeats and all."""
    km, kc = start_kernel(freezing("py-persistent-freezing", lifecycle="persistent"))
    run_ok(kc, "x = 42")
    wait_frozen(docker_client, km)
    kc.stop_channels()
    kernel_id, pid = km.kernel_id, sandbox_pid(docker_client, km)
    run_sync(km.provisioner.detach)()  # (a detach thaws it: freeze it as a dead server leaves it)
    km.provisioner = None  # type: ignore[assignment]  # it drives it no more
    freezer = CgroupFreezer.of_pid(pid)
    assert freezer is not None
    assert freezer.set(True)
    second = reattach_kernel_blocking(kernel_id)
    client = second.client()
    client.start_channels()
    try:
        assert run_ok(client, "print(x)", timeout=30).strip() == "42"
        assert freezer.state() == "thawed"
        wait_frozen(docker_client, second)  # and the new holder freezes it in its turn
        assert run_ok(client, "print(x + 1)", timeout=30).strip() == "43"
    finally:
        client.stop_channels()
        second.shutdown_kernel(now=True)


# ---------------------------------------------------------------------- its attacks


def test_a_thread_that_mostly_sleeps_stops_while_frozen_and_its_clock_jumps(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    """Neither a thread's output nor its timers keep a kernel thawed (it computes next to
    nothing): a thread printing every 0.2 s is frozen with its kernel, and what it sees is
    a jump of its clock."""
    km, kc = start_kernel(freezing())
    run_ok(
        kc,
        "import threading, time\n"
        "ticks = []\n"
        "def tick():\n"
        "    while True:\n"
        "        ticks.append(time.monotonic()); print('.', end='', flush=True); time.sleep(0.2)\n"
        "threading.Thread(target=tick, daemon=True).start()",
    )
    wait_frozen(docker_client, km, timeout=15)
    time.sleep(3)
    # The thread's first tick after the thaw may come after this cell has started: wait for it.
    said = run_ok(
        kc,
        "seen = len(ticks)\n"
        "while len(ticks) == seen: time.sleep(0.05)\n"
        "print(f'GAP={max(b - a for a, b in zip(ticks, ticks[1:])):.2f}')",
        timeout=30,
    )
    gap = re.search(r"GAP=([0-9.]+)", said)
    assert gap is not None, said
    assert float(gap.group(1)) > 2.5, f"its thread ran on while frozen: {_audit(km.kernel_id)}"


def test_a_flood_of_heartbeats_is_answered_by_the_host_without_thawing_or_spinning(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    km, kc = start_kernel(freezing())
    run_ok(kc, "x = 1")
    wait_frozen(docker_client, km)
    host_before = time.process_time()
    time.sleep(3)
    baseline = time.process_time() - host_before  # this process's own, with no flood
    pid = sandbox_pid(docker_client, km)
    sandbox_before, host_before = cpu_seconds(pid) or 0, time.process_time()
    context = zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    sock.linger = 0
    sock.connect(km._make_url("hb"))
    answered = 0
    for _ in range(2000):
        sock.send(b"ping")
        if sock.poll(5000):  # (a REQ socket left unanswered fails the next send)
            sock.recv()
            answered += 1
    sock.close()
    flood = time.process_time() - host_before
    assert answered == 2000
    assert freezer_state(docker_client, km) == "frozen", "heartbeats never thaw it"
    assert (cpu_seconds(pid) or 0) - sandbox_before < 0.005
    host_before = time.process_time()
    time.sleep(3)
    after = time.process_time() - host_before
    # A spin is 3 CPU-seconds (a core); what else this process does (a busy machine's, a
    # whole suite's) is in the baseline.
    assert after < baseline + 1.0, (
        f"this process used {after:.2f} CPU-seconds in 3 s after the flood "
        f"({flood:.2f} during, {baseline:.2f} in 3 s before it)"
    )


def test_work_in_a_thread_goes_on_unfrozen_and_the_kernel_freezes_once_it_is_done(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    """An analyst's background computation (a thread, no cell running, no client talking)
    is not stopped by the freeze: the sandbox's CPU keeps it thawed until the work ends."""
    km, kc = start_kernel(freezing())
    run_ok(
        kc,
        "import threading, time\n"
        "done = []\n"
        "def work():\n"
        "    end = time.monotonic() + 6\n"
        "    n = 0\n"
        "    while time.monotonic() < end:\n"
        "        n += 1\n"
        "    done.append(n)\n"
        "threading.Thread(target=work, daemon=True).start()",
    )
    time.sleep(5)
    assert freezer_state(docker_client, km) == "thawed", "frozen while its thread computed"
    wait_frozen(docker_client, km, timeout=30)
    assert [e["event"] for e in _audit(km.kernel_id)].count("freeze") == 1
    assert run_ok(kc, "print(len(done), done[0] > 0)").split() == ["1", "True"]


def test_a_thread_computing_with_no_cell_running_still_runs_into_the_wall_clock_limit(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    """The freeze changes nothing of the CPU a kernel may use with no execution running:
    a thread that never stops computing is never frozen, and killed as without it."""
    km, kc = start_kernel(freezing(exec_timeout=3))
    run_ok(kc, "import threading\ndef spin():\n    while True:\n        pass\n")
    run_ok(kc, "threading.Thread(target=spin, daemon=True).start()")
    deadline = time.monotonic() + 120
    while km.provisioner.limit_stop is None:
        assert time.monotonic() < deadline, "the computing thread was never stopped"
        time.sleep(0.5)
    assert km.provisioner.limit_stop.ename == "WallClockLimitExceeded"
    assert "freeze" not in [e["event"] for e in _audit(km.kernel_id)], "frozen while computing"


def test_list_and_kill_reach_a_frozen_kernel(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    """Docker's look-ups answer for a frozen sandbox (the restarter's poll, `list`)."""
    km, kc = start_kernel(freezing())
    run_ok(kc, "x = 1")
    wait_frozen(docker_client, km)
    sk = Path(sys.executable).with_name("jupyter-sandbox-kernel")
    listing = subprocess.run(
        [str(sk), "list", "--json"], capture_output=True, text=True, timeout=60, check=True
    )
    (row,) = [row for row in json.loads(listing.stdout) if row["kernel_id"] == km.kernel_id]
    assert (row["status"], row["frozen"]) == ("running, frozen", True)
    assert km.is_alive(), "poll() sees a running kernel"
    assert freezer_state(docker_client, km) == "frozen"
    km.shutdown_kernel(now=True)  # kill, then removal: each thaws it first
    kc.stop_channels()


def test_docker_stopping_a_frozen_kernel_is_not_held_up(
    start_kernel: KernelStarter, freezing: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    """`docker stop` of a frozen kernel's sandbox (what a daemon restart does to every
    container) would wait for as long as it stays frozen, its runsc kill waiting on the
    sandbox, and the daemon with it: the host sees the kill waiting and thaws it."""
    km, kc = start_kernel(freezing())
    run_ok(kc, "x = 1")
    wait_frozen(docker_client, km)
    started = time.monotonic()
    subprocess.run(["docker", "stop", "-t", "1", km.provisioner.container_id], check=True, timeout=60)
    took = time.monotonic() - started
    assert took < 45, f"docker stop of a frozen kernel took {took:.1f} s"  # not held for good
    thawed = [e for e in _audit(km.kernel_id) if e["event"] == "thaw"]
    assert [e["reason"] for e in thawed][-1:] == ["Docker is stopping it"]
    deadline = time.monotonic() + 30
    while km.is_alive():
        assert time.monotonic() < deadline, "the kernel's end was not noticed"
        time.sleep(0.2)
