"""The session API: a sandboxed kernel for programs, in a few lines.

An AI assistant (or any script) starts a kernel, runs code and gets one structured
result per run, without parsing Jupyter messages::

    from sandbox_kernel import SandboxSession

    with SandboxSession(cwd="/data/project", memory="1g", exec_timeout="2m") as sandbox:
        sandbox.files.upload("input.csv", csv_bytes)
        result = sandbox.run("import pandas as pd; df = pd.read_csv('input.csv'); df.describe()")
        if result.error:
            print(result.error.ename, result.error.evalue)
        else:
            print(result.stdout, result.text)

It is built on jupyter_client (an ``AsyncKernelManager`` and its client): the kernel is
an ordinary sandboxed kernel, with the kernelspec's policy, the server's ceilings and the
audit log. Keyword arguments beyond the session's own narrow the kernelspec's policy for
this kernel (``memory``, ``cpus``, ``pids``, ``tmp_size``, ``file_size``,
``exec_timeout``, ``idle_timeout``, ``network="none"``, fewer ``allowed_domains``); a
wider value is a :class:`~sandbox_kernel.errors.ConfigurationError` naming the key.

A run never hangs on a kernel that is gone: a kernel that died or was stopped by a limit
gives an :class:`Execution` with the error (``KernelDied``, ``MemoryLimitExceeded``,
``WallClockLimitExceeded``...), and the kernel is restarted for the next run
(``restart_on_death``; ``Execution.restarted`` says so). ``run_command`` runs a shell
command in the sandbox, through the kernel (see :mod:`~sandbox_kernel.agents.commands`), and
``lifetime`` shuts the kernel down so many seconds after its start, as E2B's sandbox
timeout. :class:`AsyncSandboxSession` is the same for asyncio code.

With ``gateway_url=`` (or ``JUPYTER_GATEWAY_URL``) the kernel runs on a sandbox gateway,
``jupyter sandbox-kernel gateway`` on another machine or as root on this one, as the user
its token names (``gateway_token=`` or ``JUPYTER_GATEWAY_AUTH_TOKEN``; ``ca_certs=`` or
``JUPYTER_GATEWAY_CA_CERTS`` for its TLS certificate's CA): see
:mod:`~sandbox_kernel.agents.gateway_session`. Runs, restarts, files, pause and resume go
through the gateway; ``cwd`` is a folder on the gateway's host, under the user's root there
(none: that root); the gateway asks ``approval_handler=`` through the session (see
:mod:`~sandbox_kernel.agents.gateway_approvals`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import ensure_async
from traitlets.config import Config

from sandbox_kernel.agents.commands import (
    DEFAULT_MAX_OUTPUT,
    DEFAULT_TIMEOUT,
    CommandResult,
    command_cell,
    command_result,
    env_cell,
    restore_cell,
    saved_env,
)
from sandbox_kernel.agents.files import FileInfo, WorkspaceFiles, workspace_files
from sandbox_kernel.agents.gateway_settings import GatewaySettings, narrowing_for_gateway
from sandbox_kernel.agents.session_run import RunMessages
from sandbox_kernel.agents.workspaces import keep_workspace, make_fresh_workspace, remove_workspace
from sandbox_kernel.channels.approval import ApprovalHandler
from sandbox_kernel.channels.output import amount
from sandbox_kernel.errors import (
    ConfigurationError,
    KernelStartupError,
    KernelTakenOverError,
    SandboxKernelError,
)
from sandbox_kernel.host.background import BackgroundLoop
from sandbox_kernel.host.cgroups import SandboxUsage
from sandbox_kernel.lifecycle.pausing import Paused
from sandbox_kernel.plan.admission import sandboxed_manager
from sandbox_kernel.provisioner import SandboxProvisioner
from sandbox_kernel.reattach import reattach_kernel

if TYPE_CHECKING:
    from sandbox_kernel.agents.gateway_approvals import GatewayApprovals
    from sandbox_kernel.agents.gateway_session import GatewayKernel, SessionGatewayKernelManager

T = TypeVar("T")
log = logging.getLogger(__name__)

#: What the host answers for a kernel that ended (see the provisioner's watchdog): the
#: run gets the error, and the kernel is restarted for the next one.
KERNEL_ENDED = frozenset({"KernelDied", "MemoryLimitExceeded", "WallClockLimitExceeded", "IdleLimitExceeded"})
#: Seconds a run waits for the kernel's reply after an interrupt (its timeout ran out)
#: before it restarts the kernel.
INTERRUPT_GRACE = 5.0
#: Seconds between checks that the kernel still runs, while a run waits in silence.
ALIVE_CHECK_INTERVAL = 1.0
#: Bytes added to a run's ``max_output`` for what the host counts besides output text:
#: each message's header and the run's status and input messages.
MESSAGE_ALLOWANCE = 8192
#: What the host writes where it cut a run's output (see :mod:`~sandbox_kernel.channels.output`).
TRUNCATION_NOTICE = "[sandbox-kernel] Output truncated"
DROPPED_MARKER = "of output dropped: over "

#: Terminal control sequences (ECMA-48) in their 7-bit (ESC ...) and 8-bit (C1) forms,
#: then every control character left but newline, tab and carriage return.
_ANSI = re.compile(
    # CSI: colours, cursor moves, screen erases.
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    # OSC (titles, OSC 8 links, OSC 52 clipboard), DCS, SOS, PM, APC: up to BEL or ST,
    # or, unterminated, to the next ESC or the end (a terminal would swallow it all).
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    # Any other escape: ESC ( B, ESC 7, ESC c (a full reset)...
    r"|\x1b[ -/]*[0-~]"
    # C0 controls but \t \n \r, DEL, and C1 controls (which some terminals obey in UTF-8).
    r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]"
)


def strip_ansi(text: str) -> str:
    """``text`` without terminal control sequences: colours (IPython colours its
    tracebacks, pip its errors), but also whatever else kernel code prints for a terminal
    to obey (OSC 52 writes the clipboard, OSC 8 hides a link's target, C1 controls), and
    every other control character but newline, tab and carriage return."""
    return _ANSI.sub("", text)


#: What a terminal acts on in a progress bar's line: cursor up (``ESC [ n A``), erase in
#: line (``ESC [ n K``), carriage return, backspace.
_MOVES = re.compile(r"\x1b\[(\d{0,6})([AK])|\r|\x08")
#: Past this many moves (or this much work per character) output is shown line by line,
#: each line's last carriage-return redraw kept: hostile code can print anything.
MAX_MOVES = 100_000


def rendered(text: str) -> str:
    """``text`` as a terminal shows it once it is all printed, without control sequences:
    a progress bar redrawn with carriage returns (tqdm, pip), erased lines and cursor
    moves up leave only their last state, and colours are removed (:func:`strip_ansi`).
    The work is bounded by the text's length."""
    if _MOVES.search(text) is None:
        return strip_ansi(text)
    if text.count("\r") + text.count("\x1b[") + text.count("\x08") > MAX_MOVES:
        return _last_redraws(text)
    rows = [""]
    row = column = 0
    budget = 4 * len(text) + 65536  # characters copied to draw it

    def write(piece: str) -> None:
        nonlocal column, budget
        line = rows[row]
        if column == len(line):
            rows[row] = line + piece
        else:
            line = line.ljust(column)
            rows[row] = line[:column] + piece + line[column + len(piece) :]
        budget -= len(rows[row])
        column += len(piece)

    for index, line in enumerate(text.split("\n")):
        if index:
            row, column = row + 1, 0
            if row == len(rows):
                rows.append("")
        at = 0
        for move in _MOVES.finditer(line):
            if move.start() > at:
                write(strip_ansi(line[at : move.start()]))
            at = move.end()
            if move.group(0) == "\r":
                column = 0
            elif move.group(0) == "\x08":
                column = max(0, column - 1)
            elif move.group(2) == "A":
                row = max(0, row - int(move.group(1) or 1))
            else:  # erase in line: 0 from the cursor on, 1 up to it, 2 all of it
                how, drawn = move.group(1) or "0", rows[row]
                if how == "0":
                    rows[row] = drawn[:column]
                elif how == "1":
                    rows[row] = " " * min(column + 1, len(drawn)) + drawn[column + 1 :]
                elif how == "2":
                    rows[row] = ""
                budget -= len(drawn)
            if budget < 0:
                return _last_redraws(text)
        if at < len(line) or not at:
            write(strip_ansi(line[at:]))
    return "\n".join(rows)


def _last_redraws(text: str) -> str:
    """Each line of ``text`` as its last carriage-return redraw left it, roughly."""
    lines = (line.rstrip("\r").rpartition("\r")[2] for line in text.split("\n"))
    return strip_ansi("\n".join(lines))


@dataclass(frozen=True)
class ExecutionError:
    """The error a run ended with: as the kernel raised it, or as the host explains
    why the kernel could not answer (``KernelDied``, ``MemoryLimitExceeded``...)."""

    ename: str
    evalue: str
    #: The traceback as the kernel formats it (with terminal colours; see :attr:`text`).
    traceback: list[str] = field(default_factory=list)

    @classmethod
    def from_content(cls, content: Mapping[str, Any]) -> ExecutionError:
        """From an ``error`` message's or an error ``execute_reply``'s content."""
        traceback = list(content.get("traceback") or [])
        return cls(str(content.get("ename", "")), str(content.get("evalue", "")), traceback)

    @property
    def text(self) -> str:
        """The traceback without terminal colours, or ``ename: evalue``."""
        return strip_ansi("\n".join(self.traceback)) if self.traceback else f"{self.ename}: {self.evalue}"

    def __str__(self) -> str:
        return f"{self.ename}: {self.evalue}"


@dataclass(frozen=True)
class Result:
    """One rich result: the cell's value (``is_main_result``) or something it displayed."""

    #: The MIME bundle: ``text/plain``, ``text/html``, ``image/png`` (base64), ...
    data: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    is_main_result: bool = False

    @property
    def text(self) -> str | None:
        value = self.data.get("text/plain")
        return value if isinstance(value, str) else None

    @property
    def formats(self) -> list[str]:
        return sorted(self.data)


@dataclass
class Execution:
    """What one run of code did."""

    #: ``ok``, ``error`` or ``aborted`` (a cell skipped after an earlier one failed).
    status: str = "ok"
    #: The run's output as a terminal would show it in the end (see :func:`rendered`).
    stdout: str = ""
    stderr: str = ""
    results: list[Result] = field(default_factory=list)
    error: ExecutionError | None = None
    #: Seconds from sending the code to its reply.
    duration: float = 0.0
    execution_count: int | None = None
    #: CPU seconds the sandbox used during the run (the host's cgroup: the kernel,
    #: its threads and children, gVisor's own work), None where it cannot be read.
    cpu_time: float | None = None
    #: The most memory the sandbox held during the run, in bytes (the host's cgroup,
    #: gVisor's own memory included; Linux 6.12 or later), None where it cannot be read.
    peak_memory: int | None = None
    #: The kernel was started afresh, without the earlier variables: it ended during
    #: this run (its error says why; the next run has the new kernel), or before it
    #: (say, killed by a limit while idle; :attr:`restart_reason` says why).
    restarted: bool = False
    restart_reason: str | None = None
    msg_id: str = ""

    @property
    def truncated(self) -> bool:
        """Whether the host cut this run's output at its output limit (the head and the
        tail of stdout/stderr are kept; results past the limit are dropped)."""
        return TRUNCATION_NOTICE in self.stderr or DROPPED_MARKER in self.stdout + self.stderr

    @property
    def text(self) -> str | None:
        """The ``text/plain`` of the cell's value, if it had one."""
        main = [result for result in self.results if result.is_main_result]
        return main[0].text if main else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of everything above."""
        data = asdict(self)
        data["text"] = self.text
        data["truncated"] = self.truncated
        return data


OutputCallback = Callable[[str], Any]
DisplayCallback = Callable[[Result], Any]


class AsyncSandboxSession:
    """One sandboxed kernel for a program: start, run, interrupt, restart, files, shut down.

    ``kernel_name``: the kernelspec; ``cwd``: the kernel's workspace folder, what
    ``start_kernel(cwd=...)`` is for any jupyter_client program. Without one the session
    gets a fresh, empty folder of its own at :meth:`start` (see :mod:`~.workspaces`),
    ``cwd`` then names it, and the folder is removed at :meth:`shutdown` (not at
    :meth:`detach`: the kernel still uses it) unless ``keep_workspace``;
    ``env``: variables to set in the sandbox; ``restart_on_death``: restart a kernel that
    died or was stopped by a limit, so the next run works; ``max_output``: bytes of
    output one run may produce (at most the server's ``output_limit``; past it the head
    and tail are kept); ``config``: server settings (a traitlets ``Config`` or a dict such
    as ``{"SandboxProvisioner": {"audit_log": "/var/log/sandbox.log"}}``), over the server's
    config files, which always apply; ``approval_handler``: with approval ``egress``,
    called (in a thread of its own) with each request outside the allowed domains, it
    answers "once", "kernel" or "deny" (see :mod:`~.approval`); ``lifetime``: seconds
    after the start at which the kernel is shut down (see :meth:`set_lifetime`);
    ``**policy``: narrow the kernelspec's policy (see the module). A kernelspec whose
    kernels would not run in the sandbox is refused (``ConfigurationError``).

    ``gateway_url``, ``gateway_token``, ``ca_certs``: run the kernel on that sandbox gateway
    (see the module; each not given is read from its ``JUPYTER_GATEWAY_*`` variable). There
    ``cwd`` is a folder on the gateway's host (none: the user's root there), the narrowing
    is sent to the gateway, which refuses what is wider than it allows; ``env`` is refused
    (``ConfigurationError``: the gateway sets no client's variables), ``approval_handler``
    is asked through the gateway (see :mod:`~.gateway_approvals`), and ``config`` does not
    apply (the gateway's settings do).
    """

    def __init__(
        self,
        kernel_name: str = "sandboxed-python",
        cwd: str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        restart_on_death: bool = True,
        max_output: int | None = None,
        startup_timeout: float = 60.0,
        config: Config | Mapping[str, Any] | None = None,
        manager_kwargs: Mapping[str, Any] | None = None,
        approval_handler: ApprovalHandler | None = None,
        lifetime: float | None = None,
        keep_workspace: bool = False,
        gateway_url: str | None = None,
        gateway_token: str | None = None,
        ca_certs: str | None = None,
        **policy: Any,
    ) -> None:
        self.kernel_name = kernel_name
        #: The sandbox gateway the kernel runs on; None: here, under this host's Docker.
        self.gateway = GatewaySettings.given(gateway_url, gateway_token, ca_certs)
        # Not resolved here: the provisioner refuses links a root program must not follow.
        #: The host folder the kernel works in; for a session without ``cwd``, its fresh
        #: workspace once started (None before, and once removed). On a gateway: the
        #: folder on its host (None: the user's root there).
        self.cwd: Path | None = Path(cwd).absolute() if cwd else None
        #: Whether this session made its workspace (so removes it, unless keep_workspace).
        self.fresh_workspace = (cwd is None or cwd == "") and self.gateway is None
        #: The POST's narrowing, for a kernel on a gateway.
        self._narrowing: dict[str, Any] = {}
        if self.gateway is not None:
            if cwd and not os.path.isabs(cwd):
                msg = (
                    f"cwd={str(cwd)!r}: a kernel on a sandbox gateway needs its folder's path there, absolute"
                )
                raise ConfigurationError(msg)
            self.cwd = Path(cwd) if cwd else None
            self._narrowing = narrowing_for_gateway(policy, dict(env or {}))
        self.keep_workspace = keep_workspace
        self.env = dict(env or {})
        self.restart_on_death = restart_on_death
        self.max_output = max_output
        self.startup_timeout = startup_timeout
        self.policy = policy
        self.config = Config(config or {})
        self._manager_kwargs = dict(manager_kwargs or {})
        self.approval_handler = approval_handler
        #: What answers the gateway's approval questions for the kernel, on a gateway with a handler.
        self._approvals: GatewayApprovals | None = None
        self.km: AsyncKernelManager | None = None
        self.kc: AsyncKernelClient | None = None
        self.files = AsyncSessionFiles(self)
        self._workspace: WorkspaceFiles | None = None
        # (container, its cgroups): what the CPU and peak-memory readings are taken of.
        self._sandbox_usage: tuple[str, SandboxUsage] | None = None
        self.lifetime = _check_lifetime(lifetime)
        self._deadline: float | None = None
        self._lifetime_changed = asyncio.Event()
        self._ending = asyncio.Event()
        self._expiry: asyncio.Task[None] | None = None
        self._expired: str | None = None
        self._closing: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ life

    @property
    def kernel_id(self) -> str | None:
        return self.km.kernel_id if self.km is not None else None

    async def start(self) -> AsyncSandboxSession:
        """Start the kernel and wait until it answers.

        Raises:
            ConfigurationError, WorkspaceError: the kernelspec, the policy asked for or
                the workspace cannot be used (the message names what and how to fix it).
            SandboxKernelError: Docker, gVisor or the image is not ready, or the kernel
                did not start (nothing is left behind).
        """
        if self.km is not None:
            return self
        self._expired = None  # a new kernel, a new lifetime
        self._ending.clear()
        if self.gateway is not None:
            await self._start_on_gateway(self.gateway)
            if self.lifetime is not None:
                await self.set_lifetime(self.lifetime)
            return self
        kwargs = dict(self._manager_kwargs)
        config = Config(kwargs.pop("config", None) or {})
        config.merge(self.config)
        km = sandboxed_manager(self.kernel_name, config, **kwargs)
        extra = {"sandbox_env": self.env} if self.env else {}
        if self.cwd is None:
            self.cwd = await asyncio.to_thread(
                make_fresh_workspace, self.kernel_name, config, not self.keep_workspace
            )
        try:
            await km.start_kernel(cwd=str(self.cwd), **extra, **self.policy)
            if self.fresh_workspace and getattr(km.provisioner, "lifecycle", None) == "persistent":
                keep_workspace(self.cwd)  # the kernel may outlive this process: no sweep takes it
            try:
                await self._connect(km)
            except BaseException:
                await km.shutdown_kernel(now=True)
                raise
        except BaseException:
            await self._remove_workspace()
            raise
        if self.lifetime is not None:
            await self.set_lifetime(self.lifetime)
        return self

    async def _start_on_gateway(self, gateway: GatewaySettings, kernel_id: str | None = None) -> None:
        """Start the kernel on ``gateway`` (or take its kernel ``kernel_id``) and connect to it."""
        # The client part loads jupyter_server's gateway client: only a gateway session pays.
        from sandbox_kernel.agents.gateway_approvals import GatewayApprovals
        from sandbox_kernel.agents.gateway_session import (
            SessionGatewayKernelManager,
            release_gateway,
            use_gateway,
        )

        use_gateway(gateway)
        try:
            km = SessionGatewayKernelManager(kernel_name=self.kernel_name)
            if kernel_id is not None:
                await km.start_kernel(kernel_id=kernel_id)
                self.kernel_name = str((km.kernel or {}).get("name") or self.kernel_name)
            else:
                cwd = str(self.cwd) if self.cwd is not None else None
                await km.start_kernel(kernel_name=self.kernel_name, cwd=cwd, sandbox=self._narrowing)
            try:
                await self._connect(km)
                if self.approval_handler is not None:
                    approvals = GatewayApprovals(str(km.kernel_id), self.approval_handler)
                    await approvals.start()
                    self._approvals = approvals
            except BaseException:
                if self.kc is not None:
                    self.kc.stop_channels()
                self.km = self.kc = None
                if kernel_id is None:
                    await km.shutdown_kernel(now=True)
                raise
        except BaseException:
            release_gateway()
            raise

    async def set_lifetime(self, seconds: float | None) -> None:
        """Shut the kernel down ``seconds`` from now, whatever it is doing (a run then
        ends with ``LifetimeExceeded``), as E2B's ``set_timeout``; ``None``: never.
        Called again, it moves the end (sooner or later). Besides the kernelspec's idle
        and wall-clock limits, which apply as ever.

        Raises:
            ValueError: ``seconds`` is not a positive number.
        """
        self.lifetime = _check_lifetime(seconds)
        self._deadline = None if seconds is None else time.monotonic() + float(seconds)
        self._lifetime_changed.set()
        if self._deadline is not None and self._expiry is None and self.km is not None:
            self._expiry = asyncio.ensure_future(self._expire_when_due())

    @property
    def lifetime_left(self) -> float | None:
        """Seconds until :meth:`set_lifetime`'s end; None without one."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def _expire_when_due(self) -> None:
        while True:
            self._lifetime_changed.clear()
            if self._deadline is None:
                self._expiry = None
                return
            left = self._deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._lifetime_changed.wait(), left)
        self._expiry = None
        self._expired = (
            f"the session's lifetime of {self.lifetime:g} s ran out, and its kernel was shut down: "
            "start a new session (or give it a longer lifetime, or set_lifetime() before the end)"
        )
        self._ending.set()
        await self.shutdown()

    @classmethod
    async def connect(cls, kernel_id: str, *, take_over: bool = False, **kwargs: Any) -> AsyncSandboxSession:
        """A session driving the running sandboxed kernel ``kernel_id`` (or a unique
        prefix), started by another process or an earlier session and kept running
        (a persistent kernel, or one whose session was :meth:`detach`-ed).

        With ``gateway_url`` (or ``JUPYTER_GATEWAY_URL``), the kernel ``kernel_id`` (its whole
        id) of the token's user on that gateway: the gateway checks that it is theirs; other
        clients of it keep theirs (``take_over`` does not apply).

        Raises:
            KernelHeldError: a live process drives the kernel; ``take_over=True`` takes
                it from that process, whose runs then fail with ``KernelTakenOverError``.
            KernelNotFoundError: no such kernel this user may drive.
        """
        gateway = GatewaySettings.given(
            kwargs.get("gateway_url"), kwargs.get("gateway_token"), kwargs.get("ca_certs")
        )
        if gateway is not None:
            session = cls(str(kwargs.pop("kernel_name", "sandboxed-python")), None, **kwargs)
            await session._start_on_gateway(gateway, kernel_id)
            if session.lifetime is not None:
                await session.set_lifetime(session.lifetime)
            return session
        km = await reattach_kernel(kernel_id, take_over=take_over)
        km.stop_restarter()  # the session restarts a dead kernel itself, when run
        cwd = (km._launch_args or {}).get("cwd")
        session = cls(km.kernel_name, str(cwd) if cwd else os.getcwd(), **kwargs)
        try:
            if session.restart_on_death and not await km.is_alive():
                await km.restart_kernel(now=True)  # stopped (a limit, say) while nobody held it
            await session._connect(km)
        except BaseException:
            if isinstance(km.provisioner, SandboxProvisioner):
                await km.provisioner.detach()  # the kernel runs on, for another try
            raise
        if session.lifetime is not None:
            await session.set_lifetime(session.lifetime)  # from now: this session's lifetime
        return session

    async def _connect(self, km: AsyncKernelManager) -> None:
        kc = km.client()
        channels: Any = kc  # a gateway's client's start_channels is a coroutine: it dials its websocket
        await ensure_async(channels.start_channels())
        try:
            await kc.wait_for_ready(timeout=self.startup_timeout)
        except RuntimeError as exc:
            kc.stop_channels()
            msg = f"Sandboxed kernel {km.kernel_id} did not answer within {self.startup_timeout:g} s: {exc}"
            raise KernelStartupError(msg) from exc
        if isinstance(km.provisioner, SandboxProvisioner):
            km.provisioner.approval_handler = self.approval_handler
        self.km, self.kc = km, kc

    async def interrupt(self) -> None:
        """Interrupt the running code (``KeyboardInterrupt`` in the kernel)."""
        await self._manager().interrupt_kernel()

    async def pause(self) -> Paused:
        """Save the idle kernel, memory included, to disk and stop its sandbox; the next
        :meth:`run` resumes it (or :meth:`resume`). Raises PauseError (the kernel runs on)."""
        gateway = self._gateway_kernel()
        if gateway is not None:
            return await gateway.pause()
        return await self._provisioner().pause()

    async def resume(self) -> None:
        """Resume a paused kernel now, rather than at the next :meth:`run`."""
        gateway = self._gateway_kernel()
        if gateway is not None:
            await gateway.resume()
            return
        await self._provisioner().resume()

    async def usage(self) -> dict[str, Any]:
        """The sandbox's use of CPU and memory, as a kernel on a gateway has its owner read
        it: ``{"state", "cpu_seconds", "memory": {"used", "peak", "limit"}}`` (bytes; null
        while it has no process, paused say). ``peak`` is the most since the sandbox started.

        Raises:
            TypeError: a kernel on this host (each :class:`Execution` has its run's
                ``cpu_time`` and ``peak_memory``).
        """
        gateway = self._gateway_kernel()
        if gateway is None:
            msg = "usage() reads a kernel on a sandbox gateway; here, each run's Execution has its figures"
            raise TypeError(msg)
        return await gateway.usage()

    async def current_policy(self) -> dict[str, Any]:
        """The policy the host holds the kernel to: the kernelspec's, narrowed by this
        session. ``memory``, ``cpus``, ``pids``, ``tmp_size``, ``file_size``;
        ``exec_timeout`` and ``idle_timeout`` in seconds (0: none); ``network``
        (``none`` or ``allowlist``), ``allowed_domains``, ``approval`` (``egress``: a
        request to another domain the server allows waits for the holder's answer);
        ``output_limit`` (per run); ``lifecycle``; ``image``; ``workspace``, where the
        sandbox sees the workspace, and ``working_folder``, the kernel's folder there.
        For a kernel on a gateway, from its status route: ``workspace`` and
        ``working_folder`` are None (the gateway does not say them)."""
        gateway = self._gateway_kernel()
        if gateway is not None:
            return _gateway_policy(await gateway.status(), self._manager())
        provisioner = self._provisioner()
        info = await provisioner.get_provisioner_info()
        policy = provisioner.policy  # the running kernel's: its settings, narrowed by its start
        online = policy.network != "none"
        return {
            **policy.limits.as_dict(),
            "network": policy.network,
            "allowed_domains": list(policy.allowed_domains) if online else [],
            "approval": policy.approval if online else "off",
            "output_limit": policy.output_limit,
            "lifecycle": policy.lifecycle,
            "image": policy.image,
            "workspace": info.get("workspace_path"),
            "working_folder": info.get("workdir"),
        }

    async def run_command(  # the timeout is the command's, not this coroutine's
        self,
        command: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> CommandResult:
        """Run the shell command line ``command`` (``/bin/sh -c``) in the sandbox,
        outside the kernel's Python namespace, and return its exit code, stdout and
        stderr (as E2B's ``commands.run``). It runs through the kernel like any run,
        audited and held to the kernel's policy; never on the host (see
        :mod:`~.commands`).

        ``timeout``: seconds after which its process group is killed (``None``: none;
        the kernelspec's ``exec_timeout`` applies in any case); ``cwd``: its folder
        (relative to the kernel's working folder); ``env``: variables set for it alone;
        ``max_output``: bytes of its stdout, and of its stderr, kept (head and tail).
        A command that fails is a result (``exit_code``, ``error``), not an exception.

        Raises:
            ValueError: an empty command or an argument out of range.
            KernelTakenOverError: another process took the kernel over.
        """
        cell = command_cell(command, timeout=timeout, cwd=cwd, env=env, max_output=max_output)
        # The kernel kills the command at its timeout; this is for a kernel that cannot.
        backstop = timeout + INTERRUPT_GRACE + 5.0 if timeout is not None else None
        # What the result may need on the wire: each byte of output may take six as JSON.
        allowance = 12 * max_output + 65536
        execution = await self.run(cell, timeout=backstop, max_output=allowance, store_history=False)
        error = None
        if execution.error is not None:
            error = (
                "the command was interrupted"
                if execution.error.ename == "KeyboardInterrupt"
                else f"{execution.error.ename}: {execution.error.evalue}"
            )
        elif execution.truncated:
            error = (
                "the command's result was over the kernel's output limit, so it was dropped: "
                "pass a smaller max_output, or have the command write its output to a file"
            )
        result = command_result(execution.results, error)
        result.stdout, result.stderr = rendered(result.stdout), rendered(result.stderr)
        return result

    def _provisioner(self) -> SandboxProvisioner:
        provisioner = self._manager().provisioner
        if not isinstance(provisioner, SandboxProvisioner):
            msg = "the session's kernel is not a sandboxed one"
            raise TypeError(msg)
        return provisioner

    async def restart(self) -> None:
        """Start the kernel afresh: same workspace and policy, no variables."""
        km = self._manager()
        await km.restart_kernel(now=True)
        if self.kc is not None:
            await self.kc.wait_for_ready(timeout=self.startup_timeout)

    async def shutdown(self) -> None:
        """Stop the kernel and remove its sandbox (the workspace stays). A shutdown
        under way (the lifetime's end) is waited for, not cut short."""
        self._stop_lifetime()
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        closing = self._closing
        try:
            await asyncio.shield(closing)
        finally:
            if closing.done() and self._closing is closing:
                self._closing = None

    async def _close(self) -> None:
        km, kc = self.km, self.kc
        self.km = self.kc = None
        await self._stop_approvals()
        if kc is not None:
            kc.stop_channels()
        if _on_gateway(km):
            from sandbox_kernel.agents.gateway_session import release_gateway

            try:
                await km.shutdown_kernel(now=True)  # DELETE on the gateway
            finally:
                release_gateway()
            return
        if km is not None:
            # A kernel another process took over is not alive here, and the provisioner
            # removes and signals nothing of it: only this manager's side goes.
            await km.shutdown_kernel(now=not await km.is_alive())
        await self._remove_workspace()

    async def _remove_workspace(self) -> None:
        """Remove the fresh workspace this session made, unless it is to be kept."""
        if self.fresh_workspace and not self.keep_workspace and self.cwd is not None:
            path, self.cwd = self.cwd, None
            self._workspace = None
            await asyncio.to_thread(remove_workspace, path)

    async def detach(self) -> None:
        """Let go of the kernel without stopping it, for :meth:`connect` in this or
        another process (a persistent kernel waits; an ephemeral one is removed once
        this process has ended). The session's lifetime no longer applies to it. A fresh
        workspace stays (the kernel works in it): ``cwd`` names it, delete it when done."""
        if self.fresh_workspace and self.cwd is not None and not self.keep_workspace:
            log.info("Detached: the session's fresh workspace %s stays; delete it when done", self.cwd)
            self.keep_workspace = True
            await asyncio.to_thread(keep_workspace, self.cwd)
        self._stop_lifetime()
        km, kc = self.km, self.kc
        self.km = self.kc = None
        await self._stop_approvals()
        if kc is not None:
            kc.stop_channels()
        if _on_gateway(km):
            from sandbox_kernel.agents.gateway_session import release_gateway

            release_gateway()  # no DELETE: the kernel runs on, on the gateway
        elif km is not None and isinstance(km.provisioner, SandboxProvisioner):
            await km.provisioner.detach()
            # The kernel's connection info (its key too) is in its saved state, for connect();
            # the temporary connection file jupyter_client wrote at the start is not.
            km.cleanup_connection_file()

    async def _stop_approvals(self) -> None:
        """On a gateway: answer the kernel's approval questions no more (the gateway denies)."""
        approvals, self._approvals = self._approvals, None
        if approvals is not None:
            await approvals.stop()

    def _stop_lifetime(self) -> None:
        expiry, self._expiry, self._deadline = self._expiry, None, None
        if expiry is not None and expiry is not asyncio.current_task():
            expiry.cancel()

    async def __aenter__(self) -> AsyncSandboxSession:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()

    # ------------------------------------------------------------------ running code

    async def run(  # the timeout is the kernel's, not this coroutine's
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: DisplayCallback | None = None,
        max_output: int | None = None,
        store_history: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> Execution:
        """Run ``code`` and return what it did.

        ``timeout``: seconds after which the code is interrupted (and, if it ignores the
        interrupt for :data:`INTERRUPT_GRACE` s, the kernel restarted); the kernelspec's
        ``exec_timeout`` applies in any case. ``on_stdout``/``on_stderr`` get each piece
        of output as it comes (as the kernel printed it), ``on_display`` each
        :class:`Result`, the cell's value (``is_main_result``) too.
        ``max_output``: bytes of output for this run (see the class). The result's
        ``stdout`` and ``stderr`` are the text as a terminal would show it in the end
        (:func:`rendered`: no colours, a progress bar's last state only).
        ``store_history=False``: the run leaves no entry in the kernel's history
        (``In``, ``Out``, ``_``) and does not count (``execution_count``). ``env``:
        environment variables for this run alone (``os.environ`` and what it starts),
        set before it and put back as they were after it.

        Raises:
            ValueError: ``env`` holds what is no environment variable.
            KernelTakenOverError: another process took the kernel over.
            SandboxKernelError: the kernel had to be restarted and could not be.
        """
        if env:
            return await self._run_in_env(
                env,
                code,
                timeout=timeout,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                on_display=on_display,
                max_output=max_output,
                store_history=store_history,
            )
        km, kc = self._manager(), self._client()
        execution = Execution()
        if not await km.is_alive():
            why = self._stopped_because()
            if not self.restart_on_death:
                execution.status = "error"
                execution.error = ExecutionError("KernelDied", f"{why}; restart() it")
                return execution
            await self.restart()
            execution.restarted = True
            execution.restart_reason = why
        limit = max_output if max_output is not None else self.max_output
        request = _execute_request(kc, code, store_history, limit)
        execution.msg_id = request["header"]["msg_id"]
        meter = await self._meter()
        gateway = self._gateway_kernel()
        cpu_before = await _gateway_cpu(gateway) if gateway is not None else None
        started = time.monotonic()
        kc.shell_channel.send(request)
        try:
            reply = await self._collect(execution, timeout, on_stdout, on_stderr, on_display)
        except asyncio.CancelledError:
            # The caller gave up (asyncio.wait_for, a cancelled task): the code stops too.
            with contextlib.suppress(Exception):
                await asyncio.shield(km.interrupt_kernel())
            raise
        finally:
            execution.duration = time.monotonic() - started
            if meter is not None:
                execution.cpu_time, execution.peak_memory = meter.stop()
        if gateway is not None and cpu_before is not None:
            # The gateway's reading is the sandbox's CPU since it started (the difference is
            # the run's) and its peak memory since then, not the run's: peak_memory stays None.
            cpu_after = await _gateway_cpu(gateway)
            execution.cpu_time = None if cpu_after is None else max(0.0, cpu_after - cpu_before)
        return await self._outcome(km, execution, reply, limit)

    async def _run_in_env(self, env: Mapping[str, str], code: str, **run: Any) -> Execution:
        """``run(code, **run)`` with the environment variables ``env`` set in the kernel
        before it, and put back as they were after it."""
        setting = env_cell(env)
        before = await self.run(setting, store_history=False)
        saved = saved_env(before.results, env)
        try:
            return await self.run(code, **run)
        finally:
            # Put back even after a failed or cancelled run; a kernel gone meanwhile
            # (restarted, shut down) has its own environment anyway.
            if saved:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.run(restore_cell(saved), store_history=False))

    async def _outcome(
        self, km: AsyncKernelManager, execution: Execution, reply: dict[str, Any] | None, limit: int | None
    ) -> Execution:
        """The run's ``execution`` once its messages are in: its output as a terminal shows
        it, its status and error as the reply, the host or the session's lifetime say (a
        kernel that ended is restarted for the next run)."""
        if execution.truncated:
            _as_asked(execution, None if limit is None else int(limit))
        execution.stdout, execution.stderr = rendered(execution.stdout), rendered(execution.stderr)
        if self._expired is not None:
            execution.status = "error"
            execution.error = ExecutionError("LifetimeExceeded", self._expired)
            return execution
        if reply is not None:
            body = reply["content"]
            execution.status = str(body.get("status", "error"))
            execution.execution_count = body.get("execution_count")
            if execution.status == "error":
                execution.error = ExecutionError.from_content(body)
        error = execution.error
        if error is not None and error.ename == "KernelTakenOver":
            raise KernelTakenOverError(error.evalue)
        if (
            error is not None
            and error.ename in KERNEL_ENDED
            and self.restart_on_death
            and not await km.is_alive()
        ):
            await self.restart()
            execution.restarted = True
            execution.restart_reason = f"{error.ename}: {error.evalue}"
            execution.error = ExecutionError(
                error.ename,
                f"{error.evalue} [the session restarted the kernel: the next run works, "
                "without the earlier variables]",
                error.traceback,
            )
        return execution

    def _stopped_because(self) -> str:
        """Why the kernel is not running, as the host knows it."""
        provisioner = self._manager().provisioner
        stop = provisioner.limit_stop if isinstance(provisioner, SandboxProvisioner) else None
        if stop is not None:
            return f"the kernel was stopped ({stop.ename}: {stop.reason})"
        return "the kernel had stopped"

    async def _collect(
        self,
        execution: Execution,
        timeout: float | None,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        on_display: DisplayCallback | None,
    ) -> dict[str, Any] | None:
        """Gather the run's output until its reply and the kernel's idle; the reply, or
        None if the kernel ended without one (``execution.error`` then says why)."""
        km, kc = self._manager(), self._client()

        def fail(ename: str, evalue: str) -> None:
            execution.status = "error"
            execution.error = ExecutionError(ename, evalue)

        async def restart() -> None:  # the run ignored its timeout's interrupt
            await self.restart()
            execution.restarted = True

        messages = RunMessages(
            km,
            kc,
            execution.msg_id,
            take=lambda message: _take(message, execution, on_stdout, on_stderr, on_display),
            fail=fail,
            restart=restart,
            ending=self._ending,
            check_every=ALIVE_CHECK_INTERVAL,
            grace=INTERRUPT_GRACE,
        )
        return await messages.gather(timeout)

    async def _meter(self) -> _Meter | None:
        """Start measuring the sandbox's CPU and peak memory (host side), if it can be."""
        provisioner = self._manager().provisioner
        if not isinstance(provisioner, SandboxProvisioner) or provisioner.container_id is None:
            return None
        container_id = provisioner.container_id
        if self._sandbox_usage is None or self._sandbox_usage[0] != container_id:
            try:
                pid = await provisioner.backend.main_pid(container_id)
            except SandboxKernelError:
                return None
            if pid is None:
                return None
            # One Docker call and one look at its cgroups per sandbox, not per run.
            self._sandbox_usage = (container_id, SandboxUsage(pid))
        # On the loop: a few reads of cgroup files (microseconds, never waiting on a
        # disk), where a thread would cost a wake-up each way on every run.
        return _Meter(self._sandbox_usage[1])

    # ------------------------------------------------------------------ plumbing

    def _manager(self) -> AsyncKernelManager:
        km = self.km
        if km is None:
            msg = self._expired or "the session has no kernel: start() it first (or it was shut down)"
            raise RuntimeError(msg)
        provisioner = km.provisioner
        if isinstance(provisioner, SandboxProvisioner) and provisioner.taken_over is not None:
            msg = f"Sandboxed kernel {km.kernel_id}: {provisioner.taken_over}"
            raise KernelTakenOverError(msg)
        return km

    def _gateway_kernel(self) -> GatewayKernel | None:
        """The owner's routes of the session's kernel, if it is on a gateway."""
        km = self._manager()
        if not _on_gateway(km):
            return None
        from sandbox_kernel.agents.gateway_session import GatewayKernel

        return GatewayKernel(str(km.kernel_id))

    def _client(self) -> AsyncKernelClient:
        if self.kc is None:
            self._manager()
            msg = "the session has no kernel client"
            raise RuntimeError(msg)
        return self.kc

    async def _workspace_files(self) -> WorkspaceFiles:
        provisioner = self._manager().provisioner
        if not isinstance(provisioner, SandboxProvisioner):
            msg = "the session's kernel is not a sandboxed kernel"
            raise TypeError(msg)
        if self._workspace is None:
            self._workspace = await workspace_files(
                await provisioner.get_provisioner_info(), provisioner.backend
            )
        return self._workspace


def _on_gateway(km: object) -> TypeGuard[SessionGatewayKernelManager]:
    """Whether ``km`` runs its kernel on a sandbox gateway. Such a manager exists only once
    its module is imported, which a local session never does."""
    module = sys.modules.get("sandbox_kernel.agents.gateway_session")
    return module is not None and isinstance(km, module.SessionGatewayKernelManager)


async def _gateway_cpu(gateway: GatewayKernel) -> float | None:
    """The CPU seconds the gateway reads for the kernel's sandbox; None if it cannot."""
    try:
        used = await gateway.usage()
    except SandboxKernelError:
        return None
    value = used.get("cpu_seconds")
    return float(value) if isinstance(value, int | float) else None


def _gateway_policy(status: Mapping[str, Any], km: AsyncKernelManager) -> dict[str, Any]:
    """:meth:`AsyncSandboxSession.current_policy` from a gateway's kernel status."""
    limits = dict(status.get("limits") or {})
    output_limit = limits.pop("output_limit", None)
    network = status.get("network")
    model: dict[str, Any] = getattr(km, "kernel", None) or {}
    found = model.get("sandbox")
    sandbox: dict[str, Any] = found if isinstance(found, dict) else {}
    return {
        **limits,
        "network": network,
        "allowed_domains": list(status.get("allowed_domains") or []),
        "approval": "egress" if status.get("approval") else "off",
        "output_limit": output_limit,
        "lifecycle": sandbox.get("lifecycle"),
        "image": status.get("image"),
        "workspace": None,
        "working_folder": None,
    }


class _Meter:
    """The sandbox's CPU time and peak memory over one run (its host cgroup's files)."""

    def __init__(self, usage: SandboxUsage) -> None:
        self.usage = usage
        self.cpu = usage.cpu_seconds()
        self.peak = usage.peak_memory()

    def stop(self) -> tuple[float | None, int | None]:
        now = self.usage.cpu_seconds()
        cpu = None if now is None or self.cpu is None else max(0.0, now - self.cpu)
        peak = self.peak.read()
        self.peak.close()
        return cpu, peak


def _check_lifetime(seconds: float | None) -> float | None:
    """A session's ``lifetime``, checked.

    Raises:
        ValueError: not None nor a positive number of seconds.
    """
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        msg = f"lifetime={seconds!r} must be a positive number of seconds, or None for no lifetime"
        raise ValueError(msg)
    return float(seconds)


def _execute_request(
    kc: AsyncKernelClient, code: str, store_history: bool, limit: int | None
) -> dict[str, Any]:
    """The ``execute_request`` of a run of ``code`` with an output limit of ``limit`` bytes."""
    # The host counts every byte the kernel publishes, each message's own few hundred too.
    allowance = {"output_limit": int(limit) + MESSAGE_ALLOWANCE} if limit is not None else None
    metadata = {"sandbox_kernel": allowance} if allowance else {}
    content = {
        "code": code,
        "silent": False,
        "store_history": store_history,
        "user_expressions": {},
        "allow_stdin": False,
        # Each run stands alone: one that fails (or is interrupted) aborts no later one.
        "stop_on_error": False,
    }
    request: dict[str, Any] = kc.session.msg("execute_request", content, metadata=metadata)
    return request


def _take(
    message: dict[str, Any],
    execution: Execution,
    on_stdout: OutputCallback | None,
    on_stderr: OutputCallback | None,
    on_display: DisplayCallback | None,
) -> bool:
    """Add one IOPub message of the run to ``execution``; True when the kernel went idle."""
    kind, body = message["header"].get("msg_type"), message["content"]
    if kind == "status":
        return bool(body.get("execution_state") == "idle")
    if kind == "stream":
        text = str(body.get("text", ""))
        if body.get("name") == "stderr":
            execution.stderr += text
            if on_stderr is not None:
                on_stderr(text)
        else:
            execution.stdout += text
            if on_stdout is not None:
                on_stdout(text)
    elif kind in ("execute_result", "display_data", "update_display_data"):
        result = Result(
            dict(body.get("data") or {}),
            dict(body.get("metadata") or {}),
            is_main_result=kind == "execute_result",
        )
        execution.results.append(result)
        if on_display is not None:
            on_display(result)
    elif kind == "error":
        execution.error = ExecutionError.from_content(body)
    return False


_DROPPED = re.compile(r"\n\[\.\.\. [^\n]{1,200}? of output dropped: over [^\n]{1,200}? \.\.\.\]\n")


def _as_asked(execution: Execution, asked: int | None) -> None:
    """A run's output cut by the host: the text around the host's marker of what was
    dropped keeps whole lines where its lines are short, and when the run asked for a
    limit (sent to the host with the :data:`MESSAGE_ALLOWANCE` added) the host's notices
    name the limit asked."""
    for name in ("stdout", "stderr"):
        text = getattr(execution, name)
        if asked is not None:
            said, meant = amount(asked + MESSAGE_ALLOWANCE), amount(asked)
            text = text.replace(f"more than {said} of output", f"more than {meant} of output")
            text = text.replace(f"output limit of {said} set", f"output limit of {meant} set")
        marker = _DROPPED.search(text)
        if marker is not None:
            head, tail = text[: marker.start()], text[marker.end() :]
            # Cut at a line break near the marker: whole lines read better (a cut
            # line is dropped, as the marker says output was).
            end = head.rfind("\n", len(head) - len(head) // 4)
            head = head[: end + 1] if end >= 0 else head
            start = tail.find("\n", 0, len(tail) // 4)
            tail = tail[start + 1 :] if start >= 0 else tail
            text = f"{head.removesuffix(chr(10))}{marker.group(0)}{tail}"
        setattr(execution, name, text)


class AsyncSessionFiles:
    """The kernel's workspace from the host: what the kernel sees in its working folder.

    Paths are relative to the kernel's working folder, or absolute inside the sandbox
    (``/workspace/...``); none may leave the workspace or pass through a link. Files
    written here belong to the kernel's user. See :mod:`~sandbox_kernel.agents.files`.
    """

    def __init__(self, session: AsyncSandboxSession) -> None:
        self._session = session

    async def upload(self, path: str, data: bytes | str) -> str:
        """Write ``data`` to ``path`` (replacing it at once); the path in the sandbox."""
        gateway = self._session._gateway_kernel()
        if gateway is not None:
            return await gateway.upload(path, data)
        files = await self._session._workspace_files()
        written = await asyncio.to_thread(files.upload, path, data)
        self._audit("upload", written, len(data))
        return written

    async def download(self, path: str, max_bytes: int | None = None) -> bytes:
        gateway = self._session._gateway_kernel()
        if gateway is not None:
            return await gateway.download(path, max_bytes)
        files = await self._session._workspace_files()
        if max_bytes is None:
            data = await asyncio.to_thread(files.download, path)
        else:
            data = await asyncio.to_thread(files.download, path, max_bytes)
        self._audit("download", path, len(data))
        return data

    async def list(self, path: str = ".") -> list[FileInfo]:
        gateway = self._session._gateway_kernel()
        if gateway is not None:
            return await gateway.list(path)
        files = await self._session._workspace_files()
        return await asyncio.to_thread(files.list, path)

    async def delete(self, path: str, recursive: bool = False) -> None:
        gateway = self._session._gateway_kernel()
        if gateway is not None:
            await gateway.delete(path, recursive)
            return
        files = await self._session._workspace_files()
        await asyncio.to_thread(files.delete, path, recursive)
        self._audit("delete", path, recursive=recursive)

    def _audit(self, action: str, path: str, size: int | None = None, **details: Any) -> None:
        """An audit line for what the host did in the kernel's workspace."""
        provisioner = self._session._manager().provisioner
        if isinstance(provisioner, SandboxProvisioner):
            provisioner.audit("files", action=action, path=path, bytes=size, **details)


class SandboxSession:
    """:class:`AsyncSandboxSession` for code without asyncio (the same arguments).

    Its kernel is driven from an event loop in a thread of its own, so it works inside a
    running event loop too (a notebook, say); the ``on_*`` callbacks run in that thread.
    """

    def __init__(
        self, kernel_name: str = "sandboxed-python", cwd: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> None:
        self._session = AsyncSandboxSession(kernel_name, cwd, **kwargs)
        self._loop: BackgroundLoop | None = None
        self.files = SessionFiles(self)

    @classmethod
    def connect(cls, kernel_id: str, *, take_over: bool = False, **kwargs: Any) -> SandboxSession:
        """See :meth:`AsyncSandboxSession.connect`."""
        session = cls.__new__(cls)
        session._loop = None
        session.files = SessionFiles(session)
        try:
            session._session = session._call(
                AsyncSandboxSession.connect(kernel_id, take_over=take_over, **kwargs)
            )
        except BaseException:
            session._close_loop()
            raise
        return session

    @property
    def kernel_id(self) -> str | None:
        return self._session.kernel_id

    @property
    def km(self) -> AsyncKernelManager | None:
        return self._session.km

    @property
    def cwd(self) -> Path | None:
        """The host folder the kernel works in (see :attr:`AsyncSandboxSession.cwd`)."""
        return self._session.cwd

    def start(self) -> SandboxSession:
        try:
            self._call(self._session.start())
        except BaseException:
            self._close_loop()
            raise
        return self

    def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: DisplayCallback | None = None,
        max_output: int | None = None,
        store_history: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> Execution:
        """See :meth:`AsyncSandboxSession.run`. Ctrl-C interrupts the kernel too."""
        run = self._session.run(
            code,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_display=on_display,
            max_output=max_output,
            store_history=store_history,
            env=env,
        )
        future = self._submit(run)
        try:
            return future.result()
        except KeyboardInterrupt:
            # Stop waiting for this run (its readers go with it), and the code with it.
            future.cancel()
            with contextlib.suppress(Exception):
                self._call(self._session.interrupt())
            raise

    def interrupt(self) -> None:
        self._call(self._session.interrupt())

    def current_policy(self) -> dict[str, Any]:
        """See :meth:`AsyncSandboxSession.current_policy`."""
        return self._call(self._session.current_policy())

    def run_command(
        self,
        command: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> CommandResult:
        """See :meth:`AsyncSandboxSession.run_command`."""
        return self._call(
            self._session.run_command(command, timeout=timeout, cwd=cwd, env=env, max_output=max_output)
        )

    def set_lifetime(self, seconds: float | None) -> None:
        """See :meth:`AsyncSandboxSession.set_lifetime`."""
        self._call(self._session.set_lifetime(seconds))

    @property
    def lifetime_left(self) -> float | None:
        return self._session.lifetime_left

    def restart(self) -> None:
        self._call(self._session.restart())

    def pause(self) -> Paused:
        return self._call(self._session.pause())

    def resume(self) -> None:
        self._call(self._session.resume())

    def usage(self) -> dict[str, Any]:
        """See :meth:`AsyncSandboxSession.usage`."""
        return self._call(self._session.usage())

    def shutdown(self) -> None:
        try:
            self._call(self._session.shutdown())
        finally:
            self._close_loop()

    def detach(self) -> None:
        try:
            self._call(self._session.detach())
        finally:
            self._close_loop()

    def __enter__(self) -> SandboxSession:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._submit(coro).result()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._loop is None:
            self._loop = BackgroundLoop(name="sandbox-kernel-session")
        return self._loop.submit(coro)

    def _close_loop(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None


class SessionFiles:
    """:class:`AsyncSessionFiles` for :class:`SandboxSession`."""

    def __init__(self, session: SandboxSession) -> None:
        self._session = session

    def upload(self, path: str, data: bytes | str) -> str:
        return self._session._call(self._session._session.files.upload(path, data))

    def download(self, path: str, max_bytes: int | None = None) -> bytes:
        return self._session._call(self._session._session.files.download(path, max_bytes))

    def list(self, path: str = ".") -> list[FileInfo]:
        return self._session._call(self._session._session.files.list(path))

    def delete(self, path: str, recursive: bool = False) -> None:
        self._session._call(self._session._session.files.delete(path, recursive))
