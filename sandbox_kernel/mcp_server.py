"""An MCP server over stdio: sandboxed kernels as tools for an AI assistant.

``jupyter sandbox-kernel mcp`` runs it. Every kernel it starts is an ordinary
sandboxed kernel of the configured kernelspec, started through the provisioner by
:class:`~sandbox_kernel.session.AsyncSandboxSession`: the kernelspec's policy, its
ceilings and the audit log apply as to any other kernel, and a tool may only narrow
that policy. The tools:

``start_kernel``
    a new kernel, optionally with a narrower policy; returns its ``kernel_id``.
``run_code``
    runs a cell; without ``kernel_id`` in the *default kernel*, started on first use.
``upload_file``, ``download_file``, ``list_files``
    the workspace, from the host side.
``restart_kernel``, ``shutdown_kernel``
    as in Jupyter.

A cell that raises is not a failed tool call: its result has ``status`` ``"error"``
and the exception's ``ename``, ``evalue`` and ``traceback`` (ANSI colours removed),
so the assistant can tell "your code raised" from "the sandbox could not run it".
The latter (an unknown kernel id, a refused path, a policy wider than the
kernelspec allows) is a tool error (``isError``) whose text says what to do.

Every kernel is shut down when the client closes stdin or the server gets SIGTERM,
SIGINT or SIGHUP. Logs go to stderr: stdout is the MCP channel.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import inspect
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ContentBlock, ImageContent, TextContent, ToolAnnotations
from pydantic import Field
from typing_extensions import TypedDict

from ._version import __version__
from .errors import SandboxKernelError
from .files import from_printable, printable
from .session import AsyncSandboxSession, strip_ansi

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Rich outputs returned to the client as MCP image content (Jupyter keeps them base64).
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")

#: The largest file ``download_file`` returns; bigger ones are read in parts with ``run_code``.
MAX_DOWNLOAD = 10 * 1024 * 1024


_MAGIC = {
    b"\x89PNG\r\n\x1a\n": "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF87a": "image/gif",
    b"GIF89a": "image/gif",
}


# What the tools return: the ``structuredContent`` of each result, also sent as JSON text.


class RunResult(TypedDict):
    """One rich result of a cell (an ``execute_result`` or ``display_data``)."""

    text: str
    """Its ``text/plain`` form ("" when it has none)."""
    mime_types: list[str]
    """Every MIME type it came in; each image type is also returned as image content."""


class RunError(TypedDict):
    ename: str
    evalue: str
    traceback: list[str]
    """IPython's formatted traceback, ANSI colour codes removed."""


class RunCodeOutput(TypedDict):
    kernel_id: str
    status: Literal["ok", "error", "aborted"]
    stdout: str
    stderr: str
    results: list[RunResult]
    error: RunError | None
    duration: float
    """Seconds from sending the code to its reply."""
    cpu_time: float | None
    """CPU seconds the sandbox used during the run, when the host can tell."""
    peak_memory: int | None
    """The most memory the sandbox held during the run, in bytes, when the host can tell."""
    restarted: bool
    """The kernel was restarted, its variables are gone: it died or hit a limit during the
    cell (the error says why), or before it (restart_reason says why)."""
    restart_reason: str | None
    """Why the kernel had stopped before this cell, if it had."""
    truncated: bool
    """The output went over the output limit: the head and tail of stdout/stderr are kept."""


class StartKernelOutput(TypedDict):
    kernel_id: str
    kernel_name: str
    policy: dict[str, Any]
    """The narrowing asked for; the kernelspec's policy applies to everything else."""


class KernelOutput(TypedDict):
    kernel_id: str
    status: Literal["restarted", "shut down"]


class UploadOutput(TypedDict):
    path: str
    size: int


class DownloadOutput(TypedDict):
    path: str
    size: int
    encoding: Literal["utf-8", "base64"]
    content: str


class FileEntry(TypedDict):
    name: str
    path: str
    size: int
    is_dir: bool
    modified: str
    """ISO 8601."""
    undecodable: bool
    """The name (or a folder's on its path) is not UTF-8: name and path show each byte
    that is not as \\xNN; download_file and list_files take the path as shown."""


class ListFilesOutput(TypedDict):
    path: str
    files: list[FileEntry]


# The session API this server drives (sandbox_kernel.session), as far as it uses it.


class _Files(Protocol):
    async def upload(self, path: str, data: bytes | str) -> str: ...
    async def download(self, path: str, max_bytes: int | None = None) -> bytes: ...
    async def list(self, path: str = ".") -> list[Any]: ...


class Session(Protocol):
    @property
    def kernel_id(self) -> str | None: ...
    @property
    def files(self) -> _Files: ...
    async def start(self) -> object: ...
    async def run(self, code: str, *, timeout: float | None = None) -> Any: ...  # noqa: ASYNC109
    async def interrupt(self) -> None: ...
    async def restart(self) -> None: ...
    async def shutdown(self) -> None: ...


SessionFactory = Callable[..., Session]


def narrowed_policy(
    memory: str | None = None,
    cpus: float | None = None,
    pids: int | None = None,
    exec_timeout: str | float | None = None,
    network: Literal["none"] | None = None,
    allowed_domains: list[str] | None = None,
) -> dict[str, Any]:
    """The policy keys a ``start_kernel`` call set, for the session (which checks them)."""
    given = {
        "memory": memory,
        "cpus": cpus,
        "pids": pids,
        "exec_timeout": exec_timeout,
        "network": network,
        "allowed_domains": allowed_domains,
    }
    return {key: value for key, value in given.items() if value is not None}


def run_output(kernel_id: str, execution: Any) -> RunCodeOutput:
    """A session ``Execution`` as ``run_code``'s structured result."""
    error: RunError | None = None
    if execution.error is not None:
        error = {
            "ename": str(execution.error.ename),
            "evalue": str(execution.error.evalue),
            "traceback": [strip_ansi(line) for line in execution.error.traceback],
        }
    return {
        "kernel_id": kernel_id,
        "status": execution.status if execution.status in ("ok", "aborted") else "error",
        "stdout": strip_ansi(execution.stdout),
        "stderr": strip_ansi(execution.stderr),
        "results": [
            {"text": str(result.data.get("text/plain", "")), "mime_types": sorted(result.data)}
            for result in execution.results
        ],
        "error": error,
        "duration": round(float(execution.duration), 3),
        "cpu_time": getattr(execution, "cpu_time", None),
        "peak_memory": getattr(execution, "peak_memory", None),
        "restarted": bool(getattr(execution, "restarted", False)),
        "restart_reason": getattr(execution, "restart_reason", None),
        "truncated": bool(getattr(execution, "truncated", False)),
    }


def run_images(execution: Any) -> list[ImageContent]:
    """The images among a cell's rich results, as MCP image content, in output order."""
    images = []
    for result in execution.results:
        for mime in IMAGE_TYPES:
            data = result.data.get(mime)
            if isinstance(data, str):
                # Jupyter may wrap base64 across lines; MCP wants it in one piece.
                images.append(ImageContent(type="image", data="".join(data.split()), mime_type=mime))
    return images


def tool_result(structured: Mapping[str, Any], extra: list[ContentBlock] | None = None) -> CallToolResult:
    """A successful result: ``structured`` as structured content and as JSON text, then ``extra``.

    Every string in it is made valid UTF-8 first (see :func:`~.files.printable`): one
    that is not (a file name kernel code chose) cannot be sent, and would end the server.
    """
    structured = _printable_strings(structured)
    text = TextContent(type="text", text=json.dumps(structured, indent=2, ensure_ascii=False))
    return CallToolResult(content=[text, *(extra or [])], structured_content=dict(structured))


def _printable_strings(value: Any) -> Any:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, Mapping):
        return {key: _printable_strings(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_printable_strings(item) for item in value]
    return value


def encode_download(path: str, data: bytes) -> tuple[DownloadOutput, list[ContentBlock]]:
    """A downloaded file: text when it is UTF-8, base64 otherwise (plus image content for images)."""
    try:
        output: DownloadOutput = {
            "path": path,
            "size": len(data),
            "encoding": "utf-8",
            "content": data.decode("utf-8"),
        }
    except UnicodeDecodeError:
        encoded = base64.b64encode(data).decode("ascii")
        output = {"path": path, "size": len(data), "encoding": "base64", "content": encoded}
    mime = next((kind for magic, kind in _MAGIC.items() if data.startswith(magic)), None)
    extra: list[ContentBlock] = []
    if mime is not None:
        extra.append(ImageContent(type="image", data=output["content"], mime_type=mime))
    return output, extra


def decode_upload(content: str, encoding: str) -> bytes:
    """``upload_file``'s content as bytes.

    Raises:
        ToolError: ``encoding`` is unknown or the content is not valid base64.
    """
    if encoding == "utf-8":
        return content.encode("utf-8")
    if encoding == "base64":
        try:
            return base64.b64decode(content, validate=True)
        except ValueError as exc:
            msg = f"content is not valid base64 ({exc}); send text with encoding 'utf-8'"
            raise ToolError(msg) from exc
    msg = f"unknown encoding {encoding!r}: use 'utf-8' for text or 'base64' for bytes"
    raise ToolError(msg)


def file_entry(info: Any) -> FileEntry:
    """One ``FileInfo`` of the session's file listing, JSON-able."""
    modified = info.modified
    if isinstance(modified, datetime):
        modified = modified.isoformat()
    elif isinstance(modified, int | float):
        modified = datetime.fromtimestamp(modified).astimezone().isoformat()
    name, path = printable(str(info.name)), printable(str(info.path))
    return {
        "name": name,
        "path": path,
        "size": int(info.size),
        "is_dir": bool(info.is_dir),
        "modified": str(modified),
        "undecodable": name != info.name or path != info.path,
    }


class KernelTools:
    """The kernels one MCP server started, and the tools that drive them.

    ``session_factory`` builds a session the way
    :class:`~sandbox_kernel.session.AsyncSandboxSession` does (tests pass a fake).
    """

    def __init__(self, kernel_name: str, cwd: str, session_factory: SessionFactory) -> None:
        self.kernel_name = kernel_name
        self.cwd = cwd
        self._new_session = session_factory
        self._kernels: dict[str, Session] = {}
        self._run_locks: dict[str, asyncio.Lock] = {}
        self._default_id: str | None = None
        self._default_lock = asyncio.Lock()
        self._starting: set[Session] = set()
        self._no_starts = asyncio.Event()
        self._no_starts.set()
        self._closed = False
        self._all_shut_down = asyncio.Event()

    # The tools. Their docstrings are the descriptions the assistant reads.

    async def start_kernel(
        self,
        memory: Annotated[
            str | None, Field(description="Memory limit, e.g. '512m' or '1.5g'; at most the kernelspec's.")
        ] = None,
        cpus: Annotated[float | None, Field(description="CPUs, e.g. 0.5; at most the kernelspec's.")] = None,
        pids: Annotated[int | None, Field(description="Process limit; at most the kernelspec's.")] = None,
        exec_timeout: Annotated[
            str | float | None,
            Field(
                description="Longest a cell may run: seconds, or '90s', '5m', '2h'; at most the kernelspec's."
            ),
        ] = None,
        network: Annotated[
            Literal["none"] | None, Field(description="'none' cuts the kernel off the network.")
        ] = None,
        allowed_domains: Annotated[
            list[str] | None,
            Field(description="Domains the kernel may reach: a subset of those the kernelspec allows."),
        ] = None,
    ) -> Annotated[CallToolResult, StartKernelOutput]:
        """Start a new sandboxed Python (IPython) kernel and return its kernel_id.

        Only needed for a second kernel or a stricter policy: run_code without a
        kernel_id uses a default kernel, started on first use. Every limit given here
        may only narrow the kernelspec's policy; a wider one is refused, naming the key.
        All kernels share the same workspace folder (the kernel's working directory).
        """
        policy = narrowed_policy(memory, cpus, pids, exec_timeout, network, allowed_domains)
        kernel_id = await self._start(policy)
        return tool_result({"kernel_id": kernel_id, "kernel_name": self.kernel_name, "policy": policy})

    async def run_code(
        self,
        code: Annotated[str, Field(description="Python code (IPython syntax), run as one notebook cell.")],
        kernel_id: Annotated[
            str | None, Field(description="The kernel to run in; omit for the default kernel.")
        ] = None,
        timeout: Annotated[  # noqa: ASYNC109 (the kernel's clock, not this coroutine's)
            float | None,
            Field(
                description="Seconds after which the cell is interrupted; the kernelspec's exec_timeout "
                "applies in any case."
            ),
        ] = None,
    ) -> Annotated[CallToolResult, RunCodeOutput]:
        """Run Python code in a sandboxed kernel and return what it produced.

        Variables, imports and files persist between calls to the same kernel. The
        result holds status ('ok' or 'error'), stdout, stderr, the text/plain form of
        each rich result (the value of the last expression, displays), and for an
        exception its ename, evalue and traceback; images (e.g. matplotlib plots) come
        back as image content. A cell that raises is a normal result with status
        'error', not a failed tool call. restarted=true means the kernel died or hit a
        limit (memory, time) and was restarted: its variables are gone.
        """
        kernel_id, session = await self._session(kernel_id, start_default=True)
        lock = self._run_locks.setdefault(kernel_id, asyncio.Lock())
        async with lock:
            try:
                execution = await self._call(session.run(code, timeout=timeout))
            except anyio.get_cancelled_exc_class():
                # The client gave up on the call: stop the cell, or the kernel stays busy.
                with anyio.CancelScope(shield=True):
                    await self._quietly(session.interrupt(), "interrupt", kernel_id)
                raise
        return tool_result(run_output(kernel_id, execution), list(run_images(execution)))

    async def upload_file(
        self,
        path: Annotated[str, Field(description="Where to write it, relative to the workspace.")],
        content: Annotated[str, Field(description="The file's content, as text or base64.")],
        encoding: Annotated[
            Literal["utf-8", "base64"], Field(description="'utf-8' for text, 'base64' for binary content.")
        ] = "utf-8",
        kernel_id: Annotated[
            str | None, Field(description="The kernel whose workspace to use; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, UploadOutput]:
        """Write a file into the kernel's workspace, where code run in the kernel can open it.

        Paths are relative to the workspace (the kernel's working directory); paths
        leaving it or following links are refused.
        """
        data = decode_upload(content, encoding)
        _, session = await self._session(kernel_id, start_default=True)
        written = await self._call(session.files.upload(path, data))
        return tool_result({"path": str(written), "size": len(data)})

    async def download_file(
        self,
        path: Annotated[str, Field(description="The file to read, relative to the workspace.")],
        kernel_id: Annotated[
            str | None, Field(description="The kernel whose workspace to use; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, DownloadOutput]:
        """Read a file from the kernel's workspace, e.g. one the code wrote.

        The content is returned as text when the file is UTF-8 (encoding 'utf-8'),
        otherwise base64 (encoding 'base64'); PNG, JPEG and GIF files also come back
        as image content. Files over 10 MiB are refused: read parts of them with run_code.
        """
        _, session = await self._session(kernel_id, start_default=True)
        data = await self._in_workspace(
            lambda where: session.files.download(where, max_bytes=MAX_DOWNLOAD), path
        )
        output, extra = encode_download(path, data)
        return tool_result(output, extra)

    async def list_files(
        self,
        path: Annotated[str, Field(description="The folder to list, relative to the workspace.")] = ".",
        kernel_id: Annotated[
            str | None, Field(description="The kernel whose workspace to use; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, ListFilesOutput]:
        """List a folder of the kernel's workspace: name, path, size, is_dir, modified.

        A name that is not UTF-8 is shown with each such byte as \\xNN and
        undecodable=true; pass its path as shown to download_file or list_files.
        """
        _, session = await self._session(kernel_id, start_default=True)
        infos = await self._in_workspace(session.files.list, path)
        return tool_result({"path": path, "files": [file_entry(info) for info in infos]})

    async def restart_kernel(
        self,
        kernel_id: Annotated[
            str | None, Field(description="The kernel to restart; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, KernelOutput]:
        """Restart a kernel: a fresh Python process, all variables and imports gone.

        Files in the workspace stay. Use it when a kernel is stuck or its state is broken.
        """
        kernel_id, session = await self._session(kernel_id, start_default=False)
        await self._call(session.restart())
        return tool_result({"kernel_id": kernel_id, "status": "restarted"})

    async def shutdown_kernel(
        self,
        kernel_id: Annotated[
            str | None, Field(description="The kernel to shut down; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, KernelOutput]:
        """Shut a kernel down and remove its sandbox. Files in the workspace stay.

        Shutting down the default kernel is allowed: the next run_code without a
        kernel_id starts a new one.
        """
        kernel_id, session = await self._session(kernel_id, start_default=False)
        self._forget(kernel_id)
        await self._call(session.shutdown())
        return tool_result({"kernel_id": kernel_id, "status": "shut down"})

    # Bookkeeping.

    async def shutdown_all(self) -> None:
        """Shut every kernel down, all at once; a failure is logged, not raised.

        A second call (SIGTERM while stdin's end shuts them down) waits for the first.
        """
        if self._closed:
            await self._all_shut_down.wait()
            return
        self._closed = True
        try:
            await self._no_starts.wait()
            sessions = dict(self._kernels)
            self._kernels.clear()
            self._default_id = None
            if sessions:
                log.info("Shutting down %d kernel(s)", len(sessions))
            await asyncio.gather(
                *(
                    self._quietly(session.shutdown(), "shut down", kernel_id)
                    for kernel_id, session in sessions.items()
                )
            )
        finally:
            self._all_shut_down.set()

    async def _start(self, policy: Mapping[str, Any]) -> str:
        """Start a kernel with ``policy`` and keep it; its id.

        Raises:
            ToolError: the kernel could not start (the policy is wider than allowed...),
                or the server is shutting down.
        """
        if self._closed:
            msg = "the MCP server is shutting down: it starts no more kernels"
            raise ToolError(msg)
        try:
            session = self._new_session(kernel_name=self.kernel_name, cwd=self.cwd, **policy)
        except SandboxKernelError as exc:
            raise ToolError(str(exc)) from exc
        self._starting.add(session)
        self._no_starts.clear()
        try:
            # Shielded: a start cut short could leave its sandbox behind, and
            # shutdown_all() waits for starts to end, then shuts down what they started.
            with anyio.CancelScope(shield=True):
                await session.start()
            kernel_id = str(session.kernel_id)
            self._kernels[kernel_id] = session
        except SandboxKernelError as exc:
            raise ToolError(str(exc)) from exc
        finally:
            self._starting.discard(session)
            if not self._starting:
                self._no_starts.set()
        log.info("Started kernel %s (%s) with policy %r", kernel_id, self.kernel_name, dict(policy))
        return kernel_id

    async def _session(self, kernel_id: str | None, start_default: bool) -> tuple[str, Session]:
        """The kernel ``kernel_id`` names, or the default kernel (started if ``start_default``).

        Raises:
            ToolError: no such kernel, or no default kernel to restart or shut down.
        """
        if kernel_id is not None:
            session = self._kernels.get(kernel_id)
            if session is None:
                running = ", ".join(sorted(self._kernels)) or "none"
                msg = (
                    f"no kernel {kernel_id!r} in this MCP server (running: {running}); "
                    "omit kernel_id to use the default kernel, or start one with start_kernel"
                )
                raise ToolError(msg)
            return kernel_id, session
        async with self._default_lock:
            if self._default_id is None:
                if not start_default:
                    msg = "no default kernel is running: run_code without a kernel_id starts it"
                    raise ToolError(msg)
                self._default_id = await self._start({})
            return self._default_id, self._kernels[self._default_id]

    def _forget(self, kernel_id: str) -> None:
        self._kernels.pop(kernel_id, None)
        self._run_locks.pop(kernel_id, None)
        if self._default_id == kernel_id:
            self._default_id = None

    @staticmethod
    async def _call(awaitable: Any) -> Any:
        """Await a session call; sandbox-kernel's errors become tool errors, which say what to do."""
        try:
            return await awaitable
        except SandboxKernelError as exc:
            raise ToolError(printable(str(exc))) from exc

    @staticmethod
    async def _in_workspace(call: Callable[[str], Awaitable[T]], path: str) -> T:
        """``call(path)``; where that fails and ``path`` has ``\\xNN`` escapes (as
        list_files shows a name that is not UTF-8), ``call`` of the path they stand for.
        A name that exists as written comes first.

        Raises:
            ToolError: neither worked; the error of ``path`` as written.
        """
        try:
            return await call(path)
        except SandboxKernelError as exc:
            raw = from_printable(path)
            if raw != path:
                with contextlib.suppress(SandboxKernelError):
                    return await call(raw)
            raise ToolError(printable(str(exc))) from exc

    @staticmethod
    async def _quietly(awaitable: Any, what: str, kernel_id: str) -> None:
        try:
            await awaitable
        except (SandboxKernelError, OSError, RuntimeError, TimeoutError) as exc:
            log.warning("Could not %s kernel %s: %s", what, kernel_id, exc)


def build_server(tools: KernelTools) -> MCPServer[Any]:
    """The MCP server exposing ``tools``; its lifespan shuts their kernels down at the end."""

    @asynccontextmanager
    async def lifespan(_: MCPServer[Any]) -> AsyncIterator[None]:
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await tools.shutdown_all()

    server: MCPServer[Any] = MCPServer(
        "sandbox-kernel",
        version=__version__,
        instructions=(
            "Runs Python code in sandboxed Jupyter (IPython) kernels inside gVisor containers. "
            "run_code without a kernel_id uses one default kernel whose state persists between calls. "
            f"Kernels use the kernelspec {tools.kernel_name!r} and the workspace folder {tools.cwd}."
        ),
        lifespan=lifespan,
    )
    mutating = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
    destructive = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)
    read_only = ToolAnnotations(read_only_hint=True, open_world_hint=False)
    registered: list[tuple[Callable[..., Any], ToolAnnotations]] = [
        (tools.start_kernel, mutating),
        (tools.run_code, destructive),
        (tools.upload_file, destructive),
        (tools.download_file, read_only),
        (tools.list_files, read_only),
        (tools.restart_kernel, destructive),
        (tools.shutdown_kernel, destructive),
    ]
    for tool, hints in registered:
        server.add_tool(tool, description=inspect.cleandoc(tool.__doc__ or ""), annotations=hints)
    return server


async def _stop_on_signals(tools: KernelTools) -> None:
    """On SIGTERM, SIGINT or SIGHUP: shut the kernels down, then die of that signal.

    Dying of the signal rather than cancelling the server: the stdio transport reads
    stdin in a thread no cancellation reaches, so only stdin's end would stop it.
    """
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("Got %s: shutting the kernels down", signal.Signals(signum).name)
            with anyio.CancelScope(shield=True):
                await tools.shutdown_all()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


async def serve_stdio_async(
    kernel_name: str, cwd: str, session_factory: SessionFactory | None = None
) -> None:
    """Serve MCP over stdin and stdout until stdin ends; every kernel is shut down by then."""
    tools = KernelTools(kernel_name, cwd, session_factory or AsyncSandboxSession)
    server = build_server(tools)
    async with anyio.create_task_group() as group:
        group.start_soon(_stop_on_signals, tools)
        try:
            await server.run_stdio_async()
        finally:
            group.cancel_scope.cancel()


def serve_stdio(
    kernel_name: str = "sandboxed-python", cwd: str | None = None, config: Mapping[str, Any] | None = None
) -> None:
    """Run the MCP server on stdin and stdout (``jupyter sandbox-kernel mcp``).

    Kernels use the kernelspec ``kernel_name``, the server settings ``config`` (over the
    server's config files, as :class:`~sandbox_kernel.session.AsyncSandboxSession` takes
    them) and the workspace ``cwd`` (default: the current folder). Returns when the client
    closes stdin, after shutting every kernel down.
    """
    factory = functools.partial(AsyncSandboxSession, config=config)
    anyio.run(serve_stdio_async, kernel_name, str(Path(cwd or os.getcwd()).resolve()), factory)
