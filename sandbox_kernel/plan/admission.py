"""What every way of starting a sandboxed kernel passes: the sandbox, and the server's config.

A Jupyter server reads its configuration (``jupyter_server_config.py``/``.json`` in every
folder of ``jupyter --paths``' config list, ``JUPYTER_CONFIG_DIR`` included) and hands it to
each kernel's manager. Programs, the MCP server, ``jupyter sandbox-kernel run`` and the
kernelspec's own launcher (what VS Code runs) are no server: without this module their
kernels would miss the administrator's ceilings and central audit log. So the provisioner
itself starts from :func:`server_config`, under whatever config its manager was given
(which may only add to it: a program that passes ``config=`` still gets the files'
settings it does not set itself).

And a name is no proof: ``SandboxSession("python3")`` would run the assistant's code on the
host. :func:`require_sandboxed` refuses any kernelspec whose kernels are not started by
the sandbox provisioner, and :func:`sandboxed_manager` is the one place our entry points
make their kernel managers.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.application import JupyterApp
from traitlets.config import Config

from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.plan.plan import kernelspec_config

#: The provisioner's entry point (pyproject.toml), as a kernelspec names it.
PROVISIONER_NAME = "sandbox-provisioner"
#: The config a Jupyter server reads: where administrators put c.SandboxProvisioner.*.
CONFIG_FILE_NAME = "jupyter_server_config"


class _ServerConfigReader(JupyterApp):
    """Reads the config files a Jupyter server would, the same way (jupyter_core's)."""

    name = "sandbox-kernel-config"
    config_file_name = CONFIG_FILE_NAME
    raise_config_file_errors = True


_lock = threading.Lock()
_cached: tuple[tuple[tuple[str, float], ...], Config] | None = None


def _config_files() -> tuple[tuple[str, float], ...]:
    """Every server config file there is now, with its modification time."""
    found = []
    for folder in _ServerConfigReader().config_file_paths:
        for name in (f"{CONFIG_FILE_NAME}.py", f"{CONFIG_FILE_NAME}.json"):
            path = os.path.join(folder, name)
            try:
                found.append((path, os.stat(path).st_mtime))
            except OSError:
                continue
    return tuple(found)


def server_config() -> Config:
    """The configuration a Jupyter server started now would read from its config files
    (a copy: change it freely). Read again when a file changes.

    Raises:
        ConfigurationError: a config file cannot be read; naming it.
    """
    global _cached
    files = _config_files()
    with _lock:
        if _cached is None or _cached[0] != files:
            reader = _ServerConfigReader()
            try:
                reader.load_config_file(suppress_errors=False)
            except Exception as exc:  # a config file is code: anything may go wrong in it
                listed = ", ".join(path for path, _ in files) or CONFIG_FILE_NAME
                msg = (
                    f"The Jupyter server config ({listed}) could not be read, so the "
                    f"administrator's sandbox settings are unknown and no kernel starts: {exc}"
                )
                raise ConfigurationError(msg) from exc
            _cached = (files, reader.config)
        return copy.deepcopy(_cached[1])


def with_server_config(given: Config | None) -> Config:
    """``given`` over the server's config files: what a server run with ``given`` on its
    command line would have."""
    config = server_config()
    if given:
        config.merge(given)
    return config


def uses_sandbox(kernel_spec: KernelSpec) -> bool:
    """Whether jupyter_client starts this kernelspec's kernels with the sandbox provisioner."""
    metadata = getattr(kernel_spec, "metadata", None) or {}
    provisioner = metadata.get("kernel_provisioner") or {}
    return isinstance(provisioner, dict) and provisioner.get("provisioner_name") == PROVISIONER_NAME


def require_sandboxed(
    kernel_name: str, kernel_spec: KernelSpec | None = None, config: Config | None = None
) -> KernelSpec:
    """The kernelspec ``kernel_name``, if its kernels run in the sandbox.

    Raises:
        ConfigurationError: there is no such kernelspec, or it does not use the sandbox
            (its kernels would run on the host); the message names it and what to use.
    """
    if kernel_spec is None:
        try:
            kernel_spec = KernelSpecManager(config=config or Config()).get_kernel_spec(kernel_name)
        except NoSuchKernel:
            msg = (
                f"No kernelspec named {kernel_name!r}: install it with `jupyter sandbox-kernel install`, "
                "or choose another (see `jupyter kernelspec list`)."
            )
            raise ConfigurationError(msg) from None
    if uses_sandbox(kernel_spec):
        # A broken config: a clear error here, not jupyter_client's TypeError later.
        kernelspec_config(kernel_spec, kernel_name)
    else:
        msg = (
            f"Kernelspec {kernel_name!r} ({getattr(kernel_spec, 'display_name', '')}) does not run its "
            f"kernels in the sandbox (its metadata.kernel_provisioner is not {PROVISIONER_NAME!r}): "
            "its code would run on this host, with this process's rights. Refused; choose a "
            "sandboxed kernelspec such as 'sandboxed-python' (`jupyter sandbox-kernel install` "
            "makes one)."
        )
        raise ConfigurationError(msg)
    return kernel_spec


def sandboxed_manager(kernel_name: str, config: Config | None = None, **kwargs: Any) -> AsyncKernelManager:
    """A kernel manager for ``kernel_name``, refused unless its kernels run in the sandbox.

    ``config``: settings as a server's command line would give them (the provisioner adds
    the server's config files under them).

    Raises:
        ConfigurationError: see :func:`require_sandboxed`.
    """
    config = Config(config or {})
    require_sandboxed(kernel_name, config=config)
    return AsyncKernelManager(kernel_name=kernel_name, config=config, **kwargs)
