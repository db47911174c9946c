"""A meter on the bytes between the sandbox and the host's bridge: whole messages bounded.

ZeroMQ caps each frame it receives (``ZMQ_MAXMSGSIZE``), not a message: it hands over a
multipart message only once its last frame has come, and holds every frame before it.
Whatever binds the sockets the bridge connects to (the channel relay, or code that took
its place) could send frames of just under the cap with the MORE flag set, without end,
and the server would hold them all (a kernel with 1 GiB sent 3 GiB in 6 s that way).

So the bridge does not connect to the sandbox's sockets itself: it connects to a meter
in the server, one listening unix socket per channel in the kernel's server-only runtime
folder, which connects on to the sandbox's socket and passes the bytes through, both
ways. ZeroMQ still speaks the protocol at both ends; the meter only reads the frame
headers of what comes from the sandbox (ZMTP 3: a 64-byte greeting, then frames, each a
flags byte and a length) and holds each message back until its last frame has come
(commands pass at once: ZeroMQ takes them apart from messages). A message that would go
over its channel's cap (all its frames together, 64 bytes counted for each, at most
``max_frames`` of them) is dropped whole, and the connection goes on: what the kernel
sends next passes as usual (cutting the connection instead, as the meter once did, lost
whatever the kernel sent until ZeroMQ had connected again: the reply to the next cell,
say). A reply dropped so is answered by the host (``ReplyLost``) once the kernel has
gone on to a later request. Bytes that break the framing cut the connection. The server
so holds at most one channel's cap of a message, whoever sent it.

What comes from clients is capped by the bridge's client-facing sockets, and checked once
whole; what the host sends the sandbox is passed as it is.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: ZMTP 3's greeting: signature (10), version (2), mechanism (20), as-server (1), filler (31).
GREETING = 64
#: The first byte of the signature, and its last (ZMTP 3.0, rfc.zeromq.org/spec/23).
SIGNATURE_FIRST, SIGNATURE_LAST = 0xFF, 0x7F
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
#: Commands (the handshake's READY, ZMTP 3.1's PING and SUBSCRIBE) are small.
MAX_COMMAND = 64 * 2**10
#: What a frame costs the server beyond its bytes (a message part in libzmq).
FRAME_COST = 64
#: Bytes read at a time, and the most waiting to be written on each side of a link.
CHUNK = 256 * 2**10
#: Seconds between tries to reach a sandbox socket that is not there (ZeroMQ's own pace).
RETRY = 0.1
#: A ZeroMQ peer greets at once. gVisor's gofer may go on accepting connections at a path
#: whose socket the sandbox has closed (for a second or two, after a pause began), and such
#: a connection stays silent: one that has not greeted within this many seconds is dropped
#: and the path tried again.
GREETING_WAIT = 1.0


_METERS = itertools.count()


class BrokenFraming(Exception):
    """What the sandbox sent is not ZMTP 3 that the meter can follow: the link is cut."""


@dataclass
class MessageMeter:
    """Reads the frame headers of one connection's bytes from the sandbox, and holds each
    message back until its last frame has come.

    :meth:`feed` is given each chunk as it comes and returns what of it may be passed on:
    the greeting and commands as they come, a message once whole. A message that goes past
    the cap (or ``max_frames``) is dropped whole: what was held of it is let go, the rest
    read and thrown away as it comes, and the next message passes as usual on the same
    connection, so nothing the kernel sends after it is lost to a reconnection. Why each
    was dropped waits in :attr:`dropped` for the caller. Bytes the meter cannot follow as
    frames raise :class:`BrokenFraming`.
    """

    cap: int
    max_frames: int = 1024
    #: Why each message dropped since the caller last looked was, and its bytes counted
    #: until then, at most the cap (the caller clears it).
    dropped: list[tuple[str, int]] = field(default_factory=list)
    _greeting: bytearray = field(default_factory=bytearray)
    _header: bytearray = field(default_factory=bytearray)
    _body_left: int = 0  # bytes of the current frame's body still to come
    _sink: str = "pass"  # where the current frame's bytes go: "pass", "hold" or "drop"
    _last: bool = False  # the current frame ends its message
    _held: bytearray = field(default_factory=bytearray)  # the message so far
    _out: bytearray = field(default_factory=bytearray)  # what feed() passes on
    _dropping: bool = False  # the current message is over a bound: thrown away
    _message: int = 0  # cost of the message so far
    _frames: int = 0

    def feed(self, data: bytes) -> bytearray:
        view = memoryview(data)
        while view:
            broken = None
            if len(self._greeting) < GREETING:
                taken = view[: GREETING - len(self._greeting)]
                self._greeting += taken
                self._out += taken
                view = view[len(taken) :]
                broken = self._check_greeting()
            elif self._body_left:
                step = min(self._body_left, len(view))
                self._put(view[:step])
                self._body_left -= step
                view = view[step:]
                if not self._body_left:
                    self._frame_done()
            else:
                self._header.append(view[0])
                view = view[1:]
                broken = self._frame()
            if broken is not None:
                raise BrokenFraming(broken)
        passed, self._out = self._out, bytearray()
        return passed

    def _check_greeting(self) -> str | None:
        greeting = self._greeting
        if greeting[0] != SIGNATURE_FIRST or (len(greeting) >= 10 and greeting[9] != SIGNATURE_LAST):
            return "not a ZeroMQ greeting"
        if len(greeting) >= 11 and greeting[10] != 3:
            return f"ZMTP version {greeting[10]}, not 3"
        return None

    def _frame(self) -> str | None:
        """A frame header read so far: once whole, check it and say where its bytes go
        (returns why the framing is broken, if it is)."""
        flags = self._header[0]
        if flags & ~(MORE | LONG | COMMAND):
            return "a frame with unknown flags"
        length_bytes = 8 if flags & LONG else 1
        if len(self._header) < 1 + length_bytes:
            return None
        size = int.from_bytes(self._header[1:], "big")
        if flags & COMMAND:
            if flags & MORE:
                return "a command with the MORE flag"
            if size > MAX_COMMAND:
                return "a command over 64 KiB"
            # At once, even between a held message's frames: ZeroMQ takes commands apart
            # from messages, and a held command would cost the server beyond the cap.
            self._sink, self._last = "pass", False
        else:
            self._frames += 1
            self._message += size + FRAME_COST
            if not self._dropping:
                if self._message > self.cap:
                    self._drop(f"a message over {self.cap / 2**20:g} MiB")
                elif self._frames > self.max_frames:
                    self._drop(f"a message of more than {self.max_frames} frames")
            self._sink, self._last = ("drop" if self._dropping else "hold"), not flags & MORE
        self._put(self._header)
        self._header.clear()
        self._body_left = size
        if not size:
            self._frame_done()
        return None

    def _put(self, data: bytearray | memoryview) -> None:
        if self._sink == "pass":
            self._out += data
        elif self._sink == "hold":
            self._held += data

    def _drop(self, why: str) -> None:
        # (Counted up to the cap: past it, the frame's length is only the kernel's word.)
        self.dropped.append((why, min(self._message, self.cap)))
        self._dropping = True
        self._held = bytearray()  # (let go at once: it may be the whole cap)

    def _frame_done(self) -> None:
        if not self._last:
            return
        if self._dropping:
            pass
        elif len(self._out) >= len(self._held):  # (each byte copied a bounded number of times)
            self._out += self._held
            self._held = bytearray()
        else:  # (the message may be the whole cap: what passes before it goes in front)
            self._held[:0] = self._out
            self._out, self._held = self._held, bytearray()
        self._dropping, self._message, self._frames, self._last = False, 0, 0, False


@dataclass(eq=False)
class _Link:
    """One connection through the meter: the bridge's end and the sandbox's."""

    channel: str
    bridge: socket.socket
    sandbox_path: str
    meter: MessageMeter
    sandbox: socket.socket | None = None  # None: not connected yet
    #: While the sandbox's side has said nothing: when it was connected, and what the
    #: bridge's side has sent it (said again to the next socket, if this one is dead).
    connected_at: float = 0.0
    unanswered: bytearray = field(default_factory=bytearray)
    to_bridge: bytearray = field(default_factory=bytearray)
    to_sandbox: bytearray = field(default_factory=bytearray)


class Meter:
    """The meter of one kernel's channels: a thread, and a listening socket per channel.

    ``folder``: where its sockets go, readable by this process alone (the kernel's runtime
    folder). ``on_refused(channel, reason, size)``: told (from the meter's thread) of
    every message dropped whole (``size``: its bytes counted until then; the link goes
    on) and every link cut (``size`` None).
    """

    def __init__(self, folder: Path, on_refused: Callable[[str, str, int | None], None]) -> None:
        self.folder = folder
        self.on_refused = on_refused
        self._selector = selectors.DefaultSelector()
        self._wake_rx, self._wake_tx = socket.socketpair()
        self._wake_rx.setblocking(False)
        self._selector.register(self._wake_rx, selectors.EVENT_READ, None)
        self._listeners: dict[socket.socket, tuple[str, str, int]] = {}
        self._new: list[socket.socket] = []  # listeners for the thread to watch
        self._paths: list[Path] = []
        self._links: set[_Link] = set()
        #: Links whose sandbox side has no socket to connect to yet (the kernel is paused,
        #: or restarting): tried again every RETRY seconds, the bridge's side held open
        #: meanwhile (ZeroMQ would otherwise reconnect, and the bridge make new sockets,
        #: ten times a second for as long as a kernel stays paused).
        self._waiting: set[_Link] = set()
        self._next_retry = 0.0
        #: Links whose sandbox side has not greeted yet (see GREETING_WAIT).
        self._silent: set[_Link] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._number = next(_METERS)
        self._thread = threading.Thread(target=self._run, name="sandbox-kernel-meter", daemon=True)
        self._thread.start()

    def endpoint(self, channel: str, sandbox_path: str, cap: int) -> str:
        """Listen for ``channel``, passing on to the unix socket at ``sandbox_path``, each
        message bounded by ``cap`` bytes; the address the bridge connects to instead."""
        # Short (a unix socket's path has at most 107 bytes), and no longer than where the
        # kernel's sockets are (launch-N/kernel-N in the same folder).
        path = self.folder / f"m-{os.getpid()}-{self._number}-{len(self._paths)}"
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(8)
        listener.setblocking(False)
        self._paths.append(path)
        with self._lock:
            self._listeners[listener] = (channel, sandbox_path, cap)
            self._new.append(listener)
        self._wake()  # (a connection made before the thread watches it waits in the backlog)
        return f"ipc://{path}"

    def close(self) -> None:
        """Cut every link, stop listening, remove the sockets' files."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout=5)
        for sock in [*self._listeners, self._wake_rx, self._wake_tx]:
            sock.close()
        for link in self._links:
            link.bridge.close()
            if link.sandbox is not None:
                link.sandbox.close()
        self._links.clear()
        self._listeners.clear()
        self._selector.close()
        for path in self._paths:
            path.unlink(missing_ok=True)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_tx.send(b"x")

    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                new, self._new = self._new, []
            for listener in new:
                self._selector.register(listener, selectors.EVENT_READ, listener)
            now = time.monotonic()
            if self._waiting and now >= self._next_retry:
                self._next_retry = now + RETRY
                for link in list(self._waiting):
                    self._connect(link)
            for link in [link for link in self._silent if now - link.connected_at >= GREETING_WAIT]:
                self._reconnect_sandbox(link)
            waits = [self._next_retry - now] if self._waiting else []
            waits += [link.connected_at + GREETING_WAIT - now for link in self._silent]
            wait = max(0.0, min(waits)) if waits else None
            for key, mask in self._selector.select(wait):
                try:
                    if key.data is None:
                        with contextlib.suppress(OSError):
                            self._wake_rx.recv(4096)
                    elif isinstance(key.data, socket.socket):
                        self._accept(key.data)
                    else:
                        self._move(key.data, key.fileobj, mask)  # type: ignore[arg-type]
                except Exception:  # the meter goes on: a dead one would silence the kernel
                    log.exception("The channel meter failed on an event; going on")

    def _accept(self, listener: socket.socket) -> None:
        try:
            bridge, _ = listener.accept()
        except BlockingIOError:
            return
        channel, sandbox_path, cap = self._listeners[listener]
        bridge.setblocking(False)
        link = _Link(channel, bridge, sandbox_path, MessageMeter(cap))
        self._links.add(link)
        self._connect(link)

    def _connect(self, link: _Link) -> None:
        """Connect ``link``'s sandbox side, or leave it waiting (see :attr:`_waiting`)."""
        if link not in self._links:
            self._waiting.discard(link)
            return
        sandbox = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sandbox.settimeout(0.2)
            sandbox.connect(link.sandbox_path)
        except OSError:
            sandbox.close()
            self._waiting.add(link)
        else:
            sandbox.setblocking(False)
            link.sandbox, link.connected_at = sandbox, time.monotonic()
            self._waiting.discard(link)
            self._silent.add(link)
        self._watch(link)

    def _reconnect_sandbox(self, link: _Link) -> None:
        """The sandbox's side never greeted: drop that socket, try the path again, and say
        again what the bridge had said to it."""
        self._silent.discard(link)
        sandbox, link.sandbox = link.sandbox, None
        if sandbox is not None:
            if sandbox in self._selector.get_map():
                self._selector.unregister(sandbox)
            sandbox.close()
        link.to_sandbox[:0] = link.unanswered
        link.unanswered.clear()
        self._waiting.add(link)
        self._watch(link)

    def _watch(self, link: _Link) -> None:
        """Read a side only while what it sent waits for no one; write while some waits."""
        for sock, outgoing, incoming in (
            (link.bridge, link.to_bridge, link.to_sandbox),
            (link.sandbox, link.to_sandbox, link.to_bridge),
        ):
            if sock is None:
                continue
            mask = (selectors.EVENT_WRITE if outgoing else 0) | (
                selectors.EVENT_READ if len(incoming) < CHUNK else 0
            )
            registered = sock in self._selector.get_map()
            if mask and registered:
                self._selector.modify(sock, mask, link)
            elif mask:
                self._selector.register(sock, mask, link)
            elif registered:
                self._selector.unregister(sock)

    def _move(self, link: _Link, sock: socket.socket, mask: int) -> None:
        if link not in self._links:
            return
        if mask & selectors.EVENT_READ:
            try:
                data = sock.recv(CHUNK)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._cut(link, None)
                return
            if data and sock is link.sandbox:
                if link in self._silent:  # it greets: a live socket
                    self._silent.discard(link)
                    link.unanswered.clear()
                try:
                    passed = link.meter.feed(data)
                except BrokenFraming as exc:
                    self._cut(link, str(exc))
                    return
                for why, size in link.meter.dropped:
                    self.on_refused(link.channel, why, size)
                link.meter.dropped.clear()
                # (No copy of what passes: a whole message may be the channel's cap.)
                passed[:0] = link.to_bridge
                link.to_bridge = passed
            elif data:
                link.to_sandbox += data
        for target, outgoing in ((link.bridge, link.to_bridge), (link.sandbox, link.to_sandbox)):
            if target is None or not outgoing:
                continue
            try:
                sent = target.send(outgoing)
                if target is link.sandbox and link in self._silent:
                    link.unanswered += outgoing[:sent]
                del outgoing[:sent]
            except BlockingIOError:
                pass
            except OSError:
                self._cut(link, None)
                return
        self._watch(link)

    def _cut(self, link: _Link, why: str | None) -> None:
        """End ``link`` (``why``: it broke the framing; None: a side closed, and what the
        sandbox sent before it did still goes to the bridge, as it would have)."""
        self._links.discard(link)
        self._waiting.discard(link)
        self._silent.discard(link)
        if why is not None:
            self.on_refused(link.channel, why, None)  # (told before the bridge sees the link go)
        elif link.to_bridge:
            with contextlib.suppress(OSError):
                link.bridge.settimeout(1.0)
                link.bridge.sendall(link.to_bridge)
        for sock in (link.bridge, link.sandbox):
            if sock is None:
                continue
            if sock in self._selector.get_map():
                self._selector.unregister(sock)
            sock.close()
