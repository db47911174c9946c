"""What the provisioner and the pool need of whatever runs sandboxes: the backend interface.

Docker with gVisor (:class:`~.docker_backend.DockerBackend`) is today's. Another one
(rootless Podman, Kubernetes) implements this class and is chosen with
``c.SandboxProvisioner.backend_class``, as jupyter_client's ``client_factory`` chooses a
client; tests plug in the same way. Identifiers are the backend's own (a container id).
A backend never falls back to weaker isolation: when it cannot run a sandbox as the spec
says, it raises.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Protocol

from sandbox_kernel.errors import PauseError
from sandbox_kernel.plan.sandbox_spec import SandboxSpec


class SandboxFreezer(Protocol):
    """What freezes one running sandbox (every process of it stops being scheduled, its
    memory stays) and thaws it; each call quick and blocking-free enough for any thread."""

    def set(self, frozen: bool) -> bool:
        """Freeze or thaw; False where it could not be done (the sandbox is gone, say)."""

    def state(self) -> str | None:
        """One of frozen, freezing (asked, not done yet) and thawed; None if unknown."""


class SandboxBackend(ABC):
    """Creates, watches, signals and removes sandboxes; async, never blocking the loop.

    Errors are :class:`~.errors.SandboxKernelError` subclasses whose messages say how
    to fix the host (DockerUnavailableError, RuntimeMissingError, ImageNotFoundError...).
    """

    # ---------------------------------------------------------------- the host

    @abstractmethod
    async def check_runtime(self, runtime: str) -> None:
        """Refuse to go on unless ``runtime`` runs sandboxes with the required isolation."""

    @abstractmethod
    async def check_image(self, image: str) -> None:
        """Refuse to go on unless ``image`` is there (it is never fetched)."""

    # ---------------------------------------------------------------- one sandbox

    @abstractmethod
    async def create(self, spec: SandboxSpec) -> str:
        """Create and start the sandbox ``spec`` describes; its id. Nothing is left
        behind when it cannot be started."""

    @abstractmethod
    async def state(self, sandbox_id: str) -> tuple[str, int | None]:
        """(status, exit code or None while it runs); ``("removed", 255)`` when gone."""

    @abstractmethod
    async def main_pid(self, sandbox_id: str) -> int | None:
        """The host pid of the sandbox's main process (its cgroups are the sandbox's)."""

    @abstractmethod
    async def oom_killed(self, sandbox_id: str) -> bool:
        """Whether the host ended the sandbox for using more memory than its limit."""

    @abstractmethod
    async def signal(self, sandbox_id: str, signum: int) -> bool:
        """Deliver ``signum`` to the sandbox's init; False if it is not running."""

    @abstractmethod
    async def update_limits(
        self, sandbox_id: str, memory: str | None = None, cpus: float | None = None
    ) -> None:
        """Change a running sandbox's memory or CPU limit."""

    @abstractmethod
    async def prepare_workspace(self, spec: SandboxSpec) -> Path | None:
        """Make the spec's workspace volume ready for the kernel's uid, or pin a gateway
        user's workspace (``owned_from``: mount it on ``staging`` from a descriptor every
        folder of which was checked, never by its path, else :class:`~.errors.WorkspaceError`);
        where its files are on the host, for attaching it to a pooled sandbox (None: a
        folder to mount as it is)."""

    @abstractmethod
    async def volume_path(self, name: str) -> Path:
        """Where the files of the workspace volume ``name`` are on the host, for the host
        side's files API; only a volume made for sandbox-kernel workspaces by this
        server's user, else :class:`~.errors.WorkspaceError`."""

    @abstractmethod
    async def attach_workspace(self, slot: Path, workspace_path: str, source: Path) -> None:
        """Show the host folder ``source`` in a running pooled sandbox (whose /workspace
        is the empty ``slot``) at ``workspace_path``."""

    @abstractmethod
    async def rename(self, sandbox_id: str, name: str) -> None:
        """Name a sandbox (after the kernel that claimed it)."""

    @abstractmethod
    async def logs(self, sandbox_id: str, tail: int = 30) -> str:
        """The sandbox's last ``tail`` lines of output, or "" if unavailable."""

    def watch_exits(self, sandbox_id: str) -> None:  # noqa: B027  # optional: no events, no-op
        """Follow the sandbox's end as the backend learns of it (see :meth:`surely_running`)."""

    def unwatch_exits(self, sandbox_id: str) -> None:  # noqa: B027
        """Stop following it."""

    def surely_running(self, sandbox_id: str) -> bool:
        """True when the backend knows, without asking, that a watched sandbox still runs
        (an event stream that saw no end); False: ask :meth:`state`."""
        return False

    async def freezer(self, sandbox_id: str) -> SandboxFreezer | None:
        """The running sandbox's freezer, or None where this backend or host cannot freeze
        it (its kernels then never freeze when idle). A frozen sandbox may take no other
        call but :meth:`remove` and the look-ups (state, pid): thaw it first."""
        return None

    @abstractmethod
    async def remove(self, sandbox_id: str) -> None:
        """Stop and remove a sandbox, frozen or not (see :mod:`~.pool`); a missing one is fine."""

    @abstractmethod
    def remove_blocking(self, sandbox_id: str) -> None:
        """:meth:`remove`, from the calling thread (at the process's exit)."""

    # ---------------------------------------------------------------- pausing (optional)
    # A backend that can save a sandbox's whole state (memory included) to disk and start
    # it again from there; one that cannot keeps these defaults, and kernels never pause.

    async def check_checkpoints(self) -> None:
        """Refuse unless sandboxes can be checkpointed on this host.

        Raises:
            PauseError: saying what the host lacks and how to enable it.
        """
        msg = f"{type(self).__name__} cannot pause sandboxes (save their memory to disk)"
        raise PauseError(msg)

    async def checkpoint(self, sandbox_id: str, name: str) -> int | None:
        """Save the running sandbox as ``name`` and stop it; the image's size in bytes,
        if the host lets this process see it. Where the sandbox cannot be saved it keeps
        running and this raises."""
        msg = f"{type(self).__name__} cannot pause sandboxes"
        raise PauseError(msg)

    async def restore(self, sandbox_id: str, name: str) -> None:
        """Start the stopped sandbox again from its checkpoint ``name``."""
        msg = f"{type(self).__name__} cannot resume sandboxes"
        raise PauseError(msg)

    async def host_sockets(self, sandbox_id: str) -> list[str] | None:
        """Paths (as the sandbox names them) of the unix sockets the running sandbox holds
        bound on the host, which keep it from being saved; None if unknown."""
        return None

    async def checkpoint_usage(self) -> tuple[int, int | None]:
        """(bytes all sandboxes' checkpoints take, bytes free where they are kept, or None
        if unknown), for the disk budget of paused kernels."""
        return 0, None

    async def remove_checkpoint(self, sandbox_id: str, name: str) -> None:  # noqa: B027  # nothing to remove
        """Remove the checkpoint ``name`` (a missing one is fine); removing the sandbox
        removes its checkpoints too."""

    # ---------------------------------------------------------------- all of them

    @abstractmethod
    async def managed_containers(self) -> list[dict[str, Any]]:
        """Every sandbox of sandbox-kernel on the host, running or not, as the backend
        describes them (labels, state); see :class:`~.ownership.SandboxedKernel`."""
