"""A meter on the bytes between the sandbox and the host's bridge: whole messages bounded.

ZeroMQ caps each frame it receives (``ZMQ_MAXMSGSIZE``), not a message: it hands over a
multipart message only once its last frame has come, and holds every frame before it.
Whatever binds the sockets the bridge connects to (the channel relay, or code that took
its place) could send frames of just under the cap with the MORE flag set, without end,
and the server would hold them all (a kernel with 1 GiB sent 3 GiB in 6 s that way).

So the bridge does not connect to the sandbox's sockets itself: it connects to a meter in
the server, one listening unix socket per channel in the kernel's server-only runtime
folder, which connects on to the sandbox's socket and passes the bytes through, both
ways, unchanged. ZeroMQ still speaks the protocol at both ends; the meter only reads the
frame headers of what comes from the sandbox (ZMTP 3: a 64-byte greeting, then frames,
each a flags byte and a length) and, before it passes on a frame that would take the
message over its channel's cap (all its frames together, 64 bytes counted for each, at
most ``max_frames`` of them) or one that breaks the framing, cuts the connection. ZeroMQ
drops the part it holds and connects again, as when a frame is over its own cap; the
bridge answers the requests that were waiting (``ReplyLost``). The server so holds at most
one channel's cap of a message, whoever sent it.

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


@dataclass
class MessageMeter:
    """Reads the frame headers of one connection's bytes from the sandbox.

    :meth:`feed` is given each chunk before it is passed on, and says whether it may be:
    None, or why not (the link is then cut: nothing of that chunk passes).
    """

    cap: int
    max_frames: int = 1024
    _greeting: bytearray = field(default_factory=bytearray)
    _header: bytearray = field(default_factory=bytearray)
    _body_left: int = 0  # bytes of the current frame's body still to come
    _message: int = 0  # cost of the message so far
    _frames: int = 0

    def feed(self, data: bytes) -> str | None:
        view = memoryview(data)
        while view:
            if len(self._greeting) < GREETING:
                taken = view[: GREETING - len(self._greeting)]
                self._greeting += taken
                view = view[len(taken) :]
                why = self._check_greeting()
                if why is not None:
                    return why
                continue
            if self._body_left:
                step = min(self._body_left, len(view))
                self._body_left -= step
                view = view[step:]
                continue
            self._header.append(view[0])
            view = view[1:]
            why = self._frame()
            if why is not None:
                return why
        return None

    def _check_greeting(self) -> str | None:
        greeting = self._greeting
        if greeting[0] != SIGNATURE_FIRST or (len(greeting) >= 10 and greeting[9] != SIGNATURE_LAST):
            return "not a ZeroMQ greeting"
        if len(greeting) >= 11 and greeting[10] != 3:
            return f"ZMTP version {greeting[10]}, not 3"
        return None

    def _frame(self) -> str | None:
        """A frame header read so far: check it once whole."""
        flags = self._header[0]
        if flags & ~(MORE | LONG | COMMAND):
            return "a frame with unknown flags"
        length_bytes = 8 if flags & LONG else 1
        if len(self._header) < 1 + length_bytes:
            return None
        size = int.from_bytes(self._header[1:], "big")
        self._header.clear()
        self._body_left = size
        if flags & COMMAND:
            if flags & MORE:
                return "a command with the MORE flag"
            return "a command over 64 KiB" if size > MAX_COMMAND else None
        self._frames += 1
        self._message += size + FRAME_COST
        if self._message > self.cap:
            return f"a message over {self.cap / 2**20:g} MiB"
        if self._frames > self.max_frames:
            return f"a message of more than {self.max_frames} frames"
        if not flags & MORE:
            self._message, self._frames = 0, 0
        return None


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
    folder). ``on_cut(channel, reason)``: told (from the meter's thread) of every link cut.
    """

    def __init__(self, folder: Path, on_cut: Callable[[str, str], None]) -> None:
        self.folder = folder
        self.on_cut = on_cut
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
                why = link.meter.feed(data)
                if why is not None:
                    self._cut(link, why)
                    return
                link.to_bridge += data
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
        """End ``link`` (``why``: it broke the meter's bounds; None: a side closed, and
        what the sandbox sent before it did still goes to the bridge, as it would have)."""
        self._links.discard(link)
        self._waiting.discard(link)
        self._silent.discard(link)
        if why is not None:
            self.on_cut(link.channel, why)  # (told before the bridge sees the link go)
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
