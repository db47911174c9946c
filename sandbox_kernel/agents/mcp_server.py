"""An MCP server over stdio: sandboxed kernels as tools for an AI assistant.

``jupyter sandbox-kernel mcp`` runs it. Every kernel it starts is an ordinary
sandboxed kernel of the configured kernelspec, started through the provisioner by
:class:`~sandbox_kernel.agents.session.AsyncSandboxSession`: the kernelspec's policy, its
ceilings and the audit log apply as to any other kernel, and a tool may only narrow
that policy. The tools:

``start_kernel``
    a new kernel, optionally with a narrower policy; returns its ``kernel_id``.
``run_code``
    runs a cell; without ``kernel_id`` in the *default kernel*, started on first use.
``run_command``
    runs a shell command in the same sandbox, outside the Python namespace.
``interrupt_kernel``, ``restart_kernel``, ``shutdown_kernel``
    as in Jupyter.
``list_kernels``, ``get_policy``
    the kernels this server runs; what one may do (limits, network), as the host holds it.
``upload_file``, ``download_file``, ``list_files``, ``delete_file``
    the workspace, from the host side.

With a kernelspec's ``approval = "egress"``, a kernel's request outside its allowed domains
is put to the MCP client (elicitation) during the ``run_code`` or ``run_command`` call that
runs its code, locally and on a sandbox gateway alike (see :mod:`~.mcp_approval`).

A cell that raises is not a failed tool call: its result has ``status`` ``"error"``
and the exception's ``ename``, ``evalue`` and ``traceback`` (terminal control sequences
removed), so the assistant can tell "your code raised" from "the sandbox could not run
it". The latter (an unknown kernel id, a refused path, a policy wider than the
kernelspec allows) is a tool error (``isError``) whose one line says what to do.

One client cannot exhaust the server (:class:`McpLimits`): it runs at most
``max_kernels`` kernels, reads no message over what ``max_upload`` needs (see
:mod:`~.mcp_transport`), pages ``list_files`` and cuts a ``run_code`` result to
``max_output_chars`` characters (see :mod:`~.mcp_results`), saving the whole of a cut
stdout or stderr in the workspace for the assistant to read.

Every kernel is shut down when the client closes stdin or the server gets SIGTERM,
SIGINT or SIGHUP. Logs go to stderr: stdout is the MCP channel.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import itertools
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.context import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import Field
from traitlets import Int, TraitError, Unicode, validate
from traitlets.config import Config, LoggingConfigurable

from sandbox_kernel._version import __version__
from sandbox_kernel.agents import mcp_files, mcp_transport, workspaces
from sandbox_kernel.agents.commands import DEFAULT_TIMEOUT
from sandbox_kernel.agents.gateway_settings import GatewaySettings
from sandbox_kernel.agents.mcp_approval import ClientApprovals
from sandbox_kernel.agents.mcp_results import (
    DeleteOutput,
    DownloadOutput,
    KernelEntry,
    KernelOutput,
    ListFilesOutput,
    ListKernelsOutput,
    PolicyOutput,
    RunCodeOutput,
    RunCommandOutput,
    StartKernelOutput,
    UploadOutput,
    command_output,
    one_line,
    over_budget,
    plain_schema,
    run_images,
    run_output,
    run_texts,
    tidy_tool_error,
    tool_result,
)
from sandbox_kernel.agents.session import AsyncSandboxSession, strip_ansi
from sandbox_kernel.errors import SandboxKernelError
from sandbox_kernel.plan.limits import size_bytes
from sandbox_kernel.plan.sandbox_spec import CONTAINER_WORKSPACE
from sandbox_kernel.plan.settings import Size

__all__ = ["KernelTools", "McpLimits", "build_server", "serve_stdio", "strip_ansi"]

log = logging.getLogger(__name__)

#: Files of cut output the server keeps in the workspace; older ones are deleted.
KEPT_OUTPUTS = 20


class McpLimits(LoggingConfigurable):
    """How much one MCP client may ask of the server. Set in a config file
    (``c.McpLimits.max_kernels = 4``) or on the command line
    (``jupyter sandbox-kernel mcp --McpLimits.max_kernels=4``)."""

    max_kernels = Int(
        8,
        config=True,
        help="""Most kernels one MCP server runs at once, its default kernel included. A
        start_kernel past it is refused, saying which kernels run and how to free one.""",
    )
    max_upload = Size(
        "16m",
        config=True,
        help="""Largest file upload_file takes in one call, e.g. '16m'. The server reads no
        message longer than such a file as base64 (plus 1 MiB), so it never holds more.""",
    )
    output_chars = Int(
        20_000,
        config=True,
        help="""Characters of text (stdout, stderr, the results' text, the error) in a
        run_code result unless the call passes max_output_chars: past it each long text
        keeps its head and tail around a marker saying how much was cut.""",
    )
    max_output_chars = Int(1_000_000, config=True, help="Most max_output_chars a run_code call may ask for.")
    list_limit = Int(200, config=True, help="Entries in one list_files page unless the call passes limit.")
    max_list_limit = Int(2000, config=True, help="Most entries a list_files call may ask for.")
    output_folder = Unicode(
        ".mcp-output",
        config=True,
        help=f"""Folder of the workspace (relative to the kernels' working folder) where the
        whole stdout or stderr of a run_code result cut at max_output_chars is saved, for
        the assistant to read; the newest {KEPT_OUTPUTS} are kept. '' saves none.""",
    )

    @validate("max_kernels", "output_chars", "max_output_chars", "list_limit", "max_list_limit")
    def _at_least_one(self, proposal: Any) -> int:
        value = proposal["value"]
        if value < 1:
            name = proposal["trait"].name
            msg = f"McpLimits.{name} = {value!r} must be at least 1: give a positive number."
            raise TraitError(msg)
        return int(value)

    @property
    def upload_bytes(self) -> int:
        return size_bytes("McpLimits.max_upload", self.max_upload)

    @property
    def max_message(self) -> int:
        """The longest message the server reads: a largest upload as base64, and the rest."""
        return self.upload_bytes * 4 // 3 + 1024 * 1024


# The session API this server drives (sandbox_kernel.agents.session), as far as it uses it.


class Session(Protocol):
    @property
    def kernel_id(self) -> str | None: ...
    @property
    def files(self) -> mcp_files.Files: ...
    async def start(self) -> object: ...
    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
        env: Mapping[str, str] | None = None,
    ) -> Any: ...
    async def run_command(
        self,
        command: str,
        *,
        timeout: float | None = ...,  # noqa: ASYNC109
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output: int = ...,
    ) -> Any: ...
    async def interrupt(self) -> None: ...
    async def current_policy(self) -> dict[str, Any]: ...
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


@contextlib.contextmanager
def tool_errors(tool: str) -> Iterator[None]:
    """Every failure of a tool as a one-line tool error that says what happened.

    sandbox-kernel's errors say what to do already; any other (the host's file system,
    Docker, a kernel that stopped answering) is named and logged.
    """
    try:
        yield
    except ToolError as exc:
        raise ToolError(one_line(str(exc))) from exc
    except SandboxKernelError as exc:
        raise ToolError(one_line(str(exc))) from exc
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        log.warning("%s failed: %r", tool, exc)
        msg = f"{tool} failed on the host: {type(exc).__name__}: {exc or 'no detail'}"
        raise ToolError(one_line(msg)) from exc


class KernelTools:
    """The kernels one MCP server started, and the tools that drive them.

    ``session_factory`` builds a session the way
    :class:`~sandbox_kernel.agents.session.AsyncSandboxSession` does (tests pass a fake);
    ``limits`` bound what a client may ask (:class:`McpLimits`' defaults if not given);
    ``approvals`` asks the client about the kernels' requests (the sessions' approval_handler).
    """

    def __init__(
        self,
        kernel_name: str,
        cwd: str,
        session_factory: SessionFactory,
        limits: McpLimits | None = None,
        remove_workspace: bool = False,
        approvals: ClientApprovals | None = None,
    ) -> None:
        self.kernel_name = kernel_name
        self.approvals = approvals or ClientApprovals()
        self.cwd = cwd
        #: Whether ``cwd`` is a fresh workspace this server made, to remove once its
        #: kernels are shut down.
        self.remove_workspace = remove_workspace
        self.limits = limits or McpLimits()
        self._new_session = session_factory
        self._kernels: dict[str, Session] = {}
        self._policies: dict[str, dict[str, Any]] = {}
        self._run_locks: dict[str, asyncio.Lock] = {}
        self._default_id: str | None = None
        self._default_lock = asyncio.Lock()
        self._starting: set[Session] = set()
        self._no_starts = asyncio.Event()
        self._no_starts.set()
        self._closed = False
        self._all_shut_down = asyncio.Event()
        self._outputs = itertools.count(1)
        self._saved_outputs: collections.deque[str] = collections.deque()

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
        lifetime: Annotated[
            float | None,
            Field(gt=0, description="Seconds after which this kernel is shut down, whatever it is doing."),
        ] = None,
    ) -> Annotated[CallToolResult, StartKernelOutput]:
        """Start a new sandboxed Python (IPython) kernel and return its kernel_id.

        Only needed for a second kernel or a stricter policy: run_code without a
        kernel_id uses a default kernel, started on first use. Every limit given here
        may only narrow the kernelspec's policy; a wider one is refused, naming the key.
        The server runs a few kernels at most: shut down those you no longer need. All
        kernels share one workspace, their working folder, at /workspace in the sandbox.
        With lifetime, the kernel is shut down that many seconds after its start.
        """
        with tool_errors("start_kernel"):
            policy = narrowed_policy(memory, cpus, pids, exec_timeout, network, allowed_domains)
            if lifetime is not None:
                policy["lifetime"] = lifetime
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
        max_output_chars: Annotated[
            int | None,
            Field(
                ge=1,
                description="Most characters of output text in the result (default about 20,000); "
                "longer output keeps its head and tail.",
            ),
        ] = None,
        env: Annotated[
            dict[str, str] | None,
            Field(description="Environment variables for this cell alone (os.environ), put back after it."),
        ] = None,
        ctx: Context | None = None,
    ) -> Annotated[CallToolResult, RunCodeOutput]:
        """Run Python code in a sandboxed kernel and return what it produced.

        Variables, imports and files persist between calls to the same kernel; the
        working folder is the workspace, /workspace in the sandbox. The result holds
        status ('ok' or 'error'), stdout, stderr, text (the text/plain of the value of
        the last expression, as a notebook shows it in Out[]), results (each rich
        output's text/plain; is_main_result marks that value, the others were
        displayed), and for an exception its ename, evalue and traceback; images (e.g.
        matplotlib plots) come back as image content. A cell that raises is a normal
        result with status 'error', not a failed tool call; past timeout it is
        interrupted (ename 'TimeoutError'), and interrupt_kernel stops it sooner
        ('KeyboardInterrupt'). restarted=true means the kernel died or hit a limit
        (memory, time) and was restarted: its variables are gone. Long output is cut to
        max_output_chars (truncated=true): its head and tail stay around a marker, and
        the whole stdout/stderr is saved to the workspace file in full_output.
        """
        with tool_errors("run_code"):
            budget = self._output_budget(max_output_chars)
            kernel_id, session = await self._session(kernel_id, start_default=True)
            lock = self._run_locks.setdefault(kernel_id, asyncio.Lock())
            async with lock:
                try:
                    with self.approvals.during(kernel_id, ctx) as approval_notes:
                        execution = await session.run(code, timeout=timeout, env=env)
                except ValueError as exc:  # env holds what is no environment variable
                    raise ToolError(str(exc)) from exc
                except anyio.get_cancelled_exc_class():
                    # The client gave up on the call: stop the cell, or the kernel stays busy.
                    with anyio.CancelScope(shield=True):
                        await self._quietly(session.interrupt(), "interrupt", kernel_id)
                    raise
            texts = run_texts(execution)
            saved = await self._save_cut_output(session, kernel_id, texts, over_budget(texts, budget))
            ceiling = self.limits.max_output_chars
            more = f"with a larger max_output_chars (at most {ceiling:,})" if budget < ceiling else ""
            output = run_output(kernel_id, execution, texts, budget, saved, more)
            images, notes = run_images(execution)
            output["notes"].extend([*approval_notes, *notes])
            return tool_result(output, images)

    async def run_command(
        self,
        command: Annotated[
            str, Field(description="A shell command line, run with /bin/sh -c, e.g. 'ls -la data'.")
        ],
        kernel_id: Annotated[
            str | None,
            Field(description="The kernel whose sandbox to run it in; omit for the default kernel."),
        ] = None,
        timeout: Annotated[  # noqa: ASYNC109 (the command's clock, not this coroutine's)
            float,
            Field(
                gt=0, description="Seconds after which the command and its children are killed (default 60)."
            ),
        ] = DEFAULT_TIMEOUT,
        cwd: Annotated[
            str | None,
            Field(description="Folder to run it in: relative to the workspace, or under /workspace."),
        ] = None,
        env: Annotated[
            dict[str, str] | None, Field(description="Environment variables for this command alone.")
        ] = None,
        max_output_chars: Annotated[
            int | None,
            Field(
                ge=1,
                description="Most characters of stdout and stderr in the result (default about 20,000); "
                "longer output keeps its head and tail.",
            ),
        ] = None,
        ctx: Context | None = None,
    ) -> Annotated[CallToolResult, RunCommandOutput]:
        """Run a shell command in the kernel's sandbox and return exit_code, stdout, stderr.

        For what the shell does better than Python: ls, grep, wc, unzip, git, a
        program's command line. It runs in the same sandbox as run_code (same files,
        same policy: no network unless allowed, no root), but outside the Python
        namespace: no variable changes. A command that fails is a normal result
        (exit_code not 0, or error saying why it did not finish, e.g. timed_out=true),
        not a failed tool call. Commands wait for a cell running in the same kernel.
        """
        with tool_errors("run_command"):
            budget = self._output_budget(max_output_chars)
            kernel_id, session = await self._session(kernel_id, start_default=True)
            lock = self._run_locks.setdefault(kernel_id, asyncio.Lock())
            async with lock:
                try:
                    with self.approvals.during(kernel_id, ctx):
                        done = await session.run_command(
                            command, timeout=timeout, cwd=cwd, env=env, max_output=budget
                        )
                except ValueError as exc:
                    raise ToolError(str(exc)) from exc
                except anyio.get_cancelled_exc_class():
                    with anyio.CancelScope(shield=True):
                        await self._quietly(session.interrupt(), "interrupt", kernel_id)
                    raise
            output = command_output(kernel_id, done, budget)
            return tool_result(output)

    async def upload_file(
        self,
        path: Annotated[
            str, Field(description="Where to write it: relative to the workspace, or under /workspace.")
        ],
        content: Annotated[str, Field(description="The file's content, as text or base64.")],
        encoding: Annotated[
            Literal["utf-8", "base64"], Field(description="'utf-8' for text, 'base64' for binary content.")
        ] = "utf-8",
        kernel_id: Annotated[
            str | None, Field(description="The kernel whose workspace to use; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, UploadOutput]:
        """Write a file into the kernel's workspace, where code run in the kernel can open it.

        Paths are relative to the workspace (the kernel's working folder, /workspace in
        the sandbox); paths leaving it or following links are refused. Files over the
        server's upload limit (16 MiB unless set otherwise) are refused, saying the limit:
        upload a bigger one in parts and join them with run_code.
        """
        with tool_errors("upload_file"):
            data = mcp_files.upload_data(path, content, encoding, self.limits.upload_bytes)
            _, session = await self._session(kernel_id, start_default=True)
            written = await session.files.upload(path, data)
            return tool_result({"path": str(written), "size": len(data)})

    async def download_file(
        self,
        path: Annotated[
            str, Field(description="The file to read: relative to the workspace, or under /workspace.")
        ],
        kernel_id: Annotated[
            str | None, Field(description="The kernel whose workspace to use; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, DownloadOutput]:
        """Read a file from the kernel's workspace, e.g. one the code wrote.

        The content is returned as text when the file is UTF-8 (encoding 'utf-8'),
        otherwise base64 (encoding 'base64'); a PNG, JPEG, GIF or WebP image also comes
        back as image content. Files over 10 MiB are refused: read parts of them with run_code.
        """
        with tool_errors("download_file"):
            _, session = await self._session(kernel_id, start_default=True)
            output, extra = await mcp_files.download(session.files, path)
            return tool_result(output, extra)

    async def delete_file(
        self,
        path: Annotated[
            str,
            Field(
                description="The file or folder to delete: relative to the workspace, or under /workspace."
            ),
        ],
        recursive: Annotated[
            bool, Field(description="Delete a folder with everything in it; without it only an empty one.")
        ] = False,
        kernel_id: Annotated[
            str | None, Field(description="The kernel whose workspace to use; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, DeleteOutput]:
        """Delete a file, or a folder, from the kernel's workspace.

        A folder that holds files is refused unless recursive=true. Links are deleted,
        never followed; the kernel's working folder itself cannot be deleted.
        """
        with tool_errors("delete_file"):
            _, session = await self._session(kernel_id, start_default=True)
            return tool_result(await mcp_files.delete(session.files, path, recursive))

    async def list_files(
        self,
        path: Annotated[
            str, Field(description="The folder to list: relative to the workspace, or under /workspace.")
        ] = ".",
        kernel_id: Annotated[
            str | None, Field(description="The kernel whose workspace to use; omit for the default kernel.")
        ] = None,
        offset: Annotated[
            int, Field(ge=0, description="Entries to skip: next_offset of the page before.")
        ] = 0,
        limit: Annotated[
            int | None, Field(ge=1, description="Most entries in this page (default 200).")
        ] = None,
    ) -> Annotated[CallToolResult, ListFilesOutput]:
        """List a folder of the kernel's workspace, by name: name, path, size, is_dir, modified.

        A page at a time: total is how many entries the folder has, and more=true means
        more follow (call again with offset=next_offset). A name that is not UTF-8 is
        shown with each such byte as \\xNN and undecodable=true; pass its path as shown
        to download_file or list_files.
        """
        with tool_errors("list_files"):
            limit = self._list_limit(limit)
            _, session = await self._session(kernel_id, start_default=True)
            return tool_result(await mcp_files.listing(session.files, path, offset, limit))

    async def interrupt_kernel(
        self,
        kernel_id: Annotated[
            str | None, Field(description="The kernel to interrupt; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, KernelOutput]:
        """Interrupt the cell a kernel is running, as Ctrl-C would (KeyboardInterrupt).

        The run_code call waiting for that cell then returns, with status 'error' and
        ename 'KeyboardInterrupt'; variables and imports stay. Use it for a cell that
        runs too long; list_kernels says which kernels are busy. A kernel that runs
        nothing is left as it is.
        """
        with tool_errors("interrupt_kernel"):
            kernel_id, session = await self._session(kernel_id, start_default=False)
            await session.interrupt()
            return tool_result({"kernel_id": kernel_id, "status": "interrupted"})

    async def list_kernels(self) -> Annotated[CallToolResult, ListKernelsOutput]:
        """List the kernels this server runs: kernel_id, whether it is the default
        kernel, whether it is running a cell now (busy), and the narrowing it was
        started with. get_policy gives a kernel's whole policy.
        """
        with tool_errors("list_kernels"):
            kernels: list[KernelEntry] = [
                {
                    "kernel_id": kernel_id,
                    "default": kernel_id == self._default_id,
                    "busy": lock.locked() if (lock := self._run_locks.get(kernel_id)) else False,
                    "policy": dict(self._policies.get(kernel_id, {})),
                }
                for kernel_id in self._kernels
            ]
            listing: ListKernelsOutput = {
                "kernels": kernels,
                "kernel_name": self.kernel_name,
                "max_kernels": self.limits.max_kernels,
            }
            return tool_result(listing)

    async def get_policy(
        self,
        kernel_id: Annotated[
            str | None, Field(description="The kernel whose policy to read; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, PolicyOutput]:
        """Read what a kernel may do: memory, cpus, pids, disk (tmp_size, file_size),
        how long a cell may run (exec_timeout, seconds; 0: no limit), its network
        ('none', or 'allowlist' with allowed_domains), and where the workspace is.

        Check it before code that needs the network or much memory: a request to a
        domain not allowed fails, and a cell past a limit is stopped. The host enforces
        it; code in the kernel cannot change it. Starts the default kernel if needed.
        """
        with tool_errors("get_policy"):
            kernel_id, session = await self._session(kernel_id, start_default=True)
            policy = await session.current_policy()
            return tool_result({"kernel_id": kernel_id, "kernel_name": self.kernel_name, **policy})

    async def restart_kernel(
        self,
        kernel_id: Annotated[
            str | None, Field(description="The kernel to restart; omit for the default kernel.")
        ] = None,
    ) -> Annotated[CallToolResult, KernelOutput]:
        """Restart a kernel: a fresh Python process, all variables and imports gone.

        Files in the workspace stay. Use it when a kernel is stuck or its state is broken.
        """
        with tool_errors("restart_kernel"):
            kernel_id, session = await self._session(kernel_id, start_default=False)
            await session.restart()
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
        with tool_errors("shutdown_kernel"):
            kernel_id, session = await self._session(kernel_id, start_default=False)
            self._forget(kernel_id)
            await session.shutdown()
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
            if self.remove_workspace:
                await asyncio.to_thread(workspaces.remove_workspace, Path(self.cwd))
        finally:
            self._all_shut_down.set()

    async def _start(self, policy: Mapping[str, Any]) -> str:
        """Start a kernel with ``policy`` and keep it; its id.

        Raises:
            ToolError: the server runs as many kernels as it may, the kernel could not
                start (the policy is wider than allowed...), or the server is shutting down.
        """
        if self._closed:
            msg = "the MCP server is shutting down: it starts no more kernels"
            raise ToolError(msg)
        self._check_room()
        session = self._new_session(kernel_name=self.kernel_name, cwd=self.cwd, **policy)
        self._starting.add(session)
        self._no_starts.clear()
        try:
            # Shielded: a start cut short could leave its sandbox behind, and
            # shutdown_all() waits for starts to end, then shuts down what they started.
            with anyio.CancelScope(shield=True):
                await session.start()
            kernel_id = str(session.kernel_id)
            self._kernels[kernel_id] = session
            self._policies[kernel_id] = dict(policy)
        finally:
            self._starting.discard(session)
            if not self._starting:
                self._no_starts.set()
        log.info("Started kernel %s (%s) with policy %r", kernel_id, self.kernel_name, dict(policy))
        return kernel_id

    def _check_room(self) -> None:
        """Refuse a start past ``max_kernels``; kernels still starting count.

        Raises:
            ToolError: naming the limit, the kernels running and how to free one.
        """
        most = self.limits.max_kernels
        if len(self._kernels) + len(self._starting) < most:
            return
        running = ", ".join(
            f"{kernel_id} (default)" if kernel_id == self._default_id else kernel_id
            for kernel_id in self._kernels
        )
        starting = f", and {len(self._starting)} starting" if self._starting else ""
        msg = (
            f"this MCP server already runs {len(self._kernels)} kernel(s){starting}, the most it may "
            f"(McpLimits.max_kernels = {most}): running {running or 'none yet'}. Shut one you no longer "
            "need down with shutdown_kernel, or run code in one of them (kernel_id)."
        )
        raise ToolError(msg)

    async def _session(self, kernel_id: str | None, start_default: bool) -> tuple[str, Session]:
        """The kernel ``kernel_id`` names, or the default kernel (started if ``start_default``).

        Raises:
            ToolError: no such kernel, or no default kernel to restart or shut down.
        """
        if kernel_id is not None:
            session = self._kernels.get(kernel_id)
            if session is not None and session.kernel_id is None:  # it ended: its lifetime ran out
                self._forget(kernel_id)
                msg = (
                    f"kernel {kernel_id!r} is no longer running (its lifetime ran out): start another "
                    "with start_kernel, or omit kernel_id to use the default kernel"
                )
                raise ToolError(msg)
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
        self._policies.pop(kernel_id, None)
        self._run_locks.pop(kernel_id, None)
        if self._default_id == kernel_id:
            self._default_id = None

    def _output_budget(self, asked: int | None) -> int:
        """Characters of text a run_code result may carry.

        Raises:
            ToolError: more were asked than the server allows.
        """
        ceiling = self.limits.max_output_chars
        if asked is None:
            return min(self.limits.output_chars, ceiling)
        if asked > ceiling:
            msg = (
                f"max_output_chars={asked:,} is more than this server allows ({ceiling:,}, "
                "McpLimits.max_output_chars): ask for less, and read long output from a file."
            )
            raise ToolError(msg)
        return asked

    def _list_limit(self, asked: int | None) -> int:
        """Entries in a list_files page.

        Raises:
            ToolError: more were asked than the server allows.
        """
        ceiling = self.limits.max_list_limit
        if asked is None:
            return min(self.limits.list_limit, ceiling)
        if asked > ceiling:
            msg = (
                f"limit={asked:,} is more than this server lists at once ({ceiling:,}, "
                "McpLimits.max_list_limit): page through with offset instead."
            )
            raise ToolError(msg)
        return asked

    async def _save_cut_output(
        self, session: Session, kernel_id: str, texts: Mapping[str, str], streams: list[str]
    ) -> dict[str, str]:
        """Save each of ``streams`` in full to the workspace, for the assistant to read;
        where each went (its path in the sandbox). Only the newest :data:`KEPT_OUTPUTS`
        files are kept. What cannot be saved (a server that may not write for the
        kernel's user) is logged and left out."""
        folder = self.limits.output_folder.strip("/")
        if not folder or not streams:
            return {}
        run = next(self._outputs)
        saved: dict[str, str] = {}
        for stream in streams:
            name = f"{folder}/{kernel_id[:8]}-{run}-{stream}.txt"
            try:
                saved[stream] = await session.files.upload(name, texts[stream])
            except (SandboxKernelError, OSError) as exc:
                log.warning("Could not save the whole %s of a run in %s: %s", stream, name, exc)
                continue
            self._saved_outputs.append(saved[stream])
        while len(self._saved_outputs) > KEPT_OUTPUTS:
            old = self._saved_outputs.popleft()
            with contextlib.suppress(SandboxKernelError, OSError):
                await session.files.delete(old)
        return saved

    @staticmethod
    async def _quietly(awaitable: Any, what: str, kernel_id: str) -> None:
        try:
            await awaitable
        except (SandboxKernelError, OSError, RuntimeError, TimeoutError) as exc:
            log.warning("Could not %s kernel %s: %s", what, kernel_id, exc)


def instructions(tools: KernelTools) -> str:
    """What the assistant is told of the server when it connects."""
    return (
        "Runs Python code in sandboxed Jupyter (IPython) kernels inside gVisor containers. "
        "run_code without a kernel_id uses one default kernel whose state persists between calls. "
        f"Kernels use the kernelspec {tools.kernel_name!r}. Their working folder is the workspace, "
        f"which the code sees at {CONTAINER_WORKSPACE} (the host's path to it does not exist in the "
        f"sandbox): use paths relative to it, or absolute ones under {CONTAINER_WORKSPACE}, in code "
        "and in the file tools alike. A run_code result's text is the value of the cell's last "
        "expression; stdout, stderr, results (displays) and error (status 'error': your code raised) "
        "hold the rest. run_command runs a shell command in the same sandbox (files, policy), outside "
        "the Python namespace. A long cell can be stopped with interrupt_kernel; get_policy says what the "
        "kernel may do (memory, time, network). Results are cut to max_output_chars (the whole output "
        "is then saved to a workspace file, named in full_output); list_files comes in pages."
    )


async def one_line_errors(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
    """Middleware making every tool error one line (see :func:`~.mcp_results.tidy_tool_error`),
    the mcp package's own (arguments that do not fit a tool's schema) too."""
    result = await call_next(ctx)
    # The chain's result is the wire form already: a dict.
    if ctx.method == "tools/call" and isinstance(result, dict) and result.get("isError"):
        result["content"] = [
            {**block, "text": tidy_tool_error(str(block.get("text", "")))}
            if isinstance(block, dict) and block.get("type") == "text"
            else block
            for block in result.get("content") or []
        ]
    return result


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
        instructions=instructions(tools),
        lifespan=lifespan,
        middleware=[mcp_transport.refuse_oversized, one_line_errors],
    )
    mutating = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
    destructive = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)
    read_only = ToolAnnotations(read_only_hint=True, open_world_hint=False)
    registered: list[tuple[Callable[..., Any], ToolAnnotations]] = [
        (tools.start_kernel, mutating),
        (tools.run_code, destructive),
        (tools.run_command, destructive),
        (tools.upload_file, destructive),
        (tools.download_file, read_only),
        (tools.list_files, read_only),
        (tools.delete_file, destructive),
        (tools.interrupt_kernel, mutating),
        (tools.list_kernels, read_only),
        (tools.get_policy, read_only),
        (tools.restart_kernel, destructive),
        (tools.shutdown_kernel, destructive),
    ]
    for tool, hints in registered:
        server.add_tool(tool, description=inspect.cleandoc(tool.__doc__ or ""), annotations=hints)
        # The schema the package publishes, read live (its model still checks each result).
        added = server._tool_manager.get_tool(tool.__name__)
        if added is not None and added.fn_metadata.output_schema is not None:
            added.fn_metadata.output_schema = plain_schema(added.fn_metadata.output_schema)
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
    kernel_name: str,
    cwd: str,
    session_factory: SessionFactory | None = None,
    limits: McpLimits | None = None,
    remove_workspace: bool = False,
) -> None:
    """Serve MCP over stdin and stdout until stdin ends; every kernel is shut down by
    then (and, with ``remove_workspace``, the workspace ``cwd`` removed). Each session is
    asked for its kernel's approvals by the client (see :mod:`~.mcp_approval`)."""
    approvals = ClientApprovals()
    factory = functools.partial(session_factory or AsyncSandboxSession, approval_handler=approvals.ask)
    tools = KernelTools(kernel_name, cwd, factory, limits, remove_workspace, approvals)
    server = build_server(tools)
    async with anyio.create_task_group() as group:
        group.start_soon(_stop_on_signals, tools)
        try:
            await mcp_transport.serve_stdio(server, tools.limits.max_message)
        finally:
            group.cancel_scope.cancel()


def serve_stdio(
    kernel_name: str = "sandboxed-python",
    cwd: str | None = None,
    config: Mapping[str, Any] | None = None,
    keep_workspace: bool = False,
    gateway: GatewaySettings | None = None,
) -> None:
    """Run the MCP server on stdin and stdout (``jupyter sandbox-kernel mcp``).

    Kernels use the kernelspec ``kernel_name``, the server settings ``config`` (over the
    server's config files, as :class:`~sandbox_kernel.agents.session.AsyncSandboxSession` takes
    them; its ``McpLimits`` section bounds the clients, see :class:`McpLimits`) and the
    workspace ``cwd``. Without ``cwd`` they share a fresh, empty folder of this server's
    own (see :mod:`~.workspaces`), removed at the end unless ``keep_workspace``. Returns
    when the client closes stdin, after shutting every kernel down.

    With ``gateway``, the kernels run on that sandbox gateway (see
    :mod:`~.gateway_session`): ``cwd`` is a folder on its host (none: the user's root there),
    and no fresh workspace is made here.

    Raises:
        WorkspaceError: no ``cwd``, and the administrator's ``workspace_root`` decides
            the workspace (the message says what to pass).
    """
    factory = functools.partial(AsyncSandboxSession, config=config)
    limits = McpLimits(config=Config(config or {}))
    if gateway is not None:
        factory = functools.partial(
            AsyncSandboxSession,
            gateway_url=gateway.url,
            gateway_token=gateway.token,
            ca_certs=gateway.ca_certs,
        )
        anyio.run(serve_stdio_async, kernel_name, cwd or "", factory, limits, False)
        return
    fresh = not cwd
    if cwd:
        folder = str(Path(cwd).resolve())
    else:
        folder = str(workspaces.make_fresh_workspace(kernel_name, Config(config or {})))
        kept = "kept at the end" if keep_workspace else "removed at the end (--keep-workspace keeps it)"
        log.info("No --cwd: the kernels' workspace is a fresh folder, %s, %s", folder, kept)
    try:
        anyio.run(serve_stdio_async, kernel_name, folder, factory, limits, fresh and not keep_workspace)
    finally:
        if fresh and not keep_workspace:
            workspaces.remove_workspace(Path(folder))  # already gone, unless the server failed
