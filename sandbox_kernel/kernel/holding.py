"""Which manager drives a kernel, and letting go when another takes it over.

A kernel's owner file (see :mod:`~.ownership`) names the one manager that drives it; a
process that reattaches with ``take_over=True`` writes its own token there. The manager
that held it notices (:meth:`Holding.elsewhere`, a stat per look), forgets the sandbox at
once (nothing here may remove or signal it from then on), answers its clients with the
reason, and says it has let go (see :mod:`~.reattach`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import Path
from typing import Any

from sandbox_kernel.kernel.channels import SETTLE, KernelChannels
from sandbox_kernel.kernel.egress import KernelEgress
from sandbox_kernel.kernel.manager import ManagerLink
from sandbox_kernel.kernel.site import KernelSite
from sandbox_kernel.lifecycle.ownership import (
    OWNER_FILE,
    Holder,
    read_holder,
    server_identity,
    write_released,
)


class Holding:
    """This manager's hold on one kernel."""

    def __init__(
        self,
        site: KernelSite,
        channels: KernelChannels,
        egress: KernelEgress,
        link: ManagerLink,
        log: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        self._site = site
        self._channels = channels
        self._egress = egress
        self._link = link
        self._log = log
        #: This manager's token in the kernel's owner file: the one manager driving it.
        self.token = secrets.token_hex(8)
        self._seen: tuple[int, int] | None = None
        #: Set once another process took the kernel over: why this one no longer drives it.
        self.taken_over: str | None = None

    def elsewhere(self) -> Holder | None:
        """Whoever took this kernel over (another process or manager), or None while this
        manager holds it. Reads the owner file only when it changed."""
        runtime_dir = self._site.runtime_dir
        if runtime_dir is None:
            return None
        try:
            st = (runtime_dir / OWNER_FILE).stat()
        except OSError:
            return None
        seen = (st.st_ino, st.st_mtime_ns)
        if seen == self._seen:
            return None
        holder = read_holder(runtime_dir)
        if holder is None or (holder.identity == server_identity() and holder.token in ("", self.token)):
            self._seen = seen
            return None
        return holder

    def _lose(self, holder: Holder) -> Path | None:
        """The kernel is another's now: forget its container and folders at once, refuse
        executions with the reason. Returns the runtime folder that was this manager's."""
        runtime_dir = self._site.forget()
        reason = (
            f"this kernel was taken over by {holder}, which drives it now; this program no longer "
            "does (reattach with take_over=True to take it back)"
        )
        # The watchdog's thread lets go while others read: whoever sees taken_over set
        # finds the refusal in place already.
        self._channels.refuse("KernelTakenOver", reason)
        self.taken_over = reason
        self._log.warning("Sandboxed kernel %s: taken over by %s; letting go", self._site.kernel_id, holder)
        return runtime_dir

    def held_elsewhere_now(self) -> bool:
        """Before anything that removes, signals or relaunches the kernel (blocking): if
        another holder took it over (say while this manager's watchdog was not running),
        let go instead."""
        if self.taken_over is not None:
            return True
        if self._site.runtime_dir is None:
            return False
        self._seen = None  # read it now, changed or not
        holder = self.elsewhere()
        if holder is None:
            return False
        runtime_dir = self._lose(holder)
        if runtime_dir is not None:
            write_released(runtime_dir, holder.token)
        return True

    async def let_go(self, holder: Holder) -> None:
        """Another process took the kernel over: stop driving it. Its container runs on,
        untouched; this manager's clients get an error at once for every execution, and
        the kernel's output no longer reaches them."""
        runtime_dir = self._lose(holder)
        self._channels.answer_pending("KernelTakenOver", self._channels.refusal[1])
        await asyncio.sleep(SETTLE)  # let the bridge send the answers before it moves
        await self._egress.close()
        if runtime_dir is not None:
            await self._channels.point_nowhere(runtime_dir, self.token)
        self._link.stop_restarter(until_start=False)  # nothing here to restart
        if runtime_dir is not None:
            await asyncio.to_thread(write_released, runtime_dir, holder.token)
