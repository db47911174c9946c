"""Putting a kernel into a sandbox: one started cold, or one claimed from the warm pool.

A cold start makes the launch folder (connection file, the kernel's CA), creates the
container, waits for the kernel's sockets and its start-up code, and seals the folder. A
claim takes a pooled sandbox that is ready and sealed already (see :mod:`~.pool`) and
binds it to the kernel (see :mod:`~.binding`): its workspace, its key, its name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.egress.ca import KernelCA
from sandbox_kernel.errors import SandboxKernelError, WorkspaceError
from sandbox_kernel.host.mounts import can_mount
from sandbox_kernel.kernel.channels import KernelChannels
from sandbox_kernel.kernel.site import KernelSite
from sandbox_kernel.kernel.start import Start
from sandbox_kernel.lifecycle.launch_folder import (
    expected_sockets,
    new_launch_dir,
    new_runtime_dir,
    seal,
    wait_until_ready,
    write_launch_files,
)
from sandbox_kernel.lifecycle.ownership import PINNED_WORKSPACE, prune_orphans, remove_tree
from sandbox_kernel.lifecycle.startup_mark import wait_for_startup_code
from sandbox_kernel.plan.limits import size_bytes
from sandbox_kernel.plan.plan import Plan
from sandbox_kernel.plan.sandbox_spec import SandboxSpec, is_launcher
from sandbox_kernel.pool.binding import bind
from sandbox_kernel.pool.fit import Narrowing, narrowing
from sandbox_kernel.pool.sandboxes import PooledSandbox, PoolPlan
from sandbox_kernel.services import PROCESS, Services

Log = logging.Logger | logging.LoggerAdapter[Any]


async def start_cold(
    site: KernelSite,
    backend: SandboxBackend,
    spec: SandboxSpec,
    session: tuple[bytes, str],
    ca: Callable[[Path], Awaitable[KernelCA | None]],
    runtime_parent: str,
    log: Log,
) -> None:
    """Create and start a container for the kernel: the site's new container and launch folder."""
    if site.runtime_dir is None or not site.runtime_dir.is_dir():
        site.runtime_dir = await asyncio.to_thread(new_runtime_dir, runtime_parent)
    site.launches += 1
    launch_dir = await asyncio.to_thread(new_launch_dir, site.runtime_dir, site.launches, spec.uid, spec.gid)
    site.launch_dir = launch_dir
    site.spec = spec = replace(staged(spec, site.runtime_dir), runtime_dir=launch_dir)
    kernel_ca = await ca(site.runtime_dir)
    key, scheme = session
    await asyncio.to_thread(
        write_launch_files,
        launch_dir,
        (spec.uid, spec.gid),
        key,
        scheme,
        spec.kernelspec,
        kernel_ca.cert_pem if kernel_ca is not None else None,
    )
    await backend.prepare_workspace(spec)
    site.container_id = container_id = await backend.create(spec)
    log.info(
        "Sandboxed kernel %s: container %s (image %s, runtime %s, uid %d, workspace %s)",
        site.kernel_id,
        container_id[:12],
        spec.image,
        spec.runtime,
        spec.uid,
        spec.workspace,
    )


def staged(spec: SandboxSpec, runtime_dir: Path) -> SandboxSpec:
    """``spec``, with a gateway user's workspace to be pinned in the kernel's runtime folder
    ``runtime_dir`` (see :func:`~sandbox_kernel.host.mounts.pin_folder`)."""
    if spec.owned_from is None or spec.volume is not None:
        return spec
    return replace(spec, staging=runtime_dir / PINNED_WORKSPACE)


async def ready_and_sealed(
    site: KernelSite, backend: SandboxBackend, egress: bool, timeout: float, startup_code: bool
) -> None:
    """Until the cold-started kernel has bound its sockets and run its start-up code; then
    the launch folder is sealed (never out of its reach while IPython reads the code).

    Raises:
        KernelStartupError: it exited, or did not get there in ``timeout`` seconds.
    """
    container_id, launch_dir, spec = site.container_id, site.launch_dir, site.spec
    if container_id is None or launch_dir is None or spec is None:
        msg = "the kernel's sandbox is not started"
        raise RuntimeError(msg)
    sockets = expected_sockets(launch_dir, egress, pooled=False)
    await wait_until_ready(backend, container_id, sockets, timeout, spec.image)
    await wait_for_startup_code(backend, container_id, launch_dir, timeout, spec.image, required=startup_code)
    await asyncio.to_thread(seal, launch_dir)


_swept_orphans = False


async def sweep_orphans_once(backend: SandboxBackend, runtime_parent: str, log: Log) -> None:
    """Remove kernels left by servers that died (once per server process)."""
    global _swept_orphans  # once per process, whichever kernel starts first
    if _swept_orphans:
        return
    _swept_orphans = True
    try:
        await prune_orphans(backend, runtime_parent)
    except SandboxKernelError as exc:
        log.warning("Could not remove orphaned sandboxed kernels: %s", exc)


class PoolClaim:
    """A kernelspec's share of the process's warm pool, for one kernel."""

    _warned_needs_root = False

    def __init__(
        self,
        site: KernelSite,
        backend: SandboxBackend,
        channels: KernelChannels,
        log: Log,
        services: Services = PROCESS,
    ) -> None:
        self._site = site
        self._backend = backend
        self._channels = channels
        self._log = log
        self._services = services
        #: With a pool_size: what this kernelspec's pooled sandboxes are made from.
        self.plan: PoolPlan | None = None
        #: Whether the running kernel's sandbox came from the pool (False: started cold).
        self.from_pool = False
        #: What a claim applies to a pooled sandbox for this start (None: it cannot claim).
        self.narrowing: Narrowing | None = None
        #: Why this start cannot claim from its kernelspec's pool (None: it can, or no pool).
        self.misfit: str | None = None
        #: Whether this start only plans its pool (:func:`~sandbox_kernel.warming.plan_pool`):
        #: its plan becomes the pool's, also for the user a gateway plans it for.
        self.fills = False

    def want(self, plan: Plan, start: Start, scheme: str) -> None:
        """With a ``pool_size``: the pool plan this start claims from. A start of the
        kernelspec's own policy hands its plan to the process's pool (which starts filling
        it in the background); one with a policy, environment or user of its own claims from
        the current plan of the pool (its user's, on a gateway) if it only narrows it (see
        :mod:`~.pool.fit`), else starts cold."""
        self.plan, self.narrowing, self.misfit = None, None, None
        spec, settings = plan.spec, start.policy
        size = settings.pool_size
        if size <= 0:
            return
        if not can_mount():
            if not PoolClaim._warned_needs_root:
                PoolClaim._warned_needs_root = True
                self._log.warning(
                    "pool_size=%d of kernelspec %r is ignored: attaching a workspace to a running "
                    "sandbox is a mount, which needs a server running as root. Kernels start cold.",
                    size,
                    spec.kernelspec,
                )
            return
        user = start.user.name if start.user is not None else ""
        if not start.own or (self.fills and not start.narrowed and not start.sandbox_env):
            self.plan = PoolPlan(
                spec=spec,
                size=size,
                scheme=scheme,
                egress=None if plan.egress is None else plan.egress.rules,
                startup_timeout=settings.startup_timeout,
                startup_code=is_launcher(start.launch.argv),
                runtime_parent=settings.runtime_parent,
                budget=size_bytes("max_pool_memory", settings.max_pool_memory),
                backend=self._backend,
                max_size=settings.max_pool_size,
            )
            self._services.pool.want(self.plan)
            self.narrowing = Narrowing()
            return
        pools = self._services.pool
        self.plan = (pools.plan_of(spec.kernelspec, user) if user else None) or pools.plan_of(spec.kernelspec)
        if self.plan is None and user:
            self.misfit = (
                f"no pool planned for user {user} (a gateway plans one for each of its "
                "GatewayKernelManagerForUsers.pool_users)"
            )
            return
        if self.plan is None:
            self.misfit = (
                "no pool planned yet (a start of the kernelspec's own policy, warm_pool() or a "
                "server's warm_pools plans it; one that narrows it claims from it)"
            )
            return
        found = narrowing(self.plan.spec, spec) if self.plan.scheme == scheme else "signature scheme differs"
        if isinstance(found, str):
            self.misfit = found
        else:
            self.narrowing = found

    def ready(self) -> bool:
        """A pooled sandbox this start can claim waits (a host checked when it was made)."""
        return (
            self.plan is not None
            and self.narrowing is not None
            and bool(self._services.pool.ready_for(self.plan.fingerprint))
        )

    def claim(self) -> PooledSandbox | None:
        """A ready pooled sandbox for this start (a restart's too), or None (then it starts
        cold, and the log says why)."""
        if self.misfit is not None:
            self._log.info(
                "Sandboxed kernel %s: starting cold, not from the pool of %s: %s",
                self._site.kernel_id,
                self._site.spec.kernelspec if self._site.spec is not None else "its kernelspec",
                self.misfit,
            )
            return None
        if self.plan is None:
            return None
        pooled = self._services.pool.claim(self.plan.fingerprint)
        if pooled is None:
            self._log.info(
                "Sandboxed kernel %s: no pooled sandbox of %s ready; starting one cold",
                self._site.kernel_id,
                self.plan.kernelspec,
            )
        return pooled

    async def bind(self, spec: SandboxSpec, sandbox: PooledSandbox, key: bytes | None = None) -> bool:
        """Make a claimed pooled sandbox this kernel's (see :mod:`~.binding`), its runtime
        folder the kernel's; on a restart (``key``: the session key its clients hold) the
        kernel is handed that key. False (and the sandbox removed) if that fails: the kernel
        then starts cold.

        Raises:
            WorkspaceError: a gateway user's folder could not be pinned (it is not theirs
                now, say); the sandbox is removed, and the kernel starts nowhere.
        """
        site = self._site
        restart = key is not None and site.runtime_dir is not None
        if not restart:
            site.runtime_dir, site.launches = sandbox.runtime_dir, 1
        site.launch_dir, site.container_id = sandbox.launch_dir, sandbox.container_id
        spec = staged(spec, sandbox.runtime_dir)
        try:
            await bind(self._backend, sandbox, spec, key, self.narrowing)
        except (SandboxKernelError, OSError) as exc:
            site.container_id = site.launch_dir = None
            if not restart:
                site.runtime_dir, site.launches = None, 0
            await self._services.pool.discard(sandbox)
            if isinstance(exc, WorkspaceError):
                raise  # a gateway user's folder is not theirs now: no start, cold or not
            self._log.warning(
                "Sandboxed kernel %s: could not bind pooled sandbox %s (%s); starting one cold",
                site.kernel_id,
                sandbox.container_id[:12],
                exc,
            )
            return False
        if restart:
            # The sandbox's runtime folder becomes the kernel's (its container's labels name
            # it); the bridge's stays until the bridge goes, one a previous restart claimed now.
            previous, site.runtime_dir, site.launches = site.runtime_dir, sandbox.runtime_dir, 1
            self._channels.bridge_dir = self._channels.bridge_dir or previous
            if previous is not None and previous != self._channels.bridge_dir:
                await asyncio.to_thread(remove_tree, previous)
        site.spec = replace(spec, runtime_dir=sandbox.launch_dir)
        self.from_pool = True
        self._log.info(
            "Sandboxed kernel %s: pooled sandbox %s (image %s, uid %d, workspace %s at %s; narrowed: %s)",
            site.kernel_id,
            sandbox.container_id[:12],
            spec.image,
            spec.uid,
            spec.workspace,
            spec.workspace_path,
            (self.narrowing or Narrowing()).describe(),
        )
        self._services.loop.submit(self._rename(sandbox.container_id, spec.container_name))
        return True

    async def _rename(self, container_id: str, name: str) -> None:
        """Name a claimed pooled sandbox after its kernel (for `docker ps`); in the
        background: the kernel's saved state already says whose it is."""
        try:
            await self._backend.rename(container_id, name)
        except SandboxKernelError as exc:
            self._log.warning("Sandboxed kernel %s: %s", self._site.kernel_id, exc)
