"""The end of a kernel's sandbox: why it ended, told once, to its clients and the logs.

Poll, the watchdog, a failed pause and a kill all notice an end; :class:`Exits` notes it
once per container, with the cause a deliberate stop gave (a limit, a failed resume) or
the host saw (the memory limit), answers what its clients still wait for, and refuses new
executions until the kernel runs again.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.errors import SandboxKernelError
from sandbox_kernel.host.background import poll_until
from sandbox_kernel.kernel.channels import KernelChannels
from sandbox_kernel.lifecycle.judge import memory_reason


@dataclass(frozen=True)
class LimitStop:
    """A limit (memory, wall-clock, idle) stopped the kernel: which, why, when, which container."""

    ename: str
    reason: str
    time: float
    container_id: str


class Exits:
    """The ends of one kernel's sandboxes, across its restarts."""

    def __init__(
        self,
        kernel_id: str,
        backend: SandboxBackend,
        channels: KernelChannels,
        log: logging.Logger | logging.LoggerAdapter[Any],
        memory: Callable[[], str],
    ) -> None:
        self.kernel_id = kernel_id
        self._backend = backend
        self._channels = channels
        self._log = log
        self.memory = memory
        self._lock = threading.Lock()
        self.code: int | None = None
        self.noted: str | None = None  # the container whose end was noted
        # (container, ename, reason) of a stop the host decided; the cause of the current
        # container's end once noted.
        self._planned: tuple[str, str, str] | None = None
        self.cause: tuple[str, str] | None = None
        #: The last time a limit stopped the kernel, kept across restarts.
        self.limit_stop: LimitStop | None = None

    def starting(self) -> None:
        """A new container is about to run: nothing of the last one's end applies to it."""
        self.code = None
        self.cause = None

    def plan(self, container_id: str, ename: str, reason: str) -> None:
        """The host is about to end ``container_id``: its clients get ``ename``: ``reason``."""
        self._planned = (container_id, ename, reason)

    async def kill_for(self, container_id: str, ename: str, reason: str) -> None:
        """Kill the sandbox deliberately; its waiting clients get ``ename``: ``reason``."""
        self.plan(container_id, ename, reason)
        await self._backend.signal(container_id, signal.SIGKILL)

        async def stopped() -> bool:  # so nothing it still sends can follow our notices
            return (await self._backend.state(container_id))[1] is not None

        await poll_until(stopped, 10.0, 0.1)
        _, code = await self._backend.state(container_id)
        await self.note(container_id, 137 if code is None else code)

    async def note(self, container_id: str, code: int, status: str = "exited") -> None:
        """Once per container (poll and the watchdog both notice): log why, tell clients.

        The cause is kept, so that a teardown cutting this short still answers with it.
        """
        if self.noted == container_id:
            return
        # Asked before anything is published: poll (another thread) takes the end as noted
        # once it sees ``noted``, and the restarter's teardown may follow at once.
        ename, reason = await self._cause(container_id, code)
        with self._lock:
            if self.noted == container_id:
                return
            self.code, self.cause = code, (ename, reason)
            if ename != "KernelDied":
                self.limit_stop = LimitStop(ename, reason, time.time(), container_id)
            self.noted = container_id  # last: whoever sees it finds the rest
        self._channels.lifecycle(
            "exit", container=container_id[:12], exit_code=code, ename=ename, reason=reason
        )
        if ename == "KernelDied":
            self._log.info("Sandboxed kernel %s stopped (%s, exit code %d)", self.kernel_id, status, code)
            if code not in (0, 128 + signal.SIGKILL, 128 + signal.SIGTERM):
                # Not a shutdown nor a kill: say why, while the container (its output) is there.
                output = await self._backend.logs(container_id) or "(none)"
                self._log.warning("Sandboxed kernel %s: its last output:\n%s", self.kernel_id, output)
        else:
            self._log.warning("Sandboxed kernel %s ended: %s", self.kernel_id, reason)
        await self._channels.abandon(ename, reason)
        # Until it is restarted, a new execution gets the kernel's end at once: a program
        # with no restarter (a plain KernelManager) must not wait for a dead kernel.
        if self._channels.auditor is not None and ename != "IdleLimitExceeded":  # that one refuses already
            self._channels.refuse(
                ename,
                f"{reason}. The kernel is not running: restart it (a Jupyter server's restarter does, "
                "by itself; with a KernelManager, call restart_kernel())",
            )

    async def _cause(self, container_id: str, code: int) -> tuple[str, str]:
        planned = self._planned
        if planned is not None and planned[0] == container_id:
            return planned[1], planned[2]
        try:
            oom = await self._backend.oom_killed(container_id)
        except SandboxKernelError:
            oom = False
        if oom:
            return "MemoryLimitExceeded", memory_reason(self.memory())
        return "KernelDied", f"the kernel stopped (exit code {code}) before this execution finished"

    def teardown_answer(self) -> tuple[str, str]:
        """What clients still waiting are told when the sandbox goes: its end, if known."""
        return self.cause or ("KernelDied", "the kernel stopped or restarted before this execution finished")
