"""A gateway kernel's approval questions, kept for the program of its owner that answers them.

Locally, a program's ``approval_handler`` is a callback in the process that holds the kernel.
On a sandbox gateway the program (a session, the MCP server) runs elsewhere, so the gateway
keeps the kernel's questions for it: the session says it answers for its kernel (the owner's
``POST /api/sandbox-kernel/kernels/<id>/approvals``, see :mod:`~.handlers`), and the kernel's
provisioner then asks an :class:`ApprovalQueue` instead of a callback. The session waits for
questions (a long poll) and posts each answer.

Why this is as safe as the local design:

- A question is made only by the host's egress proxy, from a request of the kernel that its
  policy leaves to approval (host, port, method: no text of the kernel's), and it reaches
  only the kernel's owner: only their token passes the routes (403 for anyone else), and the
  kernel has neither a token nor a way to the gateway.
- An answer counts only from the session that registered (its random ``answerer`` id, from
  the owner's routes) and only for a question still waiting; a question's id is random too.
  What is not "once" or "kernel" denies.
- A session that goes away denies: one that has not asked for questions for :data:`LEASE`
  seconds (a poll in flight counts as asking; a closed connection ends it) is gone, its
  questions are denied, the kernel's next ones denied at once, and the kernel is asked again
  as without a program (its runs' clients on stdin; a session's runs cannot answer prompts,
  so they are denied). A session that registers replaces the one before. No answer within
  the kernel's ``approval_timeout`` denies, as the egress proxy times every question out.

Everything but :meth:`ApprovalQueue.ask` (the egress proxy's thread) runs on the gateway's
event loop; state is shared under a lock, and waiting polls are woken on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandbox_kernel.channels.approval import HANDLER, Answer, DeferredHandler, meaning
from sandbox_kernel.egress import ApprovalRequest

#: Seconds after its last poll ended that a session still counts as answering (it polls
#: again at once, so this is for a slow network, not for a slow program).
LEASE = 10.0
#: The longest a poll waits for a question (seconds).
MAX_WAIT = 30.0
#: Why a question was denied with nobody to answer it (the audit line's ``by``).
GONE = (
    "by sandbox-kernel: the program that answered approvals for this kernel is gone "
    "(it stopped asking the gateway for questions)"
)
RELEASED = "by sandbox-kernel: the program that answered approvals for this kernel let go of it"
REPLACED = "another session answers approvals for this kernel now"
LAPSED = "this session's turn to answer approvals lapsed (no poll for a while): register again"


class NotTheAnswerer(Exception):
    """The answerer id is not the kernel's current answerer: ``replaced`` by another session's,
    or lapsed (no poll within the lease, or let go of)."""

    def __init__(self, message: str, replaced: bool) -> None:
        super().__init__(message)
        self.replaced = replaced


@dataclass
class _Question:
    id: str
    request: ApprovalRequest
    future: concurrent.futures.Future[Answer]
    asked: float
    handed_out: bool = False

    def to_dict(self, now: float) -> dict[str, Any]:
        request = self.request
        return {
            "id": self.id,
            "host": request.host,
            "port": request.port,
            "method": request.method,
            "timeout": request.timeout,
            "waited": round(now - self.asked, 3),
        }


class ApprovalQueue(DeferredHandler):
    """One kernel's open questions, and the session that answers them (see the module).

    ``on_gone`` is called (on the loop) once the answering session is gone or let go, so that
    the kernel no longer asks this queue; ``clock`` is for tests.
    """

    def __init__(
        self,
        kernel_id: str,
        on_gone: Callable[[ApprovalQueue], None] = lambda _: None,
        lease: float = LEASE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kernel_id = kernel_id
        self._on_gone = on_gone
        self._lease = lease
        self._clock = clock
        self._lock = threading.Lock()
        self._questions: dict[str, _Question] = {}
        self._answerer: str | None = None
        self._polls = 0
        self._quiet_since = clock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None

    # -- the session's side (the gateway's loop)

    def register(self) -> str:
        """Make a new session the answerer; its id. Questions the one before it was handed
        and did not answer are handed out again."""
        with contextlib.suppress(RuntimeError):  # a unit test calls from no loop
            loop = asyncio.get_running_loop()
            if self._loop is not loop:
                self._loop, self._arrived = loop, asyncio.Event()
        with self._lock:
            self._answerer = secrets.token_hex(16)
            self._polls, self._quiet_since = 0, self._clock()
            for question in self._questions.values():
                question.handed_out = False
            answerer = self._answerer
        self._wake()
        self._check_later()  # a session that never polls is gone too
        return answerer

    def take(self, answerer: str) -> list[dict[str, Any]]:
        """The questions not handed out yet, now handed to ``answerer``.

        Raises:
            NotTheAnswerer: ``answerer`` is not the current one.
        """
        with self._lock:
            self._check_locked(answerer)
            now = self._clock()
            fresh = [q for q in self._questions.values() if not q.handed_out and not q.future.done()]
            for question in fresh:
                question.handed_out = True
            return [question.to_dict(now) for question in fresh]

    async def wait(
        self, answerer: str, timeout: float, closed: asyncio.Event | None = None
    ) -> list[dict[str, Any]]:
        """The questions for ``answerer``, as soon as there are any, or none after ``timeout``
        seconds (at most :data:`MAX_WAIT`) or once ``closed`` is set (the poll's connection
        closed). The session counts as answering while it waits.

        Raises:
            NotTheAnswerer: ``answerer`` is not (or no longer) the current one.
        """
        deadline = time.monotonic() + min(max(timeout, 0.0), MAX_WAIT)
        with self._lock:
            self._check_locked(answerer)
            self._polls += 1
        try:
            while True:
                questions = self.take(answerer)
                left = deadline - time.monotonic()
                if questions or left <= 0 or (closed is not None and closed.is_set()):
                    return questions
                arrived = self._arrived
                if arrived is None:
                    await asyncio.sleep(min(left, 0.5))
                    continue
                arrived.clear()
                waiting = [asyncio.ensure_future(arrived.wait())]
                if closed is not None:
                    waiting.append(asyncio.ensure_future(closed.wait()))
                try:
                    await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in waiting:
                        task.cancel()
        finally:
            with self._lock:
                self._polls = max(0, self._polls - 1)
                if not self._polls:
                    self._quiet_since = self._clock()
            self._check_later()

    def answer(self, answerer: str, question_id: str, word: str) -> bool:
        """Answer the question ``question_id`` with ``word`` ("once", "kernel"; anything else
        denies); whether it was still waiting.

        Raises:
            NotTheAnswerer: ``answerer`` is not the current one.
        """
        with self._lock:
            self._check_locked(answerer)
            question = self._questions.pop(question_id, None)
        if question is None:
            return False
        try:
            question.future.set_result((meaning(word), HANDLER))
        except concurrent.futures.InvalidStateError:  # timed out meanwhile
            return False
        return True

    def release(self, answerer: str) -> None:
        """The session ``answerer`` answers no more: its open questions are denied, and the
        kernel no longer asks this queue. Another session's id changes nothing."""
        with self._lock:
            if self._answerer is None or not secrets.compare_digest(self._answerer, answerer):
                return
        self._end(RELEASED)

    def expire_if_gone(self) -> bool:
        """End the current session's turn if it is gone (see the module); whether it was."""
        with self._lock:
            gone = self._answerer is not None and not self._alive_locked()
        if gone:
            self._end(GONE)
        return gone

    # -- the kernel's side (the egress proxy's thread)

    def ask(self, request: ApprovalRequest) -> concurrent.futures.Future[Answer]:
        """Keep ``request`` for the session; its answer's future (denied at once if no session
        answers now)."""
        future: concurrent.futures.Future[Answer] = concurrent.futures.Future()
        with self._lock:
            alive = self._answerer is not None and self._alive_locked()
            if alive:
                question = _Question(secrets.token_hex(16), request, future, self._clock())
                self._questions[question.id] = question
        if not alive:
            future.set_result(("deny", GONE))
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the gateway stops
                    self._loop.call_soon_threadsafe(self.expire_if_gone)
            return future
        future.add_done_callback(lambda _: self._forget(question.id))
        self._wake()
        return future

    # -- inside

    def _check_locked(self, answerer: str) -> None:
        if self._answerer is not None and secrets.compare_digest(self._answerer, answerer):
            if self._alive_locked():
                return
            raise NotTheAnswerer(LAPSED, replaced=False)
        # Was it ever one? A replaced id and a lapsed one look alike; both re-register or stop.
        raise NotTheAnswerer(
            REPLACED if self._answerer is not None else LAPSED, replaced=self._answerer is not None
        )

    def _alive_locked(self) -> bool:
        return self._polls > 0 or self._clock() - self._quiet_since < self._lease

    def _end(self, why: str) -> None:
        """No session answers now: deny every open question ``why``; tell the kernel."""
        with self._lock:
            self._answerer = None
            questions, self._questions = list(self._questions.values()), {}
        for question in questions:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                question.future.set_result(("deny", why))
        self._on_gone(self)
        self._wake()

    def _check_later(self) -> None:
        """Once the lease has run out from now, end the session's turn if it is gone."""
        if self._loop is not None:
            self._loop.call_later(self._lease + 0.05, self.expire_if_gone)

    def _forget(self, question_id: str) -> None:
        """A question answered or timed out (the proxy cancelled it): no longer handed out."""
        with self._lock:
            self._questions.pop(question_id, None)

    def _wake(self) -> None:
        """Wake the waiting polls (from any thread)."""
        loop, arrived = self._loop, self._arrived
        if loop is not None and arrived is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the gateway stops
                loop.call_soon_threadsafe(arrived.set)
