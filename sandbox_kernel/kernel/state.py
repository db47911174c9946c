"""What a later process needs to reach the same sandboxed kernel again.

jupyter_client asks a provisioner for its ``provisioner_info`` (a dict it keeps beside
the connection info) and hands it to a new provisioner to reattach; the provisioner also
saves it in the kernel's server-only runtime folder, so that a server killed with
SIGKILL leaves it behind for the next one (see :mod:`~.reattach`). :class:`ReattachState`
is that dict, read and written in one place; its keys are flat, as earlier versions wrote
them, and a state of another ``version`` is read the same way where it can be.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_kernel.kernel.site import LAYOUT_KEYS
from sandbox_kernel.lifecycle.ownership import write_state
from sandbox_kernel.lifecycle.pausing import Paused
from sandbox_kernel.plan.users import KernelUser

#: The layout of the state written now.
VERSION = 1


@dataclass(frozen=True)
class ReattachState:
    """One kernel's reattach state (see the module's docstring)."""

    container_id: str | None
    runtime_dir: Path | None
    launch_dir: Path | None
    connection_info: dict[str, Any]
    cwd: str | None = None
    #: Of the launch environment, what a relaunch after reattaching needs again.
    launch_env: dict[str, str] = field(default_factory=dict)
    image: str = ""
    #: What the kernel's start narrowed of the kernelspec's policy (see plan.narrow_settings).
    narrowed: dict[str, Any] = field(default_factory=dict)
    sandbox_env: dict[str, str] = field(default_factory=dict)
    #: Names and times only: a credential's value is never written down.
    credential_expiry: dict[str, float | None] = field(default_factory=dict)
    revoked_credentials: list[str] = field(default_factory=list)
    paused: Paused | None = None
    #: The workspace (see :meth:`~.site.KernelSite.layout`).
    layout: dict[str, Any] = field(default_factory=dict)
    #: The user a sandbox gateway started the kernel for: a restart starts it for them again.
    user: KernelUser | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "cwd": self.cwd,
            "launch_env": self.launch_env,
            "container_id": self.container_id,
            "runtime_dir": str(self.runtime_dir) if self.runtime_dir else None,
            "launch_dir": str(self.launch_dir) if self.launch_dir else None,
            "image": self.image,
            "narrowed": self.narrowed,
            "sandbox_env": self.sandbox_env,
            "credential_expiry": self.credential_expiry,
            "revoked_credentials": sorted(self.revoked_credentials),
            "paused": self.paused.to_dict() if self.paused is not None else None,
            "user": self.user.to_dict() if self.user is not None else None,
            **self.layout,
            "connection_info": {
                k: (v.decode() if isinstance(v, bytes) else v) for k, v in self.connection_info.items()
            },
        }

    @classmethod
    def from_dict(cls, info: dict[str, Any]) -> ReattachState:
        runtime_dir, launch_dir = info.get("runtime_dir"), info.get("launch_dir")
        return cls(
            container_id=info["container_id"],
            runtime_dir=Path(runtime_dir) if runtime_dir else None,
            launch_dir=Path(launch_dir) if launch_dir else None,
            connection_info=dict(info["connection_info"]),
            cwd=info.get("cwd"),
            launch_env=dict(info.get("launch_env") or {}),
            image=str(info.get("image") or ""),
            narrowed=dict(info.get("narrowed") or {}),
            sandbox_env=dict(info.get("sandbox_env") or {}),
            credential_expiry=dict(info.get("credential_expiry") or {}),
            revoked_credentials=list(info.get("revoked_credentials") or []),
            paused=Paused.from_dict(info.get("paused")),
            layout={key: info.get(key) for key in LAYOUT_KEYS},
            user=KernelUser.from_dict(info["user"]) if info.get("user") else None,
        )

    @property
    def launches(self) -> int:
        """How many launches the runtime folder has seen (its launch folders are run1, run2...)."""
        return int(self.launch_dir.name.removeprefix("run") or 0) if self.launch_dir is not None else 0


async def save_state(
    runtime_dir: Path,
    kernel_name: str,
    info: dict[str, Any],
    kernel_spec: Any,
    log: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """Keep a kernel's ``provisioner_info`` in its server-only runtime folder
    (``provisioner.json``): a server killed with SIGKILL leaves it behind for the next one
    (see :mod:`sandbox_kernel.reattach`). A failure to is logged."""
    kernel_id = info.get("kernel_id")  # (jupyter_client's own part of the info)
    state: dict[str, Any] = {
        "kernel_id": str(kernel_id),
        "kernel_name": kernel_name,
        "provisioner_info": info,
    }
    if kernel_spec is not None:
        # A process that reattaches need not see the kernelspec (another user's data folder).
        state["kernelspec"] = kernel_spec.to_dict()
    try:
        await asyncio.to_thread(write_state, runtime_dir, state)
    except OSError as exc:
        log.warning("Sandboxed kernel %s: cannot save its reattach state: %s", kernel_id, exc)
