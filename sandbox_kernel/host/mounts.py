"""Host mounts that attach a workspace to a sandbox already running (root only).

A pooled sandbox is started before anyone knows which notebook it will serve. Its
``/workspace`` is an empty, root-owned *slot* folder, mounted with ``rslave``
propagation from a kernel's runtime folder that is made a shared mount point: a bind
mount made on the host under the slot *after* the sandbox started shows up inside it
(gVisor looks children up on the host). The slot itself cannot be replaced (the
sandbox holds it open), so the workspace appears one level down, at
``/workspace/<folder name>``.

Unmounting is the other half: a runtime folder with a workspace mounted in it must
never be deleted recursively, or the user's files go with it. :func:`detach_mounts`
comes first in every removal (see :func:`~.ownership.remove_tree`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

MS_BIND = 0x1000
MS_REC = 0x4000
MS_SHARED = 1 << 20
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def can_mount() -> bool:
    """Whether this process may make the mounts a pool needs (a root server)."""
    return os.geteuid() == 0


def make_shared(folder: Path) -> None:
    """Make ``folder`` a mount point of its own whose sub-mounts propagate to its copies."""
    path = os.fsencode(folder)
    _check(_libc.mount(path, path, None, MS_BIND, None), f"bind {folder} on itself")
    _check(_libc.mount(None, path, None, MS_SHARED | MS_REC, None), f"make {folder} shared")


def bind(source: Path, target: Path) -> None:
    """Bind-mount ``source`` (and the mounts under it, as Docker does) on ``target``."""
    _check(
        _libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND | MS_REC, None),
        f"bind {source} on {target}",
    )


def mounts_under(folder: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[Path]:
    """Mount points at or below ``folder``, deepest first."""
    top = os.path.abspath(folder)
    found = []
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        # Octal escapes (\040 for a space) as the kernel writes them.
        point = fields[4].encode().decode("unicode_escape")
        if point == top or point.startswith(top + "/"):
            found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def detach_mounts(folder: Path) -> list[Path]:
    """Lazily unmount everything mounted at or below ``folder``; the mount points left
    (none unless unmounting failed, e.g. without root)."""
    for point in mounts_under(folder):
        _libc.umount2(os.fsencode(point), MNT_DETACH)
    return mounts_under(folder)


def attach_workspace(slot: Path, workspace_path: str, source: Path) -> Path:
    """Mount ``source`` (the workspace on the host) where a pooled sandbox shows it:
    under its slot, as ``workspace_path`` (``/workspace/<name>``) inside; the mount point."""
    target = slot / Path(workspace_path).name
    target.mkdir(mode=0o755, exist_ok=True)
    bind(source, target)
    return target
