"""The plan: a kernelspec, the server's settings and one start, made into a sandbox spec.

Pure in the sense that matters: nothing here talks to Docker or starts anything. It
reads the host's accounts and the workspace's owner and mode, which decide where the
kernel may run and as whom. Every administrator's ceiling is checked here, in one place
(:func:`check_ceilings`), from the settings' own declarations (see :mod:`~.settings`).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigurationError, WorkspaceError
from .sandbox_spec import CONTAINER_WORKSPACE

#: The uid (and gid) a kernel runs as when neither the server user nor the workspace
#: owner is a usable (non-root) uid. Files the kernel writes belong to it on the host, so
#: it must be nobody's: not 1000 (the first human account on most hosts), not 65534
#: (``nobody``, which NFS and many daemons use), but 65533, in the range Debian policy
#: (9.2.2) reserves and never allocates (65000-65533). A host that gave it to an account
#: is refused at kernel start (see :func:`check_default_uid_unused`).
DEFAULT_KERNEL_UID = 65533

#: Keys a kernelspec may set in ``metadata.kernel_provisioner.config``.
KERNELSPEC_KEYS = frozenset(
    {
        "image",
        "memory",
        "cpus",
        "pids",
        "tmp_size",
        "file_size",
        "exec_timeout",
        "idle_timeout",
        "network",
        "allowed_domains",
        "workspace_root",
        "workspace_volume",
        "lifecycle",
        "persistent_ttl",
        "pass_env",
        "pool_size",
    }
)

#: Host folders that are never mounted as a workspace, nor is anything inside them.
_SYSTEM_TREES = tuple(
    Path(p)
    for p in (
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/lib",
        "/lib32",
        "/lib64",
        "/proc",
        "/run",
        "/sbin",
        "/sys",
        "/usr",
        "/var/run",
        "/var/lib/docker",
        "/var/lib/containerd",
        "/var/log",
        "/var/spool",
        "/var/mail",
        "/var/backups",
    )
)

#: Folders never mounted themselves (their subfolders may hold projects).
_SYSTEM_DIRS = frozenset(
    Path(p) for p in ("/", "/home", "/root", "/var", "/var/lib", "/var/tmp", "/opt", "/srv", "/mnt", "/tmp")
)


def _home_folders() -> set[Path]:
    """Every account's home folder: mounting one hands its dotfiles to the kernel."""
    homes = {Path(entry.pw_dir) for entry in pwd.getpwall() if entry.pw_dir not in ("", "/")}
    homes.add(Path.home())
    return {home.resolve() for home in homes}


def pooled_workspace_path(workspace: Path, volume: str | None) -> str:
    """Where a kernelspec with a pool shows the workspace: ``/workspace/<its name>``.

    gVisor cannot swap ``/workspace`` itself in a running sandbox, only what appears
    under it, so every kernel of such a kernelspec (pooled or started cold) sees its
    workspace one level down, named after the folder (or volume).
    """
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", volume or workspace.name).strip("-.")
    return f"{CONTAINER_WORKSPACE}/{name or 'work'}"


_VOLUME_FIELDS = ("user", "kernelspec", "notebook", "project")


def volume_name(template: str, **fields: str) -> str:
    """The named Docker volume a kernel's ``workspace_volume`` template asks for.

    ``{user}``, ``{kernelspec}``, ``{notebook}`` (the notebook's path) and ``{project}``
    (its folder's name) are filled in, each reduced to the characters Docker allows, so
    "team-{project}" gives a team one volume per project, and "{user}-{notebook}" each
    person one per notebook.

    Raises:
        ConfigurationError: an unknown placeholder or an unusable result.
    """
    safe = {
        key: re.sub(r"[^A-Za-z0-9_.-]+", "-", fields.get(key, "")).strip("-.") or "untitled"
        for key in _VOLUME_FIELDS
    }
    try:
        name = template.format(**safe)
    except (KeyError, IndexError, ValueError) as exc:
        msg = (
            f"workspace_volume={template!r} is not a valid template ({exc!r}); use the placeholders "
            "{user}, {kernelspec}, {notebook} and {project}, e.g. 'sandbox-{user}-{project}'."
        )
        raise ConfigurationError(msg) from None
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{1,254}", name):
        msg = (
            f"workspace_volume={template!r} gives {name!r}, which is not a Docker volume name "
            "(letters, digits, '_', '.', '-'; starting with a letter or digit)."
        )
        raise ConfigurationError(msg)
    return name


def resolve_workspace(
    cwd: str | os.PathLike[str],
    root: str | os.PathLike[str] | None,
    runtime_parent: str | os.PathLike[str] | None = None,
) -> tuple[Path, str]:
    """Map the kernel's start folder to (host folder to mount, working dir inside).

    Without a ``root`` the start folder itself is the workspace. With one, the root is
    mounted and the start folder must lie inside it.

    Raises:
        WorkspaceError: the folder is missing, is or lies in a system folder, holds the
            kernels' runtime folders, or is outside the root.
    """
    start = Path(cwd).resolve()
    if not start.is_dir():
        msg = f"The kernel's folder {str(start)!r} does not exist or is not a folder."
        raise WorkspaceError(msg)
    if root is None:
        mount, rel = start, Path()
    else:
        mount = Path(root).expanduser().resolve()
        if not mount.is_dir():
            msg = (
                f"The workspace root {str(mount)!r} does not exist. Create it, or fix "
                "SandboxProvisioner.workspace_root (or the kernelspec's workspace_root)."
            )
            raise WorkspaceError(msg)
        try:
            rel = start.relative_to(mount)
        except ValueError:
            msg = (
                f"The notebook's folder {str(start)!r} is outside the workspace root "
                f"{str(mount)!r}, so the sandboxed kernel cannot start there. Move the "
                "notebook under the workspace root, or change the root."
            )
            raise WorkspaceError(msg) from None
    if (
        mount in _SYSTEM_DIRS
        or mount in _home_folders()
        or any(mount.is_relative_to(tree) for tree in _SYSTEM_TREES)
    ):
        msg = (
            f"Refusing to mount {str(mount)!r} (a system or home folder) as the kernel's workspace. "
            "Start the kernel from a project folder, or set SandboxProvisioner.workspace_root."
        )
        raise WorkspaceError(msg)
    if runtime_parent is not None:
        private = Path(runtime_parent).resolve()
        if private.is_relative_to(mount):
            msg = (
                f"Refusing to mount {str(mount)!r} as the kernel's workspace: it contains "
                f"{str(private)!r}, where other kernels keep their private sockets and keys."
            )
            raise WorkspaceError(msg)
    workdir = CONTAINER_WORKSPACE if rel == Path() else f"{CONTAINER_WORKSPACE}/{rel.as_posix()}"
    return mount, workdir


def ensure_outside_workspace(path: str | os.PathLike[str], workspace: Path, setting: str) -> None:
    """Refuse a host file the sandbox must not reach (e.g. the audit log) inside its workspace.

    Raises:
        WorkspaceError: naming the setting to change.
    """
    resolved = Path(path).expanduser().resolve()
    if resolved.is_relative_to(workspace):
        msg = (
            f"{setting}={str(path)!r} lies inside the kernel's workspace {str(workspace)!r}, where "
            f"sandboxed code could read or rewrite it. Point {setting} outside every workspace."
        )
        raise WorkspaceError(msg)


def kernel_user(workspace: Path, configured_uid: int | None = None) -> tuple[int, int]:
    """The (uid, gid) the kernel runs as; never 0.

    Files the kernel writes must be readable and deletable by the host user, so the
    kernel runs as the server's user when that is not root, else as the workspace's
    owner when that is not root, else as :data:`DEFAULT_KERNEL_UID`.

    Raises:
        ConfigurationError: ``configured_uid`` is root, or the default uid is needed
            and belongs to an account on this host.
    """
    if configured_uid is not None:
        if configured_uid <= 0:
            msg = f"kernel_uid={configured_uid!r} is not allowed: the kernel never runs as root."
            raise ConfigurationError(msg)
        return configured_uid, configured_uid
    if os.getuid() != 0:
        return os.getuid(), os.getgid()
    st = workspace.stat()
    if st.st_uid != 0:
        # Never group 0 either, even for a folder owned by alice:root.
        return st.st_uid, st.st_gid or st.st_uid
    return check_default_uid_unused()


def volume_user(configured_uid: int | None = None) -> tuple[int, int]:
    """The (uid, gid) a kernel on a named volume runs as: kernel_uid, else the server's
    uid when that is not root, else :data:`DEFAULT_KERNEL_UID`; never 0.

    Raises:
        ConfigurationError: as :func:`kernel_user`.
    """
    if configured_uid is not None:
        return kernel_user(Path("/"), configured_uid)
    if os.getuid() != 0:
        return os.getuid(), os.getgid()
    return check_default_uid_unused()


def check_default_uid_unused() -> tuple[int, int]:
    """(:data:`DEFAULT_KERNEL_UID`, the same gid), once sure no host account or group has them.

    Whatever the kernel writes belongs to its uid on the host: a uid that is someone's
    would hand that account the files, and a setuid file (were one ever to get through)
    its identity.

    Raises:
        ConfigurationError: naming the account and the setting that avoids it.
    """
    uid = DEFAULT_KERNEL_UID
    try:
        taken = f"the account {pwd.getpwuid(uid).pw_name!r}"
    except KeyError:
        try:
            taken = f"the group {grp.getgrgid(uid).gr_name!r}"
        except KeyError:
            return uid, uid
    msg = (
        f"The sandboxed kernel would run as uid and gid {uid} (the default for a server running as "
        f"root when the workspace belongs to root or is a volume), but on this host that is {taken}, which "
        "would own everything the kernel writes. Set SandboxProvisioner.kernel_uid to a uid that "
        "no account or group uses, or give the workspace to the user the kernel should run as."
    )
    raise ConfigurationError(msg)


def check_lifetime(lifecycle: str, ttl: float, max_ttl: float) -> None:
    """Refuse a persistent kernel whose time-to-live exceeds the server's ceiling.

    Raises:
        ConfigurationError: naming the values and the ceiling.
    """
    if lifecycle == "persistent" and max_ttl > 0 and not 0 < ttl <= max_ttl:
        asked = "no limit" if ttl <= 0 else f"{ttl:g} s"
        msg = (
            f"persistent_ttl={ttl!r} ({asked}) exceeds the server's ceiling of {max_ttl:g} s "
            "(SandboxProvisioner.max_persistent_ttl). Ask for at most that in the kernelspec, "
            "or have the server's administrator raise the ceiling."
        )
        raise ConfigurationError(msg)


def check_pool_size(size: int, ceiling: int) -> None:
    """Refuse a pool larger than the server's ceiling.

    Raises:
        ConfigurationError: naming the values and the ceiling.
    """
    if size > ceiling:
        msg = (
            f"pool_size={size} exceeds the server's ceiling of {ceiling} "
            "(SandboxProvisioner.max_pool_size). Ask for at most that in the kernelspec, or have "
            "the server's administrator raise the ceiling."
        )
        raise ConfigurationError(msg)


def can_write(path: Path, uid: int, gid: int) -> bool:
    """Whether ``uid:gid`` may create files in ``path`` by its mode bits."""
    st = path.stat()
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def validate_kernelspec_config(config: Mapping[str, Any], kernelspec: str = "") -> None:
    """Reject keys a kernelspec may not set in ``metadata.kernel_provisioner.config``.

    jupyter_client silently drops unknown keys; a misspelt limit must not pass unnoticed.

    Raises:
        ConfigurationError: naming the offending key and the allowed ones.
    """
    where = f"kernelspec {kernelspec!r}" if kernelspec else "the kernelspec"
    for key in config:
        if key not in KERNELSPEC_KEYS:
            msg = (
                f"{where} sets {key!r} in metadata.kernel_provisioner.config, which is not "
                f"a setting a kernelspec may choose. Allowed: {', '.join(sorted(KERNELSPEC_KEYS))}."
            )
            raise ConfigurationError(msg)


def check_pass_env(asked: Iterable[str], ceiling: Iterable[str]) -> None:
    """Refuse a kernelspec's ``pass_env`` naming server variables beyond the ceiling.

    Raises:
        ConfigurationError: naming the variables and the ceiling.
    """
    beyond = sorted(set(asked) - set(ceiling))
    if beyond:
        msg = (
            f"pass_env would pass the server's {', '.join(beyond)} into the sandbox, beyond the "
            f"server's ceiling (SandboxProvisioner.max_pass_env={sorted(ceiling)!r}). Remove them from the "
            "kernelspec, set a value in its `env` instead, or have the administrator widen the ceiling."
        )
        raise ConfigurationError(msg)
