"""One event loop in a daemon thread, for watching kernels while their manager's loop sleeps.

A provisioner's own coroutines run only while its manager's loop runs. Under
jupyter_server that is always; under jupyter_client's blocking ``KernelManager`` it is
only during a call (``start_kernel``, ``is_alive``...), so a watchdog there would never
see a cell overrun its limit or the kernel die while the client waits for a reply. The
watchdogs run here instead, one task per kernel. While any runs, the loop's *chores*
(housekeeping such as removing other processes' orphans) run every so often too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


async def poll_until(condition: Callable[[], Awaitable[bool]], timeout: float, interval: float) -> bool:
    """Whether ``condition`` comes true within ``timeout`` seconds, asked every
    ``interval`` seconds (at least once)."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True


class BackgroundLoop:
    """An event loop running in its own daemon thread.

    :meth:`instance` is the process's watchdog loop, started on first use; the egress
    proxy has a loop of its own, so relaying traffic never delays a watchdog.
    """

    _instance: ClassVar[BackgroundLoop | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "sandbox-kernel-watchdog") -> None:
        self._loop = asyncio.new_event_loop()
        # Submitted coroutines not done yet, and the chores; touched on the loop's thread only.
        self._work = 0
        self._chores: dict[str, tuple[Callable[[], Awaitable[Any]], Callable[[], float]]] = {}
        self._chore_tasks: dict[str, asyncio.Task[None]] = {}
        self.thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self.thread.start()

    @classmethod
    def instance(cls) -> BackgroundLoop:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def close(self) -> None:
        """Cancel what runs, stop the loop and its thread (the process's own loops run
        until it exits)."""

        async def cancel_all() -> None:
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.thread.join(timeout=5)
        self._loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the background loop; cancelling the future cancels it. The
        loop's chores run while at least one submitted coroutine does."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._loop.call_soon_threadsafe(self._work_started)
        future.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._work_ended))
        return future

    def add_chore(self, name: str, job: Callable[[], Awaitable[Any]], interval: Callable[[], float]) -> None:
        """Run ``job`` every ``interval()`` seconds while submitted work runs (a kernel to
        watch), the first time one interval after that work began; never while none
        does. Thread-safe; a chore added again under ``name`` replaces the job. What the
        job raises is logged, and the chore goes on."""
        self._loop.call_soon_threadsafe(self._add_chore, name, job, interval)

    def _add_chore(self, name: str, job: Callable[[], Awaitable[Any]], interval: Callable[[], float]) -> None:
        self._chores[name] = (job, interval)
        if self._work:
            self._start_chores()

    def _work_started(self) -> None:
        self._work += 1
        self._start_chores()

    def _work_ended(self) -> None:
        self._work -= 1
        if not self._work:
            for task in self._chore_tasks.values():
                task.cancel()
            self._chore_tasks.clear()

    async def _wait_interval(self, name: str) -> None:
        """One interval of chore ``name``, read again every second: a shorter one set
        meanwhile (a test's, a setting's) takes effect without waiting out the old one."""
        started = self._loop.time()
        while self._work:
            remaining = self._chores[name][1]() - (self._loop.time() - started)
            if remaining <= 0:
                return
            await asyncio.sleep(min(remaining, 1.0))

    def _start_chores(self) -> None:
        for name in self._chores:
            task = self._chore_tasks.get(name)
            if task is None or task.done():
                self._chore_tasks[name] = self._loop.create_task(self._run_chore(name))

    async def _run_chore(self, name: str) -> None:
        while self._work:
            await self._wait_interval(name)
            if not self._work:
                return
            job, interval = self._chores[name]
            try:
                # Once begun, a job finishes even if the work ends meanwhile.
                await asyncio.shield(job())
            except Exception:
                log.exception("Background chore %r failed; it runs again in %g s", name, interval())
