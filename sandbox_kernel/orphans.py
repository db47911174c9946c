"""Finding sandboxed kernels whose Jupyter server is gone, and removing them.

Every kernel records which server process owns it: host name, PID namespace, pid, and
the pid's start time (so a recycled pid is not mistaken for the server). The container
label names the server that started it; an ``owner`` file in its runtime folder names
the current owner (a server that re-attaches with ``load_provisioner_info`` takes it
over). A kernel whose owner has died, judged only from the same host and PID namespace,
is an orphan: nothing will ever shut it down, so the next provisioner start in any
server, and ``jupyter sandbox-kernel prune``, remove it along with its runtime folder.
When in doubt (another host, another namespace, an unreadable /proc entry) a kernel is
never judged orphaned.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .docker_api import SandboxDocker
from .policy import LABEL_KERNEL_ID, LABEL_KERNELSPEC, LABEL_OWNER, LABEL_RUNTIME_DIR, LABEL_WORKSPACE

log = logging.getLogger(__name__)


_UNKNOWN = "?"
OWNER_FILE = "owner"


def _start_ticks(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot); None if it does not exist; "?" if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return _UNKNOWN  # e.g. /proc mounted with hidepid: alive or not, we cannot tell
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return _UNKNOWN


def server_identity(pid: int | None = None) -> str:
    """``host/pid-namespace/pid/start`` of this process: who owns the kernels it starts."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}/{_pid_namespace()}/{pid}/{_start_ticks(pid)}"


def owner_is_gone(identity: str) -> bool:
    """True only when the owner is known to have run here and that process is gone."""
    try:
        host, namespace, pid, ticks = identity.rsplit("/", 3)
    except ValueError:
        return False  # not ours to judge
    if host != socket.gethostname() or namespace != _pid_namespace() or namespace == _UNKNOWN:
        return False
    if not pid.isdigit():
        return False
    now = _start_ticks(int(pid))
    return now != _UNKNOWN and now != ticks


def write_owner(runtime_dir: Path) -> None:
    """Record this process as the owner of the kernel whose runtime folder this is."""
    path = runtime_dir / OWNER_FILE
    tmp = runtime_dir / f".{OWNER_FILE}.{os.getpid()}"
    tmp.write_text(server_identity())
    tmp.replace(path)


def _read_owner(launch_dir: str) -> str | None:
    if not launch_dir:
        return None
    try:
        with open(Path(launch_dir).parent / OWNER_FILE, "rb") as f:
            return f.read(512).decode("utf-8", "replace").strip()
    except OSError:
        return None


@dataclass(frozen=True)
class SandboxedKernel:
    """One sandbox container as ``jupyter sandbox-kernel list`` shows it."""

    container_id: str
    kernel_id: str
    kernelspec: str
    owner: str
    workspace: str
    runtime_dir: str
    state: str
    created: str
    memory_limit: int

    @property
    def orphaned(self) -> bool:
        return owner_is_gone(self.owner)

    @property
    def age_seconds(self) -> float:
        try:
            created = datetime.fromisoformat(self.created[:26].rstrip("Z") + "+00:00")
        except ValueError:
            return 0.0
        return (datetime.now(timezone.utc) - created).total_seconds()

    @classmethod
    def from_inspect(cls, attrs: dict[str, Any]) -> SandboxedKernel:
        labels = (attrs.get("Config") or {}).get("Labels") or {}
        return cls(
            container_id=str(attrs.get("Id", "")),
            kernel_id=labels.get(LABEL_KERNEL_ID, ""),
            kernelspec=labels.get(LABEL_KERNELSPEC, ""),
            owner=_read_owner(labels.get(LABEL_RUNTIME_DIR, "")) or labels.get(LABEL_OWNER, ""),
            workspace=labels.get(LABEL_WORKSPACE, ""),
            runtime_dir=labels.get(LABEL_RUNTIME_DIR, ""),
            state=str((attrs.get("State") or {}).get("Status", "unknown")),
            created=str(attrs.get("Created", "")),
            memory_limit=int((attrs.get("HostConfig") or {}).get("Memory") or 0),
        )


def remove_runtime_dir(launch_dir: str, runtime_parent: str | None = None) -> None:
    """Remove a kernel's runtime folder, but only one that looks like ours.

    The path comes from a container label; anyone who can create containers can write
    labels, so it must be a ``sandbox-kernel-*`` folder (holding ``runN``) directly in
    the runtime parent before anything is deleted.
    """
    if not launch_dir:
        return
    outer = Path(launch_dir).parent
    parent = Path(runtime_parent or tempfile.gettempdir()).resolve()
    if outer.parent.resolve() != parent or not outer.name.startswith("sandbox-kernel-") or outer.is_symlink():
        log.warning("Not removing %s: not a sandbox-kernel runtime folder under %s", outer, parent)
        return
    shutil.rmtree(outer, ignore_errors=True)


async def list_kernels(docker_api: SandboxDocker) -> list[SandboxedKernel]:
    """Every sandbox container on the Docker host, newest first."""
    return sorted(
        (SandboxedKernel.from_inspect(attrs) for attrs in await docker_api.managed_containers()),
        key=lambda k: k.created,
        reverse=True,
    )


async def remove_kernel(
    docker_api: SandboxDocker, kernel: SandboxedKernel, runtime_parent: str | None
) -> None:
    """Remove a kernel's container and runtime folder."""
    await docker_api.remove(kernel.container_id)
    await asyncio.to_thread(remove_runtime_dir, kernel.runtime_dir, runtime_parent)


async def prune_orphans(
    docker_api: SandboxDocker, runtime_parent: str | None = None
) -> list[SandboxedKernel]:
    """Remove every kernel whose server is gone; return them."""
    orphans = [k for k in await list_kernels(docker_api) if k.orphaned]
    for kernel in orphans:
        log.warning(
            "Removing orphaned sandboxed kernel %s (container %s): its server %s is gone",
            kernel.kernel_id,
            kernel.container_id[:12],
            kernel.owner,
        )
        await remove_kernel(docker_api, kernel, runtime_parent)
    return orphans
