"""What a sandbox is made of, whatever runs it: the spec, its paths, labels and environment.

A :class:`SandboxSpec` is the plan's result (see :mod:`~.plan`): immutable, and the same
for every backend; :mod:`~.docker_args` turns it into Docker's create arguments.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_kernel.errors import ConfigurationError

#: Where the workspace is mounted, and the kernel's working directory below it.
CONTAINER_WORKSPACE = "/workspace"

#: Per-kernel host folder holding the kernel's connection file and ipc sockets.
CONTAINER_RUNTIME_DIR = "/run/sandbox-kernel"

CONTAINER_CONNECTION_FILE = f"{CONTAINER_RUNTIME_DIR}/connection.json"

#: ipykernel binds ``ipc://{IPC_PREFIX}-{port}`` for each channel.
IPC_PREFIX = f"{CONTAINER_RUNTIME_DIR}/kernel"

IPC_PORTS: Mapping[str, int] = {"shell": 1, "iopub": 2, "stdin": 3, "control": 4, "hb": 5}

LABEL_MANAGED = "io.sandbox-kernel.managed"

LABEL_KERNEL_ID = "io.sandbox-kernel.kernel-id"

LABEL_KERNELSPEC = "io.sandbox-kernel.kernelspec"

LABEL_RUNTIME_DIR = "io.sandbox-kernel.runtime-dir"

LABEL_OWNER = "io.sandbox-kernel.owner"

LABEL_WORKSPACE = "io.sandbox-kernel.workspace"

#: "ephemeral" or "persistent" (outlives its server), the persistent one's time-to-live
#: once no server holds it (seconds, 0: none), and the uid of the server that may adopt it.
LABEL_LIFECYCLE = "io.sandbox-kernel.lifecycle"

LABEL_TTL = "io.sandbox-kernel.ttl"

LABEL_SERVER_UID = "io.sandbox-kernel.server-uid"

#: Which server may adopt a persistent kernel: its kernel manager's scope (root folder).
LABEL_SCOPE = "io.sandbox-kernel.scope"

#: The user a sandbox gateway started the kernel for (their name; none outside a gateway).
LABEL_USER = "io.sandbox-kernel.user"

#: On a named volume's labels: the volume was made for sandbox-kernel workspaces, by
#: a server of this uid; no other volume is ever mounted.
LABEL_VOLUME = "io.sandbox-kernel.workspace-volume"

LABEL_VOLUME_UID = "io.sandbox-kernel.workspace-volume-uid"
#: On a workspace volume a sandbox gateway made for one of its users: that user's name.
#: Only that user's kernels mount it, and a volume without it is no gateway user's.
LABEL_VOLUME_USER = "io.sandbox-kernel.workspace-volume-user"

#: On a pooled sandbox: made before its kernel (see :mod:`~.pool`); its name says
#: whether a kernel has claimed it (``sandbox-kernel-pool-*`` until then).
LABEL_POOL = "io.sandbox-kernel.pool"

POOL_NAME_PREFIX = "sandbox-kernel-pool-"

#: Environment the sandbox always gets, whatever the server's: the root filesystem is
#: read-only, so everything that wants a writable home uses the /tmp tmpfs.
#: PYTHONSAFEPATH (Python 3.11+) keeps the working folder, which the kernel writes, off
#: sys.path while the kernel starts: ``python -m ipykernel_launcher`` would otherwise
#: run an ``ipykernel_launcher.py`` (or ``zmq.py``...) planted there by an earlier
#: kernel, before its runtime folder is sealed. The start-up code puts the folder back
#: once the kernel is up (see :mod:`~.in_kernel_startup`).
FIXED_ENV: Mapping[str, str] = {
    "HOME": "/tmp",
    "IPYTHONDIR": "/tmp/.ipython",
    "MPLCONFIGDIR": "/tmp/.matplotlib",
    "PYTHONUNBUFFERED": "1",
    "PYTHONSAFEPATH": "1",
}

#: Environment the sandbox gets unless the kernelspec (or ``pass_env``) says otherwise:
#: the kernel's uid has no entry in the image's passwd, and ``getpass.getuser()``
#: (which some libraries call) reads these before it asks passwd and fails.
DEFAULT_ENV: Mapping[str, str] = {"USER": "sandbox", "LOGNAME": "sandbox"}

#: The kernel's effective limits, as JSON, for code in the sandbox to read.
POLICY_ENV = "SANDBOX_KERNEL_POLICY"

#: Variables of sandbox-kernel's own in the sandbox (its policy, claim socket, relay's pid):
#: only the host sets them, never a kernelspec's or a start's environment.
RESERVED_ENV_PREFIX = "SANDBOX_KERNEL_"

#: Never passed, even when a kernelspec or the allow-list names them: ipykernel exits
#: when the process JPY_PARENT_PID names is not its parent, which inside a container
#: it never is.
NEVER_PASSED_ENV = frozenset({"JPY_PARENT_PID"})

#: Where the kernel finds its start-up code (clear messages for its limits): a stub
#: (:mod:`~sandbox_kernel.inside.in_kernel`) that runs the module beside it
#: (:mod:`~sandbox_kernel.inside.in_kernel_startup`).
CONTAINER_STARTUP_FILE = f"{CONTAINER_RUNTIME_DIR}/startup.py"
CONTAINER_STARTUP_MODULE = f"{CONTAINER_RUNTIME_DIR}/in_kernel_startup.py"

#: The kernel itself: ipykernel's application, with one socket option more (see
#: :mod:`~sandbox_kernel.inside.kernel_app`).
CONTAINER_KERNEL_APP_FILE = f"{CONTAINER_RUNTIME_DIR}/kernel_app.py"
#: The kernel's parent in the sandbox: binds its channels' host sockets (see
#: :mod:`~sandbox_kernel.inside.kernel_relay`), lends the kernel shell's and IOPub's, and
#: takes them back before a pause, so that the sandbox then holds none.
CONTAINER_KERNEL_RELAY_FILE = f"{CONTAINER_RUNTIME_DIR}/kernel_relay.py"
#: The kernel binds its channels here, on the sandbox's own loopback: below gVisor's
#: ephemeral ports (16000-65535), which an outgoing connection made while the kernel
#: starts (the relay's readiness probe) could otherwise hold.
KERNEL_TCP_PORTS: Mapping[str, int] = {channel: 15000 + number for channel, number in IPC_PORTS.items()}

#: With network "allowlist": the in-sandbox relay, the unix socket the host's egress
#: proxy dials into, and the loopback port programs use as their HTTP(S) proxy.
CONTAINER_RELAY_FILE = f"{CONTAINER_RUNTIME_DIR}/egress_relay.py"

CONTAINER_EGRESS_SOCKET = f"{CONTAINER_RUNTIME_DIR}/egress.sock"
#: The kernel's egress CA certificate (the host keeps its key), which the relay makes the
#: kernel's TLS clients trust (see egress/ca.py).
CONTAINER_EGRESS_CA = f"{CONTAINER_RUNTIME_DIR}/egress-ca.pem"

#: A pooled sandbox's kernel listens here for its claim: working folder and session env.
CONTAINER_CLAIM_SOCKET = f"{CONTAINER_RUNTIME_DIR}/claim.sock"

CLAIM_ENV = "SANDBOX_KERNEL_CLAIM"

#: Launch variables that differ from one kernel to the next of one kernelspec: a pooled
#: sandbox gets them when it is claimed; every other variable is fixed when it starts.
PER_KERNEL_ENV = ("JPY_SESSION_NAME",)

EGRESS_PROXY_PORT = 3128


@dataclass(frozen=True)
class SandboxSpec:
    """Everything needed to create one kernel's container."""

    kernel_id: str
    kernelspec: str
    image: str
    runtime: str
    command: list[str]
    env: dict[str, str]
    workspace: Path
    workdir: str
    runtime_dir: Path
    uid: int
    gid: int
    memory: str = "2g"
    cpus: float = 1.0
    pids: int = 256
    tmp_size: str = "256m"
    file_size: str = "4g"
    #: A named Docker volume mounted as the workspace instead of the ``workspace`` folder.
    volume: str | None = None
    extra_labels: dict[str, str] = field(default_factory=dict)
    #: Where the workspace appears inside: /workspace, or /workspace/<folder name> for a
    #: kernelspec with a pool (see :func:`pooled_workspace_path`).
    workspace_path: str = CONTAINER_WORKSPACE
    #: A pooled sandbox's empty slot folder, mounted at /workspace so that the workspace
    #: can be attached under it once a kernel claims the sandbox (see :mod:`~.mounts`).
    slot: Path | None = None
    #: For a gateway's user: their root folder (resolved). The workspace is then *pinned*:
    #: opened from a descriptor, every folder from this one down to it the kernel's uid's,
    #: and mounted from that descriptor on ``staging``; it is never mounted by its path (see
    #: :func:`~sandbox_kernel.host.mounts.pin_folder`).
    owned_from: Path | None = None
    #: Where a pinned workspace is mounted for the sandbox: a root-only folder in the
    #: kernel's runtime folder, which Docker (or a pooled sandbox's claim) mounts instead.
    staging: Path | None = None

    @property
    def container_name(self) -> str:
        if self.slot is not None:
            return f"{POOL_NAME_PREFIX}{self.kernel_id}"
        return f"sandbox-kernel-{self.kernel_id}"

    @property
    def labels(self) -> dict[str, str]:
        labels = {
            LABEL_MANAGED: "true",
            LABEL_KERNEL_ID: self.kernel_id,
            LABEL_KERNELSPEC: self.kernelspec,
            LABEL_RUNTIME_DIR: str(self.runtime_dir),
            LABEL_WORKSPACE: f"volume:{self.volume}" if self.volume else str(self.workspace),
            **self.extra_labels,
        }
        if self.slot is not None:
            labels[LABEL_POOL] = "true"
            labels[LABEL_WORKSPACE] = "(attached when claimed)"
        return labels


def sandbox_env(
    env: Mapping[str, str], pass_env: Iterable[str], kernelspec_env: Iterable[str]
) -> dict[str, str]:
    """The environment the kernel gets: an allow-list, never the server's whole env.

    ``env`` is the launch environment (the server's, with the kernelspec's ``env``
    applied); only names in ``pass_env`` or set by the kernelspec itself survive, never
    one of sandbox-kernel's own (``SANDBOX_KERNEL_*``: the sandbox's, set by the host).
    This is the one filter of what a start sets; a pooled sandbox's claim gets what it
    lets through too (see :mod:`~sandbox_kernel.pool.fit`).
    """
    allowed = {
        name
        for name in (set(pass_env) | set(kernelspec_env)) - NEVER_PASSED_ENV
        if not name.startswith(RESERVED_ENV_PREFIX)
    }
    result = dict(DEFAULT_ENV)
    result.update({name: env[name] for name in sorted(allowed) if name in env})
    result.update(FIXED_ENV)
    return result


#: The module a sandboxed kernelspec's argv runs (``python -m sandbox_kernel.launch``).
LAUNCHER_MODULE = "sandbox_kernel.launch"
#: What runs in the sandbox for a kernelspec whose argv is the launcher: ipykernel's
#: application (:mod:`~sandbox_kernel.inside.kernel_app`). IPython's history
#: database is kept in memory: its file would be on the sandbox's /tmp, gone with the kernel
#: anyway (a restart is a new sandbox), and writing it costs every cell a wake-up of
#: IPython's history thread and some sixty system calls (four fdatasyncs), a few
#: milliseconds under gVisor. ``%history`` and clients' ``history_request`` answer as before.
SANDBOXED_KERNEL_ARGV = (
    "python",
    CONTAINER_KERNEL_APP_FILE,
    "-f",
    "{connection_file}",
    "--HistoryManager.hist_file=:memory:",
)


def launcher_argv(kernel_name: str, python: str = sys.executable) -> list[str]:
    """A sandboxed kernelspec's argv: the launcher, for the kernelspec ``kernel_name``."""
    return [python, "-m", LAUNCHER_MODULE, "--kernel", kernel_name, "-f", "{connection_file}"]


def is_launcher(argv: Sequence[str]) -> bool:
    """Whether a kernelspec's argv runs sandbox-kernel's launcher."""
    return any(a == "-m" and b == LAUNCHER_MODULE for a, b in itertools.pairwise(argv))


#: The kernel application's option for a kernel without subshells (setting ``subshells``).
NO_SUBSHELLS_ARG = "--SandboxedKernelApp.subshells=False"


def kernel_command(
    argv: Sequence[str], extra_arguments: Sequence[str] = (), *, subshells: bool = True
) -> list[str]:
    """The command run in the container, from the kernelspec's ``argv``; with
    ``subshells=False``, the launcher's kernel reads the shell channel in its main thread.

    ``km.format_kernel_cmd`` would swap ``python`` for the server's interpreter and use
    the host path of the connection file, so the command is built here instead.
    """
    if not argv:
        msg = (
            "The kernelspec's argv is empty; it must run ipykernel, e.g. python -m "
            f"{LAUNCHER_MODULE} --kernel NAME -f {{connection_file}} (see sandbox_kernel.launch)"
        )
        raise ConfigurationError(msg)
    if is_launcher(argv):
        # What a front end that ignores provisioners runs on the host (see
        # sandbox_kernel.launch); in the sandbox it is the kernel itself.
        argv = SANDBOXED_KERNEL_ARGV if subshells else (*SANDBOXED_KERNEL_ARGV, NO_SUBSHELLS_ARG)
    elif not subshells:
        msg = (
            "subshells is false (in the kernelspec's provisioner config or the server's), "
            f"which only a kernelspec whose argv runs sandbox-kernel's launcher (python -m "
            f"{LAUNCHER_MODULE} ...) can have; this one runs {' '.join(argv[:3])} ...: set "
            "subshells: true in it, or use the launcher's argv."
        )
        raise ConfigurationError(msg)
    return [arg.replace("{connection_file}", CONTAINER_CONNECTION_FILE) for arg in argv] + list(
        extra_arguments
    )


def _interpreter(cmd: Sequence[str]) -> str:
    """What runs a relay before ``cmd``: its interpreter when ``argv[0]`` names one (the
    one Python the image surely has), else the image's ``python3``."""
    return cmd[0] if Path(cmd[0]).name.startswith("python") else "python3"


def relay_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` (the kernel) as the child of the channel relay, which binds its channels'
    host sockets once the kernel listens on the sandbox's loopback."""
    python = _interpreter(cmd)
    channels = [
        f"{channel}={IPC_PREFIX}-{IPC_PORTS[channel]}:{port}" for channel, port in KERNEL_TCP_PORTS.items()
    ]
    return [python, CONTAINER_KERNEL_RELAY_FILE, *channels, "--", *cmd]


def egress_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` behind the egress relay, which starts first (trusting the kernel's egress
    CA) and then runs ``cmd``."""
    return [
        _interpreter(cmd),
        CONTAINER_RELAY_FILE,
        CONTAINER_EGRESS_SOCKET,
        str(EGRESS_PROXY_PORT),
        "--ca",
        CONTAINER_EGRESS_CA,
        "--",
        *cmd,
    ]


def proxy_env() -> dict[str, str]:
    """The variables that send HTTP(S) clients (urllib, requests, pip, curl) to the relay."""
    url = f"http://127.0.0.1:{EGRESS_PROXY_PORT}"
    names = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
    return {
        **dict.fromkeys(names, url),
        "NO_PROXY": "localhost,127.0.0.1,::1",
        "no_proxy": "localhost,127.0.0.1,::1",
    }


def kernel_sockets(launch_dir: Path) -> dict[str, Path]:
    """Host path of each channel's ipc socket, as the kernel binds them in ``launch_dir``."""
    return {channel: launch_dir / f"{Path(IPC_PREFIX).name}-{port}" for channel, port in IPC_PORTS.items()}


def container_connection_info(key: bytes, signature_scheme: str, kernel_name: str) -> dict[str, Any]:
    """The connection file the kernel reads inside the sandbox: its channels on the
    sandbox's loopback, where the channel relay connects."""
    return {
        "transport": "tcp",
        "ip": "127.0.0.1",
        **{f"{channel}_port": port for channel, port in KERNEL_TCP_PORTS.items()},
        "key": key.decode("ascii"),
        "signature_scheme": signature_scheme,
        "kernel_name": kernel_name,
    }
