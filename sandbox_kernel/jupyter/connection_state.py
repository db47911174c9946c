"""A kernel websocket that tells each new connection whether the kernel is idle or busy.

JupyterLab (4.6, with jupyterlab_server 2.28 putting jupyter_server's
``untracked_message_types`` in its page config) sets a kernel's status only from IOPub
``status`` messages whose parent is a tracked request. When its kernel websocket (re)connects,
it marks the kernel "unknown" and asks for ``kernel_info``, whose busy and idle it ignores:
``kernel_info_request`` is untracked. Unless something else sends a request then (a widget
manager's ``comm_open``), the status bar and the notebook's toolbar read "Unknown" until the
next cell runs. jupyter_server's websocket tells a new connection nothing: its nudge's
``kernel_info`` answers are its own.

Through a sandbox gateway every reconnect is a new connection to the gateway: the user's
server dials the gateway again for each socket the browser opens, and after the gateway was
killed and has adopted the kernel. :class:`StateOnConnectWebsocketConnection` sends the kernel's
state as the server tracks it (``execution_state``: from IOPub ``status`` of tracked requests,
"idle" for an adopted kernel) as the connection's first message, a ``status`` with no parent,
as jupyter_server itself sends "restarting" and "dead". It goes out before any kernel message
the connection relays (buffered ones replayed included), so JupyterLab handles it before them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_client.jsonutil import json_default
from jupyter_server.services.kernels.connection.base import serialize_msg_to_ws_v1
from tornado.websocket import WebSocketClosedError

from sandbox_kernel.jupyter.server_audit import AuditedWebsocketConnection

#: The states a new connection is told: a live kernel's ("restarting" and "dead" jupyter_server
#: sends itself; "starting" is over once the connection's nudge is).
TOLD_STATES = frozenset({"idle", "busy"})
#: The kernel websocket subprotocol whose messages are binary (jupyter_server's v1).
V1_PROTOCOL = "v1.kernel.websocket.jupyter.org"


class StateOnConnectWebsocketConnection(AuditedWebsocketConnection):
    """jupyter_server's kernel websocket (audited), whose clients learn the kernel's state as
    they connect (see the module's docstring)."""

    def nudge(self) -> asyncio.Future[None]:
        """Nudge the kernel as jupyter_server does; once done, tell the client its state.

        ``connect`` replays buffered messages and relays the kernel's in callbacks of this
        future that it adds after this one: the state goes out first."""
        nudged = super().nudge()
        nudged.add_done_callback(self._tell_state)
        return nudged

    def _tell_state(self, nudged: asyncio.Future[None]) -> None:
        state = getattr(self.kernel_manager, "execution_state", None)
        if nudged.cancelled() or state not in TOLD_STATES:
            return
        message: dict[str, Any] = self.session.msg("status", {"execution_state": state})
        # Written straight away: jupyter_server's _send_status_message first flushes IOPub,
        # which with no callback yet (the nudge stopped its own) drops the kernel's messages.
        try:
            if self.subprotocol == V1_PROTOCOL:
                frame = serialize_msg_to_ws_v1(message, "iopub", self.session.pack)  # type: ignore[no-untyped-call]  # untyped upstream
                self.write_message(frame, binary=True)
            else:
                message["channel"] = "iopub"
                self.write_message(json.dumps(message, default=json_default))
        except WebSocketClosedError:
            self.log.debug(
                "Kernel %s: the client left before it was told the kernel is %s", self.kernel_id, state
            )
