"""A kernel's idle freeze: its sandbox frozen while nobody uses it, thawed at a client's
next message.

Under runsc 20240729 an idle sandbox on gVisor's default platform keeps 2-7 % of a core
busy whatever runs in it (docs/administrators/idle-cost.md); a frozen one (the host's
cgroup freezer) uses none and keeps its memory. The watchdog decides when (the pure
:func:`~sandbox_kernel.lifecycle.judge.judge`: no execution and no client message for
``freeze_idle_after``); this part does it, and undoes it:

- The bridge calls :meth:`Freezer.client_message` (its thread) before it passes on any
  signed message of a client: a frozen sandbox is thawed right there, one file write, so
  the message reaches a kernel that runs and is read in order. Heartbeats are the
  bridge's to answer meanwhile, and never thaw it: a flood of them costs one echo each.
- Whatever else the host does to the sandbox (a signal, a pause, a removal, letting it
  go) thaws it first, and so does Docker wanting it stopped (``docker stop``, a daemon
  restart: :mod:`~sandbox_kernel.host.stopping`), within a second or two: a frozen
  gVisor sandbox can neither be signalled nor saved (``runsc kill`` and ``runsc
  checkpoint`` wait for it) and, under cgroup v1, not even killed.
  :meth:`Freezer.kept_thawed` keeps it so while that is under way.
- A freeze and a client's message take one lock: the freeze looks again, under it, at
  the time of the last message and at requests in flight, so a message never meets a
  kernel that is being frozen after it came.

Kernel code cannot keep itself thawed (only clients' messages and executions count) nor
thaw itself; what it sees is time that jumps, as after a laptop's sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from sandbox_kernel.backends.base import SandboxBackend, SandboxFreezer
from sandbox_kernel.host.stopping import being_stopped
from sandbox_kernel.kernel.channels import SETTLE, KernelChannels
from sandbox_kernel.kernel.site import KernelSite

T = TypeVar("T")

#: Seconds a freeze may stay "freezing" (some process of the sandbox not stopped yet)
#: before it is undone: a sandbox half frozen must not stay so.
FREEZING_WAIT = 5.0
#: After a freeze that could not be done or undone, seconds before the next try.
RETRY_INTERVAL = 300.0


class Freezer:
    """Freezes and thaws one kernel's sandbox (see the module's docstring); thread-safe."""

    def __init__(
        self,
        site: KernelSite,
        backend: SandboxBackend,
        channels: KernelChannels,
        log: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        self._site = site
        self._backend = backend
        self._channels = channels
        self._log = log
        self._lock = threading.Lock()
        self._handle: SandboxFreezer | None = None  # the frozen sandbox's freezer
        self._since = 0.0  # when it was frozen (monotonic)
        self._frozen_before = 0.0  # seconds of earlier freezes
        self._last_message = time.monotonic()
        self._kept = 0  # callers that need it to run (kept_thawed)
        self._watched = False  # between watch() and stop(): a freeze may be done
        self._next_try = 0.0

    @property
    def kernel_id(self) -> str:
        return self._site.kernel_id

    @property
    def frozen(self) -> bool:
        return self._handle is not None

    def quiet_for(self, now: float) -> float:
        """Seconds since a client's last message (or since this kernel was watched)."""
        return now - self._last_message

    def frozen_seconds(self, now: float) -> float:
        """Seconds the sandbox has been frozen in all, the current freeze included."""
        with self._lock:
            return self._frozen_before + (now - self._since if self._handle is not None else 0.0)

    def watch(self) -> None:
        """The kernel's sandbox runs (a start, a restart, a reattach): quiet from now on,
        and the bridge's messages wake it."""
        self._last_message, self._watched = time.monotonic(), True
        bridge = self._channels.bridge
        if bridge is not None:
            bridge.on_client_message = self.client_message

    def stop(self, why: str) -> None:
        """No freeze from now on (one under way is called off), and thaw it (any thread)."""
        with self._lock:
            self._watched = False
        self.thaw(why)

    # ---------------------------------------------------------------- freezing

    async def freeze(self, why: str, quiet_after: float) -> bool:
        """Freeze the sandbox unless a client's message came within ``quiet_after``
        seconds, a request awaits its reply, or someone needs it running; whether it was
        frozen (background loop)."""
        now, container_id, bridge = time.monotonic(), self._site.container_id, self._channels.bridge
        if self._handle is not None or self._kept or container_id is None or bridge is None:
            return False
        if now < self._next_try or bridge.holding:
            return False
        handle = await self._backend.freezer(container_id)
        if handle is None:
            self._next_try = now + RETRY_INTERVAL
            return False
        with self._lock:
            if not self._may_freeze(quiet_after):
                return False
            mark = self._last_message
            bridge.echo_heartbeats = True
        frozen = False
        try:
            # A heartbeat already passed on is the kernel's to answer: let it come back first.
            await asyncio.sleep(SETTLE)
            with self._lock:
                if self._last_message != mark or not self._may_freeze(quiet_after):
                    return False
                if container_id != self._site.container_id or not handle.set(True):
                    self._next_try = time.monotonic() + RETRY_INTERVAL
                    self._log.info("Sandboxed kernel %s: its sandbox could not be frozen", self.kernel_id)
                    return False
                # The audit line under the lock: a thaw (the bridge's thread) comes after it.
                self._channels.lifecycle("freeze", reason=why)
                self._handle, self._since, frozen = handle, time.monotonic(), True
        finally:
            if not frozen:
                bridge.echo_heartbeats = False
        self._log.debug("Sandboxed kernel %s frozen (%s)", self.kernel_id, why)
        return True

    def _may_freeze(self, quiet_after: float) -> bool:
        """Under the lock: nobody needs the kernel now."""
        quiet = time.monotonic() - self._last_message >= quiet_after
        return quiet and self._watched and not self._kept and not self._channels.busy()

    def check(self) -> None:
        """Undo a freeze that has not taken hold, or that keeps Docker from stopping the
        sandbox (background loop, about once a second)."""
        handle = self._handle
        if handle is None:
            return
        if self._site.container_id in being_stopped():
            # docker stop/kill/rm -f or a daemon shutting down: its runsc kill waits for a
            # frozen sandbox (and with it the daemon), so let it go.
            self._next_try = time.monotonic() + RETRY_INTERVAL
            self._log.info("Sandboxed kernel %s: Docker is stopping its sandbox; thawed it", self.kernel_id)
            self.thaw("Docker is stopping it")
            return
        if time.monotonic() - self._since < FREEZING_WAIT:
            return
        if handle.state() == "freezing":
            self._next_try = time.monotonic() + RETRY_INTERVAL
            self._log.warning(
                "Sandboxed kernel %s: its sandbox did not freeze within %g s; it runs on",
                self.kernel_id,
                FREEZING_WAIT,
            )
            self.thaw("not frozen in time")

    # ---------------------------------------------------------------- thawing

    def client_message(self) -> None:
        """A client's signed message is on its way to the kernel (bridge thread)."""
        with self._lock:
            self._last_message = time.monotonic()
            if self._handle is None:
                return
        self.thaw("a client's message")

    def thaw(self, why: str) -> bool:
        """Let the sandbox run again, at once (any thread); whether it was frozen."""
        with self._lock:
            handle, self._handle = self._handle, None
            if handle is None:
                return False
            frozen_for = time.monotonic() - self._since
            self._frozen_before += frozen_for
            # (Not a sandbox another process took over: it is that one's to thaw.)
            if self._site.container_id is not None and not handle.set(False):
                self._log.info("Sandboxed kernel %s: its sandbox could not be thawed (gone?)", self.kernel_id)
            bridge = self._channels.bridge
            if bridge is not None:
                bridge.echo_heartbeats = False
            self._channels.lifecycle("thaw", reason=why, frozen_for=round(frozen_for, 3))
        self._log.debug("Sandboxed kernel %s thawed after %.1f s (%s)", self.kernel_id, frozen_for, why)
        return True

    @contextlib.contextmanager
    def kept_thawed(self, why: str) -> Iterator[None]:
        """Thaw the sandbox and keep it so while the block runs (a signal, a pause)."""
        with self._lock:
            self._kept += 1
        try:
            self.thaw(why)
            yield
        finally:
            with self._lock:
                self._kept -= 1

    async def thawed(self, why: str, step: Awaitable[T]) -> T:
        """Await ``step`` (a pause, say) with the sandbox thawed, and kept so meanwhile."""
        with self.kept_thawed(why):
            return await step

    async def thaw_found(self, why: str) -> None:
        """Thaw the sandbox whatever this process knows of it: one that another process
        froze, then died or let go (a reattach)."""
        container_id = self._site.container_id
        if self.thaw(why) or container_id is None:
            return
        handle = await self._backend.freezer(container_id)
        if handle is not None and handle.state() in ("frozen", "freezing"):
            handle.set(False)
            self._channels.lifecycle("thaw", reason=why)
            self._log.info("Sandboxed kernel %s: thawed its sandbox (%s)", self.kernel_id, why)
