"""The sandboxed kernels on a Docker host: who owns them, and removing those nobody will.

Every kernel records which server process owns it: host name, PID namespace, pid, and
the pid's start time (so a recycled pid is not mistaken for the server). The container
label names the server that started it; an ``owner`` file in its runtime folder names
the current owner (a server that re-attaches takes it over, and a live owner touches it
every minute). An *ephemeral* kernel whose owner has died, judged only from the same
host and PID namespace, is an orphan: nothing will ever shut it down, so the next
provisioner start in any server, every live owner of kernels every ``REAP_INTERVAL``
seconds (``OrphanReaper``), and ``jupyter sandbox-kernel prune`` remove it along with
its runtime folder. A *persistent* kernel whose owner has died waits to be adopted
(``provisioner.json`` in its runtime folder says how to reattach) until its time-to-live
runs out, counted from the owner's last touch; one whose container stopped is removed
only once Docker shows no memory image of it (a paused kernel's checkpoint: every judge
with Docker access sees it, whatever its uid or runtime parent). When in doubt (another
host, another namespace, an unreadable /proc entry, an owner file this process may not
read, a checkpoint list Docker would not give) a kernel is never judged removable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

from sandbox_kernel.backends import configured_backend
from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.backends.docker import CHECKPOINTS_KEY, STOPPED
from sandbox_kernel.errors import SandboxKernelError
from sandbox_kernel.host.background import BackgroundLoop
from sandbox_kernel.host.cgroups import CgroupFreezer, memory_limit, memory_usage, stat_fields
from sandbox_kernel.host.files import replace_file
from sandbox_kernel.host.mounts import detach_mounts
from sandbox_kernel.host.trees import delete_tree
from sandbox_kernel.plan.sandbox_spec import (
    LABEL_KERNEL_ID,
    LABEL_KERNELSPEC,
    LABEL_LIFECYCLE,
    LABEL_OWNER,
    LABEL_POOL,
    LABEL_RUNTIME_DIR,
    LABEL_SCOPE,
    LABEL_SERVER_UID,
    LABEL_TTL,
    LABEL_USER,
    LABEL_WORKSPACE,
    POOL_NAME_PREFIX,
)

log = logging.getLogger(__name__)


_UNKNOWN = "?"
OWNER_FILE = "owner"
#: How a kernel's runtime folder (in the runtime parent) is named.
RUNTIME_DIR_PREFIX = "sandbox-kernel-"
#: How often (seconds) a process that watches sandboxed kernels removes the kernels whose
#: owner has died (see OrphanReaper); read before each round.
REAP_INTERVAL = 60.0
#: Written into a pooled sandbox's runtime folder once its kernel is ready to be claimed.
POOL_READY_FILE = "pool-ready"
#: Where a gateway user's workspace is pinned in its kernel's runtime folder (0700, the
#: server's, never mounted into the sandbox itself): the mount Docker or a pool's claim
#: mounts (see :func:`~.host.mounts.pin_folder`); detached with the runtime folder.
PINNED_WORKSPACE = "workspace"
#: What a process needs to reattach to the kernel, kept by its owner (private: it holds the key).
STATE_FILE = "provisioner.json"
#: Written by a manager that let go of its kernel, taken over by another (its holder token).
RELEASED_FILE = "released"
#: The holder token of a kernel its owner let go of (detached): anyone may reattach.
NO_HOLDER = "-"


def _start_ticks(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot); None if it does not exist; "?" if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return _UNKNOWN  # e.g. /proc mounted with hidepid: alive or not, we cannot tell
    return stat_fields(stat)[19]


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return _UNKNOWN


def _known_missing(path: str) -> bool:
    """Whether ``path`` is known not to exist (not merely unreadable to this process)."""
    if not path:
        return False
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def server_identity(pid: int | None = None) -> str:
    """``host/pid-namespace/pid/start`` of this process: who owns the kernels it starts."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}/{_pid_namespace()}/{pid}/{_start_ticks(pid)}"


def identity_parts(identity: str) -> tuple[str, str, str, str] | None:
    """(host, pid namespace, pid, start time) of a :func:`server_identity`; None if it is not one."""
    parts = identity.rsplit("/", 3)
    return (parts[0], parts[1], parts[2], parts[3]) if len(parts) == 4 else None


def owner_is_gone(identity: str) -> bool:
    """True only when the owner is known to have run here and that process is gone."""
    parts = identity_parts(identity)
    if parts is None:
        return False  # not ours to judge
    host, namespace, pid, ticks = parts
    if host != socket.gethostname() or namespace != _pid_namespace() or namespace == _UNKNOWN:
        return False
    if not pid.isdigit():
        return False
    now = _start_ticks(int(pid))
    return now != _UNKNOWN and now != ticks


def write_owner(runtime_dir: Path, holder: str = "") -> None:
    """Record this process as the owner of the kernel whose runtime folder this is, and
    ``holder`` (a token of the one manager in it that drives the kernel) on a second line."""
    replace_file(runtime_dir / OWNER_FILE, f"{server_identity()}\n{holder}".encode(), 0o644)


@dataclass(frozen=True)
class Holder:
    """Who drives a kernel: the owning process and the token of its manager."""

    identity: str
    token: str

    @property
    def pid(self) -> str:
        parts = identity_parts(self.identity)
        return parts[2] if parts else "?"

    @property
    def host(self) -> str:
        parts = identity_parts(self.identity)
        return parts[0] if parts else "?"

    @property
    def alive(self) -> bool:
        return bool(self.identity) and not owner_is_gone(self.identity)

    def __str__(self) -> str:
        return f"process {self.pid} on {self.host}"


def write_released(runtime_dir: Path, holder: str) -> None:
    """Say that the manager ``holder`` has let go of the kernel (it was taken over)."""
    replace_file(runtime_dir / RELEASED_FILE, holder.encode(), 0o644)


def released(runtime_dir: Path, holder: str) -> bool:
    """Whether the manager ``holder`` has let go of the kernel (see :func:`write_released`)."""
    try:
        return (runtime_dir / RELEASED_FILE).read_bytes()[:256].decode(errors="replace") == holder
    except OSError:
        return False


def read_holder(runtime_dir: str | Path) -> Holder | None:
    """Who drives the kernel of this runtime folder (see :func:`write_owner`), if anyone."""
    found = _read_owner(str(Path(runtime_dir) / "_"))
    if found is None:
        return None
    identity, _, token = found[0].partition("\n")
    return Holder(identity.strip(), token.strip())


def _read_owner(launch_dir: str) -> tuple[str, float] | None:
    """(owner identity, when the owner last touched it) from a kernel's runtime folder."""
    if not launch_dir:
        return None
    # The path comes from a label: never follow a link, never block on a FIFO.
    try:
        fd = os.open(Path(launch_dir).parent / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return f.read(512).decode("utf-8", "replace").strip(), st.st_mtime


def owner_identity(launch_dir: str) -> tuple[str, float] | None:
    """(owner process, when it last touched the kernel): the first line of the owner file."""
    found = _read_owner(launch_dir)
    return None if found is None else (found[0].partition("\n")[0].strip(), found[1])


def write_state(runtime_dir: Path, state: dict[str, Any]) -> None:
    """Save a kernel's reattach state (0600, replaced atomically) in its runtime folder."""
    replace_file(runtime_dir / STATE_FILE, json.dumps(state).encode(), 0o600)


def read_state(runtime_dir: str | Path) -> dict[str, Any] | None:
    """A kernel's reattach state, or None if missing or unreadable."""
    try:
        with open(Path(runtime_dir) / STATE_FILE, "rb") as f:
            state = json.loads(f.read(1024 * 1024))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


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
    memory_usage: int | None = None
    lifecycle: str = "ephemeral"
    ttl: float = 0.0
    server_uid: int | None = None
    #: When the owner last touched the kernel (epoch seconds), if known.
    owner_seen: float | None = None
    #: The adopting server's scope (see sandbox_kernel.jupyter.server), "" outside a server.
    scope: str = ""
    #: The host pid of the sandbox (its main process), while it runs.
    pid: int | None = None
    #: A pooled sandbox no kernel has claimed yet (see sandbox_kernel.pool.sandboxes), and whether
    #: its kernel is up, ready to be claimed.
    pooled: bool = False
    pool_ready: bool = False
    #: Paused to disk (see sandbox_kernel.lifecycle.pausing): its container stopped, its memory in a
    #: checkpoint of this many bytes (None: unknown).
    paused: bool = False
    checkpoint_size: int | None = None
    #: The memory images Docker keeps of the stopped container (its checkpoints, by name),
    #: as every process with Docker access sees them; None: not known (it runs, or Docker
    #: would not say).
    checkpoints: tuple[str, ...] | None = None
    #: Its sandbox frozen while the kernel is idle (see sandbox_kernel.kernel.freezer).
    frozen: bool = False
    #: The user a sandbox gateway started it for ("" for every other kernel).
    user: str = ""

    @property
    def persistent(self) -> bool:
        return self.lifecycle == "persistent"

    @property
    def owner_known(self) -> bool:
        """Whether :attr:`owner` is the kernel's current owner, read from its owner file;
        else it is only the label's server that started it (another process of its user
        may have adopted it since), and nobody is judged gone."""
        return self.owner_seen is not None

    @property
    def owner_gone(self) -> bool:
        if self.owner_known:
            return owner_is_gone(self.owner)
        # No owner file: for an ephemeral kernel whose runtime folder is gone too, nobody
        # can have adopted it (adopting writes that file), so its label's owner decides.
        return not self.persistent and _known_missing(self.runtime_dir) and owner_is_gone(self.owner)

    @property
    def orphaned(self) -> bool:
        """An ephemeral kernel nobody will shut down, or a pooled sandbox nobody will claim."""
        return (not self.persistent or self.pooled) and self.owner_gone

    @property
    def expired(self) -> bool:
        """A persistent kernel no server has held for its time-to-live."""
        if not (self.persistent and self.ttl > 0 and self.owner_gone):
            return False
        return self.owner_seen is not None and time.time() - self.owner_seen > self.ttl

    @property
    def detached(self) -> bool:
        """A persistent kernel waiting for a server to adopt it."""
        return self.persistent and self.owner_gone and not self.expired

    @property
    def abandoned(self) -> bool:
        """A persistent kernel whose container stopped while no server held it, and of
        which Docker keeps no memory image (a paused one waits to be adopted and resumed;
        one whose checkpoints are unknown may be paused)."""
        return (
            self.persistent
            and self.owner_gone
            and self.state in STOPPED
            and not self.paused
            and self.checkpoints == ()
        )

    @property
    def removable(self) -> bool:
        """Orphaned, expired, or abandoned: what ``prune`` removes."""
        return self.orphaned or self.expired or self.abandoned

    @property
    def status(self) -> str:
        if self.orphaned:
            return "orphaned"
        if self.expired:
            return "expired"
        if self.abandoned:
            return f"{self.state}, abandoned"
        if self.detached and not self.paused:
            return f"{self.state}, detached"
        if self.pooled:
            return "pooled" if self.pool_ready else "pooled, starting"
        if self.paused:
            return "paused, detached" if self.detached else "paused"
        if not self.owner_known and owner_is_gone(self.owner):
            return f"{self.state}, owner unknown"  # its starter is gone; who holds it now, unreadable here
        return f"{self.state}, frozen" if self.frozen else self.state

    @property
    def description(self) -> str:
        """ "kernel ID (container C)", or "pooled sandbox (container C)" before a claim."""
        what = "pooled sandbox" if self.pooled else f"kernel {self.kernel_id}"
        return f"{what} (container {self.container_id[:12]})"

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
        state = attrs.get("State") or {}
        owner = owner_identity(labels.get(LABEL_RUNTIME_DIR, ""))
        pid = state.get("Pid")
        try:
            ttl = float(labels.get(LABEL_TTL, "0"))
        except ValueError:
            ttl = 0.0
        uid = labels.get(LABEL_SERVER_UID, "")
        kernel_id, workspace = labels.get(LABEL_KERNEL_ID, ""), labels.get(LABEL_WORKSPACE, "")
        name = str(attrs.get("Name", "")).lstrip("/")
        pool_ready = pooled = False
        if LABEL_POOL in labels:
            # Labels are fixed before a kernel claims the sandbox: its runtime folder (the
            # kernel's saved state) and its name (renamed after the kernel) say more.
            runtime_dir = own_runtime_dir(labels.get(LABEL_RUNTIME_DIR, ""))
            saved = (read_state(runtime_dir) or {}) if runtime_dir is not None else {}
            if saved or not name.startswith(POOL_NAME_PREFIX):
                kernel_id = str(saved.get("kernel_id") or name.removeprefix("sandbox-kernel-"))
                workspace = str((saved.get("provisioner_info") or {}).get("workspace") or workspace)
            else:
                pooled, kernel_id = True, ""
                pool_ready = runtime_dir is not None and (runtime_dir / POOL_READY_FILE).exists()
        live = pid if isinstance(pid, int) and pid > 0 else None  # its host pid, while it runs
        # The cgroup's own limit while it runs: a pool claim may have narrowed Docker's.
        limit = memory_limit(live) if live is not None else None
        paused: dict[str, Any] | None = None
        images = attrs.get(CHECKPOINTS_KEY) if state.get("Status") in STOPPED else None
        checkpoints: dict[str, int | None] | None = None
        if isinstance(images, dict):
            checkpoints = {str(name): n if isinstance(n, int) else None for name, n in images.items()}
        if state.get("Status") in STOPPED:  # paused to disk? Its saved state says so, to its user...
            runtime_dir = own_runtime_dir(labels.get(LABEL_RUNTIME_DIR, ""))
            saved = (read_state(runtime_dir) or {}) if runtime_dir is not None else {}
            info = saved.get("provisioner_info") or {}
            if info.get("container_id") == attrs.get("Id") and isinstance(info.get("paused"), dict):
                paused = dict(info["paused"])
            if paused is None and checkpoints:  # ... and Docker's checkpoints to every judge
                name = max(checkpoints)  # (named sk-<seconds>-<random>: the newest)
                paused = {"checkpoint": name, "size": checkpoints[name]}
            if paused is not None and not isinstance(paused.get("size"), int) and checkpoints:
                paused["size"] = checkpoints.get(str(paused.get("checkpoint")))
        return cls(
            container_id=str(attrs.get("Id", "")),
            kernel_id=kernel_id,
            kernelspec=labels.get(LABEL_KERNELSPEC, ""),
            owner=owner[0] if owner else labels.get(LABEL_OWNER, ""),
            workspace=workspace,
            runtime_dir=labels.get(LABEL_RUNTIME_DIR, ""),
            state=str(state.get("Status", "unknown")),
            created=str(attrs.get("Created", "")),
            memory_limit=limit or int((attrs.get("HostConfig") or {}).get("Memory") or 0),
            memory_usage=memory_usage(live) if live is not None else None,
            lifecycle=labels.get(LABEL_LIFECYCLE, "ephemeral"),
            ttl=ttl,
            server_uid=int(uid) if uid.isdigit() else None,
            owner_seen=owner[1] if owner else None,
            scope=labels.get(LABEL_SCOPE, ""),
            pooled=pooled,
            pool_ready=pool_ready,
            paused=paused is not None,
            checkpoint_size=paused.get("size") if paused is not None else None,
            checkpoints=tuple(sorted(checkpoints)) if checkpoints is not None else None,
            pid=live,
            frozen=live is not None and not pooled and _frozen(live),
            user=labels.get(LABEL_USER, ""),
        )


def _frozen(pid: int) -> bool:
    freezer = CgroupFreezer.of_pid(pid)
    return freezer is not None and freezer.state() == "frozen"


def own_runtime_dir(launch_dir: str, runtime_parent: str | None = None) -> Path | None:
    """The outer runtime folder of a kernel, if it is one this user's server made.

    The path comes from a container label, which anyone who can create containers can
    write: the key and sockets are trusted only from a ``sandbox-kernel-*`` folder
    directly in the runtime parent, owned by this user and private to it.
    """
    if not launch_dir:
        return None
    outer = Path(launch_dir).parent
    parent = Path(runtime_parent or tempfile.gettempdir()).resolve()
    try:
        st = outer.lstat()
    except OSError:
        return None
    if (
        outer.parent.resolve() != parent
        or not outer.name.startswith(RUNTIME_DIR_PREFIX)
        or not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.getuid()
        or st.st_mode & 0o077
    ):
        return None
    return outer


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
    remove_tree(outer)


def remove_tree(path: Path, attempts: int = 20) -> None:
    """Remove a kernel's folder, retrying a while: just after its sandbox stops (after a
    dockerd restart, say), gVisor's processes may still hold it for a moment. Never
    raises: what cannot be removed is logged.

    A pooled kernel's workspace is mounted inside its folder: everything mounted there
    is detached first, and a folder with a mount left in it is never deleted (that
    would delete the user's files). What kernel code left in it (a tree of any depth,
    links, read-only folders) is removed without following a link out of it.
    """
    left = detach_mounts(path)
    if left:
        log.error("Not removing %s: %s still mounted there; unmount it, then remove it", path, left[0])
        return
    failure: OSError | None = None
    for _ in range(attempts):
        try:
            delete_tree(path)
        except OSError as exc:
            failure = exc
        if not os.path.lexists(path):
            return
        time.sleep(0.25)
    log.warning(
        "Could not remove %s (%s); remove it by hand (or run `jupyter sandbox-kernel prune`)", path, failure
    )


async def list_kernels(docker_backend: SandboxBackend) -> list[SandboxedKernel]:
    """Every sandbox container on the Docker host, newest first."""
    found = await docker_backend.managed_containers()
    # Reading owner files and cgroups (at paths from labels) never blocks the loop.
    kernels = await asyncio.to_thread(lambda: [SandboxedKernel.from_inspect(attrs) for attrs in found])
    return sorted(kernels, key=lambda k: k.created, reverse=True)


async def remove_kernel(
    docker_backend: SandboxBackend, kernel: SandboxedKernel, runtime_parent: str | None
) -> None:
    """Remove a kernel's container and runtime folder."""
    await docker_backend.remove(kernel.container_id)
    await asyncio.to_thread(remove_runtime_dir, kernel.runtime_dir, runtime_parent)


def stray_runtime_dirs(runtime_parent: str | None, in_use: set[Path]) -> list[Path]:
    """This user's runtime folders that no sandbox uses (``in_use``: the folders of every
    sandbox there is) and whose owner is gone: a process killed while it started a kernel
    or a pooled sandbox leaves one, as does a sandbox removed behind its owner's back."""
    parent = Path(runtime_parent or tempfile.gettempdir()).resolve()
    in_use = {folder.resolve() for folder in in_use}
    stray = []
    for outer in parent.glob(RUNTIME_DIR_PREFIX + "*"):
        if outer in in_use or own_runtime_dir(str(outer / "_"), str(parent)) != outer:
            continue
        owner = owner_identity(str(outer / "_"))
        if owner is not None and owner_is_gone(owner[0]):  # no owner file yet: being made
            stray.append(outer)
    return stray


async def prune_orphans(
    docker_backend: SandboxBackend, runtime_parent: str | None = None
) -> list[SandboxedKernel]:
    """Remove every ephemeral kernel whose server is gone, and every persistent one past
    its time-to-live or stopped with no server; return them.

    Raises:
        DockerUnavailableError, DockerOperationError: Docker failed; what was removed
            before stays removed.
    """
    return await _prune(docker_backend, lambda kernel: runtime_parent, [runtime_parent])


async def _prune(
    docker_backend: SandboxBackend,
    runtime_parent_of: Callable[[SandboxedKernel], str | None],
    runtime_parents: list[str | None],
    only_own: bool = False,
) -> list[SandboxedKernel]:
    kernels = await list_kernels(docker_backend)
    # Unattended, judge only kernels of this uid (what is removable was judged from the
    # owner file, which names who holds it now).
    doomed = [k for k in kernels if k.removable and (not only_own or k.server_uid == os.getuid())]
    for kernel in doomed:
        log.warning(
            "Removing %s %s: its server %s is gone",
            "expired" if kernel.expired else "stopped" if kernel.abandoned else "orphaned",
            kernel.description,
            kernel.owner,
        )
        await remove_kernel(docker_backend, kernel, runtime_parent_of(kernel))
    in_use = {Path(k.runtime_dir).parent for k in kernels if k.runtime_dir and k not in doomed}
    for runtime_parent in runtime_parents:
        for folder in await asyncio.to_thread(stray_runtime_dirs, runtime_parent, in_use):
            log.warning("Removing %s: its process is gone and no sandbox uses it", folder)
            await asyncio.to_thread(remove_tree, folder)
    return doomed


class OrphanReaper:
    """Removes, every ``REAP_INTERVAL`` seconds, what :func:`prune_orphans` removes, in
    every process that watches sandboxed kernels.

    A program killed with SIGKILL cannot shut its kernels down; the next kernel start
    in any process would remove them, but until then an orphan may spin at full CPU.
    So the process's watchdog loop (:class:`~.background.BackgroundLoop`) reaps as a
    chore while it has a kernel to watch: per round one Docker listing and one inspect
    per sandbox container, in worker threads, never blocking a watchdog. Who is dead is
    judged by the rules above.
    """

    _instance: ClassVar[OrphanReaper | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, docker_backend: SandboxBackend | None = None) -> None:
        self.docker = docker_backend or configured_backend()
        self._lock = threading.Lock()
        self._runtime_parents: list[Path] = []

    @classmethod
    def instance(cls) -> OrphanReaper:
        """The process's reaper, made on first use (it contacts Docker only when it reaps)."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def watch(self, runtime_parent: Path, loop: BackgroundLoop | None = None) -> None:
        """Reap on ``loop`` (the watchdog loop) while it watches kernels, removing the
        runtime folders of the reaped under ``runtime_parent`` (one of this process's)."""
        parent = Path(os.path.abspath(runtime_parent))
        with self._lock:
            if parent not in self._runtime_parents:
                self._runtime_parents.append(parent)
        (loop or BackgroundLoop.instance()).add_chore("reap-orphans", self.reap, lambda: REAP_INTERVAL)

    def _runtime_parent_of(self, kernel: SandboxedKernel) -> str | None:
        with self._lock:
            parents = list(self._runtime_parents)
        if kernel.runtime_dir:
            # Only picks the folder to check against (remove_runtime_dir checks again), so
            # a path from a label is not looked up here, on the loop.
            parent = Path(os.path.normpath(kernel.runtime_dir)).parent.parent
            if parent in parents:
                return str(parent)
        return str(parents[0]) if parents else None

    async def reap(self) -> list[SandboxedKernel]:
        """One round: remove the kernels whose owner is gone; return them."""
        try:
            with self._lock:
                parents: list[str | None] = [str(parent) for parent in self._runtime_parents]
            return await _prune(self.docker, self._runtime_parent_of, parents, only_own=True)
        except SandboxKernelError as exc:
            log.warning("Could not remove orphaned sandboxed kernels: %s", exc)
            return []
