"""The user a kernel is started for, when a sandbox gateway starts it.

A gateway (:mod:`sandbox_kernel.gateway`) serves kernels to the Jupyter servers of other
users. It authenticates each request (a JupyterHub token or a tokens file; never a field the
client sends) and hands the provisioner a :class:`KernelUser` as the start argument
``sandbox_user``. jupyter_client keeps start arguments for restarts, so a restart starts the
kernel for the same user. Without ``sandbox_user`` (every start that is not a gateway's),
nothing here applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.plan.settings import ceiling_names

#: The start argument that carries the user (``start_kernel(sandbox_user=KernelUser(...))``).
START_ARGUMENT = "sandbox_user"


@dataclass(frozen=True)
class KernelUser:
    """An authenticated user, as the gateway's administrator configured them."""

    #: The user's name (JupyterHub's, or the tokens file's).
    name: str
    #: The kernel runs as this uid and gid: files in the workspace are the user's.
    uid: int
    gid: int
    #: Kernels of this user run only in folders under this one (their home, say).
    root: Path
    groups: tuple[str, ...] = ()
    #: Ceilings of this user's (``max_memory``, ``max_network`` ...: the provisioner's
    #: ``max_*`` names): they only narrow the gateway's own.
    ceilings: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        # jupyter_client puts start arguments into the argv template namespace: a user
        # prints as their name only.
        return self.name

    def to_dict(self) -> dict[str, Any]:
        """The user as a kernel's reattach state keeps them (JSON), so that an adopted
        kernel restarts for the same user."""
        return {
            "name": self.name,
            "uid": self.uid,
            "gid": self.gid,
            "root": str(self.root),
            "groups": list(self.groups),
            "ceilings": dict(self.ceilings),
        }

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> KernelUser:
        """The user :meth:`to_dict` wrote.

        Raises:
            ConfigurationError: ``saved`` is not such a user.
        """
        try:
            return check_user(
                cls(
                    name=str(saved["name"]),
                    uid=int(saved["uid"]),
                    gid=int(saved["gid"]),
                    root=Path(saved["root"]),
                    groups=tuple(str(group) for group in saved.get("groups") or ()),
                    ceilings=dict(saved.get("ceilings") or {}),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            msg = f"The kernel's saved user {saved!r} is not a user of the sandbox gateway ({exc!r})."
            raise ConfigurationError(msg) from None


def check_user(user: Any) -> KernelUser:
    """``start_kernel(sandbox_user=...)``, checked: a :class:`KernelUser` with a name, a uid
    and gid that are not root's, an absolute root folder, and ceilings that are the
    provisioner's (``max_memory``, ``allowed_images``...: see :func:`~.settings.ceiling_names`).

    Raises:
        ConfigurationError: saying what is wrong.
    """
    if not isinstance(user, KernelUser):
        msg = (
            f"start_kernel({START_ARGUMENT}={user!r}): the user a kernel is started for must be a "
            "sandbox_kernel.plan.users.KernelUser (the sandbox gateway makes one per authenticated "
            "user), or absent."
        )
        raise ConfigurationError(msg)
    problem = None
    if not user.name:
        problem = "it has no name"
    elif not (isinstance(user.uid, int) and isinstance(user.gid, int)) or user.uid <= 0 or user.gid <= 0:
        problem = f"uid {user.uid!r} and gid {user.gid!r} must be above 0: a kernel never runs as root"
    elif not Path(user.root).is_absolute():
        problem = f"its root {str(user.root)!r} is not an absolute path"
    elif not isinstance(user.ceilings, Mapping):
        problem = f"its ceilings {user.ceilings!r} are not a mapping of ceiling names to values"
    else:
        unknown = sorted(set(user.ceilings) - ceiling_names())
        if unknown:
            problem = (
                f"its ceilings name {', '.join(map(repr, unknown))}, which are not ceilings "
                f"(they are {', '.join(sorted(ceiling_names()))})"
            )
    if problem is not None:
        msg = f"start_kernel({START_ARGUMENT}=...) for user {user.name!r}: {problem}."
        raise ConfigurationError(msg)
    return user
