"""Host-side bridge between Jupyter clients and a kernel sealed in a sandbox.

The kernel binds ZeroMQ ``ipc://`` sockets in its runtime folder (a bind mount); the
sandbox has no network. The bridge connects to those sockets and serves the five
channels to clients as ordinary TCP on 127.0.0.1, so clients never reach into the
sandbox and every byte out of it passes through one place on the host.

One thread per kernel polls all ten sockets and forwards whole multipart messages:

    client DEALER  -> ROUTER | bridge | DEALER -> ROUTER kernel   shell, control, stdin
    client REQ     -> ROUTER | bridge | DEALER -> REP    kernel   hb
    client SUB     <- XPUB   | bridge | XSUB   <- PUB    kernel   iopub

The client-facing sockets live as long as the bridge, so a restarted kernel (new
container, same ipc paths) is reached on the same ports, as with a local kernel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import zmq

from .output import OutputLimiter

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

#: The kernel routes stdin requests to the identity that sent the shell request, and
#: sees the bridge's shell DEALER as that peer: the stdin DEALER must carry the same
#: identity for input() to reach the client.
_KERNEL_SIDE_IDENTITY = b"sandbox-kernel-bridge"


#: Called in the bridge thread for every message: (channel, to_kernel, frames). It must
#: be quick and must not keep the frames; it cannot change or stop the message.
Tap = Callable[[str, bool, Sequence[zmq.Frame]], None]


@dataclass(frozen=True)
class CurveKeys:
    """The CurveZMQ keypair (Z85) clients use; the bridge is the Curve server."""

    public: bytes
    secret: bytes


class KernelBridge:
    """Relays a sandboxed kernel's ZeroMQ channels to clients on the host.

    Client-facing sockets are bound once by :meth:`start` and live until :meth:`stop`.
    Kernel-facing sockets belong to one kernel process: :meth:`detach` drops them (and
    whatever was queued for a kernel that is gone), :meth:`attach` connects new ones to
    the next kernel's endpoints.
    """

    def __init__(
        self,
        kernel_endpoints: Mapping[str, str],
        ip: str = "127.0.0.1",
        ports: Mapping[str, int] | None = None,
        curve: CurveKeys | None = None,
        tap: Tap | None = None,
        max_message_size: int = 256 * 1024 * 1024,
        output_limiter: OutputLimiter | None = None,
    ) -> None:
        self.ip = ip
        self._tap = tap
        self._limiter = output_limiter
        self._kernel_endpoints = dict(kernel_endpoints)
        self._requested_ports = dict(ports or {})
        self._curve = curve
        self._max_message_size = max_message_size
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._fronts: dict[str, zmq.Socket[bytes]] = {}
        self._backs: dict[str, zmq.Socket[bytes]] = {}
        self._thread: threading.Thread | None = None
        self._stop_tx: zmq.Socket[bytes] | None = None
        self._stop_rx: zmq.Socket[bytes] | None = None
        self._inject_tx: zmq.Socket[bytes] | None = None
        self._inject_rx: zmq.Socket[bytes] | None = None
        # zmq sockets are not thread-safe; injections come from the loop and the bridge thread.
        self._inject_lock = threading.Lock()
        self.ports: dict[str, int] = {}
        self.messages: dict[str, int] = dict.fromkeys(CHANNELS, 0)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> dict[str, int]:
        """Bind the client-facing sockets, connect to the kernel, start relaying.

        Returns the TCP port of each channel. Ports given to the constructor are reused
        (reconnecting to a kernel after a server restart); others are random.
        """
        if self._context is None:
            self._bind_fronts()
        if not self.running:
            self.attach(self._kernel_endpoints)
        return self.ports

    def _bind_fronts(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            for channel, (front_type, _) in _SOCKET_TYPES.items():
                front = ctx.socket(front_type)
                self._fronts[channel] = front
                front.linger = 0
                if self._curve is not None:
                    front.curve_secretkey = self._curve.secret
                    front.curve_publickey = self._curve.public
                    front.curve_server = True
                if front_type == zmq.XPUB:
                    # Forward every subscription, repeats included: ipykernel answers
                    # each with an iopub_welcome message.
                    front.setsockopt(zmq.XPUB_VERBOSE, 1)
                else:
                    # As ipykernel does: a client reconnecting with its old identity
                    # (jupyter_server reuses the session id) takes over the route.
                    front.setsockopt(zmq.ROUTER_HANDOVER, 1)
                port = self._requested_ports.get(channel)
                if port:
                    front.bind(f"tcp://{self.ip}:{port}")
                else:
                    port = front.bind_to_random_port(f"tcp://{self.ip}")
                self.ports[channel] = port
            self._stop_rx = ctx.socket(zmq.PAIR)
            self._stop_rx.bind("inproc://stop")
            self._stop_tx = ctx.socket(zmq.PAIR)
            self._stop_tx.connect("inproc://stop")
            self._inject_rx = ctx.socket(zmq.PULL)
            self._inject_rx.bind("inproc://inject")
            self._inject_tx = ctx.socket(zmq.PUSH)
            self._inject_tx.connect("inproc://inject")
        except BaseException:
            ctx.destroy(linger=0)
            self._fronts = {}
            self.ports = {}
            raise
        self._context = ctx

    def attach(self, kernel_endpoints: Mapping[str, str]) -> None:
        """Connect fresh kernel-facing sockets to ``kernel_endpoints`` and relay."""
        if self._context is None or self._stop_rx is None:
            msg = "attach() before start()"
            raise RuntimeError(msg)
        self.detach()
        self._kernel_endpoints = dict(kernel_endpoints)
        for channel, (_, back_type) in _SOCKET_TYPES.items():
            back = self._context.socket(back_type)
            self._backs[channel] = back
            back.linger = 0
            # Bytes from the sandbox are untrusted: a peer sending a bigger message is
            # disconnected, and fewer messages wait in the server's memory.
            back.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
            back.rcvhwm = 100
            if back_type == zmq.DEALER:
                back.setsockopt(zmq.IDENTITY, _KERNEL_SIDE_IDENTITY)
            back.connect(self._kernel_endpoints[channel])
            if back_type == zmq.XSUB:
                # Clients subscribed through the previous kernel's socket; subscribe this
                # one to everything so a restarted kernel's output reaches them.
                back.send(b"\x01")
        pairs = {channel: (self._fronts[channel], self._backs[channel]) for channel in CHANNELS}
        self._thread = threading.Thread(
            target=self._relay,
            args=(pairs, self._stop_rx, self._inject_rx),
            name="sandbox-kernel-bridge",
            daemon=True,
        )
        self._thread.start()

    def inject(self, channel: str, message: Sequence[bytes]) -> None:
        """Send a message to clients on ``channel`` as if the kernel had sent it.

        For the provisioner's own notices (a kernel killed by a limit); any thread.
        """
        with self._inject_lock:
            if self._inject_tx is not None:
                self._inject_tx.send_multipart([channel.encode(), *message])

    def detach(self) -> None:
        """Stop relaying and drop the kernel-facing sockets with anything queued in them."""
        if self._thread is not None and self._stop_tx is not None:
            self._stop_tx.send(b"")
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                # Never touch sockets a live thread still uses: wait it out.
                log.warning("The bridge thread is slow to stop (a blocked audit write?); waiting")
                self._thread.join()
        self._thread = None
        for back in self._backs.values():
            back.close(linger=0)
        self._backs = {}

    def _relay(
        self,
        pairs: Mapping[str, tuple[zmq.Socket[bytes], zmq.Socket[bytes]]],
        stop_rx: zmq.Socket[bytes],
        inject_rx: zmq.Socket[bytes] | None,
    ) -> None:
        poller = zmq.Poller()
        route: dict[zmq.Socket[bytes], tuple[str, bool, zmq.Socket[bytes]]] = {}
        for channel, (front, back) in pairs.items():
            route[front] = (channel, True, back)
            route[back] = (channel, False, front)
            poller.register(front, zmq.POLLIN)
            poller.register(back, zmq.POLLIN)
        poller.register(stop_rx, zmq.POLLIN)
        if inject_rx is not None:
            poller.register(inject_rx, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is stop_rx:
                        sock.recv()
                        return
                    if inject_rx is not None and sock is inject_rx:
                        target, *message = inject_rx.recv_multipart()
                        front = pairs[target.decode()][0]
                        try:
                            front.send_multipart(message, zmq.NOBLOCK)
                        except zmq.ZMQError as exc:
                            log.debug("Bridge could not deliver a notice: %s", exc)
                        continue
                    channel, to_kernel, peer = route[sock]
                    # Drain what is queued, but bounded, so one busy channel cannot
                    # starve the others (or the stop request).
                    for _ in range(100):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._forward(channel, to_kernel, frames, peer)
        except zmq.ContextTerminated:
            return

    def _forward(
        self, channel: str, to_kernel: bool, frames: Sequence[zmq.Frame], peer: zmq.Socket[bytes]
    ) -> None:
        """Pass one message on: observed by the tap, capped by the output limiter."""
        self.messages[channel] += 1
        if self._tap is not None:
            try:
                self._tap(channel, to_kernel, frames)
            except Exception:
                log.exception("Bridge tap failed on a %s message", channel)
        outgoing: list[Sequence[zmq.Frame | bytes]] = [frames]
        if self._limiter is not None and channel == "iopub" and not to_kernel:
            outgoing = self._limiter.admit(frames)
        for message in outgoing:
            try:
                peer.send_multipart(message, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                log.warning("Bridge dropped a %s message: the receiver is not keeping up", channel)
            except zmq.ZMQError as exc:
                # A ROUTER cannot deliver to a peer that has gone away.
                log.debug("Bridge could not forward a %s message: %s", channel, exc)

    def stop(self) -> None:
        """Stop relaying and close every socket; the ports are free afterwards."""
        self.detach()
        with self._inject_lock:  # another thread may be injecting right now
            if self._inject_tx is not None:
                self._inject_tx.close(linger=0)
            self._inject_tx = None
        for sock in [*self._fronts.values(), self._stop_tx, self._stop_rx, self._inject_rx]:
            if sock is not None:
                sock.close(linger=0)
        self._fronts = {}
        self._stop_tx = self._stop_rx = self._inject_rx = None
        if self._context is not None:
            self._context.term()
            self._context = None
