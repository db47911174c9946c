"""Channel relay run inside the sandbox: the kernel's ZeroMQ channels, lent to the host.

The kernel binds its five channels on the sandbox's own loopback (tcp 127.0.0.1). This
relay, the kernel's parent, listens for each channel on a unix socket in the launch folder
(where the host's bridge connects, as it would to a kernel binding them itself) and gives
each connection the host makes a connection of its own to the kernel's port: it copies
their bytes both ways and reads none of them (see :class:`Relay`). ZeroMQ runs end to
end, between the bridge and ipykernel, so the kernel sees the bridge as its peer (its
heartbeat thread answers pings, its IOPub socket sees the bridge's subscription), and the
relay itself needs no ZeroMQ: one thread, woken once per read, where a relay of whole
messages woke ZeroMQ's I/O thread and its own on each side (bench/roundtrip.py: a third of
the sandboxed round trip under load).

Shell and IOPub, the channels of every request and its output, skip that hop: the relay
binds their listeners and lends them to the kernel (:class:`Keeper`), whose ZeroMQ sockets
adopt them, so that the host's connections reach the kernel directly (about 1 ms less per
``1+1`` under gVisor, where every wake-up of this process is dear). A kernel that cannot
take them (another kernel's command, or ``--SandboxedKernelApp.take_channels=False``) has
all five relayed.

Why a relay: gVisor cannot checkpoint a sandbox that holds a host socket. ``SIGUSR1``
takes the lent listeners back (the kernel unbinds them, which closes them and the
connections they accepted), then closes the relay's own (their files removed) and every
connection, the kernel's with a reset (no TCP state of them left in the sandbox for the
checkpoint to save); ``SIGUSR2`` binds them afresh and lends shell and IOPub again, and
the bridge connects again. Both signals go on to the egress relay, if the kernel has one
(its pid in ``SANDBOX_KERNEL_EGRESS_RELAY_PID``), which holds host sockets of its own.

While the host lends the launch folder back for the sockets to be bound again (after a
pause, failed or not), nothing else in the sandbox runs (see :class:`Holding`): on
``SIGUSR1`` this relay stops every other process of the sandbox (the egress relay
excepted), which stay stopped through the checkpoint, and lets them go on only once the
host has sealed the folder again. Kernel code never sees the folder its own.

It also stops what the kernel's own memory watch cannot (see :class:`MemoryClamp`): one
call made in C that keeps allocating while it holds the interpreter's lock.

The relay is not a boundary (kernel code, its uid, can kill it, which ends the sandbox)
and checks no message: the host's bridge checks every message's signature and size. It
is copied into the launch folder and run by the image's Python, standard library only,
Python 3.9 and newer.

Usage::

    python kernel_relay.py CHANNEL=IPC_PATH:PORT [...] -- CMD [ARGS...]

It starts ``CMD`` (the kernel) as its child, forwards it the signals a container gets
(SIGINT interrupts it), binds the host-facing sockets once the kernel's ports accept
connections (so their files appearing means the kernel is ready), and exits with the
kernel's status.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

USAGE = "usage: kernel_relay.py CHANNEL=IPC_PATH:PORT [...] -- CMD [ARGS...]"
CHANNELS = ("shell", "iopub", "stdin", "control", "hb")
#: The order in which waiting bytes are passed on: the kernel sends a cell's output on
#: IOPub before its reply on shell, so output waiting beside the reply goes first (for a
#: kernel that has both relayed; one that holds their listeners sends them itself).
PASS_ORDER = ("iopub", "shell", "stdin", "control", "hb")
#: Bytes read from a connection at a time.
CHUNK = 64 * 1024
#: Seconds the kernel's last words (what it wrote before it ended) may take to pass.
LAST_WORDS_TIMEOUT = 2.0
#: Signals a container's init passes on that are the kernel's, not the relay's.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: How long the kernel may take to open its ports.
STARTUP_TIMEOUT = 300.0
#: The channels whose host-facing listeners the kernel takes over (see :class:`Keeper`):
#: those of every request and its output, where a hop through this relay is dearest.
HANDED = ("shell", "iopub")
#: The kernel's end of the keeper's socket pair, as an inherited descriptor's number.
KEEPER_FD = "SANDBOX_KERNEL_CHANNEL_KEEPER_FD"
#: How long the kernel may take to let go of the listeners it took over, for a pause.
TAKE_BACK_TIMEOUT = 8.0
#: The egress relay's pid, when one runs (see sandbox_kernel.egress.relay).
EGRESS_RELAY_PID = "SANDBOX_KERNEL_EGRESS_RELAY_PID"
#: How long the rest of the sandbox stays stopped for the host to seal the launch folder
#: again (the host gives up on the sockets after 20 s, and then seals it anyway).
SEAL_TIMEOUT = 30.0


def pass_on(pid: int | None, signum: int, kill: Callable[[int, int], None] = os.kill) -> None:
    """Send ``signum`` to the egress relay ``pid``, if that process is still it (kernel
    code may have ended it, and its pid gone to another process, which the signal would
    kill)."""
    if pid is None:
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"egress_relay" not in f.read():
                return
        kill(pid, signum)
    except OSError:
        pass


def parse(args: list[str]) -> tuple[dict[str, tuple[str, int]], list[str]]:
    """({channel: (ipc path, kernel port)}, command).

    Raises:
        ValueError: the arguments are not as in USAGE.
    """
    if "--" not in args:
        msg = "no '--' before the kernel's command"
        raise ValueError(msg)
    split = args.index("--")
    specs, command = args[:split], args[split + 1 :]
    if not command:
        msg = "no command after '--'"
        raise ValueError(msg)
    channels: dict[str, tuple[str, int]] = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        path, _, port = rest.rpartition(":")
        if name not in CHANNELS or not path or not port.isdigit():
            msg = f"not CHANNEL=IPC_PATH:PORT: {spec!r}"
            raise ValueError(msg)
        channels[name] = (path, int(port))
    if sorted(channels) != sorted(CHANNELS):
        msg = f"every channel once: {', '.join(CHANNELS)}"
        raise ValueError(msg)
    return channels, command


def wait_for_ports(ports: list[int], kernel: subprocess.Popen[bytes], timeout: float) -> bool:
    """Until the kernel accepts connections on every port; False if it exited first."""
    deadline = time.monotonic() + timeout
    waiting = list(ports)
    while waiting:
        if kernel.poll() is not None or time.monotonic() > deadline:
            return False
        try:
            socket.create_connection(("127.0.0.1", waiting[0]), timeout=1).close()
            waiting.pop(0)
        except OSError:
            time.sleep(0.02)
    return True


class Keeper:
    """The relay's end of a socket pair with the kernel's channel keeper (kernel_app.py),
    through which the kernel takes over the host-facing listeners of :data:`HANDED`.

    gVisor cannot save a sandbox that holds a host socket, which is why this relay exists:
    it lets go of its sockets for a pause. A kernel that can let go of its own takes the
    listeners of shell and IOPub from the relay (:meth:`lend`: the bound listener's
    descriptor, which ZeroMQ adopts, ``ZMQ_USE_FD``), and the host's connections to them
    reach the kernel directly: no hop through this process, whose wake-up gVisor makes dear
    (about 1 ms of a ``1+1``). For a pause the relay asks for them back (:meth:`take_back`:
    the kernel unbinds them, which closes them and their connections) before it stops the
    rest of the sandbox; after a resume it binds new ones and lends them again. The kernel
    never gets the launch folder: only descriptors of sockets already bound in it.

    A kernel says it can (:meth:`said_hello`) before it opens its ports; one that does not
    (another kernel's command) has all five channels relayed, as before. A kernel that
    does not let go in time (kernel code holding its interpreter) is stopped with the
    rest: the host sees its sockets still held and the pause fails, the kernel running on.
    """

    def __init__(self) -> None:
        self.sock, self.kernel_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Never waits: kernel code may leave its end unread, and this relay must go on.
        self.sock.setblocking(False)
        #: The channels whose listeners the kernel holds, as far as this relay knows (one
        #: it did not give back stays here: see :meth:`take_back`).
        self.lent: set[str] = set()
        #: Whether the kernel's end is gone (kernel code closed it): lend nothing more.
        self.gone = False
        #: The number of the last request to give the listeners back (answers name it).
        self.asked = 0

    def env(self) -> dict[str, str]:
        """The kernel's environment: where its end of the pair is."""
        return {**os.environ, KEEPER_FD: str(self.kernel_end.fileno())}

    def started(self) -> None:
        """The kernel runs, with its own copy of its end."""
        self.kernel_end.close()

    def said_hello(self) -> bool:
        """Whether the kernel has said it takes listeners over (it does before it opens its
        ports, which the relay waits for first)."""
        try:
            return self.sock.recv(16, socket.MSG_DONTWAIT) == b"hello"
        except OSError:
            return False

    def lend(self, name: str, path: str, listener: socket.socket) -> None:
        """Hand ``listener`` (bound at ``path``) to the kernel, for channel ``name``.

        Raises:
            OSError: the kernel's end is gone, or does not take more now.
        """
        rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", listener.fileno()))
        try:
            self.sock.sendmsg([f"bind {name} {path}".encode()], [rights])
        except OSError:
            self.gone = True
            raise
        self.lent.add(name)

    def take_back(self, timeout: float) -> bool:
        """Ask the kernel to let go of every listener lent and of their connections; whether
        it said it has within ``timeout`` seconds. Answers are numbered: one to an earlier
        request, come late, or anything else kernel code writes, is read past; its end
        closed is no answer. Until it answers, :attr:`lent` says it may hold them still."""
        if not self.lent:
            return True
        self.asked += 1
        answer = f"released {self.asked}".encode()
        deadline = time.monotonic() + timeout
        try:
            self.sock.send(f"release {self.asked}".encode())
            while (left := deadline - time.monotonic()) > 0:
                if not select.select([self.sock], [], [], left)[0]:
                    return False
                said = self.sock.recv(64)
                if not said:
                    self.gone = True
                    return False
                if said == answer:
                    self.lent = set()
                    return True
        except OSError:
            self.gone = True
        return False


class _Stream:
    """One direction of a connection pair: bytes read from ``source``, not yet written to
    ``sink`` (the sink could not take them all: the source is not read meanwhile)."""

    def __init__(self, source: socket.socket, sink: socket.socket) -> None:
        self.source, self.sink = source, sink
        self.pending = b""


class Relay:
    """The host-facing unix listeners (until a pause) and, for each connection the host
    makes to one, a connection of its own to the kernel's port of that channel, whose
    bytes it copies both ways unread.

    The two ends of a pair speak ZeroMQ to each other (the host's bridge and ipykernel),
    so the kernel sees each connection of the host's as a peer of its own, as it would
    without the sandbox. A pair ends with either side: the other is closed too (the
    kernel's with a reset, so that nothing of it lingers to be saved by a checkpoint), and
    a reconnecting bridge gets a new one. Flow control is the pair's own: a side that
    cannot take more is not sent more, and its peer is not read until it can.
    """

    def __init__(self, channels: dict[str, tuple[str, int]], keeper: Keeper | None = None) -> None:
        self.channels = channels
        #: Where the listeners of :data:`HANDED` go, if the kernel takes them over.
        self.keeper = keeper
        # poll(2), not epoll: an epoll set can come back from a restore holding a
        # descriptor closed before the pause, ready for ever (see kernel_app.py).
        self.poller = select.poll()
        #: listening socket's fd -> (socket, channel)
        self.listeners: dict[int, tuple[socket.socket, str]] = {}
        #: connected socket's fd -> (the stream it is the source of, its channel)
        self.streams: dict[int, tuple[_Stream, str]] = {}
        # Every read lands here: a buffer allocated per read would cost a memory mapping
        # and its removal each time, which gVisor makes dear.
        self._buffer = bytearray(CHUNK)
        self._view = memoryview(self._buffer)

    def open(self) -> None:
        """Bind the host-facing listeners (a file left at a path is replaced), and lend the
        kernel those it takes over (beside any it kept through a failed pause)."""
        if self.listeners:
            return
        for name, (path, _) in self.channels.items():
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            _unlink(path)
            # Made 0666 by the umask, not by a chmod after the bind: the host's bridge may
            # be another user, and once every socket exists the host seals the folder,
            # after which the kernel's uid may change nothing there (a chmod then failed).
            previous = os.umask(0o111)
            try:
                listener.bind(path)
            except OSError:
                listener.close()
                raise
            finally:
                os.umask(previous)
            listener.listen(16)
            if self.keeper is not None and not self.keeper.gone and name in HANDED:
                try:
                    self.keeper.lend(name, path, listener)
                except OSError:
                    # Its end is gone (kernel code closed it): this relay passes the
                    # channel on from now on, to the kernel's port, as for any kernel.
                    print(f"kernel relay: the kernel cannot take {name} over; relaying it", file=sys.stderr)
                else:
                    listener.close()
                    continue
            listener.setblocking(False)
            self.listeners[listener.fileno()] = (listener, name)
            self.poller.register(listener, select.POLLIN)

    def close(self, kernel_ended: bool = False) -> None:
        """Close the listeners and every connection, host's and kernel's; remove the
        listeners' files, and those of the listeners the kernel gave back (ZeroMQ leaves an
        adopted listener's file), or held until it ended. The files of listeners it may
        still hold stay: where the host cannot see the sandbox's sockets, it looks for
        them there, and must not save a sandbox that holds one."""
        if self.keeper is not None and (kernel_ended or not self.keeper.lent):
            for name in HANDED:
                _unlink(self.channels[name][0])
        for fd, (listener, name) in list(self.listeners.items()):
            self.poller.unregister(fd)
            listener.close()
            _unlink(self.channels[name][0])
        self.listeners = {}
        for fd in list(self.streams):
            if fd in self.streams:
                self._end(self.streams[fd][0])

    def pass_on(self, ready: list[tuple[int, int]]) -> None:
        """Act on what poll found ready: new connections, bytes to copy, sinks that can
        take more. IOPub first (PASS_ORDER): output waiting beside a reply goes before it."""
        order = {name: rank for rank, name in enumerate(PASS_ORDER)}

        def rank(event: tuple[int, int]) -> int:
            found = self.streams.get(event[0])
            return order[found[1]] if found is not None else -1

        for fd, events in sorted(ready, key=rank):
            if events & select.POLLNVAL:  # closed while registered: poll would say so on and on
                with contextlib.suppress(KeyError):
                    self.poller.unregister(fd)
            elif fd in self.listeners:
                self._accept(*self.listeners[fd])
            elif fd in self.streams:
                stream = self.streams[fd][0]
                if events & select.POLLOUT:
                    self._write_pending(fd)
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR) and fd in self.streams:
                    self._copy(stream)

    def _accept(self, listener: socket.socket, name: str) -> None:
        try:
            host, _ = listener.accept()
        except OSError as exc:  # gone meanwhile (BlockingIOError included)
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # Out of descriptors (kernel code holding connections): the listener stays
                # ready until one is free, so wait a little instead of spinning.
                time.sleep(0.01)
            return
        try:
            kernel = socket.create_connection(("127.0.0.1", self.channels[name][1]), timeout=1)
        except OSError:
            host.close()  # the kernel no longer listens (it is ending): its exit follows
            return
        kernel.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for end in (host, kernel):
            end.setblocking(False)
        for stream in (_Stream(host, kernel), _Stream(kernel, host)):
            self.streams[stream.source.fileno()] = (stream, name)
            self.poller.register(stream.source, select.POLLIN)

    def _copy(self, stream: _Stream) -> None:
        """Read what ``stream``'s source has and write it to its sink, as much as it takes."""
        try:
            size = stream.source.recv_into(self._buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            size = 0
        if not size:
            self._end(stream)
            return
        data = self._view[:size]
        try:
            sent = stream.sink.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._end(stream)
            return
        if sent < size:
            # The sink is full: keep the rest, and read no more of the source until it drains.
            stream.pending = bytes(data[sent:])
            self._watch(stream.source)
            self._watch(stream.sink)

    def _write_pending(self, fd: int) -> None:
        """``fd`` can take more: write what waits for it (then its peer is read again)."""
        sink = self.streams[fd][0].source
        stream = self.streams[self.streams[fd][0].sink.fileno()][0]  # the one writing to fd
        try:
            sent = sink.send(stream.pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._end(stream)
            return
        stream.pending = stream.pending[sent:]
        if not stream.pending:
            self._watch(stream.source)
            self._watch(stream.sink)

    def _watch(self, end: socket.socket) -> None:
        """What poll waits for on one end: bytes to read, unless what it sent last still
        waits for its peer; room to write, while bytes wait for it."""
        outgoing = self.streams[end.fileno()][0]
        incoming = self.streams[outgoing.sink.fileno()][0]
        mask = (0 if outgoing.pending else select.POLLIN) | (select.POLLOUT if incoming.pending else 0)
        self.poller.modify(end, mask)

    def _end(self, stream: _Stream) -> None:
        """Close both ends of ``stream``'s pair; the kernel's with a reset (no lingering
        TCP state in the sandbox, and its socket frees the peer's identity at once)."""
        for end in (stream.source, stream.sink):
            fd = end.fileno()
            if fd < 0:
                continue
            self.streams.pop(fd, None)
            with contextlib.suppress(KeyError):
                self.poller.unregister(fd)
            if end.family == socket.AF_INET:
                with contextlib.suppress(OSError):
                    end.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            end.close()

    def drain(self, timeout: float) -> None:
        """The kernel has ended: pass on what it wrote before (its last words), for up to
        ``timeout`` seconds, then close everything."""
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            ready = self.poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
            if not ready:
                break
            self.pass_on([(fd, events) for fd, events in ready if fd not in self.listeners])
        self.close(kernel_ended=True)


class Holding:
    """Every other process of the sandbox stopped while the launch folder is lent.

    A root host seals the launch folder once the kernel is up (it hands it to root; see
    launch_folder.seal_launch_dir) and lends it back to the kernel's uid only for these
    sockets to be bound again after a pause. Kernel code shares that uid: in that moment
    it could plant a tree or a socket of its own where the host's bridge connects. So the
    relay stops the rest of the sandbox first (``kill(-1, SIGSTOP)``: every process but
    init and this one, atomically, so none can start meanwhile), on ``SIGUSR1``, before it
    closes its sockets (the host lends the folder only once they are gone): the sandbox is
    saved and restored stopped. After binding again on ``SIGUSR2`` it waits until the
    folder is no longer its uid's (sealed), then lets go on what it stopped. The egress
    relay goes on throughout (it binds a socket there too). What was stopped before stays
    stopped.

    Only where the host seals (the folder is not this uid's when the pause begins: a host
    that is not root never seals, and its kernel shares its uid anyway), and only inside
    the sandbox (init's command line runs this relay), never on a host, where ``kill(-1)``
    would stop every process of the user.
    """

    def __init__(
        self, folder: str, egress_pid: int | None, kill: Callable[[int, int], None] = os.kill
    ) -> None:
        self.folder = folder
        self.egress_pid = egress_pid
        self.kill = kill
        self.stopped = False
        self.already_stopped: set[int] = set()
        self.sealing_since: float | None = None

    def sealed(self) -> bool:
        try:
            return os.stat(self.folder).st_uid != os.getuid()
        except OSError:
            return False

    def stop(self) -> None:
        """Stop every other process (once per pause), if the host seals the folder."""
        if self.stopped:
            return
        if not (in_sandbox() and self.sealed()):
            return
        self.already_stopped = {pid for pid, state in processes() if state == "T"}
        try:
            self.kill(-1, signal.SIGSTOP)
        except OSError:
            return  # nothing else runs
        self.stopped = True
        pass_on(self.egress_pid, signal.SIGCONT, self.kill)

    def bound(self) -> None:
        """The sockets are bound again: wait for the seal (see :meth:`poll`)."""
        if self.stopped:
            self.sealing_since = time.monotonic()

    def poll(self) -> float | None:
        """Let go once the folder is sealed again, or after SEAL_TIMEOUT; the seconds until
        the next look (None: nothing to wait for)."""
        if self.sealing_since is None:
            return None
        late = time.monotonic() - self.sealing_since > SEAL_TIMEOUT
        if not (self.sealed() or late):
            return 0.005
        if late:
            print("kernel relay: the host did not seal the launch folder again; going on", file=sys.stderr)
        self.go_on()
        return None

    def go_on(self) -> None:
        for pid, _ in processes():
            if pid not in self.already_stopped:
                with contextlib.suppress(OSError):
                    self.kill(pid, signal.SIGCONT)
        self.stopped, self.sealing_since, self.already_stopped = False, None, set()


def in_sandbox() -> bool:
    """This relay is the sandbox's one command (its init runs it), not a process on a host."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return os.path.basename(__file__).encode() in f.read()
    except OSError:
        return False


def processes() -> list[tuple[int, str]]:
    """(pid, state letter) of every other process but init."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (1, os.getpid()):
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0].decode()
        except (OSError, IndexError):
            continue
        found.append((int(entry), state))
    return found


def _unlink(path: str) -> None:
    """Remove a socket's file, if this process may: once the kernel is up, the host takes
    the launch folder back and removes what is left (binding again after a pause, the
    host hands it over first)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def memory_bytes(policy: str) -> int:
    """The memory limit in the kernel's policy (``SANDBOX_KERNEL_POLICY``), in bytes; 0:
    none known. Read as in the kernel's start-up code (in_kernel_startup.py)."""
    try:
        memory = str(json.loads(policy or "{}").get("memory", ""))
    except (ValueError, AttributeError):
        return 0
    size = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*", memory, re.IGNORECASE)
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    return int(float(size[1]) * units[size[2].lower()]) if size else 0


class MemoryClamp:
    """Makes the kernel's allocations fail, for a moment, once it keeps allocating past the
    point where its own memory watch stops cells.

    That watch is a thread of the kernel's interpreter: one call made in C that holds the
    interpreter's lock while it allocates (``list(range(10**9))``, ``dict.fromkeys``, a
    huge ``str.join``) keeps it from running until the sandbox is killed at its limit,
    every variable lost. From this process, the kernel's parent, the clamp watches the
    kernel's resident memory; once it has grown ``step`` past the watch's threshold (or
    past where it was when the clamp last let go), it lowers the kernel's address-space
    limit (RLIMIT_AS, its soft limit) to what it uses now and a little more, so that the
    call's next allocation fails (``MemoryError``, in the cell). The kernel lifts it as it
    shows that error (its start-up code), else the clamp does once memory is back below the
    threshold, or after ``hold`` seconds. Not a permanent address-space limit: ZeroMQ's threads abort the
    kernel when one of their allocations fails, which here can happen only in that moment,
    at the edge of a limit that would end the kernel anyway. What one allocation maps at
    once (``numpy.ones`` of most of the limit) is already mapped: out of its reach.
    """

    #: Bytes per second: more than a kernel allocates under gVisor.
    FASTEST_GROWTH = 2 * 2**30

    def __init__(self, pid: int, limit: int, hold: float = 3.0) -> None:
        self.pid = pid
        # As the kernel's watch (in_kernel_startup.py): gVisor's own memory, /tmp and this relay.
        self.threshold = limit - (96 * 2**20 + limit // 16)
        self.step = 32 * 2**20
        self.hold = hold
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.clamped_at: float | None = None
        self.base = 0  # resident memory when the clamp last let go
        #: How many times the clamp acted (for tests and the curious: the relay logs it).
        self.clamps = 0

    def usage(self) -> tuple[int, int]:
        """(address space, resident) of the kernel, in bytes."""
        with open(f"/proc/{self.pid}/statm", "rb") as statm:
            size, resident = statm.read().split()[:2]
        return int(size) * self.page, int(resident) * self.page

    def look(self) -> float:
        """One look: clamp, keep, or let go; the seconds until the next one (before the
        fastest allocation could get there: an idle kernel far below costs a wake-up a
        second, one near it is watched closely)."""
        vm, rss = self.usage()
        if self.clamped_at is None:
            if rss < self.threshold:
                self.base = 0
            elif rss >= max(self.threshold, self.base) + self.step:
                resource.prlimit(self.pid, resource.RLIMIT_AS, (vm + 16 * 2**20, self._hard()))
                self.clamped_at = time.monotonic()
                self.clamps += 1
        elif soft_limit(self.pid) == self._hard():  # the kernel lifted it, showing its error
            self.clamped_at, self.base = None, rss
        elif rss < self.threshold or time.monotonic() - self.clamped_at >= self.hold:
            self.release()
            self.base = rss
        return min(1.0, max(0.01, (self.threshold - rss) / self.FASTEST_GROWTH))

    def release(self) -> None:
        hard = self._hard()
        resource.prlimit(self.pid, resource.RLIMIT_AS, (hard, hard))
        self.clamped_at = None

    def _hard(self) -> int:
        return resource.prlimit(self.pid, resource.RLIMIT_AS)[1]

    def run(self) -> None:
        """Look until the kernel is gone."""
        try:
            while True:
                time.sleep(self.look())
        except (OSError, ValueError):  # the kernel ended (its /proc entry went)
            return

    def start(self) -> None:
        """Watch from now on, once the kernel is up: growth past what it uses now counts
        (a kernel with the least memory allowed starts above its watch's threshold)."""
        self.base = self.usage()[1]
        threading.Thread(target=self.run, name="memory-clamp", daemon=True).start()


def soft_limit(pid: int) -> int:
    """The soft address-space limit of process ``pid``."""
    return resource.prlimit(pid, resource.RLIMIT_AS)[0]


def main(argv: list[str]) -> int:
    try:
        channels, command = parse(argv[1:])
    except ValueError as exc:
        print(f"kernel relay: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    received: list[int] = []  # signal numbers, in order
    for signum in (*FORWARDED, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(signum, lambda signum, _frame: received.append(signum))
    egress = os.environ.pop(EGRESS_RELAY_PID, "")
    egress_pid = int(egress) if egress.isdigit() else None
    keeper = Keeper()
    try:
        kernel = subprocess.Popen(  # noqa: S603 - the kernelspec's own command
            command, pass_fds=(keeper.kernel_end.fileno(),), env=keeper.env()
        )
    except OSError as exc:
        print(f"kernel relay: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    keeper.started()
    if not wait_for_ports([port for _, port in channels.values()], kernel, STARTUP_TIMEOUT):
        kernel.wait()
        return _status(kernel.returncode)
    limit = memory_bytes(os.environ.get("SANDBOX_KERNEL_POLICY", ""))
    if limit > 0:
        try:
            MemoryClamp(kernel.pid, limit).start()
        except OSError:  # the kernel ended already: its status follows
            pass
    relay = Relay(channels, keeper if keeper.said_hello() else None)
    relay.open()
    holding = Holding(os.path.dirname(channels["shell"][0]), egress_pid)
    relay.poller.register(wake_read, select.POLLIN)
    while True:
        wait = holding.poll()
        try:
            ready = relay.poller.poll(None if wait is None else max(wait, 0.001) * 1000)
        except InterruptedError:
            continue
        if any(fd == wake_read for fd, _ in ready):
            os.read(wake_read, 256)
            while received:
                number = received.pop(0)
                if number in FORWARDED and kernel.poll() is None:
                    kernel.send_signal(number)
                elif number == signal.SIGUSR1:
                    # The kernel lets go of what it took over while it still runs; then the
                    # rest stops, before the host sees the sockets go and lends the folder.
                    if not keeper.take_back(TAKE_BACK_TIMEOUT):
                        # Its sockets stay open: the host sees them and the pause fails.
                        print("kernel relay: the kernel did not let go of its channels", file=sys.stderr)
                    holding.stop()
                    relay.close()
                    pass_on(egress_pid, number)
                elif number == signal.SIGUSR2:
                    pass_on(egress_pid, number)
                    relay.close()  # (if still open: bound afresh, as the host removed the files)
                    try:
                        relay.open()
                    except OSError as exc:
                        # The host waits for the sockets, and reports that they never came.
                        print(
                            f"kernel relay: cannot bind the host-facing sockets again: {exc}", file=sys.stderr
                        )
                        relay.close()
                    holding.bound()
            if kernel.poll() is not None:
                relay.poller.unregister(wake_read)
                try:
                    relay.drain(LAST_WORDS_TIMEOUT)
                except Exception as exc:  # noqa: BLE001 - the kernel's status must get out
                    print(f"kernel relay: {exc!r}", file=sys.stderr)
                return _status(kernel.returncode)
            ready = [(fd, events) for fd, events in ready if fd != wake_read]
        relay.pass_on(ready)


def _status(returncode: int) -> int:
    """The exit status a shell would give: 128 + N for a kernel killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv))
