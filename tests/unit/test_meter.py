"""The meter between the sandbox's sockets and the bridge, with real ZeroMQ peers on both
sides: whole messages bounded, whatever sends them (see sandbox_kernel/meter.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from sandbox_kernel.channels.meter import BrokenFraming, MessageMeter, Meter
from tests.unit.conftest import Ctx


@pytest.fixture
def meter(tmp_path: Path) -> Iterator[tuple[Meter, list[tuple[str, str]]]]:
    refused: list[tuple[str, str]] = []
    folder = tmp_path / "runtime"
    folder.mkdir(mode=0o700)
    meter = Meter(folder, lambda channel, why, _size: refused.append((channel, why)))
    yield meter, refused
    meter.close()
    assert list(folder.iterdir()) == [], "the meter removes its sockets"


def _greeting() -> bytes:
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31


def _frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


READY = _frame(b"\x05READY", command=True)


def _feed(meter: MessageMeter, stream: bytes, size: int) -> bytes:
    return b"".join(meter.feed(stream[i : i + size]) for i in range(0, len(stream), size))


def test_the_meter_reads_frames_in_any_chunks_and_passes_each_message_once_whole() -> None:
    message = b"".join(_frame(b"x" * 1000, more=True) for _ in range(9)) + _frame(b"end")
    stream = _greeting() + READY + message + _frame(b"", more=True) + _frame(b"")
    for size in (1, 7, 64, len(stream)):
        meter = MessageMeter(cap=16 * 1024)
        assert _feed(meter, stream, size) == stream
        assert meter.dropped == []
    # Held back until its last frame has come: the greeting and the command pass at once.
    meter = MessageMeter(cap=16 * 1024)
    assert meter.feed(_greeting() + READY + message[:-5]) == _greeting() + READY
    assert meter.feed(message[-5:]) == message


def test_a_message_over_the_cap_is_dropped_whole_and_the_next_one_passes() -> None:
    """Refused at the frame that takes it past the cap: what was held of it is let go,
    the rest thrown away as it comes; the connection goes on."""
    big = b"".join(_frame(b"x" * 1000, more=True) for _ in range(9)) + _frame(b"end")
    after = _frame(b"reply", more=True) + _frame(b"{}")
    stream = _greeting() + READY + big + after
    for size in (1, 7, 64, 3000, len(stream)):
        meter = MessageMeter(cap=5000)
        assert _feed(meter, stream, size) == _greeting() + READY + after
        assert [why for why, _ in meter.dropped] == ["a message over 0.00476837 MiB"]
    meter = MessageMeter(cap=2**30)
    many = b"".join(_frame(b"", more=True) for _ in range(1025)) + _frame(b"")
    assert meter.feed(_greeting() + many + after) == _greeting() + after
    assert [why for why, _ in meter.dropped] == ["a message of more than 1024 frames"]


def test_a_command_inside_a_message_passes_at_once_and_is_never_held() -> None:
    """ZeroMQ takes commands apart from messages: one sent between a message's frames
    passes before the message (whole, after its last frame), and one sent while a message
    is dropped passes too. Held, commands inside a never-ending message would cost the
    server without bound (they count toward no message's cap)."""
    ping = _frame(b"\x04PING\x00\x00", command=True)
    meter = MessageMeter(cap=2**20)
    assert meter.feed(_greeting() + _frame(b"a", more=True) + ping) == _greeting() + ping
    assert meter.feed(_frame(b"b")) == _frame(b"a", more=True) + _frame(b"b")
    dropped = _greeting() + _frame(b"a" * 200, more=True) + ping + _frame(b"b")
    assert MessageMeter(cap=100).feed(dropped) == _greeting() + ping
    endless = MessageMeter(cap=2**20)
    endless.feed(_greeting() + _frame(b"a", more=True))
    big_ping = _frame(b"\x04PING" + b"x" * 60000, command=True)
    for _ in range(100):  # 6 MiB of commands: all passed, none held
        assert endless.feed(big_ping) == big_ping
    assert len(endless._held) < 100


@pytest.mark.timeout(60)  # (the meter's thread once copied the big one per small one: an hour)
def test_many_small_messages_read_with_a_large_one_cost_no_copy_of_it_each() -> None:
    """A message near the cap ending at the start of a read, then a read's worth of empty
    messages: each message passes, and the large one is not copied again for each."""
    cap = 64 * 2**20
    large = _frame(b"x" * (cap - 200))
    meter = MessageMeter(cap=cap)
    assert meter.feed(_greeting() + large[:-10]) == _greeting()
    small = _frame(b"") * 131_000
    assert meter.feed(large[-10:] + small) == large + small


@pytest.mark.parametrize(
    ("stream", "why"),
    [
        (b"GET / HTTP/1.1\r\n", "not a ZeroMQ greeting"),
        (_greeting()[:10] + b"\x02" + _greeting()[11:], "ZMTP version 2, not 3"),
        (_greeting() + b"\x08\x01x", "a frame with unknown flags"),
        (_greeting() + _frame(b"x" * 70000, command=True), "a command over 64 KiB"),
        (_greeting() + bytes([1 | 4, 1]) + b"x", "a command with the MORE flag"),
    ],
)
def test_what_breaks_the_framing_is_refused(stream: bytes, why: str) -> None:
    with pytest.raises(BrokenFraming, match=why):
        MessageMeter(cap=2**30).feed(stream)


def test_messages_pass_both_ways_unchanged(
    ctx: Ctx, tmp_path: Path, meter: tuple[Meter, list[tuple[str, str]]]
) -> None:
    """As the channel relay's ROUTER and the bridge's DEALER talk, through the meter."""
    the_meter, refused = meter
    relay = ctx.socket(zmq.ROUTER)
    relay.bind(f"ipc://{tmp_path}/kernel-1")
    bridge = ctx.socket(zmq.DEALER)
    bridge.setsockopt(zmq.IDENTITY, b"bridge")
    bridge.connect(the_meter.endpoint("shell", str(tmp_path / "kernel-1"), 32 * 2**20))
    big = os.urandom(8 * 2**20)
    bridge.send_multipart([b"request", big])
    assert relay.poll(10_000)
    assert relay.recv_multipart() == [b"bridge", b"request", big]
    relay.send_multipart([b"bridge", b"reply", big, b"end"])
    assert bridge.poll(10_000)
    assert bridge.recv_multipart() == [b"reply", big, b"end"]
    assert refused == []
    bridge.close(linger=0)
    relay.close(linger=0)


def test_a_reply_sent_right_after_an_oversized_one_arrives_on_the_same_connection(
    ctx: Ctx, tmp_path: Path, meter: tuple[Meter, list[tuple[str, str]]]
) -> None:
    """The meter once cut the link at an oversized message, and what the kernel sent
    before ZeroMQ had connected again was lost: the reply to the next cell, sent at once."""
    the_meter, refused = meter
    relay = ctx.socket(zmq.ROUTER)
    relay.bind(f"ipc://{tmp_path}/kernel-7")
    bridge = ctx.socket(zmq.DEALER)
    bridge.setsockopt(zmq.IDENTITY, b"bridge")
    monitor = bridge.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    bridge.connect(the_meter.endpoint("shell", str(tmp_path / "kernel-7"), 32 * 2**20))
    bridge.send(b"request")
    assert relay.poll(10_000)
    relay.recv_multipart()
    relay.send_multipart([b"bridge", b"oversized", b"x" * (40 * 2**20)])
    relay.send_multipart([b"bridge", b"next", b"reply"])
    assert bridge.poll(10_000)
    assert bridge.recv_multipart() == [b"next", b"reply"]
    assert refused == [("shell", "a message over 32 MiB")]
    events = []
    while monitor.poll(200):
        events.append(parse_monitor_message(monitor.recv_multipart())["event"])
    assert events == [zmq.EVENT_CONNECTED], "one connection, never cut"
    bridge.disable_monitor()
    monitor.close(linger=0)
    bridge.close(linger=0)
    relay.close(linger=0)


SENDER = """
import sys, time, zmq
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
pub.bind(sys.argv[1])
pub.recv()  # the subscription: someone listens
chunk = b"x" * (16 * 2**20)
for _ in range(64):  # 1 GiB as one message, each frame under any frame cap
    pub.send(chunk, zmq.SNDMORE, copy=False)
pub.send(b"end")
while True:  # until killed (once the meter cut the link here, and XPUB dropped what came
    time.sleep(0.5)  # before ZeroMQ had connected and subscribed again)
    pub.send(b"small")
"""


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_one_message_of_many_frames_costs_the_server_at_most_its_cap(
    ctx: Ctx, tmp_path: Path, meter: tuple[Meter, list[tuple[str, str]]]
) -> None:
    """The attack of issue #22: frames just under ZeroMQ's frame cap, MORE set, 1 GiB in
    all. Without the meter the subscriber's process held all of it (about 1 GiB); through
    it, the message is dropped at the cap and the next message arrives."""
    the_meter, refused = meter
    path = tmp_path / "kernel-2"
    sender = subprocess.Popen([sys.executable, "-c", SENDER, f"ipc://{path}"])
    try:
        deadline = time.monotonic() + 10
        while not path.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.MAXMSGSIZE, 64 * 2**20)
        sub.connect(the_meter.endpoint("iopub", str(path), 64 * 2**20))
        before, peak, done = _rss(), [0], threading.Event()

        def sample() -> None:
            while not done.wait(0.005):
                peak[0] = max(peak[0], _rss())

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            assert sub.poll(30_000)
            assert sub.recv_multipart() == [b"small"]
        finally:
            done.set()
            sampler.join()
        grew = peak[0] - before
        print(f"1 GiB as one message through the meter: the process grew by {grew / 2**20:.0f} MiB")
        assert grew < 160 * 2**20
        assert refused[:1] == [("iopub", "a message over 64 MiB")]
        sub.close(linger=0)
    finally:
        sender.kill()
        sender.wait()


def test_a_peer_that_is_not_zeromq_is_cut_off(
    tmp_path: Path, meter: tuple[Meter, list[tuple[str, str]]]
) -> None:
    the_meter, refused = meter
    path = tmp_path / "kernel-3"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    client = socket.socket(socket.AF_UNIX)
    client.connect(the_meter.endpoint("stdin", str(path), 2**20).removeprefix("ipc://"))
    peer, _ = listener.accept()
    peer.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    client.settimeout(5)
    assert client.recv(100) == b"", "nothing of it passes; the link is closed"
    assert refused == [("stdin", "not a ZeroMQ greeting")]
    for sock in (client, peer, listener):
        sock.close()


def test_the_meter_connects_to_nothing_while_the_sandbox_has_no_socket(
    ctx: Ctx, tmp_path: Path, meter: tuple[Meter, list[tuple[str, str]]]
) -> None:
    """A paused kernel's relay holds no socket: ZeroMQ keeps trying, and is through once
    the relay binds again."""
    the_meter, _ = meter
    bridge = ctx.socket(zmq.DEALER)
    bridge.connect(the_meter.endpoint("control", str(tmp_path / "kernel-4"), 2**20))
    bridge.send(b"waiting")
    time.sleep(0.5)
    relay = ctx.socket(zmq.ROUTER)
    relay.bind(f"ipc://{tmp_path}/kernel-4")
    assert relay.poll(10_000)
    assert relay.recv_multipart()[1:] == [b"waiting"]
    bridge.close(linger=0)
    relay.close(linger=0)


def test_while_the_sandbox_has_no_socket_the_bridges_connection_is_held(
    ctx: Ctx, tmp_path: Path, meter: tuple[Meter, list[tuple[str, str]]]
) -> None:
    """A paused kernel may stay paused for hours: the meter keeps ZeroMQ's connection and
    tries the sandbox's socket ten times a second, rather than having ZeroMQ (and the
    bridge, which makes a new socket each time) connect again that often."""
    the_meter, _ = meter
    bridge = ctx.socket(zmq.DEALER)
    bridge.setsockopt(zmq.HANDSHAKE_IVL, 0)
    monitor = bridge.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    bridge.connect(the_meter.endpoint("shell", str(tmp_path / "kernel-5"), 2**20))
    events = []
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        if monitor.poll(100):
            events.append(parse_monitor_message(monitor.recv_multipart())["event"])
    assert events == [zmq.EVENT_CONNECTED]
    bridge.disable_monitor()
    monitor.close(linger=0)
    bridge.close(linger=0)


def test_a_silent_socket_at_the_path_is_dropped_and_the_path_tried_again(
    ctx: Ctx, tmp_path: Path, meter: tuple[Meter, list[tuple[str, str]]]
) -> None:
    """gVisor's gofer may go on accepting connections at a path whose socket the sandbox
    closed as a pause began, and such a connection never says a word: the meter gives it
    a second to greet, then tries the path again, saying again what the bridge said."""
    the_meter, _ = meter
    path = tmp_path / "kernel-6"
    silent = socket.socket(socket.AF_UNIX)
    silent.bind(str(path))
    silent.listen(4)
    bridge = ctx.socket(zmq.DEALER)
    bridge.setsockopt(zmq.HANDSHAKE_IVL, 0)
    bridge.connect(the_meter.endpoint("shell", str(path), 2**20))
    bridge.send(b"after the pause")
    time.sleep(0.3)
    accepted, _ = silent.accept()  # taken, never answered
    silent.close()
    path.unlink()
    relay = ctx.socket(zmq.ROUTER)
    relay.bind(f"ipc://{path}")
    assert relay.poll(10_000)
    assert relay.recv_multipart()[1:] == [b"after the pause"]
    accepted.close()
    bridge.close(linger=0)
    relay.close(linger=0)
