"""Pure translation of a kernel's sandbox settings into Docker ``create`` arguments.

Nothing here talks to Docker or starts anything, so the hardening can be unit-tested on
the dictionaries it produces (the model is docker-py's ``_create_container_args``).
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from docker.types import Mount, Ulimit

from .errors import ConfigurationError, WorkspaceError
from .limits import size_bytes

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
#: On a named volume's labels: the volume was made for sandbox-kernel workspaces, by
#: a server of this uid; no other volume is ever mounted.
LABEL_VOLUME = "io.sandbox-kernel.workspace-volume"
LABEL_VOLUME_UID = "io.sandbox-kernel.workspace-volume-uid"
#: On a pooled sandbox: made before its kernel (see :mod:`~.pool`); its name says
#: whether a kernel has claimed it (``sandbox-kernel-pool-*`` until then).
LABEL_POOL = "io.sandbox-kernel.pool"
POOL_NAME_PREFIX = "sandbox-kernel-pool-"

#: The uid (and gid) a kernel runs as when neither the server user nor the workspace
#: owner is a usable (non-root) uid. Files the kernel writes belong to it on the host, so
#: it must be nobody's: not 1000 (the first human account on most hosts), not 65534
#: (``nobody``, which NFS and many daemons use), but 65533, in the range Debian policy
#: (9.2.2) reserves and never allocates (65000-65533). A host that gave it to an account
#: is refused at kernel start (see :func:`check_default_uid_unused`).
DEFAULT_KERNEL_UID = 65533

#: Environment the sandbox always gets, whatever the server's: the root filesystem is
#: read-only, so everything that wants a writable home uses the /tmp tmpfs.
#: PYTHONSAFEPATH (Python 3.11+) keeps the working folder, which the kernel writes, off
#: sys.path while the kernel starts: ``python -m ipykernel_launcher`` would otherwise
#: run an ``ipykernel_launcher.py`` (or ``zmq.py``...) planted there by an earlier
#: kernel, before its runtime folder is sealed. The start-up code puts the folder back
#: once the kernel is up (see :mod:`~.in_kernel`).
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
#: Never passed, even when a kernelspec or the allow-list names them: ipykernel exits
#: when the process JPY_PARENT_PID names is not its parent, which inside a container
#: it never is.
NEVER_PASSED_ENV = frozenset({"JPY_PARENT_PID"})

#: System calls refused inside the sandbox (EPERM), on top of gVisor's own isolation.
#: Links and device nodes first: the host's own code (jupyter_server saving a notebook,
#: the bridge reconnecting a socket) follows paths in folders the kernel can write, so
#: the kernel must not be able to make a path there lead anywhere else. The rest is
#: defence in depth: nothing a notebook needs, everything an escape attempt tries.
DENIED_SYSCALLS = (
    "symlink", "symlinkat", "link", "linkat", "mknod", "mknodat",
    "mount", "umount2", "pivot_root", "unshare", "setns", "ptrace",
    "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key", "kexec_load", "init_module", "finit_module",
    "delete_module", "acct", "swapon", "swapoff", "reboot", "syslog",
    "open_by_handle_at", "name_to_handle_at",
)  # fmt: skip
#: Mode bits refused wherever the kernel gives a file a mode. gVisor lets a file's owner
#: set them and the host honours them: a copy of python made setuid in the workspace
#: would run as the kernel's host uid for any local user who starts it; a setgid or
#: sticky folder changes what the host's own users' files there become.
SPECIAL_MODE_BITS = (stat.S_ISUID, stat.S_ISGID, stat.S_ISVTX)
#: System calls taking a mode, with the index of their mode argument and, for those
#: that only create with O_CREAT, of their flags. ``fchmodat2`` (Linux 6.6) is not in
#: runsc 20240729's table: runsc skips names it does not know (the call is ENOSYS
#: there), and the rule takes effect in a runsc that implements it.
MODE_SYSCALLS: Mapping[str, tuple[int, int | None]] = {
    "chmod": (1, None),
    "fchmod": (1, None),
    "fchmodat": (2, None),
    "fchmodat2": (2, None),
    "mkdir": (1, None),
    "mkdirat": (2, None),
    "creat": (1, None),
    "open": (2, 1),
    "openat": (3, 2),
}
#: Calls whose mode seccomp cannot read (it sits in memory, not in an argument): refused
#: as unimplemented, so that programs fall back to ``openat``. runsc 20240729 has none
#: of them (ENOSYS anyway, and their names are skipped); a later one honours this.
UNREADABLE_MODE_SYSCALLS = ("openat2", "io_uring_setup")


def _seccomp_profile() -> str:
    """The seccomp profile given to Docker; runsc applies it with --oci-seccomp.

    seccomp compares arguments but cannot test "any of these bits set", so each special
    bit gets a rule of its own (``SCMP_CMP_MASKED_EQ``: mode & bit == bit); conditions
    on different arguments of one rule must all hold (O_CREAT and the bit).
    """
    rules: list[dict[str, Any]] = [
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
        {"names": list(UNREADABLE_MODE_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    for name, (mode_index, flags_index) in MODE_SYSCALLS.items():
        for bit in SPECIAL_MODE_BITS:
            args = [{"index": mode_index, "value": bit, "valueTwo": bit, "op": "SCMP_CMP_MASKED_EQ"}]
            if flags_index is not None:
                creates = {"index": flags_index, "value": os.O_CREAT, "valueTwo": os.O_CREAT}
                args.insert(0, {**creates, "op": "SCMP_CMP_MASKED_EQ"})
            rules.append({"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM, "args": args})
    return json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules}, separators=(",", ":"))


SECCOMP_PROFILE = _seccomp_profile()

#: Keys a kernelspec may set in ``metadata.kernel_provisioner.config``.
KERNELSPEC_KEYS = frozenset(
    {
        "image",
        "memory",
        "cpus",
        "pids",
        "tmp_size",
        "file_size",
        "exec_timeout",
        "idle_timeout",
        "network",
        "allowed_domains",
        "workspace_root",
        "workspace_volume",
        "lifecycle",
        "persistent_ttl",
        "pass_env",
        "pool_size",
    }
)
#: Where the kernel finds its start-up code (clear messages for its limits).
CONTAINER_STARTUP_FILE = f"{CONTAINER_RUNTIME_DIR}/startup.py"
#: With network "allowlist": the in-sandbox relay, the unix socket the host's egress
#: proxy dials into, and the loopback port programs use as their HTTP(S) proxy.
CONTAINER_RELAY_FILE = f"{CONTAINER_RUNTIME_DIR}/egress_relay.py"
CONTAINER_EGRESS_SOCKET = f"{CONTAINER_RUNTIME_DIR}/egress.sock"
#: A pooled sandbox's kernel listens here for its claim: working folder and session env.
CONTAINER_CLAIM_SOCKET = f"{CONTAINER_RUNTIME_DIR}/claim.sock"
CLAIM_ENV = "SANDBOX_KERNEL_CLAIM"
#: Launch variables that differ from one kernel to the next of one kernelspec: a pooled
#: sandbox gets them when it is claimed; every other variable is fixed when it starts.
PER_KERNEL_ENV = ("JPY_SESSION_NAME",)
EGRESS_PROXY_PORT = 3128

#: Host folders that are never mounted as a workspace, nor is anything inside them.
_SYSTEM_TREES = tuple(
    Path(p)
    for p in (
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/lib",
        "/lib32",
        "/lib64",
        "/proc",
        "/run",
        "/sbin",
        "/sys",
        "/usr",
        "/var/run",
        "/var/lib/docker",
        "/var/lib/containerd",
        "/var/log",
        "/var/spool",
        "/var/mail",
        "/var/backups",
    )
)
#: Folders never mounted themselves (their subfolders may hold projects).
_SYSTEM_DIRS = frozenset(
    Path(p) for p in ("/", "/home", "/root", "/var", "/var/lib", "/var/tmp", "/opt", "/srv", "/mnt", "/tmp")
)


def _home_folders() -> set[Path]:
    """Every account's home folder: mounting one hands its dotfiles to the kernel."""
    homes = {Path(entry.pw_dir) for entry in pwd.getpwall() if entry.pw_dir not in ("", "/")}
    homes.add(Path.home())
    return {home.resolve() for home in homes}


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

    def workspace_mount(self) -> Mount:
        """The workspace (or a pooled sandbox's slot) as Docker mounts it."""
        if self.slot is not None:
            return Mount(CONTAINER_WORKSPACE, str(self.slot), type="bind", propagation="rslave")
        if self.volume:
            # no_copy: Docker would otherwise copy the image's /workspace (root's) over
            # an empty volume at every mount, undoing its hand-over to the kernel's uid.
            return Mount(self.workspace_path, self.volume, type="volume", read_only=False, no_copy=True)
        return Mount(self.workspace_path, str(self.workspace), type="bind", read_only=False)


def pooled_workspace_path(workspace: Path, volume: str | None) -> str:
    """Where a kernelspec with a pool shows the workspace: ``/workspace/<its name>``.

    gVisor cannot swap ``/workspace`` itself in a running sandbox, only what appears
    under it, so every kernel of such a kernelspec (pooled or started cold) sees its
    workspace one level down, named after the folder (or volume).
    """
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", volume or workspace.name).strip("-.")
    return f"{CONTAINER_WORKSPACE}/{name or 'work'}"


def container_create_kwargs(spec: SandboxSpec) -> dict[str, Any]:
    """Keyword arguments for ``docker.DockerClient.containers.create``.

    Hardening, in order: gVisor runtime, a non-root uid, no capabilities, no new
    privileges, read-only root with a small /tmp, an init process (PID 1 forwards
    signals), no network at all, and no host path but the workspace and the kernel's
    own runtime folder.
    """
    return {
        "image": spec.image,
        "command": spec.command,
        "name": spec.container_name,
        "hostname": "sandbox",
        "labels": spec.labels,
        "environment": spec.env,
        "working_dir": spec.workdir,
        "runtime": spec.runtime,
        "user": f"{spec.uid}:{spec.gid}",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true", f"seccomp={SECCOMP_PROFILE}"],
        "privileged": False,
        "read_only": True,
        "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={spec.tmp_size},mode=1777"},
        "init": True,
        "network_mode": "none",
        "ipc_mode": "private",
        "mounts": [
            spec.workspace_mount(),
            Mount(CONTAINER_RUNTIME_DIR, str(spec.runtime_dir), type="bind", read_only=False),
        ],
        "mem_limit": spec.memory,
        "memswap_limit": spec.memory,
        "nano_cpus": int(spec.cpus * 1_000_000_000),
        # Docker's pids_limit counts gVisor's host threads, not the kernel's processes,
        # and kills the whole sandbox silently when reached. RLIMIT_NPROC is enforced
        # inside gVisor per (non-root) uid: a fork or thread bomb gets a clean EAGAIN.
        # RLIMIT_FSIZE bounds each file the kernel writes (EFBIG, "File too large"): a
        # bind-mounted workspace cannot have a quota of its own.
        "ulimits": [
            Ulimit(name="nproc", soft=spec.pids, hard=spec.pids),
            Ulimit(
                name="fsize",
                soft=size_bytes("file_size", spec.file_size),
                hard=size_bytes("file_size", spec.file_size),
            ),
        ],
        "log_config": {"type": "json-file", "config": {"max-size": "10m", "max-file": "1"}},
        "stdin_open": False,
        "tty": False,
        "detach": True,
    }


def volume_setup_kwargs(spec: SandboxSpec) -> dict[str, Any]:
    """A helper container that hands a new workspace volume to the kernel's uid.

    It runs ``chown`` as root with only CAP_CHOWN, under gVisor, with no network; nothing
    of the user's runs in it.
    """
    return {
        "image": spec.image,
        "command": ["chown", f"{spec.uid}:{spec.gid}", CONTAINER_WORKSPACE],
        "name": f"sandbox-kernel-volume-setup-{spec.kernel_id}",
        "labels": {LABEL_VOLUME: spec.volume or ""},
        "runtime": spec.runtime,
        "user": "0:0",
        "cap_drop": ["ALL"],
        "cap_add": ["CHOWN"],
        # The profile too: root in here must not make anything setuid either.
        "security_opt": ["no-new-privileges:true", f"seccomp={SECCOMP_PROFILE}"],
        "read_only": True,
        "network_mode": "none",
        "mounts": [Mount(CONTAINER_WORKSPACE, spec.volume, type="volume", read_only=False, no_copy=True)],
        "detach": True,
    }


def sandbox_env(
    env: Mapping[str, str], pass_env: Iterable[str], kernelspec_env: Iterable[str]
) -> dict[str, str]:
    """The environment the kernel gets: an allow-list, never the server's whole env.

    ``env`` is the launch environment (the server's, with the kernelspec's ``env``
    applied); only names in ``pass_env`` or set by the kernelspec itself survive.
    """
    allowed = (set(pass_env) | set(kernelspec_env)) - NEVER_PASSED_ENV - {POLICY_ENV}
    result = dict(DEFAULT_ENV)
    result.update({name: env[name] for name in sorted(allowed) if name in env})
    result.update(FIXED_ENV)
    return result


def kernel_command(argv: Sequence[str], extra_arguments: Sequence[str] = ()) -> list[str]:
    """The command run in the container, from the kernelspec's ``argv``.

    ``km.format_kernel_cmd`` would swap ``python`` for the server's interpreter and use
    the host path of the connection file, so the command is built here instead.
    """
    if not argv:
        msg = (
            "The kernelspec's argv is empty; it must run ipykernel, "
            "e.g. python -m ipykernel_launcher -f {connection_file}"
        )
        raise ConfigurationError(msg)
    return [arg.replace("{connection_file}", CONTAINER_CONNECTION_FILE) for arg in argv] + list(
        extra_arguments
    )


def egress_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` behind the egress relay, which starts first and then runs ``cmd``.

    The relay runs with the kernel's interpreter when ``argv[0]`` names one.
    """
    python = cmd[0] if Path(cmd[0]).name.startswith("python") else "python3"
    return [python, CONTAINER_RELAY_FILE, CONTAINER_EGRESS_SOCKET, str(EGRESS_PROXY_PORT), "--", *cmd]


def proxy_env() -> dict[str, str]:
    """The variables that send HTTP(S) clients (urllib, requests, pip, curl) to the relay."""
    url = f"http://127.0.0.1:{EGRESS_PROXY_PORT}"
    names = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
    return {
        **dict.fromkeys(names, url),
        "NO_PROXY": "localhost,127.0.0.1,::1",
        "no_proxy": "localhost,127.0.0.1,::1",
    }


_VOLUME_FIELDS = ("user", "kernelspec", "notebook", "project")


def volume_name(template: str, **fields: str) -> str:
    """The named Docker volume a kernel's ``workspace_volume`` template asks for.

    ``{user}``, ``{kernelspec}``, ``{notebook}`` (the notebook's path) and ``{project}``
    (its folder's name) are filled in, each reduced to the characters Docker allows, so
    "team-{project}" gives a team one volume per project, and "{user}-{notebook}" each
    person one per notebook.

    Raises:
        ConfigurationError: an unknown placeholder or an unusable result.
    """
    safe = {
        key: re.sub(r"[^A-Za-z0-9_.-]+", "-", fields.get(key, "")).strip("-.") or "untitled"
        for key in _VOLUME_FIELDS
    }
    try:
        name = template.format(**safe)
    except (KeyError, IndexError, ValueError) as exc:
        msg = (
            f"workspace_volume={template!r} is not a valid template ({exc!r}); use the placeholders "
            "{user}, {kernelspec}, {notebook} and {project}, e.g. 'sandbox-{user}-{project}'."
        )
        raise ConfigurationError(msg) from None
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{1,254}", name):
        msg = (
            f"workspace_volume={template!r} gives {name!r}, which is not a Docker volume name "
            "(letters, digits, '_', '.', '-'; starting with a letter or digit)."
        )
        raise ConfigurationError(msg)
    return name


def resolve_workspace(
    cwd: str | os.PathLike[str],
    root: str | os.PathLike[str] | None,
    runtime_parent: str | os.PathLike[str] | None = None,
) -> tuple[Path, str]:
    """Map the kernel's start folder to (host folder to mount, working dir inside).

    Without a ``root`` the start folder itself is the workspace. With one, the root is
    mounted and the start folder must lie inside it.

    Raises:
        WorkspaceError: the folder is missing, is or lies in a system folder, holds the
            kernels' runtime folders, or is outside the root.
    """
    start = Path(cwd).resolve()
    if not start.is_dir():
        msg = f"The kernel's folder {str(start)!r} does not exist or is not a folder."
        raise WorkspaceError(msg)
    if root is None:
        mount, rel = start, Path()
    else:
        mount = Path(root).expanduser().resolve()
        if not mount.is_dir():
            msg = (
                f"The workspace root {str(mount)!r} does not exist. Create it, or fix "
                "SandboxProvisioner.workspace_root (or the kernelspec's workspace_root)."
            )
            raise WorkspaceError(msg)
        try:
            rel = start.relative_to(mount)
        except ValueError:
            msg = (
                f"The notebook's folder {str(start)!r} is outside the workspace root "
                f"{str(mount)!r}, so the sandboxed kernel cannot start there. Move the "
                "notebook under the workspace root, or change the root."
            )
            raise WorkspaceError(msg) from None
    if (
        mount in _SYSTEM_DIRS
        or mount in _home_folders()
        or any(mount.is_relative_to(tree) for tree in _SYSTEM_TREES)
    ):
        msg = (
            f"Refusing to mount {str(mount)!r} (a system or home folder) as the kernel's workspace. "
            "Start the kernel from a project folder, or set SandboxProvisioner.workspace_root."
        )
        raise WorkspaceError(msg)
    if runtime_parent is not None:
        private = Path(runtime_parent).resolve()
        if private.is_relative_to(mount):
            msg = (
                f"Refusing to mount {str(mount)!r} as the kernel's workspace: it contains "
                f"{str(private)!r}, where other kernels keep their private sockets and keys."
            )
            raise WorkspaceError(msg)
    workdir = CONTAINER_WORKSPACE if rel == Path() else f"{CONTAINER_WORKSPACE}/{rel.as_posix()}"
    return mount, workdir


def ensure_outside_workspace(path: str | os.PathLike[str], workspace: Path, setting: str) -> None:
    """Refuse a host file the sandbox must not reach (e.g. the audit log) inside its workspace.

    Raises:
        WorkspaceError: naming the setting to change.
    """
    resolved = Path(path).expanduser().resolve()
    if resolved.is_relative_to(workspace):
        msg = (
            f"{setting}={str(path)!r} lies inside the kernel's workspace {str(workspace)!r}, where "
            f"sandboxed code could read or rewrite it. Point {setting} outside every workspace."
        )
        raise WorkspaceError(msg)


def kernel_user(workspace: Path, configured_uid: int | None = None) -> tuple[int, int]:
    """The (uid, gid) the kernel runs as; never 0.

    Files the kernel writes must be readable and deletable by the host user, so the
    kernel runs as the server's user when that is not root, else as the workspace's
    owner when that is not root, else as :data:`DEFAULT_KERNEL_UID`.

    Raises:
        ConfigurationError: ``configured_uid`` is root, or the default uid is needed
            and belongs to an account on this host.
    """
    if configured_uid is not None:
        if configured_uid <= 0:
            msg = f"kernel_uid={configured_uid!r} is not allowed: the kernel never runs as root."
            raise ConfigurationError(msg)
        return configured_uid, configured_uid
    if os.getuid() != 0:
        return os.getuid(), os.getgid()
    st = workspace.stat()
    if st.st_uid != 0:
        # Never group 0 either, even for a folder owned by alice:root.
        return st.st_uid, st.st_gid or st.st_uid
    return check_default_uid_unused()


def volume_user(configured_uid: int | None = None) -> tuple[int, int]:
    """The (uid, gid) a kernel on a named volume runs as: kernel_uid, else the server's
    uid when that is not root, else :data:`DEFAULT_KERNEL_UID`; never 0.

    Raises:
        ConfigurationError: as :func:`kernel_user`.
    """
    if configured_uid is not None:
        return kernel_user(Path("/"), configured_uid)
    if os.getuid() != 0:
        return os.getuid(), os.getgid()
    return check_default_uid_unused()


def check_default_uid_unused() -> tuple[int, int]:
    """(:data:`DEFAULT_KERNEL_UID`, the same gid), once sure no host account or group has them.

    Whatever the kernel writes belongs to its uid on the host: a uid that is someone's
    would hand that account the files, and a setuid file (were one ever to get through)
    its identity.

    Raises:
        ConfigurationError: naming the account and the setting that avoids it.
    """
    uid = DEFAULT_KERNEL_UID
    try:
        taken = f"the account {pwd.getpwuid(uid).pw_name!r}"
    except KeyError:
        try:
            taken = f"the group {grp.getgrgid(uid).gr_name!r}"
        except KeyError:
            return uid, uid
    msg = (
        f"The sandboxed kernel would run as uid and gid {uid} (the default for a server running as "
        f"root when the workspace belongs to root or is a volume), but on this host that is {taken}, which "
        "would own everything the kernel writes. Set SandboxProvisioner.kernel_uid to a uid that "
        "no account or group uses, or give the workspace to the user the kernel should run as."
    )
    raise ConfigurationError(msg)


def check_lifetime(lifecycle: str, ttl: float, max_ttl: float) -> None:
    """Refuse a persistent kernel whose time-to-live exceeds the server's ceiling.

    Raises:
        ConfigurationError: naming the values and the ceiling.
    """
    if lifecycle == "persistent" and max_ttl > 0 and not 0 < ttl <= max_ttl:
        asked = "no limit" if ttl <= 0 else f"{ttl:g} s"
        msg = (
            f"persistent_ttl={ttl!r} ({asked}) exceeds the server's ceiling of {max_ttl:g} s "
            "(SandboxProvisioner.max_persistent_ttl). Ask for at most that in the kernelspec, "
            "or have the server's administrator raise the ceiling."
        )
        raise ConfigurationError(msg)


def check_pool_size(size: int, ceiling: int) -> None:
    """Refuse a pool larger than the server's ceiling.

    Raises:
        ConfigurationError: naming the values and the ceiling.
    """
    if size > ceiling:
        msg = (
            f"pool_size={size} exceeds the server's ceiling of {ceiling} "
            "(SandboxProvisioner.max_pool_size). Ask for at most that in the kernelspec, or have "
            "the server's administrator raise the ceiling."
        )
        raise ConfigurationError(msg)


def can_write(path: Path, uid: int, gid: int) -> bool:
    """Whether ``uid:gid`` may create files in ``path`` by its mode bits."""
    st = path.stat()
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def kernel_sockets(launch_dir: Path) -> dict[str, Path]:
    """Host path of each channel's ipc socket, as the kernel binds them in ``launch_dir``."""
    return {channel: launch_dir / f"{Path(IPC_PREFIX).name}-{port}" for channel, port in IPC_PORTS.items()}


def container_connection_info(key: bytes, signature_scheme: str, kernel_name: str) -> dict[str, Any]:
    """The connection file the kernel reads inside the sandbox: ipc sockets only."""
    return {
        "transport": "ipc",
        "ip": IPC_PREFIX,
        **{f"{channel}_port": port for channel, port in IPC_PORTS.items()},
        "key": key.decode("ascii"),
        "signature_scheme": signature_scheme,
        "kernel_name": kernel_name,
    }


def validate_kernelspec_config(config: Mapping[str, Any], kernelspec: str = "") -> None:
    """Reject keys a kernelspec may not set in ``metadata.kernel_provisioner.config``.

    jupyter_client silently drops unknown keys; a misspelt limit must not pass unnoticed.

    Raises:
        ConfigurationError: naming the offending key and the allowed ones.
    """
    where = f"kernelspec {kernelspec!r}" if kernelspec else "the kernelspec"
    for key in config:
        if key not in KERNELSPEC_KEYS:
            msg = (
                f"{where} sets {key!r} in metadata.kernel_provisioner.config, which is not "
                f"a setting a kernelspec may choose. Allowed: {', '.join(sorted(KERNELSPEC_KEYS))}."
            )
            raise ConfigurationError(msg)


def check_pass_env(asked: Iterable[str], ceiling: Iterable[str]) -> None:
    """Refuse a kernelspec's ``pass_env`` naming server variables beyond the ceiling.

    Raises:
        ConfigurationError: naming the variables and the ceiling.
    """
    beyond = sorted(set(asked) - set(ceiling))
    if beyond:
        msg = (
            f"pass_env would pass the server's {', '.join(beyond)} into the sandbox, beyond the "
            f"server's ceiling (SandboxProvisioner.max_pass_env={sorted(ceiling)!r}). Remove them from the "
            "kernelspec, set a value in its `env` instead, or have the administrator widen the ceiling."
        )
        raise ConfigurationError(msg)


def validate_size(name: str, value: str) -> str:
    """Check a Docker size string such as ``512m`` or ``2g``."""
    size_bytes(name, value)
    return value.lower()
