"""The ``sandbox-provisioner``: jupyter_client kernel provisioner running IPython in gVisor.

Each kernel gets its own hardened Docker container under the gVisor runtime, with no
network; its ZeroMQ channels are ipc sockets in a per-kernel host folder, relayed to
clients on 127.0.0.1 by a :class:`~sandbox_kernel.bridge.KernelBridge`. See
``shared/notes/provisioner-contract.md`` for the contract this implements.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import secrets
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import zmq
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from jupyter_client.session import Session

from .admission import with_server_config
from .approval import Answer, ApprovalBroker, ApprovalHandler
from .audit import LOST_REPLY, AuditLog, ExecutionAuditor, PendingExecution
from .backend import SandboxBackend
from .background import BackgroundLoop, poll_until
from .binding import bind
from .bridge import CHANNELS, CurveKeys, KernelBridge
from .cgroups import cpu_seconds, memory_usage, oom_kills
from .egress import ApprovalRequest, Decision, EgressPolicy, EgressProxy
from .egress.ca import KernelCA
from .egress.credentials import BoundCredential, CredentialSpec, parse_definitions
from .errors import (
    ConfigurationError,
    DockerUnavailableError,
    KernelTakenOverError,
    PauseError,
    SandboxKernelError,
)
from .launch_folder import (
    expected_sockets,
    new_launch_dir,
    new_runtime_dir,
    seal_launch_dir,
    wait_until_ready,
    write_launch_files,
)
from .limits import size_bytes
from .mounts import can_mount, detach_mounts
from .output import OutputLimiter
from .ownership import (
    NO_HOLDER,
    OWNER_FILE,
    Holder,
    OrphanReaper,
    prune_orphans,
    read_holder,
    remove_tree,
    server_identity,
    write_owner,
    write_released,
    write_state,
)
from .pausing import (
    Paused,
    PauseRequests,
    check_budget,
    checkpoint_name,
    lend_launch_dir,
    wait_for_channels,
    wait_for_egress,
)
from .plan import (
    Launch,
    check_sandbox_env,
    check_settings,
    kernelspec_config,
    narrow_settings,
    plan_sandbox,
    start_policy,
    unpassed_env,
    visible_env,
)
from .pool import PooledSandbox, PoolPlan, SandboxPool
from .sandbox_spec import (
    CONTAINER_EGRESS_SOCKET,
    SandboxSpec,
    is_launcher,
    kernel_sockets,
)
from .sanitize import OutputSanitizer
from .settings import SandboxSettings
from .startup_mark import wait_for_startup_code
from .watchdog import Act, Look, Verdict, Watch, WatchLimits, judge, memory_reason
from .wire import stderr_notice

#: Launch variables a kernel needs again when a reattached manager restarts it.
RELAUNCH_ENV = ("JPY_SESSION_NAME", "JUPYTERHUB_USER")
#: Seconds a client's request (a completion, say) may take, awaiting its reply, before
#: the kernel's CPU counts as computing on its own again.
REQUEST_CPU_CREDIT = 10.0
#: How often a watchdog asks Docker for its kernel's state although the event stream
#: says it runs (seconds).
STATE_CHECK_INTERVAL = 30.0
#: What a kernel's saved state says of its workspace (see ``SandboxProvisioner._layout``).
LAYOUT_KEYS = ("workspace", "workdir", "workspace_path", "volume", "uid", "gid", "workspace_identity")
#: Seconds in a row without the kernel's CPU time before the watchdog says it cannot
#: limit computing outside executions.
CPU_MISSES_TO_WARN = 10
#: How often a live owner touches its kernels' owner files (seconds).
OWNER_TOUCH_INTERVAL = 60.0
#: After a pause the watchdog decided failed (say the disk budget is spent), how long
#: before it tries again (seconds): it is logged, never retried twice a second.
PAUSE_RETRY_INTERVAL = 300.0


def _identity(spec: SandboxSpec) -> list[int] | None:
    """(device, inode) of the host folder a sandbox mounts as its workspace (None: a volume)."""
    if spec.volume is not None:
        return None
    st = os.stat(spec.workspace)
    return [st.st_dev, st.st_ino]


@dataclass(frozen=True)
class LimitStop:
    """A limit (memory, wall-clock, idle) stopped the kernel: which, why, when, which container."""

    ename: str
    reason: str
    time: float
    container_id: str


class SandboxProvisioner(SandboxSettings, KernelProvisionerBase):  # type: ignore[metaclass]  # as upstream
    """Runs each kernel in its own gVisor container and bridges its channels to the host.

    Its settings (traits, validation, ceilings) are :class:`~.settings.SandboxSettings`.
    """

    def __init__(self, **kwargs: Any) -> None:
        # Whatever started the kernel (a server, a program, MCP, the kernelspec's launcher),
        # the server's config files apply under the config its manager was given.
        parent = kwargs.get("parent")
        given = kwargs.pop("config", None)
        kwargs["config"] = with_server_config(given if given is not None else getattr(parent, "config", None))
        super().__init__(**kwargs)
        # The base class declares connection_info as a shared class-level dict.
        self.connection_info: KernelConnectionInfo = {}
        self.container_id: str | None = None
        self.exit_code: int | None = None
        # A server-owned 0700 folder for the provisioner's life, holding one kernel-owned
        # folder per launch (connection file and ipc sockets), mounted into the sandbox.
        self.runtime_dir: Path | None = None
        self.launch_dir: Path | None = None
        self._launches = 0
        # The runtime folder the bridge was made in, once a restart from the pool moved the
        # kernel into its sandbox's (see _bind_pooled): removed when the bridge goes.
        self._bridge_dir: Path | None = None
        self.bridge: KernelBridge | None = None
        self.backend: SandboxBackend = self.backend_class()
        self._spec: SandboxSpec | None = None
        self._curve: CurveKeys | None = None
        self._auditor: ExecutionAuditor | None = None
        self._watchdog: concurrent.futures.Future[None] | None = None
        # The loop of the manager that launched the kernel: restarter calls go there.
        self._manager_loop: asyncio.AbstractEventLoop | None = None
        self._exit_lock = threading.Lock()
        self._exit_noted: str | None = None
        # (container, ename, reason) of a kill the watchdog decided; the cause of the
        # current container's end once noted.
        self._planned_exit: tuple[str, str, str] | None = None
        self._exit_cause: tuple[str, str] | None = None
        self._limit_stop: LimitStop | None = None
        # Of the launch environment, what a relaunch after reattaching needs again.
        self._launch_env: dict[str, str] = {}
        # Signs the provisioner's own messages to clients (notices, replies for the dead).
        self._signer: Session | None = None
        self._egress: EgressPolicy | None = None
        self._egress_ca: KernelCA | None = None
        # What the egress proxy adds to the kernel's requests (see bind_credential); when
        # each configured one ends (its lifetime runs from the kernel's first start); the
        # configured ones revoked (they stay so across restarts).
        self._credentials: list[BoundCredential] = []
        self._credential_expiry: dict[str, float | None] = {}
        self._revoked: set[str] = set()
        self._announced: set[str] = set()  # credentials the audit log says are bound
        #: With approval "egress": called (in a thread of its own) with an ApprovalRequest,
        #: returns "once", "kernel" or "deny"; unset: the client running the cell is asked
        #: on stdin (see sandbox_kernel.approval).
        self.approval_handler: ApprovalHandler | None = None
        self._egress_registered = False
        self._restarter_stopped = False
        self._cwd: str | None = None
        # With a pool_size: what this kernelspec's pooled sandboxes are made from.
        self._pool_plan: PoolPlan | None = None
        self._loaded_layout: dict[str, Any] = {}
        self._host_checked = False
        #: Whether the running kernel's sandbox came from the pool (False: started cold).
        self.from_pool = False
        # What this kernel's start narrowed of the kernelspec's policy (see plan.narrow_settings).
        self._narrowed: dict[str, Any] = {}
        self._sandbox_env: dict[str, str] = {}
        # This manager's token in the kernel's owner file: the one manager driving it.
        self._holder = secrets.token_hex(8)
        self._owner_seen: tuple[int, int] | None = None
        # Set once another process took the kernel over: why this one no longer drives it.
        self.taken_over: str | None = None
        # While the kernel is not running (and nobody restarts it): the error that new
        # executions get at once, instead of waiting for a kernel that is not there.
        self._refusal: tuple[str, str] = ("KernelDied", "the kernel is not running")
        # Pausing (see sandbox_kernel.pausing): pauses, resumes and signals take turns, on
        # the background loop. While a pause or resume is under way, or the kernel is
        # paused, its stopped container is not its end.
        self._paused: Paused | None = None
        self._pending_pause: Paused | None = None  # what a pause under way will be
        self._pausing = False
        self._pause_lock: asyncio.Lock | None = None
        self._wake_due: str | None = None  # what woke the kernel meanwhile
        self._next_auto_pause = 0.0
        self._workspace_identity: list[int] | None = None

    # ------------------------------------------------------------------ launch

    @property
    def has_process(self) -> bool:
        return self.container_id is not None

    @property
    def limit_stop(self) -> LimitStop | None:
        """The last time a limit stopped this kernel, kept across restarts (Jupyter may
        restart it within a second, before anyone asks), or None."""
        return self._limit_stop

    @property
    def kernel_name(self) -> str:
        return str(getattr(self.parent, "kernel_name", "") or getattr(self.kernel_spec, "name", "") or "")

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Check the settings and the Docker host, and plan the sandbox (see :mod:`~.plan`).

        Raises:
            ConfigurationError, WorkspaceError: the kernelspec or a setting is invalid.
            DockerUnavailableError, RuntimeMissingError, ImageNotFoundError: the host
                is not ready; each message says how to fix it.
        """
        if await asyncio.to_thread(self._held_elsewhere_now):
            msg = f"Sandboxed kernel {self.kernel_id}: {self.taken_over}"
            raise KernelTakenOverError(msg)
        check_settings(self, kernelspec_config(self.kernel_spec), self.kernel_name)
        self._narrowed = start_policy(kwargs)
        narrow_settings(self, self._narrowed, self.kernel_name)
        self._curve = self._curve_keys(kwargs.pop("transport_encryption", None))
        cwd = Path(kwargs.get("cwd") or os.getcwd())
        # As jupyter_client's: without an env, the launch environment is the process's.
        env = kwargs.get("env")
        launch = Launch(
            kernel_id=str(self.kernel_id),
            kernel_name=self.kernel_name,
            argv=self.kernel_spec.argv,
            cwd=cwd,
            env=dict(os.environ) if env is None else env,
            extra_arguments=kwargs.pop("extra_arguments", []),
            owner=server_identity(),
            scope=str(getattr(getattr(self.parent, "parent", None), "adoption_scope", "")),
            server_root=self._server_root(),
        )
        self._launch_env = {k: v for k, v in launch.env.items() if k in RELAUNCH_ENV}
        self._sandbox_env = check_sandbox_env(kwargs.pop("sandbox_env", None))
        dropped = unpassed_env(self, launch.env)
        if dropped:
            warnings.warn(
                f"start_kernel(env=...) sets {', '.join(dropped)}, which do not reach the sandboxed "
                f"kernel: only the kernelspec's pass_env names ({', '.join(self.pass_env)}) pass from "
                "the launch environment, so that no secret comes along. Set variables in the sandbox "
                "with start_kernel(sandbox_env={...}) (the session API's env=) or the kernelspec's env.",
                stacklevel=2,
            )
        kwargs["env"] = {**visible_env(self, launch.env), **self._sandbox_env}
        kwargs = await super().pre_launch(**kwargs)  # fills the kernelspec's env templates
        plan = plan_sandbox(self, launch, kwargs["env"], [*self.kernel_spec.env, *self._sandbox_env])
        for warning in plan.warnings:
            self.log.warning("%s", warning)
        self._spec, self._egress = plan.spec, plan.egress
        # Read on the host now: a missing token fails the start before any sandbox exists.
        self._credentials = self._bound_credentials(plan.credentials)
        kwargs["cmd"] = plan.spec.command
        self._cwd = str(cwd)
        # A pooled sandbox has the kernelspec's policy and environment, nothing of one start's.
        own = self._narrowed or self._sandbox_env
        self._pool_plan = None if own else self._plan_pool(self._spec)
        self._host_checked = False
        if self._pool_plan is None or not SandboxPool.instance().ready_for(self._pool_plan.fingerprint):
            # A pooled sandbox was made on a host checked then; a cold start checks now.
            await self._check_host()
        await self._sweep_orphans_once()
        return kwargs

    def _server_root(self) -> Path | None:
        """The Jupyter server's root folder (its kernel manager's ``root_dir``), or None
        for a kernel that no server starts (a KernelManager of its own, the session API)."""
        server = getattr(self.parent, "parent", None)
        root = getattr(server, "root_dir", None) if hasattr(server, "cwd_for_path") else None
        return Path(root) if isinstance(root, str) and root else None

    async def _check_host(self) -> None:
        """The gVisor runtime (with our flags) and the image are there; once per launch."""
        if not self._host_checked:
            await self.backend.check_runtime(self.docker_runtime)
            await self.backend.check_image(self.image)
            self._host_checked = True

    _warned_pool_needs_root = False

    def _plan_pool(self, spec: SandboxSpec) -> PoolPlan | None:
        """With a pool_size: the kernelspec's pool plan, handed to the process's pool
        (which starts filling it in the background)."""
        if self.pool_size <= 0:
            return None
        if not can_mount():
            if not SandboxProvisioner._warned_pool_needs_root:
                SandboxProvisioner._warned_pool_needs_root = True
                self.log.warning(
                    "pool_size=%d of kernelspec %r is ignored: attaching a workspace to a running "
                    "sandbox is a mount, which needs a server running as root. Kernels start cold.",
                    self.pool_size,
                    self.kernel_name,
                )
            return None
        km = self.parent
        plan = PoolPlan(
            spec=spec,
            size=self.pool_size,
            scheme=km.session.signature_scheme if km is not None else "hmac-sha256",
            egress=None if self._egress is None else self._egress.rules,
            startup_timeout=self.startup_timeout,
            startup_code=is_launcher(self.kernel_spec.argv),
            runtime_parent=self.runtime_parent,
            budget=size_bytes("max_pool_memory", self.max_pool_memory),
            backend=self.backend,
        )
        SandboxPool.instance().want(plan)
        return plan

    _swept_orphans = False

    async def _sweep_orphans_once(self) -> None:
        """Remove kernels left by servers that died (once per server process)."""
        if SandboxProvisioner._swept_orphans:
            return
        SandboxProvisioner._swept_orphans = True
        try:
            await prune_orphans(self.backend, self.runtime_parent)
        except SandboxKernelError as exc:
            self.log.warning("Could not remove orphaned sandboxed kernels: %s", exc)

    def _curve_keys(self, transport_encryption: str | None) -> CurveKeys | None:
        """The CurveZMQ keypair for the client-facing sockets, if the client asked for it.

        Mirrors LocalProvisioner: keys live on the manager and survive restarts. The
        bridge terminates Curve; inside the sandbox the channels are local ipc sockets.
        """
        km = self.parent
        if km is None or not hasattr(km, "_transport_encryption_policy"):
            return None
        policy = km._transport_encryption_policy(transport_encryption)
        if policy == "disabled":
            return None
        if policy == "auto" and not km._kernel_supports_curve_encryption():
            return None
        if km.curve_publickey is None:
            km.curve_publickey, km.curve_secretkey = zmq.curve_keypair()
        return CurveKeys(public=km.curve_publickey, secret=km.curve_secretkey)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start the kernel's container and the bridge; return the client-side connection.

        Raises:
            KernelStartupError: the kernel exited or never opened its channels; carries
                the container's last output. Nothing is left behind.
        """
        if self._spec is None:
            msg = "launch_kernel() called before pre_launch()"
            raise RuntimeError(msg)
        key, scheme = self._session_key()
        restart = self.bridge is not None
        pooled = None
        # A restart keeps the session key clients already use: its kernel is handed it.
        handed_key = key if self.connection_info else None
        if self._pool_plan is not None and (handed_key is None or self._egress is None):
            # A restart claims too, but for network "allowlist": the egress proxy keeps the
            # kernel's own CA, which its sandbox must trust.
            pooled = SandboxPool.instance().claim(self._pool_plan.fingerprint)
            if pooled is None:
                self.log.info(
                    "Sandboxed kernel %s: no pooled sandbox of %s ready; starting one cold",
                    self.kernel_id,
                    self.kernel_name,
                )
        self.exit_code = None
        self._exit_cause = None
        try:
            if pooled is not None and await self._bind_pooled(self._spec, pooled, handed_key):
                if handed_key is None:
                    # The manager adopts the sandbox's key (fresh, and nobody else's), as
                    # when reattaching: jupyter_client loads it from the connection info.
                    key, scheme = pooled.key, pooled.scheme
                    self.connection_info = {"key": key, "signature_scheme": scheme}  # type: ignore[typeddict-item]
                launch_dir, container_id = pooled.launch_dir, pooled.container_id
                BackgroundLoop.instance().submit(self._rename(container_id, self._spec.container_name))
            else:
                launch_dir, container_id = await self._start_cold(self._spec, key, scheme)
            self._workspace_identity = await asyncio.to_thread(_identity, self._spec)
            if not self.from_pool:  # a pooled sandbox was ready and sealed before its claim
                sockets = expected_sockets(launch_dir, self._egress is not None, pooled=False)
                await wait_until_ready(self.backend, container_id, sockets, self.startup_timeout, self.image)
                # Sealing only then: the folder is never out of its reach while IPython reads the code.
                await wait_for_startup_code(
                    self.backend,
                    container_id,
                    launch_dir,
                    self.startup_timeout,
                    self.image,
                    required=is_launcher(self.kernel_spec.argv),
                )
                await asyncio.to_thread(self._seal, launch_dir)
            # Clients' ports open once the kernel answers on them: a client that connects as
            # soon as they do (as front ends that start kernels themselves do) is answered.
            ports = await self._attach_bridge(launch_dir, self._manager_ports())
            await self._open_egress(launch_dir)
            self._reopen()
            self._start_watchdog(container_id)
            self._audit_start(container_id, restart)
        except BaseException as exc:
            try:
                await self._teardown(keep_bridge=False)
            except SandboxKernelError:
                pass  # logged; the start's own error is the one to report
            if self._auditor is not None:  # a restart that failed: nothing runs to answer
                self._refuse("KernelDied", f"the kernel could not be started again: {exc}")
            raise
        info: dict[str, Any] = {
            "transport": self.bridge.transport if self.bridge else self.client_transport,
            "ip": self.bridge.ip if self.bridge else "127.0.0.1",
            **{f"{channel}_port": port for channel, port in ports.items()},
            "key": key,
            "signature_scheme": scheme,
            "kernel_name": self.kernel_name,
        }
        if self._curve is not None:
            info["curve_publickey"] = self._curve.public.decode("ascii")
            info["curve_secretkey"] = self._curve.secret.decode("ascii")
        self.connection_info = info  # type: ignore[assignment]
        if self.runtime_dir is not None:
            await asyncio.to_thread(write_owner, self.runtime_dir, self._holder)
        await self._save_state()
        return self.connection_info

    def audit(self, event: str, **details: Any) -> None:
        """Write a line to the kernel's audit log for what the host did to it (the session
        API's files, say), with this process's identity."""
        if self._auditor is not None:
            self._auditor.lifecycle(event, owner=server_identity(), server_uid=os.getuid(), **details)

    def _audit_start(self, container_id: str, restart: bool) -> None:
        """The audit log's line for a (re)start: which sandbox, for whom, started by which process."""
        if self._auditor is None or self._spec is None:
            return
        self._auditor.lifecycle(
            "restart" if restart else "start",
            container=container_id[:12],
            image=self._spec.image,
            runtime=self._spec.runtime,
            uid=self._spec.uid,
            workspace=str(self._spec.workspace),
            pooled=self.from_pool,
            owner=server_identity(),
            server_uid=os.getuid(),
        )

    async def _start_cold(self, plan: SandboxSpec, key: bytes, scheme: str) -> tuple[Path, str]:
        """Create and start a container for this kernel: (its launch folder, its id)."""
        await self._check_host()
        if self.runtime_dir is None or not self.runtime_dir.is_dir():
            self.runtime_dir = await asyncio.to_thread(new_runtime_dir, self.runtime_parent)
        self._launches += 1
        launch_dir = await asyncio.to_thread(
            new_launch_dir, self.runtime_dir, self._launches, plan.uid, plan.gid
        )
        self.launch_dir = launch_dir
        self.from_pool = False
        spec = replace(plan, runtime_dir=launch_dir)
        ca = await self._kernel_ca()
        await asyncio.to_thread(
            write_launch_files,
            launch_dir,
            (spec.uid, spec.gid),
            key,
            scheme,
            self.kernel_name,
            ca.cert_pem if ca is not None else None,
        )
        await self.backend.prepare_workspace(spec)
        self.container_id = await self.backend.create(spec)
        self.log.info(
            "Sandboxed kernel %s: container %s (image %s, runtime %s, uid %d, workspace %s)",
            self.kernel_id,
            self.container_id[:12],
            spec.image,
            spec.runtime,
            spec.uid,
            spec.workspace,
        )
        return launch_dir, self.container_id

    async def _bind_pooled(self, spec: SandboxSpec, sandbox: PooledSandbox, key: bytes | None = None) -> bool:
        """Make a claimed pooled sandbox this kernel's (see :mod:`~.binding`), its runtime
        folder the kernel's; on a restart (``key``: the session key its clients hold) the
        kernel is handed that key. False (and the sandbox removed) if that fails: the kernel
        then starts cold."""
        restart = key is not None and self.runtime_dir is not None
        if not restart:
            self.runtime_dir, self._launches = sandbox.runtime_dir, 1
        self.launch_dir, self.container_id = sandbox.launch_dir, sandbox.container_id
        try:
            await bind(self.backend, sandbox, spec, key)
        except (SandboxKernelError, OSError) as exc:
            self.log.warning(
                "Sandboxed kernel %s: could not bind pooled sandbox %s (%s); starting one cold",
                self.kernel_id,
                sandbox.container_id[:12],
                exc,
            )
            self.container_id = self.launch_dir = None
            if not restart:
                self.runtime_dir, self._launches = None, 0
            await SandboxPool.instance().discard(sandbox)
            return False
        if restart:
            # The sandbox's runtime folder becomes the kernel's (its container's labels name
            # it); the bridge's stays until the bridge goes, one a previous restart claimed now.
            previous, self.runtime_dir, self._launches = self.runtime_dir, sandbox.runtime_dir, 1
            self._bridge_dir = self._bridge_dir or previous
            if previous is not None and previous != self._bridge_dir:
                await asyncio.to_thread(remove_tree, previous)
        self._spec = replace(spec, runtime_dir=sandbox.launch_dir)
        self.from_pool = True
        self.log.info(
            "Sandboxed kernel %s: pooled sandbox %s (image %s, uid %d, workspace %s at %s)",
            self.kernel_id,
            sandbox.container_id[:12],
            spec.image,
            spec.uid,
            spec.workspace,
            spec.workspace_path,
        )
        return True

    async def _rename(self, container_id: str, name: str) -> None:
        """Name a claimed pooled sandbox after its kernel (for `docker ps`); in the
        background: the kernel's saved state already says whose it is."""
        try:
            await self.backend.rename(container_id, name)
        except SandboxKernelError as exc:
            self.log.warning("Sandboxed kernel %s: %s", self.kernel_id, exc)

    async def _kernel_ca(self) -> KernelCA | None:
        """With network "allowlist": the kernel's egress CA, kept in its runtime folder
        (a pooled sandbox's was made with it; a restart or a reattach finds it there)."""
        if self._egress is None or self.runtime_dir is None:
            return None
        if self._egress_ca is None:
            self._egress_ca = await asyncio.to_thread(
                KernelCA.of_kernel, self.runtime_dir, str(self.kernel_id), self._egress.rules
            )
        return self._egress_ca

    async def _open_egress(self, launch_dir: Path) -> None:
        """With network "allowlist": have the host's egress proxy dial this kernel's relay."""
        if self._egress is None:
            return
        proxy = EgressProxy.instance()
        socket_path = launch_dir / Path(CONTAINER_EGRESS_SOCKET).name
        ca = await self._kernel_ca()
        await asyncio.to_thread(
            proxy.add_kernel,
            str(self.kernel_id),
            socket_path,
            self._egress,
            self._on_egress,
            ca,
            self._credentials,
            self._approver(),
        )
        self._egress_registered = True
        for credential in self._credentials:
            if self._auditor is not None and credential.name not in self._announced:
                self._auditor.credential("bound", credential)  # once, not at every restart
                self._announced.add(credential.name)

    def _approver(self) -> Callable[[ApprovalRequest], concurrent.futures.Future[Answer]] | None:
        """With approval "egress": what the egress proxy asks, each answer (or its absence)
        an audit line."""
        auditor, signer, bridge = self._auditor, self._signer, self.bridge
        if self._egress is None or self._egress.approval != "egress" or auditor is None:
            return None
        if signer is None or bridge is None:
            return None
        broker = ApprovalBroker(
            str(self.kernel_id),
            auditor,
            signer,
            partial(bridge.inject, "stdin"),
            lambda: self.approval_handler,
        )
        auditor.on_stdin = broker.on_stdin

        def ask(request: ApprovalRequest) -> concurrent.futures.Future[Answer]:
            asked = time.monotonic()
            future = broker.ask(request)

            def record(done: concurrent.futures.Future[Answer]) -> None:
                answer, by = ("deny", "timeout") if done.cancelled() else done.result()
                auditor.approval(request.host, request.port, answer, by, time.monotonic() - asked)

            future.add_done_callback(record)
            return future

        return ask

    def _bound_credentials(self, specs: tuple[CredentialSpec, ...]) -> list[BoundCredential]:
        """The configured credentials, values read now (a restart picks up a rotated file),
        each ending when it first would; then those a program bound, as they were.

        Raises:
            ConfigurationError: a value cannot be read.
        """
        program = {c.name: c for c in self._credentials if c.by == "api"}
        bound = []
        for spec in specs:
            if spec.name in program or spec.name in self._revoked:
                continue
            credential = BoundCredential.bind(spec, expires_at=self._credential_expiry.get(spec.name))
            self._credential_expiry.setdefault(spec.name, credential.expires_at)
            bound.append(credential)
        return [*bound, *program.values()]

    def bind_credential(self, name: str, domains: list[str], headers: dict[str, str], ttl: float = 0) -> None:
        """Have the egress proxy add ``headers`` to this kernel's requests to ``domains``
        from now on (and after restarts), for ``ttl`` seconds (0: as long as the kernel
        runs), replacing a credential of that name. The kernel never holds the values.

        A header's value is text, in which ``{env:NAME}`` and ``{file:/path}`` are read in
        this process: ``{"Authorization": "Bearer {env:WAREHOUSE_TOKEN}"}``. Call it from
        any thread; it blocks briefly.

        Raises:
            ConfigurationError: the kernel is not running with network "allowlist", the
                domains are not all allowed to it, or a value cannot be read.
        """
        (spec,) = parse_definitions(
            {name: {"domains": domains, "headers": headers, "ttl": ttl}}, "bind_credential"
        ).values()
        if self._egress is None or not self._egress_registered:
            msg = (
                f"bind_credential({name!r}): kernel {self.kernel_id} is not running with network 'allowlist'"
            )
            raise ConfigurationError(msg)
        outside = spec.rules.uncovered_by(self._egress.rules)
        if outside:
            msg = (
                f"bind_credential({name!r}): {outside} are not in the kernel's allowed_domains "
                f"({list(self._egress.rules.patterns)!r}); a credential never widens egress."
            )
            raise ConfigurationError(msg)
        credential = BoundCredential.bind(spec, by="api")
        EgressProxy.instance().bind_credential(str(self.kernel_id), credential)
        self._revoked.discard(name)
        BackgroundLoop.instance().submit(self._save_state())  # for a process that reattaches
        self._credentials = [c for c in self._credentials if c.name != name] + [credential]
        if self._auditor is not None:
            self._auditor.credential("bound", credential)
            self._announced.add(name)

    def revoke_credential(self, name: str) -> bool:
        """Stop adding the credential ``name`` to this kernel's requests, at once (open
        connections included); whether it was bound. Call it from any thread."""
        kept = [c for c in self._credentials if c.name != name]
        revoked = [c for c in self._credentials if c.name == name]
        self._credentials = kept
        self._revoked.add(name)
        self._announced.discard(name)
        BackgroundLoop.instance().submit(self._save_state())  # a reattach keeps it revoked
        found = self._egress_registered and EgressProxy.instance().revoke_credential(
            str(self.kernel_id), name
        )
        if revoked and self._auditor is not None:
            self._auditor.credential("revoked", revoked[0])
        return bool(found or revoked)

    async def _close_egress(self) -> None:
        if self._egress_registered:
            self._egress_registered = False
            await asyncio.to_thread(EgressProxy.instance().remove_kernel, str(self.kernel_id))

    def _on_egress(self, decision: Decision) -> None:
        """One verdict of the egress proxy (its thread): into the audit log and the server's log."""
        logged = self._auditor.egress(decision) if self._auditor is not None else True
        if logged and decision.get("verdict") != "allowed":
            self.log.info(
                "Sandboxed kernel %s: egress to %s:%s denied (%s)",
                self.kernel_id,
                decision.get("host"),
                decision.get("port"),
                decision.get("reason"),
            )

    def _reopen(self) -> None:
        """A kernel runs again: accept requests, restart the idle clock and Jupyter's restarter."""
        if self._auditor is not None:
            self._auditor.refuse(None)
        km = self.parent
        if self._restarter_stopped and km is not None and hasattr(km, "start_restarter"):
            km.start_restarter()
        self._restarter_stopped = False

    @staticmethod
    def _seal(launch_dir: Path) -> None:
        """Once the kernel has bound its sockets, stop it adding or swapping entries, and
        drop whatever it made there before: nothing it left may stay writable to it.

        Only a root server can hand the folder back to itself; otherwise the kernel
        shares the server's uid and could undo any change.

        Raises:
            KernelStartupError: one of the kernel's sockets is not a socket.
        """
        if os.getuid() == 0:
            seal_launch_dir(launch_dir)

    async def _attach_bridge(
        self, launch_dir: Path, ports: dict[str, int] | None = None, ip: str | None = None
    ) -> dict[str, int]:
        """Connect the bridge to this launch's sockets; create it on the first launch.

        ``ports`` and ``ip`` are the client-facing addresses to bind again (reattaching);
        an ipc ``ip`` must lie in this kernel's runtime folder.

        Raises:
            zmq.ZMQError: an address is taken.
        """
        endpoints = {channel: f"ipc://{path}" for channel, path in kernel_sockets(launch_dir).items()}
        if self.bridge is None:
            if self._auditor is None:
                log_file = (
                    AuditLog.open(self.audit_log, self.audit_log_max_bytes, self.audit_log_backups)
                    if self.audit_log
                    else None
                )
                self._auditor = ExecutionAuditor(log_file, str(self.kernel_id), self.kernel_name)
                self._auditor.on_refused = self._refuse_execution
                self._auditor.on_lost = self._answer_lost_reply
            km = self.parent
            key, scheme = self._session_key()
            limiter = sanitizer = None
            if km is not None:
                self._signer = Session(key=key, signature_scheme=scheme)
                limiter = OutputLimiter(
                    size_bytes("output_limit", self.output_limit), self._signer, self._current_execution
                )
            if self.safe_output:
                sanitizer = OutputSanitizer(self._signer or Session(key=key, signature_scheme=scheme))
            if self.client_transport == "ipc":
                if ip is None or self.runtime_dir is None or Path(ip).parent != self.runtime_dir:
                    ip = str(self.runtime_dir / "client") if self.runtime_dir else None
            else:
                ip = "127.0.0.1"
            if ip is None:
                msg = "the kernel's runtime folder is not set up"
                raise RuntimeError(msg)
            self.bridge = KernelBridge(
                endpoints,
                ip=ip,
                ports=ports,
                curve=self._curve,
                tap=self._auditor,
                output_limiter=limiter,
                sanitizer=sanitizer,
                transport=self.client_transport,
                key=key,
                signature_scheme=scheme,
                meter_folder=self.runtime_dir,
            )
            self.bridge.on_wake = self._wake
            return self.bridge.start()
        await asyncio.to_thread(self.bridge.attach, endpoints)
        return self.bridge.ports

    def _manager_ports(self) -> dict[str, int] | None:
        """The ports the manager already has for the kernel's channels, read from a
        connection file someone else wrote (see sandbox_kernel.launch), which the bridge
        must serve; None: the bridge chooses (and the manager learns them from it)."""
        km = self.parent
        ports = {channel: int(getattr(km, f"{channel}_port", 0) or 0) for channel in CHANNELS}
        if self.bridge is not None or not all(ports.values()):
            return None
        transport = getattr(km, "transport", "tcp")
        if transport != self.client_transport:
            msg = (
                f"The connection file asks for transport {transport!r}, but this server's "
                f"SandboxProvisioner.client_transport is {self.client_transport!r}."
            )
            raise ConfigurationError(msg)
        return ports

    def _session_key(self) -> tuple[bytes, str]:
        """The kernel's session key and signature scheme: the running kernel's own when
        reattaching (its manager may not know it yet), else the manager's."""
        info: dict[str, Any] = dict(self.connection_info)
        if info.get("key"):
            key = info["key"]
            return (key if isinstance(key, bytes) else str(key).encode()), str(
                info.get("signature_scheme", "hmac-sha256")
            )
        km = self.parent
        if km is None:
            return b"", "hmac-sha256"
        return km.session.key, km.session.signature_scheme

    def _spare_client_ip(self) -> str | None:
        """An ipc prefix in the runtime folder that no other bridge of this kernel uses."""
        if self.client_transport != "ipc" or self.runtime_dir is None:
            return None
        return str(self.runtime_dir / f"client-{secrets.token_hex(3)}")

    def _current_execution(self) -> tuple[str, dict[str, Any]] | None:
        """For the output cap: the request the host knows is running (bridge thread)."""
        execution = self._auditor.current() if self._auditor is not None else None
        if execution is None:
            return None
        return str(execution.header.get("msg_id", "")), execution.header

    def _start_watchdog(self, container_id: str) -> None:
        """Watch the kernel; while this process watches kernels, it also removes those of
        owners that died (see :class:`~.ownership.OrphanReaper`)."""
        self._manager_loop = asyncio.get_running_loop()
        self._watchdog = BackgroundLoop.instance().submit(self._watch(container_id))
        if self.runtime_dir is not None:
            OrphanReaper.instance().watch(self.runtime_dir.parent)

    async def _watch(self, container_id: str) -> None:
        """The kernel's watchdog, on the background loop (whether or not its manager's
        loop runs): looks at the kernel, has :func:`~.watchdog.judge` decide, and acts.
        It tells waiting clients when the kernel dies, enforces the idle limit, and
        backs up the in-kernel wall-clock limit: interrupt, then kill.

        A failing step is logged and retried: a watchdog never gives up while its kernel runs.
        """
        watch = Watch()
        limits = WatchLimits(
            self.exec_timeout, self.exec_kill_grace, self.idle_timeout, self.memory, self.pause_after
        )
        self.backend.watch_exits(container_id)
        try:
            await self._watch_loop(container_id, watch, limits)
        finally:
            self.backend.unwatch_exits(container_id)

    async def _watch_loop(self, container_id: str, watch: Watch, limits: WatchLimits) -> None:
        pid: int | None = None
        next_deep = next_state = 0.0
        next_touch = time.monotonic() + OWNER_TOUCH_INTERVAL
        docker_lost = cpu_unknown = False
        cpu_misses = 0
        requests = PauseRequests(self.runtime_dir) if self.runtime_dir is not None else None
        while self.container_id == container_id and self._auditor is not None:
            await asyncio.sleep(0.5)
            auditor = self._auditor
            if auditor is None:
                return
            try:
                holder = self._holder_elsewhere()  # a stat, a read only when it changed
                if holder is not None:
                    await self._let_go(holder)
                    return
                if requests is not None:
                    await requests.answer(self._pause, self._resume)  # a stat, unless one came
                if self._suspended:
                    pid, watch.oom_baseline = None, None  # the resumed sandbox is a new process
                    continue
                now = time.monotonic()
                look = Look(now, running=auditor.running(), idle_for=auditor.idle_for())
                if now >= next_deep:
                    next_deep = now + 1.0
                    if not pid:  # Docker says 0 for a sandbox not (yet) running
                        pid = await self.backend.main_pid(container_id) or None
                    code = None
                    if not self.backend.surely_running(container_id) or now >= next_state:
                        # Docker's event stream says when it ends; ask now and then anyway.
                        next_state = now + STATE_CHECK_INTERVAL
                        _, code = await self.backend.state(container_id)
                    docker_lost = False
                    bridge = self.bridge
                    busy = auditor.current() is not None or (
                        bridge is not None and bridge.requests_in_flight(REQUEST_CPU_CREDIT)
                    )
                    # The CPU bounds computing outside executions only with a wall-clock limit.
                    cpu = cpu_seconds(pid) if pid is not None and limits.exec_timeout > 0 else None
                    if cpu is None and limits.exec_timeout > 0:
                        # Perhaps a process of the sandbox's start that is gone: look again.
                        pid, cpu_misses = None, cpu_misses + 1
                    else:
                        cpu_misses = 0
                    if cpu_misses >= CPU_MISSES_TO_WARN and not cpu_unknown:
                        cpu_unknown = True
                        self.log.warning(
                            "Sandboxed kernel %s: cannot read its CPU time from the host's cgroup; computing "
                            "outside executions is not limited (exec_timeout still bounds each execution)",
                            self.kernel_id,
                        )
                    kills = oom_kills(pid) if pid is not None else None
                    look = replace(look, deep=True, exit_code=code, cpu=cpu, oom_kills=kills, busy=busy)
                    if now >= next_touch and self.runtime_dir is not None:
                        # A persistent kernel's time-to-live counts from the last touch.
                        next_touch = now + OWNER_TOUCH_INTERVAL
                        await asyncio.to_thread(os.utime, self.runtime_dir / OWNER_FILE)
                if await self._act(container_id, judge(look, watch, limits), look):
                    return
            except DockerUnavailableError as exc:
                # dockerd restarting, say: keep watching once it is back.
                if not docker_lost:
                    self.log.warning("Sandboxed kernel %s: %s; retrying", self.kernel_id, exc)
                docker_lost, next_deep = True, time.monotonic() + 2.0
            except Exception:
                self.log.exception("Sandboxed kernel %s: watchdog step failed; retrying", self.kernel_id)
                await asyncio.sleep(2.0)

    def _holder_elsewhere(self) -> Holder | None:
        """Whoever took this kernel over (another process or manager), or None while this
        manager holds it. Reads the owner file only when it changed."""
        if self.runtime_dir is None:
            return None
        try:
            st = (self.runtime_dir / OWNER_FILE).stat()
        except OSError:
            return None
        seen = (st.st_ino, st.st_mtime_ns)
        if seen == self._owner_seen:
            return None
        holder = read_holder(self.runtime_dir)
        if holder is None or (holder.identity == server_identity() and holder.token in ("", self._holder)):
            self._owner_seen = seen
            return None
        return holder

    def _lose(self, holder: Holder) -> Path | None:
        """The kernel is another's now: forget its container and folders at once (nothing
        here may remove or signal them from now on), refuse executions with the reason.
        Returns the runtime folder that was this manager's."""
        runtime_dir = self.runtime_dir
        self.container_id = None
        self.runtime_dir = self.launch_dir = None
        reason = (
            f"this kernel was taken over by {holder}, which drives it now; this program no longer "
            "does (reattach with take_over=True to take it back)"
        )
        self.taken_over = reason
        self.log.warning("Sandboxed kernel %s: taken over by %s; letting go", self.kernel_id, holder)
        self._refuse("KernelTakenOver", reason)
        return runtime_dir

    def _refuse(self, ename: str, reason: str) -> None:
        """From now on, answer every new execution with ``ename``: ``reason`` at once and
        pass it on to no kernel (until :meth:`_reopen` or a restart's cleanup)."""
        self._refusal = (ename, reason)
        if self._auditor is not None:
            self._auditor.refuse(reason)

    def _held_elsewhere_now(self) -> bool:
        """Before anything that removes, signals or relaunches the kernel: if another holder
        took it over (say while this manager's watchdog was not running), let go instead."""
        if self.taken_over is not None:
            return True
        if self.runtime_dir is None:
            return False
        self._owner_seen = None  # read it now, changed or not
        holder = self._holder_elsewhere()
        if holder is None:
            return False
        runtime_dir = self._lose(holder)
        if runtime_dir is not None:
            write_released(runtime_dir, holder.token)
        return True

    async def _let_go(self, holder: Holder) -> None:
        """Another process took the kernel over (see :mod:`~.reattach`): stop driving it.
        Its container runs on, untouched; this manager's clients get an error at once
        for every execution, and the kernel's output no longer reaches them."""
        runtime_dir = self._lose(holder)
        self._answer_pending("KernelTakenOver", self._refusal[1])
        await asyncio.sleep(0.1)  # let the bridge send the answers before it moves
        await self._close_egress()
        if self.bridge is not None and runtime_dir is not None:
            # Relay to nowhere: requests still reach the auditor, which answers them.
            nowhere = runtime_dir / f"let-go-{self._holder}"
            await asyncio.to_thread(self.bridge.attach, {c: f"ipc://{nowhere}-{c}" for c in CHANNELS})
        km, loop = self.parent, self._manager_loop
        if km is not None and hasattr(km, "stop_restarter") and loop is not None:
            loop.call_soon_threadsafe(km.stop_restarter)  # nothing here to restart
        if runtime_dir is not None:
            await asyncio.to_thread(write_released, runtime_dir, holder.token)

    async def _act(self, container_id: str, verdict: Verdict, look: Look) -> bool:
        """Carry out the watchdog's verdict; True once the kernel has ended."""
        if verdict.act is Act.NOTHING:
            return False
        if verdict.act is Act.EXITED:
            if self._suspended:
                return False  # stopped for a pause meanwhile: not its end
            await self._note_exit(container_id, look.exit_code if look.exit_code is not None else 255)
            return True
        if verdict.act is Act.PAUSE:
            if time.monotonic() >= self._next_auto_pause:
                try:
                    await self._pause(f"idle: {verdict.why}")
                except PauseError as exc:
                    self._next_auto_pause = time.monotonic() + PAUSE_RETRY_INTERVAL
                    self.log.warning("Sandboxed kernel %s: %s", self.kernel_id, exc)
            return False
        if verdict.act is Act.INTERRUPT:
            self.log.warning("Sandboxed kernel %s: %s; interrupting", self.kernel_id, verdict.why)
            await self.backend.signal(container_id, signal.SIGINT)
            return False
        if verdict.act is Act.STOP_IDLE:
            # The auditor decides atomically: a request that came meanwhile wins. What
            # later requests are told is set first, so none meets the refusal without it.
            self._refusal = (
                "IdleLimitExceeded",
                f"the kernel was stopped after {self.idle_timeout:g} s without executions (idle_timeout); "
                "restart the kernel to run code again",
            )
            if self._auditor is None or not self._auditor.refuse_if_idle(self.idle_timeout, verdict.reason):
                return False
            await self._stop_idle_kernel(container_id, verdict.reason)
            return True
        self.log.warning("Sandboxed kernel %s %s; killing it", self.kernel_id, verdict.why)
        await self._kill_for(container_id, verdict.ename, verdict.reason)
        return True

    async def _kill_for(self, container_id: str, ename: str, reason: str) -> None:
        """Kill the kernel deliberately; its waiting clients get ``ename``: ``reason``."""
        self._planned_exit = (container_id, ename, reason)
        await self.backend.signal(container_id, signal.SIGKILL)
        await self._wait_exited(container_id)
        _, code = await self.backend.state(container_id)
        await self._note_exit(container_id, 137 if code is None else code)

    async def _stop_idle_kernel(self, container_id: str, reason: str) -> None:
        """Stop a kernel idle past its limit, for good: Jupyter must not restart it.

        New requests are already refused; clients are told now, and later requests get
        an error reply until a restart.
        """
        self.log.warning("Sandboxed kernel %s: idle for %g s; stopping it", self.kernel_id, self.idle_timeout)
        km, loop = self.parent, self._manager_loop
        if km is not None and hasattr(km, "stop_restarter") and loop is not None:
            loop.call_soon_threadsafe(km.stop_restarter)
            self._restarter_stopped = True
            await asyncio.sleep(0.5)  # before the kill, or the restarter may see it first
        bridge, signer = self.bridge, self._signer
        if bridge is not None and signer is not None:
            bridge.inject("iopub", stderr_notice(signer, reason, None))
        await self._kill_for(container_id, "IdleLimitExceeded", reason)

    def _refuse_execution(self, execution: PendingExecution) -> None:
        """Answer a request sent to a kernel that is not running (bridge thread)."""
        self._answer_for_kernel(execution, *self._refusal)

    def _answer_lost_reply(self, execution: PendingExecution) -> None:
        """Answer a request whose reply the kernel went past (bridge thread): its client
        would otherwise wait for it for ever."""
        self._answer_for_kernel(execution, "ReplyLost", LOST_REPLY)

    async def _wait_exited(self, container_id: str, timeout: float = 10.0) -> None:
        """Until the container has stopped, so nothing it still sends can follow our notices."""

        async def stopped() -> bool:
            return (await self.backend.state(container_id))[1] is not None

        await poll_until(stopped, timeout, 0.1)

    # ------------------------------------------------------------------ pausing

    @property
    def paused(self) -> Paused | None:
        """The kernel's checkpoint while it is paused (saved to disk, its container
        stopped), else None."""
        return self._paused

    @property
    def sleep_state(self) -> str:
        """One of running, pausing, paused or resuming (a pause or resume under way, or a
        client's message waiting for the paused kernel to wake)."""
        if self._paused is not None:
            return "resuming" if self._pausing or self._wake_due is not None else "paused"
        return "pausing" if self._pausing else "running"

    @property
    def _suspended(self) -> bool:
        """Paused, or a pause or resume under way: the container's stop is not its end."""
        return self._paused is not None or self._pausing

    async def pause(self) -> Paused:
        """Save the idle kernel's whole sandbox, memory included, to disk and stop it.

        Clients notice nothing: the next message from any of them resumes the kernel
        (:meth:`resume`) and is delivered after. A kernel already paused stays so.

        Raises:
            PauseError: it could not be paused (it runs an execution, the host cannot
                checkpoint, the disk budget is spent...); it keeps running, nothing lost.
        """
        return await asyncio.wrap_future(BackgroundLoop.instance().submit(self._pause("asked")))

    async def resume(self) -> None:
        """Start a paused kernel again from its checkpoint, with all its variables; a
        kernel that is not paused is left as it is.

        Raises:
            PauseError: the sandbox could not be restored: the kernel is then stopped
                (its workspace intact) and a restart starts it fresh.
        """
        await asyncio.wrap_future(BackgroundLoop.instance().submit(self._resume("asked")))

    def _turns(self) -> asyncio.Lock:
        """The lock pauses, resumes and signals take turns with (background loop)."""
        if self._pause_lock is None:
            self._pause_lock = asyncio.Lock()
        return self._pause_lock

    def _wake(self, message: str) -> None:
        """A client's message (``message``: its channel and type) waits for the paused
        kernel (bridge thread): resume it."""
        if self._wake_due is not None:
            return
        self._wake_due = message
        if self._paused is not None:
            BackgroundLoop.instance().submit(self._resume_quietly(f"a client's {message}"))

    async def _resume_quietly(self, why: str) -> None:
        try:
            await self._resume(why)
        except PauseError as exc:
            self.log.error("Sandboxed kernel %s: %s", self.kernel_id, exc)

    async def _pause(self, why: str) -> Paused:
        async with self._turns():
            if self._paused is not None:
                return self._paused
            container_id, bridge, launch_dir = self.container_id, self.bridge, self.launch_dir
            if (
                container_id is None
                or bridge is None
                or launch_dir is None
                or self._exit_noted == container_id
            ):
                msg = f"Kernel {self.kernel_id} is not running, so it cannot be paused."
                raise PauseError(msg)
            await self.backend.check_checkpoints()
            await self._check_budget(container_id)
            self._wake_due = None
            bridge.hold()
            if self._busy(bridge):
                bridge.release()
                msg = f"Kernel {self.kernel_id} was not paused: it is working on a request. It keeps running."
                raise PauseError(msg)
            self._pausing = True
            started = time.monotonic()
            name = checkpoint_name()
            # Said before it is done: a server killed meanwhile must leave a kernel its
            # successor knows to resume (or to reopen, if it never stopped), not one to prune.
            self._pending_pause = Paused(name, None, time.time())
            signalled = False
            try:
                await self._save_state()
                await self._suspend_egress(True)
                # To the relays, via init: the channel relay stops the rest of the sandbox
                # first (kernel_relay.Holding), then closes its sockets.
                signalled = True
                await self.backend.signal(container_id, signal.SIGUSR1)
                await wait_for_channels(
                    launch_dir,
                    bound=False,
                    held=functools.partial(self.backend.host_sockets, container_id),
                    egress=self._egress is not None,
                )
                size = await self.backend.checkpoint(container_id, name)
            except (SandboxKernelError, OSError) as exc:
                self._pending_pause = None
                raise await self._pause_failed(container_id, launch_dir, bridge, exc, signalled) from exc
            finally:
                self._pausing = False
            self._pending_pause = None
            self._paused = record = Paused(name, size, time.time())
            seconds = time.monotonic() - started
            if self._auditor is not None:
                self._auditor.lifecycle("pause", reason=why, seconds=round(seconds, 3), checkpoint_bytes=size)
            self.log.info(
                "Sandboxed kernel %s paused in %.1f s (%s; image %s)",
                self.kernel_id,
                seconds,
                why,
                f"{size / 2**20:.0f} MiB" if size is not None else "size unknown",
            )
            await self._save_state()
        if self._wake_due is not None:  # a client's message came while it was being saved
            await self._resume(f"a client's {self._wake_due}")
        return record

    def _busy(self, bridge: KernelBridge) -> bool:
        """An execution or another request of a client awaits the kernel's reply."""
        auditor = self._auditor
        return (auditor is not None and auditor.current() is not None) or bridge.requests_in_flight(
            REQUEST_CPU_CREDIT
        )

    async def _check_budget(self, container_id: str) -> None:
        pid = await self.backend.main_pid(container_id)
        in_use = await asyncio.to_thread(memory_usage, pid) if pid else None
        used, free = await self.backend.checkpoint_usage()
        check_budget(
            str(self.kernel_id), in_use, used, free, size_bytes("checkpoint_budget", self.checkpoint_budget)
        )

    async def _pause_failed(
        self, container_id: str, launch_dir: Path, bridge: KernelBridge, exc: BaseException, signalled: bool
    ) -> PauseError:
        """The sandbox could not be saved: it runs on (bind its channels again if the
        relays were told to close them, pass on what came meanwhile), or, where the
        failure stopped it, the kernel has ended. The error that says why."""
        detail = str(exc)
        try:
            _, code = await self.backend.state(container_id)
        except SandboxKernelError:
            code = None
        if code is not None:
            reason = f"the pause failed and ended the kernel ({detail}); its workspace is intact"
            if self._auditor is not None:
                self._auditor.lifecycle("pause", failed=detail)
            self._planned_exit = (container_id, "PauseFailed", reason)
            bridge.drop_held()
            await self._note_exit(container_id, code or 1, "pause failed")
            return PauseError(f"Kernel {self.kernel_id}: {reason}. Restart it to start fresh.")
        try:
            if signalled:
                await self._reopen_channels(container_id, launch_dir)
            else:  # its relays still hold their sockets: the folder is never lent
                await self._suspend_egress(False)
        except (SandboxKernelError, OSError) as again:
            detail += f"; and its channels could not be opened again ({again})"
            await self._suspend_egress(False)
        bridge.release()
        await self._save_state()  # not paused after all
        if self._auditor is not None:
            self._auditor.lifecycle("pause", failed=detail)
        return PauseError(f"Kernel {self.kernel_id} could not be paused: {detail}. It keeps running.")

    async def _resume(self, why: str) -> None:
        async with self._turns():
            paused, container_id, bridge, launch_dir = (
                self._paused,
                self.container_id,
                self.bridge,
                self.launch_dir,
            )
            if paused is None or container_id is None or bridge is None or launch_dir is None:
                return
            self._pausing = True
            started = time.monotonic()
            try:
                _, code = await self.backend.state(container_id)
                if code is not None:  # (else a pause its server did not live to finish)
                    await self.backend.restore(container_id, paused.checkpoint)
                    self.backend.unwatch_exits(container_id)  # it ended once: follow the new run
                    self.backend.watch_exits(container_id)
                await self._reopen_channels(container_id, launch_dir)
            except (SandboxKernelError, OSError) as exc:
                raise await self._resume_failed(container_id, paused, exc) from exc
            finally:
                self._pausing = False
            self._paused, self._wake_due = None, None
            bridge.release()
            seconds = time.monotonic() - started
            if self._auditor is not None:
                self._auditor.lifecycle(
                    "resume",
                    reason=why,
                    seconds=round(seconds, 3),
                    paused_for=round(time.time() - paused.since),
                )
            self.log.info("Sandboxed kernel %s resumed in %.1f s (%s)", self.kernel_id, seconds, why)
            await self._save_state()
            try:
                await self.backend.remove_checkpoint(container_id, paused.checkpoint)
            except SandboxKernelError as exc:
                self.log.warning("Sandboxed kernel %s: %s (it goes with the container)", self.kernel_id, exc)

    async def _reopen_channels(self, container_id: str, launch_dir: Path) -> None:
        """Have the kernel's relay bind its host sockets again: in the launch folder lent
        to the kernel's uid for the while (every other process of the sandbox stopped
        since the pause began: see kernel_relay.Holding), sealed again once they are
        there, or once they did not come."""
        layout = self._layout()
        await asyncio.to_thread(lend_launch_dir, launch_dir, int(layout["uid"]), int(layout["gid"]))
        try:
            await self.backend.signal(container_id, signal.SIGUSR2)
            await wait_for_channels(launch_dir, bound=True)
            if self._egress is not None and not await wait_for_egress(launch_dir):
                self.log.warning(
                    "Sandboxed kernel %s: its egress relay did not bind its socket again after the pause; "
                    "its requests to the network fail (503) until it does",
                    self.kernel_id,
                )
        finally:
            await asyncio.to_thread(self._seal, launch_dir)
        await self._suspend_egress(False)

    async def _suspend_egress(self, suspended: bool) -> None:
        """With network "allowlist": have the egress proxy let go of the kernel's relay
        for a pause (``suspended``), or dial it again (a failure to is logged: the kernel
        runs on, its requests to the network answered 503).

        Raises:
            PauseError: the proxy did not let go.
        """
        if not self._egress_registered:
            return
        proxy = EgressProxy.instance()
        try:
            if suspended:
                await asyncio.to_thread(proxy.suspend_kernel, str(self.kernel_id))
            else:
                await asyncio.to_thread(proxy.resume_kernel, str(self.kernel_id))
        except (RuntimeError, concurrent.futures.TimeoutError) as exc:
            if suspended:
                msg = f"the egress proxy did not let go of the kernel ({exc!r})"
                raise PauseError(msg) from exc
            self.log.error("Sandboxed kernel %s: the egress proxy did not resume (%r)", self.kernel_id, exc)

    async def _resume_failed(self, container_id: str, paused: Paused, exc: BaseException) -> PauseError:
        """The sandbox could not be restored: the kernel has ended. Its clients are told
        why; a restart starts it fresh, with the workspace as it was. The error to raise."""
        self._paused = None
        if self.container_id != container_id:  # shut down meanwhile: nothing to report
            return PauseError(f"Kernel {self.kernel_id} was shut down while it resumed")
        reason = (
            f"the paused kernel could not be resumed ({exc}); its variables are lost, its workspace "
            "is intact. Restart the kernel to start it fresh"
        )
        if self._auditor is not None:
            self._auditor.lifecycle("resume", failed=str(exc), checkpoint=paused.checkpoint)
        self._planned_exit = (container_id, "ResumeFailed", reason)
        with contextlib.suppress(SandboxKernelError):
            await self.backend.signal(container_id, signal.SIGKILL)
        if self.bridge is not None:
            self.bridge.drop_held()
        await self._note_exit(container_id, 1, "not resumed")
        return PauseError(f"Kernel {self.kernel_id}: {reason}.")

    async def _signal_in_turn(self, signum: int) -> None:
        """Deliver ``signum`` once no pause or resume is under way (background loop). A
        paused kernel is idle (an interrupt has nothing to stop) and stopped: a kill or
        terminate ends its pause, and it."""
        async with self._turns():
            container_id = self.container_id
            if container_id is None:
                return
            if self._paused is None:
                await self.backend.signal(container_id, signum)
            elif signum in (signal.SIGKILL, signal.SIGTERM):
                self._paused = None
                if self.bridge is not None:
                    self.bridge.drop_held()
                await self._note_exit(container_id, 128 + signum, "stopped while paused")

    # ------------------------------------------------------------------ lifecycle

    async def poll(self) -> int | None:
        """None while the container runs or the kernel is paused, else its exit code
        (cheap; never blocks the loop)."""
        container_id = self.container_id
        if container_id is None:
            return self.exit_code if self.exit_code is not None else 0
        if self._exit_noted == container_id:
            return self.exit_code if self.exit_code is not None else 255
        if self._suspended or self.backend.surely_running(container_id):
            return None  # paused, or the backend's event stream has not seen it end
        try:
            status, code = await self.backend.state(container_id)
        except SandboxKernelError as exc:
            self.log.warning("Cannot check sandboxed kernel %s: %s", self.kernel_id, exc)
            return None
        if code is None or self._suspended:  # (stopped by a pause that began meanwhile)
            return None
        await self._note_exit(container_id, code, status)
        return code

    async def _note_exit(self, container_id: str, code: int, status: str = "exited") -> None:
        """Once per container (poll and the watchdog both notice): log why, tell clients.

        The cause is kept, so that a teardown cutting this short still answers with it.
        """
        with self._exit_lock:
            if self._exit_noted == container_id:
                return
            self._exit_noted = container_id
        self.exit_code = code
        planned = self._planned_exit
        if planned is not None and planned[0] == container_id:
            ename, reason = planned[1], planned[2]
        else:
            try:
                oom = await self.backend.oom_killed(container_id)
            except SandboxKernelError:
                oom = False
            if oom:
                ename, reason = "MemoryLimitExceeded", memory_reason(self.memory)
            else:
                ename = "KernelDied"
                reason = f"the kernel stopped (exit code {code}) before this execution finished"
        self._exit_cause = (ename, reason)
        if self._auditor is not None:
            self._auditor.lifecycle(
                "exit", container=container_id[:12], exit_code=code, ename=ename, reason=reason
            )
        if ename == "KernelDied":
            self.log.info("Sandboxed kernel %s stopped (%s, exit code %d)", self.kernel_id, status, code)
            if code not in (0, 128 + signal.SIGKILL, 128 + signal.SIGTERM):
                # Not a shutdown nor a kill: say why, while the container (its output) is there.
                output = await self.backend.logs(container_id) or "(none)"
                self.log.warning("Sandboxed kernel %s: its last output:\n%s", self.kernel_id, output)
        else:
            self._limit_stop = LimitStop(ename, reason, time.time(), container_id)
            self.log.warning("Sandboxed kernel %s ended: %s", self.kernel_id, reason)
        await self._abandon_executions(ename, reason)
        # Until it is restarted, a new execution gets the kernel's end at once: a program
        # with no restarter (a plain KernelManager) must not wait for a dead kernel.
        if self._auditor is not None and ename != "IdleLimitExceeded":  # that one refuses already
            self._refuse(
                ename,
                f"{reason}. The kernel is not running: restart it (a Jupyter server's restarter does, "
                "by itself; with a KernelManager, call restart_kernel())",
            )

    async def _abandon_executions(self, ename: str, reason: str) -> None:
        """Record unfinished executions, and answer their clients on the kernel's behalf.

        A client waiting for a reply from a kernel that is gone would wait forever (or
        until its own timeout, with no idea why): it gets an error reply naming the cause.
        Call it once the kernel has exited.
        """
        if self._auditor is None:
            return
        # Let the bridge pass on whatever the kernel sent before it died: a real reply
        # still in flight must win over ours.
        await asyncio.sleep(0.2)
        self._answer_pending(ename, reason)

    def _answer_pending(self, ename: str, reason: str) -> int:
        """Record every execution still waiting for its reply and answer its client;
        how many there were."""
        if self._auditor is None:
            return 0
        abandoned = self._auditor.abandon_pending(f"no reply: {reason}")
        for execution in abandoned:
            self._answer_for_kernel(execution, ename, reason)
        return len(abandoned)

    def _answer_for_kernel(self, execution: PendingExecution, ename: str, reason: str) -> None:
        """Tell the client of ``execution`` why no reply will come: a notice, an error reply, idle."""
        bridge, signer = self.bridge, self._signer  # another thread may be tearing down
        if bridge is None or signer is None:
            return
        parent = execution.header
        bridge.inject("iopub", stderr_notice(signer, reason, parent))
        content = {
            "status": "error",
            "ename": ename,
            "evalue": reason,
            "traceback": [f"{ename}: {reason}"],
        }
        reply = signer.msg("execute_reply", {**content, "execution_count": None}, parent)
        bridge.inject("shell", signer.serialize(reply, ident=execution.idents))
        idle = signer.msg("status", {"execution_state": "idle"}, parent)
        bridge.inject("iopub", signer.serialize(idle, ident=[b"status"]))

    async def wait(self) -> int | None:
        while True:
            code = await self.poll()
            if code is not None:
                return code
            await asyncio.sleep(0.1)

    async def send_signal(self, signum: int) -> None:
        """Deliver ``signum`` to the kernel via the container's init (which forwards it);
        while it is paused, or a pause or resume is under way, in turn with them."""
        if self.container_id is None or await asyncio.to_thread(self._held_elsewhere_now):
            return
        if self._suspended:
            await asyncio.wrap_future(BackgroundLoop.instance().submit(self._signal_in_turn(signum)))
        else:
            await self.backend.signal(self.container_id, signum)

    async def kill(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGKILL)

    async def terminate(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        """Remove the container; unless restarting, also the bridge and runtime folder.
        A kernel another process took over is left to it: only the bridge goes."""
        await asyncio.to_thread(self._held_elsewhere_now)
        if self._auditor is not None and not restart:
            self._auditor.lifecycle("shutdown", owner=server_identity(), server_uid=os.getuid())
        await self._teardown(keep_bridge=restart)
        if restart and self._auditor is not None and self.taken_over is None:
            # Requests from now on wait for the next kernel, as with a local one.
            self._auditor.refuse(None)

    async def _teardown(self, keep_bridge: bool) -> None:
        """Remove this kernel's container and files; the bridge's ports survive a restart.

        Raises:
            DockerOperationError: the container could not be removed (it is remembered,
                so a later cleanup retries).
        """
        failure: SandboxKernelError | None = None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._paused = None  # its checkpoint goes with the container
        if self.container_id is not None:
            try:
                await self.backend.remove(self.container_id)
                self.container_id = None
            except SandboxKernelError as exc:
                self.log.error("Sandboxed kernel %s: %s", self.kernel_id, exc)
                failure = exc
        await self._close_egress()
        # Whoever still waits for a reply gets one, with the kernel's end if known.
        ename, reason = self._exit_cause or (
            "KernelDied",
            "the kernel stopped or restarted before this execution finished",
        )
        if self._answer_pending(ename, reason):
            await asyncio.sleep(0.1)  # let the bridge send them before it detaches
        if self.bridge is not None:
            # Whatever was queued for the dead kernel (a shutdown_request, say) must
            # never reach the next one.
            await asyncio.to_thread(self.bridge.detach if keep_bridge else self.bridge.stop)
            if not keep_bridge:
                self.bridge = None
        # A request the relay passed on meanwhile went to the dead kernel and is lost: its
        # client hears why (once the bridge relays again), and it must not run the next
        # kernel's clocks.
        self._answer_pending(ename, reason)
        doomed = self.launch_dir if keep_bridge else self.runtime_dir
        if not keep_bridge and self._bridge_dir is not None:
            await asyncio.to_thread(remove_tree, self._bridge_dir)
            self._bridge_dir = None
        if keep_bridge and self.runtime_dir is not None:
            # A pooled sandbox's workspace mount goes with it; the restart starts cold.
            await asyncio.to_thread(detach_mounts, self.runtime_dir / "slot")
        if doomed is not None:
            # The kernel may have left any number of files: never on the event loop.
            await asyncio.to_thread(remove_tree, doomed)
        self.launch_dir = None
        if not keep_bridge:
            self.runtime_dir = None
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------ reconnecting

    async def _save_state(self) -> None:
        """Keep what a later process needs to reattach in the server-only runtime folder
        (``provisioner.json``): a server killed with SIGKILL leaves it behind for the
        next one (see :mod:`sandbox_kernel.reattach`)."""
        if self.runtime_dir is None:
            return
        state: dict[str, Any] = {"kernel_id": str(self.kernel_id), "kernel_name": self.kernel_name}
        state["provisioner_info"] = await self.get_provisioner_info()
        spec = self.kernel_spec
        if spec is not None:
            # A process that reattaches need not see the kernelspec (another user's data folder).
            state["kernelspec"] = spec.to_dict()
        try:
            await asyncio.to_thread(write_state, self.runtime_dir, state)
        except OSError as exc:
            self.log.warning("Sandboxed kernel %s: cannot save its reattach state: %s", self.kernel_id, exc)

    async def detach(self, save: bool = True) -> None:
        """Let go of a running kernel without stopping it: the bridge, watchdog and egress
        proxy stop here, the container and its runtime folder stay for whoever reattaches.
        A server stopping calls this for persistent kernels."""
        if save:
            await self._save_state()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        await self._close_egress()
        if self.bridge is not None:
            await asyncio.to_thread(self.bridge.stop)
            self.bridge = None
        if self._bridge_dir is not None:  # the kernel's sockets and state are in runtime_dir
            await asyncio.to_thread(remove_tree, self._bridge_dir)
            self._bridge_dir = None
        if self.runtime_dir is not None and not await asyncio.to_thread(self._held_elsewhere_now):
            # Nobody holds it now: whoever reattaches next need not take it over.
            await asyncio.to_thread(write_owner, self.runtime_dir, NO_HOLDER)
        self.log.info("Sandboxed kernel %s detached; its container keeps running", self.kernel_id)
        self.container_id = None
        self.runtime_dir = self.launch_dir = None

    async def get_provisioner_info(self) -> dict[str, Any]:
        """What a later process needs to reach this same kernel again."""
        info = await super().get_provisioner_info()
        info.update(
            {
                "cwd": self._cwd,
                "launch_env": self._launch_env,
                "container_id": self.container_id,
                "runtime_dir": str(self.runtime_dir) if self.runtime_dir else None,
                "launch_dir": str(self.launch_dir) if self.launch_dir else None,
                "image": self.image,
                "narrowed": self._narrowed,
                "sandbox_env": self._sandbox_env,
                # Names and times only: a credential's value is never written down.
                "credential_expiry": self._credential_expiry,
                "revoked_credentials": sorted(self._revoked),
                "paused": paused.to_dict() if (paused := self._paused or self._pending_pause) else None,
                **self._layout(),
            }
        )
        info["connection_info"] = {
            k: (v.decode() if isinstance(v, bytes) else v) for k, v in self.connection_info.items()
        }
        return info

    def _layout(self) -> dict[str, Any]:
        """The running sandbox's workspace: its host folder (or named volume), where it is
        inside, the kernel's working folder there, and whose files the kernel writes. What
        the host-side files API needs; a reattached kernel keeps what its state said."""
        spec = self._spec
        if spec is None:
            return dict(self._loaded_layout)
        return {
            "workspace": str(spec.workspace),
            "workdir": spec.workdir,
            "workspace_path": spec.workspace_path,
            "volume": spec.volume,
            "uid": spec.uid,
            "gid": spec.gid,
            # The folder mounted (device, inode): the files API refuses one swapped since.
            "workspace_identity": self._workspace_identity,
        }

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        """Reattach to a running kernel: same container, same client ports."""
        await super().load_provisioner_info(provisioner_info)
        self._loaded_layout = {key: provisioner_info.get(key) for key in LAYOUT_KEYS}
        # The limits the running kernel has, for the watchdog and a later restart.
        self._narrowed = dict(provisioner_info.get("narrowed") or {})
        self._sandbox_env = dict(provisioner_info.get("sandbox_env") or {})
        self._credential_expiry = dict(provisioner_info.get("credential_expiry") or {})
        self._revoked = set(provisioner_info.get("revoked_credentials") or [])
        narrow_settings(self, self._narrowed, self.kernel_name)
        self.connection_info = dict(provisioner_info["connection_info"])  # type: ignore[assignment]
        self.container_id = provisioner_info["container_id"]
        self._cwd = provisioner_info.get("cwd")
        self._launch_env = dict(provisioner_info.get("launch_env") or {})
        runtime_dir, launch_dir = provisioner_info.get("runtime_dir"), provisioner_info.get("launch_dir")
        self.runtime_dir = Path(runtime_dir) if runtime_dir else None
        self.launch_dir = Path(launch_dir) if launch_dir else None
        if self.launch_dir is not None:
            self._launches = int(self.launch_dir.name.removeprefix("run") or 0)
            info = self.connection_info
            pub, sec = info.get("curve_publickey"), info.get("curve_secretkey")
            if pub and sec:
                self._curve = CurveKeys(public=str(pub).encode(), secret=str(sec).encode())
            ports = {c: int(info[f"{c}_port"]) for c in CHANNELS}  # type: ignore[literal-required]
            self._egress = self.egress_policy()  # the server's ceilings may have narrowed
            try:  # what this server defines now; one bound by the last holder's program is gone
                self._credentials = self._bound_credentials(self.credential_specs(self._egress))
            except ConfigurationError as exc:
                self.log.warning("Sandboxed kernel %s gets no credentials: %s", self.kernel_id, exc)
                self._credentials = []
            unusable: str | None = None
            if info.get("transport") != self.client_transport:
                unusable = "the server's client_transport changed"
            else:
                try:
                    await self._attach_bridge(self.launch_dir, ports, str(info.get("ip", "")))
                except zmq.ZMQError as exc:
                    unusable = str(exc)  # taken: another process holds the kernel too
                    self.bridge = None
            if unusable is not None:
                # Clients get new addresses.
                self.log.info("Sandboxed kernel %s: %s unavailable (%s)", self.kernel_id, ports, unusable)
                fresh = await self._attach_bridge(self.launch_dir, ip=self._spare_client_ip())
                moved: dict[str, Any] = {
                    **info,
                    "transport": self.client_transport,
                    "ip": self.bridge.ip if self.bridge else "127.0.0.1",
                    **{f"{c}_port": port for c, port in fresh.items()},
                }
                self.connection_info = moved  # type: ignore[assignment]
            await self._open_egress(self.launch_dir)
            self._paused = Paused.from_dict(provisioner_info.get("paused"))
            if self._paused is not None:
                await self._suspend_egress(True)  # dialed again once it is back
            if self._paused is not None and self.bridge is not None:
                # Saved to disk, its container stopped: the first client's message resumes it.
                self._wake_due = None
                self.bridge.hold()
            if self.container_id:
                self._start_watchdog(self.container_id)
                # The event stream tells of ends from now on; one before (a limit stopped
                # it while nobody held it) is known only from its state.
                _, code = await self.backend.state(self.container_id)
                if code is None and self._paused is not None:
                    # Its last server died while pausing it, before the sandbox stopped.
                    await self.resume()
                elif code is not None and self._paused is None:
                    await self._note_exit(self.container_id, code)
        if self.runtime_dir is not None:
            # Last, once all is in place: this process owns the kernel now.
            await asyncio.to_thread(write_owner, self.runtime_dir, self._holder)
            await self._save_state()

    def resolve_path(self, path: str) -> str | None:
        """Map a path the kernel reports (e.g. /workspace/x.py) to the host, within the workspace."""
        if self._spec is None:
            return None
        workspace = self._spec.workspace
        p = Path(path)
        if p.is_absolute():
            try:
                p = workspace / p.relative_to(self._spec.workspace_path)
            except ValueError:
                return None
        else:
            p = workspace / Path(self._spec.workdir).relative_to(self._spec.workspace_path) / p
        resolved = p.resolve()
        if not resolved.is_relative_to(workspace) or not resolved.exists():
            return None
        return resolved.as_posix()
