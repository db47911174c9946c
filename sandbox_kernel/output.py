"""A cap on how much output one execution may send to clients.

A hostile or broken cell can print gigabytes; every byte of it would pass through the
Jupyter server to every client. The bridge asks :class:`OutputLimiter` about each IOPub
message from the kernel: output messages count against their execution's budget, and
once it is spent the rest is dropped and clients get one notice instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from jupyter_client.session import Session

from .wire import find_delimiter, load_dict, stderr_notice

#: Past the cap, plain status messages (busy/idle, nothing else, this small) still pass,
#: this many per execution, so clients see the kernel go idle after a capped execution.
_SMALL_STATUS = 1024
_STATUS_PAST_CAP = 16
#: Budgets remembered at once; the oldest are forgotten first.
_MAX_TRACKED = 256

#: Who is executing now, as the host knows it: (msg_id, request header) of the oldest
#: request a client sent that has no reply yet, or None while idle.
CurrentExecution = Callable[[], "tuple[str, dict[str, Any]] | None"]


class OutputLimiter:
    """Lets through at most ``limit`` bytes of IOPub traffic per client request.

    Everything the kernel publishes is charged, status messages included, whatever type
    or parent it claims, to the request the host knows is running (or to the idle time
    between requests): a hostile kernel cannot open fresh budgets by inventing parents,
    announcing "idle" or using non-output message types; only a new request from a
    client does. Past the cap only a few plain status messages pass.
    """

    def __init__(self, limit: int, session: Session, current: CurrentExecution) -> None:
        self.limit = limit
        self._session = session
        self._current = current
        self._spent: OrderedDict[str, int] = OrderedDict()
        self._noticed: set[str] = set()
        self._statuses: dict[str, int] = {}
        self._last: tuple[str, dict[str, Any]] = ("", {})

    def admit(self, frames: Sequence[zmq.Frame | bytes]) -> list[Sequence[zmq.Frame | bytes]]:
        """The messages to send in place of ``frames``: itself, a notice, or nothing."""
        size = sum(len(f) for f in frames)
        index = find_delimiter(frames)
        if index is None:
            return []  # not a Jupyter message: no client could use it
        # Between requests, output is charged to the last one: its reply may overtake the
        # tail of its output in the bridge, and idle output opens no budget of its own.
        current = self._current()
        if current is not None:
            self._last = current
        key, parent = self._last
        spent = self._spent.pop(key, 0) + size
        self._spent[key] = spent
        while len(self._spent) > _MAX_TRACKED:
            forgotten, _ = self._spent.popitem(last=False)
            self._noticed.discard(forgotten)
            self._statuses.pop(forgotten, None)
        if spent <= self.limit:
            return [frames]
        if size <= _SMALL_STATUS and _plain_status(frames, index):
            passed = self._statuses.get(key, 0)
            if passed < _STATUS_PAST_CAP:
                self._statuses[key] = passed + 1
                return [frames]
        if key in self._noticed:
            return []
        self._noticed.add(key)
        return [self._notice(parent)]

    def _notice(self, parent: dict[str, Any]) -> list[bytes]:
        text = (
            f"Output truncated: this execution produced more than {self.limit / 2**20:g} MiB of "
            "output; the rest was dropped. Write large results to a file in the workspace instead."
        )
        return stderr_notice(self._session, text, parent)


def _plain_status(frames: Sequence[zmq.Frame | bytes], index: int) -> bool:
    """A status message saying nothing but the kernel's state."""
    if load_dict(frames[index + 2]).get("msg_type") != "status":
        return False
    content = load_dict(frames[index + 5])
    return list(content) == ["execution_state"] and content["execution_state"] in ("busy", "idle", "starting")
