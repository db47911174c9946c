"""Sealing a kernel's launch folder: once the kernel is up, only what the host expects stays.

Each launch gets a fresh host folder (mounted at ``/run/sandbox-kernel``) that the kernel
owns while it starts, so that it can bind its ipc sockets there. Code that runs before
the seal (a kernelspec's own argv, a module that shadows one ipykernel imports) can put
anything there too: a world-writable folder left in the host's runtime folder would
outlive the seal. So the seal hands the folder to the server and then removes every
entry but the kernel's sockets and the files the host wrote itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

from .errors import KernelStartupError
from .policy import (
    CONTAINER_CONNECTION_FILE,
    CONTAINER_EGRESS_SOCKET,
    CONTAINER_RELAY_FILE,
    CONTAINER_STARTUP_FILE,
    kernel_sockets,
)

log = logging.getLogger(__name__)

#: Files the host writes into the launch folder before the kernel starts.
HOST_FILES = frozenset(
    Path(p).name for p in (CONTAINER_CONNECTION_FILE, CONTAINER_STARTUP_FILE, CONTAINER_RELAY_FILE)
)
#: A socket the kernel binds only with network "allowlist" (the egress relay's).
OPTIONAL_SOCKETS = frozenset({Path(CONTAINER_EGRESS_SOCKET).name})
#: How many times the folders of an entry being removed are locked again, for the
#: kernel may be creating subfolders while the host walks them.
_LOCK_PASSES = 5


def seal_launch_dir(launch_dir: Path, owner: tuple[int, int] = (0, 0)) -> list[str]:
    """Hand ``launch_dir`` to ``owner`` (0755), then keep only the kernel's sockets and
    the host's own files (as regular files); the names removed.

    The folder is handed over first, so the kernel can add nothing while the rest is
    cleared. Only a root server can do this (the kernel has another uid).

    Raises:
        KernelStartupError: one of the kernel's sockets is not a socket (something
            took its name before the kernel bound it), or an entry could not be removed.
    """
    os.chown(launch_dir, *owner)
    launch_dir.chmod(0o755)
    sockets = {path.name for path in kernel_sockets(launch_dir).values()}
    removed = []
    for entry in sorted(os.listdir(launch_dir)):
        path = launch_dir / entry
        mode = path.lstat().st_mode
        if entry in sockets | OPTIONAL_SOCKETS:
            if not stat.S_ISSOCK(mode):
                msg = (
                    f"The sandboxed kernel's {entry} in {str(launch_dir)!r} is a {stat.filemode(mode)} "
                    "entry, not the socket the kernel binds: code that ran before the kernel took its "
                    "name. Check the kernelspec's argv and the workspace, then restart the kernel."
                )
                raise KernelStartupError(msg)
            continue
        if entry in HOST_FILES and stat.S_ISREG(mode):
            # Still read by the kernel as it starts (connection.json is its own, 0600);
            # a file, even one the kernel rewrote, holds no entries.
            continue
        _remove(path, mode, owner)
        removed.append(entry)
    if removed:
        log.warning(
            "Sandboxed kernel launch folder %s: removed %s, made by the kernel before the seal",
            launch_dir,
            ", ".join(removed),
        )
    return removed


def _remove(path: Path, mode: int, owner: tuple[int, int]) -> None:
    """Remove an entry the kernel made, even while it still writes into it.

    Every folder in it is handed to ``owner`` (0700) first, top-down and until none is
    left, so the kernel cannot keep adding entries for the removal to trip over.

    Raises:
        KernelStartupError: it could not be removed.
    """
    try:
        if stat.S_ISDIR(mode):
            for _ in range(_LOCK_PASSES):
                changed = 0
                for _root, _dirs, _files, fd in os.fwalk(path):
                    st = os.fstat(fd)
                    if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) != (*owner, 0o700):
                        os.fchown(fd, *owner)
                        os.fchmod(fd, 0o700)
                        changed += 1
                if not changed:
                    break
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as exc:
        msg = f"Could not remove {str(path)!r}, which the sandboxed kernel made before the seal: {exc}"
        raise KernelStartupError(msg) from exc
