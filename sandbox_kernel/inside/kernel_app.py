"""The sandboxed kernel's command: ipykernel's own application, with one socket option more
and event loops that poll.

The channel relay (kernel_relay.py) passes the host's connections through to the kernel,
so the kernel's peer on shell and stdin is the host's bridge, which connects with one
identity of its own (the kernel routes a prompt on stdin to the identity its shell
request came from). When the bridge connects again (a paused kernel resumed, a server
that adopted the kernel, a connection the host cut off), its new connection may reach
ZeroMQ before the old one is gone: without ``ROUTER_HANDOVER`` a ROUTER ignores a peer
whose identity is taken, and reads its next message as its identity. ipykernel sets it
on the control socket only (ipykernel#270); here shell and stdin get it too: the new
connection takes the identity over, as a client reconnecting expects.

And its event loops wait with poll(2), not epoll. gVisor's runsc up to 2026-03 (Debian's
is 20240729) can save an epoll set's entry for a descriptor closed before a pause and
bring it back at the restore (gVisor commit 5d857245b, "vfs: clear temporary notReady
lists"): ready for ever, with the data of a registration long gone. ZeroMQ's I/O threads
took that data for a pointer and the kernel died of SIGSEGV after one resume in four;
Python's selectors would spin. The image's libzmq is built to poll too (images/Dockerfile),
and so are the channel and egress relays (the latter with this policy's twin: each file
runs alone in the sandbox): poll(2) keeps nothing between calls for a restore to spoil.

And it starts its subshells on demand. ipykernel 7 reads the shell channel in a thread
of its own and hands each request to the main thread (and each reply back) so that
subshells (JEP 91) can run beside the main shell: two thread wake-ups more per request,
which gVisor makes dear (1.4 to 2 ms of a sandboxed ``1+1`` on a 2-core host, see
docs/benchmarks.md). Here the main thread reads the shell channel itself, as in ipykernel
6, until a client asks for a subshell (most never do); the control thread then hands the
shell socket to ipykernel's shell-channel thread (:class:`HandOverStream`,
:class:`KernelWithSubshellsOnDemand`) and the kernel goes on as ipykernel's own, a cell
running or not. ``--SandboxedKernelApp.subshells=False`` (the kernelspec key
``subshells: false``) keeps the main thread on the shell channel for good, and the kernel
does not advertise ``kernel subshells``. ipykernel 7.4 gets its own case without the
thread wrong twice (:class:`KernelWithoutSubshells` puts both right): a cell with a
top-level ``await`` raised AttributeError after it had started, ran on detached and never
got its reply; and a request naming a subshell (from a client that did not read
``supported_features``) failed an assertion after ``busy``: no reply, no ``idle``, and the
subshell requests on control got no reply either.

And the main thread sends a reply as it makes it (:class:`ReplyStream`), not on its
loop's next turn: with ``idle`` sent at once (fast_io.py), the reply waited behind it,
about 0.4 ms of a ``1+1`` under gVisor.

And it takes over the host-facing listeners of shell and IOPub from the channel relay
(:class:`ChannelKeeper`): the host's connections reach the kernel without a hop through
the relay's process, about 1 ms of a ``1+1`` under gVisor, and the kernel lets go of them
for a pause when the relay asks.

The image does not have this package: the host copies this file into the kernel's launch
folder and runs it with the image's Python (PYTHONSAFEPATH keeps its folder off
``sys.path``). It uses ipykernel, pyzmq and the standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
from ipykernel._version import version_info as ipykernel_version
from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp
from tornado.log import gen_log
from traitlets import Bool
from zmq.eventloop.zmqstream import ZMQStream

#: What a kernel without subshells answers a request that names one, or asks for one.
NO_SUBSHELLS = (
    "this kernel has no subshells (subshells: false in its kernelspec or its server's "
    "config; its kernel_info_reply lists no 'kernel subshells' among supported_features)"
)
#: What ipykernel 7.4's SubshellManager is made with (:func:`subshells_on_demand_fit`).
MANAGER_PARAMETERS = ("context", "shell_channel_io_loop", "shell_stream")
#: Messages ipykernel takes on any shell, whatever subshell their header names.
_ANY_SHELL = ("comm_msg", "comm_close")
#: The frame between a message's routing and its signature.
DELIMITER = b"<IDS|MSG>"
#: The largest reply content :func:`succeeded` reads.
MAX_READ_REPLY = 2**16
#: The name under which in_kernel_startup.py loads fast_io.py.
FAST_IO_MODULE = "sandbox_kernel_fast_io"


class PollingEventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """Every new event loop of the kernel (its threads', and ``asyncio.run`` in a cell)
    waits with poll(2)."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(selectors.PollSelector())


class NoShellChannelThread:
    """Where ipykernel looks for its shell-channel thread in a kernel without one: false, as
    its ``if self.shell_channel_thread`` checks expect of none, and with the thread the main
    shell runs in, which ipykernel 7.4 reads for every cell with a top-level ``await``
    whether the thread exists or not."""

    def __init__(self) -> None:
        self.parent_thread = threading.current_thread()

    def __bool__(self) -> bool:
        return False


class KernelWithoutSubshells(IPythonKernel):
    """ipykernel's kernel for a :class:`NoShellChannelThread`: it says it has no subshells,
    and answers a request naming one, or asking for one, with an error reply (a kernel with
    subshells answers a subshell it does not know so: busy, the error, idle)."""

    #: The msg_id of the shell request being handled that named a subshell, and that name.
    _named_a_subshell: tuple[Any, str] | None = None

    @property
    def _supports_kernel_subshells(self) -> bool:
        return False

    def set_parent(self, ident: Any, parent: Any, channel: str = "shell") -> None:
        header = parent.get("header") if channel == "shell" and isinstance(parent, dict) else None
        if (
            isinstance(header, dict)
            and header.get("subshell_id") is not None
            and header.get("msg_type") not in _ANY_SHELL
            and threading.current_thread() is threading.main_thread()  # (not a subshell's)
        ):
            # Past ipykernel's check that the request names the shell handling it (an
            # AssertionError after busy); should_handle then answers it.
            self._named_a_subshell = (header.get("msg_id"), str(header["subshell_id"]))
            header["subshell_id"] = None
        super().set_parent(ident, parent, channel)  # type: ignore[no-untyped-call]

    def should_handle(self, stream: Any, msg: dict[str, Any], idents: Any) -> Any:
        named = self._named_a_subshell
        if named is None or msg["header"].get("msg_id") != named[0]:
            return super().should_handle(stream, msg, idents)  # type: ignore[no-untyped-call]
        self._named_a_subshell = None
        self._refuse(stream, idents, msg, *self._no_such_subshell(named[1]))
        return False  # (ipykernel then publishes idle)

    def _no_such_subshell(self, subshell_id: str) -> tuple[str, str]:
        """The error name and value of a request for the subshell ``subshell_id``."""
        return "NoSubshells", NO_SUBSHELLS

    def _abort_queues(self, subshell_id: str | None = None) -> None:
        """Abort the requests queued behind a failing one (stop_on_error). ipykernel's path
        without the shell-channel thread stops aborting at its loop's next turn, before the
        requests read while an async cell awaited have had their turn: they ran. Here, as
        with the thread, aborting stops at a marker queued behind every request read so
        far (ipykernel's own, which its dispatch_shell takes)."""
        stream = self.shell_stream
        callback = getattr(stream, "_recv_callback", None)
        if self.shell_channel_thread or subshell_id is not None or stream is None or callback is None:
            super()._abort_queues(subshell_id)
            return
        self._aborting = True
        self.log.info("Aborting queue")
        # What has arrived, read: queued behind the failing request. Read only: its reply
        # waits in the stream's queue until the marker is queued too. ipykernel's flush
        # sends it amid the reading, and a client's next request, sent once it had that
        # reply, could be read before the marker and come back "aborted".
        stream.flush(zmq.POLLIN)

        def queue_marker() -> None:  # the way each request read is queued
            stream._run_callback(callback, [zmq.Frame(b"stop aborting")])

        if self.stop_on_error_timeout:
            self.io_loop.call_later(self.stop_on_error_timeout, queue_marker)  # (what comes meanwhile too)
        else:
            queue_marker()

    async def create_subshell_request(self, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        self._refuse(socket, ident, parent)

    async def delete_subshell_request(self, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        self._refuse(socket, ident, parent)

    async def list_subshell_request(self, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        self._refuse(socket, ident, parent)

    def _refuse(
        self,
        stream: Any,
        idents: Any,
        request: dict[str, Any],
        ename: str = "NoSubshells",
        evalue: str = NO_SUBSHELLS,
    ) -> None:
        msg_type = str(request["header"].get("msg_type", ""))
        content: dict[str, Any] = {"status": "error", "ename": ename, "evalue": evalue, "traceback": []}
        if msg_type == "execute_request":
            content["execution_count"] = None
        if self.session is not None:
            reply_type = msg_type.removesuffix("_request") + "_reply"
            self.session.send(stream, reply_type, content, parent=request, ident=idents)


def subshells_on_demand_fit() -> bool:
    """Whether this ipykernel's shell-channel thread and subshell manager are the ones
    :class:`KernelWithSubshellsOnDemand` wakes (7.4; with another, ipykernel's own path)."""
    try:
        from ipykernel.shellchannel import ShellChannelThread
        from ipykernel.subshell_manager import SubshellManager
    except ImportError:
        return False
    return (
        tuple(ipykernel_version[:2]) == (7, 4)
        and tuple(inspect.signature(SubshellManager).parameters) == MANAGER_PARAMETERS
        and all(hasattr(ShellChannelThread, name) for name in ("manager", "run"))
    )


class ReplyStream(ZMQStream):
    """The main thread's stream on the shell socket, which sends a successful reply as it
    is made.

    A ZMQStream queues what it is given to send, for its loop's next turn; ipykernel's
    kernel empties that queue itself only after it has published ``idle`` (the flush in
    ``_publish_status_and_flush``). A local kernel hands ``idle`` to its IOPub thread, so
    the reply still reaches the client first; here fast_io sends ``idle`` at once, and the
    reply waited behind it: made 0.8 ms before ``idle``, it arrived 0.9 ms after it (as much
    on a host client straight on the sandbox's sockets). So a reply whose status is
    ``ok``, made on the loop's own thread with nothing queued before it, goes out at once.

    Any other reply goes through the queue, as ipykernel sends it. A failed execution
    aborts the requests already read behind it (``stop_on_error``): ipykernel sends its
    queued reply, reads what has arrived and queues a marker behind it, past which
    requests run again; that reply stays on ipykernel's own path, in ipykernel's own order
    against the marker. No abort follows an ``ok``. Another thread's send, a tracked one,
    one with a callback or one behind a queued one is the stream's own too.

    A send past the stream takes the socket's one signal of a request that arrived while
    the cell ran (ZeroMQ's descriptor is edge-triggered): the stream then looks at the
    socket again, as its own sends do, or that request would never be read.

    It is sent by fast_io's whole-message sender: the reply is sent inside the request's
    handler, where SIGINT raises KeyboardInterrupt, and pyzmq's ``send_multipart`` checks
    for signals after each frame: a cut message would make the next one its rest. Without
    fast_io (loaded by in_kernel_startup.py) every reply is queued. :attr:`at_once` turns
    it off, as for a benchmark's "before" (``bench/kernel_choices.py``).
    """

    #: Whether a successful reply made on the loop's thread goes out at once (read at
    #: each send).
    at_once = True
    #: The thread that runs the stream's loop: the only one that may use the socket.
    _owner: int

    @classmethod
    def adopt(cls, stream: ZMQStream) -> ReplyStream:
        """``stream`` (on the calling thread's loop), made one of these."""
        stream.__class__ = cls
        adopted: ReplyStream = stream  # type: ignore[assignment]
        adopted._owner = threading.get_ident()
        return adopted

    def send_multipart(
        self,
        msg: Any,
        flags: int = 0,
        copy: bool = True,
        track: bool = False,
        callback: Any = None,
        **kwargs: Any,
    ) -> None:
        send_whole = whole_message_sender()
        if (
            send_whole is None
            or not self.at_once
            or flags
            or track
            or callback is not None
            or kwargs
            or self.socket is None
            or threading.get_ident() != self._owner
            or not self._send_queue.empty()
            or not succeeded(msg)
        ):
            super().send_multipart(msg, flags, copy, track, callback, **kwargs)
            return
        # A request that arrived meanwhile (while the cell ran) was signalled once, on an
        # edge-triggered descriptor, and the send takes that signal: the stream looks again
        # on its loop's next turn (asked first: an interrupt after the send cannot skip it).
        self.io_loop.add_callback(self._look_again)
        try:
            send_whole(self.socket, msg)
        except zmq.ZMQError as exc:  # (as the stream's own send, which logs it and goes on)
            gen_log.error("SEND Error: %s", exc)

    def _look_again(self) -> None:
        if self.socket is not None:
            self._handle_events(self.socket, 0)  # type: ignore[no-untyped-call]  # untyped upstream


def succeeded(frames: Any) -> bool:
    """Whether ``frames`` are a whole Jupyter message, every frame ``bytes``, whose content
    says ``"status": "ok"`` (a big one is not read: a reply that could not gain much)."""
    if not isinstance(frames, list) or not all(type(frame) is bytes for frame in frames):
        return False
    try:
        content = frames[frames.index(DELIMITER) + 5]
    except (ValueError, IndexError):
        return False
    if len(content) > MAX_READ_REPLY:
        return False
    try:
        parsed = json.loads(content)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("status") == "ok"


def whole_message_sender() -> Callable[[Any, list[bytes]], None] | None:
    """fast_io's send of a message that no signal handler can cut, once in_kernel_startup.py
    has loaded fast_io.py (None before, or where this pyzmq has none)."""
    module = sys.modules.get(FAST_IO_MODULE)
    return None if module is None else module.whole_message_sender()


class HandOverStream(ReplyStream):
    """The main thread's stream on the shell socket, until the control thread hands the
    socket to the shell-channel thread: every use of the socket under :attr:`handover`,
    then none (its sends go to the shell-channel thread, through :attr:`forward`)."""

    handover: threading.RLock
    #: Once handed over: sends the frames of a reply through the shell-channel thread.
    forward: Callable[..., Any] | None

    @classmethod
    def adopt(cls, stream: ZMQStream) -> HandOverStream:
        """``stream`` (on the main thread's loop, not yet receiving), made one of these."""
        adopted = cast(HandOverStream, super().adopt(stream))
        adopted.handover, adopted.forward = threading.RLock(), None
        # Its loop calls the handler it was given: this class's from now on.
        adopted.io_loop.remove_handler(adopted._fd)
        adopted.io_loop.add_handler(adopted._fd, adopted._handle_events, adopted.io_loop.READ)
        return adopted

    def _handle_events(self, fd: Any, events: int) -> None:
        with self.handover:
            if self.forward is None:
                super()._handle_events(fd, events)  # type: ignore[no-untyped-call]

    def _update_handler(self, state: int) -> None:
        with self.handover:
            if self.forward is None:
                super()._update_handler(state)  # type: ignore[no-untyped-call]

    def flush(self, flag: int = 3, limit: int | None = None) -> int:  # (zmq.POLLIN | zmq.POLLOUT)
        with self.handover:
            return 0 if self.forward is not None else super().flush(flag, limit)

    def send_multipart(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        with self.handover:
            forward = self.forward
            if forward is None:
                super().send_multipart(msg, *args, **kwargs)
                return
        forward(msg, *args, **kwargs)  # a reply to a request that began before the hand-over

    def hand_over(self) -> None:
        """What the main thread queued and has not sent, sent now (the caller holds
        :attr:`handover`: no thread uses the socket)."""
        while not self._send_queue.empty():
            msg, kwargs = self._send_queue.get_nowait()
            self.socket.send_multipart(msg, **kwargs)


class KernelWithSubshellsOnDemand(KernelWithoutSubshells):
    """A kernel whose main thread reads the shell channel until the first subshell request,
    which wakes ipykernel's shell-channel thread (:meth:`wake_subshells`): from then on the
    kernel is ipykernel's own. It advertises subshells throughout."""

    _sleeping: Any = None
    _direct: HandOverStream | None = None
    _waking = threading.Lock()

    @property
    def _supports_kernel_subshells(self) -> bool:
        return bool(self.shell_channel_thread)

    @property
    def kernel_info(self) -> dict[str, Any]:
        info: dict[str, Any] = super().kernel_info
        features = info.setdefault("supported_features", [])
        if "kernel subshells" not in features:
            features.insert(0, "kernel subshells")
        return info

    def sleep_subshells(self, thread: Any) -> None:
        """Keep the shell-channel ``thread`` (made, not started) for the first subshell
        request; until then the main thread reads the shell channel."""
        self._sleeping = thread
        if self.shell_stream is not None:
            self._direct = HandOverStream.adopt(self.shell_stream)
        shell = self.shell
        magic = shell.find_line_magic("subshell") if shell is not None else None
        if shell is not None and magic is not None:  # ipykernel's %subshell: there, if asleep

            def subshell(line: str) -> Any:
                self.wake_subshells()
                return magic(line)

            subshell.__doc__ = magic.__doc__
            shell.register_magic_function(subshell, "line", "subshell")

    def wake_subshells(self) -> None:
        """Hand the shell socket to the shell-channel thread (on the control thread, whatever
        the main thread is doing): requests read before go on in the main thread, their
        replies through the shell-channel thread."""
        from ipykernel.subshell_manager import SubshellManager

        with self._waking:
            thread, direct = self._sleeping, self._direct
            if thread is None or direct is None:
                return
            made: list[ZMQStream] = []
            ready, deciding = threading.Event(), threading.Lock()

            def on_its_thread() -> None:  # ipykernel's init_kernel and manager, there
                with deciding:
                    try:
                        if not ready.is_set():  # (else given up on: the socket stays the main's)
                            stream = ZMQStream(direct.socket, thread.io_loop)
                            thread.shell_stream = stream
                            manager = SubshellManager(thread._zmq_context, thread.io_loop, stream)
                            manager._parent_thread = thread.parent_thread  # (the main shell's)
                            manager._on_recv_callback = self.shell_main
                            thread._manager = manager
                            made.append(stream)
                    finally:
                        ready.set()

            with direct.handover:
                direct.hand_over()
                if not thread.is_alive():
                    thread.start()  # (may fail: no thread left under the sandbox's pids limit)
                thread.io_loop.add_callback(on_its_thread)
                ready.wait(30)
                with deciding:
                    ready.set()
                    if not made:
                        msg = "the shell-channel thread did not take the shell socket in 30 s"
                        raise RuntimeError(msg)
                stream = made[0]
                direct.forward = lambda msg, *args, **kwargs: thread.io_loop.add_callback(
                    stream.send_multipart, msg, *args, **kwargs
                )
                # (self.shell_stream stays ``direct``, which now forwards: the main thread
                # may have looked at the thread just before, and at the stream just after.)
                self.shell_channel_thread = thread
                self._sleeping = None
            direct.io_loop.add_callback(self._main_thread_reads_from, thread, direct)
            thread.io_loop.add_callback(stream.on_recv, self.shell_channel_thread_main, copy=False)

    def _main_thread_reads_from(self, thread: Any, direct: HandOverStream) -> None:
        """On the main thread: it stops watching the socket and reads what the shell-channel
        thread hands it, with the callback the kernel gave the socket's stream (ipykernel's
        wrapper runs every main-shell request in one context: what a cell set in a context
        variable, the next one sees)."""
        direct.io_loop.remove_handler(direct._fd)
        if thread.is_alive():  # (else shut down meanwhile)
            pair = thread.manager._shell_channel_to_main
            pair.on_recv(direct.io_loop, direct._recv_callback, copy=False)

    def _abort_queues(self, subshell_id: str | None = None) -> None:
        # It looks at the thread, then at the stream: no hand-over between.
        direct = self._direct
        if direct is None:
            super()._abort_queues(subshell_id)
            return
        with direct.handover:
            super()._abort_queues(subshell_id)

    def _no_such_subshell(self, subshell_id: str) -> tuple[str, str]:
        return "UnknownSubshellError", f"Unknown subshell_id {subshell_id!r}"  # (as ipykernel's)

    async def create_subshell_request(self, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        await self._woken(IPythonKernel.create_subshell_request, socket, ident, parent)

    async def delete_subshell_request(self, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        await self._woken(IPythonKernel.delete_subshell_request, socket, ident, parent)

    async def list_subshell_request(self, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        await self._woken(IPythonKernel.list_subshell_request, socket, ident, parent)

    async def _woken(self, handler: Any, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        try:
            self.wake_subshells()
        except Exception as exc:
            self.log.exception("Cannot start subshells")
            self._refuse(socket, ident, parent, "SubshellsFailed", f"cannot start subshells: {exc}")
            return
        await handler(self, socket, ident, parent)


#: Where the channel relay put the kernel's end of the keeper's socket pair (kernel_relay.py).
KEEPER_FD = "SANDBOX_KERNEL_CHANNEL_KEEPER_FD"
#: How long a channel's owner thread may take to bind or unbind a listener.
OWNER_TIMEOUT = 2.0


def held_at(paths: set[str]) -> bool:
    """Whether this process holds a unix socket open at one of ``paths`` (a listener, or a
    connection it accepted: ``/proc/net/unix`` names both by the listener's path)."""
    try:
        with open("/proc/net/unix") as table:
            rows = [line.split() for line in table.readlines()[1:]]
        inodes = {row[6] for row in rows if len(row) > 7 and row[7] in paths}
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}")[8:-1] in inodes:
                    return True
    except OSError:
        pass
    return False


class ChannelKeeper:
    """The kernel's end of the channel relay's keeper (kernel_relay.Keeper): it binds the
    shell and IOPub sockets to the listeners the relay lends (ZeroMQ adopts a bound
    listener's descriptor, ``ZMQ_USE_FD``), and unbinds them when the relay asks for them
    back, for a pause: ZeroMQ then closes each listener and every connection it accepted,
    and the sandbox holds no host socket of theirs.

    Each socket is touched only by the thread that owns it, as ZeroMQ requires: shell's by
    the thread reading it (the main thread's, under :attr:`HandOverStream.handover` while
    it reads it, else on the owner's loop), IOPub's on the IOPub thread (its ``schedule``,
    which the direct sends of fast_io.py wait behind). A thread of its own reads the
    relay's requests, started before the kernel says it takes listeners over (a kernel
    with no thread left under its pids limit says nothing, and has every channel relayed).
    Kernel code that holds the interpreter delays it: the pause then fails (the host sees
    the sockets still held), the kernel running on.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.app: Any = None
        self.serving = threading.Event()
        #: channel -> the endpoint its socket is bound to, lent by the relay.
        self.bound: dict[str, str] = {}

    @classmethod
    def open(cls, take: bool) -> ChannelKeeper | None:
        """The keeper, if the relay gave the kernel its end and the kernel ``take``s
        listeners over, having told the relay so (before the kernel opens its ports, which
        the relay waits for); it serves once :meth:`serve` gives it the kernel."""
        fd = os.environ.pop(KEEPER_FD, "")
        if not fd.isdigit():
            return None
        try:
            sock = socket.socket(fileno=int(fd))
        except OSError:
            return None
        if not take or getattr(zmq, "USE_FD", None) is None or zmq.zmq_version_info() < (4, 2):
            sock.close()  # (a libzmq that cannot adopt a listener: every channel relayed)
            return None
        keeper = cls(sock)
        try:
            sock.set_inheritable(False)  # (not to kernel code's children)
            threading.Thread(target=keeper.run, name="channel-keeper", daemon=True).start()
            sock.send(b"hello")
        except (OSError, RuntimeError):  # (RuntimeError: no thread left)
            sock.close()
            return None
        return keeper

    def serve(self, app: IPKernelApp) -> None:
        """The kernel's sockets exist: bind what the relay lends."""
        self.app = app
        self.serving.set()

    def run(self) -> None:
        # Signals are the main thread's: a SIGINT taken here would not wake a cell asleep
        # there, and the interrupt would come only once it woke (seen: 1 in 15 runs).
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        self.serving.wait()
        try:
            mine = os.fstat(self.sock.fileno()).st_ino
        except OSError:
            return
        while True:
            try:
                # Kernel code may close the descriptor, and its number go to another socket
                # (a host connection ZeroMQ accepted): this thread then reads it no more.
                if os.fstat(self.sock.fileno()).st_ino != mine:
                    return
                message, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("i")))
            except OSError:
                return
            if not message:
                return  # the relay is gone (or kernel code shut the pair down)
            fds = [
                fd
                for level, kind, data in ancillary
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
                for (fd,) in struct.iter_unpack("i", data[: len(data) - len(data) % 4])
            ]
            words = message.decode(errors="replace").split(" ", 2)
            try:
                if words[0] == "bind" and len(words) == 3 and words[1] in ("shell", "iopub") and fds:
                    self.bind(words[1], f"ipc://{words[2]}", fds.pop(0))
                elif words[0] == "release" and len(words) == 2 and not self._more_waiting():
                    self.release()
                    self.sock.send(f"released {words[1]}".encode())
            except OSError:  # its socket is gone: nothing more will come through it
                self.app.log.exception("channel keeper: %s", words[0])
                return
            except Exception:  # the kernel goes on; a pause fails, and the host says why
                self.app.log.exception("channel keeper: %s", words[0])
            finally:
                for fd in fds:  # (what came with a request it did not take)
                    os.close(fd)

    def _more_waiting(self) -> bool:
        """Whether the relay has sent more since: then a request to let go came too late
        (the relay gave up on it, and the pause failed; the listeners it lends now come
        beside those kept, whose connections go on)."""
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:
            return False

    def _socket(self, channel: str) -> Any:
        # (IOPub's own socket: the app's iopub_socket is ipykernel's deprecated wrapper.)
        return self.app.shell_socket if channel == "shell" else self.app.iopub_thread.socket

    def bind(self, channel: str, endpoint: str, fd: int) -> None:
        """Bind ``channel``'s socket to the listener ``fd`` (at ``endpoint``), beside any it
        kept through a failed pause (the host removed that one's file; its connections go
        on until the next pause unbinds both, ZeroMQ unbinding every listener of an
        endpoint), on its owner's thread, whenever that runs (the main thread's loop
        starts after the kernel's start-up code)."""
        sock = self._socket(channel)

        def work() -> None:
            try:
                sock.setsockopt(zmq.USE_FD, fd)
                try:
                    sock.bind(endpoint)
                finally:
                    sock.setsockopt(zmq.USE_FD, -1)
            except Exception:
                with contextlib.suppress(OSError):
                    os.close(fd)  # (not taken: a bind that fails leaves the descriptor)
                self.app.log.exception("channel keeper: cannot bind %s", channel)
                return
            self.bound[channel] = endpoint

        try:
            self.on_owner(channel, work)
        except BaseException:
            os.close(fd)
            raise

    def release(self) -> None:
        """Unbind every socket bound to a lent listener, and wait until ZeroMQ's I/O thread
        has closed it and the connections it accepted (the sandbox's ``/proc/net/unix``
        lists both at the listener's path: the host sees a listener, not every connection,
        and a checkpoint that meets one fails and ends the sandbox).

        Raises:
            TimeoutError: an owner did not unbind, or a socket is still open, after
                OWNER_TIMEOUT seconds.
        """
        paths = {endpoint.removeprefix("ipc://") for endpoint in self.bound.values()}
        for channel in list(self.bound):
            done, sock = threading.Event(), self._socket(channel)

            def work(channel: str = channel, sock: Any = sock, done: threading.Event = done) -> None:
                try:
                    endpoint = self.bound.pop(channel, None)
                    if endpoint is not None:
                        with contextlib.suppress(zmq.ZMQError):
                            sock.unbind(endpoint)
                finally:
                    done.set()

            self.on_owner(channel, work)
            if not done.wait(OWNER_TIMEOUT):
                msg = f"the thread of the {channel} socket did not unbind it in time"
                raise TimeoutError(msg)
        deadline = time.monotonic() + OWNER_TIMEOUT
        while held_at(paths):
            if time.monotonic() > deadline:
                msg = "ZeroMQ did not close the channels' host sockets in time"
                raise TimeoutError(msg)
            time.sleep(0.002)

    def on_owner(self, channel: str, work: Callable[[], None]) -> None:
        """Run ``work`` where ``channel``'s socket may be used: now, or on its owner's
        thread; then have the socket's stream look again for a message waiting (ZeroMQ
        signals one once, to whichever thread looks first, and a bind or an unbind looks)."""
        if channel == "iopub":
            pub = self.app.iopub_thread
            self._then_look(pub.schedule, work, getattr(pub, "_xpub_stream", None))
            return
        kernel = self.app.kernel
        direct = getattr(kernel, "_direct", None)
        if isinstance(direct, HandOverStream):
            with direct.handover:
                if direct.forward is None:  # the main thread's, and it waits for the lock
                    work()
                    direct._rebuild_io_state()  # type: ignore[no-untyped-call]
                    return
            thread = kernel.shell_channel_thread
            self._then_look(thread.io_loop.add_callback, work, thread.shell_stream)
        else:
            self._then_look(kernel.shell_stream.io_loop.add_callback, work, kernel.shell_stream)

    @staticmethod
    def _then_look(hand: Callable[[Callable[[], None]], Any], work: Callable[[], None], stream: Any) -> None:
        def run() -> None:
            try:
                work()
            finally:
                if stream is not None:
                    stream._rebuild_io_state()

        hand(run)


class SandboxedKernelApp(IPKernelApp):
    """``python -m ipykernel_launcher``, with shell and stdin taking a reconnecting peer's
    identity over, and subshells optional."""

    subshells = Bool(
        True,
        config=True,
        help="Subshells (ipykernel 7): the main thread reads the shell channel until a "
        "client asks for one, then a thread of its own does. False: the main thread for "
        "good, as ipykernel 6 did, with no subshells.",
    )
    take_channels = Bool(
        True,
        config=True,
        help="Take the host-facing listeners of shell and IOPub over from the channel relay "
        "(about 1 ms less per request under gVisor; given back for a pause). False: the relay "
        "passes every channel on, as for a kernel that cannot (bench/kernel_choices.py).",
    )
    #: The shell-channel thread a kernel with subshells on demand wakes.
    _sleeping: Any = None

    #: The channel keeper, when the channel relay lends listeners.
    _keeper: ChannelKeeper | None = None

    def init_sockets(self) -> None:
        self._keeper = ChannelKeeper.open(self.take_channels)  # before the ports the relay waits for
        super().init_sockets()  # type: ignore[no-untyped-call]
        for sock in (self.shell_socket, self.stdin_socket):
            sock.router_handover = 1
        made = getattr(self, "shell_channel_thread", None)  # (ipykernel 6 has none to drop)
        if made is None:
            return
        if self.subshells and not subshells_on_demand_fit():
            self.log.warning(
                "subshells start with the kernel (ipykernel's own path, about 2 ms more per "
                "request): this kernel wakes them on demand in ipykernel 7.4 only, not %s",
                ".".join(map(str, ipykernel_version)),
            )
            return
        # ipykernel's own path for a kernel without the thread (init_kernel and the
        # kernel's checks), with the corrections of KernelWithoutSubshells.
        self.shell_channel_thread = NoShellChannelThread()
        if self.subshells:
            self._sleeping = made
            self.kernel_class = KernelWithSubshellsOnDemand
        else:
            made.io_loop.close()  # made, never to run
            self.kernel_class = KernelWithoutSubshells

    def init_kernel(self) -> None:
        super().init_kernel()  # type: ignore[no-untyped-call]
        if self._sleeping is not None:
            self.kernel.sleep_subshells(self._sleeping)
            self.shell_channel_thread = self._sleeping  # (stopped at the end, if woken)
        elif isinstance(self.shell_channel_thread, NoShellChannelThread) and self.kernel.shell_stream:
            ReplyStream.adopt(self.kernel.shell_stream)  # (the main thread's for good)
        if self._keeper is not None:
            self._keeper.serve(self)


if __name__ == "__main__":
    asyncio.set_event_loop_policy(PollingEventLoopPolicy())
    SandboxedKernelApp.launch_instance()
