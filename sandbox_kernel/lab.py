"""Where configs name the server extension: ``sandbox_kernel.lab`` (now :mod:`sandbox_kernel.jupyter.lab`)."""

from sandbox_kernel.jupyter.lab import _jupyter_server_extension_points, _load_jupyter_server_extension

__all__ = ["_jupyter_server_extension_points", "_load_jupyter_server_extension"]
