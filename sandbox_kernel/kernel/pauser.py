"""Pausing one kernel: its whole sandbox saved to disk and stopped, started again when a
client's message comes (the steps, pure, are in :mod:`~.pausing`).

Pauses, resumes and signals take turns, on the background loop. While a pause or resume
is under way, or the kernel is paused, its stopped container is not its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.channels.bridge import KernelBridge
from sandbox_kernel.errors import PauseError, SandboxKernelError
from sandbox_kernel.host.cgroups import memory_usage
from sandbox_kernel.kernel.channels import KernelChannels
from sandbox_kernel.kernel.egress import KernelEgress
from sandbox_kernel.kernel.exits import Exits
from sandbox_kernel.kernel.site import KernelSite
from sandbox_kernel.lifecycle.launch_folder import seal
from sandbox_kernel.lifecycle.pausing import (
    Paused,
    check_budget,
    checkpoint_name,
    lend_launch_dir,
    relay_kept_its_sockets,
    wait_for_channels,
    wait_for_egress,
)
from sandbox_kernel.services import PROCESS, Services


class Pauser:
    """Pauses and resumes one kernel.

    ``save`` keeps what a reattaching process needs (a server killed mid-pause must
    leave a kernel its successor knows to resume); ``budget`` is the disk budget of
    paused kernels in bytes.
    """

    def __init__(
        self,
        site: KernelSite,
        backend: SandboxBackend,
        channels: KernelChannels,
        egress: KernelEgress,
        exits: Exits,
        save: Callable[[], Awaitable[None]],
        budget: Callable[[], int],
        log: logging.Logger | logging.LoggerAdapter[Any],
        services: Services = PROCESS,
    ) -> None:
        self._site = site
        self._backend = backend
        self._channels = channels
        self._egress = egress
        self._exits = exits
        self._save = save
        self._budget = budget
        self._log = log
        self._services = services
        #: The kernel's checkpoint while it is paused, else None.
        self.paused: Paused | None = None
        self.pending: Paused | None = None  # what a pause under way will be
        self.pausing = False
        self._lock: asyncio.Lock | None = None
        self.wake_due: str | None = None  # what woke the kernel meanwhile
        channels.on_wake = self.wake

    @property
    def kernel_id(self) -> str:
        return self._site.kernel_id

    @property
    def state(self) -> str:
        """One of running, pausing, paused or resuming (a pause or resume under way, or a
        client's message waiting for the paused kernel to wake)."""
        if self.paused is not None:
            return "resuming" if self.pausing or self.wake_due is not None else "paused"
        return "pausing" if self.pausing else "running"

    @property
    def suspended(self) -> bool:
        """Paused, or a pause or resume under way: the container's stop is not its end."""
        return self.paused is not None or self.pausing

    def saved(self) -> Paused | None:
        """What the kernel's saved state says of its pause (one under way included)."""
        return self.paused or self.pending

    def turns(self) -> asyncio.Lock:
        """The lock pauses, resumes and signals take turns with (background loop)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def wake(self, message: str) -> None:
        """A client's message (``message``: its channel and type) waits for the paused
        kernel (bridge thread): resume it."""
        if self.wake_due is not None:
            return
        self.wake_due = message
        if self.paused is not None:
            self._services.loop.submit(self._resume_quietly(f"a client's {message}"))

    async def _resume_quietly(self, why: str) -> None:
        try:
            await self.resume(why)
        except PauseError as exc:
            self._log.error("Sandboxed kernel %s: %s", self.kernel_id, exc)

    async def adopt(self, paused: Paused | None) -> None:
        """A reattached kernel that its saved state says is paused: the first client's
        message resumes it."""
        self.paused = paused
        if paused is None:
            return
        await self._egress.suspend(True)  # dialed again once it is back
        if self._channels.bridge is not None:
            self.wake_due = None
            self._channels.bridge.hold()

    def forget(self) -> None:
        """The sandbox is gone, and its checkpoint with it."""
        self.paused = None

    # ---------------------------------------------------------------- pausing

    async def pause(self, why: str) -> Paused:
        async with self.turns():
            if self.paused is not None:
                return self.paused
            container_id, bridge, launch_dir = (
                self._site.container_id,
                self._channels.bridge,
                self._site.launch_dir,
            )
            if (
                container_id is None
                or bridge is None
                or launch_dir is None
                or self._exits.noted == container_id
            ):
                msg = f"Kernel {self.kernel_id} is not running, so it cannot be paused."
                raise PauseError(msg)
            await self._backend.check_checkpoints()
            await self._check_budget(container_id)
            self.wake_due = None
            bridge.hold()
            if self._channels.busy():
                bridge.release()
                msg = f"Kernel {self.kernel_id} was not paused: it is working on a request. It keeps running."
                raise PauseError(msg)
            record = await self._save_and_stop(container_id, launch_dir, bridge, why)
        if self.wake_due is not None:  # a client's message came while it was being saved
            await self.resume(f"a client's {self.wake_due}")
        return record

    async def _save_and_stop(
        self, container_id: str, launch_dir: Path, bridge: KernelBridge, why: str
    ) -> Paused:
        self.pausing = True
        started = time.monotonic()
        name = checkpoint_name()
        # Said before it is done: a server killed meanwhile must leave a kernel its
        # successor knows to resume (or to reopen, if it never stopped), not one to prune.
        self.pending = Paused(name, None, time.time())
        signalled = False
        try:
            await self._save()
            await self._egress.suspend(True)
            # To the relays, via init: the channel relay stops the rest of the sandbox
            # first (kernel_relay.Holding), then closes its sockets.
            signalled = True
            await self._backend.signal(container_id, signal.SIGUSR1)
            await wait_for_channels(
                launch_dir,
                bound=False,
                held=functools.partial(self._backend.host_sockets, container_id),
                egress=self._egress.policy is not None,
            )
            size = await self._backend.checkpoint(container_id, name)
            # Paused before no longer pausing: poll (another thread) must never find a stopped
            # container that is neither, and take it for the kernel's end.
            self.paused = record = Paused(name, size, time.time())
            self.pending = None
        except (SandboxKernelError, OSError) as exc:
            self.pending = None
            raise await self._pause_failed(container_id, launch_dir, bridge, exc, signalled) from exc
        finally:
            self.pausing = False
        seconds = time.monotonic() - started
        self._channels.lifecycle("pause", reason=why, seconds=round(seconds, 3), checkpoint_bytes=size)
        self._log.info(
            "Sandboxed kernel %s paused in %.1f s (%s; image %s)",
            self.kernel_id,
            seconds,
            why,
            f"{size / 2**20:.0f} MiB" if size is not None else "size unknown",
        )
        await self._save()
        return record

    async def _check_budget(self, container_id: str) -> None:
        pid = await self._backend.main_pid(container_id)
        in_use = await asyncio.to_thread(memory_usage, pid) if pid else None
        used, free = await self._backend.checkpoint_usage()
        check_budget(self.kernel_id, in_use, used, free, self._budget())

    async def _pause_failed(
        self, container_id: str, launch_dir: Path, bridge: KernelBridge, exc: BaseException, signalled: bool
    ) -> PauseError:
        """The sandbox could not be saved: it runs on (bind its channels again if the
        relays were told to close them, pass on what came meanwhile), or, where the
        failure stopped it, the kernel has ended. The error that says why."""
        detail = str(exc)
        try:
            _, code = await self._backend.state(container_id)
        except SandboxKernelError:
            code = None
        if code is not None:
            reason = f"the pause failed and ended the kernel ({detail}); its workspace is intact"
            self._channels.lifecycle("pause", failed=detail)
            self._exits.plan(container_id, "PauseFailed", reason)
            bridge.drop_held()
            await self._exits.note(container_id, code or 1, "pause failed")
            return PauseError(f"Kernel {self.kernel_id}: {reason}. Restart it to start fresh.")
        try:
            held = functools.partial(self._backend.host_sockets, container_id)
            if signalled and not await relay_kept_its_sockets(launch_dir, held):
                await self._reopen_channels(container_id, launch_dir)
            else:  # its relays still hold their sockets: the folder is never lent
                await self._egress.suspend(False)
        except (SandboxKernelError, OSError) as again:
            detail += f"; and its channels could not be opened again ({again})"
            await self._egress.suspend(False)
        bridge.release()
        await self._save()  # not paused after all
        self._channels.lifecycle("pause", failed=detail)
        return PauseError(f"Kernel {self.kernel_id} could not be paused: {detail}. It keeps running.")

    # ---------------------------------------------------------------- resuming

    async def resume(self, why: str) -> None:
        async with self.turns():
            paused, container_id = self.paused, self._site.container_id
            bridge, launch_dir = self._channels.bridge, self._site.launch_dir
            if paused is None or container_id is None or bridge is None or launch_dir is None:
                return
            self.pausing = True
            started = time.monotonic()
            try:
                _, code = await self._backend.state(container_id)
                if code is not None:  # (else a pause its server did not live to finish)
                    await self._backend.restore(container_id, paused.checkpoint)
                    self._backend.unwatch_exits(container_id)  # it ended once: follow the new run
                    self._backend.watch_exits(container_id)
                await self._reopen_channels(container_id, launch_dir)
            except (SandboxKernelError, OSError) as exc:
                raise await self._resume_failed(container_id, paused, exc) from exc
            finally:
                self.pausing = False
            self.paused, self.wake_due = None, None
            bridge.release()
            seconds = time.monotonic() - started
            self._channels.lifecycle(
                "resume", reason=why, seconds=round(seconds, 3), paused_for=round(time.time() - paused.since)
            )
            self._log.info("Sandboxed kernel %s resumed in %.1f s (%s)", self.kernel_id, seconds, why)
            await self._save()
            try:
                await self._backend.remove_checkpoint(container_id, paused.checkpoint)
            except SandboxKernelError as exc:
                self._log.warning("Sandboxed kernel %s: %s (it goes with the container)", self.kernel_id, exc)

    async def _reopen_channels(self, container_id: str, launch_dir: Path) -> None:
        """Have the kernel's relay bind its host sockets again: in the launch folder lent
        to the kernel's uid for the while (every other process of the sandbox stopped
        since the pause began: see kernel_relay.Holding), sealed again once they are
        there, or once they did not come."""
        layout = self._site.layout()
        await asyncio.to_thread(lend_launch_dir, launch_dir, int(layout["uid"]), int(layout["gid"]))
        try:
            await self._backend.signal(container_id, signal.SIGUSR2)
            await wait_for_channels(launch_dir, bound=True)
            if self._egress.policy is not None and not await wait_for_egress(launch_dir):
                self._log.warning(
                    "Sandboxed kernel %s: its egress relay did not bind its socket again after the pause; "
                    "its requests to the network fail (503) until it does",
                    self.kernel_id,
                )
        finally:
            await asyncio.to_thread(seal, launch_dir)
        await self._egress.suspend(False)

    async def _resume_failed(self, container_id: str, paused: Paused, exc: BaseException) -> PauseError:
        """The sandbox could not be restored: the kernel has ended. Its clients are told
        why; a restart starts it fresh, with the workspace as it was. The error to raise."""
        self.paused = None
        if self._site.container_id != container_id:  # shut down meanwhile: nothing to report
            return PauseError(f"Kernel {self.kernel_id} was shut down while it resumed")
        reason = (
            f"the paused kernel could not be resumed ({exc}); its variables are lost, its workspace "
            "is intact. Restart the kernel to start it fresh"
        )
        self._channels.lifecycle("resume", failed=str(exc), checkpoint=paused.checkpoint)
        self._exits.plan(container_id, "ResumeFailed", reason)
        with contextlib.suppress(SandboxKernelError):
            await self._backend.signal(container_id, signal.SIGKILL)
        if self._channels.bridge is not None:
            self._channels.bridge.drop_held()
        await self._exits.note(container_id, 1, "not resumed")
        return PauseError(f"Kernel {self.kernel_id}: {reason}.")

    # ---------------------------------------------------------------- signals

    async def signal(self, signum: int) -> None:
        """Deliver ``signum`` once no pause or resume is under way (background loop). A
        paused kernel is idle (an interrupt has nothing to stop) and stopped: a kill or
        terminate ends its pause, and it."""
        async with self.turns():
            container_id = self._site.container_id
            if container_id is None:
                return
            if self.paused is None:
                await self._backend.signal(container_id, signum)
            elif signum in (signal.SIGKILL, signal.SIGTERM):
                self.paused = None
                if self._channels.bridge is not None:
                    self._channels.bridge.drop_held()
                await self._exits.note(container_id, 128 + signum, "stopped while paused")
