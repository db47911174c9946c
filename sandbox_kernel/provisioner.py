"""The ``sandbox-provisioner``: jupyter_client kernel provisioner running IPython in gVisor.

Each kernel gets its own hardened sandbox (a Docker container under the gVisor runtime)
with no network; its ZeroMQ channels are ipc sockets in a per-kernel host folder,
relayed to clients on 127.0.0.1. This class is the contract
(``shared/notes/provisioner-contract.md``); it composes one kernel's parts, each owning
its state and handed its collaborators: the site, channels, egress, start (cold or
pooled), watchdog, pauser, holding, exits and reattach state (``docs/design/index.md``).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.channels.bridge import CurveKeys, KernelBridge
from sandbox_kernel.errors import ConfigurationError, KernelTakenOverError, SandboxKernelError
from sandbox_kernel.host.mounts import detach_mounts
from sandbox_kernel.kernel.channels import ChannelSettings, KernelChannels
from sandbox_kernel.kernel.egress import KernelEgress
from sandbox_kernel.kernel.exits import Exits, LimitStop
from sandbox_kernel.kernel.holding import Holding
from sandbox_kernel.kernel.launching import PoolClaim, ready_and_sealed, start_cold, sweep_orphans_once
from sandbox_kernel.kernel.manager import ManagerLink
from sandbox_kernel.kernel.pauser import Pauser
from sandbox_kernel.kernel.site import KernelSite, workspace_identity
from sandbox_kernel.kernel.start import plan_start
from sandbox_kernel.kernel.state import ReattachState, save_state
from sandbox_kernel.kernel.watchdog import Watchdog, watch_limits
from sandbox_kernel.lifecycle.ownership import NO_HOLDER, PINNED_WORKSPACE, remove_tree, write_owner
from sandbox_kernel.lifecycle.pausing import Paused
from sandbox_kernel.plan.admission import with_server_config
from sandbox_kernel.plan.limits import size_bytes
from sandbox_kernel.plan.plan import kernelspec_config
from sandbox_kernel.plan.policy import SandboxPolicy, policy_for
from sandbox_kernel.plan.sandbox_spec import SandboxSpec, is_launcher
from sandbox_kernel.plan.settings import SandboxSettings
from sandbox_kernel.plan.users import KernelUser
from sandbox_kernel.services import PROCESS, Services

__all__ = ["LimitStop", "SandboxProvisioner"]


class SandboxProvisioner(SandboxSettings, KernelProvisionerBase):  # type: ignore[metaclass]  # as upstream
    """Runs each kernel in its own gVisor container and bridges its channels to the host.

    Its settings (traits, validation, ceilings) are :class:`~.plan.settings.SandboxSettings`.
    """

    def __init__(
        self, *, backend: SandboxBackend | None = None, services: Services | None = None, **kwargs: Any
    ) -> None:
        """``backend``: what runs the kernel's sandboxes (default: ``backend_class()``);
        ``services``: the loop, egress proxy, pool and reaper it uses (default: the process's)."""
        if backend is not None and not isinstance(backend, SandboxBackend):
            msg = f"backend={backend!r} is not a setting: choose a backend with backend_class"
            raise ConfigurationError(msg)
        # Whatever started the kernel (a server, a program, MCP, the kernelspec's launcher),
        # the server's config files apply under the config its manager was given.
        parent_config, given = getattr(kwargs.get("parent"), "config", None), kwargs.pop("config", None)
        kwargs["config"] = with_server_config(given if given is not None else parent_config)
        super().__init__(**kwargs)
        # The base class declares connection_info as a shared class-level dict.
        self.connection_info: KernelConnectionInfo = {}
        self.backend: SandboxBackend = backend or self.backend_class()
        self.services = svc = services or PROCESS
        kernel_id, log, backend = str(self.kernel_id), self.log, self.backend
        self.site = site = KernelSite(kernel_id)
        self.link = link = ManagerLink(self.parent)
        settings = ChannelSettings.of(self, kernel_id, self.kernel_name)
        self.channels = channels = KernelChannels(settings, with_manager=self.parent is not None)
        save_soon, save = (lambda: svc.loop.submit(self._save_state())), self._save_state
        self.egress = egress = KernelEgress(kernel_id, channels, log, save_soon, svc)
        self.exits = exits = Exits(kernel_id, backend, channels, log, lambda: self.policy.memory)
        self.holding = holding = Holding(site, channels, egress, link, log)
        budget = lambda: size_bytes("checkpoint_budget", self.checkpoint_budget)  # noqa: E731
        self.pauser = pauser = Pauser(site, backend, channels, egress, exits, save, budget, log, svc)
        self.pool = PoolClaim(site, backend, channels, log, svc)
        self.watchdog = Watchdog(site, backend, channels, holding, pauser, exits, link, log, svc)
        self._curve: CurveKeys | None = None
        self._launch_env: dict[str, str] = {}  # what a relaunch after reattaching needs again
        self._cwd: str | None = None
        self._narrowed: dict[str, Any] = {}  # what this start narrowed of the kernelspec's policy
        self._sandbox_env: dict[str, str] = {}
        self._user: KernelUser | None = None
        self._host_checked = False
        self._policy: SandboxPolicy | None = None

    # ------------------------------------------------------------------ what others read

    container_id = property(lambda self: self.site.container_id)
    runtime_dir = property(lambda self: self.site.runtime_dir)
    launch_dir = property(lambda self: self.site.launch_dir)
    bridge: KernelBridge | None = property(lambda self: self.channels.bridge)  # type: ignore[assignment]
    exit_code = property(lambda self: self.exits.code)
    #: The last time a limit stopped this kernel, or None; kept across restarts (Jupyter's are quick).
    limit_stop: LimitStop | None = property(lambda self: self.exits.limit_stop)  # type: ignore[assignment]
    #: Set once another process took the kernel over: why this one no longer drives it.
    taken_over: str | None = property(lambda self: self.holding.taken_over)  # type: ignore[assignment]
    #: Whether the running kernel's sandbox came from the pool (False: started cold).
    from_pool: bool = property(lambda self: self.pool.from_pool)  # type: ignore[assignment]
    #: The kernel's checkpoint while it is paused (saved to disk, its container stopped).
    paused: Paused | None = property(lambda self: self.pauser.paused)  # type: ignore[assignment]
    #: running, pausing, paused or resuming (see :attr:`.kernel.pauser.Pauser.state`).
    sleep_state: str = property(lambda self: self.pauser.state)  # type: ignore[assignment]
    has_process: bool = property(lambda self: self.site.container_id is not None)  # type: ignore[assignment]
    #: The running kernel's settings: its own, narrowed by its start (before one: its own).
    policy: SandboxSettings = property(lambda self: self._policy or self)  # type: ignore[assignment]
    #: The user a sandbox gateway started the kernel for (``start_kernel(sandbox_user=...)``),
    #: or None; an adopted kernel's, as its saved state says.
    user: KernelUser | None = property(lambda self: self._user)  # type: ignore[assignment]

    @property
    def approval_handler(self) -> Any:
        """With approval "egress": called in a thread of its own with an ApprovalRequest, returns
        "once", "kernel" or "deny"; unset: the running cell's client is asked (channels.approval)."""
        return self.egress.approval_handler

    @approval_handler.setter
    def approval_handler(self, handler: Any) -> None:
        self.egress.approval_handler = handler

    @property
    def kernel_name(self) -> str:
        return str(getattr(self.parent, "kernel_name", "") or getattr(self.kernel_spec, "name", "") or "")

    def resolve_path(self, path: str) -> str | None:
        """Map a path the kernel reports (e.g. /workspace/x.py) to the host, within the workspace."""
        return self.site.resolve_path(path)

    def audit(self, event: str, **details: Any) -> None:
        """An audit line for what the host did to the kernel (the files API's, say), with who did it."""
        self.channels.audit(event, **details)

    # ------------------------------------------------------------------ launch

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Check the settings and the Docker host, and plan the sandbox (see :mod:`~.plan`).

        Raises:
            ConfigurationError, WorkspaceError: the kernelspec or a setting is invalid.
            DockerUnavailableError, RuntimeMissingError, ImageNotFoundError: the host
                is not ready; each message says how to fix it.
        """
        if await asyncio.to_thread(self.holding.held_elsewhere_now):
            msg = f"Sandboxed kernel {self.kernel_id}: {self.taken_over}"
            raise KernelTakenOverError(msg)
        start, plan, kwargs = await plan_start(
            self, self.kernel_spec, self.kernel_name, kwargs, self.link, super().pre_launch
        )
        self._policy, self._narrowed, self._sandbox_env = start.policy, start.narrowed, start.sandbox_env
        self._user = start.user
        self._curve = start.curve
        self._cwd, self._launch_env = str(start.launch.cwd), start.launch_env
        for warning in plan.warnings:
            self.log.warning("%s", warning)
        self.site.spec, self.egress.policy = plan.spec, plan.egress
        # Read on the host now: a missing token fails the start before any sandbox exists.
        self.egress.read_credentials(plan.credentials)
        kwargs["cmd"] = plan.spec.command
        self.pool.want(plan, start, self.link.signature_scheme())
        self._host_checked = False
        if not self.pool.ready():  # a pooled sandbox was made on a host checked then
            await self._check_host()
        await sweep_orphans_once(self.backend, self.runtime_parent, self.log)
        return kwargs

    async def _check_host(self) -> None:
        """The gVisor runtime (with our flags) and the image are there; once per launch."""
        if not self._host_checked:
            await self.backend.check_runtime(self.docker_runtime)
            await self.backend.check_image(self.image)
            self._host_checked = True

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start the kernel's container and the bridge; return the client-side connection.

        Raises:
            KernelStartupError: the kernel exited or never opened its channels; carries
                the container's last output. Nothing is left behind.
        """
        spec, site = self.site.spec, self.site
        if spec is None:
            msg = "launch_kernel() called before pre_launch()"
            raise RuntimeError(msg)
        restart = self.channels.bridge is not None
        # A restart keeps the session key clients already use: its kernel is handed it.
        session = self.link.session_key(dict(self.connection_info))
        handed_key = session[0] if self.connection_info else None
        self.exits.starting()
        try:
            session = await self._into_sandbox(spec, session, handed_key)
            site.identity = await asyncio.to_thread(workspace_identity, site.spec or spec)
            # Clients' ports open once the kernel answers on them: a client that connects as
            # soon as they do (as front ends that start kernels themselves do) is answered.
            ports = await self._open_channels(None if restart else self.link.ports(self.client_transport))
            await self.egress.open(site.launch_dir, site.runtime_dir)  # type: ignore[arg-type]
            self._running(restart)
        except BaseException as exc:
            try:
                await self._teardown(keep_bridge=False)
            except SandboxKernelError:
                pass  # logged; the start's own error is the one to report
            if self.channels.auditor is not None:  # a restart that failed: nothing runs to answer
                self.channels.refuse("KernelDied", f"the kernel could not be started again: {exc}")
            raise
        info = self.channels.client_info(ports, session, self._curve, self.kernel_name)
        self.connection_info = info  # type: ignore[assignment]
        if site.runtime_dir is not None:
            await asyncio.to_thread(write_owner, site.runtime_dir, self.holding.token)
        await self._save_state()
        return self.connection_info

    async def _into_sandbox(
        self, spec: SandboxSpec, session: tuple[bytes, str], handed_key: bytes | None
    ) -> tuple[bytes, str]:
        """A pooled sandbox bound to the kernel, else one started cold and ready; the
        session key and scheme the kernel's clients sign with."""
        allowlist, pooled = self.egress.policy is not None, self.pool.claim()
        if pooled is not None and await self.pool.bind(spec, pooled, handed_key):
            self.egress.forget_ca()  # it trusts the CA made with it, in its runtime folder
            if handed_key is None:
                # The manager adopts the sandbox's key (fresh, and nobody else's), as
                # when reattaching: jupyter_client loads it from the connection info.
                session = (pooled.key, pooled.scheme)
                self.connection_info = {"key": pooled.key, "signature_scheme": pooled.scheme}  # type: ignore[typeddict-item]
            return session
        self.pool.from_pool, site = False, self.site
        await self._check_host()
        await start_cold(
            self.site, self.backend, spec, session, self.egress.ca, self.runtime_parent, self.log
        )
        code = is_launcher(self.kernel_spec.argv)
        await ready_and_sealed(site, self.backend, allowlist, self.startup_timeout, code)
        return session

    async def _open_channels(self, ports: dict[str, int] | None = None) -> dict[str, int]:
        site, session = self.site, self.link.session_key(dict(self.connection_info))
        if site.launch_dir is None:
            msg = "the kernel's launch folder is not set up"
            raise RuntimeError(msg)
        return await self.channels.open(site.launch_dir, site.runtime_dir, session, self._curve, ports)

    def _running(self, restart: bool) -> None:
        """The kernel runs: accept requests, watch it, say so in the audit log."""
        container_id, spec = self.site.container_id, self.site.spec
        if container_id is None or spec is None:
            msg = "the kernel's sandbox is not started"
            raise RuntimeError(msg)
        self.channels.accept()
        self.channels.ledger().user = self._user.name if self._user is not None else None
        self.link.start_restarter()
        self.watchdog.start(container_id, watch_limits(self.policy))
        self.channels.audit_start(spec, container_id, restart, self.from_pool)

    # ------------------------------------------------------------------ credentials, pausing

    def bind_credential(self, name: str, domains: list[str], headers: dict[str, str], ttl: float = 0) -> None:
        """Have the egress proxy add ``headers`` to this kernel's requests to ``domains``
        (see :meth:`.kernel.egress.KernelEgress.bind`); the kernel never holds the values."""
        self.egress.bind(name, domains, headers, ttl)

    def revoke_credential(self, name: str) -> bool:
        """Stop adding the credential ``name`` to the kernel's requests at once; whether it was bound."""
        return self.egress.revoke(name)

    async def pause(self) -> Paused:
        """Save the idle kernel's whole sandbox, memory included, to disk and stop it. Clients
        notice nothing: the next message from any of them resumes the kernel (:meth:`resume`)
        and is delivered after. A kernel already paused stays so.

        Raises:
            PauseError: it could not be paused (it runs an execution, the host cannot
                checkpoint, the disk budget is spent...); it keeps running, nothing lost.
        """
        pausing = self.watchdog.freezer.thawed("pause", self.pauser.pause("asked"))  # none saves a frozen one
        return await asyncio.wrap_future(self.services.loop.submit(pausing))

    async def resume(self) -> None:
        """Start a paused kernel again from its checkpoint, with all its variables.

        Raises:
            PauseError: the sandbox could not be restored: the kernel is then stopped
                (its workspace intact) and a restart starts it fresh.
        """
        await asyncio.wrap_future(self.services.loop.submit(self.pauser.resume("asked")))

    # ------------------------------------------------------------------ lifecycle

    async def poll(self) -> int | None:
        """None while the container runs or the kernel is paused, else its exit code
        (cheap; never blocks the loop)."""
        container_id, exits = self.site.container_id, self.exits
        if container_id is None or exits.noted == container_id:
            default = 0 if container_id is None else 255
            return exits.code if exits.code is not None else default
        if self.pauser.suspended or self.backend.surely_running(container_id):
            return None  # paused, or the backend's event stream has not seen it end
        try:
            status, code = await self.backend.state(container_id)
        except SandboxKernelError as exc:
            self.log.warning("Cannot check sandboxed kernel %s: %s", self.kernel_id, exc)
            return None
        if code is None or self.pauser.suspended:  # (stopped by a pause that began meanwhile)
            return None
        await exits.note(container_id, code, status)
        return code

    async def wait(self) -> int | None:
        while True:
            if (code := await self.poll()) is not None:
                return code
            await asyncio.sleep(0.1)

    async def send_signal(self, signum: int) -> None:
        """Deliver ``signum`` to the kernel via the container's init (which forwards it), thawed
        first; while it is paused, or a pause or resume is under way, in turn with them."""
        if self.site.container_id is None or await asyncio.to_thread(self.holding.held_elsewhere_now):
            return
        with self.watchdog.freezer.kept_thawed("signal"):  # a frozen gVisor sandbox takes none
            if self.pauser.suspended:
                await asyncio.wrap_future(self.services.loop.submit(self.pauser.signal(signum)))
            elif self.site.container_id is not None:
                await self.backend.signal(self.site.container_id, signum)

    async def kill(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGKILL)

    async def terminate(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        """Remove the container; unless restarting, also the bridge and runtime folder.
        A kernel another process took over is left to it: only the bridge goes."""
        await asyncio.to_thread(self.holding.held_elsewhere_now)
        if not restart:
            self.channels.audit("shutdown")
        await self._teardown(keep_bridge=restart)
        if restart and self.taken_over is None:
            self.channels.accept()  # requests from now on wait for the next kernel, as with a local one

    async def _teardown(self, keep_bridge: bool) -> None:
        """Remove this kernel's container and files; the bridge's ports survive a restart.

        Raises:
            DockerOperationError: the container could not be removed (it is remembered,
                so a later cleanup retries).
        """
        failure: SandboxKernelError | None = None
        site = self.site
        self.watchdog.stop()
        self.pauser.forget()
        if site.container_id is not None:
            try:
                await self.backend.remove(site.container_id)
                site.container_id = None
            except SandboxKernelError as exc:
                self.log.error("Sandboxed kernel %s: %s", self.kernel_id, exc)
                failure = exc
        await self.egress.close()
        await self.channels.shut(*self.exits.teardown_answer(), keep_ports=keep_bridge)
        doomed = site.launch_dir if keep_bridge else site.runtime_dir
        if keep_bridge and site.runtime_dir is not None:
            # A pooled sandbox's workspace mount goes with it (the restart takes another
            # sandbox, pooled or cold), and a pinned workspace too (the restart pins it again,
            # checked again).
            for mounted in ("slot", PINNED_WORKSPACE):
                await asyncio.to_thread(detach_mounts, site.runtime_dir / mounted)
        if doomed is not None:
            await asyncio.to_thread(remove_tree, doomed)  # any number of files: never on the loop
        site.launch_dir = None
        if not keep_bridge:
            site.runtime_dir = None
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------ reconnecting

    async def _save_state(self) -> None:
        """Keep what a later process needs to reattach in the server-only runtime folder."""
        if self.site.runtime_dir is not None:
            info = await self.get_provisioner_info()
            await save_state(self.site.runtime_dir, self.kernel_name, info, self.kernel_spec, self.log)

    async def detach(self, save: bool = True) -> None:
        """Let go of a running kernel without stopping it: the bridge, watchdog and egress
        proxy stop here, the container and its runtime folder stay for whoever reattaches.
        A server stopping calls this for persistent kernels."""
        if save:
            await self._save_state()
        self.watchdog.stop()
        await self.egress.close()
        await self.channels.close(keep_ports=False)
        await self.channels.drop_bridge_dir()  # the kernel's sockets and state are in runtime_dir
        if self.site.runtime_dir is not None and not await asyncio.to_thread(self.holding.held_elsewhere_now):
            # Nobody holds it now: whoever reattaches next need not take it over.
            await asyncio.to_thread(write_owner, self.site.runtime_dir, NO_HOLDER)
        self.log.info("Sandboxed kernel %s detached; its container keeps running", self.kernel_id)
        self.site.forget()

    async def get_provisioner_info(self) -> dict[str, Any]:
        """What a later process needs to reach this same kernel again."""
        site, egress = self.site, self.egress
        state = ReattachState(
            site.container_id, site.runtime_dir, site.launch_dir, dict(self.connection_info),
            cwd=self._cwd, launch_env=self._launch_env, image=self.image, narrowed=self._narrowed,
            sandbox_env=self._sandbox_env, credential_expiry=egress.expiry,
            revoked_credentials=sorted(egress.revoked), paused=self.pauser.saved(), layout=site.layout(),
            user=self._user,
        )  # fmt: skip
        return {**await super().get_provisioner_info(), **state.to_dict()}

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        """Reattach to a running kernel: same container, same client ports."""
        await super().load_provisioner_info(provisioner_info)
        state, site = ReattachState.from_dict(provisioner_info), self.site
        site.loaded_layout = state.layout
        # The limits the running kernel has, for the watchdog and a later restart.
        self._narrowed, self._sandbox_env, self._user = state.narrowed, state.sandbox_env, state.user
        self.egress.restore(state.credential_expiry, state.revoked_credentials)
        config = kernelspec_config(self.kernel_spec) if self.kernel_spec is not None else {}
        self._policy = policy_for(self, self._narrowed, self.kernel_name, self._user, config)
        self.connection_info = state.connection_info  # type: ignore[assignment]
        site.container_id, site.runtime_dir = state.container_id, state.runtime_dir
        site.launch_dir, site.launches = state.launch_dir, state.launches
        self._cwd, self._launch_env = state.cwd, state.launch_env
        if site.launch_dir is not None:
            await self._reattach(state, site.launch_dir)
        if site.runtime_dir is not None:
            # Last, once all is in place: this process owns the kernel now.
            await asyncio.to_thread(write_owner, site.runtime_dir, self.holding.token)
            await self._save_state()

    async def _reattach(self, state: ReattachState, launch_dir: Path) -> None:
        """Bridge, egress, pause and watchdog of a kernel that outlived its last manager."""
        info, site = state.connection_info, self.site
        pub, sec = info.get("curve_publickey"), info.get("curve_secretkey")
        if pub and sec:
            self._curve = CurveKeys(public=str(pub).encode(), secret=str(sec).encode())
        policy = self.policy.egress_policy()  # the server's ceilings may have narrowed
        self.egress.reload(policy, self.policy.credential_specs(policy))
        session = self.link.session_key(info)
        moved = await self.channels.reopen(
            launch_dir, site.runtime_dir, session, self._curve, info, self.log.info
        )
        self.channels.ledger().user = self._user.name if self._user is not None else None
        self.connection_info = moved  # type: ignore[assignment]
        await self.egress.open(launch_dir, site.runtime_dir)
        await self.pauser.adopt(state.paused)
        if site.container_id:
            self.watchdog.start(site.container_id, watch_limits(self.policy))
            # The event stream tells of ends from now on; one before (a limit stopped it
            # while nobody held it) is known only from its state.
            _, code = await self.backend.state(site.container_id)
            if code is None and state.paused is not None:
                await self.resume()  # its last server died while pausing it, before the sandbox stopped
            elif code is not None and state.paused is None:
                await self.exits.note(site.container_id, code)
