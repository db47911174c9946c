"""Pure translation of a sandbox spec into Docker ``create`` arguments: the hardening.

Nothing here talks to Docker or starts anything, so the hardening can be unit-tested on
the dictionaries it produces (the model is docker-py's ``_create_container_args``).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from docker.types import Mount, Ulimit

from sandbox_kernel.errors import WorkspaceError
from sandbox_kernel.plan.limits import docker_size, size_bytes
from sandbox_kernel.plan.plan import DEFAULT_KERNEL_UID
from sandbox_kernel.plan.sandbox_spec import (
    CONTAINER_RUNTIME_DIR,
    CONTAINER_WORKSPACE,
    LABEL_VOLUME,
    SandboxSpec,
)

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
#: Every container we run: no privilege gained through exec, and our seccomp profile.
SECURITY_OPT = ("no-new-privileges:true", f"seccomp={SECCOMP_PROFILE}")


def container_create_kwargs(spec: SandboxSpec) -> dict[str, Any]:
    """Keyword arguments for ``docker.DockerClient.containers.create``.

    Hardening, in order: gVisor runtime, a non-root uid, no capabilities, no new
    privileges, read-only root with a small /tmp, an init process (PID 1 forwards
    signals), no network at all, and no host path but the workspace and the kernel's
    own runtime folder.
    """
    return {
        "image": spec.image,
        # Only our command runs: never the image's ENTRYPOINT (a kernelspec may name an image).
        "entrypoint": [""],
        "command": spec.command,
        "name": spec.container_name,
        "hostname": "sandbox",
        "labels": spec.labels,
        "environment": spec.env,
        "working_dir": spec.workdir,
        "runtime": spec.runtime,
        "user": f"{spec.uid}:{spec.gid}",
        "cap_drop": ["ALL"],
        "security_opt": list(SECURITY_OPT),
        "privileged": False,
        "read_only": True,
        # gVisor's tmpfs (and Linux's) take no fraction: docker_size makes '1.5g' bytes.
        "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={docker_size('tmp_size', spec.tmp_size)},mode=1777"},
        "init": True,
        "network_mode": "none",
        "ipc_mode": "private",
        "mounts": [
            workspace_mount(spec),
            Mount(CONTAINER_RUNTIME_DIR, str(spec.runtime_dir), type="bind", read_only=False),
        ],
        "mem_limit": docker_size("memory", spec.memory),
        "memswap_limit": docker_size("memory", spec.memory),
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
        "security_opt": list(SECURITY_OPT),
        "read_only": True,
        "network_mode": "none",
        "mounts": [Mount(CONTAINER_WORKSPACE, spec.volume, type="volume", read_only=False, no_copy=True)],
        "detach": True,
    }


def workspace_mount(spec: SandboxSpec) -> Mount:
    """The workspace (or a pooled sandbox's slot) as Docker mounts it: a pinned workspace
    from its staging folder, never from its own path.

    Raises:
        WorkspaceError: the workspace is to be pinned, and it is not (no staging folder).
    """
    if spec.slot is not None:
        return Mount(CONTAINER_WORKSPACE, str(spec.slot), type="bind", propagation="rslave")
    if spec.volume:
        # no_copy: Docker would otherwise copy the image's /workspace (root's) over
        # an empty volume at every mount, undoing its hand-over to the kernel's uid.
        return Mount(spec.workspace_path, spec.volume, type="volume", read_only=False, no_copy=True)
    if spec.owned_from is not None:
        if spec.staging is None:
            msg = f"The kernel's folder {str(spec.workspace)!r} is not pinned, so it is not mounted."
            raise WorkspaceError(msg)
        return Mount(spec.workspace_path, str(spec.staging), type="bind", read_only=False)
    return Mount(spec.workspace_path, str(spec.workspace), type="bind", read_only=False)


#: Prints how the image's libzmq waits, as its kernel loads it: "epoll" or "poll" (the
#: image's own Python; what the process maps of libzmq, or of pyzmq's backend where that
#: holds libzmq itself).
ZMQ_POLLER_PROBE = """\
import zmq.backend
maps = {line.split()[-1] for line in open('/proc/self/maps') if 'zmq' in line and '/' in line}
libraries = [p for p in maps if '.so' in p]
epoll = any(b'epoll_wait' in open(p, 'rb').read() for p in libraries)
print('epoll' if epoll else 'poll' if libraries else '?')
"""


def zmq_probe_kwargs(image: str, runtime: str) -> dict[str, Any]:
    """A helper container that runs :data:`ZMQ_POLLER_PROBE` in ``image`` as a kernel runs:
    under gVisor, its uid, no capabilities, no network, a read-only root."""
    return {
        "image": image,
        "entrypoint": [""],
        "command": ["python", "-c", ZMQ_POLLER_PROBE],
        "runtime": runtime,
        "user": f"{DEFAULT_KERNEL_UID}:{DEFAULT_KERNEL_UID}",
        "cap_drop": ["ALL"],
        "security_opt": list(SECURITY_OPT),
        "read_only": True,
        "network_mode": "none",
        "detach": True,
    }
