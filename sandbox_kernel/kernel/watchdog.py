"""One kernel's watchdog: it looks at the kernel, has :func:`~.watchdog.judge` decide,
and acts.

It runs on the background loop (whether or not its manager's loop runs). It tells
waiting clients when the kernel dies, enforces the idle limit, freezes a quiet kernel
(and thaws it before anything else it does to it), pauses an idle kernel,
backs up the in-kernel wall-clock limit (interrupt, then kill), answers pause requests of
other processes, lets go when another process takes the kernel over, and keeps the
owner file fresh. A failing step is logged and retried: a watchdog never gives up while
its kernel runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import time
from dataclasses import dataclass, replace
from typing import Any

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.errors import DockerUnavailableError, PauseError
from sandbox_kernel.host.cgroups import cpu_seconds, oom_kills
from sandbox_kernel.kernel.channels import KernelChannels
from sandbox_kernel.kernel.exits import Exits
from sandbox_kernel.kernel.freezer import Freezer
from sandbox_kernel.kernel.holding import Holding
from sandbox_kernel.kernel.manager import ManagerLink
from sandbox_kernel.kernel.pauser import Pauser
from sandbox_kernel.kernel.site import KernelSite
from sandbox_kernel.lifecycle.judge import Act, Look, Verdict, Watch, WatchLimits, judge
from sandbox_kernel.lifecycle.ownership import OWNER_FILE
from sandbox_kernel.lifecycle.pausing import Paused, PauseRequests
from sandbox_kernel.plan.settings import SandboxSettings
from sandbox_kernel.services import PROCESS, Services

#: How often a watchdog asks the backend for its kernel's state although the event
#: stream says it runs (seconds).
STATE_CHECK_INTERVAL = 30.0
#: Seconds in a row without the kernel's CPU time before the watchdog says it cannot
#: limit computing outside executions.
CPU_MISSES_TO_WARN = 10
#: How often a live owner touches its kernels' owner files (seconds).
OWNER_TOUCH_INTERVAL = 60.0
#: After a pause the watchdog decided failed (say the disk budget is spent), how long
#: before it tries again (seconds): it is logged, never retried twice a second.
PAUSE_RETRY_INTERVAL = 300.0
#: Seconds between two looks at a kernel.
LOOK_INTERVAL = 0.5
#: Seconds between two looks at a frozen kernel: a client's message thaws it without the
#: watchdog; a take-over, a pause asked for or an idle limit wait this long at most.
FROZEN_LOOK_INTERVAL = 2.0


@dataclass
class _Deep:
    """What the deep looks carry from one to the next."""

    pid: int | None = None
    next_deep: float = 0.0
    next_state: float = 0.0
    next_touch: float = 0.0
    cpu_misses: int = 0
    cpu_unknown: bool = False


def watch_limits(settings: SandboxSettings) -> WatchLimits:
    """The limits a kernel's settings (narrowed by its start) have its watchdog enforce."""
    s = settings
    return WatchLimits(
        s.exec_timeout, s.exec_kill_grace, s.idle_timeout, s.memory, s.pause_after, s.freeze_idle_after
    )


class Watchdog:
    """Watches one kernel while it runs (:meth:`start`, :meth:`stop`)."""

    def __init__(
        self,
        site: KernelSite,
        backend: SandboxBackend,
        channels: KernelChannels,
        holding: Holding,
        pauser: Pauser,
        exits: Exits,
        link: ManagerLink,
        log: logging.Logger | logging.LoggerAdapter[Any],
        services: Services = PROCESS,
        freezer: Freezer | None = None,
    ) -> None:
        self._site = site
        self._backend = backend
        self._channels = channels
        self._holding = holding
        self._pauser = pauser
        self._exits = exits
        self._link = link
        self.log = log
        self._future: concurrent.futures.Future[None] | None = None
        self._next_auto_pause = 0.0
        self._services = services
        #: Freezes the kernel when quiet; whatever else acts on the sandbox thaws it first.
        self.freezer = freezer or Freezer(site, backend, channels, log)

    @property
    def kernel_id(self) -> str:
        return self._site.kernel_id

    def start(self, container_id: str, limits: WatchLimits) -> None:
        """Watch the kernel; while this process watches kernels, it also removes those of
        owners that died (see :class:`~.ownership.OrphanReaper`)."""
        self._link.remember_loop()
        self.freezer.watch()
        self._future = self._services.loop.submit(self._watch(container_id, limits))
        if self._site.runtime_dir is not None:
            self._services.reaper.watch(self._site.runtime_dir.parent)

    def stop(self) -> None:
        """Stop watching, and thaw the kernel: whatever comes next (a removal, a restart,
        another process adopting it) finds it running."""
        if self._future is not None:
            self._future.cancel()
            self._future = None
        self.freezer.stop("no longer watched")

    async def _watch(self, container_id: str, limits: WatchLimits) -> None:
        self._backend.watch_exits(container_id)
        try:
            # One that another process froze, then died or let go (it reattaches).
            await self.freezer.thaw_found("watched anew")
            await self._loop(container_id, Watch(), limits)
        finally:
            self._backend.unwatch_exits(container_id)

    async def _loop(self, container_id: str, watch: Watch, limits: WatchLimits) -> None:
        deep = _Deep(next_touch=time.monotonic() + OWNER_TOUCH_INTERVAL)
        docker_lost = False
        runtime_dir = self._site.runtime_dir
        requests = PauseRequests(runtime_dir) if runtime_dir is not None else None
        freezer = self.freezer
        while self._site.container_id == container_id and self._channels.auditor is not None:
            await asyncio.sleep(FROZEN_LOOK_INTERVAL if freezer.frozen else LOOK_INTERVAL)
            auditor = self._channels.auditor
            if auditor is None:
                return
            try:
                holder = self._holding.elsewhere()  # a stat, a read only when it changed
                if holder is not None:
                    await self._holding.let_go(holder)
                    return
                if requests is not None:  # a stat, unless one came
                    await requests.answer(self._pause_thawed, self._pauser.resume)
                if self._pauser.suspended:
                    deep.pid, watch.oom_baseline = None, None  # the resumed sandbox is a new process
                    continue
                look = self._look(auditor.running(), auditor.idle_for())
                if look.now >= deep.next_deep:
                    look = await self._look_deep(container_id, look, deep, limits)
                    docker_lost = False
                if await self._act(container_id, judge(look, watch, self._now(limits)), look, limits):
                    return
            except DockerUnavailableError as exc:
                # dockerd restarting, say: keep watching once it is back.
                if not docker_lost:
                    self.log.warning("Sandboxed kernel %s: %s; retrying", self.kernel_id, exc)
                docker_lost, deep.next_deep = True, time.monotonic() + 2.0
            except Exception:
                self.log.exception("Sandboxed kernel %s: watchdog step failed; retrying", self.kernel_id)
                await asyncio.sleep(2.0)

    def _now(self, limits: WatchLimits) -> WatchLimits:
        """The limits to judge by now: no pause while a failed one waits to be tried
        again (the kernel may be frozen meanwhile)."""
        return limits if time.monotonic() >= self._next_auto_pause else replace(limits, pause_after=0.0)

    def _look(self, running: tuple[str, float] | None, idle_for: float | None) -> Look:
        """The cheap look: what the bridge and the freezer know."""
        now, freezer = time.monotonic(), self.freezer
        quiet_for = None if idle_for is None else min(idle_for, freezer.quiet_for(now))
        return Look(
            now,
            running=running,
            idle_for=idle_for,
            quiet_for=quiet_for,
            frozen=freezer.frozen,
            frozen_seconds=freezer.frozen_seconds(now),
        )

    async def _look_deep(self, container_id: str, look: Look, deep: _Deep, limits: WatchLimits) -> Look:
        """What costs a backend call or a cgroup read, about once a second."""
        now = look.now
        deep.next_deep = now + 1.0
        self.freezer.check()
        if not deep.pid:  # Docker says 0 for a sandbox not (yet) running
            deep.pid = await self._backend.main_pid(container_id) or None
        code = None
        if not self._backend.surely_running(container_id) or now >= deep.next_state:
            # The event stream says when it ends; ask now and then anyway.
            deep.next_state = now + STATE_CHECK_INTERVAL
            _, code = await self._backend.state(container_id)
        # The CPU bounds computing outside executions (with a wall-clock limit), and a
        # kernel computing is not one to freeze.
        pid = deep.pid
        wanted = limits.exec_timeout > 0 or limits.freeze_after > 0
        cpu = cpu_seconds(pid) if pid is not None and wanted else None
        if cpu is None and limits.exec_timeout > 0:
            # Perhaps a process of the sandbox's start that is gone: look again.
            deep.pid, deep.cpu_misses = None, deep.cpu_misses + 1
        else:
            deep.cpu_misses = 0
        if deep.cpu_misses >= CPU_MISSES_TO_WARN and not deep.cpu_unknown:
            deep.cpu_unknown = True
            self.log.warning(
                "Sandboxed kernel %s: cannot read its CPU time from the host's cgroup; computing "
                "outside executions is not limited (exec_timeout still bounds each execution)",
                self.kernel_id,
            )
        kills = oom_kills(pid) if pid is not None else None
        runtime_dir = self._site.runtime_dir
        if now >= deep.next_touch and runtime_dir is not None:
            # A persistent kernel's time-to-live counts from the last touch.
            deep.next_touch = now + OWNER_TOUCH_INTERVAL
            await asyncio.to_thread(os.utime, runtime_dir / OWNER_FILE)
        return replace(look, deep=True, exit_code=code, cpu=cpu, oom_kills=kills, busy=self._channels.busy())

    async def _act(self, container_id: str, verdict: Verdict, look: Look, limits: WatchLimits) -> bool:
        """Carry out the watchdog's verdict; True once the kernel has ended."""
        if verdict.act is Act.NOTHING:
            return False
        if verdict.act is Act.EXITED:
            if self._pauser.suspended:
                return False  # stopped for a pause meanwhile: not its end
            await self._exits.note(container_id, look.exit_code if look.exit_code is not None else 255)
            return True
        if verdict.act is Act.FREEZE:
            await self.freezer.freeze(verdict.why, limits.freeze_after)
            return False
        with self.freezer.kept_thawed(verdict.act.value):  # a frozen sandbox takes no signal
            return await self._carry_out(container_id, verdict, limits)

    async def _carry_out(self, container_id: str, verdict: Verdict, limits: WatchLimits) -> bool:
        """Interrupt, pause, stop or kill the (thawed) kernel; True once it has ended."""
        if verdict.act is Act.PAUSE:
            await self._pause(verdict)
            return False
        if verdict.act is Act.INTERRUPT:
            self.log.warning("Sandboxed kernel %s: %s; interrupting", self.kernel_id, verdict.why)
            await self._backend.signal(container_id, signal.SIGINT)
            return False
        if verdict.act is Act.STOP_IDLE:
            return await self._stop_idle(container_id, verdict, limits.idle_timeout)
        self.log.warning("Sandboxed kernel %s %s; killing it", self.kernel_id, verdict.why)
        await self._exits.kill_for(container_id, verdict.ename, verdict.reason)
        return True

    async def _pause_thawed(self, why: str) -> Paused:
        """A pause asked for by another process: a frozen kernel is thawed first (and
        checkpointed running: a frozen gVisor sandbox cannot be saved)."""
        return await self.freezer.thawed("pause", self._pauser.pause(why))

    async def _pause(self, verdict: Verdict) -> None:
        try:
            await self._pauser.pause(f"idle: {verdict.why}")
        except PauseError as exc:
            self._next_auto_pause = time.monotonic() + PAUSE_RETRY_INTERVAL
            self.log.warning("Sandboxed kernel %s: %s", self.kernel_id, exc)

    async def _stop_idle(self, container_id: str, verdict: Verdict, idle_timeout: float) -> bool:
        """Stop a kernel idle past its limit, for good: Jupyter must not restart it. New
        requests are refused from then on; clients are told now. False: a request came
        meanwhile, and it runs on."""
        # The auditor decides atomically: a request that came meanwhile wins. What
        # later requests are told is set first, so none meets the refusal without it.
        self._channels.refusal = (
            "IdleLimitExceeded",
            f"the kernel was stopped after {idle_timeout:g} s without executions (idle_timeout); "
            "restart the kernel to run code again",
        )
        auditor = self._channels.auditor
        if auditor is None or not auditor.refuse_if_idle(idle_timeout, verdict.reason):
            return False
        self.log.warning("Sandboxed kernel %s: idle for %g s; stopping it", self.kernel_id, idle_timeout)
        if self._link.stop_restarter():
            await asyncio.sleep(LOOK_INTERVAL)  # before the kill, or the restarter may see it first
        self._channels.notice(verdict.reason)
        await self._exits.kill_for(container_id, "IdleLimitExceeded", verdict.reason)
        return True
