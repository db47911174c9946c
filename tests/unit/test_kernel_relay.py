"""The channel relay, run here on the host with a real ipykernel as its child: what it
does inside the sandbox, without the sandbox (see tests/integration for that)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from jupyter_client import BlockingKernelClient
from jupyter_client.session import Session

from sandbox_kernel.channels.bridge import ipc_in_use
from sandbox_kernel.egress import relay as egress_relay
from sandbox_kernel.inside import kernel_app, kernel_relay
from tests.executions import CLOSE_CHANNEL_KEEPER, printing, run_ok, until_idle

CHANNELS = {"shell": 1, "iopub": 2, "stdin": 3, "control": 4, "hb": 5}


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture
def relayed(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """(the relay process, the ipc prefix its host sockets are bound at)."""
    with _running_relay(tmp_path) as running:
        yield running


@pytest.fixture
def all_relayed(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``relayed``, with a kernel that leaves shell and IOPub to the relay too."""
    with _running_relay(tmp_path, "--SandboxedKernelApp.take_channels=False") as running:
        yield running


@contextlib.contextmanager
def _running_relay(tmp_path: Path, *kernel_arguments: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    args, prefix = _relay_arguments(tmp_path, *kernel_arguments)
    relay = subprocess.Popen([sys.executable, kernel_relay.__file__, *args], start_new_session=True)
    try:
        _wait(lambda: all(_sockets(prefix)), "the relay's host sockets")
        yield relay, prefix
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(relay.pid, signal.SIGKILL)  # the kernel with it
        relay.wait()


def _kernel(connection: Path) -> list[str]:
    """The kernel as the sandbox runs it (kernel_app.py, IPython's history in memory)."""
    return [sys.executable, kernel_app.__file__, "-f", str(connection), "--HistoryManager.hist_file=:memory:"]


def _relay_arguments(tmp_path: Path, *kernel_arguments: str) -> tuple[list[str], Path]:
    """(the channel relay's arguments, its kernel's command included, as the sandbox runs
    them; the ipc prefix its host sockets are bound at)."""
    ports = dict(zip(CHANNELS, _free_ports(len(CHANNELS)), strict=True))
    connection = tmp_path / "connection.json"
    info = {"transport": "tcp", "ip": "127.0.0.1", "key": "k", "signature_scheme": "hmac-sha256"}
    connection.write_text(json.dumps({**info, **{f"{name}_port": port for name, port in ports.items()}}))
    prefix = tmp_path / "kernel"
    channels = [f"{name}={prefix}-{CHANNELS[name]}:{port}" for name, port in ports.items()]
    return [*channels, "--", *_kernel(connection), *kernel_arguments], prefix


def _sockets(prefix: Path) -> list[bool]:
    return [Path(f"{prefix}-{number}").exists() for number in CHANNELS.values()]


def _wait(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _client(prefix: Path) -> BlockingKernelClient:
    kc = BlockingKernelClient()
    kc.load_connection_info(
        {
            "transport": "ipc",
            "ip": str(prefix),
            **{f"{name}_port": number for name, number in CHANNELS.items()},
            "key": "k",
            "signature_scheme": "hmac-sha256",
        }
    )
    kc.start_channels()
    kc.wait_for_ready(timeout=60)  # (the kernel may still be starting)
    return kc


def test_a_paused_relay_holds_no_host_socket_and_the_kernel_keeps_its_state(
    relayed: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """SIGUSR1: every host socket closed and its file gone (what a checkpoint needs);
    SIGUSR2: bound again, and a new client finds the kernel as it was, prompts too."""
    relay, prefix = relayed
    kc = _client(prefix)
    assert run_ok(kc, "x = 42; print('set')") == "set\n"
    kc.stop_channels()
    relay.send_signal(signal.SIGUSR1)
    _wait(lambda: not any(_sockets(prefix)), "closing of the host sockets")
    assert not any(Path(f"{prefix}-{n}").exists() for n in CHANNELS.values())
    relay.send_signal(signal.SIGUSR2)
    _wait(lambda: all(_sockets(prefix)), "host sockets again")
    kc = _client(prefix)
    try:
        assert run_ok(kc, "print(x)") == "42\n"
        answered = kc.execute_interactive(
            "print(input('name? '))",
            timeout=30,
            stdin_hook=lambda _msg: kc.input("ada"),
            output_hook=lambda _m: None,
        )
        assert answered["content"]["status"] == "ok"
    finally:
        kc.stop_channels()


def _open_at(prefix: Path) -> dict[str, set[int]]:
    """channel -> the pids of the processes holding a unix socket open at its path (a
    listener, or a connection it accepted): what a checkpoint would meet."""
    paths = {f"{prefix}-{number}": name for name, number in CHANNELS.items()}
    inodes: dict[str, str] = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7 and fields[7] in paths:
            inodes[fields[6]] = paths[fields[7]]
    held: dict[str, set[int]] = {}
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:[") and link[8:-1] in inodes:
                held.setdefault(inodes[link[8:-1]], set()).add(int(fd.parts[2]))
    return held


def _kernel_pid(relay: subprocess.Popen[bytes]) -> int:
    (child,) = Path(f"/proc/{relay.pid}/task/{relay.pid}/children").read_text().split()
    return int(child)


def test_the_kernel_holds_shell_and_iopub_itself_and_lets_go_of_them_for_a_pause(
    relayed: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """The relay lends the kernel the listeners of shell and IOPub (a client's connection
    reaches the kernel with no hop through the relay) and relays the other three. On
    SIGUSR1 no socket of any channel stays open, the connections the kernel accepted
    included (gVisor cannot save one); on SIGUSR2 the kernel holds new ones, and a client
    finds it as it was."""
    relay, prefix = relayed
    kernel = _kernel_pid(relay)
    kc = _client(prefix)
    try:
        assert run_ok(kc, "x = 42; print('set')") == "set\n"
        held = _open_at(prefix)
        assert held["shell"] == held["iopub"] == {kernel}, held
        assert held["control"] == held["stdin"] == held["hb"] == {relay.pid}, held
        relay.send_signal(signal.SIGUSR1)
        _wait(lambda: not _open_at(prefix), "every socket at the channels' paths closed")
    finally:
        kc.stop_channels()
    relay.send_signal(signal.SIGUSR2)
    _wait(lambda: all(_sockets(prefix)), "host sockets again")
    kc = _client(prefix)
    try:
        assert run_ok(kc, "print(x)") == "42\n"
        held = _open_at(prefix)
        assert held["shell"] == held["iopub"] == {kernel}, held
    finally:
        kc.stop_channels()


def test_a_kernel_told_not_to_take_the_channels_over_has_all_five_relayed(tmp_path: Path) -> None:
    """``--SandboxedKernelApp.take_channels=False`` (bench/kernel_choices.py's "all
    relayed"): the relay passes every channel on, as for a kernel that cannot."""
    args, prefix = _relay_arguments(tmp_path, "--SandboxedKernelApp.take_channels=False")
    relay = subprocess.Popen([sys.executable, kernel_relay.__file__, *args], start_new_session=True)
    try:
        _wait(lambda: all(_sockets(prefix)), "the relay's host sockets")
        kc = _client(prefix)
        try:
            assert run_ok(kc, "print(1+1)") == "2\n"
            assert set().union(*_open_at(prefix).values()) == {relay.pid}
        finally:
            kc.stop_channels()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(relay.pid, signal.SIGKILL)
        relay.wait()


def test_kernel_code_that_closes_its_keeper_keeps_its_channels_and_is_relayed_after(
    relayed: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """The attack: kernel code closes the socket its channel keeper reads. The relay never
    waits on it: a pause's request is answered or not (the keeper may still be reading the
    socket as it is closed), and either the kernel let go of its listeners or it holds them
    still, which the host sees (the pause fails, the kernel running on). Asked to bind
    again, the relay cannot lend them: it relays shell and IOPub itself, and clients go on."""
    relay, prefix = relayed
    kernel = _kernel_pid(relay)
    kc = _client(prefix)
    try:
        closed = run_ok(kc, CLOSE_CHANNEL_KEEPER)
        assert closed == "closed\n"
        relay.send_signal(signal.SIGUSR1)
        # (it closes them one by one, the heartbeat's perhaps last)
        only_the_kernels = lambda: set().union(*_open_at(prefix).values()) <= {kernel}  # noqa: E731
        _wait(only_the_kernels, "the relay's own sockets closed", timeout=5)
    finally:
        kc.stop_channels()
    for number in CHANNELS.values():  # as the host does before it asks again
        Path(f"{prefix}-{number}").unlink(missing_ok=True)
    relay.send_signal(signal.SIGUSR2)
    _wait(lambda: all(_sockets(prefix)), "host sockets again")
    kc = _client(prefix)
    try:
        assert run_ok(kc, "print('still here')") == "still here\n"
        held = _open_at(prefix)
        assert relay.pid in held["shell"], held
        assert relay.pid in held["iopub"], held
    finally:
        kc.stop_channels()


def test_sigusr2_binds_afresh_where_the_host_removed_the_files_of_open_sockets(
    relayed: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """A pause that failed, or one its server did not live to finish: the host removes the
    socket files and asks again; the relay binds new ones even if it had never closed."""
    relay, prefix = relayed
    kc = _client(prefix)
    assert run_ok(kc, "x = 42; print('set')") == "set\n"
    kc.stop_channels()
    for number in CHANNELS.values():
        Path(f"{prefix}-{number}").unlink()
    relay.send_signal(signal.SIGUSR2)
    _wait(lambda: all(_sockets(prefix)), "host sockets again")
    kc = _client(prefix)
    try:
        assert run_ok(kc, "print(x)") == "42\n"
    finally:
        kc.stop_channels()


def test_behind_the_egress_relay_the_pause_signals_reach_it_too(tmp_path: Path) -> None:
    """As in a kernel with network "allowlist": the egress relay starts first, becomes a
    daemon and runs the channel relay, which the host signals; both let go of their host
    sockets on SIGUSR1 and bind them again on SIGUSR2."""
    args, prefix = _relay_arguments(tmp_path)
    egress = tmp_path / "egress.sock"
    chain = [sys.executable, egress_relay.__file__, str(egress), "0", "--"]
    relay = subprocess.Popen([*chain, sys.executable, kernel_relay.__file__, *args], start_new_session=True)
    daemon = 0
    try:
        _wait(lambda: all(_sockets(prefix)) and ipc_in_use(str(egress)), "the relays' host sockets")
        environ = Path(f"/proc/{relay.pid}/environ").read_bytes().split(b"\0")
        (named,) = [v for v in environ if v.startswith(kernel_relay.EGRESS_RELAY_PID.encode() + b"=")]
        assert kernel_relay.EGRESS_RELAY_PID == egress_relay.PID_VARIABLE
        daemon = int(named.split(b"=", 1)[1])
        assert b"egress_relay" in Path(f"/proc/{daemon}/cmdline").read_bytes()
        held = socket.socket(socket.AF_UNIX)
        held.connect(str(egress))  # a host connection, as the egress proxy keeps them

        relay.send_signal(signal.SIGUSR1)
        _wait(lambda: not any(_sockets(prefix)), "closing of the channels' host sockets")
        _wait(lambda: not ipc_in_use(str(egress)), "closing of the egress relay's socket")
        held.settimeout(5)
        assert held.recv(1) == b"", "the egress relay closed the host's connection"
        held.close()

        relay.send_signal(signal.SIGUSR2)
        _wait(lambda: all(_sockets(prefix)) and ipc_in_use(str(egress)), "the relays' host sockets again")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(relay.pid, signal.SIGKILL)
        relay.wait()
        if daemon:
            with contextlib.suppress(ProcessLookupError):
                os.kill(daemon, signal.SIGKILL)


def test_the_pause_signals_go_only_to_a_process_that_is_still_the_egress_relay() -> None:
    """Kernel code may end the egress relay; its pid may then be another process's, which
    SIGUSR1 would kill."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        kernel_relay.pass_on(other.pid, signal.SIGUSR1)
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
    kernel_relay.pass_on(None, signal.SIGUSR1)
    kernel_relay.pass_on(2**22 + 1, signal.SIGUSR1)  # no such process: nothing


def test_signals_reach_the_kernel_and_its_status_is_the_relays(
    relayed: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """SIGINT interrupts the running cell (the container's init signals the relay);
    SIGTERM ends the kernel, and the relay exits as it did."""
    relay, prefix = relayed
    kc = _client(prefix)
    try:
        msg_id = kc.execute("import time; print('started', flush=True); time.sleep(60)")
        printing(kc, msg_id, timeout=30)
        relay.send_signal(signal.SIGINT)
        reply = kc.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        until_idle(kc, msg_id)
        assert run_ok(kc, "print('still here')") == "still here\n"
    finally:
        kc.stop_channels()
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(timeout=30) in (0, 128 + signal.SIGTERM)
    assert not any(_sockets(prefix)), "the relay removes its sockets when the kernel is gone"


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--", "python"], "every channel once"),
        (["shell=/p-1:1"], "no '--'"),
        (["shell=/p-1:1", "--"], "no command"),
        (["shell=/p-1:x", "--", "python"], "not CHANNEL=IPC_PATH:PORT"),
        (["web=/p-1:1", "--", "python"], "not CHANNEL=IPC_PATH:PORT"),
    ],
)
def test_bad_arguments_are_refused_saying_why(args: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        kernel_relay.parse(args)


def test_a_kernel_killed_by_a_signal_gives_the_shells_status() -> None:
    assert kernel_relay._status(-9) == 137
    assert kernel_relay._status(3) == 3


def test_heartbeats_are_answered_while_the_kernel_lives(
    relayed: tuple[subprocess.Popen[bytes], Path],
) -> None:
    _, prefix = relayed
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        ping = context.socket(zmq.REQ)
        ping.linger = 0
        ping.connect(f"ipc://{prefix}-{CHANNELS['hb']}")
        for beat in (b"one", b"two"):
            ping.send(beat)
            assert ping.poll(60_000), "no heartbeat within 60 s"  # (the kernel may still be starting)
            assert ping.recv() == beat
    finally:
        context.destroy(linger=0)


class _Sandbox:
    """What Holding sees of a sandbox: its processes' states, the folder's seal, the
    signals it sends."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, inside: bool = True, sealed: bool = True) -> None:
        self.sealed = sealed
        self.states = {3: "S", 21: "T", 40: "R"}  # the kernel, a job kernel code stopped, a child
        self.sent: list[tuple[int, int]] = []
        monkeypatch.setattr(kernel_relay, "in_sandbox", lambda: inside)
        monkeypatch.setattr(kernel_relay, "processes", lambda: sorted(self.states.items()))
        monkeypatch.setattr(kernel_relay.Holding, "sealed", lambda _self: self.sealed)
        monkeypatch.setattr(kernel_relay, "pass_on", lambda pid, signum, kill: pid and kill(pid, signum))

    def kill(self, pid: int, signum: int) -> None:
        self.sent.append((pid, signum))


def test_the_rest_of_the_sandbox_is_stopped_from_the_pause_until_the_folder_is_sealed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGUSR1 stops every other process (the egress relay goes on); once bound again on
    SIGUSR2 the relay waits for the host's seal, then lets go on all it stopped, and not
    what was stopped before."""
    sandbox = _Sandbox(monkeypatch)
    holding = kernel_relay.Holding("/run/sandbox-kernel", egress_pid=7, kill=sandbox.kill)
    holding.stop()
    assert sandbox.sent == [(-1, signal.SIGSTOP), (7, signal.SIGCONT)]
    holding.stop()  # a second SIGUSR1 changes nothing
    assert len(sandbox.sent) == 2
    sandbox.sealed = False  # the host lends the folder; the relay binds again
    holding.bound()
    assert holding.poll() == pytest.approx(0.005)
    assert len(sandbox.sent) == 2, "nothing goes on while the folder is lent"
    sandbox.sealed = True
    assert holding.poll() is None
    assert sandbox.sent[2:] == [(3, signal.SIGCONT), (40, signal.SIGCONT)]
    assert holding.poll() is None


def test_the_sandbox_is_not_stopped_where_the_host_never_seals_nor_outside_a_sandbox(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host that is not root never seals (its kernel shares its uid): nothing to wait
    for. And on a host (the relay run by hand, or by these tests), kill(-1) would stop
    every process of the user: the relay never sends it there."""
    for inside, sealed in ((True, False), (False, True)):
        sandbox = _Sandbox(monkeypatch, inside=inside, sealed=sealed)
        holding = kernel_relay.Holding("/run/sandbox-kernel", egress_pid=None, kill=sandbox.kill)
        holding.stop()
        holding.bound()
        assert holding.poll() is None
        assert sandbox.sent == []


def test_the_relay_knows_it_is_not_in_a_sandbox_here() -> None:
    assert kernel_relay.in_sandbox() is False


def test_without_the_seal_the_sandbox_goes_on_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that died before sealing: the kernel does not stay stopped for ever."""
    sandbox = _Sandbox(monkeypatch)
    holding = kernel_relay.Holding("/run/sandbox-kernel", egress_pid=None, kill=sandbox.kill)
    holding.stop()
    sandbox.sealed = False
    holding.bound()
    monkeypatch.setattr(kernel_relay, "SEAL_TIMEOUT", 0.0)
    time.sleep(0.01)
    assert holding.poll() is None
    assert (3, signal.SIGCONT) in sandbox.sent


# ---------------------------------------------------------------- bytes, end to end


def _dealer(context: zmq.Context[zmq.Socket[bytes]], prefix: Path, identity: bytes) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(f"ipc://{prefix}-{CHANNELS['shell']}")
    return sock


def _kernel_info(sock: zmq.Socket[bytes], session: Session) -> dict[str, Any]:
    session.send(sock, "kernel_info_request", {})
    # The relay's sockets come once the kernel's ports accept: it may still be starting.
    assert sock.poll(60_000), "no kernel_info_reply within 60 s"
    _, reply = session.feed_identities(sock.recv_multipart())
    return session.deserialize(reply)


def test_a_peer_connecting_again_as_itself_takes_its_identity_over(
    relayed: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """The host's bridge connects with one identity, and again with the same one after a
    pause or a cut: the kernel (kernel_app.py's ROUTER_HANDOVER on shell and stdin) answers
    the new connection even while the old one is still open, where a plain ipykernel
    ignores it and reads its next message as its identity."""
    _, prefix = relayed
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    session = Session(key=b"k")
    try:
        first = _dealer(context, prefix, b"sandbox-kernel-bridge")
        assert _kernel_info(first, session)["msg_type"] == "kernel_info_reply"
        second = _dealer(context, prefix, b"sandbox-kernel-bridge")
        assert _kernel_info(second, session)["msg_type"] == "kernel_info_reply"
    finally:
        context.destroy(linger=0)


def test_a_client_that_stops_reading_output_holds_up_only_its_own_connection(
    all_relayed: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """The relay's flow control is each connection's own: while one client reads none of a
    flood of output, the kernel goes on (its IOPub drops what that client cannot take, as
    ZeroMQ does for any slow subscriber), another client gets every line and the reply,
    and the first one's own requests are still answered. (A kernel that holds IOPub's
    listener itself is ZeroMQ's alone, as a local kernel: one subscriber's queue full
    drops that subscriber's messages. In the product its one subscriber is the host's
    bridge.)"""
    _, prefix = all_relayed
    stalled, other = _client(prefix), _client(prefix)
    try:
        stalled.iopub_channel.stop()  # reads nothing from now on: its socket stays connected
        # Far more than the socket buffers on the way hold: the relay must hold back.
        count, size = 1500, 20_000
        shown: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "display_data":
                shown.append(msg["content"]["data"]["text/plain"])

        code = (
            "from IPython.display import display\n"
            f"for i in range({count}): display({{'text/plain': str(i) + 'x' * {size}}}, raw=True)"
        )
        reply = other.execute_interactive(code, timeout=120, output_hook=hook)
        assert reply["content"]["status"] == "ok"
        assert [int(text.rstrip("x")) for text in shown] == list(range(count))
        msg_id = stalled.kernel_info()
        assert stalled.get_shell_msg(timeout=30)["parent_header"]["msg_id"] == msg_id
    finally:
        stalled.stop_channels()
        other.stop_channels()


def test_the_kernel_welcomes_each_iopub_subscriber_through_the_relay(
    relayed: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """ZeroMQ runs end to end: a subscription reaches ipykernel's XPUB, which answers with
    an ``iopub_welcome`` (a relay of whole messages kept subscriptions to itself).

    The kernel may still be starting as the subscriber connects (the relay's sockets come
    once its ports accept): what it publishes between taking up the subscription and
    answering it (its ``starting`` status, a line its start-up printed) comes before the
    welcome, as it can from a local kernel (CI runs saw both)."""
    _, prefix = relayed
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    session = Session(key=b"k")
    try:
        sub = context.socket(zmq.SUB)
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{prefix}-{CHANNELS['iopub']}")
        before: list[str] = []
        deadline = time.monotonic() + 60  # (the kernel may still be starting)
        while "iopub_welcome" not in before:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            assert sub.poll(left), f"no welcome in 60 s: {before}"
            _, frames = session.feed_identities(sub.recv_multipart())
            before.append(session.deserialize(frames)["msg_type"])
        assert set(before) <= {"status", "stream", "iopub_welcome"}, before
    finally:
        context.destroy(linger=0)


def test_the_keeper_never_waits_past_its_timeout_nor_takes_a_late_answer_for_a_new_one() -> None:
    """A kernel that does not answer costs the relay ``timeout`` seconds, no more, and is
    taken to hold its listeners still; its answer, come late (read before or after the
    next request went out), or anything else kernel code writes, is not taken for the
    answer to the next pause's request."""
    keeper = kernel_relay.Keeper()
    kernel_end = keeper.kernel_end
    try:
        listener = socket.socket(socket.AF_UNIX)
        keeper.lend("shell", "/nowhere", listener)
        listener.close()
        started = time.monotonic()
        assert not keeper.take_back(0.3)
        assert 0.3 <= time.monotonic() - started < 2
        assert keeper.lent == {"shell"}
        assert kernel_end.recv(64) == b"bind shell /nowhere"
        assert kernel_end.recv(64) == b"release 1"
        kernel_end.send(b"released 1")  # late: waiting before the next request
        assert not keeper.take_back(0.3), "a late answer was taken for this one"
        assert kernel_end.recv(64) == b"release 2"
        threading.Timer(0.05, kernel_end.send, (b"released 2",)).start()  # late
        threading.Timer(0.1, kernel_end.send, (b"released",)).start()  # kernel code's
        assert not keeper.take_back(0.3)
        assert kernel_end.recv(64) == b"release 3"
        kernel_end.send(b"released 3")  # late
        threading.Timer(0.1, kernel_end.send, (b"released 4",)).start()  # in time, after the late one
        assert keeper.take_back(5)
        assert kernel_end.recv(64) == b"release 4"
        assert not keeper.lent
    finally:
        keeper.sock.close()
        kernel_end.close()


def test_a_keeper_whose_kernel_end_is_shut_down_is_given_up_at_once() -> None:
    """The attack: kernel code shuts its end down, so that every read of the relay's end
    returns at once with nothing. The relay neither spins nor waits: no answer, the
    listeners taken to be held still, and nothing more lent."""
    keeper = kernel_relay.Keeper()
    try:
        listener = socket.socket(socket.AF_UNIX)
        keeper.lend("shell", "/nowhere", listener)
        listener.close()
        keeper.kernel_end.shutdown(socket.SHUT_RDWR)
        started = time.monotonic()
        assert not keeper.take_back(30)
        assert time.monotonic() - started < 1
        assert keeper.gone
        assert keeper.lent == {"shell"}
    finally:
        keeper.sock.close()
        keeper.kernel_end.close()
