"""The host side of a kernel's egress allow-list: an enforcing HTTP(S) forward proxy.

A kernel whose network mode is "allowlist" still has no network interface. The egress
relay inside its sandbox (``relay.py``, run there as ``egress_relay.py``) listens on a
unix socket in the kernel's runtime folder; this proxy keeps a few idle connections open
to it, and a program in the sandbox that takes one speaks HTTP proxy protocol to us::

    program -> relay 127.0.0.1:3128 -> unix socket -> EgressProxy -> allowed host

Everything from the sandbox is untrusted. A request passes only if its host is a DNS
name that the kernel's rules allow on that port, every address the name resolves to is
public (or inside the administrator's private networks) and is the one connected to,
and, for CONNECT, the TLS ClientHello names the same host. Every request yields exactly
one ``Decision``.

A connection carries one request. A plain HTTP request goes upstream with ``Connection:
close`` and exactly the body its framing announces (framing two parsers could read apart
is refused, see ``http1.py``); the response comes back with ``Connection: close`` and the
connection is closed at its end. Whatever the client sends after its request is another
request: it is recorded as denied and never forwarded. After a CONNECT tunnel's TLS
ClientHello is checked, the bytes in the tunnel are opaque, except to a host that one of
the kernel's credentials is bound to: there the proxy ends the kernel's TLS with a
certificate of the kernel's own CA (``ca.py``), opens its own verified TLS connection to
the host, and passes request after request on, each checked to be for that host, its
own decision, with the credential's headers put in place of any the kernel sent.

All kernels share one proxy thread running its own asyncio loop: the server's loop
cannot be used, because synchronous KernelManagers do not run it between calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import ipaddress
import logging
import os
import re
import socket
import ssl
import stat
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from sandbox_kernel.egress.ca import KernelCA, LeafContexts
from sandbox_kernel.egress.credentials import BoundCredential, CredentialTable
from sandbox_kernel.egress.http1 import (
    Framing,
    FramingError,
    chunk_size,
    closing_response_head,
    connection_tokens,
    request_framing,
    response_framing,
    response_keeps_connection,
    response_status,
)
from sandbox_kernel.egress.rules import (
    PORT,
    DomainRule,
    EgressPolicy,
    EgressRules,
    is_domain_name,
    is_ip_literal,
    normalize_host,
    shown,
)
from sandbox_kernel.egress.tls import MAX_CLIENT_HELLO, IncompleteHello, client_hello_sni
from sandbox_kernel.egress.tlsstream import TlsStream
from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.host.background import BackgroundLoop

log = logging.getLogger(__name__)

#: Asks the kernel's holder about a request the policy leaves to them; the future gets
#: ("once" | "kernel" | "deny", who answered or why not). See sandbox_kernel.channels.approval.
Approver = Callable[["ApprovalRequest"], "concurrent.futures.Future[tuple[str, str]]"]
#: Questions one kernel may have open at once; more are denied at once.
MAX_QUESTIONS = 4

#: What ``on_decision`` receives: kernel_id, method, host, port, verdict ("allowed" or
#: "denied"), reason, and address (the IP connected to, or None).
Decision = dict[str, Any]

#: Idle connections kept open to each kernel's relay.
SPARE_CONNECTIONS = 4
MAX_HEAD = 16 * 1024
MAX_RESPONSE_HEAD = 64 * 1024
MAX_CHUNK_LINE = 4 * 1024
HEAD_TIMEOUT = 10.0
CLIENT_HELLO_TIMEOUT = 10.0
IDLE_TIMEOUT = 300.0
#: First and longest pause between attempts to reach a kernel's relay.
DIAL_BACKOFF = (0.1, 2.0)
CALL_TIMEOUT = 5.0
#: After a refusal, what the client still sends is read (this much, this long) and
#: dropped, so that closing with unread data does not reset the connection and lose
#: the answer; a closed connection whose peer stops reading is aborted after the grace.
LINGER_BYTES = 64 * 1024
LINGER_SECONDS = 1.0
CLOSE_GRACE = 10.0
_CHUNK = 64 * 1024
#: The reason recorded for what a client sends after its request on the same connection.
ONE_REQUEST_PER_CONNECTION = (
    "a further request on a connection that carried one already: the egress proxy takes one "
    "request per connection and forwards nothing after it; send it on a new connection"
)

_HTTP_NAME = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_REQUEST_LINE = re.compile(rf"({_HTTP_NAME}) ([\x21-\x7e]+) HTTP/(1\.[01])")
_HEADER_NAME = re.compile(_HTTP_NAME)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
#: Headers replaced (Host, the framing), meant for the proxy, or about the connection.
_DROPPED_HEADERS = frozenset(
    {
        "host",
        "proxy-connection",
        "proxy-authorization",
        "connection",
        "keep-alive",
        "content-length",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
    }
)
_NO_SNI = "no TLS ClientHello with SNI: only TLS may pass a CONNECT tunnel"
_IP_LITERAL = "IP literals are not allowed; use a domain name"

_T = TypeVar("_T")


@dataclass(frozen=True)
class ApprovalRequest:
    """A request of a kernel that waits for its holder's approval."""

    kernel_id: str
    host: str
    port: int
    method: str
    #: Seconds the request waits for an answer (the policy's ``approval_timeout``).
    timeout: float = 60.0

    @property
    def what(self) -> str:
        return f"a connection to {self.host}:{self.port}"


class EgressProxy:
    """The process-wide egress proxy: one daemon thread, its own event loop, every kernel.

    The public methods are thread-safe and block briefly; call them from any thread but
    the proxy's own (``on_decision`` runs there).
    """

    _instance: ClassVar[EgressProxy | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._kernels: dict[str, _KernelEgress] = {}
        self._background = BackgroundLoop("sandbox-kernel-egress")

    @classmethod
    def instance(cls) -> EgressProxy:
        """The shared proxy, started on first use."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _call(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        if threading.current_thread() is self._background.thread:
            coroutine.close()
            msg = "EgressProxy methods cannot be called from the proxy's own thread (e.g. from on_decision)."
            raise RuntimeError(msg)
        return self._background.submit(coroutine).result(CALL_TIMEOUT)

    def add_kernel(
        self,
        kernel_id: str,
        socket_path: Path,
        policy: EgressPolicy,
        on_decision: Callable[[Decision], None],
        ca: KernelCA | None = None,
        credentials: Iterable[BoundCredential] = (),
        approver: Approver | None = None,
    ) -> None:
        """Serve ``kernel_id``: keep idle connections dialed to its relay at
        ``socket_path`` (retrying until the relay is up) and enforce ``policy``; add
        ``credentials`` to its requests to their hosts, ending its TLS there with
        certificates of ``ca`` (which the kernel trusts); ask ``approver`` about requests
        the policy leaves to the kernel's holder (any thread may answer the future).

        A kernel already registered under ``kernel_id`` is removed first.
        ``on_decision`` is called in the proxy thread once per request; what it raises is
        logged and dropped.

        Raises:
            ConfigurationError: credentials without a CA, or two that clash.
            RuntimeError: called from the proxy's own thread.
            concurrent.futures.TimeoutError: the proxy thread did not answer in time.
        """
        table = CredentialTable(credentials)
        if table.names and ca is None:
            msg = "credentials need the kernel's egress CA: without it the proxy cannot add them"
            raise ConfigurationError(msg)
        upstream_tls = None if ca is None else upstream_context(policy.upstream_cafile)
        self._call(
            self._add_kernel(
                kernel_id, Path(socket_path), policy, on_decision, ca, table, approver, upstream_tls
            )
        )

    def bind_credential(self, kernel_id: str, credential: BoundCredential) -> None:
        """Add ``credential`` to ``kernel_id``'s requests from now on (replacing one of
        its name).

        Raises:
            ConfigurationError: the kernel is not served, has no CA, or another
                credential sets one of its headers for the same domains.
        """
        self._call(self._bind_credential(kernel_id, credential))

    def revoke_credential(self, kernel_id: str, name: str) -> bool:
        """Stop adding the credential ``name`` to ``kernel_id``'s requests, open
        connections included; whether it was bound."""
        return self._call(self._revoke_credential(kernel_id, name))

    def approved_domains(self, kernel_id: str) -> tuple[str, ...]:
        """The domains ``kernel_id``'s holder allowed for the kernel ("kernel" answers),
        as patterns; none for a kernel not served. Any thread, the proxy's own too."""
        kernel = self._kernels.get(kernel_id)
        return () if kernel is None else kernel.approved.patterns

    def remove_kernel(self, kernel_id: str) -> None:
        """Stop serving ``kernel_id``: stop dialing and close all its connections, open
        tunnels included. Does nothing for an unknown id.

        Raises:
            RuntimeError: called from the proxy's own thread.
        """
        try:
            self._call(self._remove_kernel(kernel_id))
        except concurrent.futures.TimeoutError:
            log.warning("egress: closing the connections of kernel %s took too long", kernel_id)

    def suspend_kernel(self, kernel_id: str) -> None:
        """Stop dialing ``kernel_id``'s relay and close all its connections, open tunnels
        included (a pause: its sandbox must hold no host socket); its rules, approvals
        and credentials stay. Does nothing for an unknown id.

        Raises:
            RuntimeError: called from the proxy's own thread.
        """
        self._call(self._suspend_kernel(kernel_id, suspended=True))

    def resume_kernel(self, kernel_id: str) -> None:
        """Dial ``kernel_id``'s relay again, after :meth:`suspend_kernel`."""
        self._call(self._suspend_kernel(kernel_id, suspended=False))

    async def _suspend_kernel(self, kernel_id: str, suspended: bool) -> None:
        kernel = self._kernels.get(kernel_id)
        if kernel is not None:
            await kernel.suspend(suspended)

    async def _add_kernel(
        self,
        kernel_id: str,
        socket_path: Path,
        policy: EgressPolicy,
        on_decision: Callable[[Decision], None],
        ca: KernelCA | None,
        credentials: CredentialTable,
        approver: Approver | None,
        upstream_tls: ssl.SSLContext | None,
    ) -> None:
        await self._remove_kernel(kernel_id)
        self._kernels[kernel_id] = _KernelEgress(
            kernel_id, socket_path, policy, on_decision, ca, credentials, approver, upstream_tls
        )

    def _served(self, kernel_id: str) -> _KernelEgress:
        kernel = self._kernels.get(kernel_id)
        if kernel is None:
            msg = f"Kernel {kernel_id} has no egress proxy: its network is not 'allowlist', or it stopped."
            raise ConfigurationError(msg)
        return kernel

    async def _bind_credential(self, kernel_id: str, credential: BoundCredential) -> None:
        kernel = self._served(kernel_id)
        if kernel.leaves is None:
            msg = f"Kernel {kernel_id} has no egress CA: credentials cannot be added to its requests."
            raise ConfigurationError(msg)
        kernel.credentials.bind(credential)

    async def _revoke_credential(self, kernel_id: str, name: str) -> bool:
        kernel = self._kernels.get(kernel_id)
        return kernel is not None and kernel.credentials.revoke(name)

    async def _remove_kernel(self, kernel_id: str) -> None:
        kernel = self._kernels.pop(kernel_id, None)
        if kernel is not None:
            await kernel.close()


def upstream_context(cafile: str | None) -> ssl.SSLContext:
    """How the proxy speaks TLS to a host whose credential it adds: verified (against
    ``cafile``, else the system's CAs), TLS 1.2 or later, HTTP/1.1.

    Raises:
        ConfigurationError: ``cafile`` cannot be read as CA certificates.
    """
    try:
        context = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        msg = f"egress_ca_bundle={cafile!r} cannot be read as CA certificates: {exc}"
        raise ConfigurationError(msg) from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    return context


async def _connect_relay(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to the relay's unix socket. The sandbox controls the socket's folder, so a
    symlink it puts in the socket's place is not followed: the socket file is opened
    without following links, checked, and connected to through /proc/self/fd."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.ENOTSOCK, os.strerror(errno.ENOTSOCK), str(path))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, f"/proc/self/fd/{fd}")
        except BaseException:
            sock.close()
            raise
    finally:
        os.close(fd)
    return await asyncio.open_unix_connection(sock=sock)


def _close(writer: asyncio.StreamWriter, abort: bool = False) -> None:
    """Close a connection; one whose peer stops reading is aborted after CLOSE_GRACE."""
    transport = writer.transport
    if abort:
        transport.abort()
        return
    transport.close()
    asyncio.get_running_loop().call_later(CLOSE_GRACE, transport.abort)


class _KernelEgress:
    """One kernel's pool of connections to its relay, and the requests they carry."""

    def __init__(
        self,
        kernel_id: str,
        socket_path: Path,
        policy: EgressPolicy,
        on_decision: Callable[[Decision], None],
        ca: KernelCA | None = None,
        credentials: CredentialTable | None = None,
        approver: Approver | None = None,
        upstream_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.kernel_id = kernel_id
        self.approver = approver
        #: Domains the holder approved for this kernel ("kernel" answers).
        self.approved = EgressRules()
        self._asking: dict[tuple[str, int], asyncio.Future[tuple[str, str]]] = {}
        self.socket_path = socket_path
        self.policy = policy
        self.on_decision = on_decision
        self.leaves = None if ca is None else LeafContexts(ca)
        self.credentials = credentials or CredentialTable()
        self._upstream_tls = upstream_tls
        self.idle = 0
        self.active = 0
        self.closed = False
        #: Paused: no connection to the relay (see suspend).
        self.suspended = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._exchanges: set[_Exchange] = set()
        self._wanted = asyncio.Event()
        self._dialer = asyncio.get_running_loop().create_task(self._dial_forever())

    def record(self, decision: Decision) -> None:
        log.debug("egress: %s", decision)
        try:
            self.on_decision(decision)
        except Exception:
            log.exception("egress: the decision callback of kernel %s failed", self.kernel_id)

    async def ask(self, host: str, port: int, method: str) -> str:
        """The reason a request outside the kernel's rules may pass: its holder approved.

        Concurrent requests for one destination share one question.

        Raises:
            _Refusal: not approvable by policy, denied, or no answer in time.
        """
        policy = self.policy
        if policy.withheld.allows(host, port):
            raise _Refusal(
                403, f"{shown(host)}:{port} is not in this kernel's allowed domains (its start removed it)"
            )
        if policy.approval != "egress" or self.approver is None or not policy.approvable.allows(host, port):
            raise _Refusal(403, f"{shown(host)}:{port} is not in this kernel's allowed domains")
        key = (host, port)
        asking = self._asking.get(key)
        if asking is None:
            if len(self._asking) >= MAX_QUESTIONS:
                raise _Refusal(403, f"{host}:{port} needs approval, and {MAX_QUESTIONS} questions are open")
            request = ApprovalRequest(self.kernel_id, host, port, method, policy.approval_timeout)
            asking = asyncio.ensure_future(self._ask(request))
            self._asking[key] = asking
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        answer, why = await asyncio.shield(asking)
        if answer == "deny":
            raise _Refusal(403, why)
        return f"approved {why}, {answer}"

    async def _ask(self, request: ApprovalRequest) -> tuple[str, str]:
        if self.approver is None:
            return "deny", f"{request.what} needed approval; nobody can be asked"
        future = self.approver(request)
        timeout = self.policy.approval_timeout
        waiting = asyncio.wrap_future(future)
        try:
            answer, by = await asyncio.wait_for(asyncio.shield(waiting), timeout)
        except asyncio.TimeoutError:
            if not future.cancel():  # answered at the last moment: the answer stands
                answer, by = await waiting
            else:
                waiting.cancel()
                return (
                    "deny",
                    f"{request.what} needed approval; no answer within {timeout:g} s (approval_timeout)",
                )
        except Exception:
            log.exception("egress: asking about %s failed", request.what)
            return "deny", f"{request.what} needed approval; asking failed"
        if answer == "kernel":
            self.approved = EgressRules((*self.approved.rules, DomainRule(request.host, port=request.port)))
        if answer == "deny":
            return "deny", f"{request.what} needed approval and was denied {by}"
        return answer, by

    def intercepts(self, host: str, port: int) -> bool:
        """Whether the proxy ends the kernel's TLS to ``host``:``port`` (to add a credential)."""
        return self.leaves is not None and self.credentials.intercepts(host, port)

    @property
    def upstream_tls(self) -> ssl.SSLContext:
        if self._upstream_tls is None:  # made by add_kernel whenever there is a CA
            msg = "no upstream TLS context: the kernel has no egress CA"
            raise RuntimeError(msg)
        return self._upstream_tls

    def _wants_connection(self) -> bool:
        return (
            not self.suspended
            and self.idle < SPARE_CONNECTIONS
            and self.idle + self.active < self.policy.max_connections
        )

    async def _dial_forever(self) -> None:
        # Besides cancellation, ``closed`` is checked: asyncio.wait_for before Python 3.12
        # can swallow a cancellation that arrives as its inner call completes.
        delay = DIAL_BACKOFF[0]
        while not self.closed:
            if not self._wants_connection():
                self._wanted.clear()
                await self._wanted.wait()
                continue
            try:
                reader, writer = await asyncio.wait_for(
                    _connect_relay(self.socket_path), self.policy.connect_timeout
                )
            except (OSError, asyncio.TimeoutError) as exc:
                log.debug("egress: kernel %s relay not reachable (%s); retrying", self.kernel_id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, DIAL_BACKOFF[1])
                continue
            if self.closed:
                _close(writer, abort=True)
                return
            if self.suspended:  # (paused while it dialed)
                _close(writer, abort=True)
                continue
            delay = DIAL_BACKOFF[0]
            self.idle += 1
            task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        exchange = _Exchange(self, reader, writer)
        self._exchanges.add(exchange)
        idle = True
        first = b""
        try:
            first = await reader.read(_CHUNK)
            self.idle -= 1
            idle = False
            self._wanted.set()
            if first and not self.closed:
                self.active += 1
                try:
                    await exchange.run(first)
                finally:
                    self.active -= 1
        except asyncio.CancelledError:
            if first:
                exchange.decide("denied", "egress for this kernel was stopped")
            exchange.close(abort=True)
            raise
        except (OSError, EOFError, asyncio.TimeoutError) as exc:
            log.debug("egress: a connection of kernel %s failed: %r", self.kernel_id, exc)
            if first:
                exchange.decide("denied", self._why_failed())
        except Exception:
            log.warning("egress: a request of kernel %s failed", self.kernel_id, exc_info=True)
            if first:
                exchange.decide("denied", "internal error in the egress proxy")
        finally:
            if idle:
                self.idle -= 1
            self._wanted.set()
            exchange.close(abort=self.closed)
            self._exchanges.discard(exchange)

    def _why_failed(self) -> str:
        if self.closed:
            return "egress for this kernel was stopped"
        if self.suspended:
            return "the kernel was paused"
        return "the connection failed"

    async def suspend(self, suspended: bool) -> None:
        """Pause (``suspended``): stop dialing, abort every connection and the requests
        they carry, until they have ended. Else dial again."""
        self.suspended = suspended
        self._wanted.set()
        if not suspended:
            return
        for exchange in list(self._exchanges):
            exchange.close(abort=True)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=(CALL_TIMEOUT - 1) / 2)
            for task in pending:  # (e.g. one waiting for an approval)
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=(CALL_TIMEOUT - 1) / 2)

    async def close(self) -> None:
        """Stop dialing, and abort every connection and the requests they carry."""
        self.closed = True
        self._wanted.set()
        for exchange in list(self._exchanges):
            exchange.close(abort=True)
        tasks = [self._dialer, *self._tasks]
        for task in tasks:
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=CALL_TIMEOUT - 1)
        if pending:
            log.warning("egress: %d tasks of kernel %s did not stop", len(pending), self.kernel_id)


class _Source:
    """What one side of a connection sends, after bytes already read from it."""

    def __init__(self, reader: asyncio.StreamReader, data: bytes, on_data: Callable[[], None]) -> None:
        self.reader = reader
        self.buffer = bytearray(data)
        self.on_data = on_data

    async def _fill(self) -> bool:
        chunk = await self.reader.read(_CHUNK)
        if not chunk:
            return False
        self.on_data()
        self.buffer += chunk
        return True

    async def take(self, limit: int = _CHUNK) -> bytes:
        """Up to ``limit`` bytes; b"" once the stream has ended."""
        if not self.buffer and not await self._fill():
            return b""
        data = bytes(self.buffer[:limit])
        del self.buffer[:limit]
        return data

    async def line(self, limit: int) -> bytes:
        """The next line, without its line end (CRLF or LF).

        Raises:
            FramingError: the line is longer than ``limit``.
            EOFError: the stream ended first.
        """
        while (end := self.buffer.find(b"\n")) < 0 and len(self.buffer) <= limit:
            if not await self._fill():
                raise EOFError
        if end < 0 or end > limit:
            msg = f"a line longer than {limit} bytes where a chunk size or trailer was expected"
            raise FramingError(msg)
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        return line[:-1] if line.endswith(b"\r") else line

    async def head(self, limit: int) -> bytes | None:
        """The next message head with its blank line; None if the stream ends first.

        Raises:
            FramingError: the head is larger than ``limit``, or cut off.
        """
        while (end := self.buffer.find(b"\r\n\r\n")) < 0 and len(self.buffer) <= limit:
            if not await self._fill():
                if self.buffer:
                    msg = "the upstream closed the connection inside a response head"
                    raise FramingError(msg)
                return None
        if end < 0 or end + 4 > limit:
            msg = f"a response head larger than {limit // 1024} KiB"
            raise FramingError(msg)
        head = bytes(self.buffer[: end + 4])
        del self.buffer[: end + 4]
        return head


async def _copy_body(source: _Source, framing: Framing, write: Callable[[bytes], Awaitable[None]]) -> None:
    """Copy one message body as ``framing`` delimits it, and nothing after it. A chunked
    body is passed on re-framed, without extensions or trailers, so that what receives it
    cannot read its end anywhere else.

    Raises:
        FramingError: a malformed chunked body.
        EOFError: the stream ended inside the body (not for ``close`` framing).
    """
    if framing.kind == "close":
        while data := await source.take():
            await write(data)
        return
    if framing.kind == "length":
        await _copy_exactly(source, framing.length, write)
        return
    if framing.kind != "chunked":
        return
    while size := chunk_size(await source.line(MAX_CHUNK_LINE)):
        await write(b"%x\r\n" % size)
        await _copy_exactly(source, size, write)
        if await source.line(2) != b"":
            msg = "a chunk is longer than its size says"
            raise FramingError(msg)
        await write(b"\r\n")
    trailer = 0
    while line := await source.line(MAX_HEAD):
        trailer += len(line) + 2
        if trailer > MAX_HEAD:
            msg = f"a chunked body's trailer larger than {MAX_HEAD // 1024} KiB"
            raise FramingError(msg)
    await write(b"0\r\n\r\n")


async def _copy_exactly(source: _Source, count: int, write: Callable[[bytes], Awaitable[None]]) -> None:
    while count:
        data = await source.take(min(count, _CHUNK))
        if not data:
            raise EOFError
        count -= len(data)
        await write(data)


def _absolute_http(target: str) -> tuple[str, str] | None:
    """(authority, path) of an absolute ``http://`` URL; None for any other target."""
    if target[:7].lower() != "http://":
        return None
    remainder = target[7:]
    cut = min((i for i in (remainder.find(c) for c in "/?#") if i >= 0), default=len(remainder))
    return remainder[:cut], remainder[cut:].split("#", 1)[0]


class _Refusal(Exception):
    """Refuse the request with an HTTP error, and record it as denied."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Exchange:
    """One request from the sandbox: its checks, its one decision, its two connections."""

    def __init__(
        self, kernel: _KernelEgress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.kernel = kernel
        self.policy = kernel.policy
        self.reader = reader
        self.writer = writer
        self.upstream: asyncio.StreamWriter | None = None
        self.method = ""
        self.host = ""
        self.port: int | None = None
        self.address: str | None = None
        #: Why the destination may be reached (an allowed pattern, the holder's approval).
        self.why = ""
        #: Inside an intercepted tunnel: whether the upstream keeps the connection open
        #: after this request's response.
        self.keeps = False
        self.decided = False
        # Set once the upstream's final response has begun: no request byte follows it.
        self.answered = False
        self.last_data = 0.0

    def decide(self, verdict: str, reason: str) -> None:
        """Record the request's verdict; only the first call counts."""
        if self.decided:
            return
        self.decided = True
        self.kernel.record(
            {
                "kernel_id": self.kernel.kernel_id,
                "method": shown(self.method, 32),
                "host": shown(self.host, 255),
                "port": self.port,
                "verdict": verdict,
                "reason": shown(reason, 400),
                "address": self.address,
            }
        )

    def close(self, abort: bool = False) -> None:
        for writer in (self.writer, self.upstream):
            if writer is not None:
                _close(writer, abort)

    async def run(self, first: bytes) -> None:
        try:
            await self._handle(first)
        except _Refusal as refusal:
            await self._refuse(refusal.status, refusal.reason)

    async def _refuse(self, status: int, reason: str) -> None:
        self.decide("denied", reason)
        prefix = "sandbox-kernel egress denied" if status < 500 else "sandbox-kernel egress failed"
        phrase = shown(f"{prefix}: {reason}", 400)
        body = f"{phrase}\n".encode("ascii")
        head = (
            f"HTTP/1.1 {status} {phrase}\r\n"
            "Content-Type: text/plain; charset=us-ascii\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        self.writer.write(head.encode("ascii") + body)
        await self._linger()

    async def _linger(self) -> None:
        if self.writer.can_write_eof() and not self.writer.is_closing():
            self.writer.write_eof()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER_SECONDS
        left = LINGER_BYTES
        with contextlib.suppress(asyncio.TimeoutError):
            while left > 0 and loop.time() < deadline:
                data = await asyncio.wait_for(self.reader.read(min(_CHUNK, left)), deadline - loop.time())
                if not data:
                    break
                left -= len(data)

    async def _handle(self, first: bytes) -> None:
        try:
            head, rest = await asyncio.wait_for(self._read_head(first), HEAD_TIMEOUT)
        except asyncio.TimeoutError:
            self.decide("denied", f"the request head did not arrive within {HEAD_TIMEOUT:g} s")
            return
        except EOFError:
            self.decide("denied", "the connection closed before the request head was complete")
            return
        method, target, version, headers = self._parse(head)
        if method == "CONNECT":
            await self._connect(target, rest)
        else:
            await self._forward(method, target, version, headers, rest)

    async def _read_head(self, first: bytes) -> tuple[bytes, bytes]:
        data = bytearray(first)
        while True:
            end = data.find(b"\r\n\r\n")
            if 0 <= end <= MAX_HEAD - 4:
                return bytes(data[: end + 4]), bytes(data[end + 4 :])
            if end >= 0 or len(data) >= MAX_HEAD:
                raise _Refusal(431, f"the request head is larger than {MAX_HEAD // 1024} KiB")
            chunk = await self.reader.read(MAX_HEAD)
            if not chunk:
                raise EOFError
            data += chunk

    def _parse(self, head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
        lines = head[:-4].decode("latin-1").split("\r\n")
        request = _REQUEST_LINE.fullmatch(lines[0])
        if request is None:
            raise _Refusal(400, f"not an HTTP/1.x proxy request: '{shown(lines[0], 60)}'")
        method, target, version = request.groups()
        self.method = method
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not _HEADER_NAME.fullmatch(name) or _CONTROL.search(value):
                raise _Refusal(400, f"malformed header line: '{shown(line, 60)}'")
            headers.append((name, value.strip(" \t")))
        return method, target, version, headers

    def _set_destination(self, authority: str, default_port: int | None) -> tuple[str, int]:
        """Split ``host[:port]``, keeping both for the decision.

        Raises:
            _Refusal: an IP literal (403), or a malformed host or port (400).
        """
        if authority.startswith("["):
            host, _, after = authority[1:].partition("]")
            port_text = after[1:] if after.startswith(":") else after
        elif authority.count(":") == 1:
            host, _, port_text = authority.partition(":")
        else:
            host, port_text = authority, ""
        self.host = normalize_host(host)
        if not port_text and default_port is not None and not authority.endswith(":"):
            self.port = default_port
        elif PORT.fullmatch(port_text) and 1 <= int(port_text) <= 65535:
            self.port = int(port_text)
        if authority.startswith("[") or is_ip_literal(self.host):
            raise _Refusal(403, _IP_LITERAL)
        if self.port is None:
            raise _Refusal(400, f"'{shown(authority)}' does not end with a port from 1 to 65535")
        if not is_domain_name(self.host):
            raise _Refusal(400, f"'{shown(self.host)}' is not a valid host name")
        return self.host, self.port

    async def _open_upstream(
        self, host: str, port: int, tls: ssl.SSLContext | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        """Check the destination against the policy (asking the kernel's holder, where
        it leaves the request to them), resolve it, and connect (over ``tls``, verifying
        the host's certificate, if given); the reader, the writer and why it may pass.

        Raises:
            _Refusal: not allowed (403), or cannot be resolved or reached (502).
        """
        rule = self.policy.rules.match(host, port) or self.kernel.approved.match(host, port)
        why = f"allowed by '{rule.pattern}'" if rule else await self.kernel.ask(host, port, self.method)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.connect_timeout
        mapped = self.policy.mapped_address(host)
        if mapped is not None:
            addresses = [mapped]
        else:
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP),
                    self.policy.connect_timeout,
                )
            except (OSError, asyncio.TimeoutError) as exc:
                raise _Refusal(502, f"cannot resolve {host}: {str(exc) or 'timed out'}") from None
            addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
        for address in addresses:
            if not self.policy.permits_address(address):
                raise _Refusal(403, f"{host} resolves to a non-public address {address}")
        failure = "no address"
        for address in addresses:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        str(address), port, ssl=tls, server_hostname=host if tls is not None else None
                    ),
                    max(deadline - loop.time(), 0.001),
                )
            except (OSError, asyncio.TimeoutError) as exc:
                failure = str(exc) or "timed out"
                continue
            self.upstream = writer
            self.address = str(address)
            if self.kernel.closed:
                raise asyncio.CancelledError
            return reader, writer, why
        raise _Refusal(502, f"cannot connect to {host}:{port}: {failure}")

    async def _connect(self, target: str, rest: bytes) -> None:
        host, port = self._set_destination(target, default_port=None)
        intercept = self.kernel.intercepts(host, port)
        names = ""
        if intercept:
            live, ended = self.kernel.credentials.lookup(host, port)
            if not live:
                raise _Refusal(403, f"{'; '.join(ended)}; nothing was sent")
            names = ", ".join(f"'{credential.name}'" for credential in live)
        upstream_reader, upstream_writer, why = await self._open_upstream(
            host, port, self.kernel.upstream_tls if intercept else None
        )
        self.writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await self.writer.drain()
        try:
            hello, sni = await asyncio.wait_for(self._read_client_hello(rest), CLIENT_HELLO_TIMEOUT)
        except asyncio.TimeoutError:
            self.decide("denied", f"{_NO_SNI} (none within {CLIENT_HELLO_TIMEOUT:g} s)")
            return
        if sni is None:
            self.decide("denied", _NO_SNI)
            return
        if normalize_host(sni) != self.host:
            self.decide("denied", f"TLS SNI '{shown(sni)}' does not match the requested host '{self.host}'")
            return
        if intercept and self.kernel.leaves is not None:
            self.why = why
            self.decide("allowed", f"{why}; TLS ends at the proxy, for credentials {names}")
            context = await asyncio.to_thread(self.kernel.leaves.get, host)  # key and signature: ~20 ms
            client = TlsStream(self.reader, self.writer, context, hello)
            await self._serve_intercepted(client, upstream_reader, upstream_writer)
            return
        self.decide("allowed", why)
        upstream_writer.write(hello)
        await self._splice(
            self._pump(self.reader, upstream_writer),
            self._pump(upstream_reader, self.writer),
            until_download_done=False,
        )

    async def _serve_intercepted(
        self, tls: TlsStream, upstream_reader: asyncio.StreamReader, upstream_writer: asyncio.StreamWriter
    ) -> None:
        """Pass the requests of a tunnel whose TLS ends here on, one after another, each
        with its own decision, until either side closes or a request is refused."""
        try:
            await asyncio.wait_for(tls.handshake(), CLIENT_HELLO_TIMEOUT)
        except (ssl.SSLError, EOFError, asyncio.TimeoutError) as exc:
            log.debug("egress: kernel %s TLS to %s not set up: %r", self.kernel.kernel_id, self.host, exc)
            return
        client = _Source(tls, b"", self._active)  # type: ignore[arg-type]
        upstream = _Source(upstream_reader, b"", self._active)
        try:
            while not self.kernel.closed:
                request = _Exchange(self.kernel, tls, tls)  # type: ignore[arg-type]
                request.host, request.port, request.address = self.host, self.port, self.address
                request.why = self.why
                client.on_data = upstream.on_data = request._active  # its idle clock
                try:
                    if not await request._pass_intercepted(client, upstream, upstream_writer):
                        return
                except _Refusal as refusal:
                    await request._refuse(refusal.status, refusal.reason)
                    return
                except (OSError, EOFError, FramingError) as exc:
                    request.decide("denied", f"the connection failed: {exc}")
                    return
        finally:
            if tls.can_write_eof():  # TLS's own end (close_notify): the response is whole
                tls.write_eof()

    async def _pass_intercepted(
        self, client: _Source, upstream: _Source, upstream_writer: asyncio.StreamWriter
    ) -> bool:
        """Pass one request inside an intercepted tunnel on, with the credentials for its
        host, and its response back; whether the connection carries another.

        Raises:
            _Refusal: a request the credentials must not go with, or none is live.
        """
        try:
            head = await asyncio.wait_for(client.head(MAX_HEAD), IDLE_TIMEOUT)
        except asyncio.TimeoutError:
            return False
        except FramingError:
            raise _Refusal(431, f"the request head is larger than {MAX_HEAD // 1024} KiB") from None
        if head is None:
            return False
        method, target, version, headers = self._parse(head)
        path = self._pinned_path(target, headers)
        if method == "CONNECT" or any(name.lower() == "upgrade" for name, _ in headers):
            raise _Refusal(400, "a tunnel or protocol upgrade inside a tunnel that carries a credential")
        live, ended = self.kernel.credentials.lookup(self.host, self.port or 443)
        if not live:
            raise _Refusal(403, f"{'; '.join(ended) or 'no credential applies'}; the request was not sent")
        if method.upper() in ("TRACE", "TRACK"):
            raise _Refusal(405, f"{method} would show the credential to the kernel; the request was not sent")
        try:
            framing = request_framing(version, headers)
        except FramingError as exc:
            raise _Refusal(400, str(exc)) from None
        replaced = {name.lower() for credential in live for name in credential.header_names}
        hop = connection_tokens(headers) | _DROPPED_HEADERS | replaced
        closing = "close" in connection_tokens(headers) or version == "1.0"
        authority = self.host if self.port == 443 else f"{self.host}:{self.port}"
        lines = [f"{method} {path} HTTP/1.1", f"Host: {authority}"]
        lines += [f"{name}: {value}" for name, value in headers if name.lower() not in hop]
        lines += [f"{name}: {value.reveal()}" for credential in live for name, value in credential.headers]
        if framing.kind == "length":
            lines.append(f"Content-Length: {framing.length}")
        elif framing.kind == "chunked":
            lines.append("Transfer-Encoding: chunked")
        if closing:
            lines.append("Connection: close")
        names = ", ".join(f"'{credential.name}'" for credential in live)
        self.decide("allowed", f"{self.why}; credential {names} added")
        upstream_writer.write("\r\n".join([*lines, "", ""]).encode("latin-1"))

        async def send(data: bytes) -> None:
            if not self.answered:
                upstream_writer.write(data)
                await upstream_writer.drain()

        sent = False
        self.keeps = False

        async def upload() -> None:
            nonlocal sent
            await _copy_body(client, framing, send)
            sent = True

        async def download() -> None:
            self.keeps = await self._pass_response(upstream, method, closing)

        # As a tunnel: cut after IDLE_TIMEOUT without data, or when either side fails. A
        # response that came before the whole body was sent leaves its end unknown: the
        # connection ends with it.
        await self._splice(upload(), download(), until_download_done=True)
        return self.keeps and sent and not closing

    async def _pass_response(self, upstream: _Source, method: str, closing: bool) -> bool:
        """Pass on the upstream's interim responses and its final one; whether the
        upstream keeps the connection open after it."""
        while True:
            head = await upstream.head(MAX_RESPONSE_HEAD)
            if head is None:
                raise EOFError
            status = response_status(head)
            if not 100 <= status < 200 or status == 101:
                break
            self.writer.write(head)
            await self.writer.drain()
        self.answered = True
        framing = response_framing(method, status, head)
        keeps = framing.kind != "close" and status != 101 and response_keeps_connection(head)
        self.writer.write(head if keeps and not closing else closing_response_head(head))

        async def write(data: bytes) -> None:
            self.writer.write(data)
            await self.writer.drain()

        await _copy_body(upstream, framing, write)
        await self.writer.drain()
        return keeps

    def _pinned_path(self, target: str, headers: list[tuple[str, str]]) -> str:
        """The path of a request inside an intercepted tunnel, which must name the
        tunnel's host and no other: a credential goes to its host only.

        Raises:
            _Refusal: the request names another host (421), or no path (400).
        """
        authorities = [value for name, value in headers if name.lower() == "host"]
        if target.lower().startswith("https://"):
            rest = target[8:]
            cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
            authorities.append(rest[:cut])
            target = rest[cut:]
            target = target if target.startswith("/") else f"/{target}"
        elif not target.startswith("/"):
            raise _Refusal(400, f"'{shown(target, 60)}' is not a path on {self.host}")
        for authority in authorities or [""]:
            host, _, port = authority.partition(":")
            if normalize_host(host) != self.host or port not in ("", str(self.port)):
                raise _Refusal(
                    421,
                    f"the request names '{shown(authority)}' inside a tunnel to {self.host}:{self.port}; "
                    f"its credential goes to {self.host} only",
                )
        return target

    async def _read_client_hello(self, rest: bytes) -> tuple[bytes, str | None]:
        data = bytearray(rest)
        while True:
            try:
                return bytes(data), client_hello_sni(bytes(data))
            except IncompleteHello:
                pass
            except ValueError:
                return bytes(data), None
            if len(data) >= MAX_CLIENT_HELLO:
                return bytes(data), None
            chunk = await self.reader.read(MAX_CLIENT_HELLO - len(data))
            if not chunk:
                return bytes(data), None
            data += chunk

    async def _forward(
        self, method: str, target: str, version: str, headers: list[tuple[str, str]], rest: bytes
    ) -> None:
        url = _absolute_http(target)
        if url is None:
            if "://" in target:
                scheme = shown(target.split("://", 1)[0], 20)
                raise _Refusal(400, f"only http:// URLs are proxied without CONNECT, not {scheme}://")
            raise _Refusal(400, "not a proxy request: use an absolute http:// URL or CONNECT")
        authority, path = url
        if "@" in authority:
            raise _Refusal(400, "user names and passwords in the URL are not supported")
        host, port = self._set_destination(authority, default_port=80)
        try:
            framing = request_framing(version, headers)
        except FramingError as exc:
            raise _Refusal(400, str(exc)) from None
        upstream_reader, upstream_writer, why = await self._open_upstream(host, port)
        host_header = host if port == 80 else f"{host}:{port}"
        lines = [
            f"{method} {path if path.startswith('/') else '/' + path} HTTP/{version}",
            f"Host: {host_header}",
        ]
        lines += [f"{name}: {value}" for name, value in headers if name.lower() not in _DROPPED_HEADERS]
        if framing.kind == "length":
            lines.append(f"Content-Length: {framing.length}")
        elif framing.kind == "chunked":
            lines.append("Transfer-Encoding: chunked")
        lines += ["Connection: close", "", ""]
        self.decide("allowed", why)
        upstream_writer.write("\r\n".join(lines).encode("latin-1"))
        await self._splice(
            self._send_body(_Source(self.reader, rest, self._active), framing, upstream_writer),
            self._relay_response(_Source(upstream_reader, b"", self._active), method),
            until_download_done=True,
        )

    async def _send_body(self, client: _Source, framing: Framing, upstream: asyncio.StreamWriter) -> None:
        """Pass on the request's body, until the upstream answers; then record what the
        client sends after it as a request of its own, denied."""

        async def write(data: bytes) -> None:
            # An upstream that answered without reading the body, and reads on, would
            # take the rest of it for a request: drop it instead.
            if not self.answered:
                upstream.write(data)
                await upstream.drain()

        try:
            await _copy_body(client, framing, write)
        except EOFError:
            pass
        else:
            await self._refuse_further_requests(client)
        if upstream.can_write_eof() and not upstream.is_closing():
            upstream.write_eof()

    async def _refuse_further_requests(self, client: _Source) -> None:
        """Read what the client sends after its request (at most LINGER_BYTES) and record
        it, once, as a denied request; nothing of it is forwarded."""
        further = bytearray()
        recorded = False
        try:
            while len(further) < LINGER_BYTES and (data := await client.take()):
                further += data
                head = further.lstrip(b"\r\n")
                if not recorded and (b"\r\n\r\n" in head or b"\n\n" in head or len(head) >= MAX_HEAD):
                    recorded = True
                    self._record_further(bytes(head))
        finally:
            head = further.lstrip(b"\r\n")
            if head and not recorded:
                self._record_further(bytes(head))

    def _record_further(self, data: bytes) -> None:
        further = _Exchange(self.kernel, self.reader, self.writer)
        lines = data[:MAX_HEAD].split(b"\n\n", 1)[0].replace(b"\r\n", b"\n").decode("latin-1").split("\n")
        request = _REQUEST_LINE.fullmatch(lines[0])
        if request is not None:
            further.method, target, _ = request.groups()
            url = _absolute_http(target)
            if further.method == "CONNECT":
                authority, default_port = target, None
            elif url is not None:
                authority, default_port = url[0], 80
            else:
                hosts = [v for n, _, v in (line.partition(":") for line in lines[1:]) if n.lower() == "host"]
                authority, default_port = (hosts[0].strip(" \t") if hosts else ""), 80
            with contextlib.suppress(_Refusal):
                further._set_destination(authority, default_port)
        further.decide("denied", ONE_REQUEST_PER_CONNECTION)

    async def _relay_response(self, upstream: _Source, method: str) -> None:
        """Pass on the upstream's interim responses, then its final one telling the client
        that the connection closes after it; return at its end."""
        while True:
            head = await upstream.head(MAX_RESPONSE_HEAD)
            if head is None:
                return
            status = response_status(head)
            if status == 101 or not 100 <= status < 200:
                break
            self.writer.write(head)
            await self.writer.drain()
        self.answered = True
        self.writer.write(head if status == 101 else closing_response_head(head))

        async def write(data: bytes) -> None:
            self.writer.write(data)
            await self.writer.drain()

        with contextlib.suppress(EOFError):
            await _copy_body(upstream, response_framing(method, status, head), write)
        await self.writer.drain()

    def _active(self) -> None:
        self.last_data = asyncio.get_running_loop().time()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy bytes until the end, then pass on the half-close."""
        while data := await reader.read(_CHUNK):
            self._active()
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()

    async def _splice(
        self,
        upload_copy: Coroutine[Any, Any, None],
        download_copy: Coroutine[Any, Any, None],
        until_download_done: bool,
    ) -> None:
        """Run both copies until both are done (or only the download, for plain HTTP),
        one fails, or IDLE_TIMEOUT passes without data."""
        loop = asyncio.get_running_loop()
        self._active()
        upload = loop.create_task(upload_copy)
        download = loop.create_task(download_copy)
        needed = {download} if until_download_done else {upload, download}
        try:
            while not all(task.done() for task in needed):
                pending = {task for task in (upload, download) if not task.done()}
                timeout = self.last_data + IDLE_TIMEOUT - loop.time()
                if timeout <= 0:
                    log.debug(
                        "egress: kernel %s tunnel to %s idle; closing", self.kernel.kernel_id, self.host
                    )
                    return
                done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                failures = [task.exception() for task in done if task.exception() is not None]
                if failures:
                    log.debug(
                        "egress: kernel %s exchange with %s cut: %r",
                        self.kernel.kernel_id,
                        self.host,
                        failures[0],
                    )
                    return
        finally:
            for task in (upload, download):
                task.cancel()
            await asyncio.gather(upload, download, return_exceptions=True)
