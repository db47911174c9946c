"""The audit trail: one JSON line per execution, written on the host by the bridge.

The bridge sees every ``execute_request`` a client sends, from any client, and the
kernel's ``execute_reply``. Each execution gets a line when it arrives and one, complete
on its own, when it finishes (or is abandoned)::

    {"event": "started", "time": "...", "kernel_id": "...", "kernelspec": "...",
     "username": "...", "session": "...", "msg_id": "...", "code": "..."}
    {"event": "finished", ...the same..., "status": "ok", "duration": 0.012,
     "execution_count": 3, "egress": [{"method": "CONNECT", "host": "pypi.org",
     "port": 443, "verdict": "allowed", "reason": "..."}]}

and each verdict of the egress proxy (network "allowlist") gets a line as it happens::

    {"event": "egress", "time": "...", "kernel_id": "...", "kernelspec": "...",
     "msg_id": "..." (the execution it served, or null), "method": "CONNECT",
     "host": "evil.example", "port": 443, "verdict": "denied", "reason": "...",
     "address": null}

The file lives outside every mount of the sandbox. Replies come from the sandbox and are
untrusted: only small frames are parsed, and anything malformed is recorded as such.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import zmq

from .egress.credentials import BoundCredential
from .wire import find_delimiter, frame_bytes, load_dict

log = logging.getLogger(__name__)

#: Pending executions kept per kernel; beyond that the oldest are written as unanswered.
_MAX_PENDING = 1000
#: Egress decisions listed in one execution's "finished" line (each also has its own line).
_MAX_EGRESS = 100
#: Egress lines a kernel may cause: this many per second on average, in bursts of the
#: second number. The kernel decides how many requests it makes; past the rate, lines
#: are counted and summed up in one "egress_suppressed" line, so it cannot flood the log.
_EGRESS_RATE = 20.0
_EGRESS_BURST = 200
#: What of an egress decision goes into the execution's "finished" line.
_EGRESS_SUMMARY = ("method", "host", "port", "verdict", "reason")
#: Why an execution the kernel went past has no reply (the audit line, and its client).
LOST_REPLY = (
    "the kernel went on to its next request without a reply to this one reaching the host "
    "(a message over the size cap cut it off, or code in the kernel withheld it)"
)


class _PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """Creates every file (the first and each one after a rotation) mode 0600."""

    def _open(self) -> Any:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return os.fdopen(fd, self.mode.replace("w", "a"), encoding=self.encoding, errors=self.errors)


class AuditLog:
    """An append-only JSON-lines file with size-based rotation, shared per path."""

    _instances: dict[Path, AuditLog] = {}
    _instances_lock = threading.Lock()

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        handler = _PrivateRotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=False
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        self.path = path
        self._logger = logging.getLogger(f"sandbox_kernel.audit.{len(self._instances)}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._logger.handlers = [handler]

    @classmethod
    def open(cls, path: str | os.PathLike[str], max_bytes: int, backups: int) -> AuditLog:
        """The one AuditLog of ``path`` in this process (rotation needs a single writer)."""
        resolved = Path(path).expanduser().resolve()
        with cls._instances_lock:
            if resolved not in cls._instances:
                cls._instances[resolved] = cls(resolved, max_bytes, backups)
            return cls._instances[resolved]

    def write(self, record: dict[str, Any]) -> None:
        self._logger.info(json.dumps(record, ensure_ascii=True, default=str))


@dataclass
class PendingExecution:
    """An execute_request still waiting for its reply."""

    started: float
    wall: str
    username: str
    session: str
    code: str
    #: The client's routing identities at the bridge, and the request's header: what a
    #: reply on the kernel's behalf needs if the kernel never sends one.
    idents: list[bytes]
    header: dict[str, Any]
    #: When the kernel said it began this one (its execute_input); queued ones have None.
    running_since: float | None = None
    #: Whether its client answers prompts on stdin (the request's allow_stdin).
    allow_stdin: bool = False
    #: The egress proxy's verdicts while it ran (the first ``_MAX_EGRESS``), and how many more.
    egress: list[dict[str, Any]] = field(default_factory=list)
    egress_dropped: int = 0


def _split(frames: Sequence[zmq.Frame | bytes]) -> tuple[list[bytes], list[bytes]] | None:
    """(routing identities, message parts), or None if not a Jupyter message."""
    index = find_delimiter(frames)
    if index is None:
        return None
    return [frame_bytes(f) for f in frames[:index]], [frame_bytes(f) for f in frames[index + 1 : index + 6]]


class ExecutionAuditor:
    """Watches one kernel's shell traffic in the bridge thread: which executions are
    running since when (for the wall-clock limit), and the audit lines (if logging)."""

    def __init__(self, log_file: AuditLog | None, kernel_id: str, kernelspec: str) -> None:
        self._log = log_file
        self._kernel_id = kernel_id
        self._kernelspec = kernelspec
        #: Sees stdin messages (to_kernel, idents, parts) and may take one (False): the
        #: approval broker's answers.
        self.on_stdin: Callable[[bool, list[bytes], list[bytes]], bool] | None = None
        self._pending: dict[str, PendingExecution] = {}
        self._lock = threading.Lock()
        self._last_activity = time.monotonic()
        #: When the oldest pending execution became the oldest (the one before it ended).
        self._head_since = time.monotonic()
        #: Set while the kernel is stopped for good (the idle limit): requests get
        #: ``on_refused`` at once instead of waiting for a kernel that will not answer.
        self._refusing: str | None = None
        self.on_refused: Callable[[PendingExecution], None] | None = None
        #: Called with each execution the kernel went past without its reply reaching
        #: the host (see :meth:`_end_earlier_locked`), so its client can be told.
        self.on_lost: Callable[[PendingExecution], None] | None = None
        self._egress_tokens = float(_EGRESS_BURST)
        self._egress_stamp = time.monotonic()
        self._egress_suppressed = 0

    def __call__(self, channel: str, to_kernel: bool, frames: Sequence[zmq.Frame | bytes]) -> bool:
        """Note one message; False for a request refused (answered here, not passed on)."""
        if channel not in ("shell", "iopub", "stdin"):
            return True
        split = _split(frames)
        if split is None:
            return True
        idents, parts = split
        if channel == "stdin":
            on_stdin = self.on_stdin
            return True if on_stdin is None else on_stdin(to_kernel, idents, parts)
        if channel == "iopub":
            if not to_kernel:
                self._started(parts)
        elif to_kernel:
            return self._request(idents, parts)
        else:
            self._reply(parts)
        return True

    def _started(self, parts: list[bytes]) -> None:
        """The kernel announced it runs a request: its wall-clock starts now, not when queued."""
        if load_dict(parts[1]).get("msg_type") != "execute_input":
            return
        msg_id = str(load_dict(parts[2]).get("msg_id", ""))
        with self._lock:
            pending = self._pending.get(msg_id)
            if pending is None:
                return
            if pending.running_since is None:
                pending.running_since = time.monotonic()
            lost = self._end_earlier_locked(msg_id)
        self._lose(lost)

    def _end_earlier_locked(self, msg_id: str) -> list[tuple[str, PendingExecution]]:
        """Take out the executions sent before ``msg_id`` to the same shell; hold the lock.

        A shell (the main one, or one subshell) runs its requests in order: once the
        kernel begins or answers a later one, the earlier ones are over even if their
        replies never reached the host (cut off with a message over the size cap, or
        withheld). Left pending, the first would pass for running for ever, and every
        later cell's output would be charged to its output budget. Moving on gives the
        kernel nothing it lacks: it could send those replies itself.
        """
        shell = self._pending[msg_id].header.get("subshell_id")
        lost: list[tuple[str, PendingExecution]] = []
        for earlier, pending in list(self._pending.items()):
            if earlier == msg_id:
                break
            if pending.header.get("subshell_id") == shell:
                lost.append((earlier, self._pending.pop(earlier)))
        if lost:
            self._head_since = time.monotonic()
        return lost

    def _lose(self, lost: list[tuple[str, PendingExecution]]) -> None:
        for msg_id, pending in lost:
            self._finish(msg_id, pending, f"no reply: {LOST_REPLY}", None)
            if self.on_lost is not None:
                self.on_lost(pending)

    def _request(self, idents: list[bytes], parts: list[bytes]) -> bool:
        """An execute_request on its way to the kernel; False if refused (answered here)."""
        header = load_dict(parts[1], limit=None)
        if header.get("msg_type") != "execute_request":
            return True
        content = load_dict(parts[4], limit=None)
        pending = PendingExecution(
            started=time.monotonic(),
            wall=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            username=str(header.get("username", "")),
            session=str(header.get("session", "")),
            code=str(content.get("code", "")),
            idents=idents,
            header=header,
            allow_stdin=content.get("allow_stdin") is True,
        )
        msg_id = str(header.get("msg_id", ""))
        with self._lock:
            refusing = self._refusing
            if refusing is None:
                self._last_activity = time.monotonic()
                superseded = self._pending.pop(msg_id, None)
                if superseded is not None:
                    self._finish(msg_id, superseded, "unanswered (its msg_id was reused)", None)
                self._pending[msg_id] = pending
                # Written now too, so a server that dies mid-cell still leaves a trace.
                self._write(self._record("started", msg_id, pending))
                while len(self._pending) > _MAX_PENDING:
                    oldest = next(iter(self._pending))
                    self._finish(oldest, self._pending.pop(oldest), "unanswered (too many pending)", None)
                return True
        self._write(self._record("started", msg_id, pending))
        self._finish(msg_id, pending, f"refused: {refusing}", None)
        if self.on_refused is not None:
            self.on_refused(pending)
        return False

    def _reply(self, parts: list[bytes]) -> None:
        header = load_dict(parts[1])
        if header.get("msg_type") != "execute_reply":
            return
        msg_id = str(load_dict(parts[2]).get("msg_id", ""))
        with self._lock:
            if msg_id not in self._pending:
                return  # the kernel's word alone is no activity
            lost = self._end_earlier_locked(msg_id)
            pending = self._pending.pop(msg_id)
            self._last_activity = time.monotonic()
            self._head_since = time.monotonic()
        self._lose(lost)
        content = load_dict(parts[4])
        status = content.get("status")
        count = content.get("execution_count")
        self._finish(
            msg_id,
            pending,
            status if status in ("ok", "error", "aborted") else "malformed reply",
            count if isinstance(count, int) else None,
        )

    def _record(self, event: str, msg_id: str, pending: PendingExecution) -> dict[str, Any]:
        return {
            "event": event,
            "time": pending.wall,
            "kernel_id": self._kernel_id,
            "kernelspec": self._kernelspec,
            "username": pending.username,
            "session": pending.session,
            "msg_id": msg_id,
            "code": pending.code,
        }

    def _finish(
        self, msg_id: str, pending: PendingExecution, status: str, execution_count: int | None
    ) -> None:
        record = self._record("finished", msg_id, pending)
        record.update(
            status=status,
            duration=round(time.monotonic() - pending.started, 6),
            execution_count=execution_count,
            egress=pending.egress,
        )
        if pending.egress_dropped:
            record["egress_dropped"] = pending.egress_dropped
        self._write(record)

    def egress(self, decision: Mapping[str, Any]) -> bool:
        """Record one verdict of the egress proxy (any thread), with the execution it served.

        Code runs between executions too (threads it started): such decisions carry no
        msg_id; the attribution is the host's best guess (the running, else the oldest
        pending execution), as code can act in the background. Each decision gets its
        own line at once (rate-limited; returns whether it did), and joins its
        execution's "finished" line.
        """
        with self._lock:
            now = time.monotonic()
            self._egress_tokens = min(
                float(_EGRESS_BURST), self._egress_tokens + (now - self._egress_stamp) * _EGRESS_RATE
            )
            self._egress_stamp = now
            suppressed = 0
            if self._egress_tokens >= 1:
                self._egress_tokens -= 1
                suppressed, self._egress_suppressed = self._egress_suppressed, 0
                write = True
            else:
                self._egress_suppressed += 1
                write = False
            running = self._running_locked()
            msg_id = running[1] if running else next(iter(self._pending), None)
            pending = self._pending.get(msg_id) if msg_id is not None else None
            if pending is not None:
                if len(pending.egress) < _MAX_EGRESS:
                    pending.egress.append({key: decision.get(key) for key in _EGRESS_SUMMARY})
                else:
                    pending.egress_dropped += 1
        if not write:
            return False
        wall = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        base = {"time": wall, "kernel_id": self._kernel_id, "kernelspec": self._kernelspec}
        if suppressed:
            self._write({"event": "egress_suppressed", **base, "count": suppressed})
        self._write(
            {
                "event": "egress",
                **base,
                "msg_id": msg_id,
                **{key: decision.get(key) for key in (*_EGRESS_SUMMARY, "address")},
            }
        )
        return True

    def approval(self, host: str, port: int, answer: str, by: str, waited: float) -> None:
        """Record what the kernel's holder answered (or why nobody did) to a request that
        needed approval, with the execution it served."""
        running = self.running()
        self._write(
            {
                "event": "approval",
                "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                "kernel_id": self._kernel_id,
                "kernelspec": self._kernelspec,
                "msg_id": running[0] if running else None,
                "host": host,
                "port": port,
                "answer": answer,
                "by": by,
                "waited": round(waited, 3),
            }
        )

    def credential(self, action: str, credential: BoundCredential) -> None:
        """Record that a credential was bound to the kernel or revoked: its name, domains,
        header names, expiry and who bound it; never a value."""
        wall = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        expires = credential.expires_at
        self._write(
            {
                "event": "credential",
                "time": wall,
                "kernel_id": self._kernel_id,
                "kernelspec": self._kernelspec,
                "action": action,
                "name": credential.name,
                "domains": list(credential.rules.patterns),
                "headers": list(credential.header_names),
                "expires": None
                if expires is None
                else datetime.fromtimestamp(expires, timezone.utc).isoformat(timespec="seconds"),
                "by": credential.by,
            }
        )

    def lifecycle(self, action: str, **details: Any) -> None:
        """Record a step of the kernel's life the host took: ``pause``, ``resume`` (with
        how long it took, the checkpoint's size, why, or what failed)."""
        wall = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        record = {"event": action, "time": wall, "kernel_id": self._kernel_id, "kernelspec": self._kernelspec}
        self._write({**record, **details})

    def _write(self, record: dict[str, Any]) -> None:
        if self._log is None:
            return
        try:
            self._log.write(record)
        except OSError as exc:
            log.error("Cannot write the audit log %s: %s", self._log.path, exc)

    def running(self) -> tuple[str, float] | None:
        """(msg_id, seconds running) of the execution the kernel is running, if any.

        Requests queued behind it do not count: "Run all" sends every cell at once.
        """
        with self._lock:
            running = self._running_locked()
        if running is None:
            return None
        since, msg_id = running
        return msg_id, time.monotonic() - since

    def _running_locked(self) -> tuple[float, str] | None:
        """(since, msg_id) of the execution the kernel began first; hold the lock.

        The kernel runs requests in order, so the oldest pending one is running since it
        arrived or since the one before it was answered, whichever is later, even if the
        kernel never says so (its execute_input is its word, which code in it can withhold).
        """
        running = [(p.running_since, msg_id) for msg_id, p in self._pending.items() if p.running_since]
        if self._pending:
            head_id, head = next(iter(self._pending.items()))
            if head.running_since is None:
                running.append((max(head.started, self._head_since), head_id))
        return min(running) if running else None

    def current(self) -> PendingExecution | None:
        """The oldest execution still waiting for its reply (host-known: clients sent it)."""
        with self._lock:
            return next(iter(self._pending.values()), None)

    def idle_for(self) -> float | None:
        """Seconds since the last execution began or ended; None while one is pending."""
        with self._lock:
            return None if self._pending else time.monotonic() - self._last_activity

    def refuse_if_idle(self, limit: float, reason: str) -> bool:
        """Atomically: if nothing ran for ``limit`` seconds, refuse new requests from now on."""
        with self._lock:
            if self._pending or self._refusing is not None or time.monotonic() - self._last_activity < limit:
                return False
            self._refusing = reason
            return True

    def refuse(self, reason: str | None) -> None:
        """From now on, answer every new execute_request with ``on_refused`` (None: stop).

        Reopening also restarts the idle clock: a fresh kernel has just begun.
        """
        with self._lock:
            self._refusing = reason
            self._last_activity = time.monotonic()

    def abandon_pending(self, reason: str) -> list[PendingExecution]:
        """Write every execution still waiting for its reply (the kernel went away).

        Returns them, so their clients can be told.
        """
        with self._lock:
            pending, self._pending = self._pending, {}
            self._head_since = time.monotonic()
        for msg_id, item in pending.items():
            self._finish(msg_id, item, reason, None)
        return list(pending.values())
