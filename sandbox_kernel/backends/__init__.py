"""Who runs the sandboxes: the interface (base), Docker + gVisor (docker, docker_args,
gvisor_checkpoint), and an in-memory fake for tests (fake).

A kernel's provisioner makes its backend from ``backend_class``; what works on sandboxes
outside any kernel (the command line, a server adopting its persistent kernels, the
reaper of orphans, the files API of a reattached kernel) gets the same with
:func:`configured_backend`.
"""

from __future__ import annotations

from traitlets.config import Config
from traitlets.utils.importstring import import_item

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.plan.admission import with_server_config


def configured_backend(config: Config | None = None) -> SandboxBackend:
    """The backend ``c.SandboxProvisioner.backend_class`` chooses, under ``config`` and the
    server's config files (default: Docker + gVisor).

    Raises:
        ConfigurationError: the class cannot be imported or is not a SandboxBackend.
    """
    chosen = with_server_config(config).get("SandboxProvisioner", {}).get("backend_class")
    if chosen is None:
        from sandbox_kernel.backends.docker import DockerBackend

        return DockerBackend()
    try:
        cls = import_item(chosen) if isinstance(chosen, str) else chosen
    except (ImportError, AttributeError, ValueError) as exc:
        msg = f"SandboxProvisioner.backend_class={chosen!r} cannot be imported: {exc}"
        raise ConfigurationError(msg) from exc
    if not (isinstance(cls, type) and issubclass(cls, SandboxBackend)):
        msg = f"SandboxProvisioner.backend_class={chosen!r} is not a sandbox_kernel.backend.SandboxBackend"
        raise ConfigurationError(msg)
    return cls()
