"""What the gateway reads for a kernel's owner: the sandbox's use of CPU and memory, and the
kernel's audit lines.

- :func:`usage`: the host cgroups of the kernel's sandbox (as the session API's meter reads
  them, see :mod:`sandbox_kernel.host.cgroups`): CPU seconds and the most memory it used since
  its sandbox started, and the memory it uses now. The peak is the cgroup's own
  (``memory.max_usage_in_bytes`` under cgroup v1, ``memory.peak`` under v2), read without
  resetting it; under v1 a session's meter on the same host resets it at each of its runs.
- :func:`audit_lines`: the lines of the gateway's audit log (and its rotated files) whose
  ``kernel_id`` is the kernel's, after a time. Only the host writes the log, one JSON object a
  line (what kernel code or a client sends is escaped within it), so a line's ``kernel_id``
  field is the kernel's own.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from sandbox_kernel.host.cgroups import cpu_seconds, memory_usage, peak_memory

#: Lines :func:`audit_lines` returns at most at once (the client asks again from the last one's time).
MAX_AUDIT_LINES = 1000


def usage(pid: int | None) -> dict[str, Any]:
    """``{"cpu_seconds", "memory": {"used", "peak"}}`` of the sandbox whose main process is
    ``pid`` (None, or unknown values: null; a paused or stopped kernel has no process)."""
    if pid is None:
        return {"cpu_seconds": None, "memory": {"used": None, "peak": None}}
    return {"cpu_seconds": cpu_seconds(pid), "memory": {"used": memory_usage(pid), "peak": peak_memory(pid)}}


def parse_since(text: str | None) -> datetime | None:
    """The ``since`` a client gave (an ISO 8601 time with its zone, as audit lines have them).

    Raises:
        ValueError: not such a time.
    """
    if not text:
        return None
    # A "+" left unescaped in a query string arrives as a space: "...05.678 00:00".
    when = datetime.fromisoformat(re.sub(r" (\d\d:\d\d)$", r"+\1", text))
    if when.tzinfo is None:
        msg = f"since={text!r} has no time zone; give it as audit lines do (2026-01-02T03:04:05.678+00:00)"
        raise ValueError(msg)
    return when


def log_files(path: Path, backups: int) -> list[Path]:
    """The audit log's files, oldest first (``audit.jsonl.N`` ... ``audit.jsonl``)."""
    rotated = [path.with_name(f"{path.name}.{n}") for n in range(backups, 0, -1)]
    return [file for file in (*rotated, path) if file.is_file()]


def audit_lines(
    path: str, backups: int, kernel_id: str, since: datetime | None, limit: int = MAX_AUDIT_LINES
) -> tuple[list[dict[str, Any]], bool]:
    """(the lines of the audit log at ``path`` of kernel ``kernel_id`` later than ``since``,
    oldest first; whether more follow). At most ``limit`` lines, ending at a change of time,
    so a client asking again from the last line's time misses none. Files last written
    before ``since`` are not read."""
    found: list[dict[str, Any]] = []
    marker = json.dumps(kernel_id)
    for file in log_files(Path(path).expanduser(), backups):
        try:
            if since is not None and datetime.fromtimestamp(file.stat().st_mtime, since.tzinfo) < since:
                continue
            handle = file.open(encoding="utf-8", errors="replace")
        except OSError:
            continue  # rotated meanwhile
        with handle:
            for line in handle:
                if marker not in line:
                    continue
                try:
                    record = json.loads(line)
                    when = datetime.fromisoformat(record["time"])
                except (ValueError, KeyError, TypeError):
                    continue
                if record.get("kernel_id") != kernel_id or (since is not None and when <= since):
                    continue
                found.append(record)
    if len(found) <= limit:
        return found, False
    kept = found[:limit]
    while len(kept) > 1 and kept[-1]["time"] == found[len(kept)]["time"]:
        kept.pop()
    return kept, True
