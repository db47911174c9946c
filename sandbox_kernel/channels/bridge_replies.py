"""The bridge's book of replies: which client each reply of the kernel goes back to, and
the signed error replies the bridge gives itself to requests that must not reach the
kernel (see :func:`~.bridge.refusal`).

On shell and control the kernel only answers: the bridge lets through one reply per
request a client actually sent, to that client (routing frames are not signed: the kernel
could aim them anywhere). :class:`PendingReplies` is written by the bridge thread alone;
:meth:`PendingReplies.in_flight` may be asked from any thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import zmq
from jupyter_client.session import Session

from sandbox_kernel.channels.wire import frame_bytes, load_dict

#: Requests remembered per channel while their replies are due; the oldest go first.
MAX_OUTSTANDING = 4096


class PendingReplies:
    """The requests of clients whose replies are due, per channel, by ``msg_id``."""

    def __init__(self, channels: Sequence[str]) -> None:
        # msg_id -> (when, routing identities) of each client waiting for that reply.
        self._outstanding: dict[str, OrderedDict[str, list[tuple[float, list[bytes]]]]] = {
            channel: OrderedDict() for channel in channels
        }

    def clear(self) -> None:
        """Forget every request: the next kernel answers none of the last one's."""
        for pending in self._outstanding.values():
            pending.clear()

    def expect(self, channel: str, msg_id: str, idents: list[bytes]) -> None:
        """A client (routed by ``idents``) sent the request ``msg_id`` on ``channel``."""
        outstanding = self._outstanding[channel]
        waiting = outstanding.pop(msg_id, [])
        waiting.append((time.monotonic(), idents))
        outstanding[msg_id] = waiting
        while len(outstanding) > MAX_OUTSTANDING:
            outstanding.popitem(last=False)

    def route(self, channel: str, msg_id: str) -> list[bytes] | None:
        """The routing identities of the client the reply to ``msg_id`` goes back to
        (once); None: no client waits for it."""
        outstanding = self._outstanding[channel]
        waiting = outstanding.get(msg_id, [])
        if not waiting:
            return None
        _, idents = waiting.pop(0)
        if not waiting:
            del outstanding[msg_id]
        return idents

    def in_flight(self, max_age: float) -> bool:
        """Whether a client's request younger than ``max_age`` seconds awaits its reply
        (any thread; a glance, not a snapshot)."""
        oldest_allowed = time.monotonic() - max_age
        try:
            for outstanding in self._outstanding.values():
                for waiting in list(outstanding.values())[-64:]:
                    if any(since >= oldest_allowed for since, _ in waiting):
                        return True
        except RuntimeError:  # changed by the bridge thread meanwhile: assume busy
            return True
        return False


def refusal_reply(
    signer: Session, frames: Sequence[zmq.Frame | bytes], index: int, header: dict[str, object], why: str
) -> list[bytes]:
    """The signed error reply, routed to its requester, to the request ``frames`` (its
    delimiter at ``index``, its ``header`` read) that the bridge refuses for ``why``."""
    msg_type = str(header.get("msg_type", ""))
    content: dict[str, object] = {
        "status": "error",
        "ename": "RequestRefused",
        "evalue": why,
        "traceback": [f"RequestRefused: {why}"],
    }
    if msg_type == "debug_request":
        # Also a DAP response, as a debugger front end reads it.
        request = load_dict(frames[index + 5])
        content.update(
            type="response",
            request_seq=request.get("seq"),
            success=False,
            command=request.get("command"),
            message=why,
        )
    elif msg_type == "execute_request":
        content["execution_count"] = None
    reply_type = msg_type.removesuffix("_request") + "_reply"
    reply = signer.msg(reply_type, content, parent=header)
    idents = [frame_bytes(frame) for frame in frames[:index]]
    return list(signer.serialize(reply, ident=idents))
