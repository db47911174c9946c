"""An in-memory backend, for tests of the host-side logic without Docker or gVisor.

:class:`FakeBackend` keeps sandboxes as records in a state machine (created, running,
exited, saved) and plays the part of the sandbox's channel relay in the launch folder:
it binds real unix sockets where the kernel's would be when a sandbox starts and on
SIGUSR2, and closes them on SIGUSR1, as ``kernel_relay`` does. No kernel runs: what a
test needs of one (an exit code, the memory limit hit, a failing checkpoint) it sets on
the record. As httpx ships ``MockTransport``, it ships with the package, so that a
backend of one's own can be tested against the same logic::

    backend = FakeBackend()
    provisioner = SandboxProvisioner(kernel_id="k1", backend=backend, ...)
    ...
    backend.exit(container_id, 137, oom=True)
"""

from __future__ import annotations

import itertools
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.errors import PauseError
from sandbox_kernel.plan.sandbox_spec import SandboxSpec, kernel_sockets


@dataclass
class FakeSandbox:
    """One sandbox of a :class:`FakeBackend`."""

    id: str
    spec: SandboxSpec
    status: str = "running"  # running, exited (stopped, saved or not), removed
    exit_code: int | None = None
    oom: bool = False
    pid: int | None = None
    signals: list[int] = field(default_factory=list)
    checkpoints: set[str] = field(default_factory=set)
    #: Raised by the next checkpoint; ``stop`` it too: the failure ended the sandbox.
    fail_checkpoint: tuple[Exception, bool] | None = None
    fail_restore: Exception | None = None
    #: Whether its relay binds its sockets again on SIGUSR2 (False: one that hangs).
    rebinds: bool = True
    #: Frozen by its freezer: a signal or checkpoint now raises (Docker's would hang).
    frozen: bool = False
    #: Whether its freezer works (False: a host that does not let this process freeze).
    freezable: bool = True
    _listeners: list[socket.socket] = field(default_factory=list, repr=False)


@dataclass
class FakeFreezer:
    """The freezer of one :class:`FakeSandbox`."""

    box: FakeSandbox

    def set(self, frozen: bool) -> bool:
        if not self.box.freezable or self.box.status != "running":
            return False
        self.box.frozen = frozen
        return True

    def state(self) -> str | None:
        return "frozen" if self.box.frozen else "thawed"


class FakeBackend(SandboxBackend):
    """Sandboxes as records; every call is noted in :attr:`calls` (name, sandbox id)."""

    def __init__(self, *, can_checkpoint: bool = True) -> None:
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.calls: list[tuple[str, str]] = []
        self.can_checkpoint = can_checkpoint
        self._ids = itertools.count(1)

    # ---------------------------------------------------------------- what tests do

    def sandbox(self, sandbox_id: str) -> FakeSandbox:
        return self.sandboxes[sandbox_id]

    def exit(self, sandbox_id: str, code: int, *, oom: bool = False) -> None:
        """The sandbox ends by itself (its kernel exited, or the host's OOM killer hit it)."""
        box = self.sandboxes[sandbox_id]
        box.status, box.exit_code, box.oom = "exited", code, oom
        self._close(box)

    # ---------------------------------------------------------------- the relay's part

    def _bind(self, box: FakeSandbox) -> None:
        self._close(box)
        for path in kernel_sockets(box.spec.runtime_dir).values():
            path.unlink(missing_ok=True)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            listener.listen(8)
            box._listeners.append(listener)

    def _close(self, box: FakeSandbox) -> None:
        for listener in box._listeners:
            listener.close()
        box._listeners.clear()

    def _note(self, call: str, sandbox_id: str = "") -> None:
        self.calls.append((call, sandbox_id))

    # ---------------------------------------------------------------- the interface

    async def check_runtime(self, runtime: str) -> None:
        self._note("check_runtime")

    async def check_image(self, image: str) -> None:
        self._note("check_image")

    async def create(self, spec: SandboxSpec) -> str:
        sandbox_id = f"fake{next(self._ids):08d}"
        box = self.sandboxes[sandbox_id] = FakeSandbox(sandbox_id, spec)
        self._note("create", sandbox_id)
        if spec.runtime_dir.is_dir():
            self._bind(box)
        return sandbox_id

    async def state(self, sandbox_id: str) -> tuple[str, int | None]:
        box = self.sandboxes.get(sandbox_id)
        if box is None or box.status == "removed":
            return "removed", 255
        return box.status, box.exit_code

    async def main_pid(self, sandbox_id: str) -> int | None:
        box = self.sandboxes.get(sandbox_id)
        return box.pid if box is not None and box.status == "running" else None

    async def oom_killed(self, sandbox_id: str) -> bool:
        box = self.sandboxes.get(sandbox_id)
        return box is not None and box.oom

    async def signal(self, sandbox_id: str, signum: int) -> bool:
        box = self.sandboxes.get(sandbox_id)
        self._note(f"signal {signal.Signals(signum).name}", sandbox_id)
        if box is None or box.status != "running":
            return False
        self._refuse_if_frozen(box, "signalled")
        box.signals.append(signum)
        if signum in (signal.SIGKILL, signal.SIGTERM):
            self.exit(sandbox_id, 128 + signum)
        elif signum == signal.SIGUSR1:
            self._close(box)
        elif signum == signal.SIGUSR2 and box.rebinds:
            self._bind(box)
        return True

    def _refuse_if_frozen(self, box: FakeSandbox, what: str) -> None:
        if box.frozen:
            msg = f"sandbox {box.id} {what} while frozen (Docker would wait until it is thawed)"
            raise RuntimeError(msg)

    async def freezer(self, sandbox_id: str) -> FakeFreezer | None:
        box = self.sandboxes.get(sandbox_id)
        return FakeFreezer(box) if box is not None and box.status == "running" else None

    async def update_limits(
        self, sandbox_id: str, memory: str | None = None, cpus: float | None = None
    ) -> None:
        self._note("update_limits", sandbox_id)

    async def prepare_workspace(self, spec: SandboxSpec) -> Path | None:
        if spec.owned_from is None or spec.staging is None:
            return None
        self._note("pin_workspace", str(spec.staging))
        # A link stands for the pinning bind mount: the staging folder shows the workspace.
        if not spec.staging.is_symlink():
            spec.staging.symlink_to(spec.workspace)
        return spec.staging

    async def volume_path(self, name: str) -> Path:
        raise NotImplementedError

    async def attach_workspace(self, slot: Path, workspace_path: str, source: Path) -> None:
        self._note("attach_workspace")

    async def rename(self, sandbox_id: str, name: str) -> None:
        self._note("rename", sandbox_id)

    async def logs(self, sandbox_id: str, tail: int = 30) -> str:
        return ""

    async def remove(self, sandbox_id: str) -> None:
        self.remove_blocking(sandbox_id)

    def remove_blocking(self, sandbox_id: str) -> None:
        self._note("remove", sandbox_id)
        box = self.sandboxes.get(sandbox_id)
        if box is not None:  # (thawed first, as Docker's is)
            self._close(box)
            box.status, box.exit_code, box.frozen = "removed", 255, False

    # ---------------------------------------------------------------- pausing

    async def check_checkpoints(self) -> None:
        if not self.can_checkpoint:
            await super().check_checkpoints()

    async def checkpoint(self, sandbox_id: str, name: str) -> int | None:
        box = self.sandboxes[sandbox_id]
        self._note("checkpoint", sandbox_id)
        self._refuse_if_frozen(box, "saved")
        if box.fail_checkpoint is not None:
            exc, stops = box.fail_checkpoint
            box.fail_checkpoint = None
            if stops:
                box.status, box.exit_code = "exited", 1
            raise exc
        if box.status != "running":
            msg = f"sandbox {sandbox_id} is not running"
            raise PauseError(msg)
        box.checkpoints.add(name)
        box.status, box.exit_code = "exited", 0
        return 4096

    async def restore(self, sandbox_id: str, name: str) -> None:
        box = self.sandboxes[sandbox_id]
        self._note("restore", sandbox_id)
        if box.fail_restore is not None:
            raise box.fail_restore
        if name not in box.checkpoints:
            msg = f"sandbox {sandbox_id} has no checkpoint {name}"
            raise PauseError(msg)
        box.status, box.exit_code = "running", None  # its relay waits for SIGUSR2

    async def host_sockets(self, sandbox_id: str) -> list[str] | None:
        return None  # unknown: the pause probes the sockets' paths

    async def remove_checkpoint(self, sandbox_id: str, name: str) -> None:
        self._note("remove_checkpoint", sandbox_id)
        self.sandboxes[sandbox_id].checkpoints.discard(name)

    # ---------------------------------------------------------------- all of them

    async def managed_containers(self) -> list[dict[str, Any]]:
        return [
            {"Id": box.id, "Config": {"Labels": box.spec.labels}, "State": {"Status": box.status}}
            for box in self.sandboxes.values()
            if box.status != "removed"
        ]
