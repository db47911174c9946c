"""Who a gateway's authenticated users are on the sandbox host, and where their kernels may run.

An identity provider (:mod:`~.identity`) says only a name (and the groups the tokens file
or the hub gives). :class:`UserPolicy`, set in the gateway's config, turns it into a
:class:`GatewayUser`: the uid and gid the kernels run as, the folder they run under, the
ceilings they get, how many kernels they may have. It refuses privileged accounts (root,
system uids, members of ``sudo``/``docker``/``wheel``): a kernel started for them would
run with rights no sandbox should hold. :func:`check_cwd` turns the folder a client asks
for (``KERNEL_WORKING_DIR``, the user's server's path) into one the user owns under their
root, or refuses it with a one-line reason::

    c.UserPolicy.workspace_root = "/home/{username}"
    c.UserPolicy.ceilings = {"*": {"max_memory": "4g"}, "group:interns": {"max_memory": "1g"}}
    c.UserPolicy.max_kernels_per_user = 4
"""

from __future__ import annotations

import grp
import os
import pwd
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_server.auth.identity import User
from traitlets import CaselessStrEnum, Dict, Int, List, TraitError, Unicode, validate
from traitlets.config import LoggingConfigurable

from sandbox_kernel.errors import WorkspaceError
from sandbox_kernel.plan.limits import duration_seconds
from sandbox_kernel.plan.plan import can_write, exceeds, refuse_foreign_links
from sandbox_kernel.plan.settings import SandboxSettings
from sandbox_kernel.plan.users import KernelUser

#: A user name that can be put into a path template safely (JupyterHub's names, e-mails).
USERNAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,63}")

#: Each ceiling (``max_memory`` ...) and how its values compare (the settings' ``bound=``).
CEILING_KINDS: dict[str, str] = {
    str(trait.metadata["ceiling"]): str(trait.metadata["bound"])
    for trait in SandboxSettings.class_traits().values()
    if "ceiling" in trait.metadata
}
#: Kinds whose narrowest value is one of the values; the others are lists, intersected.
_SCALAR_KINDS = ("size", "amount", "timeout", "lifetime")
_LIST_KINDS = ("domains", "names", "images")


class UserRefused(PermissionError):
    """An authenticated user this gateway does not start kernels for (a privileged or
    unknown account, or one at their kernel limit); the message says why."""


@dataclass(eq=False)
class GatewayUser(User):
    """An authenticated user of the gateway: jupyter_server's ``User`` and what the
    sandbox needs of them (:class:`~sandbox_kernel.plan.users.KernelUser`)."""

    kernel_user: KernelUser | None = None

    @property
    def sandbox_user(self) -> KernelUser:
        """The user the provisioner starts kernels for."""
        if self.kernel_user is None:  # built by UserPolicy.resolve, which always sets it
            msg = f"user {self.username!r} has no sandbox identity"
            raise UserRefused(msg)
        return self.kernel_user


def narrowest(entries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The ceilings that hold under all of ``entries`` at once: per key, the narrowest
    value any entry gives (a size or amount the least, a time limit the shortest, a list
    what all lists have in common). Entries can only narrow one another."""
    merged: dict[str, Any] = {}
    for entry in entries:
        for key, value in entry.items():
            kind = CEILING_KINDS[key]
            if key not in merged:
                merged[key] = list(value) if kind in _LIST_KINDS else value
            elif kind in _LIST_KINDS:
                merged[key] = [item for item in merged[key] if item in value]
            else:
                bound = merged[key]
                a, b = (
                    (duration_seconds(key, value), duration_seconds(key, bound))
                    if kind in ("timeout", "lifetime")
                    else (value, bound)
                )
                if not exceeds(kind, key, a, b):
                    merged[key] = value
    return merged


class UserPolicy(LoggingConfigurable):
    """Which authenticated users get kernels, as which uid, under which folder, with which
    ceilings."""

    uid_source = CaselessStrEnum(
        ["passwd", "map"],
        default_value="passwd",
        config=True,
        help="""Where a user's uid comes from: "passwd" (the host's account of the same name,
        as JupyterHub's LocalProcessSpawner has it) or "map" (UserPolicy.uids; a uid the
        tokens file gives counts as an entry of it).""",
    )
    uids = Dict(
        value_trait=Int(),
        config=True,
        help="""For uid_source "map": user name -> uid. The gid is the uid's passwd group if
        there is one, else the uid.""",
    )
    uid_min = Int(
        1000,
        config=True,
        help="The lowest uid that gets kernels (below it: system accounts). uid 0 never does.",
    )
    uid_max = Int(
        60000,
        config=True,
        help="The highest uid that gets kernels (above it: nobody and other special accounts).",
    )
    refused_groups = List(
        Unicode(),
        default_value=["root", "sudo", "wheel", "admin", "docker"],
        config=True,
        help="""Members of these host groups (primary or supplementary) get no kernels: they
        are root or root-equivalent (the docker group can run any container).""",
    )
    workspace_root = Unicode(
        "/home/{username}",
        config=True,
        help="""The folder a user's kernels run under ({username} is replaced): a kernel
        starts only in this folder or one below it that the user owns.""",
    )
    ceilings = Dict(
        config=True,
        help="""Per-user and per-group ceilings: {"*": {...}, "group:NAME": {...}, "USER": {...}}
        with SandboxProvisioner max_* names (max_memory, max_cpus, max_exec_timeout,
        max_allowed_domains ...). Every entry that matches a user applies, and the narrowest
        value of each wins: an entry can only narrow (a user's cannot widen their group's),
        and none widens the gateway's own SandboxProvisioner.max_*.""",
    )
    max_kernels_per_user = Int(
        4, config=True, help="How many kernels one user may have at once (0: no limit)."
    )

    @validate("workspace_root")
    def _validate_workspace_root(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"])
        if not value.startswith("/") or "{username}" not in value:
            msg = (
                f"UserPolicy.workspace_root={value!r} must be an absolute path with {{username}} "
                "in it, e.g. '/home/{username}'"
            )
            raise TraitError(msg)
        return value

    @validate("ceilings")
    def _validate_ceilings(self, proposal: dict[str, Any]) -> dict[str, Any]:
        value = proposal["value"]
        for who, entry in value.items():
            if not isinstance(entry, Mapping):
                msg = f"UserPolicy.ceilings[{who!r}] must be a dict of max_* ceilings, not {entry!r}"
                raise TraitError(msg)
            for key in entry:
                kind = CEILING_KINDS.get(key)
                if kind not in (*_SCALAR_KINDS, *_LIST_KINDS):
                    known = ", ".join(
                        k for k, v in CEILING_KINDS.items() if v in (*_SCALAR_KINDS, *_LIST_KINDS)
                    )
                    msg = f"UserPolicy.ceilings[{who!r}] has {key!r}, which no user may get: use {known}"
                    raise TraitError(msg)
        return dict(value)

    def resolve(self, name: str, groups: Iterable[str] = (), uid: int | None = None) -> GatewayUser:
        """The user ``name`` (in ``groups``, as the identity source says; ``uid`` if it
        gives one) as the gateway starts kernels for them.

        Raises:
            UserRefused: the name is not a usable one, the account is unknown, or it is
                privileged; the message says which.
        """
        if not USERNAME_RE.fullmatch(name):
            msg = f"user name {name!r} cannot name a workspace (letters, digits, '_', '.', '@', '+', '-')"
            raise UserRefused(msg)
        uid, gid = self._ids(name, uid)
        if uid == 0 or gid == 0 or not self.uid_min <= uid <= self.uid_max:
            msg = (
                f"user {name!r} is uid {uid} (gid {gid}): root and system accounts (outside "
                f"UserPolicy.uid_min..uid_max, {self.uid_min}..{self.uid_max}) get no sandboxed kernels"
            )
            raise UserRefused(msg)
        privileged = self._privileged_groups(name, gid)
        if privileged:
            msg = (
                f"user {name!r} is in the host group(s) {', '.join(privileged)}, which are root or "
                "root-equivalent (UserPolicy.refused_groups): no sandboxed kernels for them"
            )
            raise UserRefused(msg)
        groups = tuple(groups)
        matching = [self.ceilings.get("*", {}), *(self.ceilings.get(f"group:{g}", {}) for g in groups)]
        matching.append(self.ceilings.get(name, {}))
        kernel_user = KernelUser(
            name=name,
            uid=uid,
            gid=gid,
            root=Path(self.workspace_root.format(username=name)),
            groups=groups,
            ceilings=narrowest(matching),
        )
        return GatewayUser(username=name, name=name, kernel_user=kernel_user)

    def _ids(self, name: str, given: int | None) -> tuple[int, int]:
        if self.uid_source == "map":
            uid = given if given is not None else self.uids.get(name)
            if uid is None:
                msg = f"user {name!r} has no uid in UserPolicy.uids (or the tokens file)"
                raise UserRefused(msg)
            try:
                return uid, pwd.getpwuid(uid).pw_gid
            except KeyError:
                return uid, uid
        try:
            account = pwd.getpwnam(name)
        except KeyError:
            msg = f"user {name!r} has no account on the sandbox host (UserPolicy.uid_source='passwd')"
            raise UserRefused(msg) from None
        if given is not None and given != account.pw_uid:
            msg = (
                f"user {name!r} is uid {account.pw_uid} on this host, not uid {given} as the tokens file says"
            )
            raise UserRefused(msg)
        return account.pw_uid, account.pw_gid

    def _privileged_groups(self, name: str, gid: int) -> list[str]:
        found = []
        for group in self.refused_groups:
            try:
                entry = grp.getgrnam(group)
            except KeyError:
                continue
            if entry.gr_gid == gid or name in entry.gr_mem:
                found.append(group)
        return found


def check_cwd(user: KernelUser, requested: str | None) -> Path:
    """The folder a kernel of ``user`` starts in, for the client's ``requested`` one
    (``KERNEL_WORKING_DIR``; none: the user's root). It must be a folder under the user's
    root, reached through no link of someone else's, and it and every folder from the
    root down to it must be the user's, writable by them.

    Raises:
        WorkspaceError: why not, in one line (the gateway answers 403 with it).
    """
    wanted = requested or str(user.root)
    if "\x00" in wanted:
        msg = f"the kernel's folder {wanted!r} holds a NUL byte, which no folder's name can"
        raise WorkspaceError(msg)
    if not os.path.isabs(wanted):
        msg = f"the kernel's folder {wanted!r} is not an absolute path"
        raise WorkspaceError(msg)
    try:
        return _checked_cwd(user, wanted)
    except OSError as exc:  # a name too long, a folder gone meanwhile: no such folder for a kernel
        msg = f"{wanted!r} cannot be the kernel's folder: {exc.strerror or exc}"
        raise WorkspaceError(msg) from None


def _checked_cwd(user: KernelUser, wanted: str) -> Path:
    root = user.root
    refuse_foreign_links(wanted)
    resolved_root = root.resolve()
    folder = Path(wanted).resolve()
    if not folder.is_relative_to(resolved_root):
        msg = f"{wanted} is outside your sandbox workspace {root}"
        raise WorkspaceError(msg)
    if not folder.is_dir():
        msg = f"{wanted} does not exist or is not a folder"
        raise WorkspaceError(msg)
    below = folder.relative_to(resolved_root).parts
    for depth in range(len(below) + 1):
        step = resolved_root.joinpath(*below[:depth])
        owner = step.stat().st_uid
        if owner != user.uid:
            msg = f"{step} is owned by uid {owner}, not by you (uid {user.uid}): no kernel starts under it"
            raise WorkspaceError(msg)
    if not can_write(folder, user.uid, user.gid):
        msg = f"{folder} is not writable by you (uid {user.uid}): no kernel starts there"
        raise WorkspaceError(msg)
    return folder
