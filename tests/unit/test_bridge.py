"""KernelBridge between real pyzmq sockets: a fake kernel on ipc://, clients on tcp://127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from sandbox_kernel.bridge import CHANNELS, CurveKeys, KernelBridge

TIMEOUT_MS = 1000

#: Socket type of each channel in the fake kernel, as ipykernel binds them.
KERNEL_SOCKET_TYPES = {
    "shell": zmq.ROUTER,
    "iopub": zmq.PUB,
    "stdin": zmq.ROUTER,
    "control": zmq.ROUTER,
    "hb": zmq.ROUTER,
}


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def kernel(ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> dict[str, zmq.Socket[bytes]]:
    """The fake kernel: one socket per channel, bound where the bridge will connect."""
    sockets = {}
    for channel, kind in KERNEL_SOCKET_TYPES.items():
        sock = ctx.socket(kind)
        sock.linger = 0
        sock.bind(f"ipc://{tmp_path}/{channel}")
        sockets[channel] = sock
    return sockets


@pytest.fixture
def endpoints(tmp_path: Path) -> dict[str, str]:
    return {channel: f"ipc://{tmp_path}/{channel}" for channel in CHANNELS}


@pytest.fixture
def bridge(endpoints: dict[str, str], kernel: dict[str, zmq.Socket[bytes]]) -> Iterator[KernelBridge]:
    bridge = KernelBridge(endpoints)
    bridge.start()
    yield bridge
    bridge.stop()


def client(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: int, port: int, curve_server_key: bytes | None = None
) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.linger = 0
    if curve_server_key is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = curve_server_key
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def recv(sock: zmq.Socket[bytes], timeout_ms: int = TIMEOUT_MS) -> list[bytes]:
    if not sock.poll(timeout_ms):
        raise AssertionError(f"nothing arrived within {timeout_ms} ms")
    return sock.recv_multipart()


def round_trip(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kernel: zmq.Socket[bytes],
    port: int,
    request: list[bytes],
    curve_server_key: bytes | None = None,
) -> tuple[list[bytes], list[bytes]]:
    """A client DEALER sends ``request``; the kernel ROUTER answers it with its frames reversed.

    Returns (what the kernel received, what the client received back).
    """
    dealer = client(ctx, zmq.DEALER, port, curve_server_key)
    dealer.send_multipart(request)
    received = recv(kernel)
    routing, body = received[: -len(request)], received[-len(request) :]
    kernel.send_multipart([*routing, *reversed(body)])
    return received, recv(dealer)


def test_the_bridge_listens_on_five_localhost_ports(bridge: KernelBridge) -> None:
    assert bridge.running
    assert set(bridge.ports) == set(CHANNELS)
    assert len(set(bridge.ports.values())) == 5
    assert bridge.ip == "127.0.0.1"


@pytest.mark.parametrize("channel", ["shell", "control", "stdin"])
def test_a_request_and_its_reply_cross_the_bridge(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kernel: dict[str, zmq.Socket[bytes]],
    bridge: KernelBridge,
    channel: str,
) -> None:
    received, reply = round_trip(
        ctx, kernel[channel], bridge.ports[channel], [b"<IDS|MSG>", b"execute_request"]
    )
    assert received[-2:] == [b"<IDS|MSG>", b"execute_request"]
    assert reply == [b"execute_request", b"<IDS|MSG>"]
    assert bridge.messages[channel] == 2


def test_stdin_reaches_the_kernel_from_the_same_peer_as_shell(
    ctx: zmq.Context[zmq.Socket[bytes]], kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    """ipykernel sends input_request to the identity the shell request came from."""
    shell_seen, _ = round_trip(ctx, kernel["shell"], bridge.ports["shell"], [b"msg"])
    stdin_seen, _ = round_trip(ctx, kernel["stdin"], bridge.ports["stdin"], [b"msg"])
    assert shell_seen[0] == stdin_seen[0]


def test_heartbeats_are_echoed(
    ctx: zmq.Context[zmq.Socket[bytes]], kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    req = client(ctx, zmq.REQ, bridge.ports["hb"])
    req.send(b"ping")
    kernel["hb"].send_multipart(recv(kernel["hb"]))  # the kernel's heartbeat echoes
    assert recv(req) == [b"ping"]


def test_published_iopub_messages_reach_a_subscriber(
    ctx: zmq.Context[zmq.Socket[bytes]], kernel: dict[str, zmq.Socket[bytes]], bridge: KernelBridge
) -> None:
    sub = client(ctx, zmq.SUB, bridge.ports["iopub"])
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # The subscription travels client -> bridge -> kernel asynchronously: publish until it lands.
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        kernel["iopub"].send_multipart([b"kernel.k1.status", b"busy"])
        if sub.poll(50):
            assert sub.recv_multipart() == [b"kernel.k1.status", b"busy"]
            return
    raise AssertionError("no iopub message arrived within 2 s")


def test_stop_frees_the_ports_and_a_new_bridge_reuses_them(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: dict[str, str], kernel: dict[str, zmq.Socket[bytes]]
) -> None:
    first = KernelBridge(endpoints)
    ports = dict(first.start())
    first.stop()
    assert not first.running

    # Free as soon as stop() returns. The probe has a context of its own: terminating it
    # releases the ports again before the next bridge binds them.
    probe: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for port in ports.values():
            probe.socket(zmq.ROUTER).bind(f"tcp://127.0.0.1:{port}")
    finally:
        probe.destroy(linger=0)

    # A live kernel polls its sockets all the time, and that is when its ROUTER drops the
    # old bridge's peer; until then it would refuse a new peer with the same identity.
    assert not kernel["shell"].poll(100)

    second = KernelBridge(endpoints, ports=ports)
    try:
        assert second.start() == ports
        _, reply = round_trip(ctx, kernel["shell"], ports["shell"], [b"again"])
        assert reply == [b"again"]
    finally:
        second.stop()


def test_start_twice_returns_the_same_ports(bridge: KernelBridge) -> None:
    assert bridge.start() == bridge.ports


def test_a_taken_port_fails_start_and_leaves_nothing_bound(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: dict[str, str]
) -> None:
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
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: dict[str, str], kernel: dict[str, zmq.Socket[bytes]]
) -> None:
    public, secret = zmq.curve_keypair()
    bridge = KernelBridge(endpoints, curve=CurveKeys(public=public, secret=secret))
    ports = bridge.start()
    try:
        _, reply = round_trip(ctx, kernel["shell"], ports["shell"], [b"sealed"], curve_server_key=public)
        assert reply == [b"sealed"]

        plain = client(ctx, zmq.DEALER, ports["shell"])
        plain.send_multipart([b"plaintext"])
        assert not kernel["shell"].poll(200)
    finally:
        bridge.stop()
