"""One run's messages, gathered for :meth:`~sandbox_kernel.agents.session.AsyncSandboxSession.run`.

The run's reply comes on the shell channel, its output on IOPub until the kernel's idle;
meanwhile the kernel is watched: a kernel that died is told from one slow to answer, a
run past its timeout is interrupted (and, if it ignores the interrupt, its kernel
restarted), and the session's lifetime may end it. What the messages mean for the run
(its :class:`~sandbox_kernel.agents.session.Execution`) is the session's: this module only
hands them on, and says why a run ended without its reply.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Awaitable, Callable, Container
from typing import Any, TypeVar

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager

T = TypeVar("T")


class RunMessages:
    """The messages of the run ``msg_id``, gathered from ``kc`` until its reply and the
    kernel's idle.

    ``take``: called with each IOPub message of the run, True when it is the kernel's
    idle; ``fail``: called with ``(ename, evalue)`` when the run ends without its reply
    (the kernel died, or ignored its timeout's interrupt); ``restart``: starts the kernel
    afresh, for a run that ignored its interrupt; ``ending``: set when the session's
    lifetime ran out; ``check_every``: seconds between checks that the kernel still runs,
    while the run is silent; ``grace``: seconds the kernel has to answer after an
    interrupt for the timeout.
    """

    def __init__(
        self,
        km: AsyncKernelManager,
        kc: AsyncKernelClient,
        msg_id: str,
        *,
        take: Callable[[dict[str, Any]], bool],
        fail: Callable[[str, str], None],
        restart: Callable[[], Awaitable[None]],
        ending: asyncio.Event,
        check_every: float,
        grace: float,
    ) -> None:
        self.km, self.kc, self.msg_id = km, kc, msg_id
        self.take, self.fail, self.restart = take, fail, restart
        self.ending = ending
        self.check_every = check_every
        self.grace = grace
        self.reply: dict[str, Any] | None = None
        self.idle = False
        self.timeout: float | None = None
        self.deadline: float | None = None
        self.timed_out: str | None = None  # set when interrupted for the timeout

    async def gather(self, timeout: float | None) -> dict[str, Any] | None:
        """The run's reply once it and the kernel's idle came (the idle, lost, is waited
        for a while at most), or None if the kernel ended without one (``fail`` was told
        why) or the session's lifetime ran out."""
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout if timeout else None
        self._shell = asyncio.ensure_future(self.kc.get_shell_msg())
        self._iopub = asyncio.ensure_future(self.kc.get_iopub_msg())
        ending = asyncio.ensure_future(self.ending.wait())  # the session's lifetime ran out
        try:
            while self.reply is None or not self.idle:
                wait = self.check_every
                if self.deadline is not None:
                    wait = max(0.0, min(wait, self.deadline - time.monotonic()))
                done, _ = await asyncio.wait(
                    {self._shell, self._iopub, ending}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                if ending in done:
                    return None  # run() says why
                if done:
                    self._received(done)
                    continue
                if self.reply is not None:
                    break  # the idle was lost (the output limit keeps it, but be sure)
                if not await self._silent():
                    return None
        finally:
            ending.cancel()
            for task in (self._shell, self._iopub):
                task.cancel()
            await asyncio.gather(self._shell, self._iopub, ending, return_exceptions=True)
        return self._as_timed_out(self.reply)

    def _received(self, done: Container[object]) -> None:
        """Take the messages that came (a shell one, an IOPub one or both), and wait for
        the next ones."""
        if self._shell in done:
            message = self._shell.result()
            self._shell = asyncio.ensure_future(self.kc.get_shell_msg())
            if message["parent_header"].get("msg_id") == self.msg_id:
                self.reply = message  # its idle follows (or, lost, waits a second at most)
        if self._iopub in done:
            message = self._iopub.result()
            self._iopub = asyncio.ensure_future(self.kc.get_iopub_msg())
            if message["parent_header"].get("msg_id") == self.msg_id:
                self.idle = self.take(message) or self.idle

    async def _silent(self) -> bool:
        """No message came for a while, and no reply: whether the kernel still runs, and
        the run within its timeout. False when the run is over without its reply."""
        now = time.monotonic()
        if not await self.km.is_alive():
            # The host answers for a dead kernel within a moment: wait for that.
            self.reply = await _within(asyncio.shield(self._shell), 2.0)
            if self.reply is None or self.reply["parent_header"].get("msg_id") != self.msg_id:
                self.fail("KernelDied", "the kernel stopped before it answered")
                return False
            return True
        if self.deadline is not None and now >= self.deadline:
            if self.timed_out is None:
                await self.km.interrupt_kernel()
                self.deadline = now + self.grace
                self.timed_out = (
                    f"the execution ran longer than its timeout of {self.timeout:g} s and was interrupted"
                )
            else:
                # It ignored the interrupt: only a fresh kernel ends it.
                self.fail(
                    "TimeoutError",
                    f"the execution ran longer than its timeout of {self.timeout:g} s and ignored the "
                    "interrupt; the kernel was restarted",
                )
                for task in (self._shell, self._iopub):  # the restart's own replies are not ours
                    task.cancel()
                await asyncio.gather(self._shell, self._iopub, return_exceptions=True)
                await self.restart()
                return False
        return True

    def _as_timed_out(self, reply: dict[str, Any] | None) -> dict[str, Any] | None:
        """The reply of a run interrupted for its timeout says so."""
        if reply is not None and self.timed_out is not None:
            # Interrupted for its timeout: the reply says KeyboardInterrupt; say why.
            # Its traceback is the interrupt's, where the code happened to be: not the why.
            content = {
                **reply["content"],
                "status": "error",
                "ename": "TimeoutError",
                "evalue": self.timed_out,
                "traceback": [],
            }
            reply = {**reply, "content": content}
        return reply


async def _within(task: asyncio.Future[T], seconds: float) -> T | None:
    try:
        return await asyncio.wait_for(task, seconds)
    except (asyncio.TimeoutError, queue.Empty, RuntimeError):
        return None
