"""Resource limits of a kernel, and the administrator's ceilings that bound them.

A kernelspec (which a user may write into their own data folder) chooses limits; the
server's configuration holds the ceilings. jupyter_client lets kernelspec values beat
the server's config, so precedence cannot protect the ceilings: they are checked here,
in code, at every kernel start.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .errors import ConfigurationError

_SIZE_RE = re.compile(r"^([1-9][0-9]*)([kmg]?)$", re.IGNORECASE)
_UNITS: Mapping[str, int] = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def size_bytes(name: str, value: str) -> int:
    """Bytes in a Docker size string such as ``512m``.

    Raises:
        ConfigurationError: naming the setting and showing the expected form.
    """
    match = _SIZE_RE.match(str(value))
    if match is None:
        msg = f"{name}={value!r} is not a size; use a number with an optional k, m or g suffix, like '512m'."
        raise ConfigurationError(msg)
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


@dataclass(frozen=True)
class Limits:
    """What one kernel may use; also the shape of the ceilings."""

    cpus: float
    memory: str
    pids: int
    tmp_size: str
    exec_timeout: float = 0.0
    idle_timeout: float = 0.0
    file_size: str = "4g"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate_size(name: str, value: str) -> str:
    """Check a Docker size string such as ``512m`` or ``2g``."""
    size_bytes(name, value)
    return value.lower()
