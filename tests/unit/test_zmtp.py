"""The bridge's own ZMTP endpoints against libzmq's sockets and against raw peers."""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from sandbox_kernel import zmtp

Ctx = zmq.Context[zmq.Socket[bytes]]
LIMITS = zmtp.Limits(2**20, 64)


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


def pump(ends: list[zmtp.Endpoint], until: Callable[[], bool], timeout: float = 5) -> None:
    """Run the ends as the bridge's thread does until ``until()`` (or fail)."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "not within the time"
        poller = zmq.Poller()
        owners = {}
        for end in ends:
            end.tick(time.monotonic())
            for sock, events in end.poll_items():
                poller.register(sock, events)
                owners[sock.fileno()] = (end, sock)
        for fd, events in poller.poll(20):
            end, sock = owners[fd]
            end.handle(sock, events)


def test_a_libzmq_subscriber_gets_what_matches_its_subscription(ctx: Ctx, tmp_path: Path) -> None:
    xpub = zmtp.XPub(zmtp.listen_unix(str(tmp_path / "pub")), LIMITS)
    everything, only_a = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    everything.subscribe(b"")
    only_a.subscribe(b"a")
    for sub in (everything, only_a):
        sub.connect(f"ipc://{tmp_path}/pub")
    try:
        pump([xpub], lambda: len(xpub.inbox) == 2)  # both subscriptions are passed on
        assert sorted(message[0] for message in xpub.inbox) == [b"\x01", b"\x01a"]
        xpub.send([b"b-topic", b"payload"])
        xpub.send([b"a-topic", b"x" * 100_000])
        pump([xpub], lambda: everything.poll(0) != 0 and only_a.poll(0) != 0)
        assert everything.recv_multipart() == [b"b-topic", b"payload"]
        assert everything.recv_multipart()[0] == b"a-topic"
        assert only_a.recv_multipart() == [b"a-topic", b"x" * 100_000]
    finally:
        xpub.close()


def test_a_router_names_each_peer_and_a_newcomer_with_the_same_name_takes_the_route(
    ctx: Ctx, tmp_path: Path
) -> None:
    router = zmtp.Router(zmtp.listen_unix(str(tmp_path / "router")), LIMITS)
    first, second, anonymous = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER), ctx.socket(zmq.REQ)
    first.setsockopt(zmq.IDENTITY, b"session")
    second.setsockopt(zmq.IDENTITY, b"session")
    try:
        first.connect(f"ipc://{tmp_path}/router")
        first.send(b"one")
        pump([router], lambda: bool(router.inbox))
        message = router.inbox.popleft()
        assert list(message) == [b"session", b"one"]
        assert message.peer is not None
        second.connect(f"ipc://{tmp_path}/router")
        second.send(b"two")
        pump([router], lambda: bool(router.inbox))
        assert list(router.inbox.popleft()) == [b"session", b"two"]
        router.send([b"session", b"to whoever holds the name"])
        pump([router], lambda: second.poll(0) != 0)
        assert second.recv() == b"to whoever holds the name"
        assert not first.poll(100)
        anonymous.connect(f"ipc://{tmp_path}/router")
        anonymous.send(b"ping")
        pump([router], lambda: bool(router.inbox))
        ident, empty, ping = router.inbox.popleft()
        assert (ident[:1], empty, ping) == (b"\0", b"", b"ping"), "REQ's delimiter, a made-up name"
        router.send([ident, b"", b"pong"])
        pump([router], lambda: anonymous.poll(0) != 0)
        assert anonymous.recv() == b"pong"
    finally:
        router.close()


def test_a_dealer_reconnects_and_delivers_what_was_sent_meanwhile(ctx: Ctx, tmp_path: Path) -> None:
    dealer = zmtp.Dealer(str(tmp_path / "kernel"), LIMITS, identity=b"bridge")
    assert dealer.send([b"early"]), "kept until a peer is there"
    peer = ctx.socket(zmq.ROUTER)
    peer.bind(f"ipc://{tmp_path}/kernel")
    try:
        pump([dealer], lambda: peer.poll(0) != 0)
        assert peer.recv_multipart() == [b"bridge", b"early"]
        peer.close(linger=0)
        pump([dealer], lambda: dealer.connection is None)
        peer = ctx.socket(zmq.ROUTER)
        peer.bind(f"ipc://{tmp_path}/kernel")
        pump([dealer], lambda: dealer.ready)
        dealer.send([b"again"])
        pump([dealer], lambda: peer.poll(0) != 0)
        assert peer.recv_multipart() == [b"bridge", b"again"]
        peer.send_multipart([b"bridge", b"reply"])
        pump([dealer], lambda: bool(dealer.inbox))
        assert list(dealer.inbox.popleft()) == [b"reply"]
    finally:
        dealer.close()
        peer.close(linger=0)


def test_a_dealer_does_not_follow_a_link(ctx: Ctx, tmp_path: Path) -> None:
    """The kernel's folder could hold a link to any socket of the host."""
    peer = ctx.socket(zmq.ROUTER)
    peer.bind(f"ipc://{tmp_path}/elsewhere")
    (tmp_path / "kernel").symlink_to(tmp_path / "elsewhere")
    dealer = zmtp.Dealer(str(tmp_path / "kernel"), LIMITS)
    try:
        dealer.tick(time.monotonic())
        assert dealer.connection is None
    finally:
        dealer.close()
        peer.close(linger=0)


def raw_client(path: Path, greeting: bytes = zmtp.GREETING) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(path))
    sock.settimeout(5)
    sock.sendall(greeting)
    return sock


def test_a_peer_that_is_not_zmtp_or_never_greets_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zmtp, "HANDSHAKE", 0.3)
    router = zmtp.Router(zmtp.listen_unix(str(tmp_path / "router")), LIMITS)
    try:
        http = raw_client(tmp_path / "router", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 40)
        silent = raw_client(tmp_path / "router", b"")
        pump([router], lambda: len(router.connections) == 2)
        pump([router], lambda: not router.connections)
        for sock in (http, silent):
            sock.recv(4096)  # our greeting
            assert sock.recv(4096) == b"", "closed"
    finally:
        router.close()


def test_a_ping_is_answered_and_a_command_inside_a_message_ends_the_connection(tmp_path: Path) -> None:
    router = zmtp.Router(zmtp.listen_unix(str(tmp_path / "router")), LIMITS)
    try:
        peer = raw_client(tmp_path / "router")
        peer.sendall(zmtp.ready(b"DEALER", b"raw"))
        peer.sendall(zmtp.command(b"PING", struct.pack(">H", 10) + b"ctx"))
        pump([router], lambda: any(conn.ready for conn in router.connections.values()))
        received = b""
        while zmtp.command(b"PONG", b"ctx") not in received:
            pump([router], lambda: bool(select.select([peer], [], [], 0)[0]))
            received += peer.recv(4096)
        peer.sendall(b"\x01\x01a" + zmtp.command(b"PING", b"\0\0"))
        pump([router], lambda: not router.connections)
        assert not router.inbox
    finally:
        router.close()
