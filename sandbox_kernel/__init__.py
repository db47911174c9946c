"""sandbox-kernel: run Jupyter's IPython kernels inside hardened gVisor containers."""

from ._version import __version__
from .errors import (
    ConfigurationError,
    DockerOperationError,
    DockerUnavailableError,
    ImageNotFoundError,
    KernelNotFoundError,
    KernelStartupError,
    RuntimeMissingError,
    SandboxKernelError,
    WorkspaceError,
)
from .pool import SandboxPool, warm_pool
from .provisioner import SandboxProvisioner

__all__ = [
    "ConfigurationError",
    "DockerOperationError",
    "DockerUnavailableError",
    "ImageNotFoundError",
    "KernelNotFoundError",
    "KernelStartupError",
    "RuntimeMissingError",
    "SandboxKernelError",
    "SandboxPool",
    "SandboxProvisioner",
    "WorkspaceError",
    "__version__",
    "warm_pool",
]
