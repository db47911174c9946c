"""sandbox-kernel: run Jupyter's IPython kernels inside hardened gVisor containers."""

from ._version import __version__
from .errors import (
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
from .pool import SandboxPool
from .provisioner import SandboxProvisioner
from .session import AsyncSandboxSession, Execution, ExecutionError, Result, SandboxSession
from .warming import warm_pool

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
