"""A human in the loop: asking whoever holds a kernel to approve what its policy leaves to them.

With ``approval = "egress"``, a request of the kernel to a domain outside its allowed
domains (but within the administrator's ceiling, ``max_allowed_domains``) waits while
the holder is asked: a program's callback (``km.provisioner.approval_handler``), else the
client that runs the current cell, through Jupyter's own stdin channel, as ``input()``
asks, so JupyterLab shows a prompt and needs no extension. The answer is "once" (this
request), "kernel" (this domain, for this kernel from now on) or "deny", and anything else
is "deny"; no answer within ``approval_timeout`` is "deny", and so is a client that cannot
answer prompts. (The package's JupyterLab extension closes a question's box once it is
no longer waited for: Jupyter has no message withdrawing an ``input_request``.)

The prompt is the host's own message (signed with the kernel's key) and the answer is
taken off the client's stdin before the kernel sees it: the kernel can neither answer for
the human nor read the answer. Every decision is an audit line.

A holder that answers elsewhere and later (a program's session on a sandbox gateway, see
:mod:`sandbox_kernel.gateway.approvals`) is a :class:`DeferredHandler`: asked, it hands
back the answer's future at once, and no thread waits for it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from jupyter_client.session import Session

from sandbox_kernel.channels.audit import ExecutionAuditor
from sandbox_kernel.channels.wire import load_dict
from sandbox_kernel.egress import ApprovalRequest

log = logging.getLogger(__name__)

#: What allows a request, as docs/administrators/approval.md documents it; anything else denies.
ALLOWING = ("once", "kernel")
#: How long a late answer to a prompt that timed out is still recognised (and swallowed).
LATE_ANSWERS = 600.0
#: Who answered, for the audit line and the refusal ("denied at the prompt",
#: "approved by the approval_handler, once").
STDIN = "at the prompt"
HANDLER = "by the approval_handler"
AMBIGUOUS = (
    "by sandbox-kernel: an answer without a parent came while the kernel was asking the same client "
    "for input, so it could have been meant for the kernel"
)
NO_CELL = "by sandbox-kernel: no cell is running whose client could be asked"
NO_STDIN = (
    "by sandbox-kernel: the client that ran this cell cannot answer prompts (allow_stdin is false) "
    "and no approval_handler is set; a program answers through one "
    "(SandboxSession(approval_handler=...) or km.provisioner.approval_handler)"
)


def meaning(answer: object) -> str:
    """What an answer means: "once", "kernel", or "deny" for anything else."""
    word = str(answer).strip().lower()
    return word if word in ALLOWING else "deny"


def question(request: ApprovalRequest) -> str:
    """The prompt asking about ``request``, in the analyst's words."""
    return (
        f"Sandbox: allow {request.what}? It is not among this kernel's allowed domains. "
        "Type once (this time), kernel (from now on, in this kernel) or deny; "
        f"no answer within {request.timeout:g} s denies: "
    )


#: The holder's answer: ("once" | "kernel" | "deny", who answered: the holder, or
#: sandbox-kernel and why nobody could be asked), for the audit and the refusal.
Answer = tuple[str, str]
ApprovalHandler = Callable[[ApprovalRequest], str]


class DeferredHandler(ABC):
    """A holder that answers later, elsewhere: :meth:`ask` returns the answer's future at
    once. The egress proxy cancels the future at the request's timeout (a denial), so an
    implementation must take a cancelled future as "no longer asked"."""

    @abstractmethod
    def ask(self, request: ApprovalRequest) -> concurrent.futures.Future[Answer]:
        """Put ``request`` to the holder; the future of its answer (any thread may call)."""


@dataclass
class _Prompt:
    future: concurrent.futures.Future[Answer]
    idents: list[bytes]
    deadline: float


class ApprovalBroker:
    """One kernel's asking: by callback, else by a prompt on the stdin of the client
    running the current cell. Thread-safe: the proxy's thread asks, the bridge's thread
    hands in answers (see :meth:`on_stdin`).

    An answer is ours when its parent is our prompt (JupyterLab's are). One without a
    parent (jupyter_client's ``input()``) is ours only when it cannot be the answer to a
    prompt of the kernel's own: while the kernel has asked that client something too, our
    question is denied instead, for the kernel could word its prompt to get a "yes" meant
    for it. Our prompts' ids are random, so the kernel cannot reuse one.
    """

    def __init__(
        self,
        kernel_id: str,
        auditor: ExecutionAuditor,
        signer: Session,
        send_stdin: Callable[[list[bytes]], None],
        handler: Callable[[], ApprovalHandler | DeferredHandler | None],
    ) -> None:
        self.kernel_id = kernel_id
        self._auditor = auditor
        self._signer = signer
        self._send_stdin = send_stdin
        self._handler = handler
        self._lock = threading.Lock()
        self._prompts: dict[str, _Prompt] = {}
        #: Clients (their routing identity) the kernel's own input() asked, unanswered;
        #: counted only for clients that run cells, so the kernel cannot grow it.
        self._kernel_asking: dict[bytes, int] = {}

    def ask(self, request: ApprovalRequest) -> concurrent.futures.Future[Answer]:
        """Ask the holder; the future gets the answer (the proxy times it out)."""
        handler = self._handler()
        if isinstance(handler, DeferredHandler):
            return handler.ask(request)
        future: concurrent.futures.Future[Answer] = concurrent.futures.Future()
        if handler is not None:
            threading.Thread(
                target=self._call_handler, args=(handler, request, future), daemon=True, name="approval"
            ).start()
            return future
        execution = self._auditor.current()
        if execution is None:
            future.set_result(("deny", NO_CELL))
            return future
        if not execution.allow_stdin:
            future.set_result(("deny", NO_STDIN))
            return future
        msg = self._signer.msg(
            "input_request", {"prompt": question(request), "password": False}, parent=execution.header
        )
        msg["header"]["msg_id"] = msg["msg_id"] = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            for msg_id in [m for m, p in self._prompts.items() if p.deadline < now]:
                del self._prompts[msg_id]
            self._prompts[msg["msg_id"]] = _Prompt(future, list(execution.idents), now + LATE_ANSWERS)
        self._send_stdin(list(self._signer.serialize(msg, ident=execution.idents)))
        return future

    def _call_handler(
        self, handler: ApprovalHandler, request: ApprovalRequest, future: concurrent.futures.Future[Answer]
    ) -> None:
        try:
            answer: Answer = (meaning(handler(request)), HANDLER)
        except Exception:
            log.exception("Sandboxed kernel %s: the approval handler failed; denied", self.kernel_id)
            answer = ("deny", "because the approval_handler raised an exception (see the log)")
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # timed out meanwhile
            future.set_result(answer)

    def on_stdin(self, to_kernel: bool, idents: list[bytes], parts: list[bytes]) -> bool:
        """A signed stdin message through the bridge; False for an answer to our prompt
        (taken here: the kernel never sees it)."""
        msg_type = load_dict(parts[1]).get("msg_type")  # parts: signature, header, parent, metadata, content
        client = idents[0] if idents else b""  # what the bridge's ROUTER routes by
        if not to_kernel:
            if msg_type == "input_request" and self._runs_cells(client):
                with self._lock:
                    self._kernel_asking[client] = self._kernel_asking.get(client, 0) + 1
            return True
        if msg_type != "input_reply":
            return True
        parent_id = str(load_dict(parts[2]).get("msg_id", ""))
        with self._lock:
            prompt = self._prompts.pop(parent_id, None) if parent_id else None
            if prompt is None and not parent_id:
                mine = [
                    m for m, p in self._prompts.items() if p.idents[:1] == [client] and not p.future.done()
                ]
                if len(mine) == 1 and not self._kernel_asking.get(client):
                    prompt = self._prompts.pop(mine[0])
                elif mine:  # the kernel asked this client too: whose answer is it?
                    for msg_id in mine:  # kept: a late answer to one is still ours to take
                        self._deny(self._prompts[msg_id], AMBIGUOUS)
            if prompt is None:
                if self._kernel_asking.get(client):
                    self._kernel_asking[client] -= 1
                return True
        value = str(load_dict(parts[4]).get("value", ""))
        self._answer(prompt, (meaning(value), STDIN))
        return False

    def _runs_cells(self, client: bytes) -> bool:
        execution = self._auditor.current()
        return execution is not None and execution.idents[:1] == [client]

    @staticmethod
    def _answer(prompt: _Prompt, answer: Answer) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            prompt.future.set_result(answer)

    def _deny(self, prompt: _Prompt, why: str) -> None:
        self._answer(prompt, ("deny", why))
