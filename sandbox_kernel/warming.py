"""Filling the warm pool of a kernelspec ahead of its kernels' starts.

A server fills the pools of its sandboxed kernelspecs as it starts
(``SandboxMappingKernelManager.warm_pools``; a sandbox gateway, one per user of its
``pool_users``); a program calls :func:`warm_pool`. Either
plans the pool with the very call a kernel start of that kernelspec makes
(:meth:`~.provisioner.SandboxProvisioner.pre_launch`: the same checks, settings, ceilings,
credentials, host check and orphan sweep), which hands the plan to the process's
:class:`~.pool.SandboxPool`; that starts the sandboxes in the background.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import Any

from sandbox_kernel.plan.users import START_ARGUMENT, KernelUser
from sandbox_kernel.pool.sandboxes import SandboxPool
from sandbox_kernel.provisioner import SandboxProvisioner


async def plan_pool(
    kernel_name: str,
    cwd: str | os.PathLike[str] | None = None,
    parent: Any = None,
    env: Mapping[str, str] | None = None,
    user: KernelUser | None = None,
) -> bool:
    """Start filling the pool of ``kernel_name`` as a kernel start would (same checks,
    same settings; ``parent``: the configurable whose config the kernels get, e.g. a
    server's kernel manager); with ``user``, the pool of that user's kernels, as a start
    for them in ``cwd`` would plan it (their uid, label and ceilings). False if the
    kernelspec has no pool (or cannot have one here). The sandboxes start in the background.

    Raises:
        ConfigurationError, WorkspaceError, DockerUnavailableError, RuntimeMissingError,
        ImageNotFoundError: as a kernel start of that kernelspec would.
    """
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_client.provisioning.factory import KernelProvisionerFactory

    specs = getattr(parent, "kernel_spec_manager", None)
    km = AsyncKernelManager(
        kernel_name=kernel_name, parent=parent, **({"kernel_spec_manager": specs} if specs else {})
    )
    factory = KernelProvisionerFactory.instance(parent=km.parent)
    provisioner = factory.create_provisioner_instance(secrets.token_hex(8), km.kernel_spec, parent=km)
    if not isinstance(provisioner, SandboxProvisioner) or provisioner.pool_size <= 0:
        return False
    # A start of the kernelspec's own policy plans the pool: this is one, up to its launch.
    provisioner.pool.fills = True
    start = {START_ARGUMENT: user} if user is not None else {}
    await provisioner.pre_launch(
        cwd=str(cwd or os.getcwd()), env=dict(os.environ if env is None else env), **start
    )
    return provisioner.pool.plan is not None


def warm_pool(
    kernel_name: str = "sandboxed-python",
    cwd: str | os.PathLike[str] | None = None,
    wait: bool = True,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> int:
    """Fill this process's pool of ``kernel_name`` (a kernelspec with ``pool_size``) and,
    with ``wait``, block until it is full; how many sandboxes wait. For programs using
    jupyter_client: every later kernel start of that kernelspec claims one::

        from jupyter_client.manager import start_new_kernel
        import sandbox_kernel

        sandbox_kernel.warm_pool("sandboxed-python", cwd="/srv/work")
        km, kc = start_new_kernel(kernel_name="sandboxed-python", cwd="/srv/work")  # ~0.1 s

    ``cwd`` is where kernels will start (it decides the kernels' uid, see kernel_uid);
    ``env`` the environment they will be started with (default: this process's), as
    ``start_kernel(env=...)`` would pass it: what a sandbox gets of it is fixed when it
    starts, so only kernels started with the same claim one.
    Call it outside a running event loop (in async code: ``await asyncio.to_thread(...)``).
    """
    from jupyter_core.utils import run_sync

    if not run_sync(plan_pool)(kernel_name, cwd, env=env):
        return 0
    pool = SandboxPool.instance()
    return pool.wait_ready(kernel_name, timeout=timeout) if wait else pool.ready(kernel_name)
