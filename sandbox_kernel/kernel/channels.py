"""One kernel's channels on the host: its bridge, its ledger of executions, and the
messages the host sends on the kernel's behalf.

:class:`KernelChannels` owns the :class:`~.bridge.KernelBridge` (the client-facing
ports, kept across restarts), the :class:`~.audit.ExecutionAuditor` that watches the
shell traffic (and writes the audit log), and the signer of what the host itself tells
clients: a notice, an error reply for an execution whose kernel is gone. It knows nothing
of containers or pausing: the provisioner tells it where the kernel's sockets are.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from jupyter_client.session import Session

from sandbox_kernel.channels.audit import AuditLog, ExecutionAuditor, PendingExecution
from sandbox_kernel.channels.bridge import CHANNELS, CurveKeys, KernelBridge
from sandbox_kernel.channels.output import OutputLimiter
from sandbox_kernel.channels.sanitize import OutputSanitizer
from sandbox_kernel.channels.wire import stderr_notice
from sandbox_kernel.lifecycle.ownership import remove_tree, server_identity
from sandbox_kernel.plan.limits import size_bytes
from sandbox_kernel.plan.sandbox_spec import SandboxSpec, kernel_sockets
from sandbox_kernel.plan.settings import SandboxSettings

#: Seconds a client's request (a completion, say) may take, awaiting its reply, before
#: the kernel's CPU counts as computing on its own again.
REQUEST_CPU_CREDIT = 10.0
#: Seconds the bridge is given to pass on what is queued before the host answers for a
#: kernel (its own reply, still in flight, must win) or before the bridge moves.
SETTLE = 0.1


@dataclass(frozen=True)
class ChannelSettings:
    """What the channels are made with (the kernel's settings)."""

    kernel_id: str
    kernel_name: str
    client_transport: str = "tcp"
    output_limit: str = ""
    safe_output: bool = True
    audit_log: str = ""
    audit_log_max_bytes: int = 0
    audit_log_backups: int = 0

    @classmethod
    def of(cls, settings: SandboxSettings, kernel_id: str, kernel_name: str) -> ChannelSettings:
        return cls(
            kernel_id,
            kernel_name,
            settings.client_transport,
            settings.output_limit,
            settings.safe_output,
            settings.audit_log,
            settings.audit_log_max_bytes,
            settings.audit_log_backups,
        )


class KernelChannels:
    """The bridge, the ledger and the host's own messages of one kernel.

    ``with_manager``: a kernel manager drives the kernel (its clients get the host's
    notices and the output cap); False for a bare provisioner in tests.
    """

    def __init__(self, settings: ChannelSettings, *, with_manager: bool = True) -> None:
        self.settings = settings
        self.with_manager = with_manager
        self.bridge: KernelBridge | None = None
        self.auditor: ExecutionAuditor | None = None
        # Signs the host's own messages to clients (notices, replies for the dead).
        self.signer: Session | None = None
        #: Called (bridge thread) when a client's message waits for a held kernel.
        self.on_wake: Callable[[str], None] | None = None
        # While the kernel is not running (and nobody restarts it): the error that new
        # executions get at once, instead of waiting for a kernel that is not there.
        self.refusal: tuple[str, str] = ("KernelDied", "the kernel is not running")
        #: The runtime folder the bridge was made in, once a restart from the pool moved
        #: the kernel into its sandbox's: removed when the bridge goes.
        self.bridge_dir: Path | None = None

    # ---------------------------------------------------------------- the ledger

    def ledger(self) -> ExecutionAuditor:
        """The kernel's auditor, made (and its audit log opened) on first use."""
        if self.auditor is None:
            s = self.settings
            log_file = (
                AuditLog.open(s.audit_log, s.audit_log_max_bytes, s.audit_log_backups)
                if s.audit_log
                else None
            )
            self.auditor = ExecutionAuditor(log_file, s.kernel_id, s.kernel_name)
            self.auditor.on_refused = lambda execution: self.answer_for_kernel(execution, *self.refusal)
            self.auditor.on_lost = lambda execution: self.answer_for_kernel(execution, *execution.lost)
        return self.auditor

    def lifecycle(self, event: str, **details: Any) -> None:
        """An audit line for what the host did to the kernel (none before the ledger exists)."""
        if self.auditor is not None:
            self.auditor.lifecycle(event, **details)

    def audit(self, event: str, **details: Any) -> None:
        """:meth:`lifecycle`, with this process's identity."""
        self.lifecycle(event, owner=server_identity(), server_uid=os.getuid(), **details)

    def audit_start(self, spec: SandboxSpec, container_id: str, restart: bool, pooled: bool) -> None:
        """The audit log's line for a (re)start: which sandbox, for whom, started by which process."""
        self.audit(
            "restart" if restart else "start",
            container=container_id[:12],
            image=spec.image,
            runtime=spec.runtime,
            uid=spec.uid,
            workspace=str(spec.workspace),
            pooled=pooled,
        )

    def executing(self) -> list[tuple[str, dict[str, Any]]]:
        """For the output cap: the requests the host knows are running, one per shell,
        the first begun first (bridge thread)."""
        return self.auditor.executing() if self.auditor is not None else []

    def busy(self) -> bool:
        """An execution or another request of a client awaits the kernel's reply."""
        running = self.auditor is not None and self.auditor.current() is not None
        return running or (self.bridge is not None and self.bridge.requests_in_flight(REQUEST_CPU_CREDIT))

    def refuse(self, ename: str, reason: str) -> None:
        """From now on, answer every new execution with ``ename``: ``reason`` at once and
        pass it on to no kernel (until :meth:`accept`)."""
        self.refusal = (ename, reason)
        if self.auditor is not None:
            self.auditor.refuse(reason)

    def accept(self) -> None:
        """A kernel runs (or is about to): requests wait for it again."""
        if self.auditor is not None:
            self.auditor.refuse(None)

    # ---------------------------------------------------------------- the bridge

    async def open(
        self,
        launch_dir: Path,
        runtime_dir: Path | None,
        session: tuple[bytes, str],
        curve: CurveKeys | None,
        ports: dict[str, int] | None = None,
        ip: str | None = None,
    ) -> dict[str, int]:
        """Connect the bridge to this launch's sockets; create it on the first launch.

        ``ports`` and ``ip`` are the client-facing addresses to bind again (reattaching);
        an ipc ``ip`` must lie in the kernel's runtime folder.

        Raises:
            zmq.ZMQError: an address is taken.
        """
        endpoints = {channel: f"ipc://{path}" for channel, path in kernel_sockets(launch_dir).items()}
        if self.bridge is not None:
            await asyncio.to_thread(self.bridge.attach, endpoints)
            return self.bridge.ports
        auditor = self.ledger()
        key, scheme = session
        limiter = sanitizer = None
        if self.with_manager:
            self.signer = Session(key=key, signature_scheme=scheme)
            limiter = OutputLimiter(
                size_bytes("output_limit", self.settings.output_limit), self.signer, self.executing
            )
        if self.settings.safe_output:
            sanitizer = OutputSanitizer(self.signer or Session(key=key, signature_scheme=scheme))
        self.bridge = KernelBridge(
            endpoints,
            ip=self._client_ip(ip, runtime_dir),
            ports=ports,
            curve=curve,
            tap=auditor,
            output_limiter=limiter,
            sanitizer=sanitizer,
            transport=self.settings.client_transport,
            key=key,
            signature_scheme=scheme,
            meter_folder=runtime_dir,
        )
        self.bridge.on_wake = self._wake
        return self.bridge.start()

    def _client_ip(self, ip: str | None, runtime_dir: Path | None) -> str:
        if self.settings.client_transport != "ipc":
            return "127.0.0.1"
        if ip is None or runtime_dir is None or Path(ip).parent != runtime_dir:
            ip = str(runtime_dir / "client") if runtime_dir else None
        if ip is None:
            msg = "the kernel's runtime folder is not set up"
            raise RuntimeError(msg)
        return ip

    def _wake(self, message: str) -> None:
        if self.on_wake is not None:
            self.on_wake(message)

    async def point_nowhere(self, folder: Path, token: str) -> None:
        """Relay to sockets nobody binds: requests still reach the ledger, which answers them."""
        if self.bridge is not None:
            nowhere = folder / f"let-go-{token}"
            await asyncio.to_thread(self.bridge.attach, {c: f"ipc://{nowhere}-{c}" for c in CHANNELS})

    async def close(self, *, keep_ports: bool) -> None:
        """Drop the kernel-facing sockets with whatever was queued for the kernel (a
        shutdown_request, say, must never reach the next one); unless ``keep_ports``,
        stop the bridge."""
        if self.bridge is None:
            return
        await asyncio.to_thread(self.bridge.detach if keep_ports else self.bridge.stop)
        if not keep_ports:
            self.bridge = None

    async def shut(self, ename: str, reason: str, *, keep_ports: bool) -> None:
        """The kernel's sandbox is gone: whoever still waits for a reply gets one
        (``ename``: ``reason``), then :meth:`close`; unless ``keep_ports``, the folder the
        bridge was made in goes too."""
        if self.answer_pending(ename, reason):
            await asyncio.sleep(SETTLE)  # let the bridge send them before it detaches
        await self.close(keep_ports=keep_ports)
        # A request the relay passed on meanwhile went to the dead kernel and is lost: its
        # client hears why (once the bridge relays again); it must not run the next kernel's clocks.
        self.answer_pending(ename, reason)
        if not keep_ports:
            await self.drop_bridge_dir()

    async def drop_bridge_dir(self) -> None:
        if self.bridge_dir is not None:
            await asyncio.to_thread(remove_tree, self.bridge_dir)
            self.bridge_dir = None

    async def reopen(
        self,
        launch_dir: Path,
        runtime_dir: Path | None,
        session: tuple[bytes, str],
        curve: CurveKeys | None,
        info: dict[str, Any],
        log: Callable[..., None],
    ) -> dict[str, Any]:
        """A reattached kernel's bridge, on its client ports (``info``: its connection info)
        again; where another process holds them, or the transport changed, on new ones,
        which the connection info returned says."""
        ports = {c: int(info[f"{c}_port"]) for c in CHANNELS}
        unusable: str | None = None
        if info.get("transport") != self.settings.client_transport:
            unusable = "the server's client_transport changed"
        else:
            try:
                await self.open(launch_dir, runtime_dir, session, curve, ports, str(info.get("ip", "")))
            except zmq.ZMQError as exc:
                unusable = str(exc)  # taken: another process holds the kernel too
                self.bridge = None
        if unusable is None:
            return info
        log("Sandboxed kernel %s: %s unavailable (%s)", self.settings.kernel_id, ports, unusable)
        spare = None  # an ipc prefix no other bridge of the kernel uses
        if self.settings.client_transport == "ipc" and runtime_dir is not None:
            spare = str(runtime_dir / f"client-{secrets.token_hex(3)}")
        fresh = await self.open(launch_dir, runtime_dir, session, curve, ip=spare)
        return {**info, **self._addresses(fresh)}

    def _addresses(self, ports: dict[str, int]) -> dict[str, Any]:
        bridge = self.bridge
        return {
            "transport": bridge.transport if bridge else self.settings.client_transport,
            "ip": bridge.ip if bridge else "127.0.0.1",
            **{f"{channel}_port": port for channel, port in ports.items()},
        }

    def client_info(
        self, ports: dict[str, int], session: tuple[bytes, str], curve: CurveKeys | None, kernel_name: str
    ) -> dict[str, Any]:
        """The connection info clients get: the bridge's transport, address and ports, the
        session's key and scheme, the Curve keys if any."""
        info = {**self._addresses(ports), "key": session[0], "signature_scheme": session[1]}
        info["kernel_name"] = kernel_name
        if curve is not None:
            info["curve_publickey"] = curve.public.decode("ascii")
            info["curve_secretkey"] = curve.secret.decode("ascii")
        return info

    def notice(self, text: str) -> None:
        """A line on the kernel's stderr from the host, for every client."""
        bridge, signer = self.bridge, self.signer
        if bridge is not None and signer is not None:
            bridge.inject("iopub", stderr_notice(signer, text, None))

    # ---------------------------------------------------------------- answering for the kernel

    async def abandon(self, ename: str, reason: str) -> None:
        """Record unfinished executions, and answer their clients on the kernel's behalf,
        once the kernel has exited: a client waiting for a reply from a kernel that is gone
        would wait forever (or until its own timeout, with no idea why)."""
        if self.auditor is None:
            return
        # Whatever the kernel sent before it died passes first: a real reply in flight wins.
        # With nothing waiting (a shutdown, a restart between cells) there is nothing to
        # win: the kernel's end is told at once (poll waits for this, and restarts with it).
        if self.auditor.idle_for() is None:
            await asyncio.sleep(2 * SETTLE)
        self.answer_pending(ename, reason)

    def answer_pending(self, ename: str, reason: str) -> int:
        """Record every execution still waiting for its reply and answer its client;
        how many there were."""
        if self.auditor is None:
            return 0
        abandoned = self.auditor.abandon_pending(f"no reply: {reason}")
        for execution in abandoned:
            self.answer_for_kernel(execution, ename, reason)
        return len(abandoned)

    def answer_for_kernel(self, execution: PendingExecution, ename: str, reason: str) -> None:
        """Tell the client of ``execution`` why no reply will come: a notice, an error reply, idle."""
        bridge, signer = self.bridge, self.signer  # another thread may be tearing down
        if bridge is None or signer is None:
            return
        parent = execution.header
        bridge.inject("iopub", stderr_notice(signer, reason, parent))
        content = {"status": "error", "ename": ename, "evalue": reason, "traceback": [f"{ename}: {reason}"]}
        reply = signer.msg("execute_reply", {**content, "execution_count": None}, parent)
        bridge.inject("shell", signer.serialize(reply, ident=execution.idents))
        idle = signer.msg("status", {"execution_state": "idle"}, parent)
        bridge.inject("iopub", signer.serialize(idle, ident=[b"status"]))
