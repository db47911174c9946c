"""Resource limits of a kernel, and the administrator's ceilings that bound them.

A kernelspec (which a user may write into their own data folder) chooses limits; the
server's configuration holds the ceilings. jupyter_client lets kernelspec values beat
the server's config, so precedence cannot protect the ceilings: they are checked here,
in code, at every kernel start.

Sizes (``512m``, ``1.5g``, ``1073741824``) and durations (``300``, ``90s``, ``5m``,
``1.5h``, ``1d``) are parsed here, for the traits of :mod:`~.settings` and for whatever
reads a limit back in bytes or seconds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from sandbox_kernel.errors import ConfigurationError

_SIZE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([kmg]?)$", re.IGNORECASE)
_UNITS: Mapping[str, int] = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
SIZE_FORMS = (
    "a whole number of bytes, or a number with k, m or g (powers of 1024), "
    "like '512m', '1.5g' or '1073741824'"
)

_DURATION_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhd]?)$", re.IGNORECASE)
_SECONDS: Mapping[str, int] = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
DURATION_FORMS = (
    "a number of seconds (e.g. 300), or a number with s, m, h or d, like '90s', '5m', '1.5h' or '1d'"
)


def size_bytes(name: str, value: str | int) -> int:
    """Bytes in a size such as ``512m``, ``1.5g`` or ``1073741824`` (k, m, g: powers of 1024).

    Raises:
        ConfigurationError: naming the setting and showing the accepted forms; also for
            a size of 0 bytes and for a fraction of a byte.
    """
    match = _SIZE_RE.match(str(value).strip())
    if match is not None:
        number, unit = match.group(1), match.group(2).lower()
        if unit or number.isdigit():
            amount = int(float(number) * _UNITS[unit]) if "." in number else int(number) * _UNITS[unit]
            if amount > 0:
                return amount
    msg = f"{name}={value!r} is not a size; use {SIZE_FORMS} (above 0)."
    raise ConfigurationError(msg)


def validate_size(name: str, value: str | int) -> str:
    """Check a size such as ``512m`` or ``1.5g``; the size as written, lowercased.

    Raises:
        ConfigurationError: as :func:`size_bytes`.
    """
    size_bytes(name, value)
    return str(value).strip().lower()


def docker_size(name: str, value: str) -> str:
    """``value`` in a form every consumer reads: Docker, and gVisor's or Linux's tmpfs
    ``size=``, take a whole number with an optional k, m or g, but no fraction (``1.5g``
    becomes its bytes).

    Raises:
        ConfigurationError: as :func:`size_bytes`.
    """
    amount = size_bytes(name, value)
    text = str(value).strip().lower()
    return text if "." not in text else str(amount)


def duration_seconds(name: str, value: object) -> float:
    """Seconds in a duration: a number of seconds (``300``, ``2.5``) or a string with an
    optional unit (``"300"``, ``"90s"``, ``"5m"``, ``"1.5h"``, ``"1d"``).

    Raises:
        ConfigurationError: naming the setting, showing the value and the accepted forms;
            also for a negative or infinite number.
    """
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value.strip())
        if match is not None:
            seconds = float(match.group(1)) * _SECONDS[match.group(2).lower()]
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        msg = f"{name}={value!r} is not a duration; use {DURATION_FORMS} (not negative)."
        raise ConfigurationError(msg)
    return seconds


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
