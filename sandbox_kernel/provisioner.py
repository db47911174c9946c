"""The ``sandbox-provisioner``: jupyter_client kernel provisioner running IPython in gVisor.

Each kernel gets its own hardened Docker container under the gVisor runtime, with no
network; its ZeroMQ channels are ipc sockets in a per-kernel host folder, relayed to
clients on 127.0.0.1 by a :class:`~sandbox_kernel.bridge.KernelBridge`. See
``shared/notes/provisioner-contract.md`` for the contract this implements.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from jupyter_client.session import Session
from jupyter_core.paths import jupyter_data_dir
from traitlets import Float, Int, List, TraitError, Unicode, default, validate

from .audit import AuditLog, ExecutionAuditor
from .bridge import CHANNELS, CurveKeys, KernelBridge
from .docker_api import SandboxDocker
from .errors import ConfigurationError, KernelStartupError, SandboxKernelError
from .limits import Limits, check_within_ceilings, exec_timeout_startup, size_bytes
from .orphans import prune_orphans, server_identity, write_owner
from .output import OutputLimiter
from .policy import (
    CONTAINER_STARTUP_FILE,
    CONTAINER_WORKSPACE,
    LABEL_OWNER,
    POLICY_ENV,
    SandboxSpec,
    can_write,
    container_connection_info,
    container_create_kwargs,
    ensure_outside_workspace,
    kernel_command,
    kernel_sockets,
    kernel_user,
    resolve_workspace,
    sandbox_env,
    validate_kernelspec_config,
    validate_size,
)
from .wire import stderr_notice

DEFAULT_IMAGE = "sandbox-kernel/python:latest"
DEFAULT_RUNTIME = "runsc-sandbox-kernel"


class SandboxProvisioner(KernelProvisionerBase):
    """Runs each kernel in its own gVisor container and bridges its channels to the host."""

    IMAGE_ENV = "SANDBOX_KERNEL_IMAGE"
    RUNTIME_ENV = "SANDBOX_KERNEL_RUNTIME"
    WORKSPACE_ROOT_ENV = "SANDBOX_KERNEL_WORKSPACE_ROOT"
    AUDIT_LOG_ENV = "SANDBOX_KERNEL_AUDIT_LOG"

    image = Unicode(
        config=True,
        help=f"""Docker image the kernel runs in. It must already exist on the Docker host:
        images are never pulled. Build the default with `jupyter sandbox-kernel build-image`.
        Default: ${IMAGE_ENV}, else {DEFAULT_IMAGE}.""",
    )
    docker_runtime = Unicode(
        config=True,
        help=f"""Name of the Docker runtime that runs gVisor's runsc with --network=none and
        --host-uds=create --oci-seccomp. Starting a kernel fails if it is missing or is not runsc.
        Default: ${RUNTIME_ENV}, else {DEFAULT_RUNTIME}.""",
    )
    workspace_root = Unicode(
        None,
        allow_none=True,
        config=True,
        help=f"""Host folder mounted read-write at {CONTAINER_WORKSPACE}. The kernel's working
        directory is the notebook's folder mapped into it; a notebook outside it is refused.
        When unset, the folder the kernel is started in is the workspace.
        Default: ${WORKSPACE_ROOT_ENV}, else unset.""",
    )
    pass_env = List(
        Unicode(),
        default_value=["LANG", "LC_ALL", "TZ"],
        config=True,
        help="""Names of environment variables passed from the server into the sandbox.
        Nothing else of the server's environment enters it (variables the kernelspec's
        own `env` sets are passed too). JPY_PARENT_PID is never passed.""",
    )
    memory = Unicode("2g", config=True, help="Memory limit of the kernel's container, e.g. '512m' or '2g'.")
    cpus = Float(1.0, config=True, help="CPU limit of the kernel's container, in cores (e.g. 0.5).")
    pids = Int(
        256,
        config=True,
        help="""Most processes and threads the kernel's user may run (RLIMIT_NPROC); more
        forks or threads fail with EAGAIN. ipykernel and numpy need a few dozen.""",
    )
    tmp_size = Unicode(
        "256m", config=True, help="Size of the /tmp tmpfs, the only writable place besides the workspace."
    )
    exec_timeout = Float(
        0.0,
        config=True,
        help="""Wall-clock limit of one execution, in seconds (0: none). The cell gets a
        TimeoutError naming the limit; code that ignores it is interrupted, then the
        kernel is killed (and restarted by Jupyter) `exec_kill_grace` seconds later.""",
    )
    exec_kill_grace = Float(
        10.0,
        config=True,
        help="Seconds past `exec_timeout` before a runaway kernel is interrupted and then killed.",
    )
    max_exec_timeout = Float(
        0.0,
        config=True,
        help="""Ceiling for `exec_timeout` (0: none). When set, every kernel must have a limit
        at or below it. Server config only.""",
    )
    output_limit = Unicode(
        "10m",
        config=True,
        help="""Most output (printed text, displays, errors) one execution may send to
        clients, e.g. '10m'; past it the rest is dropped and clients get one notice.
        Server config only.""",
    )
    max_cpus = Float(
        2.0, config=True, help="Ceiling for `cpus`: no kernelspec may ask for more. Server config only."
    )
    max_memory = Unicode(
        "4g", config=True, help="Ceiling for `memory`: no kernelspec may ask for more. Server config only."
    )
    max_pids = Int(
        1024, config=True, help="Ceiling for `pids`: no kernelspec may ask for more. Server config only."
    )
    max_tmp_size = Unicode(
        "1g", config=True, help="Ceiling for `tmp_size`: no kernelspec may ask for more. Server config only."
    )
    kernel_uid = Int(
        None,
        allow_none=True,
        config=True,
        help="""Numeric uid (and gid) the kernel runs as. Unset: the server's uid when that
        is not root, else the workspace owner's uid when that is not root, else 1000.
        Never 0. Only a server running as root may choose a uid other than its own.""",
    )
    startup_timeout = Float(
        60.0, config=True, help="Seconds to wait for the kernel in a new container to open its channels."
    )
    audit_log = Unicode(
        config=True,
        help=f"""JSON-lines file on the host recording every execute_request a sandboxed
        kernel receives (time, kernel id, kernelspec, username, session, code, status,
        duration). It must lie outside every workspace. Empty string: no audit log.
        Default: ${AUDIT_LOG_ENV}, else JUPYTER_DATA_DIR/sandbox-kernel/audit.jsonl.""",
    )
    audit_log_max_bytes = Int(
        50 * 1024 * 1024, config=True, help="Rotate the audit log when it reaches this size (bytes)."
    )
    audit_log_backups = Int(10, config=True, help="Rotated audit log files to keep (audit.jsonl.1, ...).")
    runtime_parent = Unicode(
        config=True,
        help="""Host folder under which each kernel gets a private runtime folder (its
        connection file and ipc sockets). Keep the path short: unix socket paths are
        limited to about 100 characters. Default: the system temp folder.""",
    )

    @default("image")
    def _image_default(self) -> str:
        return os.environ.get(self.IMAGE_ENV) or DEFAULT_IMAGE

    @default("docker_runtime")
    def _docker_runtime_default(self) -> str:
        return os.environ.get(self.RUNTIME_ENV) or DEFAULT_RUNTIME

    @default("workspace_root")
    def _workspace_root_default(self) -> str | None:
        return os.environ.get(self.WORKSPACE_ROOT_ENV) or None

    @default("audit_log")
    def _audit_log_default(self) -> str:
        env = os.environ.get(self.AUDIT_LOG_ENV)
        if env is not None:
            return env
        return os.path.join(jupyter_data_dir(), "sandbox-kernel", "audit.jsonl")

    @default("runtime_parent")
    def _runtime_parent_default(self) -> str:
        return tempfile.gettempdir()

    @validate("memory", "tmp_size", "max_memory", "max_tmp_size", "output_limit")
    def _validate_size(self, proposal: dict[str, Any]) -> str:
        try:
            return validate_size(proposal["trait"].name, proposal["value"])
        except ConfigurationError as exc:
            raise TraitError(str(exc)) from None

    @validate("exec_timeout", "max_exec_timeout", "exec_kill_grace")
    def _validate_seconds(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        if not 0 <= value <= 7 * 24 * 3600:
            msg = f"{proposal['trait'].name}={value!r} is out of range; use seconds between 0 and a week."
            raise TraitError(msg)
        return value

    @validate("cpus")
    def _validate_cpus(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        if not 0 < value <= 64:
            msg = f"cpus={value!r} is out of range; use a number of cores above 0, e.g. 1 or 0.5."
            raise TraitError(msg)
        return value

    @validate("pids", "max_pids")
    def _validate_pids(self, proposal: dict[str, Any]) -> int:
        value = int(proposal["value"])
        if value < 16:
            msg = (
                f"{proposal['trait'].name}={value!r} is too low for ipykernel to start; "
                "use at least 16 (the default is 256)."
            )
            raise TraitError(msg)
        return value

    @validate("kernel_uid")
    def _validate_kernel_uid(self, proposal: dict[str, Any]) -> int | None:
        value: int | None = proposal["value"]
        if value is not None and value <= 0:
            msg = (
                f"kernel_uid={value!r} is not allowed: the kernel never runs as root; use a uid such as 1000."
            )
            raise TraitError(msg)
        return value

    def __init__(self, **kwargs: Any) -> None:
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
        self.bridge: KernelBridge | None = None
        self.docker = SandboxDocker()
        self._spec: SandboxSpec | None = None
        self._curve: CurveKeys | None = None
        self._auditor: ExecutionAuditor | None = None
        self._watchdog: asyncio.Task[None] | None = None
        # Signs the provisioner's own messages to clients (notices, replies for the dead).
        self._signer: Session | None = None

    # ------------------------------------------------------------------ launch

    @property
    def limits(self) -> Limits:
        """What this kernel asks for (kernelspec values over the server's defaults)."""
        return Limits(self.cpus, self.memory, self.pids, self.tmp_size, self.exec_timeout)

    @property
    def ceilings(self) -> Limits:
        """The most the server allows; only server config sets these."""
        return Limits(self.max_cpus, self.max_memory, self.max_pids, self.max_tmp_size, self.max_exec_timeout)

    @property
    def has_process(self) -> bool:
        return self.container_id is not None

    @property
    def kernel_name(self) -> str:
        return str(getattr(self.parent, "kernel_name", "") or getattr(self.kernel_spec, "name", "") or "")

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Validate the kernelspec and the Docker host, and plan the container.

        Raises:
            ConfigurationError: the kernelspec or a setting is invalid.
            DockerUnavailableError, RuntimeMissingError, ImageNotFoundError: the host
                is not ready; each message says how to fix it.
        """
        metadata = getattr(self.kernel_spec, "metadata", {}) or {}
        validate_kernelspec_config(metadata.get("kernel_provisioner", {}).get("config", {}), self.kernel_name)
        transport_encryption = kwargs.pop("transport_encryption", None)
        extra_arguments = kwargs.pop("extra_arguments", [])
        self._curve = self._curve_keys(transport_encryption)
        limits = self.limits
        check_within_ceilings(limits, self.ceilings)

        await self.docker.check_runtime(self.docker_runtime)
        await self.docker.check_image(self.image)

        workspace, workdir = resolve_workspace(
            kwargs.get("cwd") or os.getcwd(), self.workspace_root, self.runtime_parent
        )
        if self.audit_log:
            ensure_outside_workspace(self.audit_log, workspace, "SandboxProvisioner.audit_log")
        uid, gid = kernel_user(workspace, self.kernel_uid)
        if os.getuid() not in (0, uid):
            msg = (
                f"kernel_uid={uid} differs from the server's uid {os.getuid()}; only a server "
                "running as root can run kernels as another user. Unset kernel_uid."
            )
            raise ConfigurationError(msg)
        if not can_write(workspace, uid, gid):
            self.log.warning(
                "The sandboxed kernel runs as uid %d, which cannot write to its workspace %s: "
                "results cannot be saved there. Give uid %d write access to it, or set "
                "SandboxProvisioner.kernel_uid to its owner's uid.",
                uid,
                workspace,
                uid,
            )
        cmd = kernel_command(self.kernel_spec.argv, extra_arguments)
        kwargs = await super().pre_launch(cmd=cmd, **kwargs)
        self._spec = SandboxSpec(
            kernel_id=str(self.kernel_id),
            kernelspec=self.kernel_name,
            image=self.image,
            runtime=self.docker_runtime,
            command=cmd,
            env={
                **sandbox_env(kwargs["env"], self.pass_env, self.kernel_spec.env),
                POLICY_ENV: json.dumps({**limits.as_dict(), "network": "none", "image": self.image}),
                **({"PYTHONSTARTUP": CONTAINER_STARTUP_FILE} if self.exec_timeout > 0 else {}),
            },
            workspace=workspace,
            workdir=workdir,
            runtime_dir=Path(),
            uid=uid,
            gid=gid,
            memory=self.memory,
            cpus=self.cpus,
            pids=self.pids,
            tmp_size=self.tmp_size,
            extra_labels={LABEL_OWNER: server_identity()},
        )
        await self._sweep_orphans_once()
        return kwargs

    _swept_orphans = False

    async def _sweep_orphans_once(self) -> None:
        """Remove kernels left by servers that died (once per server process)."""
        if SandboxProvisioner._swept_orphans:
            return
        SandboxProvisioner._swept_orphans = True
        try:
            await prune_orphans(self.docker, self.runtime_parent)
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
        km = self.parent
        key: bytes = km.session.key if km is not None else b""
        scheme: str = km.session.signature_scheme if km is not None else "hmac-sha256"
        try:
            launch_dir = await asyncio.to_thread(self._new_launch_dir, self._spec.uid, self._spec.gid)
            spec = replace(self._spec, runtime_dir=launch_dir)
            self._write_container_connection_file(spec, key, scheme)
            if self.exec_timeout > 0:
                (launch_dir / Path(CONTAINER_STARTUP_FILE).name).write_text(
                    exec_timeout_startup(self.exec_timeout)
                )
            container = await self.docker.create_and_start(container_create_kwargs(spec))
            self.container_id = str(container.id)
            self.exit_code = None
            self.log.info(
                "Sandboxed kernel %s: container %s (image %s, runtime %s, uid %d, workspace %s)",
                self.kernel_id,
                self.container_id[:12],
                spec.image,
                spec.runtime,
                spec.uid,
                spec.workspace,
            )
            ports = await self._attach_bridge(launch_dir)
            await self._wait_until_ready(self.container_id, launch_dir)
            await asyncio.to_thread(self._seal, launch_dir)
            self._start_watchdog(self.container_id)
        except BaseException:
            try:
                await self._teardown(keep_bridge=False)
            except SandboxKernelError:
                pass  # logged; the start's own error is the one to report
            raise
        info: dict[str, Any] = {
            "transport": "tcp",
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
        return self.connection_info

    def _new_launch_dir(self, uid: int, gid: int) -> Path:
        """A fresh folder for one kernel process, inside the server-only runtime folder.

        The outer folder (0700, the server's) keeps other host users, including one
        whose uid the kernel happens to share, away from the key and the sockets. A
        fresh inner folder per launch means nothing the previous kernel left there can
        disturb the next one.
        """
        if self.runtime_dir is None or not self.runtime_dir.is_dir():
            self.runtime_dir = Path(tempfile.mkdtemp(prefix="sandbox-kernel-", dir=self.runtime_parent))
            write_owner(self.runtime_dir)
        self._launches += 1
        launch_dir = self.runtime_dir / f"run{self._launches}"
        launch_dir.mkdir(mode=0o700)
        if os.getuid() == 0:
            os.chown(launch_dir, uid, gid)
        self.launch_dir = launch_dir
        return launch_dir

    def _write_container_connection_file(self, spec: SandboxSpec, key: bytes, scheme: str) -> None:
        info = container_connection_info(key, scheme, self.kernel_name)
        fd = os.open(
            spec.runtime_dir / "connection.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
        )
        with os.fdopen(fd, "w") as f:
            if os.getuid() == 0:
                os.fchown(f.fileno(), spec.uid, spec.gid)
            json.dump(info, f)

    @staticmethod
    def _seal(launch_dir: Path) -> None:
        """Once the kernel has bound its sockets, stop it adding or swapping entries.

        Only a root server can hand the folder back to itself; otherwise the kernel
        shares the server's uid and could undo any change.
        """
        if os.getuid() == 0:
            os.chown(launch_dir, 0, 0)
            launch_dir.chmod(0o755)

    async def _attach_bridge(self, launch_dir: Path, ports: dict[str, int] | None = None) -> dict[str, int]:
        """Connect the bridge to this launch's sockets; create it on the first launch."""
        endpoints = {channel: f"ipc://{path}" for channel, path in kernel_sockets(launch_dir).items()}
        if self.bridge is None:
            if self._auditor is None:
                log_file = (
                    AuditLog.open(self.audit_log, self.audit_log_max_bytes, self.audit_log_backups)
                    if self.audit_log
                    else None
                )
                self._auditor = ExecutionAuditor(log_file, str(self.kernel_id), self.kernel_name)
            km = self.parent
            limiter = None
            if km is not None:
                self._signer = Session(key=km.session.key, signature_scheme=km.session.signature_scheme)
                limiter = OutputLimiter(
                    size_bytes("output_limit", self.output_limit), self._signer, self._current_execution
                )
            self.bridge = KernelBridge(
                endpoints, ports=ports, curve=self._curve, tap=self._auditor, output_limiter=limiter
            )
            return self.bridge.start()
        await asyncio.to_thread(self.bridge.attach, endpoints)
        return self.bridge.ports

    async def _wait_until_ready(self, container_id: str, runtime_dir: Path) -> None:
        """Wait until the kernel has bound all its sockets, or fail with its logs."""
        sockets = list(kernel_sockets(runtime_dir).values())
        deadline = time.monotonic() + self.startup_timeout
        next_check = 0.0
        while True:
            if all(s.exists() for s in sockets):
                return
            now = time.monotonic()
            if now >= next_check:
                _, code = await self.docker.state(container_id)
                if code is not None:
                    logs = await self.docker.logs(container_id)
                    msg = (
                        f"The sandboxed kernel exited during startup (exit code {code}, image "
                        f"{self.image!r}). Its last output:\n{logs or '(no output)'}"
                    )
                    raise KernelStartupError(msg, logs)
                next_check = now + 0.5
            if now >= deadline:
                logs = await self.docker.logs(container_id)
                msg = (
                    f"The sandboxed kernel did not open its channels within {self.startup_timeout:g} s "
                    f"(image {self.image!r}); raise SandboxProvisioner.startup_timeout if the host is "
                    f"slow. Its last output:\n{logs or '(no output)'}"
                )
                raise KernelStartupError(msg, logs)
            await asyncio.sleep(0.05)

    def _current_execution(self) -> tuple[str, dict[str, Any]] | None:
        """For the output cap: the request the host knows is running (bridge thread)."""
        execution = self._auditor.current() if self._auditor is not None else None
        if execution is None:
            return None
        return str(execution.header.get("msg_id", "")), execution.header

    def _start_watchdog(self, container_id: str) -> None:
        if self.exec_timeout > 0:
            self._watchdog = asyncio.create_task(self._enforce_exec_timeout(container_id))

    async def _enforce_exec_timeout(self, container_id: str) -> None:
        """Backstop for code that defeats the in-kernel limit: interrupt, then kill.

        Only the execution the kernel is running counts, from when it began; cells
        queued behind it wait without spending their limit.
        """
        limit, grace = self.exec_timeout, self.exec_kill_grace
        interrupted: str | None = None
        try:
            while self.container_id == container_id and self._auditor is not None:
                await asyncio.sleep(0.5)
                running = self._auditor.running()
                if running is None:
                    continue
                msg_id, age = running
                if age < limit + min(2.0, grace / 2):
                    continue
                if interrupted != msg_id:
                    self.log.warning(
                        "Sandboxed kernel %s: an execution ignored its %g s wall-clock limit; interrupting",
                        self.kernel_id,
                        limit,
                    )
                    await self.docker.signal(container_id, signal.SIGINT)
                    interrupted = msg_id
                elif age >= limit + grace:
                    self.log.warning(
                        "Sandboxed kernel %s: an execution ignored its %g s wall-clock limit and the "
                        "interrupt; killing the kernel (Jupyter restarts it)",
                        self.kernel_id,
                        limit,
                    )
                    await self.docker.signal(container_id, signal.SIGKILL)
                    await self._wait_exited(container_id)
                    await self._abandon_executions(
                        "WallClockLimitExceeded",
                        f"killed: wall-clock limit of {limit:g} s per execution exceeded and the "
                        "interrupt ignored; the kernel restarts without its state",
                    )
                    return
        except SandboxKernelError as exc:
            self.log.error("Sandboxed kernel %s: wall-clock enforcement failed: %s", self.kernel_id, exc)

    async def _wait_exited(self, container_id: str, timeout: float = 10.0) -> None:
        """Until the container has stopped, so nothing it still sends can follow our notices."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, code = await self.docker.state(container_id)
            if code is not None:
                return
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------ lifecycle

    async def poll(self) -> int | None:
        """None while the container runs, else its exit code (cheap; never blocks the loop)."""
        if self.container_id is None:
            return self.exit_code if self.exit_code is not None else 0
        try:
            status, code = await self.docker.state(self.container_id)
        except SandboxKernelError as exc:
            self.log.warning("Cannot check sandboxed kernel %s: %s", self.kernel_id, exc)
            return None
        if code is not None and self.exit_code is None:
            self.exit_code = code
            if await self.docker.oom_killed(self.container_id):
                self.log.warning(
                    "Sandboxed kernel %s was killed: memory limit %s exceeded", self.kernel_id, self.memory
                )
                await self._abandon_executions(
                    "MemoryLimitExceeded",
                    f"memory limit {self.memory} exceeded: the kernel was killed "
                    "and restarts without its state",
                )
            else:
                self.log.info("Sandboxed kernel %s stopped (%s, exit code %d)", self.kernel_id, status, code)
                await self._abandon_executions(
                    "KernelDied", f"the kernel stopped (exit code {code}) before this execution finished"
                )
        return code

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
        abandoned = self._auditor.abandon_pending(f"no reply: {reason}")
        if self.bridge is None or self._signer is None:
            return
        signer = self._signer
        for execution in abandoned:
            parent = execution.header
            self.bridge.inject("iopub", stderr_notice(signer, reason, parent))
            content = {
                "status": "error",
                "ename": ename,
                "evalue": reason,
                "traceback": [f"{ename}: {reason}"],
            }
            reply = signer.msg("execute_reply", {**content, "execution_count": None}, parent)
            self.bridge.inject("shell", signer.serialize(reply, ident=execution.idents))
            idle = signer.msg("status", {"execution_state": "idle"}, parent)
            self.bridge.inject("iopub", signer.serialize(idle, ident=[b"status"]))

    async def wait(self) -> int | None:
        while True:
            code = await self.poll()
            if code is not None:
                return code
            await asyncio.sleep(0.1)

    async def send_signal(self, signum: int) -> None:
        """Deliver ``signum`` to the kernel via the container's init (which forwards it)."""
        if self.container_id is not None:
            await self.docker.signal(self.container_id, signum)

    async def kill(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGKILL)

    async def terminate(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        """Remove the container; unless restarting, also the bridge and runtime folder."""
        await self._teardown(keep_bridge=restart)

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
        if self.container_id is not None:
            try:
                await self.docker.remove(self.container_id)
                self.container_id = None
            except SandboxKernelError as exc:
                self.log.error("Sandboxed kernel %s: %s", self.kernel_id, exc)
                failure = exc
        if self._auditor is not None:
            self._auditor.abandon_pending("no reply: the kernel stopped or restarted")
        if self.bridge is not None:
            # Whatever was queued for the dead kernel (a shutdown_request, say) must
            # never reach the next one.
            await asyncio.to_thread(self.bridge.detach if keep_bridge else self.bridge.stop)
            if not keep_bridge:
                self.bridge = None
        doomed = self.launch_dir if keep_bridge else self.runtime_dir
        if doomed is not None:
            # The kernel may have left any number of files: never on the event loop.
            await asyncio.to_thread(shutil.rmtree, doomed, True)
        self.launch_dir = None
        if not keep_bridge:
            self.runtime_dir = None
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------ reconnecting

    async def get_provisioner_info(self) -> dict[str, Any]:
        """What a later process needs to reach this same kernel again."""
        info = await super().get_provisioner_info()
        info.update(
            {
                "container_id": self.container_id,
                "runtime_dir": str(self.runtime_dir) if self.runtime_dir else None,
                "launch_dir": str(self.launch_dir) if self.launch_dir else None,
                "image": self.image,
                "workspace": str(self._spec.workspace) if self._spec else None,
                "workdir": self._spec.workdir if self._spec else None,
            }
        )
        info["connection_info"] = {
            k: (v.decode() if isinstance(v, bytes) else v) for k, v in self.connection_info.items()
        }
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        """Reattach to a running kernel: same container, same client ports."""
        await super().load_provisioner_info(provisioner_info)
        self.connection_info = dict(provisioner_info["connection_info"])  # type: ignore[assignment]
        self.container_id = provisioner_info["container_id"]
        runtime_dir, launch_dir = provisioner_info.get("runtime_dir"), provisioner_info.get("launch_dir")
        self.runtime_dir = Path(runtime_dir) if runtime_dir else None
        self.launch_dir = Path(launch_dir) if launch_dir else None
        if self.runtime_dir is not None and self.runtime_dir.is_dir():
            await asyncio.to_thread(write_owner, self.runtime_dir)  # this process owns it now
        if self.launch_dir is not None:
            self._launches = int(self.launch_dir.name.removeprefix("run") or 0)
            info = self.connection_info
            pub, sec = info.get("curve_publickey"), info.get("curve_secretkey")
            if pub and sec:
                self._curve = CurveKeys(public=str(pub).encode(), secret=str(sec).encode())
            ports = {c: int(info[f"{c}_port"]) for c in CHANNELS}  # type: ignore[literal-required]
            await self._attach_bridge(self.launch_dir, ports)
            if self.container_id:
                self._start_watchdog(self.container_id)

    def resolve_path(self, path: str) -> str | None:
        """Map a path the kernel reports (e.g. /workspace/x.py) to the host, within the workspace."""
        if self._spec is None:
            return None
        workspace = self._spec.workspace
        p = Path(path)
        if p.is_absolute():
            try:
                p = workspace / p.relative_to(CONTAINER_WORKSPACE)
            except ValueError:
                return None
        else:
            p = workspace / Path(self._spec.workdir).relative_to(CONTAINER_WORKSPACE) / p
        resolved = p.resolve()
        if not resolved.is_relative_to(workspace) or not resolved.exists():
            return None
        return resolved.as_posix()
