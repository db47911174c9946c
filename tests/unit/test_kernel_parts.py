"""The provisioner's parts (pauser, watchdog, take-over, exits, reattach state) against
the in-memory backend: what each does to a sandbox and tells its clients, in
milliseconds, without Docker. The same paths under real gVisor: tests/integration."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from jupyter_client.session import Session

from sandbox_kernel.backends.fake import FakeBackend
from sandbox_kernel.channels.bridge import ipc_in_use
from sandbox_kernel.errors import PauseError
from sandbox_kernel.kernel import channels as channels_module
from sandbox_kernel.kernel.channels import ChannelSettings, KernelChannels
from sandbox_kernel.kernel.egress import KernelEgress
from sandbox_kernel.kernel.exits import Exits
from sandbox_kernel.kernel.holding import Holding
from sandbox_kernel.kernel.manager import ManagerLink
from sandbox_kernel.kernel.pauser import Pauser
from sandbox_kernel.kernel.site import KernelSite
from sandbox_kernel.kernel.state import ReattachState
from sandbox_kernel.kernel.watchdog import Watchdog
from sandbox_kernel.lifecycle.judge import WatchLimits
from sandbox_kernel.lifecycle.ownership import RELEASED_FILE, OrphanReaper, write_owner
from sandbox_kernel.lifecycle.pausing import Paused, ask_holder
from sandbox_kernel.plan.sandbox_spec import kernel_sockets
from sandbox_kernel.services import Services

from .conftest import make_spec

LOG = logging.getLogger("test_kernel_parts")


class FakeBridge:
    """What the parts use of a KernelBridge: holding, in-flight requests, injections."""

    def __init__(self) -> None:
        self.held = False
        self.dropped = 0
        self.in_flight = False
        self.injected: list[tuple[str, Any]] = []
        self.attached: dict[str, str] | None = None
        self.echo_heartbeats = False
        self.on_client_message: Callable[[], None] | None = None

    @property
    def holding(self) -> bool:
        return self.held

    def client_sends(self) -> None:
        """A client's signed message comes (what the bridge thread does first)."""
        if self.on_client_message is not None:
            self.on_client_message()

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False

    def drop_held(self) -> int:
        self.held, self.dropped = False, self.dropped + 1
        return 0

    def requests_in_flight(self, max_age: float) -> bool:
        return self.in_flight

    def inject(self, channel: str, message: Any) -> None:
        self.injected.append((channel, message))

    def attach(self, endpoints: dict[str, str]) -> None:
        self.attached = dict(endpoints)


class NoReaper:
    """No orphans here: the fake backend's sandboxes are the test's."""

    def watch(self, runtime_parent: Path) -> None:
        pass


@dataclass
class Parts:
    backend: FakeBackend
    site: KernelSite
    bridge: FakeBridge
    channels: KernelChannels
    exits: Exits
    holding: Holding
    pauser: Pauser
    watchdog: Watchdog
    saves: list[Paused | None] = field(default_factory=list)

    @property
    def container_id(self) -> str:
        assert self.site.container_id is not None
        return self.site.container_id

    def signals(self) -> list[int]:
        return self.backend.sandbox(self.container_id).signals

    def bound(self) -> list[bool]:
        return [
            ipc_in_use(str(p), timeout=0.05) for p in kernel_sockets(self.site.launch_dir or Path()).values()
        ]


@pytest.fixture
async def parts(tmp_path: Path) -> Parts:
    runtime_dir = tmp_path / "kernels" / "k1"
    launch_dir = runtime_dir / "run1"
    launch_dir.mkdir(parents=True)
    site = KernelSite("k1", runtime_dir=runtime_dir, launch_dir=launch_dir, launches=1)
    site.spec = make_spec(tmp_path, runtime_dir=launch_dir, uid=os.getuid(), gid=os.getgid())
    backend = FakeBackend()
    site.container_id = await backend.create(site.spec)
    channels = KernelChannels(ChannelSettings("k1", "sandboxed-python"))
    bridge = FakeBridge()
    channels.bridge = bridge  # type: ignore[assignment]
    channels.signer = Session(key=b"secret")
    channels.ledger()
    egress = KernelEgress("k1", channels, LOG, lambda: None)
    exits = Exits("k1", backend, channels, LOG, lambda: "512m")
    link = ManagerLink(None)
    holding = Holding(site, channels, egress, link, LOG)
    saves: list[Paused | None] = []

    async def save() -> None:
        saves.append(pauser.saved())

    pauser = Pauser(site, backend, channels, egress, exits, save, lambda: 2**40, LOG)
    services = Services(reaper=cast(OrphanReaper, NoReaper()))
    watchdog = Watchdog(site, backend, channels, holding, pauser, exits, link, LOG, services)
    made = Parts(backend, site, bridge, channels, exits, holding, pauser, watchdog, saves)
    yield made
    watchdog.stop()
    await backend.remove(site.container_id or "")


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        assert asyncio.get_running_loop().time() < deadline, "not within the time"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------- the pauser


async def test_a_pause_saves_the_sandbox_stops_it_and_holds_what_clients_send(parts: Parts) -> None:
    paused = await parts.pauser.pause("asked")
    box = parts.backend.sandbox(parts.container_id)
    assert (box.status, paused.checkpoint in box.checkpoints) == ("exited", True)
    assert parts.signals() == [signal.SIGUSR1], "the relay was told to let go, nothing else"
    assert parts.bridge.held
    assert (parts.pauser.state, parts.pauser.suspended) == ("paused", True)
    pending, done = parts.saves
    assert pending is not None
    assert pending.size is None, "said before it is done (a server may die meanwhile)"
    assert done == paused
    assert parts.exits.noted is None, "a paused sandbox's stop is not the kernel's end"


async def test_a_resume_restores_binds_again_seals_and_lets_clients_through(parts: Parts) -> None:
    paused = await parts.pauser.pause("asked")
    assert parts.bound() == [False] * 5
    await parts.pauser.resume("a client's shell execute_request")
    box = parts.backend.sandbox(parts.container_id)
    assert box.status == "running"
    assert parts.signals() == [signal.SIGUSR1, signal.SIGUSR2]
    assert parts.bound() == [True] * 5
    assert not parts.bridge.held
    assert paused.checkpoint not in box.checkpoints, "its checkpoint is removed once it runs again"
    assert parts.pauser.state == "running"
    if os.getuid() == 0:  # only a root server can seal the folder against the kernel's uid
        st = (parts.site.launch_dir or Path()).stat()
        assert (st.st_uid, oct(st.st_mode & 0o777)) == (0, "0o755")


async def test_a_kernel_working_on_a_request_is_not_paused(parts: Parts) -> None:
    parts.bridge.in_flight = True
    with pytest.raises(PauseError, match=r"working on a request. It keeps running"):
        await parts.pauser.pause("idle")
    assert parts.signals() == [], "its relay was never told to let go"
    assert not parts.bridge.held
    assert parts.pauser.paused is None


async def test_a_host_that_cannot_checkpoint_refuses_before_touching_the_sandbox(parts: Parts) -> None:
    parts.backend.can_checkpoint = False
    with pytest.raises(PauseError, match=r"cannot pause"):
        await parts.pauser.pause("asked")
    assert parts.signals() == []
    assert parts.bound() == [True] * 5


async def test_a_failed_checkpoint_leaves_the_kernel_running_with_its_channels_bound_again(
    parts: Parts,
) -> None:
    box = parts.backend.sandbox(parts.container_id)
    box.fail_checkpoint = (PauseError("no space left on device"), False)
    with pytest.raises(PauseError, match=r"could not be paused: no space left on device. It keeps running"):
        await parts.pauser.pause("asked")
    assert parts.signals() == [signal.SIGUSR1, signal.SIGUSR2]
    assert parts.bound() == [True] * 5
    assert not parts.bridge.held, "what clients sent meanwhile goes on to the kernel"
    assert (parts.pauser.paused, parts.exits.noted) == (None, None)
    assert parts.saves[-1] is None, "its saved state says it is not paused after all"


async def test_a_checkpoint_failure_that_ended_the_sandbox_ends_the_kernel_saying_why(parts: Parts) -> None:
    box = parts.backend.sandbox(parts.container_id)
    box.fail_checkpoint = (PauseError("runsc crashed"), True)
    with pytest.raises(PauseError, match=r"the pause failed and ended the kernel .runsc crashed."):
        await parts.pauser.pause("asked")
    assert parts.exits.noted == parts.container_id
    assert parts.exits.cause is not None
    assert parts.exits.cause[0] == "PauseFailed"
    assert parts.channels.refusal[0] == "PauseFailed", "new executions are told at once"
    assert parts.bridge.dropped == 1


async def test_a_resume_that_fails_ends_the_kernel_and_keeps_its_workspace(parts: Parts) -> None:
    await parts.pauser.pause("asked")
    parts.backend.sandbox(parts.container_id).fail_restore = PauseError("checkpoint image damaged")
    with pytest.raises(
        PauseError, match=r"could not be resumed .checkpoint image damaged.; its variables are lost"
    ):
        await parts.pauser.resume("asked")
    assert parts.exits.cause is not None
    assert parts.exits.cause[0] == "ResumeFailed"
    assert "its workspace is intact" in parts.exits.cause[1]
    assert parts.bridge.dropped == 1, "clients' held messages are answered, not delivered to nothing"
    assert parts.pauser.paused is None


async def test_a_kill_ends_a_paused_kernel_and_an_interrupt_leaves_it_paused(parts: Parts) -> None:
    await parts.pauser.pause("asked")
    await parts.pauser.signal(signal.SIGINT)
    assert parts.pauser.paused is not None, "a paused kernel is idle: nothing to interrupt"
    assert parts.signals() == [signal.SIGUSR1]
    await parts.pauser.signal(signal.SIGKILL)
    assert parts.pauser.paused is None
    assert parts.exits.noted == parts.container_id
    assert parts.exits.code == 128 + signal.SIGKILL


async def test_a_client_message_wakes_a_paused_kernel(parts: Parts) -> None:
    await parts.pauser.pause("asked")
    parts.pauser.wake("shell execute_request")  # (the bridge thread, for a held message)
    assert parts.pauser.state == "resuming"
    await eventually(lambda: parts.pauser.state == "running")
    assert parts.bound() == [True] * 5


# ---------------------------------------------------------------------- the watchdog


async def test_the_watchdog_notes_an_end_and_refuses_new_executions_until_a_restart(parts: Parts) -> None:
    parts.watchdog.start(parts.container_id, WatchLimits())
    parts.backend.exit(parts.container_id, 1)
    await eventually(
        lambda: parts.channels.refusal[0] != "KernelDied" or "restart" in parts.channels.refusal[1]
    )
    assert parts.exits.noted == parts.container_id
    assert parts.exits.cause == (
        "KernelDied",
        "the kernel stopped (exit code 1) before this execution finished",
    )
    assert parts.channels.refusal[0] == "KernelDied"
    assert "restart it" in parts.channels.refusal[1]
    assert parts.exits.limit_stop is None


async def test_an_end_with_no_execution_waiting_is_told_at_once_and_one_waiting_gives_its_reply_time(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each restart and shutdown waited 0.2 s (what the bridge is given to pass on a reply
    in flight) before the end was noted and ``poll`` answered, with no execution waiting
    for a reply. The wait is made an hour here: only an execution waiting may take it."""
    monkeypatch.setattr(channels_module, "SETTLE", 3600.0)
    await asyncio.wait_for(parts.exits.note(parts.container_id, 0), 10)
    assert parts.exits.noted == parts.container_id
    assert parts.bridge.injected == []  # nobody to answer

    other = await parts.backend.create(parts.site.spec)  # (the kernel after a restart)
    parts.channels.accept()
    session = Session(key=b"secret")
    request = session.msg("execute_request", {"code": "1", "silent": False})
    assert parts.channels.ledger()("shell", True, session.serialize(request, ident=[b"client"]))
    noting = asyncio.create_task(parts.exits.note(other, 1))
    await asyncio.sleep(0.5)
    assert not noting.done(), "its reply in flight, if any, was not given time to pass first"
    noting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await noting
    await parts.backend.remove(other)


async def test_an_end_by_the_memory_limit_is_named_and_kept_on_record(parts: Parts) -> None:
    parts.watchdog.start(parts.container_id, WatchLimits(memory="512m"))
    parts.backend.exit(parts.container_id, 137, oom=True)
    # (the watchdog's thread notes the end, then asks the backend why: wait for the why)
    await eventually(lambda: parts.exits.limit_stop is not None)
    assert parts.exits.noted == parts.container_id
    stop = parts.exits.limit_stop
    assert stop is not None
    assert stop.ename == "MemoryLimitExceeded"
    assert stop.reason.startswith("memory limit 512m exceeded")


async def test_an_end_is_noted_with_its_cause_never_before(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A provisioner's poll (the server's thread) takes the end as noted once it sees
    ``noted``, and the restarter's teardown may follow at once, cutting the watchdog's note
    short: the cause (Docker's inspect, slow on a busy host) must be known by then, or a
    memory limit's end reached nobody by its name."""
    asked, answer = threading.Event(), threading.Event()
    oom_killed = parts.backend.oom_killed

    async def slow_oom_killed(sandbox_id: str) -> bool:
        asked.set()
        await asyncio.to_thread(answer.wait, 10)
        return await oom_killed(sandbox_id)

    monkeypatch.setattr(parts.backend, "oom_killed", slow_oom_killed)
    parts.watchdog.start(parts.container_id, WatchLimits())
    parts.backend.exit(parts.container_id, 137, oom=True)
    assert await asyncio.to_thread(asked.wait, 10), "the watchdog asked why it ended"
    assert (parts.exits.noted, parts.exits.code) == (None, None), "nothing of the end said before its cause"
    answer.set()
    await eventually(lambda: parts.exits.noted == parts.container_id)
    assert parts.exits.code == 137
    assert parts.exits.cause is not None
    assert parts.exits.cause[0] == "MemoryLimitExceeded"
    assert parts.exits.limit_stop is not None


async def test_a_kernel_idle_past_its_limit_is_told_and_stopped_for_good(parts: Parts) -> None:
    parts.watchdog.start(parts.container_id, WatchLimits(idle_timeout=0.3))
    await eventually(lambda: parts.exits.cause is not None)
    assert parts.exits.noted == parts.container_id
    assert signal.SIGKILL in parts.signals()
    assert parts.exits.cause is not None
    assert parts.exits.cause[0] == "IdleLimitExceeded"
    assert [channel for channel, _ in parts.bridge.injected] == ["iopub"], "one notice for every client"
    assert parts.channels.refusal[0] == "IdleLimitExceeded"


async def test_a_kernel_idle_a_while_is_paused_by_its_watchdog(parts: Parts) -> None:
    parts.watchdog.start(parts.container_id, WatchLimits(pause_after=0.3))
    await eventually(lambda: parts.pauser.paused is not None)
    assert parts.signals() == [signal.SIGUSR1]
    assert parts.exits.noted is None


async def test_a_kernel_another_manager_took_over_is_let_go_untouched(parts: Parts) -> None:
    runtime_dir = parts.site.runtime_dir
    assert runtime_dir is not None
    write_owner(runtime_dir, parts.holding.token)
    parts.watchdog.start(parts.container_id, WatchLimits())
    container_id = parts.container_id
    await asyncio.sleep(0.6)
    assert parts.holding.taken_over is None, "its own token: it still holds the kernel"
    write_owner(runtime_dir, "0123456789abcdef")  # what reattach(take_over=True) writes
    await eventually(lambda: parts.holding.taken_over is not None)
    assert parts.site.container_id is None, "nothing here may remove or signal it now"
    assert parts.backend.sandbox(container_id).status == "running"
    assert parts.backend.sandbox(container_id).signals == []
    assert parts.channels.refusal[0] == "KernelTakenOver", parts.channels.refusal
    assert f"process {os.getpid()}" in parts.holding.taken_over
    await eventually(lambda: (runtime_dir / RELEASED_FILE).exists())
    assert (runtime_dir / RELEASED_FILE).read_text() == "0123456789abcdef", "it says it let go"
    assert parts.bridge.attached is not None, "the bridge relays to nowhere; the ledger answers"


# ---------------------------------------------------------------------- the freezer


def events_of(parts: Parts, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """The audit log's lifecycle lines, as the channels write them."""
    events: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(parts.channels, "lifecycle", lambda event, **details: events.append((event, details)))
    return events


def box_of(parts: Parts) -> Any:
    return parts.backend.sandbox(parts.container_id)


async def test_a_quiet_kernel_is_frozen_and_a_clients_message_thaws_it_at_once(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    events, freezer = events_of(parts, monkeypatch), parts.watchdog.freezer
    parts.watchdog.start(parts.container_id, WatchLimits(freeze_after=0.3))
    await eventually(lambda: freezer.frozen)
    assert box_of(parts).frozen
    assert parts.bridge.echo_heartbeats, "while frozen, heartbeats are the bridge's to answer"
    assert [event for event, _ in events] == ["freeze"]
    parts.bridge.client_sends()  # the bridge thread, before it passes the message on
    assert not box_of(parts).frozen, "thawed before the message reaches the kernel"
    assert not parts.bridge.echo_heartbeats
    assert events[-1][0] == "thaw"
    assert events[-1][1]["reason"] == "a client's message"
    assert freezer.frozen_seconds(asyncio.get_running_loop().time()) > 0
    await eventually(lambda: freezer.frozen)  # quiet again as long: frozen again
    assert parts.signals() == [], "nothing else was done to the sandbox"


async def test_a_kernel_working_on_a_request_or_running_a_cell_is_never_frozen(parts: Parts) -> None:
    freezer = parts.watchdog.freezer
    parts.bridge.in_flight = True  # a completion awaits its reply
    parts.watchdog.start(parts.container_id, WatchLimits(freeze_after=0.3))
    await asyncio.sleep(2.0)
    assert not freezer.frozen
    session = Session(key=b"secret")  # a cell waiting on input(): its execution is pending
    request = session.msg("execute_request", {"code": "input()", "silent": False, "allow_stdin": True})
    assert parts.channels.ledger()("shell", True, session.serialize(request, ident=[b"client"]))
    parts.bridge.in_flight = False
    await asyncio.sleep(2.0)
    assert not freezer.frozen
    assert not box_of(parts).frozen


async def test_a_clients_message_while_the_freeze_is_under_way_calls_it_off(parts: Parts) -> None:
    freezer = parts.watchdog.freezer
    freezer.watch()
    freezing = asyncio.create_task(freezer.freeze("quiet", 0))
    await eventually(lambda: parts.bridge.echo_heartbeats)  # heartbeats in flight come back first
    parts.bridge.client_sends()
    assert not await freezing
    assert (freezer.frozen, box_of(parts).frozen, parts.bridge.echo_heartbeats) == (False, False, False)


async def test_whatever_the_host_does_to_a_frozen_kernel_thaws_it_first(parts: Parts) -> None:
    """A frozen gVisor sandbox takes no signal and cannot be saved (Docker's call waits
    until it is thawed; the fake backend raises): the idle limit's kill, a pause."""
    freezer = parts.watchdog.freezer
    parts.watchdog.start(parts.container_id, WatchLimits(freeze_after=0.3, idle_timeout=2.5))
    await eventually(lambda: freezer.frozen)
    await eventually(lambda: parts.exits.cause is not None, timeout=8)
    assert parts.exits.noted == parts.container_id
    assert parts.exits.cause[0] == "IdleLimitExceeded"
    assert signal.SIGKILL in parts.signals()


async def test_a_frozen_kernel_is_thawed_then_paused_when_idle_long_or_asked(parts: Parts) -> None:
    freezer = parts.watchdog.freezer
    parts.watchdog.start(parts.container_id, WatchLimits(freeze_after=0.3))
    await eventually(lambda: freezer.frozen)
    runtime_dir = parts.site.runtime_dir
    assert runtime_dir is not None
    done, said = await asyncio.to_thread(ask_holder, runtime_dir, "pause", 10)  # `sandbox-kernel pause`
    assert done, said
    assert parts.pauser.paused is not None
    assert parts.signals() == [signal.SIGUSR1]
    assert not freezer.frozen
    await parts.pauser.resume("asked")
    parts.watchdog.stop()
    parts.channels.accept()  # its idle clock begins again
    parts.watchdog.start(parts.container_id, WatchLimits(freeze_after=0.3, pause_after=2.5))
    await eventually(lambda: freezer.frozen)
    await eventually(lambda: parts.pauser.paused is not None, timeout=8)
    assert not box_of(parts).frozen


async def test_a_kernel_kept_thawed_or_on_a_host_that_cannot_freeze_runs_on(parts: Parts) -> None:
    freezer = parts.watchdog.freezer
    freezer.watch()
    with freezer.kept_thawed("signal"):
        assert not await freezer.freeze("quiet", 0), "a signal, a pause is under way"
    assert await freezer.freeze("quiet", 0)
    assert freezer.thaw("asked")
    box_of(parts).freezable = False
    assert not await freezer.freeze("quiet", 0)
    assert not box_of(parts).frozen
    assert not parts.bridge.echo_heartbeats
    box_of(parts).freezable = True
    assert not await freezer.freeze("quiet", 0), "not tried again at once"


async def test_a_kernel_is_thawed_when_no_longer_watched_but_not_once_another_took_it(parts: Parts) -> None:
    freezer = parts.watchdog.freezer
    freezer.watch()
    assert await freezer.freeze("quiet", 0)
    parts.watchdog.stop()  # a detach, a shutdown, a restart
    assert not box_of(parts).frozen
    assert not await freezer.freeze("quiet", 0), "nor frozen again, until watched anew"
    freezer.watch()
    assert await freezer.freeze("quiet", 0)
    container_id = parts.container_id
    parts.site.forget()  # taken over: the sandbox is another process's now
    assert freezer.thaw("a client's message")
    assert parts.backend.sandbox(container_id).frozen, "that process thaws it when it reattaches"
    parts.site.container_id = container_id


async def test_a_sandbox_another_process_froze_is_thawed_when_watched_anew(parts: Parts) -> None:
    box_of(parts).frozen = True  # its last server froze it, then died
    parts.watchdog.start(parts.container_id, WatchLimits())
    await eventually(lambda: not box_of(parts).frozen)


# ---------------------------------------------------------------------- the reattach state


def test_the_reattach_state_reads_back_what_it_wrote(tmp_path: Path) -> None:
    state = ReattachState(
        "c0ffee",
        tmp_path / "k1",
        tmp_path / "k1" / "run3",
        {"key": b"secret", "shell_port": 5000},
        cwd="/srv/work",
        launch_env={"JPY_SESSION_NAME": "a.ipynb"},
        image="img:1",
        narrowed={"memory": "1g"},
        sandbox_env={"MODE": "test"},
        credential_expiry={"warehouse": 1.5},
        revoked_credentials=["b", "a"],
        paused=Paused("sk-1", 4096, 1.0),
        layout={"workspace": "/srv/work", "uid": 1000},
    )
    saved = state.to_dict()
    assert saved["version"] == 1
    assert saved["connection_info"]["key"] == "secret", "JSON: bytes become text"
    assert saved["revoked_credentials"] == ["a", "b"]
    again = ReattachState.from_dict(saved)
    assert again.launches == 3
    assert (again.container_id, again.runtime_dir, again.paused) == ("c0ffee", tmp_path / "k1", state.paused)
    assert again.layout["workspace"] == "/srv/work"
    assert again.layout["volume"] is None
    assert ReattachState.from_dict(again.to_dict()).to_dict() == again.to_dict()


def test_a_reattach_state_of_an_earlier_version_is_read(tmp_path: Path) -> None:
    """What a server before the state's version field wrote (a kernel that outlived an upgrade)."""
    old = {"container_id": "c0ffee", "runtime_dir": str(tmp_path), "launch_dir": None, "connection_info": {}}
    state = ReattachState.from_dict(old)
    assert (state.launch_dir, state.paused, state.narrowed, state.launches) == (None, None, {}, 0)


# ---------------------------------------------------------------------- the provisioner on the fake


@pytest.fixture
def short_runtime() -> Iterator[Path]:
    """A runtime parent folder short enough for unix socket paths (pytest's are not)."""
    folder = Path(tempfile.mkdtemp(prefix="sk-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def fake_provisioners(short_runtime: Path) -> Iterator[Callable[..., Any]]:
    """Provisioners of one kernel, on one FakeBackend (what a later process sees)."""
    from sandbox_kernel.provisioner import SandboxProvisioner

    from .test_provisioner import kernel_spec

    backend = FakeBackend()
    made: list[Any] = []

    def make() -> Any:
        provisioner = SandboxProvisioner(
            kernel_id="k-fake",
            kernel_spec=kernel_spec(),
            parent=None,
            runtime_parent=str(short_runtime),
            backend=backend,
            services=Services(reaper=cast(OrphanReaper, NoReaper())),
        )
        made.append(provisioner)
        return provisioner

    yield make
    for provisioner in made:
        provisioner.watchdog.stop()
        if provisioner.bridge is not None:
            provisioner.bridge.stop()


async def test_a_kernel_reattached_by_another_provisioner_is_the_same_kernel_on_the_same_ports(
    fake_provisioners: Callable[..., Any], tmp_path: Path, short_runtime: Path
) -> None:
    """Launch, detach, reattach: what jupyter_client and sandbox_kernel.reattach do across
    processes, here against the fake backend (the real path: tests/integration/test_sessions.py)."""
    from .test_provisioner import SERVER_ENV

    workspace = tmp_path / "ws"
    workspace.mkdir()
    first = fake_provisioners()
    kwargs = await first.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    info = dict(await first.launch_kernel(**kwargs))
    container_id = first.container_id
    saved = await first.get_provisioner_info()
    await first.detach()
    assert first.container_id is None, "let go of, not stopped"
    assert first.backend.sandbox(container_id).status == "running"

    second = fake_provisioners()
    await second.load_provisioner_info(saved)
    assert second.container_id == container_id
    assert {k: second.connection_info[k] for k in info if k.endswith("_port")} == {
        k: v for k, v in info.items() if k.endswith("_port")
    }, "its clients' ports again"
    assert await second.poll() is None
    second.backend.exit(container_id, 1)
    assert await second.wait() == 1
    await second.cleanup()
    assert second.backend.sandbox(container_id).status == "removed"
    assert list(short_runtime.iterdir()) == [], "its runtime folder is gone"


async def test_a_paused_kernel_reattached_stays_paused_until_it_is_resumed(
    fake_provisioners: Callable[..., Any], tmp_path: Path
) -> None:
    from .test_provisioner import SERVER_ENV

    workspace = tmp_path / "ws"
    workspace.mkdir()
    first = fake_provisioners()
    kwargs = await first.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    await first.launch_kernel(**kwargs)
    paused = await first.pause()
    saved = await first.get_provisioner_info()
    assert saved["paused"]["checkpoint"] == paused.checkpoint
    await first.detach()

    second = fake_provisioners()
    await second.load_provisioner_info(saved)
    assert (second.sleep_state, second.bridge.holding) == ("paused", True)
    assert await second.poll() is None, "a paused kernel's stopped sandbox is not its end"
    await second.resume()
    assert second.sleep_state == "running"
    assert second.backend.sandbox(second.container_id).signals[-1] == signal.SIGUSR2
    await second.cleanup()


async def test_a_frozen_kernel_is_running_takes_signals_and_is_thawed_for_its_next_holder(
    fake_provisioners: Callable[..., Any], tmp_path: Path
) -> None:
    """poll() and the restarter see a running kernel; an interrupt thaws it first; a
    persistent kernel frozen by one process and adopted by another is thawed there."""
    from .test_provisioner import SERVER_ENV

    workspace = tmp_path / "ws"
    workspace.mkdir()
    first = fake_provisioners()
    kwargs = await first.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    await first.launch_kernel(**kwargs)
    box = first.backend.sandbox(first.container_id)
    assert await first.watchdog.freezer.freeze("quiet", 0)
    assert await first.poll() is None
    await first.send_signal(signal.SIGINT)
    assert (box.frozen, box.signals) == (False, [signal.SIGINT])
    saved = await first.get_provisioner_info()
    await first.detach()
    box.frozen = True  # as if the first had died with it frozen

    second = fake_provisioners()
    await second.load_provisioner_info(saved)
    await eventually(lambda: not box.frozen)
    assert await second.poll() is None
    await second.cleanup()


# ---------------------------------------------------------------------- the configured backend


def test_what_runs_outside_a_kernel_uses_the_backend_the_config_chooses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command line, a server's adoption, the reaper and the files API made a
    DockerBackend whatever backend_class said; now they make the configured one."""
    from traitlets.config import Config

    from sandbox_kernel.backends import configured_backend
    from sandbox_kernel.backends.docker import DockerBackend
    from sandbox_kernel.cli.app import ListApp
    from sandbox_kernel.errors import ConfigurationError

    assert isinstance(configured_backend(), DockerBackend), "the default"
    chosen = Config({"SandboxProvisioner": {"backend_class": "sandbox_kernel.backends.fake.FakeBackend"}})
    assert isinstance(configured_backend(chosen), FakeBackend)
    with pytest.raises(ConfigurationError, match=r"not a sandbox_kernel\.backend\.SandboxBackend"):
        configured_backend(Config({"SandboxProvisioner": {"backend_class": "pathlib.Path"}}))
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        configured_backend(Config({"SandboxProvisioner": {"backend_class": "no.such.Backend"}}))
    app = ListApp()  # (a unit test never reaches Docker: the conftest refuses docker.from_env)
    app.initialize(["--SandboxProvisioner.backend_class=sandbox_kernel.backends.fake.FakeBackend", "--json"])
    app.start()
    assert json.loads(capsys.readouterr().out) == []
