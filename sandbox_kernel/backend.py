"""Where a backend of one's own finds the interface: ``sandbox_kernel.backend.SandboxBackend``
(now :mod:`sandbox_kernel.backends.base`)."""

from sandbox_kernel.backends.base import SandboxBackend

__all__ = ["SandboxBackend"]
