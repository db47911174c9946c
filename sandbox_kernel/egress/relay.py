"""Egress relay run inside the sandbox: lends the host proxy's connections to the kernel.

The sandbox has no network, and it may create host unix sockets but not connect to
them, so the host connects in: it keeps a few idle connections open to the relay's unix
socket. A program in the sandbox connects to the relay's TCP port on 127.0.0.1 (its
HTTP(S)_PROXY); the relay hands it one idle host connection and copies bytes both ways.

The relay is untrusted (kernel code can kill or replace it) and enforces nothing: the
host proxy decides what may pass. It is copied into the image and run by the image's
python, so it uses the standard library only and runs on Python 3.9.

Usage::

    python egress_relay.py SOCKET_PATH PORT [--ca CA_FILE] [-- CMD [ARGS...]]

Both sockets are bound first, so a failure is reported (non-zero exit, message on
stderr) before the kernel starts. With ``-- CMD`` the relay becomes a daemon and this
process execs ``CMD``; without it the relay runs in the foreground and prints its TCP
port on stdout once both sockets listen.

A pause (the kernel's sandbox saved to disk, which gVisor refuses while it holds a host
socket) goes through the daemon's signals: ``SIGUSR1`` closes the unix socket and every
host connection, idle or lent (a client whose request was under way sees its connection
close); ``SIGUSR2`` binds the unix socket again, and the host proxy dials in anew. The
daemon's pid is in ``SANDBOX_KERNEL_EGRESS_RELAY_PID`` for ``CMD`` (the channel relay,
which the host signals, passes both on).

``--ca`` names the kernel's egress CA certificate (the host proxy ends the kernel's TLS
with it for the domains whose credentials it adds): ``CMD`` then trusts it besides what
it trusted, through a bundle of both in ``BUNDLE`` that the usual variables name
(OpenSSL and Python's ssl, requests, curl, pip; node's takes the CA alone).
"""

from __future__ import annotations

import asyncio
import collections
import os
import selectors
import signal
import socket
import stat
import sys

#: How long a client waits for an idle host connection before it gets a 503.
HOST_WAIT = 5.0
#: At most this many idle host connections are kept; older ones are closed.
MAX_IDLE = 64
CHUNK = 64 * 1024
#: Before closing on a client, read what it still sends (at most this much, this long)
#: so that closing with unread data does not reset the connection and lose the answer.
LINGER_BYTES = 64 * 1024
LINGER_SECONDS = 1.0
UNAVAILABLE = (
    b"HTTP/1.1 503 sandbox-kernel egress proxy unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)
USAGE = "usage: egress_relay.py SOCKET_PATH PORT [--ca CA_FILE] [-- CMD [ARGS...]]"
#: Where the trusted CAs plus the kernel's egress CA are written for ``CMD``.
BUNDLE = "/tmp/.sandbox-kernel-ca.pem"  # noqa: S108 (the sandbox's own /tmp)
#: The variables that name the CAs TLS clients trust; the first files they name are kept.
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT")


#: Where the daemon's pid is passed to ``CMD``, to pass the pause signals on.
PID_VARIABLE = "SANDBOX_KERNEL_EGRESS_RELAY_PID"


def bind(socket_path: str, port: int) -> tuple[socket.socket, socket.socket]:
    """Listen on TCP 127.0.0.1:``port`` and on the unix socket ``socket_path``.

    Raises:
        OSError: a socket cannot be bound.
    """
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(("127.0.0.1", port))
        tcp.listen(128)
        unix = bind_unix(socket_path)
    except OSError:
        tcp.close()
        raise
    return tcp, unix


def bind_unix(socket_path: str) -> socket.socket:
    """Listen on the unix socket ``socket_path``; a socket file left there by an earlier
    relay (or before a pause) is replaced.

    Raises:
        OSError: it cannot be bound.
    """
    try:
        if stat.S_ISSOCK(os.lstat(socket_path).st_mode):
            os.unlink(socket_path)
    except FileNotFoundError:
        pass
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The host side connects, possibly as another user than the kernel's: 0666 by the
    # umask, as the file appears (the host may seal the folder as soon as it exists).
    previous = os.umask(0o111)
    try:
        unix.bind(socket_path)
        unix.listen(64)
    except OSError:
        unix.close()
        raise
    finally:
        os.umask(previous)
    return unix


def _alive(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bool:
    reader, writer = connection
    # The transport reads eagerly, so a host that hung up shows as EOF even unread.
    return not reader.at_eof() and not writer.is_closing()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        data = await reader.read(CHUNK)
        if not data:
            break
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof() and not writer.is_closing():
        writer.write_eof()


async def splice(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Copy bytes both ways until both sides are done; an error on either closes both."""
    tasks = [
        asyncio.ensure_future(_pump(a_reader, b_writer)),
        asyncio.ensure_future(_pump(b_reader, a_writer)),
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        a_writer.close()
        b_writer.close()


async def linger_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close ``writer``, drain what the peer still sends (bounded), then close."""
    try:
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER_SECONDS
        left = LINGER_BYTES
        while left > 0:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            read = asyncio.ensure_future(reader.read(min(CHUNK, left)))
            done, _ = await asyncio.wait({read}, timeout=remaining)
            if not done:
                read.cancel()
                break
            data = read.result()
            if not data:
                break
            left -= len(data)
    except OSError:
        pass
    finally:
        writer.close()


class Relay:
    """Pairs each sandbox client with one idle connection from the host proxy."""

    def __init__(self) -> None:
        self.idle: collections.deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = collections.deque()
        self.waiters: collections.deque[asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
        self.waiters = collections.deque()
        #: Host connections lent to clients, until their exchange ends.
        self.lent: set[asyncio.StreamWriter] = set()
        #: False while paused: a host connection accepted just before is closed at once.
        self.accepting = True

    def drop_host(self) -> None:
        """Close every host connection, idle or lent (for a pause)."""
        self.accepting = False
        while self.idle:
            self.idle.popleft()[1].transport.abort()
        for writer in list(self.lent):
            writer.transport.abort()

    async def host_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.accepting:
            writer.transport.abort()
            return
        for connection in [c for c in self.idle if not _alive(c)]:
            self.idle.remove(connection)
            connection[1].close()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.lent.add(writer)  # from now: its client's, until the exchange ends
                waiter.set_result((reader, writer))
                return
        self.idle.append((reader, writer))
        while len(self.idle) > MAX_IDLE:
            self.idle.popleft()[1].close()

    async def take_host(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The newest live idle host connection, waiting up to HOST_WAIT for one."""
        while self.idle:
            connection = self.idle.pop()
            if _alive(connection):
                return connection
            connection[1].close()
        waiter: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        await asyncio.wait({waiter}, timeout=HOST_WAIT)
        if waiter.done():
            connection = waiter.result()
            if not self.accepting:  # (let go meanwhile: closed)
                self.lent.discard(connection[1])
                return None
            return connection
        waiter.cancel()
        self.waiters.remove(waiter)
        return None

    async def client_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            host = await self.take_host()
            if host is None:
                writer.write(UNAVAILABLE)
                await writer.drain()
                await linger_close(reader, writer)
                return
            self.lent.add(host[1])
            try:
                await splice(reader, writer, *host)
            finally:
                self.lent.discard(host[1])
        except OSError:
            pass
        except Exception as exc:  # noqa: BLE001 - one broken connection must never stop the relay
            print(f"egress relay: connection failed: {exc!r}", file=sys.stderr)
        finally:
            writer.close()


async def serve(tcp: socket.socket, unix: socket.socket) -> None:
    """Run the relay on the two bound sockets, forever; ``SIGUSR1`` lets go of the host
    (the unix socket and its connections), ``SIGUSR2`` binds the unix socket again."""
    relay = Relay()
    socket_path = unix.getsockname()
    loop = asyncio.get_running_loop()
    host_server: asyncio.AbstractServer | None
    host_server = await asyncio.start_unix_server(relay.host_connected, sock=unix)
    rebinding: set[asyncio.Task[None]] = set()

    def let_go() -> None:
        nonlocal host_server
        if host_server is not None:
            host_server.close()
            host_server = None
            try:
                os.unlink(socket_path)
            except OSError:
                pass  # (the host's folder, taken back: the host removes it)
        relay.drop_host()

    def bind_again() -> None:
        task = loop.create_task(rebind())
        rebinding.add(task)
        task.add_done_callback(rebinding.discard)

    one_at_a_time = asyncio.Lock()

    async def rebind() -> None:
        nonlocal host_server
        async with one_at_a_time:
            let_go()
            relay.accepting = True
            try:
                listener = bind_unix(socket_path)
                host_server = await asyncio.start_unix_server(relay.host_connected, sock=listener)
            except OSError as exc:  # the host waits for the socket, and says it never came
                print(f"egress relay: cannot bind {socket_path} again: {exc}", file=sys.stderr)

    loop.add_signal_handler(signal.SIGUSR1, let_go)
    loop.add_signal_handler(signal.SIGUSR2, bind_again)
    client_server = await asyncio.start_server(relay.client_connected, sock=tcp)
    async with client_server:
        await client_server.serve_forever()


def daemonize() -> int:
    """Double-fork; 0 in the daemon, the daemon's pid in the original process once the
    intermediate child is gone."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child:
        os.close(write_end)
        os.waitpid(child, 0)
        with os.fdopen(read_end, "rb") as pipe:
            said = pipe.read()
        return int(said) if said.isdigit() else -1
    os.close(read_end)
    os.setsid()
    daemon = os.fork()
    if daemon:
        os.write(write_end, str(daemon).encode())
        os._exit(0)
    os.close(write_end)
    for ignored in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):  # (until serve's)
        signal.signal(ignored, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    # The exec'd kernel owns stdout; stderr stays for the relay's errors.
    os.dup2(devnull, 1)
    os.close(devnull)
    return 0


def trust(ca_file: str, bundle: str = BUNDLE) -> None:
    """Have this process's children trust ``ca_file`` besides the CAs they trusted: the
    files the CA variables name, else the system's bundle.

    Raises:
        OSError: the CA or the bundle could not be read or written.
    """
    import ssl

    with open(ca_file, "rb") as f:
        ca = f.read()
    sources = [os.environ[name] for name in CA_VARIABLES if os.path.isfile(os.environ.get(name, ""))]
    if not sources:
        defaults = ssl.get_default_verify_paths()
        sources = [p for p in (defaults.cafile, defaults.openssl_cafile) if p and os.path.isfile(p)][:1]
    parts = []
    for source in dict.fromkeys(sources):
        with open(source, "rb") as f:
            parts.append(f.read().rstrip(b"\n") + b"\n")
    fd = os.open(bundle, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(b"".join(parts) + ca)
    os.environ.update(dict.fromkeys(CA_VARIABLES, bundle))
    os.environ["NODE_EXTRA_CA_CERTS"] = ca_file


class PollingEventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """Event loops that wait with poll(2): an epoll set can come back from a restore
    holding a connection closed before the pause, ready for ever, and the loop would spin
    (runsc before 2026-04; see the kernel's kernel_app.py)."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(selectors.PollSelector())


def main(argv: list[str]) -> int:
    args = argv[1:]
    command: list[str] = []
    if "--" in args:
        split = args.index("--")
        args, command = args[:split], args[split + 1 :]
        if not command:
            print(f"egress relay: no command after '--'\n{USAGE}", file=sys.stderr)
            return 2
    ca_file = None
    if "--ca" in args:
        at = args.index("--ca")
        if at + 1 >= len(args):
            print(USAGE, file=sys.stderr)
            return 2
        ca_file = args[at + 1]
        del args[at : at + 2]
    if len(args) != 2 or not args[1].isdigit() or not 0 <= int(args[1]) <= 65535:
        print(USAGE, file=sys.stderr)
        return 2
    socket_path, port = args[0], int(args[1])
    asyncio.set_event_loop_policy(PollingEventLoopPolicy())
    try:
        tcp, unix = bind(socket_path, port)
    except OSError as exc:
        print(f"egress relay: cannot listen on 127.0.0.1:{port} and {socket_path}: {exc}", file=sys.stderr)
        return 1
    if ca_file is not None:
        try:
            trust(ca_file)
        except OSError as exc:
            print(f"egress relay: cannot trust the kernel's egress CA {ca_file}: {exc}", file=sys.stderr)
            return 1
    if not command:
        print(tcp.getsockname()[1], flush=True)
        try:
            asyncio.run(serve(tcp, unix))
        except KeyboardInterrupt:
            pass
        return 0
    daemon = daemonize()
    if daemon == 0:
        asyncio.run(serve(tcp, unix))
        return 0
    tcp.close()
    unix.close()
    os.environ[PID_VARIABLE] = str(daemon)
    try:
        os.execvp(command[0], command)  # noqa: S606
    except OSError as exc:
        print(f"egress relay: cannot run {command[0]!r}: {exc}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
