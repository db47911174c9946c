"""A warm pool: sandboxes started before anyone asks for their kernel.

Starting a kernel under gVisor takes seconds, most of it Python's imports through the
gofer. A kernelspec with ``pool_size`` N keeps up to N sandboxes of its own fully
started in this process: container running with the kernelspec's policy, kernel
imported, channels bound, launch folder sealed, no workspace. Starting a kernel then
*claims* one (see :meth:`~.provisioner.SandboxProvisioner.launch_kernel`): the
workspace is mounted under its slot (:mod:`~.mounts`), its kernel is told its working
folder and session variables, the container is renamed after the kernel, and the
manager adopts the sandbox's session key (fresh and random per sandbox, seen by nobody
else, as when a kernel is reattached).

- One sandbox serves one kernel, ever: a claimed sandbox never comes back. No user code
  has run in a sandbox before its claim.
- A start claims a sandbox made from its own plan (image, command, environment, limits,
  uid, labels: :func:`plan_fingerprint`), or from one it narrows in ways a running,
  never-used sandbox can be narrowed to (lower limits, less network, variables set at
  the claim: :mod:`~.fit`); otherwise the kernel starts cold, with one log line saying why.
- A waiting sandbox is frozen (its cgroup's freezer): under runsc 20240729 an idle
  sandbox keeps ~6 % of a core busy, a frozen one nothing; a claim thaws it first, and
  so does Docker wanting it stopped (a daemon restart waits for a frozen sandbox).
- Refilling runs on the background loop's thread after each claim, one sandbox at a
  time, and never blocks a server's event loop. The pool stops at ``max_pool_memory``
  (the sum of the waiting sandboxes' memory limits).
- A sandbox gateway keeps a pool per user and kernelspec (``pool_users``): its sandboxes
  are planned for that user (their uid, their label), so only their starts fit them. All
  pools together stop at ``max_pool_memory``, and all users' pools of one kernelspec at
  its ``max_pool_size`` sandboxes.
- Pooled sandboxes belong to this process (owner label and file): removed when it exits
  (:meth:`SandboxPool.close`, at exit) and swept as orphans by the next process when
  it dies without doing so (see :mod:`~.orphans`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.egress.ca import KernelCA
from sandbox_kernel.egress.rules import EgressRules
from sandbox_kernel.errors import SandboxKernelError
from sandbox_kernel.host.background import BackgroundLoop
from sandbox_kernel.host.cgroups import freeze, lower_limits
from sandbox_kernel.host.mounts import make_shared
from sandbox_kernel.host.stopping import being_stopped
from sandbox_kernel.lifecycle.launch_folder import (
    expected_sockets,
    new_launch_dir,
    new_runtime_dir,
    seal_launch_dir,
    wait_until_ready,
    write_launch_files,
)
from sandbox_kernel.lifecycle.ownership import POOL_READY_FILE, remove_tree
from sandbox_kernel.lifecycle.startup_mark import wait_for_startup_code
from sandbox_kernel.plan.limits import size_bytes
from sandbox_kernel.plan.sandbox_spec import (
    CLAIM_ENV,
    CONTAINER_CLAIM_SOCKET,
    CONTAINER_WORKSPACE,
    LABEL_OWNER,
    LABEL_USER,
    PER_KERNEL_ENV,
    SandboxSpec,
)

log = logging.getLogger(__name__)

#: Seconds a failed fill waits before the pool tries that kernelspec again.
RETRY_AFTER = 30.0
#: Seconds a refill waits after a claim: starting a sandbox takes both cores for a
#: moment, which the claimed kernel's first replies should not have to share.
REFILL_DELAY = 1.0


def plan_fingerprint(spec: SandboxSpec, scheme: str) -> str:
    """What must be equal for a pooled sandbox to serve a kernel: everything fixed when
    its container starts. The workspace, kernel id and per-kernel variables are given
    at the claim."""
    fixed = asdict(
        replace(
            spec,
            kernel_id="",
            workspace=Path(),
            workdir="",
            workspace_path="",
            volume=None,
            runtime_dir=Path(),
            owned_from=None,
            staging=None,
        )
    )
    fixed["env"] = {k: v for k, v in spec.env.items() if k not in PER_KERNEL_ENV}
    fixed["extra_labels"] = {k: v for k, v in spec.extra_labels.items() if k != LABEL_OWNER}
    fixed["scheme"] = scheme
    return hashlib.sha256(json.dumps(fixed, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _named(plan: PoolPlan) -> str:
    """The pool, for the log: its kernelspec, and its user if it has one."""
    return f"{plan.kernelspec} for user {plan.user}" if plan.user else plan.kernelspec


def _at_exit(close: Callable[[], None]) -> None:
    """Run ``close`` when the interpreter exits, while worker threads still run.

    A sandbox being started when a program ends must be removed with the same async
    Docker calls that start it, and those run in the default executor's threads, which
    Python shuts down before plain ``atexit`` handlers run. Exit hooks of ``threading``
    run before that, newest first (the hook concurrent.futures uses itself): register
    after its module is loaded, so ours comes first.
    """
    import concurrent.futures.thread  # noqa: F401  # its exit hook is registered on import

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython 3.9+: the best there is
        atexit.register(close)
    else:
        register(close)


def pooled_spec(spec: SandboxSpec, slot: Path, launch_dir: Path) -> SandboxSpec:
    """A pooled sandbox of the plan ``spec``: nothing of the kernel whose start made the
    plan (no folder, name, volume or session variables; those come with each claim), its
    slot as /workspace, and the claim socket to listen on."""
    env = {name: value for name, value in spec.env.items() if name not in PER_KERNEL_ENV}
    return replace(
        spec,
        workspace=slot,
        workdir=CONTAINER_WORKSPACE,
        workspace_path=CONTAINER_WORKSPACE,
        volume=None,
        owned_from=None,
        staging=None,
        kernel_id=secrets.token_hex(6),
        runtime_dir=launch_dir,
        slot=slot,
        env={**env, CLAIM_ENV: CONTAINER_CLAIM_SOCKET},
    )


#: Which pool a plan fills: its kernelspec's, and the user's it is planned for ("": no user's).
PoolKey = tuple[str, str]


@dataclass(frozen=True)
class PoolPlan:
    """What a kernelspec's pooled sandboxes are made from (for one user of a sandbox
    gateway, or for none), and how many to keep."""

    spec: SandboxSpec
    size: int
    scheme: str
    #: With network "allowlist", the kernel's allowed domains (its egress CA signs for no others).
    egress: EgressRules | None
    startup_timeout: float
    #: Whether its kernel runs the start-up code (the shipped launcher's argv; see startup_mark).
    startup_code: bool
    runtime_parent: str
    #: Most bytes of memory limits all waiting sandboxes of the process may reserve.
    budget: int
    #: What starts them (the provisioner's backend).
    backend: SandboxBackend = field(compare=False)
    #: Most sandboxes all pools of the kernelspec (every user's) may keep (its max_pool_size).
    max_size: int = 64

    @property
    def kernelspec(self) -> str:
        return self.spec.kernelspec

    @property
    def user(self) -> str:
        """The name of the user its sandboxes are planned for ("": none, outside a gateway)."""
        return self.spec.extra_labels.get(LABEL_USER, "")

    @property
    def key(self) -> PoolKey:
        return (self.kernelspec, self.user)

    @property
    def fingerprint(self) -> str:
        return plan_fingerprint(self.spec, self.scheme)

    @property
    def memory(self) -> int:
        return size_bytes("memory", self.spec.memory)


@dataclass(frozen=True)
class PooledSandbox:
    """A started sandbox waiting for its kernel."""

    container_id: str
    runtime_dir: Path
    launch_dir: Path
    slot: Path
    key: bytes
    scheme: str
    memory: int
    backend: SandboxBackend = field(compare=False)
    #: The host pid of its sandbox, whose cgroup is frozen while it waits (None: not frozen).
    frozen_pid: int | None = None
    #: The host pid of its sandbox (None: not known), whose cgroup a claim may narrow.
    pid: int | None = None

    def thaw(self) -> None:
        """Let the sandbox run again, before its claim (the backend's removal thaws by itself)."""
        if self.frozen_pid is not None:
            freeze(self.frozen_pid, False)

    def narrow(self, memory: str | None, cpus: float | None) -> None:
        """Lower the sandbox's memory limit and CPU quota (its host cgroup), before its claim.

        Raises:
            OSError: they could not be lowered (then the sandbox must not serve the start).
        """
        if self.pid is None:
            msg = "the sandbox's host process is not known, so its limits cannot be lowered"
            raise OSError(msg)
        lower_limits(self.pid, None if memory is None else size_bytes("memory", memory), cpus)


class SandboxPool:
    """The process's pooled sandboxes, per kernelspec (and user, on a gateway); thread-safe."""

    _instance: ClassVar[SandboxPool | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, loop: BackgroundLoop | None = None) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._plans: dict[PoolKey, PoolPlan] = {}
        self._ready: dict[str, list[PooledSandbox]] = {}
        self._starting: dict[str, int] = {}
        self._fills: dict[str, concurrent.futures.Future[None]] = {}
        self._failed: dict[str, float] = {}
        self._over_budget: set[str] = set()
        self._closed = False
        self._watching: concurrent.futures.Future[None] | None = None  # _let_docker_stop

    @classmethod
    def instance(cls) -> SandboxPool:
        """The process's pool; its sandboxes are removed when the process exits."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
                _at_exit(cls._instance.close)
            return cls._instance

    @property
    def loop(self) -> BackgroundLoop:
        if self._loop is None:
            self._loop = BackgroundLoop.instance()
        return self._loop

    # ------------------------------------------------------------------ asking

    def want(self, plan: PoolPlan) -> None:
        """Keep ``plan.size`` sandboxes of ``plan`` ready (filling in the background). The
        older plan of its kernelspec (for its user) is dropped, its waiting sandboxes removed."""
        with self._lock:
            if self._closed:
                return
            old = self._plans.get(plan.key)
            self._plans[plan.key] = plan
            stale = []
            if old is not None and old.fingerprint != plan.fingerprint:
                stale = self._ready.pop(old.fingerprint, [])
        for sandbox in stale:
            self.loop.submit(self._remove(sandbox))
        self._fill_soon(plan)

    def claim(self, fingerprint: str) -> PooledSandbox | None:
        """A waiting sandbox made from the plan ``fingerprint``, now the caller's alone;
        None when none is ready. The pool refills in the background."""
        with self._lock:
            ready = self._ready.get(fingerprint)
            sandbox = ready.pop(0) if ready else None
            plan = next((p for p in self._plans.values() if p.fingerprint == fingerprint), None)
        if plan is not None:
            self._fill_soon(plan, delay=REFILL_DELAY if sandbox is not None else 0.0)
        return sandbox

    def plan_of(self, kernelspec: str, user: str = "") -> PoolPlan | None:
        """What ``kernelspec``'s pooled sandboxes (for ``user``, on a gateway) are made from
        now, if it has such a pool."""
        with self._lock:
            return self._plans.get((kernelspec, user))

    def ready_for(self, fingerprint: str) -> int:
        """How many sandboxes of the plan ``fingerprint`` wait."""
        with self._lock:
            return len(self._ready.get(fingerprint, []))

    def ready(self, kernelspec: str, user: str = "") -> int:
        """How many sandboxes of ``kernelspec``'s current plan (for ``user``) wait."""
        with self._lock:
            plan = self._plans.get((kernelspec, user))
            return len(self._ready.get(plan.fingerprint, [])) if plan else 0

    def wait_ready(
        self, kernelspec: str, count: int | None = None, timeout: float = 120.0, user: str = ""
    ) -> int:
        """Block until ``count`` (default: the pool's size) sandboxes of ``kernelspec`` (for
        ``user``) wait, or the timeout passes; how many wait."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                plan = self._plans.get((kernelspec, user))
                want = count if count is not None else (plan.size if plan else 0)
                have = len(self._ready.get(plan.fingerprint, [])) if plan else 0
                busy = plan is not None and (
                    self._starting.get(plan.fingerprint, 0) > 0
                    or not self._fills.get(plan.fingerprint, concurrent.futures.Future()).done()
                )
            if have >= want or time.monotonic() >= deadline or not busy:
                return have
            time.sleep(0.05)

    # ------------------------------------------------------------------ filling

    def _fill_soon(self, plan: PoolPlan, delay: float = 0.0) -> None:
        with self._lock:
            if self._closed or plan.size <= 0:
                return
            running = self._fills.get(plan.fingerprint)
            if running is None or running.done():
                running = None
                if time.monotonic() < self._failed.get(plan.fingerprint, 0.0):
                    return
                self._fills[plan.fingerprint] = self.loop.submit(self._fill(plan, delay))
        if running is not None:
            # It may have seen the pool full just before a claim: look again once it ends
            # (outside the lock: a future done meanwhile runs the callback at once).
            running.add_done_callback(lambda _: self._fill_soon(plan, delay))

    def _current(self, plan: PoolPlan) -> bool:
        """Whether ``plan`` is still what its pool is made from (lock held)."""
        current = self._plans.get(plan.key)
        return current is not None and current.fingerprint == plan.fingerprint

    def _reserved(self) -> int:
        """Memory limits of the waiting and starting sandboxes (with the lock held)."""
        by_fingerprint = {p.fingerprint: p.memory for p in self._plans.values()}
        waiting = sum(s.memory for ready in self._ready.values() for s in ready)
        starting = sum(by_fingerprint.get(fp, 0) * n for fp, n in self._starting.items())
        return waiting + starting

    def _kept(self, kernelspec: str) -> int:
        """Sandboxes waiting or starting in the pools of ``kernelspec``, every user's (lock held)."""
        fingerprints = {p.fingerprint for p in self._plans.values() if p.kernelspec == kernelspec}
        return sum(len(self._ready.get(fp, [])) + self._starting.get(fp, 0) for fp in fingerprints)

    async def _fill(self, plan: PoolPlan, delay: float = 0.0) -> None:
        """Start sandboxes one at a time until the plan's size is reached."""
        fingerprint = plan.fingerprint
        await asyncio.sleep(delay)
        while True:
            with self._lock:
                if self._closed or not self._current(plan):
                    return
                plan = self._plans[plan.key]  # the same, with the latest size and budget
                if len(self._ready.get(fingerprint, [])) >= plan.size:
                    return
                over = None
                if self._reserved() + plan.memory > plan.budget:
                    over = "the waiting sandboxes would reserve more than max_pool_memory"
                elif self._kept(plan.kernelspec) >= plan.max_size:
                    over = f"its users' pools keep max_pool_size ({plan.max_size}) sandboxes already"
                if over is not None:
                    if fingerprint not in self._over_budget:
                        self._over_budget.add(fingerprint)
                        log.warning(
                            "Sandbox pool of %s: not starting more, %s; kernels beyond the pool start cold",
                            _named(plan),
                            over,
                        )
                    return
                self._starting[fingerprint] = self._starting.get(fingerprint, 0) + 1
            try:
                sandbox = await self._start(plan)
            except (SandboxKernelError, OSError) as exc:
                log.warning(
                    "Sandbox pool of %s: could not start a sandbox (%s); kernels start cold, "
                    "and the pool tries again in %g s",
                    _named(plan),
                    exc,
                    RETRY_AFTER,
                )
                with self._lock:
                    self._failed[fingerprint] = time.monotonic() + RETRY_AFTER
                return
            finally:
                with self._lock:
                    self._starting[fingerprint] -= 1
            with self._lock:
                keep = not self._closed and self._current(plan)
                if keep:
                    self._ready.setdefault(fingerprint, []).append(sandbox)
            if not keep:
                await self._remove(sandbox)
                return
            log.info("Sandbox pool of %s: sandbox %s ready", _named(plan), sandbox.container_id[:12])
            if sandbox.frozen_pid is not None and (self._watching is None or self._watching.done()):
                self._watching = self.loop.submit(self._let_docker_stop())

    async def _let_docker_stop(self) -> None:
        """While frozen sandboxes wait, thaw and drop any that Docker wants stopped (docker
        stop, a daemon restart: its runsc kill waits for a frozen sandbox, and the daemon
        with it; see :mod:`~sandbox_kernel.host.stopping`)."""
        while True:
            await asyncio.sleep(1.0)
            stopped = await asyncio.to_thread(being_stopped)
            with self._lock:
                waiting = [s for ready in self._ready.values() for s in ready if s.frozen_pid is not None]
                doomed = [s for s in waiting if s.container_id in stopped]
                for fingerprint, ready in self._ready.items():
                    self._ready[fingerprint] = [s for s in ready if s not in doomed]
            for sandbox in doomed:
                log.info("Sandbox pool: Docker is stopping sandbox %s; thawed it", sandbox.container_id[:12])
                await asyncio.to_thread(sandbox.thaw)
                await self._remove(sandbox)
            if self._closed or len(waiting) == len(doomed):
                return

    async def _start(self, plan: PoolPlan) -> PooledSandbox:
        """One sandbox of ``plan``, started and sealed; nothing left behind on failure."""
        spec = plan.spec
        backend = plan.backend
        await backend.check_runtime(spec.runtime)
        await backend.check_image(spec.image)
        key = secrets.token_hex(32).encode()
        runtime_dir = await asyncio.to_thread(new_runtime_dir, plan.runtime_parent)

        def prepare() -> tuple[Path, Path]:
            make_shared(runtime_dir)
            slot = runtime_dir / "slot"
            slot.mkdir(mode=0o755)
            launch_dir = new_launch_dir(runtime_dir, 1, spec.uid, spec.gid)
            owner = (spec.uid, spec.gid)
            ca = None
            if plan.egress is not None:  # the claiming kernel finds it there
                ca = KernelCA.of_kernel(runtime_dir, runtime_dir.name, plan.egress).cert_pem
            write_launch_files(launch_dir, owner, key, plan.scheme, spec.kernelspec, ca)
            return slot, launch_dir

        container_id = None
        try:
            slot, launch_dir = await asyncio.to_thread(prepare)
            pooled = pooled_spec(spec, slot, launch_dir)
            container_id = await backend.create(pooled)
            sockets = expected_sockets(launch_dir, plan.egress is not None, pooled=True)
            await wait_until_ready(backend, container_id, sockets, plan.startup_timeout, spec.image)
            await wait_for_startup_code(
                backend, container_id, launch_dir, plan.startup_timeout, spec.image, plan.startup_code
            )
            if os.getuid() == 0:
                await asyncio.to_thread(seal_launch_dir, launch_dir)
            await asyncio.to_thread((runtime_dir / POOL_READY_FILE).touch)
            # Waiting costs nothing while frozen (an idle gVisor sandbox is not idle).
            pid = await backend.main_pid(container_id)
            frozen = pid is not None and await asyncio.to_thread(freeze, pid, True)
        except BaseException:
            if container_id is not None:
                await backend.remove(container_id)
            await asyncio.to_thread(remove_tree, runtime_dir)
            raise
        return PooledSandbox(
            container_id=container_id,
            runtime_dir=runtime_dir,
            launch_dir=launch_dir,
            slot=slot,
            key=key,
            scheme=plan.scheme,
            memory=plan.memory,
            backend=backend,
            frozen_pid=pid if frozen else None,
            pid=pid,
        )

    async def _remove(self, sandbox: PooledSandbox) -> None:
        try:
            await sandbox.backend.remove(sandbox.container_id)
        except SandboxKernelError as exc:
            log.warning("Sandbox pool: could not remove sandbox %s: %s", sandbox.container_id[:12], exc)
        await asyncio.to_thread(remove_tree, sandbox.runtime_dir)

    async def discard(self, sandbox: PooledSandbox) -> None:
        """Remove a claimed sandbox that could not be bound to its kernel."""
        await self._remove(sandbox)

    # ------------------------------------------------------------------ ending

    def drain(self, timeout: float = 60.0) -> None:
        """Forget every plan and remove every waiting sandbox, blocking (never on an event
        loop's thread; also at the process's exit, when no new thread may start). Kernels
        already claimed are not touched."""
        with self._lock:
            self._plans.clear()
            fills = list(self._fills.values())
        deadline = time.monotonic() + timeout
        # With their plans gone, fills end by themselves, a sandbox they are starting removed
        # once it is up. Cancelled mid-start, one left its container behind: Docker went on
        # creating it in its thread, unknown to the pool.
        concurrent.futures.wait(fills, timeout=timeout)
        for fill in fills:
            fill.cancel()
        while time.monotonic() < deadline:
            with self._lock:
                if not any(self._starting.values()):
                    break
            time.sleep(0.05)
        with self._lock:
            doomed = [s for ready in self._ready.values() for s in ready]
            self._ready.clear()
            self._failed.clear()
            self._over_budget.clear()
        for sandbox in doomed:
            try:
                sandbox.backend.remove_blocking(sandbox.container_id)
            except SandboxKernelError as exc:
                log.warning("Sandbox pool: could not remove sandbox %s: %s", sandbox.container_id[:12], exc)
            remove_tree(sandbox.runtime_dir)

    def close(self) -> None:
        """Remove every waiting sandbox and take no more plans (at the process's exit)."""
        with self._lock:
            self._closed = True
        try:
            self.drain(timeout=10.0)
        except Exception:
            log.exception("Sandbox pool: could not remove its sandboxes; the next start sweeps them")
