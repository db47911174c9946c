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
