"""jupyter_server's kernel manager, extended so persistent sandboxed kernels outlive it.

Enable it with one line in ``jupyter_server_config.py``::

    c.ServerApp.kernel_manager_class = "sandbox_kernel.server.SandboxMappingKernelManager"

Then, for kernels whose kernelspec says ``"lifecycle": "persistent"``:

- stopping the server (Ctrl-C, SIGTERM) lets go of them instead of shutting them down;
  a server killed outright leaves them running too;
- a server starting adopts every such kernel of its user on this host whose server is
  gone: same kernel id, same variables, so notebooks reconnect to them;
- the server's sessions (which notebook uses which kernel) are kept in a file, so the
  notebook's session still names its kernel after a restart. The file is
  ``JUPYTER_DATA_DIR/sandbox-kernel/sessions-<hash of root_dir>.db`` unless
  ``SessionManager.database_filepath`` is set.

Shutting a kernel down from the notebook (or the REST API) still removes it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

from jupyter_core.paths import jupyter_data_dir
from jupyter_core.utils import run_sync
from jupyter_server._tz import utcnow
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from traitlets import Bool

from .docker_api import SandboxDocker
from .errors import SandboxKernelError
from .orphans import list_kernels, read_state
from .provisioner import SandboxProvisioner
from .reattach import attach_manager


class SandboxMappingKernelManager(AsyncMappingKernelManager):
    """A MappingKernelManager whose persistent sandboxed kernels survive server restarts."""

    adopt_persistent_kernels = Bool(
        True,
        config=True,
        help="""At start, adopt the persistent sandboxed kernels of this user on this host
        whose server is gone.""",
    )
    keep_sessions = Bool(
        True,
        config=True,
        help="""Keep the server's sessions in a file (unless SessionManager.database_filepath
        is set), so notebooks find their persistent kernels after a restart.""",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        if self.keep_sessions:
            self._keep_sessions_in_a_file()
        if self.adopt_persistent_kernels:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                # The server's loop has not started: adopt before it serves any request,
                # or the first session listing would drop sessions of kernels not yet back.
                run_sync(self.adopt_kernels)()
            else:
                self._adopting = asyncio.ensure_future(self.adopt_kernels())

    def _keep_sessions_in_a_file(self) -> None:
        """Point the (not yet created) SessionManager at a file, unless configured."""
        parent = self.parent
        if parent is None or "database_filepath" in parent.config.get("SessionManager", {}):
            return
        digest = hashlib.sha256(str(self.root_dir).encode()).hexdigest()[:16]
        folder = Path(jupyter_data_dir()) / "sandbox-kernel"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        parent.config.SessionManager.database_filepath = str(folder / f"sessions-{digest}.db")

    async def adopt_kernels(self) -> list[str]:
        """Adopt every running persistent sandboxed kernel of this user whose server is
        gone; return their ids. Failures are logged: a server always starts."""
        try:
            kernels = await list_kernels(SandboxDocker())
        except SandboxKernelError as exc:
            self.log.warning("Cannot look for persistent sandboxed kernels to adopt: %s", exc)
            return []
        adopted = []
        for kernel in kernels:
            if not (kernel.detached and kernel.state == "running" and kernel.server_uid == os.getuid()):
                continue
            if kernel.kernel_id in self:
                continue
            state = await asyncio.to_thread(read_state, Path(kernel.runtime_dir).parent)
            if state is None:
                self.log.warning("Persistent sandboxed kernel %s has no reattach state", kernel.kernel_id)
                continue
            try:
                await self._adopt(state)
            except (SandboxKernelError, OSError, KeyError, ValueError) as exc:
                self.log.warning("Could not adopt sandboxed kernel %s: %s", kernel.kernel_id, exc)
                continue
            adopted.append(kernel.kernel_id)
        return adopted

    async def _adopt(self, state: dict[str, Any]) -> None:
        kernel_id = str(state["kernel_id"])
        km = self.kernel_manager_factory(
            parent=self,
            log=self.log,
            kernel_name=str(state["kernel_name"]),
            connection_file=os.path.join(self.connection_dir, f"kernel-{kernel_id}.json"),
            kernel_spec_manager=self.kernel_spec_manager,
        )
        await attach_manager(km, state)
        self._kernels[kernel_id] = km
        self._kernel_connections[kernel_id] = 0
        km.execution_state = "idle"
        km.reason = ""
        km.last_activity = utcnow()
        await self._finish_kernel_start(kernel_id)  # type: ignore[no-untyped-call]
        self.log.info("Adopted persistent sandboxed kernel %s (%s)", kernel_id, km.kernel_name)

    async def _async_shutdown_all(self, now: bool = False) -> None:
        """The server is stopping: let go of persistent sandboxed kernels, stop the rest."""
        for kernel_id in self.list_kernel_ids():
            km = self._kernels[kernel_id]
            provisioner = km.provisioner
            if not (
                isinstance(provisioner, SandboxProvisioner)
                and provisioner.lifecycle == "persistent"
                and provisioner.has_process
            ):
                continue
            km.stop_restarter()
            km._close_control_socket()
            self.stop_watching_activity(kernel_id)  # type: ignore[no-untyped-call]
            await provisioner.detach()
            self._kernels.pop(kernel_id, None)
            self._kernel_connections.pop(kernel_id, None)
            self._kernel_ports.pop(kernel_id, None)
        await super()._async_shutdown_all(now=now)

    # As jupyter_server's own async managers do.
    shutdown_all = _async_shutdown_all  # type: ignore[assignment]
