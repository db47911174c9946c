"""What a provisioner knows of the kernel manager (and server) above it.

jupyter_client hands a provisioner its ``parent``, the KernelManager; jupyter_server's
manager of managers sits above that. This is the one place that reads them: the session
key, Curve keys, the ports of a connection file somebody else wrote, the server's root,
the adoption scope, and the restarter (started and stopped from the manager's own loop).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import zmq

from sandbox_kernel.channels.bridge import CHANNELS, CurveKeys
from sandbox_kernel.errors import ConfigurationError


class ManagerLink:
    """The kernel manager ``manager`` (None: a provisioner on its own, as in tests)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restarter_stopped = False

    @property
    def server(self) -> Any:
        return getattr(self.manager, "parent", None)

    def server_root(self) -> Path | None:
        """The Jupyter server's root folder (its kernel manager's ``root_dir``), or None
        for a kernel that no server starts (a KernelManager of its own, the session API)."""
        server = self.server
        root = getattr(server, "root_dir", None) if hasattr(server, "cwd_for_path") else None
        return Path(root) if isinstance(root, str) and root else None

    def adoption_scope(self) -> str:
        return str(getattr(self.server, "adoption_scope", ""))

    def signature_scheme(self) -> str:
        return self.manager.session.signature_scheme if self.manager is not None else "hmac-sha256"

    def session_key(self, connection_info: dict[str, Any]) -> tuple[bytes, str]:
        """The kernel's session key and signature scheme: the running kernel's own when
        reattaching (its manager may not know it yet), else the manager's."""
        if connection_info.get("key"):
            key = connection_info["key"]
            scheme = str(connection_info.get("signature_scheme", "hmac-sha256"))
            return (key if isinstance(key, bytes) else str(key).encode()), scheme
        if self.manager is None:
            return b"", "hmac-sha256"
        return self.manager.session.key, self.manager.session.signature_scheme

    def curve_keys(self, transport_encryption: str | None) -> CurveKeys | None:
        """The CurveZMQ keypair for the client-facing sockets, if the client asked for it.

        Mirrors LocalProvisioner: keys live on the manager and survive restarts. The
        bridge terminates Curve; inside the sandbox the channels are local ipc sockets.
        """
        km = self.manager
        if km is None or not hasattr(km, "_transport_encryption_policy"):
            return None
        policy = km._transport_encryption_policy(transport_encryption)
        if policy == "disabled":
            return None
        if policy == "auto" and not km._kernel_supports_curve_encryption():
            return None
        if km.curve_publickey is None:
            km.curve_publickey, km.curve_secretkey = zmq.curve_keypair()
        return CurveKeys(public=km.curve_publickey, secret=km.curve_secretkey)

    def ports(self, client_transport: str) -> dict[str, int] | None:
        """The ports the manager already has for the kernel's channels, read from a
        connection file someone else wrote (see sandbox_kernel.launch), which the bridge
        must serve; None: the bridge chooses (and the manager learns them from it)."""
        km = self.manager
        ports = {channel: int(getattr(km, f"{channel}_port", 0) or 0) for channel in CHANNELS}
        if not all(ports.values()):
            return None
        transport = getattr(km, "transport", "tcp")
        if transport != client_transport:
            msg = (
                f"The connection file asks for transport {transport!r}, but this server's "
                f"SandboxProvisioner.client_transport is {client_transport!r}."
            )
            raise ConfigurationError(msg)
        return ports

    # ---------------------------------------------------------------- the restarter

    def remember_loop(self) -> None:
        """The running loop is the manager's: restarter calls go there."""
        self._loop = asyncio.get_running_loop()

    def stop_restarter(self, *, until_start: bool = True) -> bool:
        """Ask Jupyter's restarter to stop (from any thread): the kernel's end is for good;
        ``until_start``: the next start of the kernel starts the restarter again."""
        km, loop = self.manager, self._loop
        if km is None or not hasattr(km, "stop_restarter") or loop is None:
            return False
        loop.call_soon_threadsafe(km.stop_restarter)
        self._restarter_stopped = self._restarter_stopped or until_start
        return True

    def start_restarter(self) -> None:
        """The kernel runs again: Jupyter's restarter, if it was stopped for it, watches again."""
        km = self.manager
        if self._restarter_stopped and km is not None and hasattr(km, "start_restarter"):
            km.start_restarter()
        self._restarter_stopped = False
