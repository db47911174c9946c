"""Host-side bridge between Jupyter clients and a kernel sealed in a sandbox.

The kernel binds ZeroMQ ``ipc://`` sockets in its runtime folder (a bind mount); the
sandbox has no network. The bridge connects to those sockets and serves the five
channels to clients, so clients never reach into the sandbox and every byte out of it
passes through one place on the host.

One thread per kernel polls all ten sockets and forwards whole multipart messages:

    client DEALER  -> ROUTER | bridge | DEALER -> ROUTER kernel   shell, control, stdin
    client REQ     -> ROUTER | bridge | DEALER -> REP    kernel   hb
    client SUB     <- XPUB   | bridge | XSUB   <- PUB    kernel   iopub

Clients reach the bridge by ``ipc://`` sockets in the server's private (0700) runtime
folder by default, so no other local user can connect or listen; ``tcp`` on 127.0.0.1
is for clients elsewhere (with CurveZMQ). Either way nothing is trusted before it is
checked: a client's message acts on nothing (the kernel, the audit log, the output
budget, the idle clock) unless its HMAC signature is valid, and the kernel's messages
reach clients only if signed, within the size caps, and (on shell and control) as the
one reply to a request a client actually sent, routed back to that client. On stdin
the kernel may only prompt: the tap (the auditor) lets one ``input_request`` through at a
time, to the client running a cell that allowed stdin, and the output limiter charges it
to that cell's budget. The limiter sees the kernel's output before the cleaner does, so
output past the budget is dropped unparsed.

The client-facing sockets live as long as the bridge, so a restarted kernel (new
container, same ipc paths) is reached at the same addresses, as with a local kernel.

Some requests never reach the kernel (:func:`refusal`): the bridge answers them itself
with a signed error reply, and shows them to the tap so they are audited. ``debug_request``
is one: every shipped kernelspec says ``"debugger": false``, yet ipykernel answers it
whenever debugpy is installed (the image ships it), and a debugger evaluates code that
no ``execute_request`` carries. Code on the control channel is the other: ipykernel takes
every shell request there too, where it would run beside the shell, past the wall-clock
and output limits that follow the shell's executions.

While the kernel is paused (its sandbox saved to disk and stopped), :meth:`KernelBridge.hold`
keeps clients' messages on the host, answers their heartbeats, and calls ``on_wake`` at
the first signed request; :meth:`KernelBridge.release` passes them on, in order, once every
channel has reconnected to the resumed kernel. Clients see a delay, never a disconnect.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import socket
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
from jupyter_client.session import Session
from zmq.utils.monitor import parse_monitor_message

from sandbox_kernel.channels.bridge_replies import PendingReplies, refusal_reply
from sandbox_kernel.channels.meter import Meter
from sandbox_kernel.channels.output import OutputLimiter
from sandbox_kernel.channels.sanitize import OutputSanitizer
from sandbox_kernel.channels.wire import MAX_SMALL_FRAME, Signatures, find_delimiter, frame_bytes, load_dict

log = logging.getLogger(__name__)

#: Socket types of (client-facing, kernel-facing) per channel.
_SOCKET_TYPES: Mapping[str, tuple[int, int]] = {
    "shell": (zmq.ROUTER, zmq.DEALER),
    "control": (zmq.ROUTER, zmq.DEALER),
    "stdin": (zmq.ROUTER, zmq.DEALER),
    "hb": (zmq.ROUTER, zmq.DEALER),
    "iopub": (zmq.XPUB, zmq.XSUB),
}
CHANNELS = tuple(_SOCKET_TYPES)
#: The flags of each frame the bridge passes on but the last, and of the last.
_SEND_MORE, _SEND_LAST = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)
#: The bridge's own command (see :meth:`KernelBridge.inject`): the meter dropped an IOPub
#: message of the kernel's whole.
_REFUSED = "\x00refused"
#: Channels whose messages are signed Jupyter messages (hb echoes raw bytes).
_SIGNED = ("shell", "control", "stdin", "iopub")
#: Channels where the kernel only answers: one reply per request a client sent.
_REQUEST_REPLY = ("shell", "control")
#: The ``port`` of each channel's ipc socket, as jupyter_client numbers them.
IPC_PORTS: Mapping[str, int] = {"shell": 1, "iopub": 2, "stdin": 3, "control": 4, "hb": 5}

#: The kernel routes stdin requests to the identity that sent the shell request, and
#: sees the bridge's shell DEALER as that peer: the stdin DEALER must carry the same
#: identity for input() to reach the client.
_KERNEL_SIDE_IDENTITY = b"sandbox-kernel-bridge"
#: Messages read from one socket before the others get a turn.
_BATCH = 100
#: Clients' messages kept on the host while the kernel is paused (count, bytes); beyond,
#: they are dropped (and counted): a paused kernel must not grow the server's memory.
_MAX_HELD = 1000
_MAX_HELD_BYTES = 128 * 2**20
#: What the kernel-facing sockets' monitors report: the kernel went away (reconnect), or
#: a connection to it is complete (held messages may go).
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED

#: Why the bridge answers a request itself instead of passing it on (see :func:`refusal`).
DEBUGGER_OFF = (
    'the debugger is turned off for sandboxed kernels (their kernelspecs say "debugger": '
    "false): it would run code that the audit log does not see. Run code as a cell instead"
)
CODE_ON_CONTROL = (
    "code runs only from the shell channel, where it is audited and limited; "
    "send this execute_request on the shell channel"
)

#: Called in the bridge thread for every message that passes the checks, before the
#: output limit and the cleaner see it: (channel, to_kernel, frames). It must be quick and
#: must not keep the frames; it cannot change the message, and stops it only by returning
#: False (it answered it: a request to a kernel that is not running must never reach the
#: next one) or a reason (drop it: counted in ``dropped``, as stdin messages of the kernel
#: that are not the prompt of the running cell are). It also sees each request the bridge
#: refuses (:func:`refusal`) before the bridge answers it; what it returns then changes nothing.
Tap = Callable[[str, bool, Sequence[zmq.Frame | bytes]], bool | str | None]
Frames = Sequence[zmq.Frame | bytes]


@dataclass(frozen=True)
class CurveKeys:
    """The CurveZMQ keypair (Z85) clients use; the bridge is the Curve server."""

    public: bytes
    secret: bytes


@dataclass(frozen=True)
class SizeCaps:
    """Largest ZeroMQ frame each side may send; a peer sending a bigger one is cut off (on
    the kernel's side, the meter drops a whole message over its cap before that).

    Clients send requests (a few KiB; comm messages with buffers may be larger) and
    subscriptions; the kernel sends replies and output, whose total per execution the
    output limit bounds anyway.
    """

    client: int = 64 * 2**20
    client_small: int = 64 * 2**10  # hb pings, iopub subscriptions
    kernel_reply: int = 32 * 2**20  # shell, control, stdin
    kernel_iopub: int = 64 * 2**20
    kernel_hb: int = 64 * 2**10

    def front(self, channel: str) -> int:
        return self.client_small if channel in ("hb", "iopub") else self.client

    def back(self, channel: str) -> int:
        return {"iopub": self.kernel_iopub, "hb": self.kernel_hb}.get(channel, self.kernel_reply)


def refusal(channel: str, msg_type: str) -> str | None:
    """Why a client's ``msg_type`` request on ``channel`` must not reach the kernel, or None.

    Refused: every ``debug_request`` (:data:`DEBUGGER_OFF`; refusing all of them is right
    while every shipped kernelspec says ``"debugger": false``), and ``execute_request`` on
    the control channel (:data:`CODE_ON_CONTROL`). Completion and inspection requests run
    no code in ipykernel under IPython's default ``Completer.evaluation = "limited"``; a
    cell that changes that is itself audited.
    """
    if msg_type == "debug_request":
        return DEBUGGER_OFF
    if channel == "control" and msg_type == "execute_request":
        return CODE_ON_CONTROL
    return None


def peer_credentials(frames: Sequence[zmq.Frame | bytes]) -> tuple[int, int] | None:
    """(uid, pid) of the process that sent a message received over a unix socket, as the
    host's kernel told libzmq (``SO_PEERCRED``); None over tcp, or for frames not received
    from a socket. The sender cannot choose them, unlike anything in its message."""
    frame = frames[0] if frames else None
    if not isinstance(frame, zmq.Frame):
        return None
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    # libzmq writes "<host>:<uid>:<gid>:<pid>" for a unix socket; a tcp peer's host is an
    # IP address, whose colons (IPv6) never leave three plain numbers after a colon-free host.
    parts = str(address).rsplit(":", 3)
    if len(parts) != 4 or ":" in parts[0] or not all(part.isdigit() for part in parts[1:]):
        return None
    return int(parts[1]), int(parts[3])


def ipc_in_use(path: str, timeout: float | None = None, follow: bool = True) -> bool:
    """Whether a live process listens on the unix socket ``path`` (and, with ``timeout``,
    takes the connection within that many seconds: a socket gVisor let go of can leave a
    connect hanging for a minute rather than refused). Without ``follow``, a link at
    ``path`` (which a sandbox could plant in a folder lent to it) is not followed."""
    return _ipc_connect(path, timeout, follow) == 0


def ipc_let_go(path: str) -> bool:
    """Whether nothing listens on the unix socket ``path`` any more: a connection is
    refused, or there is no socket. Not a connection that waits (the listener's queue
    full: a process that holds it but takes no connections, e.g. one stopped). A link at
    ``path`` is not followed."""
    return _ipc_connect(path, 0.05, follow=False) in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK)


def _ipc_connect(path: str, timeout: float | None, follow: bool) -> int:
    """0 if a connection to the unix socket ``path`` is taken, else why not (an errno;
    ``EAGAIN`` for one not taken within ``timeout`` seconds)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    fd = -1
    try:
        if not follow:
            fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                return errno.ENOTSOCK
            path = f"/proc/self/fd/{fd}"
        probe.connect(path)
    except TimeoutError:
        return errno.EAGAIN
    except OSError as exc:
        return exc.errno or errno.EIO
    finally:
        probe.close()
        if fd >= 0:
            os.close(fd)
    return 0


def _socket_file(address: str) -> str:
    """Where the socket behind the client address ``address`` lives (see :func:`_link`)."""
    folder, name = os.path.split(address)
    return os.path.join(folder, f".{name}.sock")


def _link(address: str) -> None:
    """Make ``address`` (what clients connect to) a relative link to its socket file."""
    tmp = f"{address}.new"
    Path(tmp).unlink(missing_ok=True)
    os.symlink(os.path.basename(_socket_file(address)), tmp)
    os.replace(tmp, address)


def _front_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], channel: str, caps: SizeCaps, curve: CurveKeys | None
) -> zmq.Socket[bytes]:
    """A client-facing socket for ``channel``, not bound yet."""
    front_type = _SOCKET_TYPES[channel][0]
    front = ctx.socket(front_type)
    front.linger = 0
    # Unauthenticated until checked: a peer sending a bigger frame is cut off.
    front.setsockopt(zmq.MAXMSGSIZE, caps.front(channel))
    if curve is not None:
        front.curve_secretkey = curve.secret
        front.curve_publickey = curve.public
        front.curve_server = True
    if front_type == zmq.XPUB:
        # Forward every subscription, repeats included: ipykernel answers each with an
        # iopub_welcome message.
        front.setsockopt(zmq.XPUB_VERBOSE, 1)
    else:
        # As ipykernel does: a client reconnecting with its old identity (jupyter_server
        # reuses the session id) takes over the route.
        front.setsockopt(zmq.ROUTER_HANDOVER, 1)
    return front


class _Routes:
    """What a relay thread polls, and where a message read from each socket goes."""

    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self.fronts: dict[str, zmq.Socket[bytes]] = {}
        #: socket -> (channel, whether it comes from a client, the socket to send it to)
        self.peers: dict[zmq.Socket[bytes], tuple[str, bool, zmq.Socket[bytes]]] = {}
        #: disconnect monitor -> the channel whose kernel-facing socket it watches
        self.monitors: dict[zmq.Socket[bytes], str] = {}

    def connect(
        self, channel: str, front: zmq.Socket[bytes], back: zmq.Socket[bytes], monitor: zmq.Socket[bytes]
    ) -> None:
        self.fronts[channel] = front
        self.peers[front] = (channel, True, back)
        self.peers[back] = (channel, False, front)
        self.monitors[monitor] = channel
        for sock in (front, back, monitor):
            self.poller.register(sock, zmq.POLLIN)

    def disconnect(self, back: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        """Forget a kernel-facing socket and its monitor (before they are closed)."""
        for sock in (back, monitor):
            self.poller.unregister(sock)
        self.peers.pop(back, None)
        self.monitors.pop(monitor, None)


class KernelBridge:
    """Relays a sandboxed kernel's ZeroMQ channels to clients on the host.

    Client-facing sockets are bound once by :meth:`start` and live until :meth:`stop`.
    Kernel-facing sockets belong to one kernel process: :meth:`detach` drops them (and
    whatever was queued for a kernel that is gone), :meth:`attach` connects new ones to
    the next kernel's endpoints.

    ``transport`` "ipc": ``ip`` is a path prefix and each channel's socket is
    ``{ip}-{port}``, as jupyter_client names ipc endpoints. "tcp": ``ip`` is an address.
    ``key`` and ``signature_scheme`` are the kernel's session's: messages that fail the
    signature check are dropped and counted in :attr:`dropped`.
    """

    def __init__(
        self,
        kernel_endpoints: Mapping[str, str],
        ip: str = "127.0.0.1",
        ports: Mapping[str, int] | None = None,
        curve: CurveKeys | None = None,
        tap: Tap | None = None,
        output_limiter: OutputLimiter | None = None,
        sanitizer: OutputSanitizer | None = None,
        *,
        transport: str = "tcp",
        key: bytes = b"",
        signature_scheme: str = "hmac-sha256",
        caps: SizeCaps | None = None,
        meter_folder: Path | None = None,
    ) -> None:
        if transport not in ("tcp", "ipc"):
            msg = f"transport={transport!r}: use 'ipc' or 'tcp'"
            raise ValueError(msg)
        self.transport = transport
        self.ip = ip
        self._tap = tap
        self._limiter = output_limiter
        self._sanitizer = sanitizer
        self._signatures = Signatures(key, signature_scheme)
        #: Signs the bridge's own answers to requests it refuses.
        self._signer = Session(key=key, signature_scheme=signature_scheme, username="sandbox-kernel")
        self._caps = caps or SizeCaps()
        self._kernel_endpoints = dict(kernel_endpoints)
        #: Where the meter of the kernel's ipc sockets listens (see :mod:`.meter`): a
        #: folder of this process alone; None: the bridge connects to them itself, each
        #: frame capped but not a message (for tests).
        self._meter_folder = meter_folder
        self._meter: Meter | None = None
        self._back_endpoints: dict[str, str] = {}
        self._requested_ports = dict(ports or {})
        self._curve = curve
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._fronts: dict[str, zmq.Socket[bytes]] = {}
        self._backs: dict[str, zmq.Socket[bytes]] = {}
        self._monitors: dict[str, zmq.Socket[bytes]] = {}
        self._thread: threading.Thread | None = None
        self._stop_tx: zmq.Socket[bytes] | None = None
        self._attachments = itertools.count()
        self._monitor_numbers = itertools.count()
        self._inject_tx: zmq.Socket[bytes] | None = None
        self._inject_rx: zmq.Socket[bytes] | None = None
        # zmq sockets are not thread-safe; injections come from the loop and the bridge thread.
        self._inject_lock = threading.Lock()
        #: Whom each reply of the kernel goes back to, on shell and control.
        self._pending = PendingReplies(_REQUEST_REPLY)
        self._last_warning = 0.0
        # While the kernel is paused: (channel, frames) of clients' messages, in order.
        self._held: list[tuple[str, list[bytes]]] | None = None
        self._held_bytes = 0
        self._release_due = False
        # Channels whose kernel-facing socket has completed a connection to the kernel.
        self._connected: set[str] = set()
        # Bytes of the kernel's IOPub messages the meter dropped whole, not told yet, and
        # whether a word of them is on its way to the bridge's thread (see _on_refused).
        self._refused_lock = threading.Lock()
        self._refused_bytes = 0
        self._refused_due = False
        #: Called (bridge thread) with the message type of every signed message that
        #: arrives while held: it must be quick (schedule the resume); it may be called
        #: many times.
        self.on_wake: Callable[[str], None] | None = None
        #: Called (bridge thread) before each signed message of a client on shell, control
        #: or stdin goes on to the kernel or is held: quick (a frozen kernel is thawed).
        self.on_client_message: Callable[[], None] | None = None
        #: Answer clients' heartbeats here, as while holding (the kernel is frozen).
        self.echo_heartbeats = False
        self.ports: dict[str, int] = {}
        self.messages: dict[str, int] = dict.fromkeys(CHANNELS, 0)
        #: Messages dropped, by reason ("shell from a client: bad signature", ...).
        self.dropped: Counter[str] = Counter()
        #: Requests the bridge answered itself (see :func:`refusal`), by channel and type.
        self.refused: Counter[str] = Counter()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def endpoint(self, channel: str) -> str:
        """The address clients connect to for ``channel``."""
        if self.transport == "ipc":
            return f"ipc://{self._ipc_path(channel)}"
        return f"tcp://{self.ip}:{self.ports[channel]}"

    def _ipc_path(self, channel: str, port: int | None = None) -> str:
        """The file clients connect to for ``channel``, as jupyter_client names it."""
        return f"{self.ip}-{port or self.ports[channel]}"

    def start(self) -> dict[str, int]:
        """Bind the client-facing sockets, connect to the kernel, start relaying.

        Returns the port of each channel. Ports given to the constructor are reused
        (reconnecting to a kernel after a server restart); others are random (tcp) or
        jupyter_client's usual 1-5 (ipc).

        Raises:
            zmq.ZMQError: an address is taken (EADDRINUSE for an ipc path a live
                process listens on).
        """
        if self._context is None:
            self._bind_fronts()
        if not self.running:
            self.attach(self._kernel_endpoints)
        return self.ports

    def _bind_fronts(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            for channel in CHANNELS:
                front = self._fronts[channel] = _front_socket(ctx, channel, self._caps, self._curve)
                self.ports[channel] = self._bind_front(channel, front)
            self._inject_rx = ctx.socket(zmq.PULL)
            self._inject_rx.bind(f"inproc://inject-{id(self)}")
            self._inject_tx = ctx.socket(zmq.PUSH)
            self._inject_tx.connect(f"inproc://inject-{id(self)}")
        except BaseException:
            ctx.destroy(linger=0)
            self._fronts = {}
            self.ports = {}
            raise
        self._context = ctx

    def _bind_front(self, channel: str, front: zmq.Socket[bytes]) -> int:
        port = self._requested_ports.get(channel)
        if self.transport == "tcp":
            if port:
                front.bind(f"tcp://{self.ip}:{port}")
                return port
            return front.bind_to_random_port(f"tcp://{self.ip}")
        port = port or IPC_PORTS[channel]
        path = self._ipc_path(channel, port)
        # ZeroMQ unlinks whatever is at the path before binding: never another live
        # bridge's socket (a second process reattaching to the same kernel).
        if ipc_in_use(path):
            raise zmq.ZMQError(errno.EADDRINUSE, f"{path} is in use by another process")
        front.bind(f"ipc://{_socket_file(path)}")
        _link(path)
        return port

    def _restore_ipc_links(self) -> None:
        """Put back any client address that is gone.

        jupyter_client removes a kernel's ipc files when it restarts the kernel
        (``cleanup_ipc_files``); the bridge lives on, and new clients must find it. The
        address clients use is a link to the socket the bridge bound once, so only the
        link is made again: the listener, and every client connected through it, stay.
        """
        if self.transport != "ipc":
            return
        for channel in self._fronts:
            path = self._ipc_path(channel)
            if not os.path.lexists(path):
                _link(path)

    def attach(self, kernel_endpoints: Mapping[str, str]) -> None:
        """Connect fresh kernel-facing sockets to ``kernel_endpoints`` and relay."""
        if self._context is None:
            msg = "attach() before start()"
            raise RuntimeError(msg)
        self.detach()
        self._restore_ipc_links()
        self._kernel_endpoints = dict(kernel_endpoints)
        self._back_endpoints = self._metered(self._kernel_endpoints)
        self._pending.clear()  # the next kernel answers none of the last one's requests
        with self._refused_lock:  # (nor is charged what the meter dropped of the last one)
            self._refused_bytes, self._refused_due = 0, False
        self._held, self._held_bytes, self._release_due = None, 0, False
        if self._limiter is not None and "iopub" in self._fronts:
            # The last kernel's held output tail, before anything of the next one (no
            # relay thread runs now to share the socket with).
            for message in self._limiter.release():
                self._send(self._fronts["iopub"], "iopub", message)
        for channel in CHANNELS:
            self._connect_back(channel)
        routes = _Routes()
        for channel in CHANNELS:
            routes.connect(channel, self._fronts[channel], self._backs[channel], self._monitors[channel])
        # A stop channel of its own per relay thread: a stop meant for an earlier thread
        # (one that had already ended) can never end this one.
        name = f"inproc://stop-{id(self)}-{next(self._attachments)}"
        stop_rx = self._context.socket(zmq.PAIR)
        stop_rx.bind(name)
        self._stop_tx = self._context.socket(zmq.PAIR)
        self._stop_tx.connect(name)
        self._thread = threading.Thread(
            target=self._relay,
            args=(routes, stop_rx, self._inject_rx),
            name="sandbox-kernel-bridge",
            daemon=True,
        )
        self._thread.start()

    def _metered(self, endpoints: Mapping[str, str]) -> dict[str, str]:
        """Where the kernel-facing sockets connect: a meter in front of each ipc socket of
        the kernel's, which bounds whole messages (see :mod:`.meter`)."""
        if self._meter_folder is None:
            return dict(endpoints)
        self._meter = Meter(self._meter_folder, self._on_refused)
        return {
            channel: self._meter.endpoint(channel, endpoint.removeprefix("ipc://"), self._caps.back(channel))
            if endpoint.startswith("ipc://")
            else endpoint
            for channel, endpoint in endpoints.items()
        }

    def _on_refused(self, channel: str, why: str, size: int | None) -> None:
        """The meter dropped a message of the kernel's on ``channel`` whole (of ``size``
        bytes, at least), or cut the channel off for breaking the framing (``size`` None;
        ZeroMQ connects again)."""
        self._drop(channel, False, why)
        if size is None or channel != "iopub":
            return
        # The bridge's thread tells the execution's client. One word on the way at a time,
        # however fast the kernel has messages dropped: the meter's thread never waits.
        with self._refused_lock:
            self._refused_bytes += size
            if self._refused_due:
                return
            self._refused_due = True
        self.inject(_REFUSED, [])

    def _connect_back(self, channel: str) -> zmq.Socket[bytes]:
        """A new kernel-facing socket for ``channel``, connected, with a disconnect monitor."""
        if self._context is None:
            msg = "the bridge is stopped"
            raise RuntimeError(msg)
        back_type = _SOCKET_TYPES[channel][1]
        back = self._context.socket(back_type)
        back.linger = 0
        try:
            # Bytes from the sandbox are untrusted: a peer sending a bigger frame is cut
            # off (ZeroMQ then does not reconnect: the monitor tells the relay to make a
            # new socket), and few messages wait in the server's memory.
            back.setsockopt(zmq.MAXMSGSIZE, self._caps.back(channel))
            back.rcvhwm = 100
            # The meter holds a connection while the kernel has no socket (paused): no
            # handshake deadline, so no reconnecting meanwhile.
            back.setsockopt(zmq.HANDSHAKE_IVL, 0)
            if back_type == zmq.DEALER:
                back.setsockopt(zmq.IDENTITY, _KERNEL_SIDE_IDENTITY)
            self._connected.discard(channel)
            # An address of its own: pyzmq's default names the socket's descriptor, which
            # the next socket may reuse before the last monitor's address is free.
            address = f"inproc://monitor-{id(self):x}-{next(self._monitor_numbers)}"
            self._monitors[channel] = back.get_monitor_socket(_MONITORED, addr=address)
            back.connect(self._back_endpoints[channel])
            if back_type == zmq.XSUB:
                # Clients subscribed through the previous socket; subscribe this one to
                # everything so a restarted kernel's output reaches them.
                back.send(b"\x01")
        except BaseException:
            back.close(linger=0)  # (an open socket would keep the context from ending)
            monitor = self._monitors.pop(channel, None)
            if monitor is not None:
                monitor.close(linger=0)
            raise
        self._backs[channel] = back
        return back

    def _close_back(self, channel: str) -> None:
        self._connected.discard(channel)
        back, monitor = self._backs.pop(channel, None), self._monitors.pop(channel, None)
        if back is not None:
            if monitor is not None:
                back.disable_monitor()
            back.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)

    def inject(self, channel: str, message: Sequence[bytes]) -> None:
        """Send a message to clients on ``channel`` as if the kernel had sent it.

        For the provisioner's own signed notices (a kernel killed by a limit); any thread.
        From the bridge's own thread (the tap answering a request whose reply the kernel
        went past), it goes out before the message being relayed, which caused it.
        """
        with self._inject_lock:
            if self._inject_tx is not None:
                self._inject_tx.send_multipart([channel.encode(), *message])
        inject_rx = self._inject_rx
        if inject_rx is not None and threading.current_thread() is self._thread:
            try:
                while inject_rx.poll(0):  # (in order: with what other threads sent before)
                    self._deliver_injected(inject_rx, self._fronts)
            except Exception:
                log.exception("Bridge could not deliver a message of the host's; relaying on")

    # ------------------------------------------------------------------ pausing

    @property
    def holding(self) -> bool:
        """Whether clients' messages are kept on the host (the kernel is paused)."""
        return self._held is not None

    def hold(self) -> None:
        """From now on keep clients' messages for the kernel, answer heartbeats, and call
        :attr:`on_wake` at each signed request (any thread)."""
        if self._held is None:
            self._held_bytes, self._release_due = 0, False
            self._held = []

    def release(self) -> None:
        """Pass the held messages on, in order, once every channel is connected to the
        kernel again (any thread; :attr:`holding` turns False when they have gone)."""
        self.inject("", [b"release"])

    def drop_held(self) -> int:
        """Stop holding, dropping what was held (the kernel is gone); how many there were
        (any thread: call it only while the bridge is detached or the kernel is gone)."""
        held, self._held = self._held or [], None
        self._held_bytes, self._release_due = 0, False
        return len(held)

    def _hold(self, channel: str, frames: Frames) -> None:
        held = self._held
        size = sum(len(frame_bytes(frame)) for frame in frames)
        if held is None or len(held) >= _MAX_HELD or self._held_bytes + size > _MAX_HELD_BYTES:
            self._drop(channel, True, "too much waits for the paused kernel")
            return
        held.append((channel, [frame_bytes(frame) for frame in frames]))
        self._held_bytes += size
        if channel != "iopub" and channel in _SIGNED and self.on_wake is not None:  # (not a subscription)
            index = find_delimiter(frames)
            header = load_dict(frames[index + 2]) if index is not None else {}
            try:
                self.on_wake(f"{channel} {header.get('msg_type', '?')}")
            except Exception:
                log.exception("Bridge could not wake the paused kernel")

    def _release_if_connected(self) -> None:
        """Send what was held once every channel reaches the kernel again (bridge thread)."""
        if not self._release_due or self._held is None or not self._connected.issuperset(CHANNELS):
            return
        held, self._held = self._held, None
        self._held_bytes, self._release_due = 0, False
        for channel, message in held:
            try:
                self._backs[channel].send_multipart(message, zmq.NOBLOCK)
            except (KeyError, zmq.ZMQError):
                self._drop(channel, True, "could not reach the resumed kernel")

    def detach(self) -> None:
        """Stop relaying and drop the kernel-facing sockets with anything queued in them."""
        if self._thread is not None and self._stop_tx is not None:
            self._stop_tx.send(b"", zmq.NOBLOCK)
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                # Never touch sockets a live thread still uses: wait it out.
                log.warning("The bridge thread is slow to stop (a blocked audit write?); waiting")
                self._thread.join()
        self._thread = None
        if self._stop_tx is not None:
            self._stop_tx.close(linger=0)
            self._stop_tx = None
        for channel in list(self._backs):
            self._close_back(channel)
        if self._meter is not None:
            self._meter.close()
            self._meter = None
        self.drop_held()  # meant for a kernel that is gone

    def _relay(
        self,
        routes: _Routes,
        stop_rx: zmq.Socket[bytes],
        inject_rx: zmq.Socket[bytes] | None,
    ) -> None:
        poller = routes.poller
        poller.register(stop_rx, zmq.POLLIN)
        if inject_rx is not None:
            poller.register(inject_rx, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is stop_rx:
                        return
                    if sock in routes.monitors or sock is inject_rx:
                        try:
                            if inject_rx is not None and sock is inject_rx:
                                self._deliver_injected(inject_rx, routes.fronts)
                            else:
                                self._on_monitor(sock, routes)
                        except Exception:
                            log.exception("Bridge could not handle an event; relaying on")
                        continue
                    if sock not in routes.peers:
                        continue  # a socket replaced earlier in this round
                    channel, to_kernel, peer = routes.peers[sock]
                    # Drain what is queued, but bounded, so one busy channel cannot
                    # starve the others (or the stop request).
                    for _ in range(_BATCH):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            self._forward(channel, to_kernel, frames, peer)
                        except Exception:
                            # Whatever the bytes were, the relay goes on: a dead bridge
                            # would silence the kernel and stop enforcing its limits.
                            self._drop(channel, to_kernel, "could not be handled")
                            log.debug("Bridge failed on a %s message", channel, exc_info=True)
        except zmq.ContextTerminated:
            return
        finally:
            stop_rx.close(linger=0)

    def _on_monitor(self, monitor: zmq.Socket[bytes], routes: _Routes) -> None:
        channel = routes.monitors[monitor]
        event = parse_monitor_message(monitor.recv_multipart())["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected.add(channel)
            self._release_if_connected()
        elif event == zmq.EVENT_DISCONNECTED:
            self._reconnect(channel, routes)

    def _reconnect(self, channel: str, routes: _Routes) -> None:
        """The kernel-facing socket of ``channel`` lost its kernel: connect a new one.

        A kernel that sent a frame over ZeroMQ's own cap (behind the meter's, which drops
        whole messages first) was cut off and ZeroMQ would not reconnect;
        a kernel that died is simply reconnected to (its successor binds the same path).
        """
        routes.disconnect(self._backs[channel], self._monitors[channel])
        self._close_back(channel)
        back = self._connect_back(channel)
        routes.connect(channel, routes.fronts[channel], back, self._monitors[channel])

    def _deliver_injected(
        self,
        inject_rx: zmq.Socket[bytes],
        fronts: Mapping[str, zmq.Socket[bytes]],
    ) -> None:
        try:  # (what polled readable may have been taken since: see inject())
            target, *message = inject_rx.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if not target:  # the bridge's own command
            self._release_due = True
            self._release_if_connected()
            return
        if target == _REFUSED.encode():
            with self._refused_lock:
                size, self._refused_bytes, self._refused_due = self._refused_bytes, 0, False
            if size and self._limiter is not None and "iopub" in fronts:
                for notice in self._limiter.refused(size):
                    self._send(fronts["iopub"], "iopub", notice)
            return
        channel = target.decode()
        front = fronts[channel]
        if channel == "iopub" and self._limiter is not None:
            # The host's notice (the kernel died, a limit stopped it) ends the execution:
            # the tail of its output held back by the limiter comes first.
            for held in self._limiter.release(message):
                self._send(front, channel, held)
        self._send(front, channel, message)

    def _send(self, front: zmq.Socket[bytes], channel: str, message: Frames) -> None:
        """Send a message of the bridge's own (a notice, a held output tail) to clients."""
        try:
            front.send_multipart(message, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("Bridge could not deliver a %s notice: %s", channel, exc)

    def _forward(self, channel: str, to_kernel: bool, frames: Frames, peer: zmq.Socket[bytes]) -> None:
        """Pass one message on if it passes the checks: observed by the tap; from the
        kernel, capped by the output limiter, then cleaned (only what will be sent)."""
        self.messages[channel] += 1
        if to_kernel and channel == "hb" and (self._held is not None or self.echo_heartbeats):
            # The kernel is paused or frozen, not dead: its heartbeat is the bridge's to give.
            self._send(self._fronts["hb"], channel, frames)
            return
        checked = self._check(channel, to_kernel, frames)
        if checked is None:
            return
        frames = checked
        if self._tap is not None:
            try:
                verdict = self._tap(channel, to_kernel, frames)
            except Exception:
                log.exception("Bridge tap failed on a %s message", channel)
                # The kernel's stdin is a way out only the tap lets through: closed, not open.
                verdict = "could not be checked" if channel == "stdin" and not to_kernel else None
            if verdict is False:
                return
            if isinstance(verdict, str):
                self._drop(channel, to_kernel, verdict)
                return
        if to_kernel:
            if self.on_client_message is not None and channel in ("shell", "control", "stdin"):
                self.on_client_message()  # (not a heartbeat, not a subscription)
            if self._limiter is not None and channel == "shell":
                self._limiter.request(frames)  # signed: it may narrow its own output limit
            if self._held is not None:
                self._hold(channel, frames)
            else:
                self._pass(peer, channel, to_kernel, frames)
            return
        outgoing: list[Frames] = [frames]
        if self._limiter is not None:
            # Before the cleaner: output past the budget costs the host no parsing.
            if channel == "iopub":
                outgoing = self._limiter.admit(frames)
            elif channel == "stdin" and not self._limiter.charge(frames):
                # (The tap took it for the prompt that waits for its answer: the cell waits
                # until interrupted, as its budget is spent anyway.)
                self._drop(channel, to_kernel, "over the output limit")
                return
        for message in outgoing:
            if self._sanitizer is not None:
                cleaned = self._sanitizer.clean(channel, message)
                if cleaned is None:
                    self._drop(channel, to_kernel, "could not be made safe to show")
                    continue
                message = cleaned
            self._pass(peer, channel, to_kernel, message)

    def _pass(self, peer: zmq.Socket[bytes], channel: str, to_kernel: bool, message: Frames) -> None:
        """Send one checked message on to ``peer``, never waiting for it."""
        # (Frame by frame with the flags as ints: pyzmq's send_multipart combines its enum
        # flags anew for each frame, and sends frame by frame too.)
        last = len(message) - 1
        number = 0
        try:
            for number, frame in enumerate(message):
                peer.send(frame, _SEND_MORE if number < last else _SEND_LAST, copy=False)
        except zmq.Again:
            # libzmq (4.3.x) checks the high-water mark on a message's first frame, which
            # then fails with nothing sent. A later frame fails only on a DEALER whose pipe
            # is going away: libzmq takes back the frames before it and throws away, while
            # reporting success, every frame up to the end of a message (lb_t::sendpipe).
            # The rest of this one is sent for it to throw away, or the next message would
            # be. (ROUTER and XPUB drop what they cannot deliver without failing.)
            if 0 < number < last:
                with contextlib.suppress(zmq.ZMQError):
                    for rest in range(number + 1, last + 1):
                        peer.send(message[rest], _SEND_MORE if rest < last else _SEND_LAST, copy=False)
            self._drop(channel, to_kernel, "the receiver is not keeping up")
        except zmq.ZMQError as exc:  # (a socket closed under it, as the bridge stops)
            log.debug("Bridge could not forward a %s message: %s", channel, exc)

    def _check(self, channel: str, to_kernel: bool, frames: Frames) -> Frames | None:
        """The message to pass on (replies re-routed to their requester), or None to drop it."""
        if channel not in _SIGNED or (channel == "iopub" and to_kernel):
            return frames  # heartbeats and subscriptions: raw bytes, size-capped
        index = find_delimiter(frames)
        if index is None:
            self._drop(channel, to_kernel, "not a Jupyter message")
            return None
        if not self._signatures.valid(frames, index):
            self._drop(channel, to_kernel, "bad signature")
            return None
        if channel not in _REQUEST_REPLY:
            return frames
        if to_kernel:
            # Read whole, as the kernel will: a big header must not hide what it asks for.
            header = load_dict(frames[index + 2], limit=None)
            msg_type = str(header.get("msg_type", ""))
            why = refusal(channel, msg_type)
            if why is not None:
                self._refuse(channel, frames, index, header, why)
                return None
            if len(frames[index + 2]) > MAX_SMALL_FRAME or not msg_type.endswith("_request"):
                return frames  # comm messages: the kernel answers none of them
            self._pending.expect(
                channel, str(header.get("msg_id", "")), [frame_bytes(frame) for frame in frames[:index]]
            )
            return frames
        # From the kernel: only the reply to a request a client sent, once, and to that
        # client (routing frames are not signed: the kernel could aim them anywhere).
        idents = self._pending.route(channel, str(load_dict(frames[index + 3]).get("msg_id", "")))
        if idents is None:
            self._drop(channel, to_kernel, "reply to no pending request")
            return None
        return [*idents, *frames[index:]]

    def _refuse(self, channel: str, frames: Frames, index: int, header: dict[str, object], why: str) -> None:
        """Answer a request that must not reach the kernel with a signed error reply (the
        tap sees the request first, so it is audited)."""
        self.refused[f"{channel} {header.get('msg_type')}"] += 1
        if self._tap is not None:
            try:
                self._tap(channel, True, frames)
            except Exception:
                log.exception("Bridge tap failed on a refused %s request", channel)
        self._send(self._fronts[channel], channel, refusal_reply(self._signer, frames, index, header, why))

    def requests_in_flight(self, max_age: float) -> bool:
        """Whether a client's request younger than ``max_age`` seconds awaits its reply
        (any thread; a glance, not a snapshot)."""
        return self._pending.in_flight(max_age)

    def _drop(self, channel: str, to_kernel: bool, reason: str) -> None:
        source = "from a client" if to_kernel else "from the kernel"
        what = f"{channel} message {source}: {reason}"
        self.dropped[what] += 1
        now = time.monotonic()
        if now - self._last_warning >= 10:  # the sender decides how often: never flood the log
            self._last_warning = now
            log.warning("Bridge dropped a %s (%d so far)", what, self.dropped[what])

    def stop(self) -> None:
        """Stop relaying and close every socket; the addresses are free afterwards."""
        self.detach()
        with self._inject_lock:  # another thread may be injecting right now
            if self._inject_tx is not None:
                self._inject_tx.close(linger=0)
            self._inject_tx = None
        for sock in [*self._fronts.values(), self._inject_rx]:
            if sock is not None:
                sock.close(linger=0)
        if self.transport == "ipc":
            for channel in self._fronts:
                path = self._ipc_path(channel)
                Path(path).unlink(missing_ok=True)
                Path(_socket_file(path)).unlink(missing_ok=True)
        self._fronts = {}
        self._inject_rx = None
        if self._context is not None:
            self._context.term()
            self._context = None
