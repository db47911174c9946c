"""When a kernel's websocket, relayed to a sandbox gateway, dials the gateway again, and when
it gives up: the bookkeeping, as a pure state machine.

A JupyterLab tab's kernel websocket ends at the user's Jupyter server, which relays it to the
gateway over a second websocket (jupyter_server's ``GatewayWebSocketConnection``). When that
second one drops, the server dials again, waiting longer each time (``GatewayClient``'s
``gateway_retry_interval``, doubled per try up to ``gateway_retry_interval_max``, plus up to a
second of jitter), ``gateway_retry_max`` times in a row. :class:`GatewayLink` says, for each
event, what the connection does next:

- ``dialled()``: the gateway answered; the count starts again from zero.
- ``lost(status)``: the connection dropped, or a dial failed (``status``: the HTTP code of a
  refused upgrade). The answer is :class:`Redial` (wait ``delay`` seconds, then dial), or
  :class:`GiveUp` (close the browser's socket, code 1011, with ``reason``): the tries are used up,
  or the gateway refused (401/403/404: this kernel is not, or no longer, the user's to reach; trying
  again cannot help). A loss reported while a redial is already pending is the same loss: None.
- ``wait_over()``: the delay has passed; True if the connection should dial now.
- ``close()``: the browser's socket is gone (or was closed by us). Nothing dials after that.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

#: Upgrade answers that say the kernel is not (or no longer) the caller's to reach.
REFUSED = frozenset({401, 403, 404})
#: The close code a browser's socket gets when the gateway is lost ("internal error": the
#: server cannot fulfil the connection). JupyterLab then tries to reconnect the kernel.
CLOSE_CODE = 1011

State = Literal["dialling", "open", "waiting", "closed"]


@dataclass(frozen=True)
class Redial:
    """Dial the gateway again after ``delay`` seconds (try ``attempt`` of the allowed retries)."""

    attempt: int
    delay: float


@dataclass(frozen=True)
class GiveUp:
    """Close the browser's socket with code :data:`CLOSE_CODE` and ``reason`` (one line)."""

    reason: str


class GatewayLink:
    """What one relayed kernel websocket does next, event by event (see the module's docstring)."""

    def __init__(
        self,
        retry_max: int,
        interval: float,
        interval_max: float,
        jitter: Callable[[], float] = lambda: random.uniform(0.1, 1.0),  # noqa: S311  # not a secret
    ) -> None:
        self.retry_max = retry_max
        self.interval = interval
        self.interval_max = interval_max
        self._jitter = jitter
        self.retries = 0
        self.state: State = "dialling"

    def dialled(self) -> None:
        """The gateway accepted the connection."""
        if self.state != "closed":
            self.state = "open"
            self.retries = 0

    def lost(self, status: int | None = None) -> Redial | GiveUp | None:
        """The connection to the gateway dropped, or a dial failed with HTTP ``status``."""
        if self.state in ("closed", "waiting"):
            return None
        if status in REFUSED:
            self.state = "closed"
            return GiveUp(f"the sandbox gateway refused the kernel's connection (HTTP {status})")
        if self.retries >= self.retry_max:
            self.state = "closed"
            return GiveUp(f"sandbox gateway unreachable (gave up after {self.retry_max} retries)")
        delay = min(self.interval * 2**self.retries, self.interval_max) + self._jitter()
        self.retries += 1
        self.state = "waiting"
        return Redial(self.retries, delay)

    def wait_over(self) -> bool:
        """A redial's delay has passed: True if the connection should dial now."""
        if self.state != "waiting":
            return False
        self.state = "dialling"
        return True

    def close(self) -> None:
        """The browser's socket is closed: never dial again."""
        self.state = "closed"
