"""The plan: a kernelspec, the server's settings and one start, made into a sandbox spec.

Pure in the sense that matters: nothing here talks to Docker or starts anything. It
reads the host's accounts and the workspace's owner and mode, which decide where the
kernel may run and as whom. Every administrator's ceiling is checked here, in one place
(:func:`check_ceilings`), from the settings' own declarations (see :mod:`~.settings`).
"""

from __future__ import annotations

import fnmatch
import getpass
import grp
import json
import os
import pwd
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jupyter_core.paths import jupyter_config_dir, jupyter_data_dir, jupyter_runtime_dir
from traitlets import TraitError

from sandbox_kernel.egress import EgressPolicy, EgressRules
from sandbox_kernel.egress.credentials import CredentialSpec
from sandbox_kernel.errors import ConfigurationError, WorkspaceError
from sandbox_kernel.plan.limits import size_bytes
from sandbox_kernel.plan.sandbox_spec import (
    CONTAINER_STARTUP_FILE,
    CONTAINER_WORKSPACE,
    LABEL_LIFECYCLE,
    LABEL_OWNER,
    LABEL_SCOPE,
    LABEL_SERVER_UID,
    LABEL_TTL,
    LABEL_USER,
    NEVER_PASSED_ENV,
    POLICY_ENV,
    SandboxSpec,
    egress_command,
    kernel_command,
    proxy_env,
    relay_command,
    sandbox_env,
)
from sandbox_kernel.plan.settings import SandboxSettings, kernelspec_keys
from sandbox_kernel.plan.users import KernelUser

#: The uid (and gid) a kernel runs as when neither the server user nor the workspace
#: owner is a usable (non-root) uid. Files the kernel writes belong to it on the host, so
#: it must be nobody's: not 1000 (the first human account on most hosts), not 65534
#: (``nobody``, which NFS and many daemons use), but 65533, in the range Debian policy
#: (9.2.2) reserves and never allocates (65000-65533). A host that gave it to an account
#: is refused at kernel start (see :func:`check_default_uid_unused`).
DEFAULT_KERNEL_UID = 65533


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
    if os.getuid() == 0:
        refuse_foreign_links(cwd)
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
    refusal = _mount_refusal(mount, runtime_parent)
    if refusal is not None:
        raise WorkspaceError(refusal)
    workdir = CONTAINER_WORKSPACE if rel == Path() else f"{CONTAINER_WORKSPACE}/{rel.as_posix()}"
    return mount, workdir


def _mount_refusal(mount: Path, runtime_parent: str | os.PathLike[str] | None) -> str | None:
    """Why ``mount`` (resolved) may not be a workspace, or None: a system or home folder,
    or one holding the kernels' runtime folders."""
    if (
        mount in _SYSTEM_DIRS
        or mount in _home_folders()
        or any(mount.is_relative_to(tree) for tree in _SYSTEM_TREES)
    ):
        return (
            f"Refusing to mount {str(mount)!r} (a system or home folder) as the kernel's workspace. "
            "Start the kernel from a project folder, or set SandboxProvisioner.workspace_root."
        )
    if runtime_parent is not None:
        private = Path(runtime_parent).resolve()
        if private.is_relative_to(mount):
            return (
                f"Refusing to mount {str(mount)!r} as the kernel's workspace: it contains "
                f"{str(private)!r}, where other kernels keep their private sockets and keys."
            )
    return None


def shared_root(
    cwd: str | os.PathLike[str],
    server_root: str | os.PathLike[str],
    runtime_parent: str | os.PathLike[str] | None = None,
    keep_out: Iterable[str | os.PathLike[str]] = (),
) -> Path | None:
    """Choose the folder to mount for a kernel started in ``cwd`` under a Jupyter server
    whose root folder is ``server_root``, so that ``../data`` beside ``notebooks/`` is
    there: the highest folder from the server's root down to ``cwd`` that may be
    mounted (not a system or home folder: `jupyter lab` started in ~ gives the folder in
    it that holds the notebook), or None for ``cwd`` alone.

    Only a tree of one owner: every folder from the one chosen down to ``cwd`` belongs
    to ``cwd``'s owner (and to the server's user, when that is not root), so a root
    server runs the kernel as the same user as for ``cwd`` alone, and never shows it a
    folder of someone else's above or around alice's. A server root reached through a
    link that :func:`refuse_foreign_links` refuses is not used, nor a folder holding
    Jupyter's own (its runtime folder's connection files and server tokens, its config)
    or anything in ``keep_out`` (the audit log).
    """
    if os.getuid() == 0:
        try:
            refuse_foreign_links(server_root)
        except WorkspaceError:
            return None
    start = Path(cwd).resolve()
    top = Path(server_root).expanduser().resolve()
    try:
        below = start.relative_to(top).parts
        owner = start.stat().st_uid
    except (ValueError, OSError):
        return None
    if os.getuid() not in (0, owner):
        return None
    chain = [top.joinpath(*below[:depth]) for depth in range(len(below) + 1)]
    jupyter_own = (jupyter_runtime_dir(), jupyter_data_dir(), jupyter_config_dir())
    kept_out = [Path(path).expanduser().resolve() for path in (*jupyter_own, *keep_out) if path]
    for index, folder in enumerate(chain[:-1]):
        try:
            owners = {path.stat().st_uid for path in chain[index:]}
        except OSError:
            return None
        if (
            owners == {owner}
            and _mount_refusal(folder, runtime_parent) is None
            and not any(private.is_relative_to(folder) for private in kept_out)
        ):
            return folder
    return None


def refuse_foreign_links(path: str | os.PathLike[str]) -> None:
    """Refuse a path that goes through a symbolic link owned by someone other than root
    or the owner of what it points to (as Linux's ``protected_symlinks`` does in sticky
    folders): a root server would otherwise mount, and run the kernel as the owner of,
    a folder that the link's owner chose and may not read (alice's link to bob's folder).

    Raises:
        WorkspaceError: naming the link, its owner and its target's.
    """
    current = Path("/")
    for part in Path(path).absolute().parts[1:]:
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        try:
            link = os.lstat(candidate)
        except OSError:
            return  # missing: the caller says so
        if not stat.S_ISLNK(link.st_mode):
            current = candidate
            continue
        try:
            target = candidate.resolve(strict=True)
            owner = target.stat().st_uid
        except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of links
            msg = (
                f"The kernel's folder {str(path)!r} goes through the link {str(candidate)!r}, "
                f"which leads nowhere: {exc}"
            )
            raise WorkspaceError(msg) from None
        if link.st_uid not in (0, owner):
            msg = (
                f"Refusing the kernel's folder {str(path)!r}: it goes through the link {str(candidate)!r}, "
                f"owned by uid {link.st_uid}, to {str(target)!r}, owned by uid {owner}. Only links of root "
                "or of the target's owner are followed; give the real folder instead."
            )
            raise WorkspaceError(msg)
        current = target


def check_user_folder(cwd: str | os.PathLike[str], user: KernelUser) -> Path:
    """The folder a gateway's ``user`` starts a kernel in, resolved, once sure it is theirs:
    it lies under their root, no link on the way is another user's (see
    :func:`refuse_foreign_links`), and every folder from their root down to it belongs to
    them. A kernel of theirs that could not start there does not start anywhere else
    either.

    This check reads paths, and gives the start its answer early, in the user's words. The
    user may swap one of their folders for a link right after it: what makes the mount
    safe is the same check made again on descriptors when the workspace is mounted, which
    mounts the very folder it checked (the plan's ``owned_from``, see
    :func:`~sandbox_kernel.host.mounts.pin_folder`).

    Raises:
        WorkspaceError: in one line, why the folder is not theirs.
    """
    if "\x00" in os.fspath(cwd):
        msg = f"The kernel's folder {os.fspath(cwd)!r} holds a NUL byte, which no folder's name can."
        raise WorkspaceError(msg)
    try:
        return _checked_user_folder(cwd, user)
    except OSError as exc:  # a name too long, a folder gone meanwhile
        msg = f"{os.fspath(cwd)!r} cannot be the kernel's folder: {exc.strerror or exc}."
        raise WorkspaceError(msg) from None


def _checked_user_folder(cwd: str | os.PathLike[str], user: KernelUser) -> Path:
    refuse_foreign_links(cwd)
    root = Path(user.root).resolve()
    start = Path(cwd).resolve()
    if not start.is_dir():
        msg = f"The kernel's folder {str(start)!r} does not exist or is not a folder."
        raise WorkspaceError(msg)
    if not start.is_relative_to(root):
        msg = (
            f"The kernel's folder {str(start)!r} is outside your sandbox workspace {str(root)!r}: "
            f"kernels of {user.name} run only in folders under it."
        )
        raise WorkspaceError(msg)
    below = start.relative_to(root).parts
    for folder in [root.joinpath(*below[:depth]) for depth in range(len(below) + 1)]:
        owner = folder.stat().st_uid
        if owner != user.uid:
            msg = (
                f"Refusing the kernel's folder {str(start)!r}: {str(folder)!r} belongs to uid {owner}, "
                f"not to {user.name} (uid {user.uid}); a sandbox workspace holds only its user's folders."
            )
            raise WorkspaceError(msg)
    return start


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


def can_write(path: Path, uid: int, gid: int) -> bool:
    """Whether ``uid:gid`` may create files in ``path`` by its mode bits."""
    st = path.stat()
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def unwritable_workspace(workspace: Path, uid: int, gid: int, configured_uid: int | None) -> str:
    """The one line that says what to run so that the kernel can write ``workspace``, and why.

    What to run comes first: JupyterLab shows the line in a box about 110 characters
    wide that cuts what is longer. A root server's root-owned folder (no kernel_uid set)
    is given to the account that works there: the owner of the nearest folder above it
    that is not root's, when there is one. Never to 65533: files stay their user's, and
    what Lab or a local kernel makes there later (root's) would be read-only to the kernel.
    """
    st = workspace.stat()
    if os.getuid() == 0 and st.st_uid == 0 and configured_uid is None:
        name, why = "USER", "USER: who works there"
        for above in workspace.parents:
            owner = above.stat().st_uid
            if owner != 0:
                try:
                    name = pwd.getpwuid(owner).pw_name
                except KeyError:
                    name = str(owner)
                why = f"{name} owns {above}"
                break
        return (
            f"Run `chown -R {name}: {workspace}` first ({why}): the folder is root's, and a "
            "sandboxed kernel never runs as root."
        )
    return (
        f"Run `chown -R {uid}:{gid} {workspace}` first, or start the kernel in a folder of yours: "
        f"the sandboxed kernel (uid {uid}) cannot write it "
        f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)})."
    )


def validate_kernelspec_config(config: Mapping[str, Any], kernelspec: str = "") -> None:
    """Reject keys a kernelspec may not set in ``metadata.kernel_provisioner.config``.

    jupyter_client silently drops unknown keys; a misspelt limit must not pass unnoticed.

    Raises:
        ConfigurationError: naming the offending key and the allowed ones.
    """
    where = f"kernelspec {kernelspec!r}" if kernelspec else "the kernelspec"
    allowed = kernelspec_keys()
    for key in config:
        if key not in allowed:
            msg = (
                f"{where} sets {key!r} in metadata.kernel_provisioner.config, which is not "
                f"a setting a kernelspec may choose. Allowed: {', '.join(sorted(allowed))}."
            )
            raise ConfigurationError(msg)


def _within_any(folder: str, roots: Sequence[str]) -> bool:
    """Whether ``folder`` is one of ``roots`` or lies within one (links resolved)."""
    resolved = Path(folder).expanduser().resolve()
    return any(resolved.is_relative_to(Path(root).expanduser().resolve()) for root in roots)


def ceiling_violations(
    settings: SandboxSettings, kernelspec_config: Mapping[str, Any], user: KernelUser | None = None
) -> list[str]:
    """Every setting beyond the administrator's ceiling, each in words that say how to fix it.
    With a ``user`` (``settings`` bound to their ceilings, see :func:`bind_to_user`), a
    ceiling of theirs that is narrower than the server's is named as theirs.

    Which setting each ``max_*`` bounds, and how, is declared on the setting itself
    (``ceiling=`` and ``bound=`` tags, see :mod:`~.settings`):

    - ``amount``, ``size``: at most the ceiling (sizes like ``512m`` compared in bytes);
    - ``timeout``: with a ceiling (above 0), a limit is required: above 0, at most it;
    - ``lifetime``: the same, for persistent kernels only;
    - ``names``: only names the ceiling lists, for what the kernelspec itself asks;
    - ``domains``: every domain covered by one of the ceiling's patterns;
    - ``credentials``: only names the ceiling lists (a kernelspec never defines one);
    - ``images``: a name one of the ceiling's wildcards matches, for what the kernelspec asks;
    - ``roots``: a folder within one the ceiling lists, for what the kernelspec asks.
    """
    found = []
    for name, trait in sorted(settings.traits(bound=lambda bound: bound is not None).items()):
        kind, ceiling_name = trait.metadata["bound"], trait.metadata["ceiling"]
        ceiling, setting = getattr(settings, ceiling_name), f"SandboxProvisioner.{ceiling_name}"
        whose = "the server's"
        if user is not None and ceiling_name in user.ceilings:
            whose, setting = f"{user.name}'s", f"{ceiling_name} of the gateway's ceilings for {user.name}"
        if kind in ("amount", "size", "timeout", "lifetime"):
            violation = _setting_beyond(settings, kind, name, ceiling, setting, whose)
        elif kind in ("names", "images", "roots", "credentials"):
            violation = _request_beyond(kernelspec_config, kind, name, ceiling, setting, whose)
        elif kind == "domains":
            violation = _domains_beyond(settings, setting, whose)
        else:  # a tag this function does not know: a programming error, never a pass
            msg = f"{name}: unknown ceiling bound {kind!r}"
            raise ValueError(msg)
        if violation is not None:
            found.append(violation)
    return found


def _setting_beyond(
    settings: SandboxSettings, kind: str, name: str, ceiling: Any, setting: str, whose: str = "the server's"
) -> str | None:
    """The setting ``name`` (an amount, a size or a limit in seconds) beyond its ceiling."""
    if kind == "lifetime" and settings.lifecycle != "persistent":
        return None
    asked = getattr(settings, name)
    if not exceeds(kind, name, asked, ceiling):
        return None
    if kind in ("amount", "size"):
        return (
            f"{name}={asked!r} exceeds {whose} ceiling of {ceiling!r} ({setting}). "
            f"Ask for at most {ceiling!r} in the kernelspec, or have the server's administrator "
            "raise the ceiling."
        )
    what = "no limit" if asked <= 0 else f"{asked:g} s"
    return (
        f"{name}={asked!r} ({what}) exceeds {whose} ceiling of {ceiling:g} s ({setting}). "
        "Ask for at most that in the kernelspec, or have the server's administrator raise the ceiling."
    )


def _request_beyond(
    kernelspec_config: Mapping[str, Any],
    kind: str,
    name: str,
    ceiling: Any,
    setting: str,
    whose: str = "the server's",
) -> str | None:
    """What the kernelspec itself asks of ``name`` (names, an image, a root, credentials)
    beyond its ceiling."""
    if kind == "names":
        beyond = sorted(set(kernelspec_config.get(name, [])) - set(ceiling))
        if beyond:
            return (
                f"{name} would pass the server's {', '.join(beyond)} into the sandbox, beyond "
                f"{whose} ceiling ({setting}={sorted(ceiling)!r}). Remove them from the kernelspec, "
                "set a value in its `env` instead, or have the administrator widen the ceiling."
            )
    elif kind == "images":
        image = kernelspec_config.get(name)
        if image is not None and not any(fnmatch.fnmatchcase(str(image), p) for p in ceiling):
            allows = "the server allows" if whose == "the server's" else f"{whose} ceiling allows"
            return (
                f"image={image!r} is not among the images {allows} kernelspecs to name "
                f"({setting}={list(ceiling)!r}). Use one of those, or have the administrator add it."
            )
    elif kind == "roots":
        root = kernelspec_config.get(name)
        if root is not None and not _within_any(str(root), ceiling):
            lets = "the server lets" if whose == "the server's" else f"{whose} ceiling lets"
            return (
                f"workspace_root={root!r} is not within the folders {lets} kernelspecs "
                f"mount ({setting}={list(ceiling)!r}). Remove it from the kernelspec (the notebook's "
                "folder is the workspace), or have the administrator allow that folder."
            )
    else:  # credentials
        named = kernelspec_config.get(name, [])
        if isinstance(named, Mapping):
            return (
                "The kernelspec defines credentials; it may only name the server's "
                '(credentials: ["warehouse"]), whose values only the server\'s config holds '
                "(SandboxProvisioner.credentials)."
            )
        beyond = sorted(set(named) - set(ceiling))
        if beyond:
            return (
                f"credentials names {beyond}, beyond {whose} ceiling "
                f"({setting}={sorted(ceiling)!r}). Remove them from the kernelspec, or have the "
                "administrator add them to the ceiling."
            )
    return None


def _domains_beyond(settings: SandboxSettings, setting: str, whose: str) -> str | None:
    """The allowed domains beyond their ceiling's patterns."""
    rules = settings.egress_rules()
    try:
        if rules is not None:
            settings.check_domains(rules, setting, whose)
    except ConfigurationError as exc:
        return str(exc)
    return None


def exceeds(kind: str, name: str, value: Any, bound: Any) -> bool:
    """Whether ``value`` of the setting ``name`` goes beyond ``bound``, as settings of its
    ``bound=`` kind compare: an amount or a size (in bytes) above it; a limit in seconds
    (``timeout``, ``lifetime``; 0 is none, the widest) that is none or above a bound that
    is a limit. A ceiling and what a kernelspec gives a start are such bounds."""
    if kind == "size":
        return size_bytes(name, value) > size_bytes(name, bound)
    if kind in ("timeout", "lifetime"):
        return bool(bound > 0 and not 0 < value <= bound)
    return bool(value > bound)


def check_ceilings(
    settings: SandboxSettings, kernelspec_config: Mapping[str, Any], user: KernelUser | None = None
) -> None:
    """Refuse any setting beyond the administrator's ceilings (see :func:`ceiling_violations`).

    Raises:
        ConfigurationError: naming the first such setting, its ceiling and who can raise it.
    """
    found = ceiling_violations(settings, kernelspec_config, user)
    if found:
        raise ConfigurationError(found[0])


def _pattern_within(pattern: str, patterns: Sequence[str]) -> bool:
    """Whether every image name ``pattern`` matches, one of ``patterns`` matches too: it is
    one of them, a name one matches, or a prefix wildcard within one's (``team/py*`` within
    ``team/*``). Anything else is not known to be within, so it counts as not."""
    if pattern in patterns:
        return True
    magic = re.compile(r"[*?\[]")
    if not magic.search(pattern):
        return any(fnmatch.fnmatchcase(pattern, p) for p in patterns)
    head = pattern[:-1]
    return (
        pattern.endswith("*")
        and not magic.search(head)
        and any(p.endswith("*") and not magic.search(p[:-1]) and head.startswith(p[:-1]) for p in patterns)
    )


def narrower_ceiling(kind: str, name: str, server: Any, user: Any) -> Any:
    """Of the server's ceiling ``name`` and a user's, what lies within both, as settings of
    its ``bound=`` kind compare (see :func:`ceiling_violations`): the lower amount, size or
    limit; the names, images, folders or domains both allow. A user's ceiling never widens
    the server's: where it is wider, the server's is the answer.

    Raises:
        ConfigurationError: the user's ceiling is not a value of its kind.
    """
    if kind in ("amount", "size", "timeout", "lifetime"):
        return server if exceeds(kind, name, user, server) else user
    if not isinstance(user, list | tuple) or not all(isinstance(item, str) for item in user):
        msg = f"{name}={user!r} is not a list of {kind}"
        raise ConfigurationError(msg)
    if kind in ("names", "credentials"):
        return [item for item in server if item in user]
    if kind == "images":
        both = [p for p in server if _pattern_within(p, user)]
        return both + [p for p in user if p not in both and _pattern_within(p, server)]
    if kind == "roots":
        both = [root for root in server if _within_any(root, user)]
        return both + [root for root in user if root not in both and _within_any(root, server)]
    # domains
    server_rules, user_rules = EgressRules.parse(server, name), EgressRules.parse(user, name)
    both = [p for p in server_rules.patterns if p not in server_rules.uncovered_by(user_rules)]
    return both + [
        p for p in user_rules.patterns if p not in both and p not in user_rules.uncovered_by(server_rules)
    ]


def bind_to_user(policy: SandboxSettings, kernelspec_config: Mapping[str, Any], user: KernelUser) -> None:
    """Bind one start's ``policy`` (already checked against the server's ceilings) to the
    ceilings of the user a gateway starts it for: each ceiling of theirs that is narrower
    takes the server's place; a limit the kernelspec does not set (the server's default)
    beyond it becomes it, and so do allowed domains beyond theirs (no network at all when
    none is left); then everything is checked against the ceilings as they now are.

    Raises:
        ConfigurationError: a ceiling of the user's is not valid, or what the kernelspec
            asks is beyond it, naming the setting and the user's ceiling.
    """
    bounds = {
        trait.metadata["ceiling"]: (name, trait.metadata["bound"])
        for name, trait in policy.traits(bound=lambda bound: bound is not None).items()
    }
    theirs = {}  # the user's ceilings that are narrower than the server's
    for ceiling_name, value in sorted(user.ceilings.items()):
        name, kind = bounds[ceiling_name]
        server = getattr(policy, ceiling_name)
        try:
            setattr(policy, ceiling_name, value)  # read as the server's config is
            ceiling = narrower_ceiling(kind, ceiling_name, server, getattr(policy, ceiling_name))
        except (TraitError, ConfigurationError) as exc:
            msg = f"The gateway's ceiling {ceiling_name}={value!r} for {user.name} is not valid: {exc}"
            raise ConfigurationError(msg) from None
        setattr(policy, ceiling_name, ceiling)
        if ceiling == server:
            continue
        theirs[ceiling_name] = ceiling
        if name in kernelspec_config:
            continue  # asked for: checked below
        if kind in ("amount", "size", "timeout", "lifetime"):
            if _setting_beyond(policy, kind, name, ceiling, ceiling_name) is not None:
                setattr(policy, name, ceiling)
        elif kind == "domains" and "network" not in kernelspec_config:
            rules = EgressRules.parse(ceiling, ceiling_name)
            kept = [p for p in policy.allowed_domains if not EgressRules.parse([p]).uncovered_by(rules)]
            policy.allowed_domains = kept
            if not kept:
                policy.network = "none"
    check_ceilings(policy, kernelspec_config, replace(user, ceilings=theirs))


@dataclass(frozen=True)
class Launch:
    """One kernel start, as jupyter_client hands it to the provisioner."""

    kernel_id: str
    kernel_name: str
    argv: Sequence[str]
    cwd: Path
    #: The launch environment: the server's, with jupyter_client's session variables.
    env: Mapping[str, str]
    extra_arguments: Sequence[str] = ()
    #: The process that owns the kernel (see :func:`~.ownership.server_identity`).
    owner: str = ""
    #: Which server may adopt it again (see sandbox_kernel.jupyter.server).
    scope: str = ""
    #: The Jupyter server's root folder (its ``root_dir``), when a server starts the kernel.
    server_root: Path | None = None
    #: The user a sandbox gateway starts the kernel for (``start_kernel(sandbox_user=...)``):
    #: it runs as them, in a folder under their root, within their ceilings too.
    user: KernelUser | None = None


@dataclass(frozen=True)
class Plan:
    """What the kernel's sandbox will be, and what its host side needs to know."""

    spec: SandboxSpec
    egress: EgressPolicy | None
    #: The credentials the egress proxy adds to the kernel's requests (values not read yet).
    credentials: tuple[CredentialSpec, ...] = ()
    #: For the server's log: things that work, but not as the user may expect.
    warnings: tuple[str, ...] = ()


def kernelspec_config(kernel_spec: Any, kernel_name: str = "") -> dict[str, Any]:
    """The settings a kernelspec chooses (``metadata.kernel_provisioner.config``).

    Raises:
        ConfigurationError: that is not an object of settings.
    """
    metadata = getattr(kernel_spec, "metadata", {}) or {}
    provisioner = metadata.get("kernel_provisioner", {}) if isinstance(metadata, Mapping) else None
    config = provisioner.get("config", {}) if isinstance(provisioner, Mapping) else None
    if not isinstance(config, Mapping):
        name = kernel_name or getattr(kernel_spec, "name", "") or getattr(kernel_spec, "display_name", "")
        msg = (
            f"Kernelspec {name!r}: metadata.kernel_provisioner.config must be an object of settings "
            f'(like {{"memory": "1g"}}), not {config!r}.'
        )
        raise ConfigurationError(msg)
    return dict(config)


def check_settings(settings: SandboxSettings, config: Mapping[str, Any], kernel_name: str) -> None:
    """Everything about a kernel's settings that can be refused before anything else:
    unknown kernelspec keys, settings beyond their ceilings, an inconsistent network.

    Raises:
        ConfigurationError: saying which setting and how to fix it.
    """
    validate_kernelspec_config(config, kernel_name)
    check_ceilings(settings, config)  # the allowed_domains bound checks the network too


#: What one start may narrow (``start_kernel(memory="512m")``, the session API): the
#: kernelspec's limits and network, never wider than the kernelspec has them.
NARROWABLE = (
    "network",
    "allowed_domains",
    "memory",
    "cpus",
    "pids",
    "tmp_size",
    "file_size",
    "exec_timeout",
    "idle_timeout",
)
#: What else a start takes: jupyter_client's own arguments (``kernel_id`` and
#: ``transport_encryption`` are taken before).
START_ARGUMENTS = ("cwd", "env", "sandbox_env", "extra_arguments", "kernel_id")


def start_policy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the policy a start asks for out of jupyter_client's start arguments.

    Raises:
        ConfigurationError: an argument a sandboxed kernel does not take (jupyter_client
            would hand it to ``Popen``; dropping it silently would hide a mistake).
    """
    unknown = sorted(set(kwargs) - set(START_ARGUMENTS) - set(NARROWABLE))
    if unknown:
        msg = (
            f"start_kernel() got {', '.join(unknown)}, which a sandboxed kernel does not take. It takes "
            f"{', '.join(START_ARGUMENTS[:4])} and, to narrow the kernelspec's policy for this kernel, "
            f"{', '.join(NARROWABLE)}."
        )
        raise ConfigurationError(msg)
    return {key: kwargs.pop(key) for key in NARROWABLE if key in kwargs}


def narrow_settings(settings: SandboxSettings, requested: Mapping[str, Any], kernel_name: str = "") -> None:
    """Narrow ``settings`` (already checked against the ceilings) to what one start asks
    for: less memory, CPU or processes, shorter limits, network ``none`` or fewer domains.
    Nothing is changed unless all of it is narrower.

    Raises:
        ConfigurationError: a value is invalid or would widen the policy, naming the key.
    """
    where = f"kernelspec {kernel_name!r}" if kernel_name else "the kernelspec"
    before = {key: getattr(settings, key) for key in NARROWABLE}
    asked = dict(requested)
    if asked.get("network") == "none" and "allowed_domains" not in asked:
        asked["allowed_domains"] = []  # no network: no domains either
    try:
        for key in sorted(asked, key=NARROWABLE.index):
            value = asked[key]
            try:
                setattr(settings, key, value)
            except TraitError as exc:
                msg = f"start_kernel({key}={value!r}) is not a valid {key}: {exc}"
                raise ConfigurationError(msg) from None
            if _widens(settings, key, before[key], getattr(settings, key)):
                msg = (
                    f"start_kernel({key}={value!r}) would widen this kernel's policy: {where} gives "
                    f"{key}={before[key]!r}, and a start may only narrow it. Ask for at most that, or use "
                    "a kernelspec that allows more."
                )
                raise ConfigurationError(msg)
    except BaseException:
        for key, value in before.items():
            setattr(settings, key, value)
        raise
    # What the start took out stays out, even where approval could have asked about it.
    settings.withheld_domains = list(
        EgressRules.parse(before["allowed_domains"], "allowed_domains").uncovered_by(
            EgressRules.parse(settings.allowed_domains, "allowed_domains")
        )
    )


def _widens(settings: SandboxSettings, key: str, before: Any, after: Any) -> bool:
    if key == "network":
        return bool(before == "none" and after != "none")
    if key == "allowed_domains":
        if not after:
            return False
        if settings.network == "none":
            return True
        return bool(EgressRules.parse(after, key).uncovered_by(EgressRules.parse(before, key)))
    return exceeds(settings.traits()[key].metadata["bound"], key, after, before)


def check_sandbox_env(sandbox_env: Any) -> dict[str, str]:
    """``start_kernel(sandbox_env={...})``: variables one start sets in the sandbox, as a
    kernelspec's ``env`` does.

    Raises:
        ConfigurationError: not a mapping of names to strings.
    """
    if sandbox_env is None:
        return {}
    if not isinstance(sandbox_env, Mapping) or not all(
        isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in sandbox_env.items()
    ):
        msg = f"start_kernel(sandbox_env={sandbox_env!r}) must map variable names to strings"
        raise ConfigurationError(msg)
    return {k: v for k, v in sandbox_env.items() if k not in NEVER_PASSED_ENV}


def unpassed_env(settings: SandboxSettings, launch_env: Mapping[str, str]) -> list[str]:
    """Variables a start set in its launch environment (``start_kernel(env=...)``, values
    the server's own environment does not have) that do not reach the sandbox: only
    ``pass_env`` names do, so that no secret comes along with an environment, and
    Jupyter's own launch variables are the host's business."""
    return sorted(
        name
        for name, value in launch_env.items()
        if os.environ.get(name) != value
        and name not in settings.pass_env
        and not name.startswith(("JPY_", "JUPYTER", "PYDEVD_"))
    )


def visible_env(settings: SandboxSettings, launch_env: Mapping[str, str]) -> dict[str, str]:
    """The part of the launch environment a kernel may see (``pass_env``), which is also
    all that jupyter_client may fill the kernelspec's ``env`` templates (``${VAR}``)
    from: "${JUPYTERHUB_API_TOKEN}" stays as written."""
    return {name: launch_env[name] for name in settings.pass_env if name in launch_env}


@dataclass(frozen=True)
class Placement:
    """Where a kernel's workspace is, how it appears inside the sandbox, and whose it is."""

    #: The host folder mounted as the workspace (with a volume: the notebook's folder).
    workspace: Path
    #: The kernel's working folder inside the sandbox.
    workdir: str
    #: Where the workspace appears inside the sandbox.
    workspace_path: str
    uid: int
    gid: int
    #: The Docker volume that is the workspace, if the settings name one.
    volume: str | None
    #: For a gateway's user (without a volume): their root, resolved. The workspace is then
    #: pinned when it is mounted: every folder from here down to it checked again to be
    #: theirs, on the descriptors the mount is made from.
    owned_from: Path | None = None


def place_workspace(settings: SandboxSettings, launch: Launch) -> Placement:
    """The kernel's workspace, working folder and uid (see :func:`plan_sandbox`).

    Raises:
        ConfigurationError, WorkspaceError: the start cannot go ahead as asked.
    """
    cwd, env, user = launch.cwd, launch.env, launch.user
    if user is not None:
        cwd = check_user_folder(cwd, user)
    volume = None
    if settings.workspace_volume:
        if user is not None and "{user}" not in settings.workspace_volume:
            msg = (
                f"workspace_volume={settings.workspace_volume!r} names no {{user}}: on a sandbox gateway "
                "each user's volumes are their own, and this template would give users one volume to "
                "share. Put {user} in it, e.g. '{user}-{project}'."
            )
            raise ConfigurationError(msg)
        volume = volume_name(
            settings.workspace_volume,
            # A gateway's client names a user of its own choosing: the gateway's user is known.
            user=user.name if user is not None else env.get("JUPYTERHUB_USER") or getpass.getuser(),
            kernelspec=launch.kernel_name,
            notebook=env.get("JPY_SESSION_NAME", "").removesuffix(".ipynb"),
            project=cwd.name,
        )
        workspace, workdir = cwd, CONTAINER_WORKSPACE
        uid, gid = volume_user(settings.kernel_uid) if user is None else (user.uid, user.gid)
    else:
        root: str | Path | None = settings.workspace_root
        top = launch.server_root
        if user is not None:  # the user's own root stands for the server's, whatever is configured
            root, top = None, user.root
        if root is None and settings.workspace_scope == "server_root" and top is not None:
            root = shared_root(cwd, top, settings.runtime_parent, [settings.audit_log])
        workspace, workdir = resolve_workspace(cwd, root, settings.runtime_parent)
        if settings.audit_log:
            ensure_outside_workspace(settings.audit_log, workspace, "SandboxProvisioner.audit_log")
        uid, gid = kernel_user(workspace, settings.kernel_uid) if user is None else (user.uid, user.gid)
    if os.getuid() not in (0, uid):
        msg = (
            f"kernel_uid={uid} differs from the server's uid {os.getuid()}; only a server "
            "running as root can run kernels as another user. Unset kernel_uid."
        )
        if user is not None:
            msg = (
                f"The kernel of {user.name} would run as their uid {uid}, but this server runs as "
                f"uid {os.getuid()}; only a server running as root starts kernels for other users."
            )
        raise ConfigurationError(msg)
    if volume is None and not can_write(workspace, uid, gid):
        raise WorkspaceError(unwritable_workspace(workspace, uid, gid, settings.kernel_uid))
    workspace_path = CONTAINER_WORKSPACE
    if settings.pool_size > 0:
        # Pooled or not, every kernel of a pooled kernelspec sees the same layout.
        workspace_path = pooled_workspace_path(workspace, volume)
        workdir = workspace_path + workdir.removeprefix(CONTAINER_WORKSPACE)
    owned_from = Path(user.root).resolve() if user is not None and volume is None else None
    return Placement(workspace, workdir, workspace_path, uid, gid, volume, owned_from)


def kernel_policy(
    settings: SandboxSettings, egress: EgressPolicy | None, credentials: Sequence[CredentialSpec]
) -> dict[str, Any]:
    """The policy the kernel reads inside the sandbox (``POLICY_ENV``): its limits, network
    and image, its allowed domains, and which domains get a credential (never its value:
    code may know why a request works)."""
    policy: dict[str, Any] = {
        **settings.limits.as_dict(),
        "network": settings.network,
        "image": settings.image,
    }
    policy["allowed_domains"] = list(egress.rules.patterns) if egress is not None else []
    policy["credentials"] = {spec.name: list(spec.rules.patterns) for spec in credentials}
    return policy


def plan_sandbox(
    settings: SandboxSettings, launch: Launch, kernel_env: Mapping[str, str], kernelspec_env: Iterable[str]
) -> Plan:
    """The kernel's sandbox: where its workspace is and how it appears inside, its uid,
    command, environment, limits and labels.

    ``kernel_env``: :func:`visible_env` with the kernelspec's ``env`` applied (by
    jupyter_client); ``kernelspec_env``: the names the kernelspec's ``env`` sets.

    Raises:
        ConfigurationError, WorkspaceError: the start cannot go ahead as asked.
    """
    egress = settings.egress_policy()
    credentials = settings.credential_specs(egress)
    place = place_workspace(settings, launch)
    command = relay_command(kernel_command(launch.argv, launch.extra_arguments, subshells=settings.subshells))
    policy = kernel_policy(settings, egress, credentials)
    if egress is not None:
        command = egress_command(command)
    spec = SandboxSpec(
        kernel_id=launch.kernel_id,
        kernelspec=launch.kernel_name,
        image=settings.image,
        runtime=settings.docker_runtime,
        command=command,
        env={
            **sandbox_env(kernel_env, settings.pass_env, kernelspec_env),
            POLICY_ENV: json.dumps(policy),
            "PYTHONSTARTUP": CONTAINER_STARTUP_FILE,
            **(proxy_env() if egress is not None else {}),
        },
        workspace=place.workspace,
        workdir=place.workdir,
        runtime_dir=Path(),
        uid=place.uid,
        gid=place.gid,
        memory=settings.memory,
        cpus=settings.cpus,
        pids=settings.pids,
        tmp_size=settings.tmp_size,
        file_size=settings.file_size,
        volume=place.volume,
        workspace_path=place.workspace_path,
        owned_from=place.owned_from,
        extra_labels={
            LABEL_OWNER: launch.owner,
            LABEL_LIFECYCLE: settings.lifecycle,
            LABEL_TTL: f"{settings.persistent_ttl:g}",
            LABEL_SERVER_UID: str(os.getuid()),
            LABEL_SCOPE: launch.scope,
            **({LABEL_USER: launch.user.name} if launch.user is not None else {}),
        },
    )
    return Plan(spec, egress, credentials)
