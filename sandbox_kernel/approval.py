"""A human in the loop: asking whoever holds a kernel to approve what its policy leaves to them.

With ``approval = "egress"``, a request of the kernel to a domain outside its allowed
domains (but within the administrator's ceiling, ``max_allowed_domains``) waits while
the holder is asked: a program's callback (``km.provisioner.approval_handler``), else the
client that runs the current cell, through Jupyter's own stdin channel, as ``input()``
asks, so JupyterLab shows a prompt and needs no extension. The answer is "once" (this
request), "kernel" (this domain, for this kernel from now on) or "deny"; no answer within
``approval_timeout`` is "deny", and so is a client that cannot answer prompts.

The prompt is the host's own message (signed with the kernel's key) and the answer is
taken off the client's stdin before the kernel sees it: the kernel can neither answer for
the human nor read the answer. Every decision is an audit line.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from jupyter_client.session import Session

from .audit import ExecutionAuditor
from .egress import ApprovalRequest
from .wire import load_dict

log = logging.getLogger(__name__)

#: What the holder may answer, and what each means.
ANSWERS = {
    "o": "once",
    "once": "once",
    "y": "once",
    "yes": "once",
    "k": "kernel",
    "kernel": "kernel",
    "always": "kernel",
}
#: How long a late answer to a prompt that timed out is still recognised (and swallowed).
LATE_ANSWERS = 600.0


#: The holder's answer: ("once" | "kernel" | "deny", who answered: the holder, or
#: sandbox-kernel and why nobody could be asked), for the audit and the refusal.
Answer = tuple[str, str]
ApprovalHandler = Callable[[ApprovalRequest], str]


@dataclass
class _Prompt:
    future: concurrent.futures.Future[Answer]
    idents: list[bytes]
    deadline: float


class ApprovalBroker:
    """One kernel's asking: by callback, else by a prompt on the stdin of the client
    running the current cell. Thread-safe: the proxy's thread asks, the bridge's thread
    hands in answers (see :meth:`on_stdin`)."""

    def __init__(
        self,
        kernel_id: str,
        auditor: ExecutionAuditor,
        signer: Session,
        send_stdin: Callable[[list[bytes]], None],
        handler: Callable[[], ApprovalHandler | None],
    ) -> None:
        self.kernel_id = kernel_id
        self._auditor = auditor
        self._signer = signer
        self._send_stdin = send_stdin
        self._handler = handler
        self._lock = threading.Lock()
        self._prompts: dict[str, _Prompt] = {}
        #: Stdin requests of the kernel's own (input()) per client, still unanswered.
        self._kernel_asking: dict[bytes, int] = {}

    def ask(self, request: ApprovalRequest) -> concurrent.futures.Future[Answer]:
        """Ask the holder; the future gets the answer (the proxy times it out)."""
        future: concurrent.futures.Future[Answer] = concurrent.futures.Future()
        handler = self._handler()
        if handler is not None:
            threading.Thread(
                target=self._call_handler, args=(handler, request, future), daemon=True, name="approval"
            ).start()
            return future
        execution = self._auditor.current()
        if execution is None:
            future.set_result(("deny", "sandbox-kernel: no cell is running whose client could be asked"))
        elif not execution.allow_stdin:
            future.set_result(
                (
                    "deny",
                    "sandbox-kernel: the client that ran this cell cannot answer prompts (allow_stdin is "
                    "false)",
                )
            )
        else:
            prompt = (
                f"sandbox-kernel: allow this kernel {request.what} (not in its allowed domains)? "
                "[once / kernel / deny]: "
            )
            msg = self._signer.msg(
                "input_request", {"prompt": prompt, "password": False}, parent=execution.header
            )
            with self._lock:
                self._prompts[msg["header"]["msg_id"]] = _Prompt(
                    future, list(execution.idents), time.monotonic() + LATE_ANSWERS
                )
            self._send_stdin(list(self._signer.serialize(msg, ident=execution.idents)))
        return future

    def _call_handler(
        self, handler: ApprovalHandler, request: ApprovalRequest, future: concurrent.futures.Future[Answer]
    ) -> None:
        try:
            answer = ANSWERS.get(str(handler(request)).strip().lower(), "deny")
        except Exception:
            log.exception("Sandboxed kernel %s: the approval handler failed; denied", self.kernel_id)
            future.set_result(("deny", "the approval handler failed"))
            return
        future.set_result((answer, "the kernel's holder (approval_handler)"))

    def on_stdin(self, to_kernel: bool, idents: list[bytes], parts: list[bytes]) -> bool:
        """A signed stdin message through the bridge; False for an answer to our prompt
        (taken here: the kernel never sees it)."""
        header = load_dict(parts[1])  # parts: signature, header, parent, metadata, content
        msg_type = header.get("msg_type")
        who = idents[-1] if idents else b""
        with self._lock:
            if not to_kernel:
                if msg_type == "input_request":
                    self._kernel_asking[who] = self._kernel_asking.get(who, 0) + 1
                return True
            if msg_type != "input_reply":
                return True
            now = time.monotonic()
            for msg_id in [m for m, p in self._prompts.items() if p.deadline < now]:
                del self._prompts[msg_id]
            parent_id = str(load_dict(parts[2]).get("msg_id", ""))
            prompt = self._prompts.pop(parent_id, None)
            if prompt is None and not parent_id and not self._kernel_asking.get(who):
                # jupyter_client's input() answers without a parent: ours if it is the
                # one prompt this client has open and the kernel asked it nothing.
                mine = [m for m, p in self._prompts.items() if p.idents == idents and not p.future.done()]
                if len(mine) == 1:
                    prompt = self._prompts.pop(mine[0])
            if prompt is None:
                if self._kernel_asking.get(who):
                    self._kernel_asking[who] -= 1
                return True
        value = str(load_dict(parts[4]).get("value", ""))
        answer = ANSWERS.get(value.strip().lower(), "deny")
        if not prompt.future.done():
            prompt.future.set_result((answer, "the kernel's holder (stdin)"))
        return False
