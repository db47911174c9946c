"""sandbox-kernel: run Jupyter's IPython kernels inside hardened gVisor containers.

The session API, the provisioner and the pool are imported when first named (PEP 562):
every submodule's import runs this file first, and the launcher a front end runs for each
kernel (:mod:`sandbox_kernel.launch`) should not pay for the session API's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sandbox_kernel._version import __version__
from sandbox_kernel.errors import (
    ConfigurationError,
    DockerOperationError,
    DockerUnavailableError,
    ImageNotFoundError,
    KernelHeldError,
    KernelNotFoundError,
    KernelStartupError,
    KernelTakenOverError,
    RuntimeMissingError,
    SandboxKernelError,
    WorkspaceError,
)

if TYPE_CHECKING:
    from sandbox_kernel.agents.session import (
        AsyncSandboxSession,
        Execution,
        ExecutionError,
        Result,
        SandboxSession,
    )
    from sandbox_kernel.pool.sandboxes import SandboxPool
    from sandbox_kernel.provisioner import SandboxProvisioner
    from sandbox_kernel.warming import warm_pool

#: Where each name imported on first use lives.
_LAZY = {
    "AsyncSandboxSession": "sandbox_kernel.agents.session",
    "Execution": "sandbox_kernel.agents.session",
    "ExecutionError": "sandbox_kernel.agents.session",
    "Result": "sandbox_kernel.agents.session",
    "SandboxSession": "sandbox_kernel.agents.session",
    "SandboxPool": "sandbox_kernel.pool.sandboxes",
    "SandboxProvisioner": "sandbox_kernel.provisioner",
    "warm_pool": "sandbox_kernel.warming",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'sandbox_kernel' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AsyncSandboxSession",
    "ConfigurationError",
    "DockerOperationError",
    "DockerUnavailableError",
    "Execution",
    "ExecutionError",
    "ImageNotFoundError",
    "KernelHeldError",
    "KernelNotFoundError",
    "KernelStartupError",
    "KernelTakenOverError",
    "Result",
    "RuntimeMissingError",
    "SandboxKernelError",
    "SandboxPool",
    "SandboxProvisioner",
    "SandboxSession",
    "WorkspaceError",
    "__version__",
    "warm_pool",
]
