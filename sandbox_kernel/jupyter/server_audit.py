"""Who is behind each JupyterLab connection, in the sandboxed kernel's audit log.

A message's ``username`` is what the client wrote in its header. jupyter_server knows
better: it authenticated the websocket. :class:`AuditedWebsocketConnection` writes the
user it authenticated into the metadata of every message the connection sends on
(``sandbox_kernel_user``, over anything the client put there), which the audit log records
as ``user_authenticated``, and writes one ``client`` line per connection (user, session
id, the browser's address). The package's server extension (:mod:`~sandbox_kernel.jupyter.lab`)
puts it in place of jupyter_server's default connection class; one an administrator
configured is left alone.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_client.session import Session
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from tornado import web
from traitlets import default

from sandbox_kernel.channels.audit import AUTHENTICATED_USER
from sandbox_kernel.provisioner import SandboxProvisioner


class _StampingSession(Session):
    """A session whose messages carry the authenticated user in their metadata."""

    def __init__(self, user: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._user = user

    def send(self, stream: Any, msg_or_type: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg_or_type, dict):
            msg_or_type["metadata"] = {**(msg_or_type.get("metadata") or {}), AUTHENTICATED_USER: self._user}
        return super().send(stream, msg_or_type, *args, **kwargs)

    def send_raw(self, stream: Any, msg_list: Any, *args: Any, **kwargs: Any) -> Any:
        # [header, parent_header, metadata, content, *buffers], as the v1 websocket protocol has them.
        parts = list(msg_list)
        if len(parts) >= 4:
            try:
                metadata = json.loads(bytes(parts[2]) or b"{}")
            except ValueError:
                metadata = None
            if not isinstance(metadata, dict):
                return None  # not a message the kernel could read: nothing to send
            parts[2] = json.dumps({**metadata, AUTHENTICATED_USER: self._user}).encode()
        return super().send_raw(stream, parts, *args, **kwargs)


def _username(user: Any) -> str:
    return str(getattr(user, "username", None) or user)


class AuditedWebsocketConnection(ZMQChannelsWebsocketConnection):
    """jupyter_server's kernel websocket, saying in the audit log whom the server authenticated."""

    @default("session")
    def _default_session(self) -> Session:
        return _StampingSession(_username(self.websocket_handler.current_user), config=self.config)

    _replaced = False

    def _superseded(self) -> bool:
        """Whether a newer connection of this session registered while this one was in its
        handshake (jupyter_server registers each as the session's, replacing any before it)."""
        holder = self._open_sessions.get(self.session_key)
        return holder is not None and holder is not self.websocket_handler

    async def prepare(self) -> None:
        """jupyter_server's handshake, refused (409) if a newer connection of the session
        registered meanwhile, while the websocket is not yet upgraded.

        Refused, the client knows it is not connected: JupyterLab reconnects, and a user's server
        relaying to a sandbox gateway keeps holding the browser's messages and dials again. Opened
        and then closed (:meth:`_give_way`), the socket would first take what the client sends at
        once, and lose it: the older connection may be the live one and its newer twin the one the
        browser is abandoning, when both come through a user's server.
        """
        await super().prepare()  # type: ignore[no-untyped-call]  # untyped upstream
        if self._superseded():
            # No websocket opens, so nothing calls disconnect: let go of the kernel_info request here.
            self._release_kernel_info()
            self.log.info(
                "Kernel %s: refused a connection of session %s that a newer one replaced in its handshake",
                self.kernel_id,
                self.session_id,
            )
            raise web.HTTPError(409, "A newer connection of session %s replaced this one", self.session_id)

    def connect(self) -> Any:
        if self._superseded():
            return self._give_way()
        provisioner = getattr(self.kernel_manager, "provisioner", None)
        if isinstance(provisioner, SandboxProvisioner):
            handler = self.websocket_handler
            provisioner.audit(
                "client",
                user=_username(handler.current_user),
                session=self.session_id,
                remote_ip=handler.request.remote_ip,
            )
        return super().connect()

    def _give_way(self) -> asyncio.Future[None]:
        """Close this connection, which a newer one of its session replaced while it was
        still in its handshake (jupyter_server's "Replacing stale connection" cannot close a
        socket not yet open). Opened, it would give the kernel a second client with the
        session's identity, and whichever connected last would take the kernel's replies:
        the live socket's requests could go unanswered for ever. (:meth:`prepare` refuses
        such a connection before its upgrade; this catches one replaced after that.)"""
        self._replaced = True
        self.log.info(
            "Kernel %s: closed a connection of session %s that a newer one replaced as it opened",
            self.kernel_id,
            self.session_id,
        )
        self.websocket_handler.close()
        opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        opened.set_result(None)
        return opened

    def disconnect(self) -> None:  # type: ignore[override]  # upstream's base says async; the class it uses is not
        if not self._replaced:
            super().disconnect()  # type: ignore[no-untyped-call]  # untyped upstream
            return
        # It made no channels and counts no connection.
        self._release_kernel_info()

    def _release_kernel_info(self) -> None:
        """Close the handshake's kernel_info channel, if left (one whose request the kernel never
        answered), as upstream's ``disconnect`` does. Its future is then the kernel's pending one,
        which later handshakes wait on: resolve it (empty, as upstream does), or they wait for a
        reply no channel can bring any more."""
        channel, self.kernel_info_channel = self.kernel_info_channel, None
        if channel is not None and not channel.closed():
            channel.close()
            if not self._kernel_info_future.done():
                self._kernel_info_future.set_result({})
            if getattr(self.kernel_manager, "_kernel_info_future", None) is self._kernel_info_future:
                del self.kernel_manager._kernel_info_future


def use_audited_connections(settings: dict[str, Any]) -> bool:
    """Make the web app's kernel websockets audited ones, unless another class was chosen."""
    if settings.get("kernel_websocket_connection_class") in (None, ZMQChannelsWebsocketConnection):
        settings["kernel_websocket_connection_class"] = AuditedWebsocketConnection
        return True
    return False
