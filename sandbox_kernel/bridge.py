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
from collections.abc import Mapping
from dataclasses import dataclass

import zmq

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


@dataclass(frozen=True)
class CurveKeys:
    """The CurveZMQ keypair (Z85) clients use; the bridge is the Curve server."""

    public: bytes
    secret: bytes


class KernelBridge:
    """Relays a sandboxed kernel's ZeroMQ channels to clients on the host."""

    def __init__(
        self,
        kernel_endpoints: Mapping[str, str],
        ip: str = "127.0.0.1",
        ports: Mapping[str, int] | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        self.ip = ip
        self._kernel_endpoints = dict(kernel_endpoints)
        self._requested_ports = dict(ports or {})
        self._curve = curve
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._thread: threading.Thread | None = None
        self._stop_tx: zmq.Socket[bytes] | None = None
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
        if self.running:
            return self.ports
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        pairs: dict[str, tuple[zmq.Socket[bytes], zmq.Socket[bytes]]] = {}
        try:
            for channel, (front_type, back_type) in _SOCKET_TYPES.items():
                front = ctx.socket(front_type)
                front.linger = 0
                if self._curve is not None:
                    front.curve_secretkey = self._curve.secret
                    front.curve_publickey = self._curve.public
                    front.curve_server = True
                if front_type == zmq.XPUB:
                    # Forward every subscription, repeats included: ipykernel answers
                    # each with an iopub_welcome message.
                    front.setsockopt(zmq.XPUB_VERBOSE, 1)
                port = self._requested_ports.get(channel)
                if port:
                    front.bind(f"tcp://{self.ip}:{port}")
                else:
                    port = front.bind_to_random_port(f"tcp://{self.ip}")
                self.ports[channel] = port

                back = ctx.socket(back_type)
                back.linger = 0
                if back_type == zmq.DEALER:
                    back.setsockopt(zmq.IDENTITY, _KERNEL_SIDE_IDENTITY)
                back.connect(self._kernel_endpoints[channel])
                pairs[channel] = (front, back)
            stop_rx = ctx.socket(zmq.PAIR)
            stop_rx.bind("inproc://stop")
            self._stop_tx = ctx.socket(zmq.PAIR)
            self._stop_tx.connect("inproc://stop")
        except BaseException:
            ctx.destroy(linger=0)
            self.ports = {}
            raise
        self._context = ctx
        self._thread = threading.Thread(
            target=self._relay, args=(pairs, stop_rx), name="sandbox-kernel-bridge", daemon=True
        )
        self._thread.start()
        return self.ports

    def _relay(
        self, pairs: Mapping[str, tuple[zmq.Socket[bytes], zmq.Socket[bytes]]], stop_rx: zmq.Socket[bytes]
    ) -> None:
        poller = zmq.Poller()
        route: dict[zmq.Socket[bytes], tuple[str, zmq.Socket[bytes]]] = {}
        for channel, (front, back) in pairs.items():
            route[front] = (channel, back)
            route[back] = (channel, front)
            poller.register(front, zmq.POLLIN)
            poller.register(back, zmq.POLLIN)
        poller.register(stop_rx, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is stop_rx:
                        return
                    channel, peer = route[sock]
                    # Drain what is queued, but bounded, so one busy channel cannot
                    # starve the others (or the stop request).
                    for _ in range(100):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.messages[channel] += 1
                        try:
                            peer.send_multipart(frames, zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            log.warning(
                                "Bridge dropped a %s message: the receiver is not keeping up", channel
                            )
                        except zmq.ZMQError as exc:
                            # A ROUTER cannot deliver to a peer that has gone away.
                            log.debug("Bridge could not forward a %s message: %s", channel, exc)
        except zmq.ContextTerminated:
            return
        finally:
            for front, back in pairs.values():
                front.close(linger=0)
                back.close(linger=0)
            stop_rx.close(linger=0)

    def stop(self) -> None:
        """Stop relaying and close every socket; the ports are free afterwards."""
        if self._thread is not None and self._stop_tx is not None:
            self._stop_tx.send(b"")
            self._thread.join(timeout=5)
        if self._stop_tx is not None:
            self._stop_tx.close(linger=0)
            self._stop_tx = None
        if self._context is not None:
            self._context.term()
            self._context = None
        self._thread = None
