"""Whether the kernel's start-up code ran: the mark it leaves, and the host's wait for it.

IPython runs the start-up code (:mod:`~.in_kernel`, the kernel's ``PYTHONSTARTUP``) as it
starts, and carries on without it whatever goes wrong: a file it cannot see at that moment
is a warning ("File not found"), or nothing at all; an exception in it a warning and a
traceback nobody reads. Such a kernel answers like any other, but without its one-line
network and memory messages, its ``MemoryError`` before the OOM killer, its pip and its
clocks. So the start-up code leaves a mark in the launch folder as it ends (``ok``, or
``failed`` and its traceback), and no kernel is handed over before the host has read it.
The mark is the kernel's word, read with a bounded read; it tells the host what the kernel
did for its user's benefit, and bounds nothing.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.errors import KernelStartupError

#: The mark's name in the launch folder; in_kernel.py writes it next to itself.
STARTED_MARK = "started"
#: What IPython writes to the kernel's output when it does not run a PYTHONSTARTUP file.
NOT_RUN = ("File not found: ", "Could not open file <", "Unknown error in handling PYTHONSTARTUP")
#: Most bytes of the mark read (a traceback, cut).
MARK_BYTES = 8192


def read_mark(launch_dir: Path) -> str | None:
    """The start-up code's mark in ``launch_dir`` (None: none yet), removed once read, so
    that the seal finds only what the host expects. Never follows a link."""
    path = launch_dir / STARTED_MARK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # not a file the kernel wrote as it should: say what it is
        return f"failed\nits mark {str(path)!r} is unreadable ({exc})"
    try:
        text = os.read(fd, MARK_BYTES).decode("utf-8", "replace")
    finally:
        os.close(fd)
    if not text.endswith("\n") and len(text) < MARK_BYTES:
        return None  # still being written
    path.unlink(missing_ok=True)
    return text


async def wait_for_startup_code(
    backend: SandboxBackend,
    container_id: str,
    launch_dir: Path,
    timeout: float,
    image: str,
    required: bool = True,
) -> None:
    """Wait until the kernel's start-up code has run (its mark says ``ok``). Not
    ``required`` (a kernelspec's own argv, whose kernel may be no IPython or run none):
    only remove a mark already there.

    Raises:
        KernelStartupError: the start-up code failed, IPython did not run it, the kernel
            exited, or no mark came within ``timeout`` seconds; the message says which,
            with the kernel's last output.
    """
    if not required:
        await asyncio.to_thread(read_mark, launch_dir)
        return
    deadline = time.monotonic() + timeout
    next_check = 0.0
    while True:
        mark = await asyncio.to_thread(read_mark, launch_dir)
        if mark is not None:
            status, _, detail = mark.partition("\n")
            if status.strip() == "ok":
                return
            msg = (
                f"The sandboxed kernel's start-up code failed (image {image!r}), so it would run "
                "without its network and memory messages and its limits' clocks; it was not "
                f"started. Restart it; if this persists, report it with this error:\n{detail.strip()}"
            )
            raise KernelStartupError(msg, detail)
        now = time.monotonic()
        if now >= next_check:
            _, code = await backend.state(container_id)
            logs = await backend.logs(container_id)
            skipped = next((line for line in logs.splitlines() if any(m in line for m in NOT_RUN)), None)
            if code is not None or skipped is not None or now >= deadline:
                why = (
                    f"exited (exit code {code})"
                    if code is not None
                    else f"did not run its start-up code ({skipped.strip()})"
                    if skipped is not None
                    else f"did not finish its start-up code within {timeout:g} s"
                )
                msg = (
                    f"The sandboxed kernel {why} (image {image!r}); it was not handed over, as it "
                    "would run without its network and memory messages and its limits' clocks. "
                    "Restart it; raise SandboxProvisioner.startup_timeout if the host is slow. "
                    f"Its last output:\n{logs or '(no output)'}"
                )
                raise KernelStartupError(msg, logs)
            next_check = now + 0.5
        await asyncio.sleep(0.02)
