"""The audit trail: one JSON line per execution, written on the host by the bridge.

The bridge sees every ``execute_request`` a client sends, from any client, and the
kernel's ``execute_reply``. Each execution gets a line when it arrives and one, complete
on its own, when it finishes (or is abandoned)::

    {"event": "started", "time": "...", "kernel_id": "...", "kernelspec": "...",
     "username_claimed": "...", "client_uid": 1000, "client_pid": 4242,
     "server_uid": 1000, "session": "...", "msg_id": "...", "code": "..."}
    {"event": "finished", ...the same..., "status": "ok", "duration": 0.012,
     "execution_count": 3, "egress": [{"method": "CONNECT", "host": "pypi.org",
     "port": 443, "verdict": "allowed", "reason": "..."}]}

Everything of the request that the kernel runs is there: ``user_expressions`` (each one
evaluated after the code, also when the code is empty) and ``"silent": true`` when set.
Long code is logged bounded (its head and tail, with ``code_sha256`` and ``code_bytes``
of the whole), so a few huge cells cannot rotate earlier lines out of the files.
``username_claimed`` is the header's user name, which the client writes; ``client_uid``
and ``client_pid`` are what the host's kernel says about a unix-socket peer (null over
tcp), ``server_uid`` the uid of the process that writes the log.

The kernel's own lines (``start``, ``restart``, ``exit``, ``shutdown``, ``pause``...) say
what the host did to it; those of its start and end, its ``egress`` verdicts and its
``approval`` answers carry ``"user": "alice"`` when a sandbox gateway started it for alice
(the user the gateway authenticated).

Requests the bridge refuses (:func:`~.bridge.refusal`: ``debug_request``, code on the
control channel) get a ``refused`` line, with what they would have run.

The auditor also decides which of the kernel's stdin messages reach a client (see
:meth:`ExecutionAuditor.prompt`): at most one ``input_request`` at a time, of at most
:data:`MAX_PROMPT` bytes, for the running execution if its request allowed stdin, to the
client that sent it. Refused ones get a line, the first per execution (and the first
between executions), the kernel deciding how many it sends::

    {"event": "prompt_refused", "time": "...", "kernel_id": "...", "kernelspec": "...",
     "msg_id": "..." (the running execution, or null), "reason": "...", "bytes": 1048790}

and the execution's "finished" line counts them all (``"prompts_refused": 256``).

Each verdict of the egress proxy (network "allowlist") gets a line as it happens::

    {"event": "egress", "time": "...", "kernel_id": "...", "kernelspec": "...",
     "msg_id": "..." (the execution it served, or null), "method": "CONNECT",
     "host": "evil.example", "port": 443, "verdict": "denied", "reason": "...",
     "address": null}

Allowed requests always do; denials past a rate are counted, and the count is written
before the next line, within a second, or when the kernel ends, whichever comes first.

The file lives outside every mount of the sandbox. Replies come from the sandbox and are
untrusted: only small frames are parsed, and anything malformed is recorded as such.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import logging.handlers
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import zmq

from sandbox_kernel.channels.bridge import peer_credentials, refusal
from sandbox_kernel.channels.wire import MAX_HEADER_FRAME, find_delimiter, frame_bytes, load_dict
from sandbox_kernel.egress.credentials import BoundCredential

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
#: Longest a run of suppressed denials waits for its count to be written (seconds).
_EGRESS_FLUSH = 1.0
#: Code up to this many characters is logged whole; longer code as its first and last
#: ``_CODE_KEPT`` characters, with the whole code's size and hash. A client decides how
#: long its code is: a line must not grow with it, or a few cells rotate the log away.
_CODE_WHOLE = 16 * 1024
_CODE_KEPT = 4 * 1024
#: The same for the other strings a client writes into its request (user name, session,
#: msg_id, the names of user expressions, a debug command).
_FIELD_WHOLE = 256
_FIELD_KEPT = 96
#: Largest stdin message (all its frames) the kernel may send a client: a prompt, not a
#: way around the output limit.
MAX_PROMPT = 64 * 2**10
#: Why a stdin message from the kernel does not reach clients (see ExecutionAuditor.prompt).
NOT_A_PROMPT = "not an input_request"
PROMPT_TOO_BIG = "a prompt over 64 KiB"
NO_CELL = "no cell is running"
NO_STDIN = "its cell was run with allow_stdin false"
NOT_ITS_CLIENT = "not to the client running the cell"
PROMPT_WAITING = "a prompt already waits for its answer"
#: The kernel's lines that name the user a sandbox gateway started it for: its lifecycle,
#: and what it asked of the network and who allowed it.
_USER_EVENTS = frozenset({"start", "restart", "exit", "shutdown", "egress", "approval"})
#: What of an egress decision goes into the execution's "finished" line.
_EGRESS_SUMMARY = ("method", "host", "port", "verdict", "reason")
#: Why an execution the kernel went past has no reply (the audit line, and its client).
LOST_REPLY = (
    "the kernel went on to its next request without a reply to this one reaching the host "
    "(it was over the size cap and dropped, or code in the kernel withheld it)"
)

#: Why an execution queued on a subshell that was deleted has no reply.
SUBSHELL_DELETED = (
    "its subshell was deleted before it finished, and the kernel drops the requests queued on a "
    "deleted subshell"
)
#: Seconds an execution's reply may come after the kernel began a later request of the
#: same shell (see ExecutionAuditor._started) before the host takes it for lost.
OVERTAKEN_GRACE = 10.0
#: The most subshell deletions waiting for the kernel's reply that the host keeps in mind.
_MAX_DELETIONS = 64


class _PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """Creates every file (the first and each one after a rotation) mode 0600."""

    def _open(self) -> Any:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return os.fdopen(fd, self.mode.replace("w", "a"), encoding=self.encoding, errors=self.errors)


class AuditLog:
    """An append-only JSON-lines file with size-based rotation, shared per path.

    Each line is one ``write(2)`` to the file opened ``O_APPEND`` (the bridge's thread
    writes two for each execution, on the way of its messages): the handler is kept for
    its rotation only, which happens before the line that would take the file to
    ``max_bytes`` (never for a file that is not a regular one, e.g. ``/dev/stdout``)."""

    _instances: dict[Path, AuditLog] = {}
    _instances_lock = threading.Lock()

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._handler = _PrivateRotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=False
        )
        self.path = path

    @classmethod
    def open(cls, path: str | os.PathLike[str], max_bytes: int, backups: int) -> AuditLog:
        """The one AuditLog of ``path`` in this process (rotation needs a single writer)."""
        resolved = Path(path).expanduser().resolve()
        with cls._instances_lock:
            if resolved not in cls._instances:
                cls._instances[resolved] = cls(resolved, max_bytes, backups)
            return cls._instances[resolved]

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line.

        Raises:
            OSError: the file cannot be written (or rotated).
        """
        line = memoryview((json.dumps(record, ensure_ascii=True, default=str) + "\n").encode())
        handler = self._handler
        handler.acquire()  # (logging's shutdown closes the handler under its lock)
        try:
            if handler.stream is None:  # (a rotation that failed to open the next file)
                handler.stream = handler._open()
            if handler.maxBytes > 0:
                status = os.fstat(handler.stream.fileno())
                if stat.S_ISREG(status.st_mode) and status.st_size + len(line) >= handler.maxBytes:
                    handler.doRollover()
            fd = handler.stream.fileno()
            written = os.write(fd, line)
            if written < len(line):  # (a full disk took part of it)
                self._write_rest(fd, line, written)
        finally:
            handler.release()

    @staticmethod
    def _write_rest(fd: int, line: memoryview, written: int) -> None:
        """Write what is left of ``line``, of which a write took ``written`` bytes. If a
        write fails (the disk is full), what was written of it is taken back, so that the
        next line starts a line."""
        start: int | None = None
        with contextlib.suppress(OSError):  # (a pipe has no offset, and nothing to take back)
            # O_APPEND: the offset is where this process's last write ended.
            end = os.lseek(fd, 0, os.SEEK_CUR)
            start = end - written
        try:
            while written < len(line):
                done = os.write(fd, line[written:])
                if start is not None:
                    end = os.lseek(fd, 0, os.SEEK_CUR)
                    if end - done != start + written:
                        start = None  # another process's write came between the parts
                written += done
        except BaseException:
            if start is not None:
                _take_back(fd, start, end)
            raise


def _take_back(fd: int, start: int, end: int) -> None:
    """Cut the file ``fd`` back to ``start``, if it still ends at ``end``: the part of a
    line this process wrote there. Not if anything came after it (another process using
    the same log: a user's server and their ``sandbox-kernel mcp``)."""
    with contextlib.suppress(OSError):
        status = os.fstat(fd)
        if stat.S_ISREG(status.st_mode) and status.st_size == end:
            os.ftruncate(fd, start)


@dataclass
class PendingExecution:
    """An execute_request still waiting for its reply."""

    started: float
    wall: str
    #: The header's user name: the client's claim, bounded like every field it writes.
    username: str
    session: str
    #: The code as logged (bounded: see :func:`bounded`).
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
    #: The kernel's stdin messages refused while it ran (see ExecutionAuditor.prompt).
    prompts_refused: int = 0
    #: More of what its audit lines show: who sent it (as the host knows), what else of
    #: the request the kernel runs (user_expressions, silent), the whole code's hash.
    details: dict[str, Any] = field(default_factory=dict)
    #: When the kernel began a later request of the same shell, this one's reply not come yet.
    overtaken: float | None = None
    #: What its client is told (ename, evalue) if the host ends it without the kernel's reply.
    lost: tuple[str, str] = ("ReplyLost", LOST_REPLY)


#: The metadata key in which jupyter_server (see :mod:`~.server_audit`) puts the user it
#: authenticated, over anything the client wrote there.
AUTHENTICATED_USER = "sandbox_kernel_user"


def bounded(text: str, whole: int = _CODE_WHOLE, kept: int = _CODE_KEPT) -> str:
    """``text`` if at most ``whole`` characters, else its first and last ``kept`` with a
    marker between saying how much was left out (code also gets its hash beside it:
    see :func:`_code_fields`)."""
    if len(text) <= whole:
        return text
    left_out = len(text) - 2 * kept
    marker = f"\n[sandbox-kernel: {left_out} of {len(text)} characters left out of the audit log here]\n"
    return f"{text[:kept]}{marker}{text[-kept:]}"


def _field(value: object) -> str:
    """A string the client wrote, as the log shows it (bounded)."""
    return bounded(str(value), _FIELD_WHOLE, _FIELD_KEPT)


def _code_fields(name: str, text: str) -> dict[str, Any]:
    """``{name: text}``, or its bounded form with ``{name}_sha256`` and ``{name}_bytes`` of
    the whole (UTF-8, as the kernel received it) when it is long."""
    shown = bounded(text)
    if shown is text:
        return {name: text}
    raw = text.encode("utf-8", "surrogatepass")
    return {name: shown, f"{name}_sha256": hashlib.sha256(raw).hexdigest(), f"{name}_bytes": len(raw)}


def _expressions(value: object) -> dict[str, Any]:
    """The ``user_expressions`` fields of a record: the kernel evaluates each value after the
    code. Logged as given when small, else (as JSON text) bounded like code."""
    if not value:
        return {}
    text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) <= _CODE_WHOLE and isinstance(value, dict):
        return {"user_expressions": {str(name): str(expr) for name, expr in value.items()}}
    return _code_fields("user_expressions", text)


def request_fields(content: Mapping[str, Any]) -> dict[str, Any]:
    """What an execute_request makes the kernel run, as its audit lines show it: the code
    and, if any, its user_expressions and ``silent`` (which runs it all the same, unannounced)."""
    fields = _code_fields("code", str(content.get("code", "")))
    fields.update(_expressions(content.get("user_expressions")))
    if content.get("silent"):
        fields["silent"] = True
    return fields


def _debug_fields(content: Mapping[str, Any]) -> dict[str, Any]:
    """A debug request's DAP command, and the code it carries (``evaluate``'s expression,
    ``dumpCell``'s code), as the log shows them."""
    arguments = content.get("arguments")
    code = ""
    if isinstance(arguments, dict):
        code = next((str(arguments[key]) for key in ("expression", "code") if key in arguments), "")
    return {"command": _field(content.get("command", "")), **_code_fields("code", code)}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _split(frames: Sequence[zmq.Frame | bytes]) -> tuple[list[bytes], list[bytes]] | None:
    """(routing identities, message parts), or None if not a Jupyter message."""
    index = find_delimiter(frames)
    if index is None:
        return None
    return [frame_bytes(f) for f in frames[:index]], [frame_bytes(f) for f in frames[index + 1 : index + 6]]


def _shell(pending: PendingExecution) -> str | None:
    """The shell that runs ``pending``: None for the main one, else its subshell's id (as
    text: a client's header may hold any JSON there)."""
    shell = pending.header.get("subshell_id")
    return None if shell is None else str(shell)


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
        #: Per shell (the main one: None; a subshell: its id), when its oldest pending
        #: execution became its oldest (the one before it on that shell ended). Each shell
        #: runs its own queue: another's replies say nothing of this one's.
        self._head_since: dict[str | None, float] = {}
        #: Counts the changes to the pending executions (and their shells' clocks): what
        #: :meth:`executing` found stays true until the next one. The output cap asks it
        #: for each message the kernel publishes; a change comes once per request or so.
        self._changes = 0
        self._executing: tuple[int, list[tuple[str, dict[str, Any]]]] = (0, [])
        #: Set while the kernel is stopped for good (the idle limit): requests get
        #: ``on_refused`` at once instead of waiting for a kernel that will not answer.
        self._refusing: str | None = None
        self.on_refused: Callable[[PendingExecution], None] | None = None
        #: Called with each execution the kernel went past without its reply reaching
        #: the host (see :meth:`_end_earlier_locked`), so its client can be told.
        self.on_lost: Callable[[PendingExecution], None] | None = None
        #: The subshell each delete_subshell_request names, by its msg_id, until answered.
        self._deleting: dict[str, str] = {}
        self._egress_tokens = float(_EGRESS_BURST)
        self._egress_stamp = time.monotonic()
        self._egress_suppressed = 0
        self._egress_suppressed_since = ""
        self._egress_timer: threading.Timer | None = None
        self._server_uid = os.getuid()
        #: The user a sandbox gateway started the kernel for (their name): on the lines
        #: of its start, restart, exit and shutdown, its egress verdicts and approvals.
        self.user: str | None = None
        #: The execution whose prompt waits for its client's answer, if any.
        self._prompting: str | None = None
        #: A refused prompt got its line since the last execution ended.
        self._refused_between = False

    def __call__(self, channel: str, to_kernel: bool, frames: Sequence[zmq.Frame | bytes]) -> bool | str:
        """Note one message; False for a request refused (answered here, not passed on),
        or why a stdin message from the kernel must not reach clients (see :meth:`prompt`)."""
        if channel not in ("shell", "control", "iopub", "stdin"):
            return True
        split = _split(frames)
        if split is None:
            return True
        idents, parts = split
        if channel == "stdin":
            if not to_kernel:
                why = self.prompt(idents, parts, sum(len(frame) for frame in frames))
                if why is not None:
                    return why
            on_stdin = self.on_stdin
            passes = True if on_stdin is None else on_stdin(to_kernel, idents, parts)
            if passes and to_kernel and load_dict(parts[1]).get("msg_type") == "input_reply":
                with self._lock:
                    self._prompting = None  # answered: the kernel may ask again
            return passes
        if channel == "iopub":
            if not to_kernel:
                self._started(parts)
        elif to_kernel:
            passes = self._request(channel, idents, parts, self._client(frames))
            if passes and channel == "control":
                self._deletion_asked(parts)
            return passes
        elif channel == "shell":
            self._reply(parts)
        else:
            self._deletion_answered(parts)
        return True

    def prompt(self, idents: list[bytes], parts: list[bytes], size: int) -> str | None:
        """Why a stdin message from the kernel (``size`` bytes in all) must not reach
        clients, or None to let it pass (it is then the prompt that waits for its answer).

        stdin is a way out to clients that the output limit does not watch, and the kernel
        can send to it at will: only an ``input_request`` passes, of at most
        :data:`MAX_PROMPT` bytes, while an execution runs whose request allowed stdin, to
        the client that sent it, and only when no earlier prompt of it waits for the
        client's ``input_reply``. Refusals are counted on the execution and logged (see
        the module's docstring). The host's own prompts (:mod:`~.approval`) never pass here.
        """
        header = load_dict(parts[1])
        parent = load_dict(parts[2]).get("msg_id")
        with self._lock:
            running = [msg_id for _, msg_id in sorted(self._heads_locked())]
            # The prompt's own execution if it runs (subshells run beside the main shell),
            # else the one that began first.
            msg_id = parent if parent in running else next(iter(running), None)
            pending = self._pending.get(msg_id) if msg_id is not None else None
            if header.get("msg_type") != "input_request":
                why = NOT_A_PROMPT
            elif pending is None:
                why = NO_CELL
            elif not pending.allow_stdin:
                why = NO_STDIN
            elif idents[:1] != pending.idents[:1]:  # (the client-facing ROUTER routes by the first)
                why = NOT_ITS_CLIENT
            elif size > MAX_PROMPT:
                why = PROMPT_TOO_BIG
            elif self._prompting == msg_id:
                why = PROMPT_WAITING
            else:
                self._prompting = msg_id
                return None
            if pending is not None:
                pending.prompts_refused += 1
                first = pending.prompts_refused == 1
            else:
                first, self._refused_between = not self._refused_between, True
        if first:  # one line per execution, or between two: the kernel decides how many come
            shown = None if msg_id is None else _field(msg_id)
            line = {"event": "prompt_refused", **self._base(), "msg_id": shown, "reason": why, "bytes": size}
            self._write(line)
        return why

    def _client(self, frames: Sequence[zmq.Frame | bytes]) -> dict[str, Any]:
        """Who sent a request, as the host knows it (not as its header says)."""
        peer = peer_credentials(frames)
        return {
            "client_uid": peer[0] if peer else None,
            "client_pid": peer[1] if peer else None,
            "server_uid": self._server_uid,
        }

    def _started(self, parts: list[bytes]) -> None:
        """The kernel announced it runs a request: its wall-clock starts now, not when queued.

        The executions before it on the same shell are over, but their replies may still
        be on their way: once ipykernel's shell-channel thread has the shell socket (a
        client asked for a subshell), a reply takes a hop through it that the next
        request's execute_input does not. They no longer count as running; a reply ends
        each as usual, and one that has not come within :data:`OVERTAKEN_GRACE` seconds
        (or before a later reply of that shell) is lost (see :meth:`_end_earlier_locked`).
        """
        if load_dict(parts[1], limit=MAX_HEADER_FRAME).get("msg_type") != "execute_input":
            return
        msg_id = str(load_dict(parts[2], limit=MAX_HEADER_FRAME).get("msg_id", ""))
        now = time.monotonic()
        with self._lock:
            pending = self._pending.get(msg_id)
            if pending is None:
                return
            # (Counted only if it changes something: the kernel may repeat its word.)
            changed = pending.running_since is None
            if changed:
                pending.running_since = now
            shell = _shell(pending)
            for earlier, other in self._pending.items():
                if earlier == msg_id:
                    break
                if _shell(other) == shell and other.overtaken is None:
                    other.overtaken = now
                    changed = True
            if changed:
                self._changes += 1
            lost = self._overdue_locked(now)
        self._lose(lost)

    def _overdue_locked(self, now: float) -> list[tuple[str, PendingExecution]]:
        """Take out the overtaken executions whose reply is overdue; hold the lock."""
        overdue = [
            msg_id
            for msg_id, pending in self._pending.items()
            if pending.overtaken is not None and now - pending.overtaken >= OVERTAKEN_GRACE
        ]
        # (Overtaken executions run no more: taking them out changes nothing executing() says.)
        return [(msg_id, self._pending.pop(msg_id)) for msg_id in overdue]

    def _end_earlier_locked(self, msg_id: str) -> list[tuple[str, PendingExecution]]:
        """Take out the executions sent before ``msg_id`` to the same shell; hold the lock.

        A shell (the main one, or one subshell) runs its requests in order: once the
        kernel answers a later one (or began it a while ago), the earlier ones are over
        even if their replies never reached the host (over the size cap and dropped, or
        withheld). Left pending, the first would pass for running for ever, and every
        later cell's output would be charged to its output budget. Moving on gives the
        kernel nothing it lacks: it could send those replies itself.
        """
        shell = _shell(self._pending[msg_id])
        lost: list[tuple[str, PendingExecution]] = []
        for earlier, pending in list(self._pending.items()):
            if earlier == msg_id:
                break
            if _shell(pending) == shell:
                lost.append((earlier, self._pending.pop(earlier)))
        if lost:  # (its caller counts the change)
            self._head_since[shell] = time.monotonic()
        return lost

    def _deletion_asked(self, parts: list[bytes]) -> None:
        header = load_dict(parts[1])
        if header.get("msg_type") != "delete_subshell_request":
            return
        subshell_id = load_dict(parts[4]).get("subshell_id")
        if not isinstance(subshell_id, str):
            return
        with self._lock:
            self._deleting[str(header.get("msg_id", ""))] = subshell_id
            while len(self._deleting) > _MAX_DELETIONS:
                del self._deleting[next(iter(self._deleting))]

    def _deletion_answered(self, parts: list[bytes]) -> None:
        """A subshell the kernel deleted: the requests still queued on it are over.

        ipykernel stops the subshell's thread and drops them, unanswered. Left pending,
        they would keep the kernel busy for good and, once the oldest, pass for an
        execution past its wall-clock limit."""
        if load_dict(parts[1]).get("msg_type") != "delete_subshell_reply":
            return
        with self._lock:
            subshell_id = self._deleting.pop(str(load_dict(parts[2]).get("msg_id", "")), None)
        if subshell_id is None or load_dict(parts[4]).get("status") != "ok":
            return
        with self._lock:
            dropped = [(m, p) for m, p in self._pending.items() if _shell(p) == subshell_id]
            for msg_id, pending in dropped:
                del self._pending[msg_id]
                pending.lost = ("SubshellDeleted", SUBSHELL_DELETED)
            self._head_since.pop(subshell_id, None)
            self._changes += 1
            if dropped:
                self._last_activity = time.monotonic()
        self._lose(dropped)

    def _lose(self, lost: list[tuple[str, PendingExecution]]) -> None:
        for msg_id, pending in lost:
            self._finish(msg_id, pending, f"no reply: {pending.lost[1]}", None)
            if self.on_lost is not None:
                self.on_lost(pending)

    def _request(self, channel: str, idents: list[bytes], parts: list[bytes], client: dict[str, Any]) -> bool:
        """A request on its way to the kernel; False if refused (answered here or by the bridge)."""
        header = load_dict(parts[1], limit=None)
        msg_type = str(header.get("msg_type", ""))
        why = refusal(channel, msg_type)
        if why is not None:
            self._write_refused(channel, header, load_dict(parts[4], limit=None), client, why)
            return False
        if channel != "shell" or msg_type != "execute_request":
            return True
        content = load_dict(parts[4], limit=None)
        fields = request_fields(content)
        vouched = load_dict(parts[3]).get(AUTHENTICATED_USER)
        if isinstance(vouched, str):  # jupyter_server's, over the client's (see server_audit)
            fields["user_authenticated"] = _field(vouched)
        pending = PendingExecution(
            started=time.monotonic(),
            wall=_now(),
            username=_field(header.get("username", "")),
            session=_field(header.get("session", "")),
            code=fields.pop("code"),
            idents=idents,
            header=header,
            allow_stdin=content.get("allow_stdin") is True,
            details={**client, **fields},
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
                self._changes += 1
                if self._prompting == msg_id:
                    self._prompting = None  # (a msg_id used again)
                self._refused_between = False
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
            self._changes += 1
            self._last_activity = time.monotonic()
            shell = _shell(pending)
            if any(_shell(other) == shell for other in self._pending.values()):
                self._head_since[shell] = time.monotonic()
            else:  # (the next request of that shell starts its clock as it arrives)
                self._head_since.pop(shell, None)
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
        client = {key: pending.details.get(key) for key in ("client_uid", "client_pid", "server_uid")}
        extra = {key: value for key, value in pending.details.items() if key not in client}
        return {
            "event": event,
            "time": pending.wall,
            "kernel_id": self._kernel_id,
            "kernelspec": self._kernelspec,
            "username_claimed": pending.username,
            **client,
            "session": pending.session,
            "msg_id": _field(msg_id),
            "code": pending.code,
            **extra,
        }

    def _write_refused(
        self,
        channel: str,
        header: Mapping[str, Any],
        content: Mapping[str, Any],
        client: dict[str, Any],
        why: str,
    ) -> None:
        """The line of a request the bridge answers itself and never passes on."""
        msg_type = str(header.get("msg_type", ""))
        asked = request_fields(content) if msg_type == "execute_request" else _debug_fields(content)
        self._write(
            {
                "event": "refused",
                "time": _now(),
                "kernel_id": self._kernel_id,
                "kernelspec": self._kernelspec,
                "username_claimed": _field(header.get("username", "")),
                **client,
                "session": _field(header.get("session", "")),
                "msg_id": _field(header.get("msg_id", "")),
                "channel": channel,
                "msg_type": _field(msg_type),
                "reason": why,
                **asked,
            }
        )

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
        if pending.prompts_refused:
            record["prompts_refused"] = pending.prompts_refused
        self._write(record)

    def egress(self, decision: Mapping[str, Any]) -> bool:
        """Record one verdict of the egress proxy (any thread), with the execution it served.

        Code runs between executions too (threads it started): such decisions carry no
        msg_id; the attribution is the host's best guess (the running, else the oldest
        pending execution), as code can act in the background. Each decision joins its
        execution's "finished" line and gets its own line at once: an allowed one always
        (something left the sandbox), a denial within the rate. Denials over the rate are
        counted, and the count is written before the next line, within ``_EGRESS_FLUSH``
        seconds, or at :meth:`flush_egress`. Returns whether it got its line.
        """
        allowed = decision.get("verdict") == "allowed"
        with self._lock:
            now = time.monotonic()
            self._egress_tokens = min(
                float(_EGRESS_BURST), self._egress_tokens + (now - self._egress_stamp) * _EGRESS_RATE
            )
            self._egress_stamp = now
            suppressed: tuple[int, str] | None = None
            write = allowed or self._egress_tokens >= 1
            if write:
                if not allowed:
                    self._egress_tokens -= 1
                suppressed = self._take_suppressed_locked()
            else:
                if not self._egress_suppressed:
                    self._egress_suppressed_since = _now()
                self._egress_suppressed += 1
                if self._egress_timer is None and self._log is not None:
                    # Not a daemon: a server that exits meanwhile still writes the count.
                    self._egress_timer = threading.Timer(_EGRESS_FLUSH, self.flush_egress)
                    self._egress_timer.start()
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
        self._write_suppressed(suppressed)
        self._write(
            {
                "event": "egress",
                **self._base(),
                **self._user("egress"),
                "msg_id": None if msg_id is None else _field(msg_id),
                **{key: decision.get(key) for key in (*_EGRESS_SUMMARY, "address")},
            }
        )
        return True

    def flush_egress(self) -> None:
        """Write the count of denials not logged yet, if any (any thread): on a timer, and
        when the kernel ends."""
        with self._lock:
            suppressed = self._take_suppressed_locked()
        self._write_suppressed(suppressed)

    def _take_suppressed_locked(self) -> tuple[int, str] | None:
        """(count, since) of the denials not logged yet, now counted as written; hold the lock."""
        timer, self._egress_timer = self._egress_timer, None
        if timer is not None:
            timer.cancel()
        if not self._egress_suppressed:
            return None
        taken = (self._egress_suppressed, self._egress_suppressed_since)
        self._egress_suppressed = 0
        return taken

    def _write_suppressed(self, suppressed: tuple[int, str] | None) -> None:
        if suppressed is not None:
            count, since = suppressed
            self._write({"event": "egress_suppressed", **self._base(), "count": count, "since": since})

    def _base(self) -> dict[str, Any]:
        return {"time": _now(), "kernel_id": self._kernel_id, "kernelspec": self._kernelspec}

    def _user(self, event: str) -> dict[str, str]:
        """``{"user": name}`` for a line of ``event`` of a kernel a gateway started for a user."""
        return {"user": self.user} if self.user is not None and event in _USER_EVENTS else {}

    def approval(self, host: str, port: int, answer: str, by: str, waited: float) -> None:
        """Record what the kernel's holder answered (or why nobody did) to a request that
        needed approval, with the execution it served."""
        running = self.running()
        self._write(
            {
                "event": "approval",
                "time": _now(),
                "kernel_id": self._kernel_id,
                "kernelspec": self._kernelspec,
                **self._user("approval"),
                "msg_id": _field(running[0]) if running else None,
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
        wall = _now()
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

    def lifecycle(self, event: str, /, **details: Any) -> None:
        """Record a step of the kernel's life or what the host did to it: ``start``,
        ``restart``, ``exit``, ``shutdown``, ``pause``, ``resume`` (with how long it took,
        the checkpoint's size, why, or what failed), ``files`` (the files API)."""
        wall = _now()
        record = {"event": event, "time": wall, "kernel_id": self._kernel_id, "kernelspec": self._kernelspec}
        self._write({**record, **self._user(event), **details})

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
        Overtaken executions whose reply is overdue are ended here (the watchdog asks
        twice a second).
        """
        with self._lock:
            lost = self._overdue_locked(time.monotonic())
            running = self._running_locked()
        self._lose(lost)
        if running is None:
            return None
        since, msg_id = running
        return msg_id, time.monotonic() - since

    def _running_locked(self) -> tuple[float, str] | None:
        """(since, msg_id) of the execution the kernel began first; hold the lock."""
        return min(self._heads_locked(), default=None)

    def _heads_locked(self) -> list[tuple[float, str]]:
        """(since, msg_id) of each execution the kernel runs (one per shell); hold the lock.

        Each shell (the main one, each subshell) runs its requests in order, so its oldest
        pending one is running since it arrived or since the one before it on that shell
        was answered, whichever is later, even if the kernel never says so (its
        execute_input is its word, which code in it can withhold).
        """
        running = [
            (p.running_since, msg_id)
            for msg_id, p in self._pending.items()
            if p.running_since and p.overtaken is None
        ]
        heads: set[str | None] = set()
        for msg_id, pending in self._pending.items():
            if pending.overtaken is not None:
                continue
            shell = _shell(pending)
            if shell in heads:
                continue
            heads.add(shell)
            if pending.running_since is None:
                running.append((max(pending.started, self._head_since.get(shell, 0.0)), msg_id))
        return running

    def executing(self) -> list[tuple[str, dict[str, Any]]]:
        """(msg_id, request header) of each execution the kernel runs, one per shell (see
        :meth:`_heads_locked`), the one it began first first; empty while none is pending.

        The output cap asks it for each message the kernel publishes: the answer is kept
        until the pending executions change (the list returned must not be changed).
        """
        with self._lock:
            changes, executing = self._executing
            if changes != self._changes:
                executing = self._executing_locked()
                self._executing = (self._changes, executing)
            return executing

    def _executing_locked(self) -> list[tuple[str, dict[str, Any]]]:
        """What :meth:`executing` says, found afresh; hold the lock."""
        return [(msg_id, self._pending[msg_id].header) for _, msg_id in sorted(self._heads_locked())]

    def current(self) -> PendingExecution | None:
        """The oldest execution still waiting for its reply (host-known: clients sent it)
        that the kernel has not gone past."""
        with self._lock:
            return next((p for p in self._pending.values() if p.overtaken is None), None)

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
        """Write every execution still waiting for its reply, and the count of denials not
        logged yet (the kernel went away).

        Returns them, so their clients can be told.
        """
        with self._lock:
            pending, self._pending = self._pending, {}
            self._head_since = {}
            self._changes += 1
        for msg_id, item in pending.items():
            self._finish(msg_id, item, reason, None)
        self.flush_egress()  # the kernel's end: its last denials are counted now
        return list(pending.values())
