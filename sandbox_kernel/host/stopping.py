"""Which gVisor sandboxes Docker is trying to stop: the ``runsc kill`` commands waiting.

Docker stops or kills a container (``docker stop``, ``docker kill``, ``docker rm -f``, a
daemon shutting down or restarting) by running ``runsc ... kill <container id> <signal>``;
for a sandbox whose cgroup is frozen, that command waits until it is thawed, and with it
Docker: a daemon restart hangs for as long as any sandbox stays frozen, its API answering
and its event stream quiet meanwhile (measured, runsc 20240729, Docker 20.10). What
freezes a sandbox looks here now and then, and thaws it when Docker wants it gone.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

_CONTAINER_ID = re.compile(rb"[0-9a-f]{64}")
#: Seconds a look at /proc is reused: every frozen sandbox of a process asks about once a
#: second, and one look serves them all.
REUSE = 1.0

_lock = threading.Lock()
_last: tuple[float, frozenset[str]] = (float("-inf"), frozenset())


def _look(proc: Path) -> frozenset[str]:
    found: set[str] = set()
    try:
        entries = os.listdir(proc)
    except OSError:
        return frozenset()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            if (proc / entry / "comm").read_bytes().strip() != b"runsc":
                continue
            args = (proc / entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for at, arg in enumerate(args[:-1]):
            if arg == b"kill" and _CONTAINER_ID.fullmatch(args[at + 1]):
                found.add(args[at + 1].decode())
    return frozenset(found)


def being_stopped(proc: Path = Path("/proc")) -> frozenset[str]:
    """The full ids of the containers that a ``runsc kill`` waits for now (reused for
    :data:`REUSE` seconds)."""
    global _last
    now = time.monotonic()
    with _lock:
        if now - _last[0] < REUSE and proc == Path("/proc"):
            return _last[1]
    found = _look(proc)
    if proc == Path("/proc"):
        with _lock:
            _last = (now, found)
    return found
