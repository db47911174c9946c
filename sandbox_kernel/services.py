"""The process-wide parts every kernel of a process shares, in one injectable place.

A server (or program) runs one watchdog loop, one egress proxy, one warm pool and one
reaper of orphaned kernels for all its kernels. A kernel's parts (see
:mod:`~.kernel`) reach them through a :class:`Services`, never through the classes'
``instance()``: the process's own by default (each made on first use, so a process that
never needs the egress proxy never starts it), a test's where it hands its own.
"""

from __future__ import annotations

from sandbox_kernel.egress import EgressProxy
from sandbox_kernel.host.background import BackgroundLoop
from sandbox_kernel.lifecycle.ownership import OrphanReaper
from sandbox_kernel.pool.sandboxes import SandboxPool


class Services:
    """The loop, egress proxy, pool and reaper a kernel uses; None: the process's."""

    def __init__(
        self,
        *,
        loop: BackgroundLoop | None = None,
        egress: EgressProxy | None = None,
        pool: SandboxPool | None = None,
        reaper: OrphanReaper | None = None,
    ) -> None:
        self._loop, self._egress, self._pool, self._reaper = loop, egress, pool, reaper

    @property
    def loop(self) -> BackgroundLoop:
        """Where watchdogs, pauses and other background work of the kernels run."""
        return self._loop or BackgroundLoop.instance()

    @property
    def egress(self) -> EgressProxy:
        """The egress proxy of kernels with network "allowlist"."""
        return self._egress or EgressProxy.instance()

    @property
    def pool(self) -> SandboxPool:
        """The warm pool of sandboxes waiting for kernels."""
        return self._pool or SandboxPool.instance()

    @property
    def reaper(self) -> OrphanReaper:
        """What removes kernels whose owners died, while the process watches kernels."""
        return self._reaper or OrphanReaper.instance()


#: The process's own.
PROCESS = Services()
