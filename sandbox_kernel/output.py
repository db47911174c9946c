"""A cap on how much output one execution may send to clients.

A hostile or broken cell can print gigabytes; every byte of it would pass through the
Jupyter server to every client. The bridge asks :class:`OutputLimiter` about each IOPub
message from the kernel: output messages count against their execution's budget, and
once it is spent the rest is dropped and clients get one notice instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import zmq
from jupyter_client.session import Session

from .wire import find_delimiter, load_dict

_OUTPUT_TYPES = frozenset({"stream", "display_data", "execute_result", "update_display_data", "error"})
#: Executions tracked at once; the oldest are forgotten first.
_MAX_TRACKED = 256


class OutputLimiter:
    """Lets through at most ``limit`` bytes of output per execution (per parent message)."""

    def __init__(self, limit: int, session: Session) -> None:
        self.limit = limit
        self._session = session
        self._spent: OrderedDict[str, int] = OrderedDict()
        self._noticed: set[str] = set()

    def admit(self, frames: Sequence[zmq.Frame]) -> list[Sequence[zmq.Frame | bytes]]:
        """The messages to send in place of ``frames``: itself, a notice, or nothing."""
        index = find_delimiter(frames)
        if index is None:
            return [frames]
        header = load_dict(frames[index + 2])
        kind = header.get("msg_type")
        parent = load_dict(frames[index + 3])
        parent_id = str(parent.get("msg_id", ""))
        if kind == "status" and load_dict(frames[index + 5]).get("execution_state") == "idle":
            self._spent.pop(parent_id, None)
            self._noticed.discard(parent_id)
            return [frames]
        if kind not in _OUTPUT_TYPES and header:
            return [frames]
        spent = self._spent.pop(parent_id, 0) + sum(len(f) for f in frames)
        self._spent[parent_id] = spent
        while len(self._spent) > _MAX_TRACKED:
            forgotten, _ = self._spent.popitem(last=False)
            self._noticed.discard(forgotten)
        if spent <= self.limit:
            return [frames]
        if parent_id in self._noticed:
            return []
        self._noticed.add(parent_id)
        return [self._notice(parent)]

    def _notice(self, parent: dict[str, Any]) -> list[bytes]:
        text = (
            f"\n[sandbox-kernel] Output truncated: this execution produced more than "
            f"{self.limit / 2**20:g} MiB of output; the rest was dropped. "
            "Write large results to a file in the workspace instead.\n"
        )
        msg = self._session.msg("stream", {"name": "stderr", "text": text}, parent=parent)
        return list(self._session.serialize(msg, ident=[b"stream.stderr"]))
