"""Fresh workspaces: a folder of its own for a session (or MCP server) started without one.

A program that gives no ``cwd`` used to get the process's current folder, so two
assistants started in the same folder (or an MCP client's ``/`` or home) shared files,
or were refused. Now such a session gets a new, empty folder under this user's data
folder, ``JUPYTER_DATA_DIR/sandbox-kernel/workspaces/`` (``~/.local/share/jupyter/...``):
mode 0700, owned by this user (by the uid the kernel runs as, under root: a root
program's kernel never runs as root, so the folder goes to ``kernel_uid`` or 65533 while
the folders above it stay root's, 0700). Its owner removes it when the session ends,
unless asked to keep it; a session's whose process was killed outright is removed by the
next fresh workspace of that user, or by ``jupyter sandbox-kernel prune``.

An administrator's ``workspace_root`` (the server's config, the kernelspec or
``$SANDBOX_KERNEL_WORKSPACE_ROOT``) mounts that root for every kernel, so no folder
elsewhere can be a session's own workspace: :func:`check_fresh_workspace_allowed` says
to pass ``cwd`` then, before anything is made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_core.paths import jupyter_data_dir
from traitlets.config import Config

from sandbox_kernel.errors import WorkspaceError
from sandbox_kernel.host.trees import delete_tree
from sandbox_kernel.lifecycle.ownership import owner_is_gone, server_identity
from sandbox_kernel.plan.admission import with_server_config
from sandbox_kernel.plan.plan import check_default_uid_unused, kernelspec_config
from sandbox_kernel.plan.settings import SandboxSettings

log = logging.getLogger(__name__)

#: Beside each fresh workspace that goes at its process's end: that process's identity.
OWNER_SUFFIX = ".owner"
#: The setting sections the provisioner reads (its class, and the settings' own).
_SECTIONS = ("SandboxProvisioner", "SandboxSettings")


def workspaces_parent() -> Path:
    """Where fresh workspaces are made: ``JUPYTER_DATA_DIR/sandbox-kernel/workspaces``."""
    return Path(jupyter_data_dir()) / "sandbox-kernel" / "workspaces"


def _setting(config: Config, name: str) -> Any:
    for section in _SECTIONS:
        if section in config and name in config[section]:
            return config[section][name]
    return None


def check_fresh_workspace_allowed(kernel_name: str, config: Config | None = None) -> None:
    """Refuse a fresh workspace where the administrator's ``workspace_root`` decides
    the workspace: it would be refused at the start (outside the root), and inside the
    root every kernel sees the whole root anyway. And where a ``workspace_volume``
    template names the volume after the folder (``{project}``): each session would get
    a new volume, left behind.

    Raises:
        WorkspaceError: naming the setting, where it is set, and what to pass.
    """
    merged = with_server_config(config)
    root, where = None, ""
    try:
        spec = KernelSpecManager(config=merged).get_kernel_spec(kernel_name)
    except NoSuchKernel:
        spec = None  # the start says so, naming what to install
    chosen = kernelspec_config(spec, kernel_name) if spec is not None else {}
    volume = chosen.get("workspace_volume") or _setting(merged, "workspace_volume")
    if volume and "{project}" in str(volume):
        msg = (
            f"Pass cwd= a folder whose name names the project: workspace_volume={str(volume)!r} makes "
            "the workspace a Docker volume named after the kernel's folder ({project}), and a fresh "
            "folder's name would make a new volume for every session."
        )
        raise WorkspaceError(msg)
    if spec is not None:
        root, where = chosen.get("workspace_root"), f"kernelspec {kernel_name!r}"
    if root is None:
        root, where = _setting(merged, "workspace_root"), "the server's config"
    if root is None:
        root, where = (
            os.environ.get(SandboxSettings.WORKSPACE_ROOT_ENV) or None,
            f"${SandboxSettings.WORKSPACE_ROOT_ENV}",
        )
    if root is None:
        return
    msg = (
        f"Pass cwd= a folder under {str(root)!r} (SandboxSession(cwd=...), or --cwd for "
        f"`jupyter sandbox-kernel mcp`): workspace_root={str(root)!r} ({where}) mounts that folder for "
        "every kernel, so a session without cwd cannot get a workspace of its own elsewhere."
    )
    raise WorkspaceError(msg)


def _owner_for_kernel(config: Config) -> tuple[int, int] | None:
    """Who must own a fresh workspace so that the kernel can write it: None (this
    process) unless it runs as root, then ``kernel_uid`` or 65533 (never root).

    Raises:
        ConfigurationError: 65533 is needed and an account or group has it.
    """
    if os.getuid() != 0:
        return None
    configured = _setting(config, "kernel_uid")
    if configured is not None and int(configured) > 0:
        return int(configured), int(configured)
    return check_default_uid_unused()


def _private_folder(path: Path) -> None:
    """Make ``path`` (and the folders above it that are missing) 0700 folders of this
    process's user; refuse one that is a link, someone else's or open to others.

    Raises:
        WorkspaceError: naming the folder and what is wrong with it.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)  # the missing folders above: as umask says
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        msg = (
            f"{str(path)!r}, where fresh workspaces are made, must be a folder of uid {os.getuid()} "
            f"that no one else may enter (mode 0700); it is {stat.filemode(info.st_mode)}, owned by uid "
            f"{info.st_uid}. Remove it (it is made again), or pass cwd= a folder of yours."
        )
        raise WorkspaceError(msg)


def _marker(path: Path) -> Path:
    """Beside a fresh workspace (out of the kernel's reach): who will remove it."""
    return path.with_name(path.name + OWNER_SUFFIX)


def make_fresh_workspace(kernel_name: str, config: Config | None = None, sweep: bool = False) -> Path:
    """A new, empty workspace folder for one session (see the module). With ``sweep``, a
    file beside it names this process, so that once it has died without removing the
    folder, the next fresh workspace (or ``jupyter sandbox-kernel prune``) removes it.

    Raises:
        WorkspaceError: an administrator's ``workspace_root`` decides the workspace, or
            the workspaces' folder is unsafe.
        ConfigurationError: a root process's kernel would run as a uid an account has.
    """
    check_fresh_workspace_allowed(kernel_name, config)
    merged = with_server_config(config)
    owner = _owner_for_kernel(merged)
    parent = workspaces_parent()
    _private_folder(parent)
    sweep_abandoned_workspaces()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(tempfile.mkdtemp(prefix=f"{stamp}-", dir=parent))  # 0700, this process's
    if sweep:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(_marker(path), flags, 0o600), "w") as marker:
            marker.write(server_identity())
    if owner is not None:
        os.chown(path, *owner, follow_symlinks=False)
    log.info("Fresh workspace %s for a session without cwd", path)
    return path


def keep_workspace(path: Path) -> None:
    """Keep a fresh workspace after this process: nothing removes it then but its user."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_marker(path))


def remove_workspace(path: Path) -> None:
    """Remove a fresh workspace and everything the kernel left in it (links removed,
    never followed). A failure is logged, not raised: the session is over either way."""
    try:
        delete_tree(path)
    except OSError as exc:
        log.warning("Could not remove the session's workspace %s: %s", path, exc)
        return
    keep_workspace(path)  # its marker goes with it
    log.info("Removed the session's workspace %s", path)


def sweep_abandoned_workspaces() -> list[Path]:
    """Remove this user's fresh workspaces whose process died without removing them
    (killed outright); those kept, and those of a process that may be alive, stay.
    The fresh workspaces removed."""
    removed: list[Path] = []
    parent = workspaces_parent()
    try:
        markers = [entry for entry in os.scandir(parent) if entry.name.endswith(OWNER_SUFFIX)]
    except OSError:
        return removed
    for entry in markers:
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd) as marker:
                identity = marker.read(4096)
        except OSError:
            continue
        if owner_is_gone(identity):
            folder = parent / entry.name.removesuffix(OWNER_SUFFIX)
            remove_workspace(folder)
            removed.append(folder)
    return removed
