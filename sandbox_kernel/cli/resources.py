"""Locate the files shipped with the package: kernelspecs and image recipes."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # sandbox_kernel/


def data_path(name: str) -> Path:
    """``kernelspecs`` or ``images``, from the wheel or from a source checkout.

    Raises:
        FileNotFoundError: the installation is incomplete.
    """
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    msg = f"sandbox-kernel's {name!r} folder is missing from {_PACKAGE}; reinstall the package."
    raise FileNotFoundError(msg)
