"""Where one kernel runs now: its sandbox, its folders, its workspace.

The provisioner's parts (the pauser, the watchdog, take-over, exits) are handed the one
:class:`KernelSite` of their kernel and read from it what they act on; a start, a
teardown, a take-over or a reattach changes it, and every part sees that at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_kernel.plan.sandbox_spec import SandboxSpec

#: What a kernel's saved state says of its workspace (see :meth:`KernelSite.layout`).
LAYOUT_KEYS = ("workspace", "workdir", "workspace_path", "volume", "uid", "gid", "workspace_identity")


def workspace_identity(spec: SandboxSpec) -> list[int] | None:
    """(device, inode) of the host folder a sandbox mounts as its workspace (None: a volume):
    a pinned one's as its staging folder shows it, whatever its path leads to now."""
    if spec.volume is not None:
        return None
    st = os.stat(spec.staging or spec.workspace)
    return [st.st_dev, st.st_ino]


@dataclass
class KernelSite:
    """One kernel's sandbox (``container_id``, None while there is none), its server-only
    runtime folder, the launch folder of its current run, and the plan it runs."""

    kernel_id: str
    container_id: str | None = None
    # A server-owned 0700 folder for the provisioner's life, holding one kernel-owned
    # folder per launch (connection file and ipc sockets), mounted into the sandbox.
    runtime_dir: Path | None = None
    launch_dir: Path | None = None
    launches: int = 0
    spec: SandboxSpec | None = None
    #: The folder mounted (device, inode): the files API refuses one swapped since.
    identity: list[int] | None = None
    #: A reattached kernel's layout, as its saved state said (its spec is not known).
    loaded_layout: dict[str, Any] = field(default_factory=dict)

    def forget(self) -> Path | None:
        """The kernel is not this process's to touch any more: its runtime folder (which
        was), all else forgotten."""
        runtime_dir = self.runtime_dir
        self.container_id = None
        self.runtime_dir = self.launch_dir = None
        return runtime_dir

    def layout(self) -> dict[str, Any]:
        """The running sandbox's workspace: its host folder (or named volume), where it is
        inside, the kernel's working folder there, and whose files the kernel writes. What
        the host-side files API needs; a reattached kernel keeps what its state said."""
        spec = self.spec
        if spec is None:
            return dict(self.loaded_layout)
        return {
            "workspace": str(spec.workspace),
            "workdir": spec.workdir,
            "workspace_path": spec.workspace_path,
            "volume": spec.volume,
            "uid": spec.uid,
            "gid": spec.gid,
            "workspace_identity": self.identity,
        }

    def resolve_path(self, path: str) -> str | None:
        """Map a path the kernel reports (e.g. /workspace/x.py) to the host, within the workspace."""
        spec = self.spec
        if spec is None:
            return None
        p = Path(path)
        if p.is_absolute():
            try:
                p = spec.workspace / p.relative_to(spec.workspace_path)
            except ValueError:
                return None
        else:
            p = spec.workspace / Path(spec.workdir).relative_to(spec.workspace_path) / p
        resolved = p.resolve()
        if not resolved.is_relative_to(spec.workspace) or not resolved.exists():
            return None
        return resolved.as_posix()
