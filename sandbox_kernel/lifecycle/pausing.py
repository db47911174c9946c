"""Pausing a kernel: its whole sandbox, memory included, saved to disk and stopped, until
a client's next message resumes it (see the provisioner's ``pause`` and ``resume``).

The steps around the backend's checkpoint, in order:

pause
    the bridge holds clients' messages (and answers heartbeats); the kernel's channel
    relay closes its host sockets (``SIGUSR1``: gVisor cannot save a sandbox holding
    one); the backend saves the sandbox and stops it.
resume
    the launch folder is handed back to the kernel's uid (so the relay can bind there);
    the backend starts the sandbox from its image; the relay binds its sockets again
    (``SIGUSR2``); the folder is sealed again; the bridge passes on what it held.

With network "allowlist" the egress relay in the sandbox holds host sockets too (its
unix socket, and the connections the host's egress proxy dials in): the proxy lets go of
the kernel first, the channel relay passes both signals on to the egress relay, and the
proxy dials again once its socket is back.

What is decided here is pure (the budget, the checkpoint's name); the waiting is on
the launch folder's sockets, which the host can probe without trusting the sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sandbox_kernel.channels.bridge import ipc_in_use, ipc_let_go
from sandbox_kernel.errors import PauseError
from sandbox_kernel.host.background import poll_until
from sandbox_kernel.lifecycle.launch_folder import seal_launch_dir
from sandbox_kernel.plan.sandbox_spec import CONTAINER_EGRESS_SOCKET, CONTAINER_RUNTIME_DIR, kernel_sockets

#: The channels whose sockets the kernel holds itself, lent by the channel relay
#: (kernel_relay.HANDED), and those the relay always keeps.
KEPT_BY_KERNEL = ("shell", "iopub")
KEPT_BY_RELAY = ("stdin", "control", "hb")
#: How long the relay may take to close or bind its host sockets.
CHANNELS_TIMEOUT = 20.0
#: How long the relay's own sockets may go on accepting once it closed them, where the
#: host cannot see which the sandbox holds (after a failed pause, before lending the folder).
LET_GO_TIMEOUT = 5.0
#: How long the egress relay may take to bind its socket again, once the channels are.
EGRESS_TIMEOUT = 5.0


@dataclass(frozen=True)
class Paused:
    """A kernel saved to disk: its checkpoint, the image's size (None: not readable by
    this process), and when (epoch seconds)."""

    checkpoint: str
    size: int | None
    since: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Paused | None:
        """From a saved state; None for anything that is not one (a kernel not paused)."""
        if not isinstance(data, dict) or not isinstance(data.get("checkpoint"), str):
            return None
        size = data.get("size")
        return cls(data["checkpoint"], size if isinstance(size, int) else None, float(data.get("since") or 0))


def checkpoint_name() -> str:
    """A fresh checkpoint name (Docker takes letters, digits, '-' and '_')."""
    return f"sk-{int(time.time())}-{secrets.token_hex(3)}"


def check_budget(kernel_id: str, memory_in_use: int | None, used: int, free: int | None, budget: int) -> None:
    """Refuse a pause whose image could outgrow the disk budget or the disk: the kernel's
    memory in use bounds the image (Docker compresses it; zero pages cost nothing).

    Raises:
        PauseError: saying what is taken, by whom, and what to do; the kernel runs on.
    """
    need = memory_in_use or 0
    mib = 2**20
    if used + need > budget:
        msg = (
            f"Kernel {kernel_id} was not paused: its image could take up to {need / mib:.0f} MiB (the memory "
            f"it uses), and paused kernels' images already take {used / mib:.0f} MiB of the "
            f"{budget / mib:.0f} MiB budget (SandboxProvisioner.checkpoint_budget). It keeps running, "
            "nothing lost. Resume or shut down paused kernels, or raise the budget."
        )
        raise PauseError(msg)
    if free is not None and need > free:
        msg = (
            f"Kernel {kernel_id} was not paused: its image could take up to {need / mib:.0f} MiB and the "
            f"disk that holds checkpoints has {free / mib:.0f} MiB free. It keeps running, nothing lost."
        )
        raise PauseError(msg)


async def wait_for_channels(
    launch_dir: Path,
    bound: bool,
    timeout: float = CHANNELS_TIMEOUT,
    held: Callable[[], Awaitable[list[str] | None]] | None = None,
    egress: bool = False,
) -> None:
    """Until every channel socket in ``launch_dir`` accepts connections (``bound``) or none
    does (nor, with ``egress``, the egress relay's). Letting go, ``held`` (the sandbox's
    bound host sockets, None if unknown) answers sooner: once the sandbox holds none in
    its runtime folder it can be saved, while gVisor's gofer may go on accepting
    connections at the paths for a second or two.

    Raises:
        PauseError: not within ``timeout`` seconds.
    """
    sockets = list(kernel_sockets(launch_dir).values())
    if egress and not bound:
        sockets.append(egress_socket(launch_dir))
    still: list[str] = []

    async def done() -> bool:
        names = await _held_in_runtime_dir(launch_dir, held) if not bound else None
        if names is not None:  # known: it alone tells (a connection may outlive its listener)
            still[:] = [channel for channel in KEPT_BY_KERNEL if channel in names] + sorted(
                names - set(KEPT_BY_KERNEL)
            )
            return not names
        return await _all_in_use(sockets, bound)

    if not await poll_until(done, timeout, 0.02):
        if bound:
            msg = f"the kernel's channel relay did not bind its channels again within {timeout:g} s"
        elif set(still) <= set(KEPT_BY_KERNEL) and still:
            msg = (
                f"the kernel did not give back its {' and '.join(still)} socket{'s' * (len(still) > 1)} "
                f"within {timeout:g} s "
                "(code in the kernel keeping the interpreter busy in a thread, e.g. a long call made in C)"
            )
        else:
            msg = f"the kernel's channel relay did not let go of its channels within {timeout:g} s"
        raise PauseError(msg)


async def relay_kept_its_sockets(
    launch_dir: Path,
    held: Callable[[], Awaitable[list[str] | None]] | None = None,
    timeout: float = LET_GO_TIMEOUT,
) -> bool:
    """Whether the channel relay still holds the sockets of the channels it always keeps:
    then it has not stopped the rest of the sandbox, which it does before it closes them
    (kernel_relay.Holding), and the launch folder must not be lent (kernel code would run
    meanwhile). ``held`` (the sandbox's bound host sockets) tells. Where it cannot (None:
    a root server that cannot find the sandbox's gofer), the sockets' paths do: let go
    once each refuses connections within ``timeout`` seconds. A listener whose queue is
    full (a stopped relay's fills with the probes) is no letting go: such a host keeps a
    kernel frozen rather than lend its folder. A server that is not root lends no folder
    (it never seals one): False, so that the relay always binds its channels again."""
    if os.getuid() != 0:
        return False
    names = await _held_in_runtime_dir(launch_dir, held)
    if names is not None:
        return bool(names & set(KEPT_BY_RELAY))
    sockets = kernel_sockets(launch_dir)
    kept = [str(sockets[channel]) for channel in KEPT_BY_RELAY]
    return not await poll_until(
        lambda: asyncio.to_thread(lambda: all(ipc_let_go(path) for path in kept)), timeout, 0.1
    )


async def _held_in_runtime_dir(
    launch_dir: Path, held: Callable[[], Awaitable[list[str] | None]] | None
) -> set[str] | None:
    """The channels (or, for a socket that is none of theirs, its name) whose sockets the
    sandbox holds bound in its runtime folder, as ``held`` sees them; None if unknown."""
    paths = await held() if held is not None else None
    if paths is None:
        return None
    by_name = {path.name: channel for channel, path in kernel_sockets(launch_dir).items()}
    ours = [Path(path) for path in paths if Path(path).parent == Path(CONTAINER_RUNTIME_DIR)]
    return {by_name.get(path.name, path.name) for path in ours}


async def wait_for_egress(launch_dir: Path, timeout: float = EGRESS_TIMEOUT) -> bool:
    """Whether the egress relay binds its socket in ``launch_dir`` again within
    ``timeout`` seconds (kernel code may have ended it: the kernel resumes all the same)."""
    return await poll_until(lambda: _all_in_use([egress_socket(launch_dir)], True), timeout, 0.02)


async def _all_in_use(sockets: list[Path], bound: bool) -> bool:
    # (Not following links: the folder is the kernel's while it binds again.)
    states = await asyncio.to_thread(
        lambda: [ipc_in_use(str(path), timeout=0.05, follow=False) for path in sockets]
    )
    return all(state == bound for state in states)


def egress_socket(launch_dir: Path) -> Path:
    """Where the egress relay's unix socket is in ``launch_dir``."""
    return launch_dir / Path(CONTAINER_EGRESS_SOCKET).name


def lend_launch_dir(launch_dir: Path, uid: int, gid: int) -> None:
    """Hand the sealed launch folder back to the kernel's uid, without the sockets of its
    last run, so that the resumed relay binds them afresh (sealed again once it has)."""
    for path in (*kernel_sockets(launch_dir).values(), egress_socket(launch_dir)):
        path.unlink(missing_ok=True)
    if os.getuid() == 0:
        seal_launch_dir(launch_dir, owner=(uid, gid))


#: In a kernel's private runtime folder: a request to pause or resume it, from another
#: process of the server's user (``jupyter sandbox-kernel pause ID``), and the answer.
REQUEST_FILE = "pause-request.json"
ANSWER_FILE = "pause-answer-{token}.json"


def describe(paused: Paused) -> str:
    size = f"{paused.size / 2**20:.0f} MiB" if paused.size is not None else "size unknown"
    return f"checkpoint {paused.checkpoint}, {size}"


class PauseRequests:
    """The holder's side: its watchdog looks for a request twice a second (one failed
    open when there is none), carries it out, and answers."""

    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir

    async def answer(
        self,
        pause: Callable[[str], Awaitable[Paused]],
        resume: Callable[[str], Awaitable[None]],
    ) -> None:
        path = self.runtime_dir / REQUEST_FILE
        try:
            request = json.loads(path.read_bytes()[:4096])
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            request = None
        path.unlink(missing_ok=True)
        if not isinstance(request, dict):
            return
        token, action = str(request.get("token", "")), request.get("action")
        if not token.isalnum() or action not in ("pause", "resume"):
            return
        why = f"asked by `jupyter sandbox-kernel {action}`"
        try:
            if action == "pause":
                answer = {"ok": True, "message": f"paused ({describe(await pause(why))})"}
            else:
                await resume(why)
                answer = {"ok": True, "message": "resumed"}
        except PauseError as exc:
            answer = {"ok": False, "message": str(exc)}
        _write_private(self.runtime_dir / ANSWER_FILE.format(token=token), answer)


def ask_holder(runtime_dir: Path, action: str, timeout: float) -> tuple[bool, str]:
    """The other side: ask the kernel's holder to ``action`` it; (done, what it said).

    Raises:
        PauseError: no answer within ``timeout`` seconds (the request is withdrawn).
    """
    token = secrets.token_hex(8)
    answer = runtime_dir / ANSWER_FILE.format(token=token)
    _write_private(runtime_dir / REQUEST_FILE, {"action": action, "token": token})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            said = json.loads(answer.read_bytes())
        except (FileNotFoundError, ValueError):
            time.sleep(0.1)
            continue
        answer.unlink(missing_ok=True)
        return bool(said.get("ok")), str(said.get("message", ""))
    (runtime_dir / REQUEST_FILE).unlink(missing_ok=True)
    msg = f"the process that holds the kernel did not answer within {timeout:g} s"
    raise PauseError(msg)


def _write_private(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
