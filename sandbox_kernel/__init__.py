"""sandbox-kernel: run Jupyter's IPython kernels inside hardened gVisor containers."""

from sandbox_kernel._version import __version__
from sandbox_kernel.agents.session import (
    AsyncSandboxSession,
    Execution,
    ExecutionError,
    Result,
    SandboxSession,
)
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
from sandbox_kernel.pool.sandboxes import SandboxPool
from sandbox_kernel.provisioner import SandboxProvisioner
from sandbox_kernel.warming import warm_pool

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
