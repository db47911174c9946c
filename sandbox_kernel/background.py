"""One event loop in a daemon thread, for watching kernels while their manager's loop sleeps.

A provisioner's own coroutines run only while its manager's loop runs. Under
jupyter_server that is always; under jupyter_client's blocking ``KernelManager`` it is
only during a call (``start_kernel``, ``is_alive``...), so a watchdog there would never
see a cell overrun its limit or the kernel die while the client waits for a reply. The
watchdogs run here instead, one task per kernel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """An event loop running in its own daemon thread.

    :meth:`instance` is the process's watchdog loop, started on first use; the egress
    proxy has a loop of its own, so relaying traffic never delays a watchdog.
    """

    _instance: ClassVar[BackgroundLoop | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "sandbox-kernel-watchdog") -> None:
        self._loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self.thread.start()

    @classmethod
    def instance(cls) -> BackgroundLoop:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the background loop; cancelling the future cancels it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)
