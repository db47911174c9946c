"""What JupyterLab shows an analyst about a sandboxed kernel: a jupyter_server extension.

``GET /api/sandbox-kernel/kernels/<kernel_id>`` answers, for a kernel of this server,
which sandbox it runs in, its policy and limits, the memory it uses now, whether it is
paused, and whether a limit stopped it::

    {"sandboxed": true, "runtime": "gVisor", "docker_runtime": "runsc-sandbox-kernel",
     "image": "sandbox-kernel/python:latest", "network": "none", "allowed_domains": [],
     "approved_domains": [], "approval": null,
     "limits": {"memory": "2g", "cpus": 1.0, "pids": 256, "tmp_size": "256m", ...},
     "memory": {"used": 157286400, "limit": 2147483648},
     "state": "running", "frozen": false, "stopped": null}

``approved_domains`` are those the analyst allowed at an approval question ("kernel"),
``approval`` is ``{"timeout": seconds}`` for a kernel that asks (approval ``egress``).
``state`` is "running", "pausing", "paused" (saved to disk, its container stopped) or
"resuming" (a client's message is waking it). ``frozen`` is true while a running kernel,
quiet a while, is frozen (it uses no CPU; a client's next message thaws it in milliseconds).

``stopped`` is the last time a limit stopped the kernel (``{"ename":
"MemoryLimitExceeded", "limit": "memory", "reason": ..., "time": ..., "age": seconds,
"current": true}``; ``current`` is false once the kernel runs again). A kernel another
provisioner runs gets ``{"sandboxed": false}``; an unknown id, 404. The package enables
the extension (``etc/jupyter/jupyter_server_config.d/sandbox_kernel.json``), and its
prebuilt JupyterLab extension shows this in the status bar.

Under a server running as root, the extension also makes the server's file manager
write (and read) in a folder of another user as that user, so what JupyterLab creates
there is theirs and their kernel's to change (see :mod:`~.contents`).
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.serverapp import ServerApp
from jupyter_server.utils import url_path_join
from tornado import web

from sandbox_kernel.egress import EgressProxy
from sandbox_kernel.errors import SandboxKernelError
from sandbox_kernel.host.cgroups import memory_usage
from sandbox_kernel.jupyter.contents import own_the_servers_files
from sandbox_kernel.jupyter.gateway_client import GatewayKernelStatusHandler, use_gateway_client
from sandbox_kernel.jupyter.server_audit import use_audited_connections
from sandbox_kernel.plan.limits import size_bytes
from sandbox_kernel.provisioner import LimitStop, SandboxProvisioner

RUNTIME = "gVisor"
#: Which limit each kind of stop is, in the words the status bar uses ("stopped: memory limit").
STOPPED_BY = {
    "MemoryLimitExceeded": "memory",
    "WallClockLimitExceeded": "wall-clock",
    "IdleLimitExceeded": "idle",
}


def describe(
    provisioner: SandboxProvisioner,
    memory_used: int | None,
    now: float,
    approved: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Build the endpoint's answer for a sandboxed kernel (``now``: ``time.time()``;
    ``approved``: the domains its holder allowed at a question, see :func:`approved_domains`)."""
    policy = provisioner.policy  # the running kernel's: its settings, narrowed by its start
    network = str(policy.network)
    allowlist = network == "allowlist"
    asks = allowlist and policy.approval == "egress"
    return {
        "sandboxed": True,
        "runtime": RUNTIME,
        "docker_runtime": policy.docker_runtime,
        "image": policy.image,
        "network": network,
        "allowed_domains": list(policy.allowed_domains) if allowlist else [],
        "approved_domains": list(approved) if allowlist else [],
        "approval": {"timeout": policy.approval_timeout} if asks else None,
        "limits": {**policy.limits.as_dict(), "output_limit": policy.output_limit},
        "memory": {"used": memory_used, "limit": size_bytes("memory", policy.memory)},
        "state": provisioner.sleep_state,
        "frozen": provisioner.watchdog.freezer.frozen,
        "stopped": _stopped(provisioner.limit_stop, provisioner.container_id, now),
    }


def approved_domains(provisioner: SandboxProvisioner) -> tuple[str, ...]:
    """Return the domains the holder of an allow-list kernel allowed at a question."""
    if str(provisioner.policy.network) != "allowlist" or provisioner.kernel_id is None:
        return ()
    return EgressProxy.instance().approved_domains(str(provisioner.kernel_id))


def _stopped(stop: LimitStop | None, container_id: str | None, now: float) -> dict[str, Any] | None:
    if stop is None:
        return None
    return {
        "ename": stop.ename,
        "limit": STOPPED_BY.get(stop.ename, stop.ename),
        "reason": stop.reason,
        "time": datetime.fromtimestamp(stop.time, timezone.utc).isoformat(timespec="seconds"),
        "age": round(max(0.0, now - stop.time), 1),
        # Still the kernel's state, or history: it has been restarted since.
        "current": stop.container_id == container_id,
    }


class MemoryGauge:
    """Memory a sandboxed kernel uses now, from the host's memory cgroup of its container.

    Finding the container's main process takes a Docker call, so that is asked once per
    container; the cgroup files are cheap to read.
    """

    #: Containers remembered at most (a server's kernels come and go).
    MAX_CONTAINERS = 256

    def __init__(self) -> None:
        self._pids: dict[str, int] = {}

    async def used(self, provisioner: SandboxProvisioner) -> int | None:
        """Bytes charged to the kernel's container; None while it does not run (or is
        paused), or if unknown."""
        container_id = provisioner.container_id
        if container_id is None or provisioner.exit_code is not None:
            return None
        if provisioner.paused is not None:  # resumed, it runs as another process
            self._pids.pop(container_id, None)
            return None
        pid = self._pids.get(container_id)
        if pid is not None:
            used = memory_usage(pid)
            if used is not None:
                return used
            del self._pids[container_id]  # gone (resumed meanwhile, say): ask again
        try:
            pid = await provisioner.backend.main_pid(container_id)
        except SandboxKernelError:
            return None
        if pid is None:
            return None
        if len(self._pids) >= self.MAX_CONTAINERS:
            self._pids.clear()
        self._pids[container_id] = pid
        return memory_usage(pid)


#: The kernel status route. The group is named, as jupyter_server's kernel routes name
#: theirs, so that an Authorizer sees whose kernel is asked for (``path_kwargs``).
KERNEL_STATUS_PATH = r"api/sandbox-kernel/kernels/(?P<kernel_id>[^/]+)"


class KernelSandboxHandler(APIHandler):
    """``GET /api/sandbox-kernel/kernels/<kernel_id>``: see the module's docstring."""

    auth_resource = "kernels"

    def initialize(self, gauge: MemoryGauge) -> None:
        self.gauge = gauge

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        """Answer with the sandbox of kernel ``kernel_id``.

        Raises:
            HTTPError: 404 if this server has no kernel ``kernel_id``.
        """
        kernels = self.kernel_manager
        if kernel_id not in kernels:
            raise web.HTTPError(404, f"Kernel does not exist: {kernel_id}")
        provisioner = kernels.get_kernel(kernel_id).provisioner
        if not isinstance(provisioner, SandboxProvisioner):
            self.finish({"sandboxed": False})
            return
        used = await self.gauge.used(provisioner)
        self.finish(describe(provisioner, used, time.time(), approved_domains(provisioner)))


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "sandbox_kernel.jupyter.lab"}]


def _load_jupyter_server_extension(serverapp: ServerApp) -> None:
    web_app = serverapp.web_app
    pattern = url_path_join(web_app.settings["base_url"], KERNEL_STATUS_PATH)
    handlers: list[tuple[str, type[APIHandler], dict[str, Any]]]
    if serverapp.gateway_config.gateway_enabled:  # the kernels, and their sandboxes, are the gateway's
        use_gateway_client(serverapp)
        handlers = [(pattern, GatewayKernelStatusHandler, {})]
        serverapp.log.info("sandbox-kernel: kernel status at %s, from the sandbox gateway", pattern)
    else:
        handlers = [(pattern, KernelSandboxHandler, {"gauge": MemoryGauge()})]
        serverapp.log.info("sandbox-kernel: kernel status at %s", pattern)
    web_app.add_handlers(".*$", handlers)  # type: ignore[no-untyped-call]  # untyped upstream
    if use_audited_connections(web_app.settings):
        serverapp.log.info("sandbox-kernel: the audit log names each kernel connection's authenticated user")
    if os.geteuid() == 0:
        manager = serverapp.contents_manager
        if own_the_servers_files(manager, getattr(manager, "checkpoints", None)):
            serverapp.log.info(
                "sandbox-kernel: running as root, the server writes and reads in a folder of "
                "another user as that user (see sandbox_kernel.jupyter.contents)"
            )
        else:
            serverapp.log.warning(
                "sandbox-kernel: running as root with %s, which sandbox-kernel does not extend: what "
                "the server creates in users' folders stays root's, read-only to their kernels",
                type(manager).__name__,
            )
