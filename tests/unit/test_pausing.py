"""Pausing's pure parts: the disk budget, the saved record, and how another process asks
the kernel's holder to pause or resume it."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandbox_kernel.errors import PauseError
from sandbox_kernel.lifecycle import pausing
from sandbox_kernel.lifecycle.pausing import (
    REQUEST_FILE,
    Paused,
    PauseRequests,
    ask_holder,
    check_budget,
    checkpoint_name,
    relay_kept_its_sockets,
    wait_for_channels,
)
from sandbox_kernel.plan.sandbox_spec import CONTAINER_RUNTIME_DIR, kernel_sockets

MIB = 2**20


def test_a_pause_that_could_outgrow_the_budget_or_the_disk_is_refused_saying_what_to_do() -> None:
    check_budget("k1", 100 * MIB, used=900 * MIB, free=None, budget=1000 * MIB)  # just fits
    with pytest.raises(PauseError) as over:
        check_budget("k1", 101 * MIB, used=900 * MIB, free=None, budget=1000 * MIB)
    message = str(over.value)
    assert "up to 101 MiB" in message
    assert "already take 900 MiB of the 1000 MiB budget (SandboxProvisioner.checkpoint_budget)" in message
    assert "It keeps running, nothing lost" in message
    with pytest.raises(PauseError, match="has 50 MiB free"):
        check_budget("k1", 100 * MIB, used=0, free=50 * MIB, budget=1000 * MIB)


def test_the_saved_record_reads_back_and_anything_else_is_not_a_pause() -> None:
    paused = Paused(checkpoint_name(), 13 * MIB, 1.5)
    assert Paused.from_dict(paused.to_dict()) == paused
    assert Paused.from_dict({**paused.to_dict(), "size": None}) == Paused(paused.checkpoint, None, 1.5)
    for other in (None, {}, {"checkpoint": 3}, "sk-1", []):
        assert Paused.from_dict(other) is None
    assert checkpoint_name() != checkpoint_name()


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Path:
    """A kernel's private runtime folder."""
    folder = tmp_path / "runtime"
    folder.mkdir(mode=0o700)
    return folder


@contextmanager
def holder(
    runtime_dir: Path, pause: Callable[[str], Awaitable[Paused]], resume: Callable[[str], Awaitable[None]]
) -> Iterator[None]:
    """The kernel's holder, looking for requests as its watchdog does (twice a second)."""
    stop = threading.Event()

    def watch() -> None:
        requests = PauseRequests(runtime_dir)
        while not stop.is_set():
            asyncio.run(requests.answer(pause, resume))
            stop.wait(0.05)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


ANSWERS = [("pause", "paused (checkpoint sk-1, 13 MiB)"), ("resume", "resumed")]


@pytest.mark.parametrize(("action", "said"), ANSWERS)
def test_another_process_asks_the_holder_and_hears_it(runtime_dir: Path, action: str, said: str) -> None:
    done: list[str] = []

    async def pause(why: str) -> Paused:
        done.append(f"pause: {why}")
        return Paused("sk-1", 13 * MIB, 0)

    async def resume(why: str) -> None:
        done.append(f"resume: {why}")

    with holder(runtime_dir, pause, resume):
        assert ask_holder(runtime_dir, action, timeout=10) == (True, said)
    assert done == [f"{action}: asked by `jupyter sandbox-kernel {action}`"]
    assert list(runtime_dir.iterdir()) == [], "request and answer are gone"


def test_a_refusal_reaches_the_asker_and_junk_requests_are_dropped(runtime_dir: Path) -> None:
    refusal = "Kernel k1 was not paused: it is working on a request. It keeps running."

    async def pause(why: str) -> Paused:
        raise PauseError(refusal)

    async def resume(why: str) -> None:
        raise AssertionError("not asked")

    (runtime_dir / REQUEST_FILE).write_text('{"action": "rm -rf", "token": "../../x"}')
    asyncio.run(PauseRequests(runtime_dir).answer(pause, resume))
    assert list(runtime_dir.iterdir()) == []
    with holder(runtime_dir, pause, resume):
        assert ask_holder(runtime_dir, "pause", timeout=10) == (False, refusal)


def test_an_unanswered_request_is_withdrawn(runtime_dir: Path) -> None:
    with pytest.raises(PauseError, match=r"did not answer within 0\.3 s"):
        ask_holder(runtime_dir, "pause", timeout=0.3)
    assert list(runtime_dir.iterdir()) == []


def test_a_sandbox_that_holds_none_of_its_channel_sockets_has_let_go_though_the_paths_answer(
    tmp_path: Path,
) -> None:
    """gVisor's gofer accepts connections at the paths for a second or two after the relay
    closed them; what the sandbox itself holds is what a checkpoint needs."""
    launch_dir = tmp_path / "launch"
    launch_dir.mkdir()
    listeners = []
    for path in kernel_sockets(launch_dir).values():
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen()
        listeners.append(listener)
    held: list[str] | None = [f"{CONTAINER_RUNTIME_DIR}/kernel-1", "/workspace/own.sock"]

    async def sandbox_holds() -> list[str] | None:
        return held

    async def wait(timeout: float) -> None:
        await wait_for_channels(launch_dir, bound=False, timeout=timeout, held=sandbox_holds)

    try:
        with pytest.raises(PauseError, match=r"^the kernel did not give back its shell socket within 0\.2 s"):
            asyncio.run(wait(0.2))
        held = [f"{CONTAINER_RUNTIME_DIR}/kernel-2", f"{CONTAINER_RUNTIME_DIR}/kernel-1"]
        with pytest.raises(PauseError, match=r"^the kernel did not give back its shell and iopub sockets"):
            asyncio.run(wait(0.2))
        held = [f"{CONTAINER_RUNTIME_DIR}/kernel-1", f"{CONTAINER_RUNTIME_DIR}/kernel-4"]  # the relay's too
        with pytest.raises(PauseError, match=r"did not let go of its channels within 0\.2 s"):
            asyncio.run(wait(0.2))
        held = ["/workspace/own.sock"]  # (the checkpoint refuses that one, saying so)
        asyncio.run(wait(5))
        held = None  # unknown: the paths decide
        with pytest.raises(PauseError):
            asyncio.run(wait(0.2))
        asyncio.run(wait_for_channels(launch_dir, bound=True, timeout=5, held=sandbox_holds))
    finally:
        for listener in listeners:
            listener.close()
    asyncio.run(wait(5))


def test_a_relay_that_still_holds_its_own_channel_sockets_is_told_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed pause the host lends the launch folder back only to a relay that let
    go of its own sockets (stdin, control, heartbeat), as the host sees the sandbox hold
    them: it stops the rest of the sandbox before it closes them, so kernel code cannot
    run while the folder is lent. The paths themselves answer for a moment after a close
    (gVisor's gofer), so they are asked only where the host cannot see (None)."""
    monkeypatch.setattr(pausing.os, "getuid", lambda: 0)  # (a root server: it lends the folder)
    launch_dir = tmp_path / "launch"
    held: list[str] | None = [f"{CONTAINER_RUNTIME_DIR}/kernel-{n}" for n in range(1, 6)]

    async def sandbox_holds() -> list[str] | None:
        return held

    assert asyncio.run(relay_kept_its_sockets(launch_dir, sandbox_holds))
    held = [f"{CONTAINER_RUNTIME_DIR}/kernel-{n}" for n in (3, 4, 5)]  # the kernel's given back
    assert asyncio.run(relay_kept_its_sockets(launch_dir, sandbox_holds))
    held = [f"{CONTAINER_RUNTIME_DIR}/kernel-{n}" for n in (1, 2)] + ["/workspace/own.sock"]
    assert not asyncio.run(relay_kept_its_sockets(launch_dir, sandbox_holds))


def test_where_the_host_cannot_see_the_sockets_held_a_stopped_relay_is_told_apart_by_its_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root server that cannot see what the sandbox holds (None: no gofer found) asks the
    relay's sockets' paths, for a few seconds: a relay that closed them is refused at once;
    one that was stopped (kernel code can stop its parent) still listens, its queue of
    connections filling up and then refusing to wait (EAGAIN), which is no letting go. A
    server that is not root lends no folder: its relay always binds its channels again."""
    monkeypatch.setattr(pausing.os, "getuid", lambda: 0)
    launch_dir = tmp_path / "launch"
    launch_dir.mkdir()
    kept = [kernel_sockets(launch_dir)[channel] for channel in ("stdin", "control", "hb")]

    async def unknown() -> list[str] | None:
        return None

    def kept_by_relay() -> bool:
        return asyncio.run(relay_kept_its_sockets(launch_dir, unknown, timeout=0.3))

    assert not kept_by_relay()  # no sockets at all
    listeners = []
    for path in kept:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)  # never accepting, as a stopped relay
        listeners.append(listener)
    try:
        for _ in range(3):  # the queue full after the first probes
            assert kept_by_relay()
        listeners.pop().close()  # one let go, two held
        assert kept_by_relay()
        monkeypatch.setattr(pausing.os, "getuid", lambda: 1000)
        assert not kept_by_relay()  # (nothing to lend: its channels are bound again)
        monkeypatch.setattr(pausing.os, "getuid", lambda: 0)
    finally:
        for listener in listeners:
            listener.close()
    assert not kept_by_relay()  # closed: refused (the files are left)
    assert all(path.exists() for path in kept)
