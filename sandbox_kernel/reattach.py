"""Reattaching to sandboxed kernels that outlived the process that started them.

A persistent kernel (``"lifecycle": "persistent"``) keeps running when the program or
server that started it exits, even when killed. Any later process of the same user on
the same host can drive it again, with its variables intact::

    from sandbox_kernel.reattach import reattach_kernel

    km = await reattach_kernel(kernel_id)  # an AsyncKernelManager for the same kernel
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready()

The kernel's owner keeps what this needs in the kernel's private runtime folder, so the
kernel id is enough (``jupyter sandbox-kernel list`` shows it); the state carries the
kernelspec too, so the reattaching process need not see it. A program can also keep the
state itself: ``state = await kernel_state(km)`` is a JSON-able dict, and
``reattach_kernel(state)`` takes it. It holds the kernel's session key: store it privately.
:func:`reattach_kernel_blocking` gives a blocking ``KernelManager`` instead.

A kernel has one holder at a time: two programs relaying one kernel's channels would
each lose replies to the other. Reattaching to a kernel that a live process drives raises
:class:`~sandbox_kernel.errors.KernelHeldError` naming it; ``take_over=True`` takes the
kernel from it instead: its watchdog lets go within a second (its executions then get a
``KernelTakenOver`` error at once, its session API raises
:class:`~sandbox_kernel.errors.KernelTakenOverError`) and the kernel, untouched, answers
the newcomer.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from jupyter_client.connect import port_names
from jupyter_client.kernelspec import KernelSpec
from jupyter_client.manager import AsyncKernelManager, KernelManager
from jupyter_client.provisioning.factory import KernelProvisionerFactory
from jupyter_core.utils import run_sync

from sandbox_kernel.backends import configured_backend
from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.errors import KernelHeldError, KernelNotFoundError, PauseError
from sandbox_kernel.lifecycle.ownership import (
    NO_HOLDER,
    SandboxedKernel,
    list_kernels,
    own_runtime_dir,
    read_holder,
    read_state,
    released,
    server_identity,
    write_owner,
)
from sandbox_kernel.lifecycle.pausing import ask_holder, describe
from sandbox_kernel.plan.users import START_ARGUMENT
from sandbox_kernel.provisioner import SandboxProvisioner

M = TypeVar("M", bound=KernelManager)

#: Seconds a holder has to let go of a kernel taken over from it (its watchdog looks
#: twice a second).
TAKE_OVER_TIMEOUT = 10.0


async def kernel_state(km: KernelManager) -> dict[str, Any]:
    """What :func:`reattach_kernel` needs to drive ``km``'s kernel from another process.

    Raises:
        TypeError: ``km`` does not run a sandboxed kernel.
    """
    provisioner = km.provisioner
    if not isinstance(provisioner, SandboxProvisioner):
        msg = f"kernel {km.kernel_id} is not a sandboxed kernel (its provisioner is {provisioner!r})"
        raise TypeError(msg)
    return {
        "kernel_id": km.kernel_id,
        "kernel_name": km.kernel_name,
        "provisioner_info": await provisioner.get_provisioner_info(),
    }


async def saved_state(
    kernel_id: str, docker: SandboxBackend | None = None, runtime_parent: str | None = None
) -> dict[str, Any]:
    """The reattach state a sandboxed kernel's owner keeps, found by kernel id (or a prefix).

    ``runtime_parent`` is ``SandboxProvisioner.runtime_parent`` if the server set one.

    Raises:
        KernelNotFoundError: no such kernel runs on this Docker host, several match, or
            its state is unreadable (another user's kernel).
        DockerUnavailableError: the daemon cannot be reached.
    """
    kernels = [
        k for k in await list_kernels(docker or configured_backend()) if k.kernel_id.startswith(kernel_id)
    ]
    if len(kernels) != 1:
        found = "no sandboxed kernel" if not kernels else f"{len(kernels)} sandboxed kernels"
        msg = f"{found} with an id starting with {kernel_id!r}; see `jupyter sandbox-kernel list`."
        raise KernelNotFoundError(msg)
    (kernel,) = kernels
    state = await asyncio.to_thread(load_state, kernel, runtime_parent)
    if state is None:
        msg = (
            f"Sandboxed kernel {kernel.kernel_id} has no reattach state this user may use in "
            f"{Path(kernel.runtime_dir).parent}: it belongs to another user, its runtime folder is "
            "not where this process expects (SandboxProvisioner.runtime_parent), or it is too old."
        )
        raise KernelNotFoundError(msg)
    return state


def load_state(kernel: SandboxedKernel, runtime_parent: str | None = None) -> dict[str, Any] | None:
    """``kernel``'s reattach state, from a runtime folder of this user only (see
    :func:`~sandbox_kernel.lifecycle.ownership.own_runtime_dir`), for this kernel only."""
    folder = own_runtime_dir(kernel.runtime_dir, runtime_parent)
    state = read_state(folder) if folder is not None else None
    if state is None or state.get("kernel_id") != kernel.kernel_id:
        return None
    info = state.get("provisioner_info")
    if not isinstance(info, dict) or info.get("container_id") != kernel.container_id:
        return None  # e.g. a server killed mid-restart: the state names the old container
    return state


async def attach_manager(km: KernelManager, state: Mapping[str, Any], take_over: bool = False) -> None:
    """Make ``km`` (fresh, never started) the manager of the running kernel in ``state``:
    bridge, watchdog and egress proxy start here, the kernel is untouched.

    Raises:
        KernelHeldError: a live process (or another manager of this one) drives the
            kernel, and ``take_over`` is false.
    """
    km.kernel_id = str(state["kernel_id"])
    info = dict(state["provisioner_info"])
    spec = state.get("kernelspec")
    if isinstance(spec, dict):
        km._kernel_spec = KernelSpec(**spec)
    # The session key first: the provisioner signs its own messages with the manager's.
    km.load_connection_info(info["connection_info"])
    provisioner = KernelProvisionerFactory.instance(parent=km.parent).create_provisioner_instance(
        km.kernel_id, km.kernel_spec, parent=km
    )
    if not isinstance(provisioner, SandboxProvisioner):
        msg = f"kernelspec {km.kernel_name!r} does not use the sandbox-provisioner"
        raise KernelNotFoundError(msg)
    runtime_dir = info.get("runtime_dir")
    if runtime_dir:
        await _become_holder(km.kernel_id, Path(runtime_dir), provisioner, take_over)
    try:
        await provisioner.load_provisioner_info(info)
    except BaseException:
        await provisioner.detach(save=False)  # nothing half-attached stays; the kernel runs on
        if runtime_dir:  # and nobody holds it: a later try need not take it over
            await asyncio.to_thread(write_owner, Path(runtime_dir), NO_HOLDER)
        raise
    km.provisioner = provisioner
    # The addresses may have changed (another process holds the old ones): load them anew.
    for name in port_names:
        setattr(km, name, 0)
    km.load_connection_info(provisioner.connection_info)
    # What a restart relaunches with: the kernel's folder, its notebook and user.
    env = {**os.environ, **dict(info.get("launch_env") or {})}
    launch_args: dict[str, Any] = {"cwd": info.get("cwd") or os.getcwd(), "env": env, **provisioner._narrowed}
    if provisioner._sandbox_env:
        launch_args["sandbox_env"] = provisioner._sandbox_env
    if provisioner.user is not None:  # a gateway's kernel restarts for the same user
        launch_args[START_ARGUMENT] = provisioner.user
    km._launch_args = launch_args
    # As if started here: later shutdowns and restarts each get a fresh "ready" future.
    km._attempted_start = True
    if not km.ready.done():
        km.ready.set_result(None)
    km.start_restarter()
    km._connect_control_socket()


async def _become_holder(
    kernel_id: str, runtime_dir: Path, provisioner: SandboxProvisioner, take_over: bool
) -> None:
    """Make ``provisioner`` the kernel's one holder; with ``take_over``, once the live
    holder has let go (or died)."""
    holder = await asyncio.to_thread(read_holder, runtime_dir)
    if holder is None or not holder.alive or holder.token == NO_HOLDER:
        return
    if holder.identity == server_identity() and not holder.token:
        return  # this process made it and has not handed it to a manager yet (a pool)
    if not take_over:
        msg = (
            f"Sandboxed kernel {kernel_id} is driven by {holder}, which is alive: two programs "
            "driving one kernel break each other. Stop that program (or shut the kernel down "
            "there), or reattach with take_over=True to take the kernel from it (its calls then "
            "fail with KernelTakenOver)."
        )
        raise KernelHeldError(msg)
    await asyncio.to_thread(write_owner, runtime_dir, provisioner.holding.token)
    deadline = asyncio.get_running_loop().time() + TAKE_OVER_TIMEOUT
    while not released(runtime_dir, provisioner.holding.token) and holder.alive:
        if asyncio.get_running_loop().time() > deadline:
            provisioner.log.warning(
                "Sandboxed kernel %s: %s did not let go within %g s; taking it over anyway",
                kernel_id,
                holder,
                TAKE_OVER_TIMEOUT,
            )
            break
        await asyncio.sleep(0.1)


async def reattach_kernel(
    kernel: str | Mapping[str, Any], *, take_over: bool = False, **kwargs: Any
) -> AsyncKernelManager:
    """An ``AsyncKernelManager`` driving the already running sandboxed kernel ``kernel``:
    its kernel id (or a unique prefix), or a state from :func:`kernel_state`.

    ``take_over``: take the kernel from the live process driving it (see above).
    ``kwargs`` go to the manager (e.g. ``config=``).

    Raises:
        KernelHeldError: a live process drives the kernel (the message names it).
        KernelNotFoundError: no such kernel, or its state is unreadable.
        SandboxKernelError: the kernel's container is gone or Docker is unreachable.
    """
    return await _reattach(kernel, AsyncKernelManager, kwargs, take_over)


def reattach_kernel_blocking(
    kernel: str | Mapping[str, Any], *, take_over: bool = False, **kwargs: Any
) -> KernelManager:
    """:func:`reattach_kernel` for blocking code: returns a ``KernelManager``."""
    manager: KernelManager = run_sync(_reattach)(kernel, KernelManager, kwargs, take_over)
    return manager


async def _reattach(
    kernel: str | Mapping[str, Any], manager_class: type[M], kwargs: dict[str, Any], take_over: bool
) -> M:
    state = await saved_state(kernel) if isinstance(kernel, str) else kernel
    km = manager_class(kernel_name=str(state["kernel_name"]), **kwargs)
    await attach_manager(km, state, take_over)
    return km


async def pause_kernel(kernel_id: str, *, resume: bool = False, timeout: float = 900.0) -> str:
    """Pause the sandboxed kernel ``kernel_id`` (or a unique prefix) to disk, or
    ``resume`` it, from any process of its server's user; what was done.

    The process that drives the kernel does it (asked through the kernel's private
    runtime folder; its clients notice only a delay); a persistent kernel nobody drives
    is adopted here for the while.

    Raises:
        PauseError: it could not be paused (it keeps running) or resumed; or its holder
            did not answer within ``timeout`` seconds.
        KernelNotFoundError: no such kernel of this user.
    """
    state = await saved_state(kernel_id)
    action = "resume" if resume else "pause"
    runtime_dir = Path(str(state["provisioner_info"].get("runtime_dir") or ""))
    holder = await asyncio.to_thread(read_holder, runtime_dir)
    if holder is not None and holder.alive and holder.token != NO_HOLDER:
        done, said = await asyncio.to_thread(ask_holder, runtime_dir, action, timeout)
        if not done:
            raise PauseError(said)
        return said
    km = await reattach_kernel(state)
    provisioner = km.provisioner
    assert isinstance(provisioner, SandboxProvisioner)  # noqa: S101 - reattach_kernel made it so
    try:
        if resume:
            await provisioner.resume()
            return "resumed"
        return f"paused ({describe(await provisioner.pause())})"
    finally:
        km.stop_restarter()
        await provisioner.detach()
