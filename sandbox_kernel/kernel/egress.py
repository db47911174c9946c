"""One kernel's way out with network "allowlist": its CA, credentials and approvals.

:class:`KernelEgress` registers the kernel with the process's
:class:`~.egress.EgressProxy` (which dials the relay in its sandbox), keeps the kernel's
own CA (in its runtime folder: a pooled sandbox, a restart and a reattach find it
there), the credentials the proxy adds to its requests, and, with approval "egress", the
broker that asks the running cell's client. Without "allowlist" it does nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from sandbox_kernel.channels.approval import Answer, ApprovalBroker, ApprovalHandler, DeferredHandler
from sandbox_kernel.egress import ApprovalRequest, Decision, EgressPolicy
from sandbox_kernel.egress.ca import KernelCA
from sandbox_kernel.egress.credentials import BoundCredential, CredentialSpec, parse_definitions
from sandbox_kernel.errors import ConfigurationError, PauseError
from sandbox_kernel.kernel.channels import KernelChannels
from sandbox_kernel.plan.sandbox_spec import CONTAINER_EGRESS_SOCKET
from sandbox_kernel.services import PROCESS, Services


class KernelEgress:
    """The egress of one kernel, across its restarts.

    ``policy`` is None for a kernel without network "allowlist". ``save`` is called
    (from any thread) when what a reattaching process must know changed.
    """

    def __init__(
        self,
        kernel_id: str,
        channels: KernelChannels,
        log: logging.Logger | logging.LoggerAdapter[Any],
        save: Callable[[], object],
        services: Services = PROCESS,
    ) -> None:
        self.kernel_id = kernel_id
        self.policy: EgressPolicy | None = None
        self._channels = channels
        self._log = log
        self._save = save
        self._services = services
        self._ca: KernelCA | None = None
        # What the egress proxy adds to the kernel's requests (see bind); when each
        # configured one ends (its lifetime runs from the kernel's first start); the
        # configured ones revoked (they stay so across restarts).
        self.credentials: list[BoundCredential] = []
        self.expiry: dict[str, float | None] = {}
        self.revoked: set[str] = set()
        self._announced: set[str] = set()  # credentials the audit log says are bound
        #: With approval "egress": called (in a thread of its own) with an ApprovalRequest,
        #: returns "once", "kernel" or "deny" (or a DeferredHandler, asked for a future
        #: answer); unset: the client running the cell is asked on stdin (see
        #: sandbox_kernel.channels.approval).
        self.approval_handler: ApprovalHandler | DeferredHandler | None = None
        self.registered = False

    def restore(self, expiry: dict[str, float | None], revoked: list[str]) -> None:
        """What a reattached kernel's saved state says of its credentials."""
        self.expiry, self.revoked = dict(expiry), set(revoked)

    async def ca(self, runtime_dir: Path | None) -> KernelCA | None:
        """With network "allowlist": the kernel's CA, kept in its runtime folder."""
        if self.policy is None or runtime_dir is None:
            return None
        if self._ca is None:
            self._ca = await asyncio.to_thread(
                KernelCA.of_kernel, runtime_dir, self.kernel_id, self.policy.rules
            )
        return self._ca

    def forget_ca(self) -> None:
        """The kernel moved into a pooled sandbox (a restart): its CA is the one made with
        that sandbox, in the runtime folder the kernel has now."""
        self._ca = None

    def read_credentials(self, specs: tuple[CredentialSpec, ...]) -> None:
        """The configured credentials, values read now (a restart picks up a rotated file),
        each ending when it first would; then those a program bound, as they were.

        Raises:
            ConfigurationError: a value cannot be read.
        """
        program = {c.name: c for c in self.credentials if c.by == "api"}
        bound = []
        for spec in specs:
            if spec.name in program or spec.name in self.revoked:
                continue
            credential = BoundCredential.bind(spec, expires_at=self.expiry.get(spec.name))
            self.expiry.setdefault(spec.name, credential.expires_at)
            bound.append(credential)
        self.credentials = [*bound, *program.values()]

    def reload(self, policy: EgressPolicy | None, specs: tuple[CredentialSpec, ...]) -> None:
        """A reattached kernel: the policy and credentials this server defines now (its
        ceilings may have narrowed; one bound by the last holder's program is gone)."""
        self.policy = policy
        try:
            self.read_credentials(specs)
        except ConfigurationError as exc:
            self._log.warning("Sandboxed kernel %s gets no credentials: %s", self.kernel_id, exc)
            self.credentials = []

    async def open(self, launch_dir: Path, runtime_dir: Path | None) -> None:
        """Have the host's egress proxy dial this launch's relay."""
        if self.policy is None:
            return
        socket_path = launch_dir / Path(CONTAINER_EGRESS_SOCKET).name
        await asyncio.to_thread(
            self._services.egress.add_kernel,
            self.kernel_id,
            socket_path,
            self.policy,
            self._on_decision,
            await self.ca(runtime_dir),
            self.credentials,
            self._approver(),
        )
        self.registered = True
        auditor = self._channels.auditor
        for credential in self.credentials:
            if auditor is not None and credential.name not in self._announced:
                auditor.credential("bound", credential)  # once, not at every restart
                self._announced.add(credential.name)

    async def close(self) -> None:
        if self.registered:
            self.registered = False
            await asyncio.to_thread(self._services.egress.remove_kernel, self.kernel_id)

    async def suspend(self, suspended: bool) -> None:
        """Have the egress proxy let go of the kernel's relay for a pause (``suspended``),
        or dial it again (a failure to is logged: the kernel runs on, its requests to the
        network answered 503).

        Raises:
            PauseError: the proxy did not let go.
        """
        if not self.registered:
            return
        proxy = self._services.egress
        try:
            await asyncio.to_thread(
                proxy.suspend_kernel if suspended else proxy.resume_kernel, self.kernel_id
            )
        except (RuntimeError, concurrent.futures.TimeoutError) as exc:
            if suspended:
                msg = f"the egress proxy did not let go of the kernel ({exc!r})"
                raise PauseError(msg) from exc
            self._log.error("Sandboxed kernel %s: the egress proxy did not resume (%r)", self.kernel_id, exc)

    def _on_decision(self, decision: Decision) -> None:
        """One verdict of the egress proxy (its thread): into the audit log and the server's log."""
        auditor = self._channels.auditor
        logged = auditor.egress(decision) if auditor is not None else True
        if logged and decision.get("verdict") != "allowed":
            self._log.info(
                "Sandboxed kernel %s: egress to %s:%s denied (%s)",
                self.kernel_id,
                decision.get("host"),
                decision.get("port"),
                decision.get("reason"),
            )

    def _approver(self) -> Callable[[ApprovalRequest], concurrent.futures.Future[Answer]] | None:
        """With approval "egress": what the egress proxy asks, each answer (or its absence)
        an audit line."""
        auditor, signer, bridge = self._channels.auditor, self._channels.signer, self._channels.bridge
        if self.policy is None or self.policy.approval != "egress" or auditor is None:
            return None
        if signer is None or bridge is None:
            return None
        broker = ApprovalBroker(
            self.kernel_id, auditor, signer, partial(bridge.inject, "stdin"), lambda: self.approval_handler
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

    def bind(self, name: str, domains: list[str], headers: dict[str, str], ttl: float = 0) -> None:
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
        if self.policy is None or not self.registered:
            msg = (
                f"bind_credential({name!r}): kernel {self.kernel_id} is not running with network 'allowlist'"
            )
            raise ConfigurationError(msg)
        outside = spec.rules.uncovered_by(self.policy.rules)
        if outside:
            msg = (
                f"bind_credential({name!r}): {outside} are not in the kernel's allowed_domains "
                f"({list(self.policy.rules.patterns)!r}); a credential never widens egress."
            )
            raise ConfigurationError(msg)
        credential = BoundCredential.bind(spec, by="api")
        self._services.egress.bind_credential(self.kernel_id, credential)
        self.revoked.discard(name)
        self._save()  # for a process that reattaches
        self.credentials = [c for c in self.credentials if c.name != name] + [credential]
        if self._channels.auditor is not None:
            self._channels.auditor.credential("bound", credential)
            self._announced.add(name)

    def revoke(self, name: str) -> bool:
        """Stop adding the credential ``name`` to this kernel's requests, at once (open
        connections included); whether it was bound. Call it from any thread."""
        revoked = [c for c in self.credentials if c.name == name]
        self.credentials = [c for c in self.credentials if c.name != name]
        self.revoked.add(name)
        self._announced.discard(name)
        self._save()  # a reattach keeps it revoked
        found = self.registered and self._services.egress.revoke_credential(self.kernel_id, name)
        if revoked and self._channels.auditor is not None:
            self._channels.auditor.credential("revoked", revoked[0])
        return bool(found or revoked)
