"""KernelBridge between real pyzmq sockets: a fake kernel on ipc://, clients on tcp or ipc.

Messages are real signed Jupyter messages (jupyter_client's Session); the attacks are
sent the way a local user without the key, or code in the kernel, would send them.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from jupyter_client.session import Session

from sandbox_kernel.channels.audit import AuditLog, ExecutionAuditor
from sandbox_kernel.channels.bridge import CHANNELS, CurveKeys, KernelBridge, SizeCaps
from sandbox_kernel.channels.output import OutputLimiter
from sandbox_kernel.channels.sanitize import OutputSanitizer
from sandbox_kernel.channels.wire import find_delimiter, frame_bytes, stderr_notice
from tests.unit.conftest import Ctx

#: How long a message that must come may take (a loaded machine's threads pause for seconds);
#: where nothing must come, the tests wait far less before concluding so.
TIMEOUT_MS = 10_000
KEY = b"a-session-key"

#: Socket type of each channel in the fake kernel, as ipykernel binds them.
KERNEL_SOCKET_TYPES = {
    "shell": zmq.ROUTER,
    "iopub": zmq.PUB,
    "stdin": zmq.ROUTER,
    "control": zmq.ROUTER,
    "hb": zmq.ROUTER,
}


@pytest.fixture
def session() -> Session:
    return Session(key=KEY)


@pytest.fixture
def kernel(ctx: Ctx, tmp_path: Path) -> dict[str, zmq.Socket[bytes]]:
    """The fake kernel: one socket per channel, bound where the bridge will connect."""
    sockets = {}
    for channel, kind in KERNEL_SOCKET_TYPES.items():
        sock = ctx.socket(kind)
        sock.linger = 0
        if kind == zmq.ROUTER and channel != "hb":
            sock.router_handover = 1  # as ipykernel sets it
        sock.bind(f"ipc://{tmp_path}/{channel}")
        sockets[channel] = sock
    return sockets


@pytest.fixture
def endpoints(tmp_path: Path) -> dict[str, str]:
    return {channel: f"ipc://{tmp_path}/{channel}" for channel in CHANNELS}


class Tap:
    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def __call__(self, channel: str, to_kernel: bool, frames: Any) -> None:
        self.seen.append((channel, to_kernel))


@pytest.fixture
def tap() -> Tap:
    return Tap()


@pytest.fixture
def bridge(
    endpoints: dict[str, str], kernel: dict[str, zmq.Socket[bytes]], tap: Tap
) -> Iterator[KernelBridge]:
    bridge = KernelBridge(endpoints, key=KEY, tap=tap)
    bridge.start()
    yield bridge
    bridge.stop()


def client(ctx: Ctx, kind: int, address: str, curve_server_key: bytes | None = None) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.linger = 0
    if curve_server_key is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = curve_server_key
    sock.connect(address)
    return sock


def recv(sock: zmq.Socket[bytes], timeout_ms: int = TIMEOUT_MS) -> list[bytes]:
    if not sock.poll(timeout_ms):
        raise AssertionError(f"nothing arrived within {timeout_ms} ms")
    return sock.recv_multipart()


def request(session: Session, msg_type: str = "kernel_info_request", **content: Any) -> list[bytes]:
    return list(session.serialize(session.msg(msg_type, content)))


def answer(session: Session, kernel: zmq.Socket[bytes], received: list[bytes]) -> list[bytes]:
    """The fake kernel answers ``received`` (routing frames kept) with a signed reply."""
    idents, msg = session.feed_identities(received)
    parent = session.deserialize(msg)
    reply = session.msg(parent["msg_type"].replace("_request", "_reply"), {"status": "ok"}, parent=parent)
    frames = list(session.serialize(reply, ident=idents))
    kernel.send_multipart(frames)
    return frames


def round_trip(
    ctx: Ctx,
    session: Session,
    kernel: zmq.Socket[bytes],
    address: str,
    curve_server_key: bytes | None = None,
) -> dict[str, Any]:
    """A client sends a signed request; the kernel answers; returns the reply the client got."""
    dealer = client(ctx, zmq.DEALER, address, curve_server_key)
    dealer.send_multipart(request(session))
    answer(session, kernel, recv(kernel))
    _, msg = session.feed_identities(recv(dealer))
    return session.deserialize(msg)


def test_the_bridge_listens_on_five_localhost_ports(bridge: KernelBridge) -> None:
    assert bridge.running
    assert set(bridge.ports) == set(CHANNELS)
    assert len(set(bridge.ports.values())) == 5
    assert bridge.ip == "127.0.0.1"


class _PipeGoingAway:
    """A kernel-facing DEALER as libzmq 4.3.x is when its pipe goes away in the middle of
    a message (``lb_t::sendpipe``): the frame that finds the pipe gone fails with EAGAIN,
    and libzmq then throws away, while reporting success, every frame up to the end of a
    message, which has to be this one's rest, or it is the next message."""

    def __init__(self, fails_at: int) -> None:
        self.fails_at, self.calls, self.delivered = fails_at, 0, []
        self.dropping = self.in_message = False

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        self.calls += 1
        more = bool(flags & zmq.SNDMORE)
        if self.dropping:
            self.dropping = more
            return
        if self.calls == self.fails_at:
            # (On a message's first frame it is the high-water mark: nothing is thrown away.)
            self.dropping, self.in_message = self.in_message and more, False
            raise zmq.Again
        self.in_message = more
        self.delivered.append(frame)


@pytest.mark.parametrize("fails_at", [1, 3, 6])
def test_a_message_cut_off_in_the_middle_takes_nothing_of_the_next_with_it(
    bridge: KernelBridge, session: Session, fails_at: int
) -> None:
    """A send that fails part of the way through a message goes through with the rest,
    so that what libzmq throws away ends with it: the next message arrives whole."""
    peer = _PipeGoingAway(fails_at)
    first, second = request(session), request(session)
    bridge._pass(peer, "shell", True, first)  # type: ignore[arg-type]
    peer.delivered.clear()
    bridge._pass(peer, "shell", True, second)  # type: ignore[arg-type]
    assert peer.delivered == second
    assert bridge.dropped["shell message from a client: the receiver is not keeping up"] == 1


@pytest.mark.parametrize("channel", ["shell", "control"])
def test_a_signed_request_and_its_reply_cross_the_bridge(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge, channel: str
) -> None:
    reply = round_trip(ctx, session, kernel[channel], bridge.endpoint(channel))
    assert reply["msg_type"] == "kernel_info_reply"
    assert bridge.messages[channel] == 2
    assert not bridge.dropped


def test_stdin_reaches_the_kernel_from_the_same_peer_as_shell(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    """ipykernel sends input_request to the identity the shell request came from."""
    shell, stdin = (
        client(ctx, zmq.DEALER, bridge.endpoint("shell")),
        client(ctx, zmq.DEALER, bridge.endpoint("stdin")),
    )
    shell.send_multipart(request(session))
    stdin.send_multipart(request(session, "input_reply"))
    assert recv(kernel["shell"])[0] == recv(kernel["stdin"])[0]


def test_of_two_clients_with_one_identity_only_the_last_to_connect_is_heard(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    """Why a server's kernel connection that a newer one of its session replaced must not
    open (:mod:`sandbox_kernel.jupyter.server_audit`): the route of an identity goes to the
    last client that connected with it, and the other one's requests reach nothing, for ever."""

    def with_identity() -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.linger, sock.identity = 0, b"the-session-id"
        sock.connect(bridge.endpoint("shell"))
        return sock

    live = with_identity()
    live.send_multipart(request(session))
    answer(session, kernel["shell"], recv(kernel["shell"]))
    recv(live)
    stale = with_identity()
    stale.send_multipart(request(session))
    recv(kernel["shell"])  # the stale one's: it holds the route now
    live.send_multipart(request(session))
    assert not kernel["shell"].poll(1000), "the live client's request arrived"


def test_heartbeats_are_echoed(ctx: Ctx, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge) -> None:
    req = client(ctx, zmq.REQ, bridge.endpoint("hb"))
    req.send(b"ping")
    kernel["hb"].send_multipart(recv(kernel["hb"]))  # the kernel's heartbeat echoes
    assert recv(req) == [b"ping"]


def publish_until_received(
    kernel: zmq.Socket[bytes], sub: zmq.Socket[bytes], frames: list[bytes], timeout: float = TIMEOUT_MS / 1000
) -> list[bytes] | None:
    """The subscription travels client -> bridge -> kernel asynchronously: publish until it
    lands. What was published before may arrive after (see :func:`drain`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kernel.send_multipart(frames)
        if sub.poll(50):
            return sub.recv_multipart()
    return None


def msg_id(frames: list[bytes]) -> str:
    """The message's id, read without deserializing (a copy again would be a replay to Session)."""
    return str(json.loads(frames[frames.index(b"<IDS|MSG>") + 2])["msg_id"])


def drain(session: Session, kernel: zmq.Socket[bytes], sub: zmq.Socket[bytes]) -> list[str]:
    """Read what the kernel published so far (the copies :func:`publish_until_received` left
    on their way): up to a marker published after them, which comes after them all. The
    ids of what came before it."""
    marker = session.msg("status", {"execution_state": "busy"})
    kernel.send_multipart(list(session.serialize(marker, ident=[b"kernel.k1.status"])))
    before = []
    while (got := msg_id(recv(sub))) != marker["msg_id"]:
        before.append(got)
    return before


def subscriber(ctx: Ctx, bridge: KernelBridge) -> zmq.Socket[bytes]:
    sub = client(ctx, zmq.SUB, bridge.endpoint("iopub"))
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub


def status(session: Session, state: str = "busy", **extra: Any) -> list[bytes]:
    msg = session.msg("status", {"execution_state": state, **extra})
    return list(session.serialize(msg, ident=[b"kernel.k1.status"]))


def test_signed_iopub_messages_reach_a_subscriber(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    got = publish_until_received(kernel["iopub"], subscriber(ctx, bridge), status(session))
    assert got is not None
    assert session.deserialize(session.feed_identities(got)[1])["content"] == {"execution_state": "busy"}


# ---------------------------------------------------------------- attacks from local users


def test_an_unsigned_request_acts_on_nothing(
    ctx: Ctx, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge, tap: Tap
) -> None:
    """A local user without the key forges an execute_request: it never reaches the kernel,
    the audit log (the tap), the output budget or the idle clock."""
    forger = Session(key=b"")  # what an attacker without the key can do
    forged = forger.msg("execute_request", {"code": "curl evil | sh"})
    forged["header"]["username"] = "alice"
    dealer = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    dealer.send_multipart(list(forger.serialize(forged)))
    wrong_key = Session(key=b"guessed")
    dealer.send_multipart(list(wrong_key.serialize(wrong_key.msg("execute_request", {"code": "x"}))))
    dealer.send_multipart([b"<IDS|MSG>", b"", b"{}", b"{}", b"{}", b"{}"])
    assert not kernel["shell"].poll(300)
    assert tap.seen == []
    assert bridge.dropped["shell message from a client: bad signature"] == 3
    assert not bridge.requests_in_flight(60)


def test_a_huge_unsigned_message_is_cut_off_unread(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str]
) -> None:
    caps = SizeCaps(client=1024 * 1024)
    bridge = KernelBridge(endpoints, key=KEY, caps=caps)
    bridge.start()
    try:
        dealer = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
        dealer.send_multipart([b"<IDS|MSG>", b"", b"{}", b"{}", b"{}", b"x" * (2 * 1024 * 1024)])
        assert not kernel["shell"].poll(300)
        # The bridge still serves everyone else.
        assert (
            round_trip(ctx, session, kernel["shell"], bridge.endpoint("shell"))["msg_type"]
            == "kernel_info_reply"
        )
    finally:
        bridge.stop()


def test_by_default_clients_connect_over_ipc_in_a_private_folder(
    ctx: Ctx,
    session: Session,
    kernel: dict[str, zmq.Socket[bytes]],
    endpoints: dict[str, str],
    tmp_path: Path,
) -> None:
    private = tmp_path / "runtime"
    private.mkdir(mode=0o700)
    bridge = KernelBridge(endpoints, ip=str(private / "client"), transport="ipc", key=KEY)
    bridge.start()
    try:
        assert bridge.endpoint("shell") == f"ipc://{private}/client-1"
        names = {p.name for p in private.iterdir()}
        assert names == {f"client-{n}" for n in range(1, 6)} | {f".client-{n}.sock" for n in range(1, 6)}
        assert (
            round_trip(ctx, session, kernel["shell"], bridge.endpoint("shell"))["msg_type"]
            == "kernel_info_reply"
        )
    finally:
        bridge.stop()
    assert list(private.iterdir()) == []


def test_an_ipc_socket_removed_by_a_restart_is_bound_again(
    ctx: Ctx,
    session: Session,
    kernel: dict[str, zmq.Socket[bytes]],
    endpoints: dict[str, str],
    tmp_path: Path,
) -> None:
    """jupyter_client's restart removes ipc files (cleanup_ipc_files); the bridge lives on."""
    bridge = KernelBridge(endpoints, ip=str(tmp_path / "client"), transport="ipc", key=KEY)
    bridge.start()
    try:
        connected = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
        connected.send_multipart(request(session))
        answer(session, kernel["shell"], recv(kernel["shell"]))
        recv(connected)
        for n in range(1, 6):
            os.remove(tmp_path / f"client-{n}")
        bridge.attach(endpoints)  # what a restart does
        assert (
            round_trip(ctx, session, kernel["shell"], bridge.endpoint("shell"))["msg_type"]
            == "kernel_info_reply"
        )
        connected.send_multipart(request(session))  # the old connection still works
        answer(session, kernel["shell"], recv(kernel["shell"]))
        assert recv(connected)
    finally:
        bridge.stop()


def test_a_second_bridge_never_takes_a_live_bridges_ipc_socket(
    endpoints: dict[str, str], kernel: dict[str, zmq.Socket[bytes]], tmp_path: Path
) -> None:
    first = KernelBridge(endpoints, ip=str(tmp_path / "client"), transport="ipc", key=KEY)
    first.start()
    try:
        second = KernelBridge(endpoints, ip=str(tmp_path / "client"), transport="ipc", key=KEY)
        with pytest.raises(zmq.ZMQError) as caught:
            second.start()
        assert caught.value.errno == errno.EADDRINUSE
        assert first.running
    finally:
        first.stop()


# ---------------------------------------------------------------- attacks from the kernel


def test_unsigned_output_from_the_kernel_is_dropped_and_counted(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    sub = subscriber(ctx, bridge)
    # The way through first: the kernel's PUB drops what nobody has subscribed to yet.
    assert publish_until_received(kernel["iopub"], sub, status(session)) is not None
    forged = status(Session(key=b"other"))
    kernel["iopub"].send_multipart(forged)
    assert msg_id(forged) not in drain(session, kernel["iopub"], sub), "in order: before the marker"
    assert bridge.dropped["iopub message from the kernel: bad signature"] == 1


def test_the_kernel_answers_only_requests_a_client_sent_once_and_to_that_client(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    asker = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    bystander = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    bystander.send_multipart(request(session))
    bystander_seen = recv(kernel["shell"])
    answer(session, kernel["shell"], bystander_seen)
    recv(bystander)

    asker.send_multipart(request(session, "execute_request", code="spin()"))
    seen = recv(kernel["shell"])
    reply = answer(session, kernel["shell"], seen)
    assert recv(asker)
    # The same reply again (a forged second reply), and one aimed at the bystander's route.
    kernel["shell"].send_multipart(reply)
    kernel["shell"].send_multipart([bystander_seen[0], *reply[1:]])
    unsolicited = session.msg("execute_reply", {"status": "ok"}, parent=session.msg("execute_request", {}))
    kernel["shell"].send_multipart(list(session.serialize(unsolicited, ident=[bystander_seen[0]])))
    assert not asker.poll(300)
    assert not bystander.poll(100)
    assert bridge.dropped["shell message from the kernel: reply to no pending request"] == 3


def test_a_reply_goes_to_its_requester_whatever_route_the_kernel_names(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    asker = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    other = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    other.send_multipart(request(session))
    other_route = recv(kernel["shell"])[0]
    asker.send_multipart(request(session))
    _, msg = session.feed_identities(recv(kernel["shell"]))
    parent = session.deserialize(msg)
    reply = session.msg("kernel_info_reply", {"status": "ok"}, parent=parent)
    kernel["shell"].send_multipart(list(session.serialize(reply, ident=[other_route])))
    assert recv(asker)
    assert not other.poll(200)


def test_a_deeply_nested_header_does_not_stop_the_relay(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    """b"[" * 1005 as a header once raised RecursionError and killed the relay for good."""
    sub = subscriber(ctx, bridge)
    nested = [b"kernel.k1.status", b"<IDS|MSG>", b"", b"[" * 100_000, b"{}", b"{}", b"{}"]
    signed = list(nested)
    signed[2] = session.sign(nested[3:7])
    for _ in range(3):
        kernel["iopub"].send_multipart(signed)
    assert publish_until_received(kernel["iopub"], sub, status(session)) is not None
    assert bridge.running


def test_a_restart_always_brings_a_working_relay(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str]
) -> None:
    bridge = KernelBridge(endpoints, key=KEY)
    bridge.start()
    try:
        for _ in range(5):
            bridge.detach()
            bridge.detach()  # a stop sent to no thread must not end the next one
            bridge.attach(endpoints)
            assert bridge.running
        assert (
            round_trip(ctx, session, kernel["shell"], bridge.endpoint("shell"))["msg_type"]
            == "kernel_info_reply"
        )
    finally:
        bridge.stop()


def fuzz_frames(rng: random.Random, session: Session) -> list[bytes]:
    """Random, truncated, nested, huge or non-UTF-8 frames, sometimes validly signed."""
    kind = rng.randrange(8)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 9))]
    if kind == 1:
        return [b"<IDS|MSG>"] * rng.randrange(1, 9)
    if kind == 2:
        return [b"<IDS|MSG>", b"", b"[" * rng.randrange(900, 5000), b"{}", b"{}", b"{}"]
    if kind == 3:
        return [b"<IDS|MSG>", b"", b"\xff\xfe" * 50, b"\x80", b"{", b"}"]
    if kind == 4:
        return [b"<IDS|MSG>", b"", b"x" * rng.randrange(100_000, 2_000_000), b"{}", b"{}", b"{}"]
    message = list(session.serialize(session.msg("execute_request", {"code": "1"})))
    if kind == 5:
        return message[: rng.randrange(1, len(message))]
    if kind == 6:  # validly signed garbage
        body = [rng.choice([b"[", b"{}", b"null", b"\xff", b'{"msg_id": 5}', b"[]" * 600]) for _ in range(4)]
        return [b"<IDS|MSG>", session.sign(body), *body, rng.randbytes(10)]
    return [b"topic", *message, rng.randbytes(rng.randrange(0, 10))]


def kernel_answers_again(ctx: Ctx, session: Session, kernel: zmq.Socket[bytes], address: str) -> int:
    """A new client's request reaches the kernel and its reply comes back: how many were
    sent. The fuzzing's signed requests that the bridge passed on may still be arriving
    (the kernel reads up to the new one), and one sent while the bridge replaces a
    kernel-facing socket that ZeroMQ cut off for an oversized frame is lost with it (in
    the server, the meter drops such a message first, and the socket stays connected)."""
    dealer = client(ctx, zmq.DEALER, address)
    for sent in itertools.count(1):
        marker = session.msg("kernel_info_request", {})
        dealer.send_multipart(list(session.serialize(marker)))
        while kernel.poll(2000):  # (the fuzzing's signed messages may be garbage, or sent twice)
            received = kernel.recv_multipart()
            if marker["header"]["msg_id"].encode() in session.feed_identities(received)[1][1]:
                answer(session, kernel, received)
                reply = session.deserialize(session.feed_identities(recv(dealer))[1])
                assert reply["parent_header"]["msg_id"] == marker["header"]["msg_id"]
                return sent
        assert sent < 10, "the kernel never got a request again"
    raise AssertionError  # (unreachable)


def test_fuzz_every_channel_from_both_sides(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str], tap: Tap
) -> None:
    bridge = KernelBridge(
        endpoints, key=KEY, tap=tap, caps=SizeCaps(client=1024 * 1024, kernel_reply=1024 * 1024)
    )
    bridge.start()
    rng = random.Random(8)  # noqa: S311  # repeatable fuzzing, not secrets
    clients = {
        "shell": client(ctx, zmq.DEALER, bridge.endpoint("shell")),
        "control": client(ctx, zmq.DEALER, bridge.endpoint("control")),
        "stdin": client(ctx, zmq.DEALER, bridge.endpoint("stdin")),
        "hb": client(ctx, zmq.DEALER, bridge.endpoint("hb")),
        "iopub": client(ctx, zmq.XSUB, bridge.endpoint("iopub")),
    }
    try:
        for _ in range(400):
            channel = rng.choice(list(CHANNELS))
            frames = fuzz_frames(rng, session)
            if rng.random() < 0.5:
                clients[channel].send_multipart(frames)
            elif channel == "iopub":
                kernel["iopub"].send_multipart(frames)
            elif KERNEL_SOCKET_TYPES[channel] == zmq.ROUTER:
                kernel[channel].send_multipart([b"sandbox-kernel-bridge", *frames])
        for channel in ("shell", "control"):
            assert kernel_answers_again(ctx, session, kernel[channel], bridge.endpoint(channel)) <= 3
        assert bridge.running
        assert publish_until_received(kernel["iopub"], subscriber(ctx, bridge), status(session)) is not None
    finally:
        bridge.stop()


@pytest.mark.timeout(60)  # (the bridge's thread once blocked for good here, and stop() with it)
def test_an_injection_from_the_bridge_thread_while_others_wait_leaves_the_bridge_relaying(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str]
) -> None:
    """The auditor injects from the bridge's own thread (a reply it takes for lost), which
    delivers at once whatever other threads injected before (the meter's word of a
    dropped message, the host's notices). The relay then went on to the inject socket it
    had polled readable in the same round, found it emptied, and blocked reading it."""
    busy, go_on = threading.Event(), threading.Event()

    def tap(channel: str, to_kernel: bool, frames: Any) -> None:
        if channel == "control" and to_kernel:
            busy.set()
            go_on.wait(10)  # the bridge's thread held while the next two wait
        elif channel == "shell" and to_kernel:
            bridge.inject("iopub", status(session))

    bridge = KernelBridge(endpoints, key=KEY, tap=tap)
    bridge.start()
    try:
        shell = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
        control = client(ctx, zmq.DEALER, bridge.endpoint("control"))
        control.send_multipart(request(session))
        assert busy.wait(10)
        bridge.inject("iopub", status(session))  # from another thread
        shell.send_multipart(request(session))  # its tap injects on the bridge's thread
        time.sleep(0.2)  # (both at the bridge's sockets when it polls again)
        go_on.set()
        assert recv(kernel["control"])
        shell.send_multipart(request(session))
        for _ in range(2):
            assert session.deserialize(session.feed_identities(recv(kernel["shell"]))[1])["msg_type"] == (
                "kernel_info_request"
            )
    finally:
        go_on.set()
        bridge.stop()


# ---------------------------------------------------------------- lifecycle


def test_stop_frees_the_ports_and_a_new_bridge_reuses_them(
    ctx: Ctx, session: Session, endpoints: dict[str, str], kernel: dict[str, zmq.Socket[bytes]]
) -> None:
    first = KernelBridge(endpoints, key=KEY)
    ports = dict(first.start())
    first.stop()
    assert not first.running

    # Free as soon as stop() returns. The probe has a context of its own: terminating it
    # releases the ports again before the next bridge binds them.
    probe: Ctx = zmq.Context()
    try:
        for port in ports.values():
            probe.socket(zmq.ROUTER).bind(f"tcp://127.0.0.1:{port}")
    finally:
        probe.destroy(linger=0)

    # A live kernel polls its sockets all the time, and that is when its ROUTER drops the
    # old bridge's peer; until then it would refuse a new peer with the same identity.
    assert not kernel["shell"].poll(100)

    second = KernelBridge(endpoints, ports=ports, key=KEY)
    try:
        assert second.start() == ports
        assert (
            round_trip(ctx, session, kernel["shell"], second.endpoint("shell"))["msg_type"]
            == "kernel_info_reply"
        )
    finally:
        second.stop()


def test_start_twice_returns_the_same_ports(bridge: KernelBridge) -> None:
    assert bridge.start() == bridge.ports


def test_a_taken_port_fails_start_and_leaves_nothing_bound(ctx: Ctx, endpoints: dict[str, str]) -> None:
    squatter = ctx.socket(zmq.ROUTER)
    squatter.linger = 0
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    bridge = KernelBridge(endpoints, ports={"iopub": port})
    with pytest.raises(zmq.ZMQError):
        bridge.start()
    assert not bridge.running
    assert bridge.ports == {}


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CurveZMQ")
def test_with_curve_only_encrypted_clients_get_through(
    ctx: Ctx, session: Session, endpoints: dict[str, str], kernel: dict[str, zmq.Socket[bytes]]
) -> None:
    public, secret = zmq.curve_keypair()
    bridge = KernelBridge(endpoints, curve=CurveKeys(public=public, secret=secret), key=KEY)
    bridge.start()
    try:
        reply = round_trip(ctx, session, kernel["shell"], bridge.endpoint("shell"), curve_server_key=public)
        assert reply["msg_type"] == "kernel_info_reply"

        plain = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
        plain.send_multipart(request(session))
        assert not kernel["shell"].poll(200)
    finally:
        bridge.stop()


def test_a_kernel_cut_off_for_an_oversized_frame_is_reconnected(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str]
) -> None:
    """ZeroMQ never reconnects a peer it cut off for MAXMSGSIZE: the bridge must, or one big
    display would silence the kernel's output until a restart."""
    bridge = KernelBridge(endpoints, key=KEY, caps=SizeCaps(kernel_iopub=64 * 1024, kernel_reply=64 * 1024))
    bridge.start()
    try:
        sub = subscriber(ctx, bridge)
        assert publish_until_received(kernel["iopub"], sub, status(session)) is not None
        kernel["iopub"].send_multipart(status(session, padding="x" * 100_000))
        shell = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
        shell.send_multipart(request(session))
        seen = recv(kernel["shell"])
        idents, msg = session.feed_identities(seen)
        big = session.msg("kernel_info_reply", {"padding": "x" * 100_000}, parent=session.deserialize(msg))
        kernel["shell"].send_multipart(list(session.serialize(big, ident=idents)))
        assert not shell.poll(300)
        time.sleep(0.3)
        while sub.poll(10):
            sub.recv_multipart()
        assert publish_until_received(kernel["iopub"], sub, status(session, "idle")) is not None
        assert (
            round_trip(ctx, session, kernel["shell"], bridge.endpoint("shell"))["msg_type"]
            == "kernel_info_reply"
        )
    finally:
        bridge.stop()


def test_wire_parsing_never_raises_on_nesting() -> None:
    from sandbox_kernel.channels.wire import load_dict

    assert load_dict(b"[" * 100_000, limit=None) == {}
    assert load_dict(b'{"a": ' * 5000, limit=None) == {}


def test_restarts_do_not_pile_up_listening_sockets(
    kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str], tmp_path: Path
) -> None:
    """Each restart removes the ipc files (jupyter_client); code in the kernel can force
    restarts: the server must not gain open files with each one."""
    bridge = KernelBridge(endpoints, ip=str(tmp_path / "client"), transport="ipc", key=KEY)
    bridge.start()
    try:
        bridge.attach(endpoints)
        time.sleep(0.3)  # ZeroMQ frees closed sockets' files in the background
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            for n in range(1, 6):
                os.remove(tmp_path / f"client-{n}")
            bridge.attach(endpoints)
        deadline = time.monotonic() + 5
        while len(os.listdir("/proc/self/fd")) > before + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir("/proc/self/fd")) <= before + 2  # a second listener each time: +100
        assert all((tmp_path / f"client-{n}").exists() for n in range(1, 6))
    finally:
        bridge.stop()


def test_comm_messages_never_crowd_out_a_pending_reply(session: Session, endpoints: dict[str, str]) -> None:
    """ipympl mouse moves or a slider during a long cell: thousands of comm messages, which
    the kernel never answers, must not make the bridge forget the execute_request."""
    bridge = KernelBridge(endpoints, key=KEY)
    execute = session.msg("execute_request", {"code": "long()"})
    assert bridge._check("shell", True, list(session.serialize(execute, ident=[b"client"]))) is not None
    for _ in range(5000):
        comm = session.msg("comm_msg", {"comm_id": "c", "data": {}})
        assert bridge._check("shell", True, list(session.serialize(comm, ident=[b"client"]))) is not None
    reply = session.msg("execute_reply", {"status": "ok"}, parent=execute)
    passed = bridge._check("shell", False, list(session.serialize(reply, ident=[b"client"])))
    assert passed is not None
    assert passed[0] == b"client"


# ---------------------------------------------------------------- the output limit


@pytest.fixture
def limited(endpoints: dict[str, str], kernel: dict[str, zmq.Socket[bytes]]) -> Iterator[KernelBridge]:
    """A bridge with the output limiter, its executions known from the audit tap, as the
    provisioner wires them."""
    auditor = ExecutionAuditor(None, "k1", "spec")

    limiter = OutputLimiter(2**20, Session(key=KEY), auditor.executing)
    bridge = KernelBridge(endpoints, key=KEY, tap=auditor, output_limiter=limiter)
    bridge.start()
    yield bridge
    bridge.stop()


def start_execution(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge, **metadata: Any
) -> tuple[zmq.Socket[bytes], dict[str, Any]]:
    """A subscribed client sends an execute_request; returns its subscriber and the request."""
    sub = subscriber(ctx, bridge)
    assert publish_until_received(kernel["iopub"], sub, status(session)) is not None
    drain(session, kernel["iopub"], sub)
    msg = session.msg("execute_request", {"code": "print(...)"}, metadata=metadata)
    dealer = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    dealer.send_multipart(list(session.serialize(msg)))
    recv(kernel["shell"])  # the bridge has seen it
    dealer.close()
    return sub, msg


def publish(
    session: Session, kernel: dict[str, zmq.Socket[bytes]], kind: str, content: Any, parent: Any
) -> None:
    kernel["iopub"].send_multipart(
        list(session.serialize(session.msg(kind, content, parent=parent), ident=[b"k"]))
    )


def received_until(
    session: Session, sub: zmq.Socket[bytes], last: Callable[[dict[str, Any]], bool]
) -> list[Any]:
    messages = []
    while not messages or not last(messages[-1]):
        messages.append(session.deserialize(session.feed_identities(recv(sub))[1]))
    return messages


def stdout_of(messages: list[dict[str, Any]]) -> str:
    return "".join(
        m["content"]["text"]
        for m in messages
        if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
    )


def test_a_run_that_narrows_its_output_limit_gets_its_head_and_tail_before_idle(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], limited: KernelBridge
) -> None:
    sub, request = start_execution(ctx, session, kernel, limited, sandbox_kernel={"output_limit": 8000})
    publish(
        session, kernel, "stream", {"name": "stdout", "text": "A" * 20_000 + "MIDDLE" + "Z" * 20_000}, request
    )
    publish(session, kernel, "status", {"execution_state": "idle"}, request)
    messages = received_until(session, sub, lambda m: m["msg_type"] == "status")
    out = stdout_of(messages)
    assert out.startswith("AAAA")
    assert out.endswith("\n" + "Z" * 2000)
    assert "MIDDLE" not in out
    assert "over the output limit of 7.8 KiB set for this execution" in out
    assert messages[-1]["content"] == {"execution_state": "idle"}


def test_a_kernel_that_dies_mid_run_gets_its_tail_delivered_before_the_hosts_notice(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], limited: KernelBridge
) -> None:
    sub, request = start_execution(ctx, session, kernel, limited, sandbox_kernel={"output_limit": 8000})
    publish(session, kernel, "stream", {"name": "stdout", "text": "A" * 20_000 + "Z" * 2000}, request)
    head = received_until(session, sub, lambda m: m["msg_type"] == "stream")  # the bridge has it
    limited.inject("iopub", stderr_notice(session, "the kernel stopped", request))
    messages = received_until(session, sub, lambda m: "the kernel stopped" in m["content"].get("text", ""))
    assert stdout_of(head).startswith("AAAA")
    assert stdout_of(head + messages).endswith("\n" + "Z" * 2000)


def test_a_forged_request_narrows_nothing(
    ctx: Ctx, kernel: dict[str, zmq.Socket[bytes]], limited: KernelBridge
) -> None:
    forger = Session(key=b"not-the-key")
    msg = forger.msg("execute_request", {"code": ""}, metadata={"sandbox_kernel": {"output_limit": 10}})
    dealer = client(ctx, zmq.DEALER, limited.endpoint("shell"))
    dealer.send_multipart(list(forger.serialize(msg)))
    deadline = time.monotonic() + 2
    while not limited.dropped and time.monotonic() < deadline:
        time.sleep(0.05)
    assert limited.dropped["shell message from a client: bad signature"] == 1
    assert limited._limiter is not None
    assert limited._limiter._requested == {}


# ---------------------------------------------------------------- a paused kernel


def msg_type(frames: list[bytes]) -> str:
    return str(json.loads(frames[frames.index(b"<IDS|MSG>") + 2])["msg_type"])


def wait_for(condition: Callable[[], bool], timeout: float = TIMEOUT_MS / 1000) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s"
        time.sleep(0.01)


def test_while_held_the_bridge_answers_heartbeats_keeps_requests_and_wakes_on_each(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    woken: list[str] = []
    bridge.on_wake = woken.append
    bridge.hold()
    hb = client(ctx, zmq.REQ, bridge.endpoint("hb"))
    hb.send(b"ping")
    assert recv(hb) == [b"ping"], "a paused kernel is alive to its clients"
    subscriber(ctx, bridge)  # a subscription does not wake it (a server watching activity)
    shell = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    shell.send_multipart(request(session))
    shell.send_multipart(request(session, "execute_request", code="print(x)"))
    wait_for(lambda: len(woken) == 2)
    assert woken == ["shell kernel_info_request", "shell execute_request"]
    assert not kernel["shell"].poll(200), "nothing reaches the paused kernel"
    assert not kernel["hb"].poll(0)

    bridge.release()
    first, second = recv(kernel["shell"]), recv(kernel["shell"])
    assert [msg_type(first), msg_type(second)] == ["kernel_info_request", "execute_request"], "in order"
    wait_for(lambda: not bridge.holding)
    answer(session, kernel["shell"], second)
    _, reply = session.feed_identities(recv(shell))
    assert session.deserialize(reply)["msg_type"] == "execute_reply"


def test_a_frozen_kernels_heartbeats_are_the_bridges_and_only_clients_requests_thaw_it(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    """The idle freeze's hook: called for every signed request (before it goes on, in
    order), never for a heartbeat or a subscription; with ``echo_heartbeats`` the bridge
    answers heartbeats itself."""
    messages: list[bool] = []
    bridge.on_client_message = lambda: messages.append(kernel["shell"].poll(0) == 0)
    hb = client(ctx, zmq.REQ, bridge.endpoint("hb"))
    hb.send(b"ping")
    kernel["hb"].send_multipart(recv(kernel["hb"]))
    assert recv(hb) == [b"ping"]
    subscriber(ctx, bridge)
    bridge.echo_heartbeats = True
    hb.send(b"ping")
    assert recv(hb) == [b"ping"], "answered by the bridge"
    assert not kernel["hb"].poll(100), "the frozen kernel never sees it"
    assert messages == [], "heartbeats and subscriptions do not count"
    shell = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    shell.send_multipart(request(session, "execute_request", code="print(x)"))
    assert msg_type(recv(kernel["shell"])) == "execute_request"
    assert messages == [True], "called before the request reached the kernel"
    shell.send_multipart(request(Session(key=b"not the kernel's"), "execute_request", code="x"))
    time.sleep(0.2)
    assert messages == [True], "an unsigned message thaws nothing"


def test_held_messages_wait_until_the_resumed_kernel_is_reachable_on_every_channel(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge, tmp_path: Path
) -> None:
    """As in a pause: the kernel's sockets go away, come back later at the same paths."""
    wait_for(lambda: bridge._connected.issuperset(CHANNELS))  # a kernel that ran a while
    bridge.hold()
    for sock in kernel.values():
        sock.close(linger=0)
    shell = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    shell.send_multipart(request(session, "execute_request", code="print(x)"))
    # The checkpoint: seconds, in which the bridge sees the kernel go (on every channel).
    wait_for(lambda: not bridge._connected)
    wait_for(lambda: bridge.messages["shell"] == 1)  # held
    bridge.release()  # before the kernel is back: the bridge waits for it
    wait_for(lambda: bridge._release_due or not bridge.holding)  # the bridge has read it
    assert bridge.holding, "released while the kernel is away"
    hb = client(ctx, zmq.REQ, bridge.endpoint("hb"))  # and has done with it: it answers, held
    hb.send(b"ping")
    assert recv(hb) == [b"ping"]
    assert bridge.holding
    resumed = {}
    for channel, kind in KERNEL_SOCKET_TYPES.items():
        resumed[channel] = ctx.socket(kind)
        resumed[channel].linger = 0
        resumed[channel].bind(f"ipc://{tmp_path}/{channel}")
    received = recv(resumed["shell"])
    assert msg_type(received) == "execute_request"
    assert not bridge.holding
    sub = subscriber(ctx, bridge)
    assert publish_until_received(resumed["iopub"], sub, status(session)) is not None, "output flows again"


def test_what_was_held_for_a_kernel_that_is_gone_never_reaches_the_next(
    ctx: Ctx,
    session: Session,
    kernel: dict[str, zmq.Socket[bytes]],
    bridge: KernelBridge,
    endpoints: dict[str, str],
) -> None:
    bridge.hold()
    shell = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    shell.send_multipart(request(session, "shutdown_request"))
    wait_for(lambda: bridge.messages["shell"] == 1)
    bridge.attach(endpoints)  # a restart: a new kernel at the same paths
    assert not bridge.holding
    assert not kernel["shell"].poll(300)


# ---------------------------------------------------------------- requests the bridge refuses


@pytest.fixture
def audited(
    endpoints: dict[str, str], kernel: dict[str, zmq.Socket[bytes]], tmp_path: Path
) -> Iterator[tuple[KernelBridge, Path]]:
    """A bridge whose tap is an auditor writing a log, as the provisioner wires them (ipc)."""
    path = tmp_path / "audit" / "audit.jsonl"
    auditor = ExecutionAuditor(AuditLog.open(path, 10**8, 1), "k1", "py")
    bridge = KernelBridge(endpoints, ip=str(tmp_path / "client"), transport="ipc", key=KEY, tap=auditor)
    bridge.start()
    yield bridge, path
    bridge.stop()


def audit_records(path: Path, event: str, timeout: float = 2) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        records = [r for r in map(json.loads, lines) if r["event"] == event]
        if records or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


@pytest.mark.parametrize("command", ["initialize", "attach", "evaluate"])
@pytest.mark.parametrize("channel", ["control", "shell"])
def test_a_debug_request_is_answered_by_the_bridge_and_never_reaches_the_kernel(
    ctx: Ctx,
    session: Session,
    kernel: dict[str, zmq.Socket[bytes]],
    audited: tuple[KernelBridge, Path],
    channel: str,
    command: str,
) -> None:
    """debug_request (initialize, attach, evaluate) ran code through the image's debugpy
    with no audit line; every shipped kernelspec says "debugger": false."""
    bridge, path = audited
    dealer = client(ctx, zmq.DEALER, bridge.endpoint(channel))
    code = "open('/workspace/pwned', 'w').write('1')"
    arguments = {"expression": code, "context": "repl"} if command == "evaluate" else {}
    debug = session.msg(
        "debug_request", {"seq": 7, "type": "request", "command": command, "arguments": arguments}
    )
    dealer.send_multipart(list(session.serialize(debug)))
    reply = session.deserialize(session.feed_identities(recv(dealer))[1])  # checks the signature
    assert reply["msg_type"] == "debug_reply"
    assert reply["parent_header"]["msg_id"] == debug["header"]["msg_id"]
    content = reply["content"]
    assert content["status"] == "error"
    assert content["success"] is False
    assert (content["command"], content["request_seq"]) == (command, 7)
    assert "debugger" in content["message"]
    assert not kernel[channel].poll(300), "the kernel must never see it"
    assert not bridge.requests_in_flight(60)
    (record,) = audit_records(path, "refused")
    assert record["msg_type"] == "debug_request"
    assert record["command"] == command
    assert record["code"] == (code if command == "evaluate" else "")
    assert record["channel"] == channel


def test_code_sent_on_the_control_channel_is_refused(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], audited: tuple[KernelBridge, Path]
) -> None:
    """ipykernel's control channel takes every shell request, execute_request too: code
    there would run beside the shell, past the audit and the limits that watch the shell."""
    bridge, path = audited
    dealer = client(ctx, zmq.DEALER, bridge.endpoint("control"))
    execute = session.msg("execute_request", {"code": "", "user_expressions": {"x": "evil()"}})
    dealer.send_multipart(list(session.serialize(execute)))
    reply = session.deserialize(session.feed_identities(recv(dealer))[1])
    assert reply["msg_type"] == "execute_reply"
    assert reply["content"]["status"] == "error"
    assert "shell" in reply["content"]["evalue"]
    assert not kernel["control"].poll(300)
    (record,) = audit_records(path, "refused")
    assert record["user_expressions"] == {"x": "evil()"}
    # What the control channel is for still passes.
    assert round_trip(ctx, session, kernel["control"], bridge.endpoint("control"))["msg_type"] == (
        "kernel_info_reply"
    )


def test_the_log_names_the_unix_socket_peer_that_sent_a_request(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], audited: tuple[KernelBridge, Path]
) -> None:
    """The header's username is the client's word; over ipc the kernel knows who connected."""
    bridge, path = audited
    claimed = Session(key=KEY, username="ceo@corp.example")
    dealer = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
    dealer.send_multipart(list(claimed.serialize(claimed.msg("execute_request", {"code": "1"}))))
    recv(kernel["shell"])
    (record,) = audit_records(path, "started")
    assert record["username_claimed"] == "ceo@corp.example"
    assert (record["client_uid"], record["client_pid"]) == (os.getuid(), os.getpid())
    assert record["server_uid"] == os.getuid()


def test_a_big_header_does_not_hide_a_debug_request(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    """The kernel reads headers of any size: so does the bridge's check."""
    debug = session.msg("debug_request", {"seq": 1, "type": "request", "command": "evaluate"})
    debug["header"]["padding"] = "x" * 2**17
    dealer = client(ctx, zmq.DEALER, bridge.endpoint("control"))
    dealer.send_multipart(list(session.serialize(debug)))
    reply = session.deserialize(session.feed_identities(recv(dealer))[1])
    assert (reply["msg_type"], reply["content"]["status"]) == ("debug_reply", "error")
    assert not kernel["control"].poll(300)
    assert bridge.refused == {"control debug_request": 1}


def test_the_hosts_answer_for_a_lost_reply_comes_before_the_reply_that_passed_it(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str]
) -> None:
    """A shell answers its requests in order: once the kernel answers a later one, the
    host answers the earlier one for it (ReplyLost). That answer reached the client after
    the later reply (test_hostile_bridge saw it so in 5 runs of 8), as if out of order."""
    auditor = ExecutionAuditor(None, "k1", "spec")
    bridge = KernelBridge(endpoints, key=KEY, tap=auditor)
    signer = Session(key=KEY)

    def answer_lost(execution: Any) -> None:
        reply = signer.msg(
            "execute_reply", {"status": "error", "ename": "ReplyLost"}, parent=execution.header
        )
        bridge.inject("shell", signer.serialize(reply, ident=execution.idents))

    auditor.on_lost = answer_lost
    bridge.start()
    try:
        dealer = client(ctx, zmq.DEALER, bridge.endpoint("shell"))
        first, second = (session.msg("execute_request", {"code": code}) for code in ("lost()", "next()"))
        for msg in (first, second):
            dealer.send_multipart(list(session.serialize(msg)))
        idents, _ = session.feed_identities(recv(kernel["shell"]))
        recv(kernel["shell"])
        reply = session.msg("execute_reply", {"status": "ok"}, parent=second)
        kernel["shell"].send_multipart(list(session.serialize(reply, ident=idents)))
        got = [session.deserialize(session.feed_identities(recv(dealer))[1]) for _ in range(2)]
        assert [(m["parent_header"]["msg_id"], m["content"]["status"]) for m in got] == [
            (first["header"]["msg_id"], "error"),
            (second["header"]["msg_id"], "ok"),
        ]
    finally:
        bridge.stop()


# ---------------------------------------------------------------- prompts on stdin


def run_cell(
    ctx: Ctx,
    session: Session,
    kernel: dict[str, zmq.Socket[bytes]],
    bridge: KernelBridge,
    allow_stdin: bool,
    **metadata: Any,
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes], dict[str, Any], list[bytes]]:
    """A client (shell and stdin with one identity, as jupyter_client connects them) runs a
    cell; returns its shell and stdin sockets, the request, and its routing frames at the kernel."""
    shell, stdin = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock, channel in ((shell, "shell"), (stdin, "stdin")):
        sock.linger = 0
        sock.setsockopt(zmq.IDENTITY, session.bsession)
        sock.connect(bridge.endpoint(channel))
    msg = session.msg("execute_request", {"code": "input()", "allow_stdin": allow_stdin}, metadata=metadata)
    shell.send_multipart(list(session.serialize(msg)))
    idents, _ = session.feed_identities(recv(kernel["shell"]))
    return shell, stdin, msg, idents


def prompt(
    session: Session, kernel: dict[str, zmq.Socket[bytes]], idents: list[bytes], parent: Any, text: str
) -> None:
    """The kernel asks, as ipykernel's input() does (or as code in it does, at will)."""
    msg = session.msg("input_request", {"prompt": text, "password": False}, parent=parent)
    kernel["stdin"].send_multipart(list(session.serialize(msg, ident=idents)))


def prompts_received(
    session: Session, stdin: zmq.Socket[bytes], expected: int = 0, wait_ms: int = 300
) -> list[str]:
    """The prompts the client gets: the ``expected`` ones may take long (a loaded machine);
    then none more for ``wait_ms`` concludes that no other comes."""
    got = []
    while stdin.poll(TIMEOUT_MS if len(got) < expected else wait_ms):
        msg = session.deserialize(session.feed_identities(stdin.recv_multipart())[1])
        got.append(msg["content"]["prompt"])
    return got


def dropped_once_seen(bridge: KernelBridge, count: int) -> dict[str, int]:
    """What the bridge dropped, once it has dropped ``count`` messages (it reads them in its
    own time; a loaded machine's may take seconds)."""
    wait_for(lambda: sum(bridge.dropped.values()) >= count, timeout=60)
    return dict(bridge.dropped)


def test_a_cell_run_without_stdin_gets_no_prompt_however_many_the_kernel_sends(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], limited: KernelBridge
) -> None:
    """Issue #22: signed input_request messages the kernel routes itself were not charged:
    256 MiB arrived in 1.7 s under a 1 MiB output_limit, from a cell run with allow_stdin=False."""
    _, stdin, request, idents = run_cell(ctx, session, kernel, limited, allow_stdin=False)
    for _ in range(256):
        prompt(session, kernel, idents, request, "A" * 2**20)
    dropped = dropped_once_seen(limited, 256)
    assert prompts_received(session, stdin, wait_ms=1000) == []
    assert dropped == {"stdin message from the kernel: its cell was run with allow_stdin false": 256}


def test_one_prompt_at_a_time_and_the_next_only_after_the_answer(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], limited: KernelBridge
) -> None:
    _, stdin, request, idents = run_cell(ctx, session, kernel, limited, allow_stdin=True)
    waiting = "stdin message from the kernel: a prompt already waits for its answer"
    for n in range(3):
        prompt(session, kernel, idents, request, f"name {n}? ")
    assert prompts_received(session, stdin, expected=1) == ["name 0? "]
    assert dropped_once_seen(limited, 2) == {waiting: 2}
    stdin.send_multipart(list(session.serialize(session.msg("input_reply", {"value": "ada"}))))
    assert msg_type(recv(kernel["stdin"])) == "input_reply"
    prompt(session, kernel, idents, request, "age? ")
    prompt(session, kernel, idents, request, "again? ")
    assert prompts_received(session, stdin, expected=1) == ["age? "]
    assert dropped_once_seen(limited, 3) == {waiting: 3}


def test_a_prompt_is_size_capped_routed_only_to_the_cell_s_client_and_charged_to_its_budget(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], limited: KernelBridge
) -> None:
    sub = subscriber(ctx, limited)
    assert publish_until_received(kernel["iopub"], sub, status(session)) is not None
    drain(session, kernel["iopub"], sub)
    _, stdin, request, idents = run_cell(
        ctx, session, kernel, limited, allow_stdin=True, sandbox_kernel={"output_limit": 8000}
    )
    prompt(session, kernel, idents, request, "x" * (64 * 2**10))
    prompt(session, kernel, [*idents[:-1], b"another client"], request, "y? ")
    prompt(session, kernel, idents, request, "name? ")
    assert prompts_received(session, stdin, expected=1) == ["name? "]
    stdin.send_multipart(list(session.serialize(session.msg("input_reply", {"value": "ada"}))))
    recv(kernel["stdin"])
    publish(session, kernel, "stream", {"name": "stdout", "text": "A" * 5000}, request)
    received_until(session, sub, lambda m: m["msg_type"] == "stream")  # charged, before the prompt
    prompt(session, kernel, idents, request, "z" * 3000)  # 5000 + 3000 bytes and more: over 8000
    dropped = dropped_once_seen(limited, 3)
    assert prompts_received(session, stdin) == []
    assert dropped == {
        "stdin message from the kernel: a prompt over 64 KiB": 1,
        "stdin message from the kernel: not to the client running the cell": 1,
        "stdin message from the kernel: over the output limit": 1,
    }


def test_nothing_but_prompts_comes_from_the_kernel_on_stdin_and_none_between_cells(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], limited: KernelBridge
) -> None:
    shell, stdin, request, idents = run_cell(ctx, session, kernel, limited, allow_stdin=True)
    stream = session.msg("stream", {"name": "stdout", "text": "out"}, parent=request)
    kernel["stdin"].send_multipart(list(session.serialize(stream, ident=idents)))
    reply = session.msg("execute_reply", {"status": "ok"}, parent=request)
    kernel["shell"].send_multipart(list(session.serialize(reply, ident=idents)))
    recv(shell)
    prompt(session, kernel, idents, request, "after the cell? ")
    dropped = dropped_once_seen(limited, 2)
    assert prompts_received(session, stdin) == []
    assert dropped == {
        "stdin message from the kernel: not an input_request": 1,
        "stdin message from the kernel: no cell is running": 1,
    }


def test_a_prompt_the_tap_could_not_check_is_dropped(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str]
) -> None:
    """Only the tap lets the kernel's stdin through: when it fails, the prompt stays behind
    (other messages go on, as a failing tap must not silence the kernel)."""

    def failing(channel: str, to_kernel: bool, frames: Any) -> None:
        raise RuntimeError("a bug in the tap")

    bridge = KernelBridge(endpoints, key=KEY, tap=failing)
    bridge.start()
    try:
        shell, stdin, request, idents = run_cell(ctx, session, kernel, bridge, allow_stdin=True)
        prompt(session, kernel, idents, request, "name? ")
        dropped = dropped_once_seen(bridge, 1)
        assert prompts_received(session, stdin) == []
        reply = session.msg("execute_reply", {"status": "ok"}, parent=request)
        kernel["shell"].send_multipart(list(session.serialize(reply, ident=idents)))
        assert msg_type(recv(shell)) == "execute_reply"
        assert dropped == bridge.dropped == {"stdin message from the kernel: could not be checked": 1}
    finally:
        bridge.stop()


# ---------------------------------------------------------------- output past the budget


class CountingSanitizer(OutputSanitizer):
    """The output cleaner, counting the displays it was given to read."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.displays = 0

    def clean(self, channel: str, frames: Any) -> Any:
        index = find_delimiter(frames)
        if index is not None and b'"display_data"' in frame_bytes(frames[index + 2]):
            self.displays += 1
        return super().clean(channel, frames)


def test_displays_past_the_budget_are_dropped_unread(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str]
) -> None:
    """Issue #22: the cleaner ran before the limiter, so displays over the budget were
    parsed and cleaned anyway: 40 s of 16 MiB HTML displays kept the server at 43 % of a
    core for 331 s. Here 100 HTML displays of 2 MiB under a 1 MiB budget: none is cleaned."""
    auditor = ExecutionAuditor(None, "k1", "spec")

    sanitizer = CountingSanitizer(Session(key=KEY))
    limiter = OutputLimiter(2**20, Session(key=KEY), auditor.executing)
    bridge = KernelBridge(endpoints, key=KEY, tap=auditor, output_limiter=limiter, sanitizer=sanitizer)
    bridge.start()
    try:
        sub, request = start_execution(ctx, session, kernel, bridge)
        html = "<table>" + "<tr><td onclick='x()'>cell</td></tr>" * 60_000 + "</table>"  # 2 MiB
        # Made once, sent 100 times: the clock is for the bridge's work, not the test's.
        content = {"data": {"text/html": html}, "metadata": {}}
        display = list(session.serialize(session.msg("display_data", content, parent=request), ident=[b"k"]))
        cpu = time.process_time()
        for _ in range(100):
            kernel["iopub"].send_multipart(display)
        publish(session, kernel, "status", {"execution_state": "idle"}, request)
        messages = []
        while not messages or messages[-1]["msg_type"] != "status":
            messages.append(session.deserialize(session.feed_identities(recv(sub, timeout_ms=60_000))[1]))
        cpu = time.process_time() - cpu
        assert [m["msg_type"] for m in messages] == ["stream", "status"]  # the notice, idle
        assert "Output truncated" in messages[0]["content"]["text"]
        assert sanitizer.displays == 0, "a display over the budget was parsed"
        # About 0.3 s here; cleaning each display would cost about 15 s (0.15 s each).
        assert cpu < 5, f"{cpu:.1f} s of CPU for output that was dropped"
    finally:
        bridge.stop()


def test_output_within_the_budget_is_still_cleaned(
    ctx: Ctx, session: Session, kernel: dict[str, zmq.Socket[bytes]], endpoints: dict[str, str]
) -> None:
    auditor = ExecutionAuditor(None, "k1", "spec")
    limiter = OutputLimiter(2**20, Session(key=KEY), list)
    sanitizer = CountingSanitizer(Session(key=KEY))
    bridge = KernelBridge(endpoints, key=KEY, tap=auditor, output_limiter=limiter, sanitizer=sanitizer)
    bridge.start()
    try:
        sub, request = start_execution(ctx, session, kernel, bridge)
        bundle = {"text/html": "<b onclick='steal()'>hi</b><script>steal()</script>"}
        publish(session, kernel, "display_data", {"data": bundle, "metadata": {}}, request)
        (shown,) = received_until(session, sub, lambda m: m["msg_type"] == "display_data")
        assert "<script" not in shown["content"]["data"]["text/html"]
        assert "onclick" not in shown["content"]["data"]["text/html"]
        assert sanitizer.displays == 1
    finally:
        bridge.stop()
