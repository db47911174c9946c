"""The gateway's kernel manager: every kernel has an owner, and each user sees their own.

A kernel is started for an authenticated user (``start_kernel(sandbox_user=...)``, see
:mod:`sandbox_kernel.plan.users`); the manager records whose it is, and:

- ``list_kernels`` lists, during a request, only the caller's kernels (nothing outside one);
- ``start_kernel(kernel_id=...)`` returns an existing kernel only to its owner (jupyter_server
  would return anyone's) and never starts one under an id the client picked;
- a user has at most ``UserPolicy.max_kernels_per_user`` kernels at once.

jupyter_client keeps the start's arguments for restarts, so a restarted kernel is started
for the same user again and keeps its owner.

Each kernel's model (``GET /api/kernels``...) says how the gateway keeps it, under
:data:`~sandbox_kernel.jupyter.gateway_client.SANDBOX_MODEL_KEY`:
``"sandbox": {"lifecycle": "persistent"}`` (or ``"ephemeral"``); a user's server takes back
only kernels so marked after its own restart.

Persistent kernels outlive the gateway: stopped (or killed), it leaves them running, and
started again it adopts those it started for its users (their ``io.sandbox-kernel.user``
label; never a kernel started for no user), each with its owner from the kernel's saved
state, before it serves a request. What it adopts is what its root folder's scope holds
(see :class:`~sandbox_kernel.jupyter.server.SandboxMappingKernelManager`): two gateways on
one Docker host need different root folders (``root_dir``). Neither prunes the other's
kernels while it lives (a kernel is pruned only once its holder is gone).

The warm pool is per user: for each user of ``pool_users``, each sandboxed kernelspec with a
``pool_size`` gets a pool planned as a start of theirs would be (their uid, their label,
their ceilings, their groups' included), so their starts claim a ready sandbox whole and
nobody else's do (see :mod:`~sandbox_kernel.pool.fit`). The gateway plans them before it
serves, each user as its identity provider knows them then (the tokens file gives their
groups), and again when a request shows a user's ceilings changed (under JupyterHub, their
groups come with their first request); :mod:`~.pools` decides when. The workspace is each
claim's, checked as any start's; the plan is made in an empty folder of theirs that the
gateway makes for the moment (their root may be a home folder, where no kernel starts).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from jupyter_server.base.call_context import CallContext
from tornado import web
from traitlets import List, Unicode, default

from sandbox_kernel.gateway.pools import PoolUsers
from sandbox_kernel.gateway.users import GatewayUser, UserPolicy, UserRefused
from sandbox_kernel.jupyter.gateway_client import SANDBOX_MODEL_KEY
from sandbox_kernel.jupyter.server import SandboxMappingKernelManager
from sandbox_kernel.plan.users import START_ARGUMENT, KernelUser
from sandbox_kernel.provisioner import SandboxProvisioner


def request_user() -> Any:
    """The user of the request being served, or None outside one."""
    handler = CallContext.get(CallContext.JUPYTER_HANDLER)
    return getattr(handler, "current_user", None) if handler is not None else None


class GatewayKernelManagerForUsers(SandboxMappingKernelManager):
    """jupyter_server's kernel manager (with sandbox-kernel's persistence), per user."""

    adopts_users_kernels = True
    #: How users are known before their requests (see :meth:`serve_users`).
    _known_user: Callable[[str], GatewayUser]

    pool_users = List(
        Unicode(),
        config=True,
        help="""Users whose kernels start from a warm pool of their own: at start, for each of
        them and each sandboxed kernelspec with a pool_size, that many sandboxes are started
        as theirs (their uid, and the ceilings of UserPolicy.ceilings that hold for them, their
        groups' included: from the tokens file, or, under JupyterHub, once a request of theirs
        brings their groups, when their pools are planned again; the workspace is attached
        when one is claimed). A name the UserPolicy refuses is logged and skipped. Other users
        get no pool (their kernels start cold). All pools together are bounded by
        SandboxProvisioner.max_pool_memory, and all users' pools of one kernelspec by its
        max_pool_size.""",
    )

    @default("keep_sessions")
    def _keep_sessions_default(self) -> bool:
        return False  # the gateway has no sessions: its clients keep theirs

    @default("warm_pools")
    def _warm_pools_default(self) -> bool:
        return bool(self.pool_users)  # only users' pools: one of the gateway's own fits no user

    async def fill_pools(self, user: KernelUser | None = None) -> list[str]:
        """Start filling the pools of every user of :attr:`pool_users`, each as the identity
        provider knows them (see :meth:`serve_users`), or of ``user`` only, as ``user``; each
        pool's name ("<kernelspec> for <user>")."""
        if user is not None:
            # The plan is all but the workspace (a claim's): made in an empty folder of theirs.
            with tempfile.TemporaryDirectory(prefix="sk-gateway-pool-plan-") as folder:
                await asyncio.to_thread(os.chown, folder, user.uid, user.gid)
                filled = await super().fill_pools(replace(user, root=Path(folder)))
            return [f"{name} for {user.name}" for name in filled]
        filled = []
        async with self._planning:
            for name in self._pool_users.names:
                try:
                    pool_user = self._known_user(name).sandbox_user
                except UserRefused as exc:
                    self.log.warning(
                        "No sandbox pool for user %r (GatewayKernelManagerForUsers.pool_users): %s", name, exc
                    )
                    continue
                if self._pool_users.update(pool_user):
                    filled += await self.fill_pools(pool_user)
        return filled

    def serve_users(self, known_user: Callable[[str], GatewayUser]) -> None:
        """Before the gateway serves: adopt the persistent kernels of its users, and plan the
        pools of :attr:`pool_users`, each user as ``known_user(name)`` has them (the identity
        provider's: the tokens file gives their groups). ServerApp makes its identity provider
        after this manager; the gateway app calls this once both are there."""
        self._known_user = known_user
        super()._before_serving()

    def _before_serving(self) -> None:
        """Nothing yet: see :meth:`serve_users`."""

    def user_seen(self, user: KernelUser) -> None:
        """A request is authenticated as ``user``: if they are a user of :attr:`pool_users`
        whose pools were planned for other ceilings (their groups were not known yet, or
        changed), plan their pools again, in the background."""
        if not self.warm_pools or not self._pool_users.update(user):
            return
        self.log.info(
            "Planning the sandbox pools of user %s as their requests have them (ceilings %s)",
            user.name,
            dict(user.ceilings) or "none",
        )
        replanning = asyncio.ensure_future(self._replan(user))
        self._replanning.add(replanning)
        replanning.add_done_callback(self._replanning.discard)

    async def _replan(self, user: KernelUser) -> None:
        async with self._planning:  # one plan at a time: the last one asked for is the pools'
            if not self._pool_users.current(user):
                return  # changed again meanwhile: that plan follows
            try:
                await self.fill_pools(user)
            except OSError as exc:  # the planning folder; a kernelspec's failure is logged already
                self.log.warning("Cannot plan the sandbox pools of user %s: %s", user.name, exc)

    @default("default_kernel_name")
    def _default_kernel_name_default(self) -> str:
        return "sandboxed-python"

    def __init__(self, **kwargs: Any) -> None:
        self._owners: dict[str, str] = {}  # before the base's adoption, which may ask for owners
        self._replanning: set[asyncio.Future[None]] = set()
        self._planning = asyncio.Lock()
        # One restart or shutdown of a kernel at a time; a shutdown asked for wins.
        self._turns: dict[str, asyncio.Lock] = {}
        self._stopping: set[str] = set()
        super().__init__(**kwargs)
        self._pool_users = PoolUsers(self.pool_users)
        self._known_user = UserPolicy(config=self.config).resolve  # until serve_users says

    def _turn(self, kernel_id: str) -> asyncio.Lock:
        return self._turns.setdefault(kernel_id, asyncio.Lock())

    async def _async_shutdown_kernel(
        self, kernel_id: str, now: bool | None = False, restart: bool | None = False
    ) -> None:
        """Shut kernel ``kernel_id`` down, once a restart of it under way is done (a
        shutdown that met a restart halfway failed, and the restart left the kernel running)."""
        self._stopping.add(kernel_id)
        try:
            async with self._turn(kernel_id):
                if kernel_id in self or kernel_id in self._pending_kernels:
                    await super()._async_shutdown_kernel(kernel_id, now=now, restart=restart)  # type: ignore[no-untyped-call]  # untyped upstream
        finally:
            self._stopping.discard(kernel_id)
            self._turns.pop(kernel_id, None)

    shutdown_kernel = _async_shutdown_kernel  # type: ignore[assignment]  # async, as upstream's own

    async def _async_restart_kernel(self, kernel_id: str, now: bool = False) -> None:
        """Restart kernel ``kernel_id``, unless it is being shut down (409).

        Raises:
            HTTPError: 409, a shutdown of it is under way or done meanwhile.
        """
        if kernel_id in self._stopping:
            raise web.HTTPError(409, f"kernel {kernel_id} is being shut down")
        async with self._turn(kernel_id):
            if kernel_id in self._stopping or kernel_id not in self:
                raise web.HTTPError(409, f"kernel {kernel_id} is being shut down")
            await super()._async_restart_kernel(kernel_id, now=now)  # type: ignore[no-untyped-call]  # untyped upstream

    restart_kernel = _async_restart_kernel  # type: ignore[assignment]  # async, as upstream's own

    def owner(self, kernel_id: str) -> str | None:
        """The name of the user kernel ``kernel_id`` was started for, or None (no such
        kernel, or one no user owns)."""
        if kernel_id not in self._kernels:
            return None
        recorded = self._owners.get(kernel_id)
        if recorded is not None:
            return recorded
        # Not started here (adopted): the user its provisioner was started for.
        user = getattr(getattr(self._kernels[kernel_id], "provisioner", None), "user", None)
        return user.name if isinstance(user, KernelUser) else None

    def kernel_model(self, kernel_id: str) -> dict[str, Any]:
        """jupyter_server's model of the kernel, with how the gateway keeps it
        (``"sandbox": {"lifecycle": ...}``)."""
        model: dict[str, Any] = super().kernel_model(kernel_id)  # type: ignore[no-untyped-call]
        provisioner = self.sandbox_of(kernel_id)
        lifecycle = provisioner.lifecycle if provisioner is not None else "ephemeral"
        model[SANDBOX_MODEL_KEY] = {"lifecycle": lifecycle}
        return model

    def sandbox_of(self, kernel_id: str) -> SandboxProvisioner | None:
        """The provisioner of kernel ``kernel_id``, or None (no such kernel, or not yet one)."""
        km = self._kernels.get(kernel_id)
        provisioner = getattr(km, "provisioner", None)
        return provisioner if isinstance(provisioner, SandboxProvisioner) else None

    def kernels_of(self, name: str) -> list[str]:
        """The ids of user ``name``'s kernels."""
        return [kernel_id for kernel_id in list(self._kernels) if self.owner(kernel_id) == name]

    def list_kernels(self) -> list[dict[str, Any]]:
        """The models of the calling user's kernels (none outside a request)."""
        user = request_user()
        if user is None:
            return []
        mine = set(self.kernels_of(user.username))
        models: list[dict[str, Any]] = super().list_kernels()  # type: ignore[no-untyped-call]
        return [model for model in models if model["id"] in mine]

    async def _async_start_kernel(
        self, *, kernel_id: str | None = None, path: Any = None, **kwargs: Any
    ) -> str:
        """Start a kernel for ``kwargs["sandbox_user"]`` (a :class:`KernelUser`), or, with
        ``kernel_id``, return that kernel if it is theirs.

        Raises:
            UserRefused: no user; a ``kernel_id`` that is not one of theirs; or they have
                as many kernels as they may.
        """
        user = kwargs.get(START_ARGUMENT)
        if not isinstance(user, KernelUser):
            msg = f"the gateway starts kernels only for an authenticated user ({START_ARGUMENT}=KernelUser)"
            raise UserRefused(msg)
        if kernel_id is not None:
            if self.owner(kernel_id) != user.name:
                msg = f"you have no kernel {kernel_id}"
                raise UserRefused(msg)
            return kernel_id
        self.user_seen(user)  # an identity provider of the gateway's told it already
        limit = UserPolicy(config=self.config).max_kernels_per_user
        # Kernels still starting count too (a start takes seconds; the owner is recorded first).
        theirs = {k for k, name in self._owners.items() if name == user.name}
        theirs |= set(self.kernels_of(user.name))
        if limit and len(theirs) >= limit:
            msg = (
                f"you have {limit} kernels, as many as this gateway allows one user "
                "(UserPolicy.max_kernels_per_user): shut one down first"
            )
            raise UserRefused(msg)
        kernel_id = self.new_kernel_id()
        self._owners[kernel_id] = user.name
        try:
            started = await super()._async_start_kernel(kernel_id=kernel_id, path=None, **kwargs)
        except BaseException:
            self._owners.pop(kernel_id, None)
            raise
        self.log.info("Kernel %s started for user %s", started, user.name)
        return started

    start_kernel = _async_start_kernel

    def remove_kernel(self, kernel_id: str) -> Any:
        """Forget kernel ``kernel_id`` and its owner."""
        self._owners.pop(kernel_id, None)
        return super().remove_kernel(kernel_id)
