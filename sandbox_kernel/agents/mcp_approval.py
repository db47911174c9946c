"""The MCP server's approval handler: its kernels' requests put to the MCP client.

With a kernelspec's ``approval = "egress"``, a kernel's request outside its allowed domains
waits for its holder's answer (see :mod:`sandbox_kernel.channels.approval`). The MCP server
is that holder: every session it starts gets :meth:`ClientApprovals.ask` as its
``approval_handler`` (locally the provisioner calls it; on a sandbox gateway the session's
:mod:`~.gateway_approvals` does, for the same session), and it asks the MCP client through
elicitation, in the ``run_code`` or ``run_command`` call that runs the kernel's code: a form
with one choice, once, kernel or deny. The client shows it to its user (or decides itself: the
MCP spec leaves that to the client). Declined, cancelled, unanswered within the kernel's
``approval_timeout``, asked while no call runs the kernel's code (a thread it left running),
or of a client that declared no elicitation: denied. So is a question to a client of the
2026 protocol, which takes no request from the server (it elicits by retried calls, which
this server does not do yet). Each question and its outcome is a note in the call's result,
so the assistant learns why a request failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from mcp.server.elicitation import AcceptedElicitation
from mcp.shared.exceptions import MCPError, NoBackChannelError
from pydantic import BaseModel, Field

from sandbox_kernel.channels.approval import meaning
from sandbox_kernel.egress import ApprovalRequest

log = logging.getLogger(__name__)


class ApprovalChoice(BaseModel):
    """The form the MCP client shows: one choice."""

    answer: Literal["once", "kernel", "deny"] = Field(
        description="once: this request only; kernel: this domain from now on, in this kernel; "
        "deny: refuse it"
    )


@dataclass
class _Call:
    """A tool call running a kernel's code: whom to ask, on which loop, and its notes."""

    context: Any
    loop: asyncio.AbstractEventLoop
    notes: list[str] = field(default_factory=list)


class ClientApprovals:
    """Asks the MCP client about the requests of the kernels whose code a tool call runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, _Call] = {}

    @contextlib.contextmanager
    def during(self, kernel_id: str, context: Any) -> Iterator[list[str]]:
        """While a tool call (its MCP ``context``; None: it has none) runs kernel ``kernel_id``'s
        code, ask its client; the notes it gathers (call it on the server's loop)."""
        call = _Call(context, asyncio.get_running_loop())
        with self._lock:
            self._calls[kernel_id] = call
        try:
            yield call.notes
        finally:
            with self._lock:
                if self._calls.get(kernel_id) is call:
                    del self._calls[kernel_id]

    def ask(self, request: ApprovalRequest) -> str:
        """The approval handler: "once", "kernel" or "deny" for ``request``, from the client
        of the tool call running its kernel's code. Called in a thread of its own."""
        with self._lock:
            call = self._calls.get(request.kernel_id)
        if call is None:
            return "deny"  # no call runs its code: nobody to ask, no call to tell
        what = request.what
        if call.context is None or not _can_elicit(call.context):
            call.notes.append(
                f"{what} needed approval and was denied: this MCP client cannot be asked "
                "(it declared no elicitation capability)"
            )
            return "deny"
        asking = asyncio.run_coroutine_threadsafe(_elicit(call.context, request), call.loop)
        try:
            answer = asking.result(timeout=request.timeout)
        except concurrent.futures.TimeoutError:
            asking.cancel()
            answer = f"no answer within {request.timeout:g} s"
        except NoBackChannelError:
            # The 2026 protocol takes no request from the server; it elicits by retried calls.
            answer = "this MCP client's connection takes no question from the server"
        except (MCPError, ValueError, OSError, RuntimeError, anyio.BrokenResourceError) as exc:
            # The client's transport closed, a malformed answer, the loop gone.
            log.warning("Asking the MCP client about %s failed: %r", what, exc)
            answer = "asking the client failed"
        said = (
            f"the client answered {answer}" if answer in ("once", "kernel", "deny") else f"denied: {answer}"
        )
        call.notes.append(f"{what} needed approval: {said}")
        return meaning(answer)


def _can_elicit(context: Any) -> bool:
    capabilities = getattr(context, "client_capabilities", None)
    return getattr(capabilities, "elicitation", None) is not None


async def _elicit(context: Any, request: ApprovalRequest) -> str:
    """The client's answer to the question about ``request``: its choice, or why there is none."""
    message = (
        f"Sandbox: allow {request.what}? It is not among this kernel's allowed domains. "
        f"Choose once (this request), kernel (from now on, in this kernel) or deny; "
        f"no answer within {request.timeout:g} s denies."
    )
    result = await context.elicit(message, ApprovalChoice)
    if isinstance(result, AcceptedElicitation):
        return str(result.data.answer)
    return f"the client's user chose {result.action}"
