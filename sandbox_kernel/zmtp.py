"""ZeroMQ's wire protocol spoken in Python, so that a message is bounded as it arrives.

libzmq hands an application a multipart message only once its last frame has come, and
its size cap (``ZMQ_MAXMSGSIZE``) bounds each frame, not the message: a peer that keeps
sending frames with MORE set makes the receiving process hold all of them, out of the
application's sight (issue #22: a server went from 64 MiB to 3 GiB in 6 s, one message of
16 MiB frames). So the bridge speaks ZMTP itself to peers it does not trust: it reads frame
by frame, and a message over its cap in bytes or in frames (:class:`Limits`) is drained as
it arrives and dropped, nothing of it kept, the connection working on.

Implemented: ZMTP 3.0 (https://rfc.zeromq.org/spec/23/) with the NULL mechanism, as
libzmq 4 speaks it (3.1's SUBSCRIBE, CANCEL and PING commands are understood too), and
what three kinds of ZeroMQ socket do with the messages:

- :class:`Dealer` connects to one unix socket and keeps connecting: the bridge's end of
  a kernel's shell, control, stdin and heartbeat channels; with ``xsub`` it is the IOPub
  subscriber (subscribed to everything).
- :class:`Router` and :class:`XPub` listen, for many peers: the ends clients connect to.

Not implemented: CURVE (the bridge keeps libzmq's sockets for CurveZMQ clients), PLAIN,
ZMTP 1.0 and 2.0 (libzmq before 4.0). An endpoint belongs to one thread, which polls its
:meth:`Endpoint.poll_items` beside its other sockets and calls :meth:`Endpoint.handle`.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import stat
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
#: Ours: ZMTP 3.0, the NULL mechanism. A libzmq peer then sends subscriptions as messages.
GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)
#: What each frame costs besides its bytes, charged to its message: a frame is an object.
FRAME_COST = 64
#: Largest command (READY with its properties, PING) a peer may send.
MAX_COMMAND = 64 * 2**10
#: Bytes read at once into the parse buffer (a large frame's body is read straight in).
_CHUNK = 64 * 2**10
#: Bytes one connection reads before other sockets get a turn, and at most in one read.
_TURN = 4 * 2**20
#: Messages waiting in an endpoint's inbox before it reads more.
BATCH = 100
#: Buffers handed to one sendmsg (writev) call.
_IOV = 64
#: Seconds between attempts to reach a peer that is not there (libzmq's reconnect_ivl).
RECONNECT = 0.1
#: Seconds a connection may take to complete its handshake (libzmq's handshake_ivl).
HANDSHAKE = 30.0
#: Topics one subscriber may hold.
MAX_SUBSCRIPTIONS = 256

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
#: What is written: a frame's header or bytes.
Chunk = bytes | memoryview
#: A frame to send.
Frame = bytes | zmq.Frame


@dataclass(frozen=True)
class Limits:
    """The most one message may be: bytes (every frame's, each charged :data:`FRAME_COST`
    more) and frames. A message over either is drained and dropped as it arrives."""

    message: int
    frames: int = 1024


class Received(list[bytes]):
    """A message's frames as they were read, with who sent it: ``peer`` is (uid, pid) of a
    unix-socket peer as the host's kernel told it (``SO_PEERCRED``), None over tcp."""

    peer: tuple[int, int] | None = None


class ProtocolError(Exception):
    """The peer broke ZMTP: its connection is closed."""


def encode(frames: Sequence[Frame]) -> list[Chunk]:
    """``frames`` as one ZMTP message: buffers to write in order."""
    out: list[Chunk] = []
    last = len(frames) - 1
    for n, frame in enumerate(frames):
        data = frame.buffer if isinstance(frame, zmq.Frame) else frame
        size = len(data)
        flags = MORE if n < last else 0
        if size < 256:
            out.append(bytes((flags, size)) + data)
        else:
            out.append(bytes((flags | LONG,)) + size.to_bytes(8, "big"))
            out.append(data)
    return out


def command(name: bytes, body: bytes = b"") -> bytes:
    """A ZMTP command frame."""
    data = bytes((len(name),)) + name + body
    if len(data) < 256:
        return bytes((COMMAND, len(data))) + data
    return bytes((COMMAND | LONG,)) + len(data).to_bytes(8, "big") + data


def ready(socket_type: bytes, identity: bytes = b"") -> bytes:
    """The READY command of a socket of ``socket_type``."""
    properties = {b"Socket-Type": socket_type}
    if identity:
        properties[b"Identity"] = identity
    body = b"".join(
        bytes((len(name),)) + name + len(value).to_bytes(4, "big") + value
        for name, value in properties.items()
    )
    return command(b"READY", body)


def properties(data: bytes) -> dict[bytes, bytes]:
    """The metadata of a READY command.

    Raises:
        ProtocolError: it is malformed.
    """
    found: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        size = data[pos]
        name = data[pos + 1 : pos + 1 + size]
        pos += 1 + size
        if len(name) != size or pos + 4 > len(data):
            msg = "a malformed READY command"
            raise ProtocolError(msg)
        length = int.from_bytes(data[pos : pos + 4], "big")
        value = data[pos + 4 : pos + 4 + length]
        pos += 4 + length
        if len(value) != length:
            msg = "a malformed READY command"
            raise ProtocolError(msg)
        found[name.lower()] = value
    return found


# The parser's states.
_GREETING, _HEADER, _BODY = range(3)


class Connection:
    """One ZMTP connection: the handshake, messages in (bounded by ``limits``), and
    messages out (queued up to ``queue_limit`` bytes, more when the queue is empty).

    ``accepts`` are the peer socket types this end works with. Complete messages go to
    :attr:`inbox`, the reason for each dropped one to :attr:`drops`.
    """

    def __init__(
        self,
        sock: socket.socket,
        socket_type: bytes,
        accepts: frozenset[bytes],
        limits: Limits,
        queue_limit: int,
        identity: bytes = b"",
    ) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as libzmq: no Nagle delay
        self.sock = sock
        #: By when the handshake must be done, or the connection is closed.
        self.deadline = time.monotonic() + HANDSHAKE
        self._type = socket_type
        self._identity = identity
        self._accepts = accepts
        self._limits = limits
        self._queue_limit = queue_limit
        self.peer = _peer_credentials(sock)
        #: The peer's READY has come (ours went before it was read): messages may flow.
        self.ready = False
        #: Set when :attr:`ready` turns True; whoever reacts to it clears it.
        self.just_ready = False
        self.closed = False
        #: The peer's READY properties (lower-case names).
        self.properties: dict[bytes, bytes] = {}
        self.inbox: deque[Received] = deque()
        self.drops: list[str] = []
        self._in = bytearray()
        self._pos = 0
        self._state = _GREETING
        # The frame being read: its flags, the bytes still to come, what came of it (None:
        # it is dropped). Its bytes are kept as they come, never ahead of them: a header
        # announcing 64 MiB costs nothing until they arrive.
        self._flags = 0
        self._need = 0
        self._body: list[bytes] | None = None
        self._scratch: bytearray | None = None
        # The message being read: its frames so far, its cost, why it is dropped (if it is).
        self._frames: list[bytes] = []
        self._total = 0
        self._count = 0
        self._dropping: str | None = None
        self._out: deque[Chunk] = deque()
        self._out_bytes = 0
        self._write([GREETING])

    # ------------------------------------------------------------------ writing

    @property
    def wants_write(self) -> bool:
        return bool(self._out) and not self.closed

    def send(self, chunks: Sequence[Chunk], size: int) -> bool:
        """Queue an encoded message (:func:`encode`) of ``size`` bytes and write what the
        socket takes now; False if it does not fit the queue (it is dropped)."""
        if self.closed or not self.ready:
            return False
        if self._out_bytes and self._out_bytes + size > self._queue_limit:
            return False
        self._write(chunks)
        return True

    def _write(self, chunks: Sequence[Chunk]) -> None:
        self._out.extend(chunks)
        self._out_bytes += sum(len(chunk) for chunk in chunks)
        self.flush()

    def flush(self) -> None:
        """Write what the socket takes without blocking."""
        out = self._out
        while out and not self.closed:
            try:
                sent = self.sock.sendmsg(list(itertools.islice(out, _IOV)))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            self._out_bytes -= sent
            while sent:
                head = out[0]
                if len(head) <= sent:
                    sent -= len(head)
                    out.popleft()
                else:
                    out[0] = memoryview(head)[sent:]
                    sent = 0

    # ------------------------------------------------------------------ reading

    def on_readable(self, inbox_limit: int = BATCH) -> None:
        """Read a turn's worth of what the peer sent, until :attr:`inbox` holds
        ``inbox_limit`` messages; the connection is closed at its end or on any breach."""
        budget = _TURN
        try:
            while budget > 0 and len(self.inbox) < inbox_limit and not self.closed:
                read = self._read_once(budget)
                if read < 0:
                    break
                budget -= read
        except ProtocolError:
            self.close()

    def _read_once(self, budget: int) -> int:
        """One read; how many bytes it got (-1: none now)."""
        try:
            if self._state == _BODY and self._pos == len(self._in) and self._need > _CHUNK:
                # A large body: read as it is, or into scratch if it is dropped.
                if self._body is not None:
                    data = self.sock.recv(min(self._need, budget))
                    got = len(data)
                    if got:
                        self._body.append(data)
                else:
                    if self._scratch is None:
                        self._scratch = bytearray(4 * _CHUNK)
                    with memoryview(self._scratch)[: min(self._need, budget)] as view:
                        got = self.sock.recv_into(view)
                if not got:
                    self.close()
                    return -1
                self._need -= got
                if not self._need:
                    self._frame_ends()
                return got
            data = self.sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return -1
        except OSError:
            self.close()
            return -1
        if not data:
            self.close()
            return -1
        if self._pos:
            del self._in[: self._pos]
            self._pos = 0
        self._in += data
        self._parse()
        return len(data)

    def _parse(self) -> None:
        buf = self._in
        while not self.closed:
            pos = self._pos
            avail = len(buf) - pos
            if self._state == _GREETING:
                if avail < len(GREETING):
                    return
                self._greeting(bytes(buf[pos : pos + len(GREETING)]))
                self._pos += len(GREETING)
                self._state = _HEADER
            elif self._state == _HEADER:
                if avail < 2:
                    return
                flags = buf[pos]
                if flags & LONG:
                    if avail < 9:
                        return
                    size = int.from_bytes(buf[pos + 1 : pos + 9], "big")
                    self._pos += 9
                else:
                    size = buf[pos + 1]
                    self._pos += 2
                self._frame_begins(flags, size)
            else:
                take = min(avail, self._need)
                if self._need and not take:
                    return
                if self._body is not None and take:
                    with memoryview(buf) as view:
                        self._body.append(bytes(view[pos : pos + take]))
                self._pos += take
                self._need -= take
                if self._need:
                    return
                self._frame_ends()

    def _greeting(self, greeting: bytes) -> None:
        if greeting[0] != 0xFF or not greeting[9] & 1:
            msg = "not a ZMTP peer"
            raise ProtocolError(msg)
        if greeting[10] < 3:
            msg = "a ZMTP version before 3.0"
            raise ProtocolError(msg)
        if greeting[12:32].rstrip(b"\0") != b"NULL":
            msg = "a security mechanism other than NULL"
            raise ProtocolError(msg)
        self._write([ready(self._type, self._identity)])

    def _frame_begins(self, flags: int, size: int) -> None:
        self._flags = flags
        self._need = size
        self._body = None
        if flags & COMMAND:
            if self._count or flags & MORE or size > MAX_COMMAND:
                msg = "a command inside a message, or too big"
                raise ProtocolError(msg)
            self._body = []
        elif not self.ready:
            msg = "a message before READY"
            raise ProtocolError(msg)
        else:
            self._count += 1
            self._total += size + FRAME_COST
            if self._dropping is None:
                if self._count > self._limits.frames:
                    self._drop("too many frames")
                elif self._total > self._limits.message:
                    self._drop("over the size cap")
            if self._dropping is None:
                self._body = []
        self._state = _BODY
        if not size:
            self._frame_ends()

    def _drop(self, reason: str) -> None:
        """Stop holding the message being read: what came of it goes, the rest is skipped."""
        self._dropping = reason
        self._frames = []

    def _frame_ends(self) -> None:
        pieces, self._body = self._body, None
        self._state = _HEADER
        body = None if pieces is None else pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if self._flags & COMMAND:
            self._command(body or b"")
            return
        if body is not None:
            self._frames.append(body)
        if self._flags & MORE:
            return
        if self._dropping is not None:
            self.drops.append(self._dropping)
        else:
            message = Received(self._frames)
            message.peer = self.peer
            self.inbox.append(message)
        self._frames, self._total, self._count, self._dropping = [], 0, 0, None

    def _command(self, body: bytes) -> None:
        size = body[0] if body else 0
        name, data = body[1 : 1 + size], body[1 + size :]
        if name == b"READY":
            if self.ready:
                msg = "a second READY"
                raise ProtocolError(msg)
            self.properties = properties(data)
            if self.properties.get(b"socket-type", b"") not in self._accepts:
                msg = "a socket type this one does not work with"
                raise ProtocolError(msg)
            self.ready = self.just_ready = True
        elif name == b"ERROR":
            msg = "the peer gave up"
            raise ProtocolError(msg)
        elif name == b"PING":
            self._write([command(b"PONG", data[2:18])])
        elif name in (b"SUBSCRIBE", b"CANCEL") and self.ready:
            message = Received([bytes((name == b"SUBSCRIBE",)) + data])
            message.peer = self.peer
            self.inbox.append(message)
        # PONG and commands of later versions: nothing to do.

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()
        self._out.clear()
        self._out_bytes = 0
        self._in = bytearray()
        self._frames = []
        self._body = self._scratch = None


def _peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    if sock.family != socket.AF_UNIX:
        return None
    try:
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return None
    return uid, pid


class Endpoint:
    """What a thread polls and hands events to: complete messages gather in :attr:`inbox`,
    the reasons for dropped ones until :meth:`take_drops` takes them."""

    def __init__(self) -> None:
        self.inbox: deque[Received] = deque()
        self._drops: list[str] = []

    def poll_items(self) -> list[tuple[Any, int]]:
        """(socket, zmq.POLLIN | zmq.POLLOUT ...) to poll now."""
        raise NotImplementedError

    def handle(self, sock: Any, events: int) -> None:
        """React to ``events`` polled on ``sock``."""
        raise NotImplementedError

    def send(self, frames: Sequence[Frame]) -> bool:
        """Send one message; False if it was dropped (a receiver not keeping up)."""
        raise NotImplementedError

    def timeout(self, now: float) -> float | None:
        """Seconds until :meth:`tick` has something to do, if ever."""
        return None

    def tick(self, now: float) -> None:
        """Do what is due at ``now`` (reconnect)."""

    def close(self) -> None:
        raise NotImplementedError

    def take_drops(self) -> list[str]:
        drops, self._drops = self._drops, []
        return drops

    def _collect(self, conn: Connection) -> None:
        if conn.drops:
            self._drops += conn.drops
            conn.drops.clear()

    @staticmethod
    def _events(conn: Connection) -> int:
        return zmq.POLLIN | (zmq.POLLOUT if conn.wants_write else 0)


def _connect_unix(path: str) -> socket.socket:
    """A connection to the unix socket at ``path``, which must be a socket, not a link:
    the folder may have been the sandbox's, and a link there could point anywhere.

    Raises:
        OSError: nothing listens there (or it is not a socket).
    """
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.ENOTSOCK, "not a socket", path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.connect(f"/proc/self/fd/{fd}")
        except OSError:
            sock.close()
            raise
        return sock
    finally:
        os.close(fd)


class Dealer(Endpoint):
    """ZeroMQ's DEALER (with ``xsub``: XSUB, subscribed to everything) connected to the
    unix socket ``path``: while no connection is up it tries again every
    :data:`RECONNECT` seconds, and keeps what is sent meanwhile (up to ``queue_limit`` bytes)."""

    def __init__(
        self, path: str, limits: Limits, identity: bytes = b"", xsub: bool = False, queue_limit: int = 2**27
    ) -> None:
        super().__init__()
        self.path = path
        self._limits = limits
        self._identity = identity
        self._xsub = xsub
        self._queue_limit = queue_limit
        self.connection: Connection | None = None
        self._pending: deque[tuple[list[Chunk], int]] = deque()
        self._pending_bytes = 0
        self._retry_at = 0.0

    @property
    def ready(self) -> bool:
        """Whether a connection is up and its handshake done."""
        return self.connection is not None and self.connection.ready

    def poll_items(self) -> list[tuple[Any, int]]:
        conn = self.connection
        return [] if conn is None else [(conn.sock, self._events(conn))]

    def timeout(self, now: float) -> float | None:
        conn = self.connection
        if conn is None:
            return max(0.0, self._retry_at - now)
        return None if conn.ready else max(0.0, conn.deadline - now)

    def tick(self, now: float) -> None:
        conn = self.connection
        if conn is not None and not conn.ready and now >= conn.deadline:
            conn.close()  # a peer that never completes the handshake: try again
            self._after_io(conn)
        if self.connection is not None or now < self._retry_at:
            return
        try:
            sock = _connect_unix(self.path)
        except OSError:
            self._retry_at = now + RECONNECT
            return
        accepts = frozenset({b"PUB", b"XPUB"} if self._xsub else {b"ROUTER", b"DEALER", b"REP"})
        kind = b"XSUB" if self._xsub else b"DEALER"
        self.connection = Connection(sock, kind, accepts, self._limits, self._queue_limit, self._identity)
        self._after_io(self.connection)

    def handle(self, sock: Any, events: int) -> None:
        conn = self.connection
        if conn is None or conn.sock is not sock:
            return
        if events & zmq.POLLOUT:
            conn.flush()
        if events & (zmq.POLLIN | zmq.POLLERR) and len(self.inbox) < BATCH:
            conn.on_readable(BATCH - len(self.inbox))
        self._after_io(conn)

    def _after_io(self, conn: Connection) -> None:
        self.inbox.extend(conn.inbox)
        conn.inbox.clear()
        self._collect(conn)
        if conn.just_ready:
            conn.just_ready = False
            if self._xsub:
                conn.send(encode([b"\x01"]), 3)
            while self._pending and not conn.closed:
                chunks, size = self._pending.popleft()
                self._pending_bytes -= size
                conn.send(chunks, size)
        if conn.closed:
            self.connection = None
            self._retry_at = time.monotonic() + RECONNECT

    def send(self, frames: Sequence[Frame]) -> bool:
        chunks = encode(frames)
        size = sum(len(chunk) for chunk in chunks)
        conn = self.connection
        if conn is not None and conn.ready:
            sent = conn.send(chunks, size)
            self._after_io(conn)
            return sent
        if self._pending_bytes and self._pending_bytes + size > self._queue_limit:
            return False
        self._pending.append((chunks, size))
        self._pending_bytes += size
        return True

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
        self.connection = None
        self._pending.clear()
        self._pending_bytes = 0


class _Server(Endpoint):
    """What :class:`Router` and :class:`XPub` share: a listening socket and its peers."""

    SOCKET_TYPE = b""
    ACCEPTS: frozenset[bytes] = frozenset()

    def __init__(self, listener: socket.socket, limits: Limits, queue_limit: int, max_peers: int) -> None:
        super().__init__()
        listener.setblocking(False)
        self.listener = listener
        self._limits = limits
        self._queue_limit = queue_limit
        self._max_peers = max_peers
        self.connections: dict[socket.socket, Connection] = {}

    def timeout(self, now: float) -> float | None:
        deadlines = [conn.deadline for conn in self.connections.values() if not conn.ready]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def tick(self, now: float) -> None:
        for conn in [conn for conn in self.connections.values() if not conn.ready and now >= conn.deadline]:
            conn.close()  # a peer that never completes the handshake holds no place
            self._after_io(conn)

    def poll_items(self) -> list[tuple[Any, int]]:
        items: list[tuple[Any, int]] = [(self.listener, zmq.POLLIN)]
        items += [(sock, self._events(conn)) for sock, conn in self.connections.items()]
        return items

    def handle(self, sock: Any, events: int) -> None:
        if sock is self.listener:
            self._accept()
            return
        conn = self.connections.get(sock)
        if conn is None:
            return
        if events & zmq.POLLOUT:
            conn.flush()
        if events & (zmq.POLLIN | zmq.POLLERR) and len(self.inbox) < BATCH:
            conn.on_readable(BATCH - len(self.inbox))
        self._after_io(conn)

    def _accept(self) -> None:
        for _ in range(BATCH):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # out of file descriptors, say: the peer tries again
            if len(self.connections) >= self._max_peers:
                sock.close()
                self._drops.append("too many connections")
                continue
            conn = Connection(sock, self.SOCKET_TYPE, self.ACCEPTS, self._limits, self._queue_limit)
            self.connections[sock] = conn
            self._after_io(conn)

    def _after_io(self, conn: Connection) -> None:
        self._collect(conn)
        if conn.just_ready:
            conn.just_ready = False
            self._joined(conn)
        if conn.inbox:
            self._received(conn)
        if conn.closed:
            self.connections.pop(conn.sock, None)
            self._left(conn)

    def _joined(self, conn: Connection) -> None:
        """``conn`` completed its handshake."""

    def _received(self, conn: Connection) -> None:
        """``conn`` has messages in its inbox."""
        raise NotImplementedError

    def _left(self, conn: Connection) -> None:
        """``conn`` closed."""

    def close(self) -> None:
        for conn in list(self.connections.values()):
            conn.close()
        self.connections = {}
        self.listener.close()


class Router(_Server):
    """ZeroMQ's ROUTER, with ``ROUTER_HANDOVER``: each message received starts with its
    peer's routing id (the one it named, else one made up, starting with a zero byte);
    a message sent goes to the peer its first frame names (if none, it is dropped, as
    libzmq drops it). A peer that names a routing id in use takes it over."""

    SOCKET_TYPE = b"ROUTER"
    ACCEPTS = frozenset({b"DEALER", b"REQ", b"ROUTER"})

    def __init__(
        self, listener: socket.socket, limits: Limits, queue_limit: int = 2**27, max_peers: int = 256
    ) -> None:
        super().__init__(listener, limits, queue_limit, max_peers)
        self.routes: dict[bytes, Connection] = {}
        self._ids: dict[Connection, bytes] = {}
        self._next_id = itertools.count(1)

    def _joined(self, conn: Connection) -> None:
        ident = conn.properties.get(b"identity", b"")
        if not ident or ident[0] == 0 or len(ident) > 255:
            ident = b"\0" + (next(self._next_id) % 2**32).to_bytes(4, "big")
        previous = self.routes.get(ident)
        if previous is not None:
            self._ids.pop(previous, None)
            self.connections.pop(previous.sock, None)
            previous.close()
        self.routes[ident] = conn
        self._ids[conn] = ident

    def _received(self, conn: Connection) -> None:
        ident = self._ids.get(conn)
        for message in conn.inbox:
            if ident is not None:
                message.insert(0, ident)
                self.inbox.append(message)
        conn.inbox.clear()

    def _left(self, conn: Connection) -> None:
        ident = self._ids.pop(conn, None)
        if ident is not None and self.routes.get(ident) is conn:
            del self.routes[ident]

    def send(self, frames: Sequence[Frame]) -> bool:
        if not frames:
            return True
        first = frames[0]
        conn = self.routes.get(first.bytes if isinstance(first, zmq.Frame) else first)
        if conn is None:
            return True  # nobody to deliver to: gone, as with libzmq
        chunks = encode(frames[1:])
        sent = conn.send(chunks, sum(len(chunk) for chunk in chunks))
        self._after_io(conn)
        return sent


class XPub(_Server):
    """ZeroMQ's XPUB, verbose: a message sent goes to every peer with a subscription its
    first frame starts with (dropped for a peer whose queue is full, as libzmq drops it);
    each subscription and unsubscription received is passed on as a message
    (``b"\\x01" + topic``, ``b"\\x00" + topic``). Other messages from peers are dropped."""

    SOCKET_TYPE = b"XPUB"
    ACCEPTS = frozenset({b"SUB", b"XSUB"})

    def __init__(
        self, listener: socket.socket, limits: Limits, queue_limit: int = 2**27, max_peers: int = 256
    ) -> None:
        super().__init__(listener, limits, queue_limit, max_peers)
        self._topics: dict[Connection, list[bytes]] = {}

    def _received(self, conn: Connection) -> None:
        topics = self._topics.setdefault(conn, [])
        for message in conn.inbox:
            if len(message) != 1 or not message[0] or message[0][0] not in (0, 1):
                self._drops.append("not a subscription")
                continue
            topic = message[0][1:]
            if message[0][0] == 1:
                if topic not in topics and len(topics) < MAX_SUBSCRIPTIONS:
                    topics.append(topic)
            elif topic in topics:
                topics.remove(topic)
            self.inbox.append(message)
        conn.inbox.clear()

    def _left(self, conn: Connection) -> None:
        self._topics.pop(conn, None)

    def send(self, frames: Sequence[Frame]) -> bool:
        if not frames:
            return True
        first = frames[0].bytes if isinstance(frames[0], zmq.Frame) else frames[0]
        chunks: list[Chunk] | None = None
        size = 0
        delivered = True
        for conn, topics in list(self._topics.items()):
            if not conn.ready or not any(first.startswith(topic) for topic in topics):
                continue
            if chunks is None:
                chunks = encode(frames)
                size = sum(len(chunk) for chunk in chunks)
            delivered = conn.send(chunks, size) and delivered
            self._after_io(conn)
        return delivered


def listen_unix(path: str) -> socket.socket:
    """A socket listening at ``path`` (whatever was there is replaced, as libzmq does)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def listen_tcp(host: str, port: int = 0) -> socket.socket:
    """A socket listening on ``host``:``port`` (0: a free one), as libzmq binds (SO_REUSEADDR).

    Raises:
        OSError: the address is taken (EADDRINUSE) or not this host's.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
