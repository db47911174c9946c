"""Host mounts that attach a workspace to a sandbox already running (root only).

A pooled sandbox is started before anyone knows which notebook it will serve. Its
``/workspace`` is an empty, root-owned *slot* folder, mounted with ``rslave``
propagation from a kernel's runtime folder that is made a shared mount point: a bind
mount made on the host under the slot *after* the sandbox started shows up inside it
(gVisor looks children up on the host). The slot itself cannot be replaced (the
sandbox holds it open), so the workspace appears one level down, at
``/workspace/<folder name>``.

A gateway user's workspace is *pinned* (:func:`pin_folder`): opened as a descriptor by a
walk that checks whose each folder is (:func:`~.trees.open_folder`), and bind-mounted from
that descriptor onto a root-only staging folder in the kernel's runtime folder, which is
what Docker or a pool's claim then mounts. The user may rename their folders or swap them
for links at any moment: the mount follows the descriptor, never a name, so the folder
checked is the folder mounted.

Unmounting is the other half: a runtime folder with a workspace mounted in it must
never be deleted recursively, or the user's files go with it. :func:`detach_mounts`
comes first in every removal (see :func:`~.ownership.remove_tree`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from pathlib import Path

from sandbox_kernel.host.trees import open_folder

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


def bind_descriptor(fd: int, target: Path) -> None:
    """Bind-mount the folder open as ``fd`` (an ``O_PATH`` descriptor will do), and the
    mounts under it, on ``target``: ``/proc/self/fd/N`` leads to the descriptor's folder
    itself, not to whatever its path names now."""
    _check(
        _libc.mount(f"/proc/self/fd/{fd}".encode(), os.fsencode(target), None, MS_BIND | MS_REC, None),
        f"bind the folder open as descriptor {fd} on {target}",
    )


def pin_folder(source: Path, target: Path, owner: int, owned_from: Path) -> tuple[int, int]:
    """Mount the folder ``source`` on the folder ``target`` (made 0700 if missing, whatever
    was mounted there detached first) from a descriptor :func:`~.trees.open_folder` opened,
    every folder from ``owned_from`` down to it checked to be ``owner``'s; its (device, inode).

    Raises:
        ValueError, NotADirectoryError, ForeignFolderError, OSError: as
            :func:`~.trees.open_folder`: ``source`` is not (or no longer) that; or the
            mount failed (without root, say). Nothing stays mounted on ``target`` then.
    """
    fd = open_folder(source, owner, owned_from)
    try:
        st = os.fstat(fd)
        target.mkdir(mode=0o700, exist_ok=True)
        detach_mounts(target)
        bind_descriptor(fd, target)
    finally:
        os.close(fd)
    mounted = os.stat(target)
    if (mounted.st_dev, mounted.st_ino) != (st.st_dev, st.st_ino):  # never expected: say so, mount nothing
        detach_mounts(target)
        msg = f"{target} shows another folder than the one pinned from {source}"
        raise OSError(msg)
    return st.st_dev, st.st_ino


def mounts_under(folder: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[Path]:
    """Mount points at or below ``folder``, deepest first."""
    top = os.fsencode(os.path.abspath(folder))
    found = []
    try:
        # Bytes, and lines only at newlines: a mount's source folder may have any name, UTF-8
        # or not, a carriage return in it.
        lines = mountinfo.read_bytes().split(b"\n")
    except OSError:
        return []
    for line in lines:
        fields = line.split(b" ")
        if len(fields) < 5:
            continue
        point = _unescaped(fields[4])
        if point == top or point.startswith(top + b"/"):
            found.append(Path(os.fsdecode(point)))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def _unescaped(field: bytes) -> bytes:
    """A mountinfo path: the kernel writes a space, tab, newline and backslash as octal
    escapes (``\\040``), every other byte as it is."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field)


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
