"""jupyter_server's kernel manager, extended so persistent sandboxed kernels outlive it.

Enable it with one line in ``jupyter_server_config.py``::

    c.ServerApp.kernel_manager_class = "sandbox_kernel.jupyter.server.SandboxMappingKernelManager"

Then, for kernels whose kernelspec says ``"lifecycle": "persistent"``:

- stopping the server (Ctrl-C, SIGTERM) lets go of them instead of shutting them down;
  a server killed outright leaves them running too;
- a server starting adopts every such kernel that a server of the same user, on this
  host, with the same root folder started and that no live server holds: same kernel
  id, same variables, so notebooks reconnect to them; it also prunes what nobody will
  use again (see ``jupyter sandbox-kernel prune``);
- the server's sessions (which notebook uses which kernel) are kept in a file, so the
  notebook's session still names its kernel after a restart. The file is
  ``JUPYTER_DATA_DIR/sandbox-kernel/sessions-<hash of root_dir and port>.db`` unless
  ``SessionManager.database_filepath`` is set.

Shutting a kernel down from the notebook (or the REST API) still removes it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jupyter_core.paths import jupyter_data_dir
from jupyter_core.utils import run_sync
from jupyter_server._tz import utcnow
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from traitlets import Bool

from sandbox_kernel.backends import configured_backend
from sandbox_kernel.errors import SandboxKernelError
from sandbox_kernel.lifecycle.ownership import SandboxedKernel, list_kernels, prune_orphans
from sandbox_kernel.plan.users import KernelUser
from sandbox_kernel.pool.sandboxes import SandboxPool
from sandbox_kernel.provisioner import SandboxProvisioner
from sandbox_kernel.reattach import attach_manager, load_state
from sandbox_kernel.warming import plan_pool


def before_serving(manager: Any, work: Callable[[], Awaitable[Any]]) -> asyncio.Future[Any] | None:
    """Run ``work`` to its end on the loop the server of ``manager`` (its ``parent``) will
    serve on, before it serves (see :meth:`SandboxMappingKernelManager._before_serving`); or,
    when a running program made the manager, alongside it: then its future."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return asyncio.ensure_future(work())
    serving = getattr(getattr(manager.parent, "io_loop", None), "asyncio_loop", None)
    if isinstance(serving, asyncio.AbstractEventLoop) and not serving.is_closed():
        serving.run_until_complete(work())
    else:  # no ServerApp around it
        run_sync(work)()
    return None


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

    warm_pools = Bool(
        True,
        config=True,
        help="""At start, fill the pool of every sandboxed kernelspec with a pool_size (see
        SandboxProvisioner.pool_size), so the first notebooks' kernels are ready at once.""",
    )

    #: Whether the kernels this server adopts are those a sandbox gateway started for its
    #: users (a gateway's), rather than those started for no user (every other server's).
    adopts_users_kernels = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        if self.keep_sessions:
            self._keep_sessions_in_a_file()
        if self.adopt_persistent_kernels or self.warm_pools:
            self._before_serving()

    async def _async_start_kernel(
        self, *, kernel_id: str | None = None, path: Any = None, **kwargs: Any
    ) -> str:
        """As jupyter_server's; a start that fails (a refused policy, a missing image) leaves
        nothing behind: jupyter_client 8.10 keeps a failed start's id in ``_pending_kernels``
        for ever, one per refused request, and ``shutdown_all`` then fails on it."""
        try:
            return await super()._async_start_kernel(kernel_id=kernel_id, path=path, **kwargs)
        except BaseException:
            for failed, task in list(self._pending_kernels.items()):
                if task.done() and failed not in self._kernels:
                    self._pending_kernels.pop(failed, None)
            raise

    start_kernel = _async_start_kernel  # type: ignore[assignment]

    async def _prepare(self) -> None:
        if self.adopt_persistent_kernels:
            await self.adopt_kernels()
        if self.warm_pools:
            await self.fill_pools()

    def _before_serving(self) -> None:
        """Adopt kernels and fill pools on the loop the server will serve on, before it
        serves any request (the first session listing would drop sessions of kernels
        not yet back).

        ServerApp creates that loop (``io_loop``) before this manager and runs it only
        after ``initialize``: running it here until adoption is done puts the adopted
        kernels' ZeroMQ streams, restarter and culler on it. ``jupyter lab`` and
        ``jupyter notebook`` make another loop current meanwhile, so ``run_sync`` would
        adopt onto a loop that never runs again, and the kernels would hang.
        """
        self._adopting = before_serving(self, self._prepare)

    async def fill_pools(self, user: KernelUser | None = None) -> list[str]:
        """Start filling the pool of every sandboxed kernelspec that has one (in the
        background; with ``user``, the pools of that user's kernels, in their root folder);
        their names. Failures are logged: a server always starts."""
        filled: list[str] = []
        whose = f" for user {user.name}" if user else ""
        if self.kernel_spec_manager is None:
            return []
        specs = await asyncio.to_thread(self.kernel_spec_manager.get_all_specs)
        for name, entry in specs.items():
            provisioner = (entry.get("spec", {}).get("metadata") or {}).get("kernel_provisioner") or {}
            if provisioner.get("provisioner_name") != "sandbox-provisioner":
                continue
            try:
                if await plan_pool(name, user.root if user else self.root_dir, parent=self, user=user):
                    filled.append(name)
            except Exception as exc:  # noqa: BLE001  # one bad kernelspec must not keep the server from starting
                self.log.warning("Cannot fill the sandbox pool of kernelspec %r%s: %s", name, whose, exc)
        if filled:
            self.log.info("Filling sandbox pools of %s%s in the background", ", ".join(filled), whose)
        return filled

    @property
    def adoption_scope(self) -> str:
        """Which persistent kernels this server may adopt: those of its root folder."""
        return hashlib.sha256(str(self.root_dir).encode()).hexdigest()[:16]

    def _keep_sessions_in_a_file(self) -> None:
        """Point the (not yet created) SessionManager at a file, unless configured.

        One file per root folder and port: two servers sharing one would each delete
        the other's sessions (jupyter_server drops sessions of kernels it does not know).
        """
        parent = self.parent
        if parent is None or "database_filepath" in parent.config.get("SessionManager", {}):
            return
        port = getattr(parent, "port", "")
        digest = hashlib.sha256(f"{self.root_dir}\0{port}".encode()).hexdigest()[:16]
        folder = Path(jupyter_data_dir()) / "sandbox-kernel"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        parent.config.SessionManager.database_filepath = str(folder / f"sessions-{digest}.db")

    async def adopt_kernels(self) -> list[str]:
        """Prune what nobody will use again, then adopt every running (or paused) persistent
        sandboxed kernel of this server's scope and user that no live server holds;
        return their ids. Failures are logged: a server always starts."""
        docker = configured_backend(self.config)
        runtime_parent = SandboxProvisioner(parent=self).runtime_parent
        try:
            await prune_orphans(docker, runtime_parent)
            kernels = await list_kernels(docker)
        except SandboxKernelError as exc:
            self.log.warning("Cannot look for persistent sandboxed kernels to adopt: %s", exc)
            return []
        adopted = []
        for kernel in kernels:
            if not self.adoptable(kernel):
                continue
            state = await asyncio.to_thread(load_state, kernel, runtime_parent)
            if state is None:
                self.log.warning(
                    "Persistent sandboxed kernel %s has no usable reattach state", kernel.kernel_id
                )
                continue
            try:
                await self._adopt(state)
            except Exception:  # one bad kernel must not keep the server from starting
                self.log.exception("Could not adopt sandboxed kernel %s", kernel.kernel_id)
                continue
            adopted.append(kernel.kernel_id)
        if adopted and not self._initialized_culler:
            self.initialize_culler()  # type: ignore[no-untyped-call]
        return adopted

    def adoptable(self, kernel: SandboxedKernel) -> bool:
        """Whether this server adopts ``kernel``: a persistent kernel no live server holds,
        running or paused, of this server's uid and scope, and a sandbox gateway's (for one
        of its users) exactly when this server is one (:attr:`adopts_users_kernels`)."""
        return (
            kernel.detached
            and (kernel.state == "running" or kernel.paused)
            and kernel.server_uid == os.getuid()
            and kernel.scope == self.adoption_scope
            and kernel.kernel_id not in self
            and bool(kernel.user) == self.adopts_users_kernels
        )

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
                and await provisioner.poll() is None  # a dead one is shut down as usual
            ):
                continue
            try:
                km.stop_restarter()
                km._close_control_socket()
                self.stop_watching_activity(kernel_id)  # type: ignore[no-untyped-call]
                await provisioner.detach()
            except Exception:  # the other kernels must still be shut down
                self.log.exception("Could not detach sandboxed kernel %s", kernel_id)
            self._kernels.pop(kernel_id, None)
            self._kernel_connections.pop(kernel_id, None)
            self._kernel_ports.pop(kernel_id, None)
        await asyncio.to_thread(SandboxPool.instance().drain)
        await super()._async_shutdown_all(now=now)

    # As jupyter_server's own async managers do.
    shutdown_all = _async_shutdown_all  # type: ignore[assignment]
