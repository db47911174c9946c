"""Sealing a kernel's launch folder: once the kernel is up, only what the host expects stays.

Each launch gets a fresh host folder (mounted at ``/run/sandbox-kernel``) that the kernel
owns while it starts, so that it can bind its ipc sockets there. Code that runs before
the seal (a kernelspec's own argv, a module that shadows one ipykernel imports) can put
anything there too: a world-writable folder left in the host's runtime folder would
outlive the seal. So the seal hands the folder to the server and then removes every
entry but the kernel's sockets and the files the host wrote itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import socket
import stat
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.egress import relay as egress_relay
from sandbox_kernel.errors import KernelStartupError
from sandbox_kernel.host.trees import delete_tree
from sandbox_kernel.lifecycle.ownership import RUNTIME_DIR_PREFIX, write_owner
from sandbox_kernel.plan.sandbox_spec import (
    CONTAINER_CLAIM_SOCKET,
    CONTAINER_CONNECTION_FILE,
    CONTAINER_EGRESS_CA,
    CONTAINER_EGRESS_SOCKET,
    CONTAINER_KERNEL_APP_FILE,
    CONTAINER_KERNEL_RELAY_FILE,
    CONTAINER_RELAY_FILE,
    CONTAINER_STARTUP_FILE,
    CONTAINER_STARTUP_MODULE,
    container_connection_info,
    kernel_sockets,
)

log = logging.getLogger(__name__)


def _in_sandbox_file(name: str) -> str:
    """The source file of the module ``sandbox_kernel.inside.NAME``, found without importing
    it: the host only copies these files (``kernel_app`` imports ipykernel and IPython)."""
    spec = importlib.util.find_spec(f"sandbox_kernel.inside.{name}")
    if spec is None or spec.origin is None:
        msg = f"sandbox_kernel.inside.{name} is missing from this installation"
        raise ImportError(msg)
    return spec.origin


FAST_IO_FILE = _in_sandbox_file("fast_io")
STARTUP_SOURCES = {
    CONTAINER_STARTUP_FILE: _in_sandbox_file("in_kernel"),
    CONTAINER_STARTUP_MODULE: _in_sandbox_file("in_kernel_startup"),
    # The start-up module loads it from beside itself.
    f"{Path(CONTAINER_STARTUP_MODULE).parent}/{Path(FAST_IO_FILE).name}": FAST_IO_FILE,
}


#: Files the host writes into the launch folder before the kernel starts.
HOST_FILES = frozenset(
    Path(p).name
    for p in (
        CONTAINER_CONNECTION_FILE,
        CONTAINER_STARTUP_FILE,
        CONTAINER_STARTUP_MODULE,
        CONTAINER_KERNEL_APP_FILE,
        CONTAINER_KERNEL_RELAY_FILE,
        CONTAINER_RELAY_FILE,
        CONTAINER_EGRESS_CA,
    )
) | {Path(FAST_IO_FILE).name}

#: The programs the sandbox runs besides the kernel's start-up code: the kernel itself and
#: its parent, the channel relay.
IN_SANDBOX_PROGRAMS = {
    CONTAINER_KERNEL_APP_FILE: _in_sandbox_file("kernel_app"),
    CONTAINER_KERNEL_RELAY_FILE: _in_sandbox_file("kernel_relay"),
}
#: Sockets the kernel binds only with network "allowlist" (the egress relay's) or in a pool
#: (where it hears its claim).
OPTIONAL_SOCKETS = frozenset({Path(CONTAINER_EGRESS_SOCKET).name, Path(CONTAINER_CLAIM_SOCKET).name})


def seal(launch_dir: Path) -> None:
    """Once the kernel has bound its sockets, stop it adding or swapping entries, and
    drop whatever it made there before: nothing it left may stay writable to it.

    Only a root server can hand the folder back to itself; otherwise the kernel
    shares the server's uid and could undo any change.

    Raises:
        KernelStartupError: one of the kernel's sockets is not a socket.
    """
    if os.getuid() == 0:
        seal_launch_dir(launch_dir)


def seal_launch_dir(launch_dir: Path, owner: tuple[int, int] = (0, 0)) -> list[str]:
    """Hand ``launch_dir`` to ``owner`` (0755), then keep only the kernel's sockets and
    the host's own files (as regular files); the names removed.

    The folder is handed over first, so the kernel can add nothing while the rest is
    cleared. Only a root server can do this (the kernel has another uid).

    Raises:
        KernelStartupError: one of the kernel's sockets is not a socket (something
            took its name before the kernel bound it), or an entry could not be removed.
    """
    os.chown(launch_dir, *owner)
    launch_dir.chmod(0o755)
    sockets = {path.name for path in kernel_sockets(launch_dir).values()}
    removed = []
    for entry in sorted(os.listdir(launch_dir)):
        path = launch_dir / entry
        mode = path.lstat().st_mode
        if entry in sockets | OPTIONAL_SOCKETS:
            if not stat.S_ISSOCK(mode):
                msg = (
                    f"The sandboxed kernel's {entry} in {str(launch_dir)!r} is a {stat.filemode(mode)} "
                    "entry, not the socket the kernel binds: code that ran before the kernel took its "
                    "name. Check the kernelspec's argv and the workspace, then restart the kernel."
                )
                raise KernelStartupError(msg)
            continue
        if entry in HOST_FILES and stat.S_ISREG(mode):
            # Still read by the kernel as it starts (connection.json is its own, 0600);
            # a file, even one the kernel rewrote, holds no entries.
            continue
        _remove(path, owner)
        removed.append(entry)
    if removed:
        log.warning(
            "Sandboxed kernel launch folder %s: removed %s, made by the kernel before the seal",
            launch_dir,
            ", ".join(removed),
        )
    return removed


def _remove(path: Path, owner: tuple[int, int]) -> None:
    """Remove an entry the kernel made, however deep a tree, even while it still writes
    into it: each folder in it is handed to ``owner`` (0700) as the removal enters it,
    before its entries are read, so the kernel cannot add any for the removal to trip over.

    Raises:
        KernelStartupError: it could not be removed.
    """
    try:
        delete_tree(path, owner=owner)
    except OSError as exc:
        msg = f"Could not remove {str(path)!r}, which the sandboxed kernel made before the seal: {exc}"
        raise KernelStartupError(msg) from exc


def new_runtime_dir(runtime_parent: str) -> Path:
    """A kernel's server-only (0700) runtime folder, owned by this process."""
    runtime_dir = Path(tempfile.mkdtemp(prefix=RUNTIME_DIR_PREFIX, dir=runtime_parent))
    write_owner(runtime_dir)
    return runtime_dir


def new_launch_dir(runtime_dir: Path, number: int, uid: int, gid: int) -> Path:
    """A fresh folder for one kernel process, inside the server-only runtime folder.

    The outer folder (0700, the server's) keeps other host users, including one whose
    uid the kernel happens to share, away from the key and the sockets. A fresh inner
    folder per launch means nothing the previous kernel left there can disturb the next.
    """
    launch_dir = runtime_dir / f"run{number}"
    launch_dir.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(launch_dir, uid, gid)
    return launch_dir


def write_launch_files(
    launch_dir: Path,
    owner: tuple[int, int],
    key: bytes,
    scheme: str,
    kernel_name: str,
    egress_ca: bytes | None,
) -> None:
    """What the kernel reads at its start: connection file (its own, 0600), start-up
    code, and with network "allowlist" (``egress_ca``: the certificate of its egress CA)
    the egress relay and that certificate."""
    info = container_connection_info(key, scheme, kernel_name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(launch_dir / Path(CONTAINER_CONNECTION_FILE).name, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        if os.getuid() == 0:
            os.fchown(f.fileno(), *owner)
        json.dump(info, f)
    write_startup_code(launch_dir)
    for path, source in IN_SANDBOX_PROGRAMS.items():
        (launch_dir / Path(path).name).write_text(Path(source).read_text())
    if egress_ca is not None:
        (launch_dir / Path(CONTAINER_RELAY_FILE).name).write_text(Path(egress_relay.__file__).read_text())
        (launch_dir / Path(CONTAINER_EGRESS_CA).name).write_bytes(egress_ca)


def write_startup_code(launch_dir: Path) -> None:
    """The kernel's start-up code (its PYTHONSTARTUP) and the module it runs, side by side."""
    for path, source in STARTUP_SOURCES.items():
        (launch_dir / Path(path).name).write_text(Path(source).read_text())


def expected_sockets(launch_dir: Path, egress: bool, pooled: bool) -> list[Path]:
    """Every socket the kernel binds in ``launch_dir`` once it is ready."""
    sockets = list(kernel_sockets(launch_dir).values())
    if egress:
        sockets.append(launch_dir / Path(CONTAINER_EGRESS_SOCKET).name)
    if pooled:
        # Bound by the start-up code, so after every import: the kernel is ready.
        sockets.append(launch_dir / Path(CONTAINER_CLAIM_SOCKET).name)
    return sockets


async def wait_until_ready(
    backend: SandboxBackend, container_id: str, sockets: list[Path], timeout: float, image: str
) -> None:
    """Wait until the kernel has bound all ``sockets``, or fail with its logs.

    Raises:
        KernelStartupError: it exited, or did not get there within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    next_check = 0.0
    while True:
        if all(s.exists() for s in sockets):
            return
        now = time.monotonic()
        if now >= next_check:
            _, code = await backend.state(container_id)
            if code is not None:
                logs = await backend.logs(container_id)
                msg = (
                    f"The sandboxed kernel exited during startup (exit code {code}, image "
                    f"{image!r}). Its last output:\n{logs or '(no output)'}"
                )
                raise KernelStartupError(msg, logs)
            next_check = now + 0.5
        if now >= deadline:
            logs = await backend.logs(container_id)
            msg = (
                f"The sandboxed kernel did not open its channels within {timeout:g} s "
                f"(image {image!r}); raise SandboxProvisioner.startup_timeout if the host is "
                f"slow. Its last output:\n{logs or '(no output)'}"
            )
            raise KernelStartupError(msg, logs)
        await asyncio.sleep(0.05)


def send_claim(
    launch_dir: Path,
    cwd: str,
    env: Mapping[str, str],
    timeout: float = 10.0,
    key: bytes | None = None,
    unset: Sequence[str] = (),
    rlimits: Mapping[str, int] | None = None,
) -> None:
    """Hand a pooled sandbox's kernel its working folder and the variables it sets (and
    ``unset``, drops), the lower resource limits its processes get (``rlimits``: "nproc",
    "fsize"), and on a restart (``key``) the session key its clients hold; wait for its
    "ok", which it gives once all is in place.

    The kernel's answer is untrusted: only a bounded read, compared with b"ok".

    Raises:
        KernelStartupError: the kernel did not take the claim.
    """
    claim: dict[str, Any] = {
        "cwd": cwd,
        "env": dict(env),
        "unset": list(unset),
        "rlimits": dict(rlimits or {}),
    }
    if key is not None:
        claim["key"] = key.decode()
    path = launch_dir / Path(CONTAINER_CLAIM_SOCKET).name
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(str(path))
            conn.sendall(json.dumps(claim).encode() + b"\n")
            conn.shutdown(socket.SHUT_WR)
            answer = conn.recv(64)
    except OSError as exc:
        msg = f"The pooled sandbox's kernel did not take its claim ({exc})"
        raise KernelStartupError(msg) from exc
    if answer.strip() != b"ok":
        msg = f"The pooled sandbox's kernel refused its claim: {answer[:64]!r}"
        raise KernelStartupError(msg)
