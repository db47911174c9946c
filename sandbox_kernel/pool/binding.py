"""The binding: what makes a running sandbox one kernel's.

A sandbox started cold is bound as it is created (its kernel id in its name, its
workspace mounted, its session key in its connection file). A pooled sandbox exists
before its kernel (see :mod:`~.pool`): a claim binds it afterwards, here. What binds it:

- the kernel id: the container is named after it, and the kernel's saved state (its
  runtime folder's ``provisioner.json``) says whose it is;
- the session key: the sandbox's own, fresh and random, which nobody but this process
  has seen; the manager adopts it, as when reattaching (so the bridge re-signs nothing);
- the workspace: mounted under the sandbox's slot, where it appears as
  ``/workspace/<name>``;
- the working folder and the per-kernel session variables (``JPY_SESSION_NAME``),
  handed to the kernel through its one-shot claim socket;
- for a start that narrows the pool's plan (see :mod:`~.fit`): the lower memory and CPU
  limits, written to the sandbox's host cgroup while it is still frozen, and the
  variables, the policy and the lower resource limits the kernel takes with its claim.

One sandbox serves one kernel, ever: a binding is never undone, the sandbox is removed
with its kernel.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.lifecycle.launch_folder import send_claim
from sandbox_kernel.plan.sandbox_spec import PER_KERNEL_ENV, SandboxSpec
from sandbox_kernel.pool.fit import Narrowing
from sandbox_kernel.pool.sandboxes import PooledSandbox


@dataclass(frozen=True)
class KernelBinding:
    """One kernel's own part of a sandbox spec (everything else is the plan's)."""

    kernel_id: str
    name: str
    workdir: str
    workspace_path: str
    #: Session variables that differ from one kernel of a kernelspec to the next.
    env: dict[str, str]

    @classmethod
    def of(cls, spec: SandboxSpec) -> KernelBinding:
        return cls(
            kernel_id=spec.kernel_id,
            name=spec.container_name,
            workdir=spec.workdir,
            workspace_path=spec.workspace_path,
            env={name: value for name, value in spec.env.items() if name in PER_KERNEL_ENV},
        )


async def bind(
    backend: SandboxBackend,
    sandbox: PooledSandbox,
    spec: SandboxSpec,
    key: bytes | None = None,
    narrowing: Narrowing | None = None,
) -> KernelBinding:
    """Make the claimed ``sandbox`` the kernel of ``spec``'s: narrowed to it (``narrowing``,
    its lower limits first), thawed, its workspace attached (a volume prepared first), its
    kernel told where to work, its variables and its lower limits, and on a restart
    (``key``) the session key the kernel's clients hold. The container's name follows in
    the background (:func:`rename`).

    Raises:
        SandboxKernelError, OSError: it could not be bound; remove the sandbox.
    """
    binding, narrowing = KernelBinding.of(spec), narrowing or Narrowing()
    if narrowing.memory is not None or narrowing.cpus is not None:
        await asyncio.to_thread(sandbox.narrow, narrowing.memory, narrowing.cpus)
    await asyncio.to_thread(sandbox.thaw)
    source = await backend.prepare_workspace(spec) or spec.workspace
    await backend.attach_workspace(sandbox.slot, binding.workspace_path, source)
    env = {**narrowing.env, **binding.env}
    await asyncio.to_thread(
        send_claim,
        sandbox.launch_dir,
        binding.workdir,
        env,
        key=key,
        unset=narrowing.unset,
        rlimits=narrowing.rlimits,
    )
    return binding
