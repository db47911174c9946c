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


def check_within_ceilings(limits: Limits, ceilings: Limits) -> None:
    """Refuse any limit above its ceiling.

    Raises:
        ConfigurationError: naming the limit, its value, the ceiling and who can raise it.
    """
    checks: list[tuple[str, Any, Any, float, float]] = [
        ("cpus", limits.cpus, ceilings.cpus, limits.cpus, ceilings.cpus),
        ("pids", limits.pids, ceilings.pids, limits.pids, ceilings.pids),
        (
            "memory",
            limits.memory,
            ceilings.memory,
            size_bytes("memory", limits.memory),
            size_bytes("max_memory", ceilings.memory),
        ),
        (
            "tmp_size",
            limits.tmp_size,
            ceilings.tmp_size,
            size_bytes("tmp_size", limits.tmp_size),
            size_bytes("max_tmp_size", ceilings.tmp_size),
        ),
        (
            "file_size",
            limits.file_size,
            ceilings.file_size,
            size_bytes("file_size", limits.file_size),
            size_bytes("max_file_size", ceilings.file_size),
        ),
    ]
    for name, asked, ceiling in (
        ("exec_timeout", limits.exec_timeout, ceilings.exec_timeout),
        ("idle_timeout", limits.idle_timeout, ceilings.idle_timeout),
    ):
        if ceiling > 0 and not 0 < asked <= ceiling:
            what = "no limit" if asked <= 0 else f"{asked:g} s"
            msg = (
                f"{name}={asked!r} ({what}) exceeds the server's ceiling of {ceiling:g} s "
                f"(SandboxProvisioner.max_{name}). Ask for at most that in the kernelspec, "
                "or have the server's administrator raise the ceiling."
            )
            raise ConfigurationError(msg)
    for name, value, ceiling, amount, most in checks:
        if amount > most:
            msg = (
                f"{name}={value!r} exceeds the server's ceiling of {ceiling!r} "
                f"(SandboxProvisioner.max_{name}). Ask for at most {ceiling!r} in the kernelspec, "
                "or have the server's administrator raise the ceiling."
            )
            raise ConfigurationError(msg)


def kernel_startup(limits: Limits) -> str:
    """Python the kernel runs at its start (as PYTHONSTARTUP): clear messages for the limits,
    and the notebook's folder back on ``sys.path``.

    This is for the user's benefit, not enforcement (the kernel's own code could undo it):

    - the kernel starts with PYTHONSAFEPATH, so that nothing in the workspace runs
      before it is up; once it is, ``import mymodule`` of a file next to the notebook
      works as in a local kernel (``''`` where IPython puts it: after the standard
      library, before site-packages), and child processes (``!python script.py``)
      start without PYTHONSAFEPATH, finding their own folder's modules as usual;
    - a ``MemoryError`` names the memory limit (gVisor fails allocations with ENOMEM at
      the container's limit rather than killing the kernel);
    - with a wall-clock limit, a SIGALRM armed before each cell raises a TimeoutError
      naming it, so the user keeps the kernel. Code that blocks or ignores the signal is
      the host's business: the provisioner interrupts, then kills the kernel.
    """
    return f"""\
def _sandbox_kernel_startup(memory, exec_timeout):
    import os
    import signal
    import sys

    os.environ.pop("PYTHONSAFEPATH", None)
    if "" not in sys.path:
        names = [os.path.basename(entry) for entry in sys.path]
        packages = [i for i, name in enumerate(names) if name in ("site-packages", "dist-packages")]
        sys.path.insert(packages[0] if packages else 0, "")

    shell = get_ipython()  # noqa: F821

    def memory_error(self, etype, value, tb, tb_offset=None):
        detail = str(value)
        message = (
            f"memory limit {{memory}} of this sandboxed kernel reached"
            + (f" ({{detail}})" if detail else "")
            + ": the allocation failed and the kernel keeps running; free memory (del, gc) "
            "or restart the kernel, or ask for a higher limit"
        )
        value.args = (message,)
        # Some errors (numpy's) render from their own fields: show a plain one instead.
        shown = value if str(value) == message else MemoryError(message)
        self.showtraceback((type(shown), shown, tb), tb_offset=tb_offset)

    shell.set_custom_exc((MemoryError,), memory_error)
    if exec_timeout <= 0:
        return

    def expired(signum, frame):
        raise TimeoutError(
            f"execution stopped: the wall-clock limit of {{exec_timeout:g}} s per execution was exceeded "
            "(sandbox-kernel exec_timeout); split the work into shorter cells or ask for a higher limit"
        )

    def arm(info):
        signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, exec_timeout)

    def disarm(result):
        signal.setitimer(signal.ITIMER_REAL, 0)

    shell.events.register("pre_run_cell", arm)
    shell.events.register("post_run_cell", disarm)


_sandbox_kernel_startup({limits.memory!r}, {float(limits.exec_timeout)!r})
del _sandbox_kernel_startup
"""
