"""Where configs name the kernel manager: ``sandbox_kernel.server.SandboxMappingKernelManager``
(now :mod:`sandbox_kernel.jupyter.server`)."""

from sandbox_kernel.jupyter.server import SandboxMappingKernelManager

__all__ = ["SandboxMappingKernelManager"]
