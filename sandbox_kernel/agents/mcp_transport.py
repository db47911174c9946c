"""The MCP server's stdio channel, with a bound on each message it reads.

MCP over stdio is one JSON-RPC message a line, and the ``mcp`` package reads each line
whole before looking at it: one ``upload_file`` of 256 MiB took the server from 92 to
1,665 MiB. Here stdin is read in pieces (:class:`BoundedLines`): a line over the limit is
read through and dropped, never held, and in its place the server gets a small request
with the same id and method (:func:`stand_in`), which :func:`refuse_oversized` answers
with an error naming the limit. So no message makes the server hold more than the limit
(and one piece of 64 KiB).

The server's session reads and writes the messages here (:class:`WireMessages`,
:class:`WireWriter`), parsed and serialized as the package's own stdio transport does
them, without its reader and writer tasks: a message in and its answer out take one hand
over between tasks each fewer (about 0.1 ms a call on a loaded 2-core machine).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import stat
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp.types import INVALID_REQUEST, CallToolResult, TextContent, jsonrpc_message_adapter

log = logging.getLogger(__name__)

#: The ``_meta`` key of a stand-in request; its value: {"size": bytes read, "limit": bytes}.
OVERSIZED = "sandbox-kernel/oversized"

_PIECE = 64 * 1024
#: How much of an oversized line's head and tail is kept to find its id and method.
_HEAD, _TAIL = 4096, 512
_TAIL_ID = re.compile(rb',\s*"id"\s*:\s*(-?\d{1,20}|"(?:[^"\\]|\\.){0,200}")\s*}\s*$')


class BoundedLines:
    """The lines read from the descriptor ``fd``, as bytes, none longer than ``limit``: a
    longer one becomes its :func:`stand_in` (or is dropped, when it has no id).

    A pipe or a socket (what an MCP client hands its server) is read without blocking,
    on the event loop: a thread per message, as the mcp package reads stdin, costs a
    wake-up on the way in (see :class:`LineWriter`). Anything else (a terminal, a file)
    is read in a thread.
    """

    def __init__(self, fd: int, limit: int) -> None:
        self.fd = fd
        self.limit = limit
        self._buffer = bytearray()
        self._searched = 0  # where the search for the next line break goes on
        self._dropping: _Dropping | None = None  # an oversized line, partly read
        self._flags: int | None = None  # the descriptor's own, while it is non-blocking
        self._threaded: bool | None = None  # decided at the first asynchronous read

    def __aiter__(self) -> BoundedLines:
        return self

    async def __anext__(self) -> bytes:
        if self._threaded is None:
            self._flags = _set_nonblocking(self.fd)
            self._threaded = self._flags is None
        if self._threaded:
            # A thread: no cancellation reaches a read() that blocks.
            line = await anyio.to_thread.run_sync(self.read_line, abandon_on_cancel=True)
        else:
            while True:
                try:
                    line = self.read_line()
                    break
                except BlockingIOError:
                    await anyio.wait_readable(self.fd)
        if line is None:
            raise StopAsyncIteration
        return line

    def close(self) -> None:
        """Give the descriptor back its flags (it may be a terminal's, or shared)."""
        _restore_flags(self.fd, self._flags)
        self._flags = None

    def read_line(self) -> bytes | None:
        """The next line, its stand-in for one over the limit; None at the end. On a
        non-blocking descriptor, raises BlockingIOError where a read would block; the
        next call goes on where this one stopped."""
        while True:
            if self._dropping is not None:
                substitute = self._drop_rest()
            else:
                newline = self._buffer.find(b"\n", self._searched)
                if newline >= 0:
                    line = bytes(self._buffer[: newline + 1])
                    del self._buffer[: newline + 1]
                    self._searched = 0
                    if len(line) <= self.limit:
                        return line
                    substitute = stand_in(line[:_HEAD], line[-_TAIL - 1 : -1], len(line) - 1, self.limit)
                elif len(self._buffer) > self.limit:
                    self._begin_drop()
                    substitute = self._drop_rest()
                else:
                    self._searched = len(self._buffer)
                    piece = os.read(self.fd, _PIECE)
                    if not piece:
                        if not self._buffer:
                            return None
                        self._buffer += b"\n"  # the last line, without its line break
                    else:
                        self._buffer += piece
                    continue
            if substitute is not None:
                return substitute

    def _begin_drop(self) -> None:
        """The line in the buffer is over the limit: keep its head and tail, drop the rest."""
        buffer = self._buffer
        self._dropping = _Dropping(bytes(buffer[:_HEAD]), bytes(buffer[-_TAIL:]), len(buffer))
        buffer.clear()
        self._searched = 0

    def _drop_rest(self) -> bytes | None:
        """Read the rest of the oversized line and drop it; its stand-in."""
        dropping = self._dropping
        assert dropping is not None  # noqa: S101 (read_line's state)
        while piece := os.read(self.fd, _PIECE):
            newline = piece.find(b"\n")
            if newline >= 0:
                dropping.tail = (dropping.tail + piece[:newline])[-_TAIL:]
                dropping.size += newline
                self._buffer += piece[newline + 1 :]
                break
            dropping.tail = (dropping.tail + piece)[-_TAIL:]
            dropping.size += len(piece)
        self._dropping = None
        log.warning(
            "Refused an MCP message of %d bytes or more: over the limit of %d", dropping.size, self.limit
        )
        return stand_in(dropping.head, dropping.tail, dropping.size, self.limit)


@dataclass
class _Dropping:
    """An oversized line being read through: its head, its tail so far, its size so far."""

    head: bytes
    tail: bytes
    size: int


class LineWriter:
    """The server's side of stdout (behind :class:`WireWriter`): it writes each message
    (``write`` then ``flush``) straight to the descriptor from the event loop, waiting on
    the loop while a pipe or socket is full; the package's own stdout (an
    ``anyio.wrap_file``) takes a thread for each write and each flush. On anything else
    (a terminal, a file) a thread writes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending = bytearray()
        self._flags = _set_nonblocking(fd)

    async def write(self, text: str) -> int:
        self._pending += text.encode("utf-8")
        return len(text)

    async def flush(self) -> None:
        if self._flags is None:
            await anyio.to_thread.run_sync(self._write_all)
            return
        while self._pending:
            try:
                written = os.write(self.fd, self._pending)
            except BlockingIOError:
                await anyio.wait_writable(self.fd)
                continue
            del self._pending[:written]

    def _write_all(self) -> None:
        while self._pending:
            written = os.write(self.fd, self._pending)
            del self._pending[:written]

    def close(self) -> None:
        """Give the descriptor back its flags."""
        _restore_flags(self.fd, self._flags)
        self._flags = None


def _set_nonblocking(fd: int) -> int | None:
    """Make a pipe or socket ``fd`` non-blocking; its flags before, or None (not one)."""
    if not stat.S_ISFIFO(mode := os.fstat(fd).st_mode) and not stat.S_ISSOCK(mode):
        return None
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    return flags


def _restore_flags(fd: int, flags: int | None) -> None:
    if flags is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def stand_in(head: bytes, tail: bytes, size: int, limit: int) -> bytes | None:
    """A small request standing in for a message of ``size`` bytes, over ``limit``, of
    which ``head`` and ``tail`` were kept: its id and method, and the sizes under
    ``_meta`` (:data:`OVERSIZED`). None when no id was found (a notification: nobody
    waits for an answer)."""
    found = _top_level_scalars(head.decode("utf-8", "replace"), {"id", "method"})
    request_id = found.get("id")
    if request_id is None and (match := _TAIL_ID.search(tail)):
        request_id = json.loads(match.group(1))
    if not isinstance(request_id, int | str) or isinstance(request_id, bool):
        return None
    method = found.get("method")
    request = {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": method if isinstance(method, str) else "tools/call",
        "params": {"_meta": {OVERSIZED: {"size": size, "limit": limit}}},
    }
    return json.dumps(request).encode() + b"\n"


def _top_level_scalars(text: str, wanted: set[str]) -> dict[str, Any]:
    """The values of the ``wanted`` keys of the JSON object that ``text`` begins (maybe
    cut short), where they are strings or numbers and come before the cut."""
    decoder = json.JSONDecoder()
    found: dict[str, Any] = {}
    start = text.find("{")
    if start < 0:
        return found
    at, depth, key_next = start + 1, 1, True
    while at < len(text) and depth > 0:
        char = text[at]
        if char == '"':
            try:
                value, at = decoder.raw_decode(text, at)
            except ValueError:
                break  # cut short inside a string
            if depth == 1 and key_next:
                key_next = False
                colon = _skip_space(text, at)
                if colon < len(text) and text[colon] == ":" and value in wanted:
                    where = _skip_space(text, colon + 1)
                    if where < len(text) and text[where] not in "{[":
                        try:
                            found[value], at = decoder.raw_decode(text, where)
                        except ValueError:
                            break
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == "," and depth == 1:
            key_next = True
        at += 1
    return found


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def oversized_message(size: int, limit: int) -> str:
    """What the client is told of a message over the limit."""
    return (
        f"This request is {size:,} bytes or more: over the {limit:,} bytes this MCP server reads in "
        "one message (it follows from max_upload), so it was not read. Send less in one call: "
        "upload a large file in parts (each under the upload limit) and join them with run_code, "
        "or have the kernel make it."
    )


async def refuse_oversized(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
    """Middleware answering a :func:`stand_in`: a tool error for a tool call, else a
    JSON-RPC error; any other message passes on."""
    meta = ctx.params.get("_meta") if isinstance(ctx.params, Mapping) else None
    marker = meta.get(OVERSIZED) if isinstance(meta, Mapping) else None
    if not isinstance(marker, Mapping):
        return await call_next(ctx)
    msg = oversized_message(int(marker.get("size", 0)), int(marker.get("limit", 0)))
    if ctx.method == "tools/call":
        return CallToolResult(content=[TextContent(type="text", text=msg)], is_error=True)
    raise MCPError(code=INVALID_REQUEST, message=msg)


@contextmanager
def claimed_stdin() -> Iterator[int]:
    """A private descriptor of stdin (the MCP channel), while fd 0 reads the null device:
    nothing else in this process, nor a child, reads from the channel (as the mcp package's
    stdio transport claims it)."""
    wire = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
    finally:
        os.close(null)
    try:
        yield wire
    finally:
        # ``wire`` stays open: a reader thread may still block on it, and a descriptor
        # closed under it could be reused for something else.
        os.dup2(wire, 0)


@contextmanager
def claimed_stdout() -> Iterator[int]:
    """A private descriptor of stdout (the MCP channel), while fd 1 writes to stderr:
    stray output of this process or a child misses the wire (as the mcp package's stdio
    transport claims it)."""
    sys.stdout.flush()
    wire = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    os.dup2(2, 1)
    try:
        yield wire
    finally:
        os.dup2(wire, 1)
        os.close(wire)


class WireMessages:
    """The session's read stream: each line of ``lines`` as a JSON-RPC message, parsed as
    the package's stdio transport parses it; a line that is none is handed on as its
    exception (the session answers or logs it), as there."""

    #: No sender's context to pass on (the package's own streams carry one per message).
    last_context = None

    def __init__(self, lines: BoundedLines) -> None:
        self._lines = lines
        self._closed = False

    async def receive(self) -> SessionMessage | Exception:
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            line = await anext(self._lines)
        except StopAsyncIteration:
            raise anyio.EndOfStream from None
        try:
            return SessionMessage(jsonrpc_message_adapter.validate_json(line, by_name=False))
        except Exception as exc:  # noqa: BLE001 (handed on, as the package's transport does)
            return exc

    def __aiter__(self) -> WireMessages:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> WireMessages:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class WireWriter:
    """The session's write stream: each message serialized as the package's stdio
    transport does it, one line, written whole by the task that sends it.

    One message at a time, and a message once begun is finished even if its sender is
    cancelled meanwhile (a client reading slowly, a request it cancelled): its rest would
    wait for the next message, and the client for it. A client gone (a broken pipe) is a
    closed stream to the session, which then drops what it sends.
    """

    def __init__(self, out: LineWriter) -> None:
        self._out = out
        self._lock = anyio.Lock(fast_acquire=True)
        self._closed = False

    async def send(self, message: SessionMessage) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        line = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
        async with self._lock:
            with anyio.CancelScope(shield=True):
                try:
                    await self._out.write(line)
                    await self._out.flush()
                except OSError as exc:  # the client closed its end
                    self._closed = True
                    raise anyio.BrokenResourceError from exc

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> WireWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def serve_stdio(server: MCPServer[Any], max_message: int) -> None:
    """Serve ``server`` on stdin and stdout, reading no message over ``max_message``
    bytes, until stdin ends. ``server`` must have :func:`refuse_oversized` among its
    middleware."""
    with claimed_stdin() as wire_in, claimed_stdout() as wire_out:
        lines, writer = BoundedLines(wire_in, max_message), LineWriter(wire_out)
        try:
            # MCPServer.run_stdio_async reads stdin itself; this is its body, on our streams.
            lowlevel = server._lowlevel_server
            await lowlevel.run(
                cast(Any, WireMessages(lines)),
                cast(Any, WireWriter(writer)),
                lowlevel.create_initialization_options(),
            )
        finally:
            lines.close()
            writer.close()
