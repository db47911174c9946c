"""A cap on how much output one execution may send to clients, keeping what a reader needs.

A hostile or broken cell can print gigabytes; every byte of it would pass through the
Jupyter server to every client. The bridge asks :class:`OutputLimiter` about each IOPub
message from the kernel. Each execution has a budget: the server's ``output_limit``, or
less if the client asked for less in its execute_request's metadata::

    {"sandbox_kernel": {"output_limit": 65536}}

Of an execution past its budget, the beginning and the end reach clients:

- messages pass whole until the budget, less a reserve for the tail
  (:func:`tail_reserve`: 64 KiB, or a quarter of a smaller budget), is spent;
- the stdout/stderr message that crosses that line is cut, and its head passes (cut to
  the size of its message as sent: JSON writes a newline in two bytes);
- from then on stdout/stderr text is held back in a ring that keeps only its last
  ``reserve`` bytes; other output that does not fit is dropped, with one notice on stderr;
- the held tail is sent, after a marker saying how much was dropped
  (``[... 29.8 MiB of output dropped: over this kernel's output limit of 10 MiB per
  execution ...]``), when the execution ends: before the kernel's ``idle`` for it, before
  the next execution's first output, or before the host's own notices (the kernel died,
  a limit stopped it; see :meth:`OutputLimiter.release`).

Cells running on subshells at once (ipykernel 7) each have their own budget and their own
tail: a message is charged to the running cell whose parent it claims (or to one that
ended or was sent lately: a reply can overtake its cell's output, all of it even, and the
next cell begin before any is read), or to the one begun first if it claims none of them.

The kernel's prompts on stdin (``input_request``, the few the auditor lets through) are
charged to the same budget (:meth:`OutputLimiter.charge`): one that does not fit is dropped.
The bridge asks the limiter before the output cleaner reads a message, so output past the
budget is dropped unparsed (only stdout/stderr text past it is read, for the tail).

Text is cut on UTF-8 character boundaries; every message the limiter writes is signed
with the session key.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from jupyter_client.session import Session

from sandbox_kernel.channels.wire import (
    MAX_HEADER_FRAME,
    find_delimiter,
    load_dict,
    stderr_notice,
    stream_message,
)

#: Past the cap, plain status messages (busy/idle, nothing else, this small) still pass,
#: this many per execution, so clients see the kernel go idle after a capped execution.
_SMALL_STATUS = 1024
_STATUS_PAST_CAP = 16
#: Budgets remembered at once; the oldest are forgotten first.
_MAX_TRACKED = 256
#: Executions that ended lately whose output may still be on its way (their replies
#: overtake it in the bridge, which reads shell first), and those sent lately and not
#: seen running yet: a message may claim them.
_MAX_TRAILING = 16
#: Markers past the first that go out without text of the tail's (output dropped after
#: the tail went out, by a thread the cell started, say): a kernel making a cell's tail be
#: held and released again and again gets no more than these to clients.
_MARKERS_WITHOUT_TEXT = 4
#: Per-run limits remembered for requests whose output has not begun yet.
_MAX_REQUESTED = 4096
#: Most bytes of stdout/stderr held back for the tail of an execution past its budget.
TAIL_BYTES = 64 * 2**10
#: Most pieces (runs of one stream) in a held tail: a kernel alternating stdout and
#: stderr byte by byte must not cost more than a few bytes each.
_MAX_PIECES = 1024
#: The key under which a client narrows one execution's limit in its request's metadata.
METADATA_KEY = "sandbox_kernel"

#: Who is executing now, as the host knows it: (msg_id, request header) of each request
#: a client sent that a shell runs (the main shell, each subshell: one each), the one begun
#: first first; empty while idle.
Executing = Callable[[], Sequence[tuple[str, dict[str, Any]]]]
Message = Sequence[zmq.Frame | bytes]


def tail_reserve(limit: int) -> int:
    """Bytes of a ``limit``-byte budget kept for the tail of stdout/stderr."""
    return min(TAIL_BYTES, limit // 4)


def requested_limit(metadata: Mapping[str, Any]) -> int | None:
    """The output limit an execute_request's metadata asks for, if it is a valid one
    (a whole number of bytes, 0 or more); whether it narrows the server's is the caller's call."""
    options = metadata.get(METADATA_KEY)
    value = options.get("output_limit") if isinstance(options, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def amount(size: int) -> str:
    """``size`` bytes for people: "512 bytes", "64 KiB", "29.8 MiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{size} bytes"


class _Tail:
    """The last ``capacity`` bytes of stdout/stderr text, UTF-8 encoded, in pieces by stream."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        #: Bytes of text that went through and are no longer held.
        self.dropped = 0
        #: The stream last added to.
        self.name = "stdout"
        # Only the first piece may start inside a character (its front was cut).
        self._pieces: deque[tuple[str, bytearray]] = deque()

    def add(self, name: str, text: str) -> None:
        self.name = name
        whole = _utf8_len(text)
        # Each character is at least one byte: the last ``capacity`` of them suffice.
        data = (
            text[-self.capacity :].encode("utf-8", "surrogatepass")[-self.capacity :]
            if self.capacity
            else b""
        )
        self.dropped += whole - len(data)
        if not data:
            return
        if self._pieces and self._pieces[-1][0] == name:
            self._pieces[-1][1].extend(data)
        else:
            self._pieces.append((name, bytearray(data)))
        self.held += len(data)
        while self.held > self.capacity or len(self._pieces) > _MAX_PIECES:
            piece = self._pieces[0][1]
            excess = self.held - self.capacity
            if len(piece) <= excess or len(self._pieces) > _MAX_PIECES:
                self._pieces.popleft()
                excess = len(piece)
            else:
                del piece[:excess]  # CPython advances a bytearray's start: no copy
            self.held -= excess
            self.dropped += excess

    def take(self) -> list[tuple[str, str]]:
        """The held text as (stream, text), whole characters only; the tail is empty after."""
        pieces, self._pieces, self.held = self._pieces, deque(), 0
        if pieces:
            first = pieces[0][1]
            start = 0
            while start < len(first) and first[start] & 0xC0 == 0x80:  # a continuation byte
                start += 1
            del first[:start]
            self.dropped += start
        return [(name, data.decode("utf-8", "replace")) for name, data in pieces if data]


@dataclass
class _Budget:
    """One execution's output: its limit, what passed, what was dropped, what is held."""

    limit: int
    parent: dict[str, Any]
    passed: int = 0
    #: Bytes of whole messages dropped since the last marker.
    dropped: int = 0
    #: Something was dropped: from now on only the tail of stdout/stderr passes.
    over: bool = False
    noticed: bool = False
    #: Told of a message the meter dropped, under a limit above the channel's cap.
    refused_noticed: bool = False
    #: Markers that went out (see :data:`_MARKERS_WITHOUT_TEXT`).
    markers: int = 0
    statuses: int = 0
    tail: _Tail | None = None

    @property
    def head_room(self) -> int:
        return self.limit - tail_reserve(self.limit)


class OutputLimiter:
    """Lets through at most ``limit`` bytes of IOPub traffic per client request, keeping
    the head and the tail of stdout/stderr past it.

    Everything the kernel publishes is charged, status messages included, whatever type
    it claims, to a request the host knows is running (or to the last one, between
    requests): the one whose parent it claims if cells run on subshells at once, else the
    one begun first. A hostile kernel cannot open fresh budgets by inventing parents,
    announcing "idle" or using non-output message types; only a new request from a
    client does, and it can at most spread output over the budgets of the cells that
    clients made run at once. Past the cap only the held tails and a few plain status
    messages pass.

    All methods run in the bridge thread (or while it is stopped).
    """

    def __init__(self, limit: int, session: Session, executing: Executing) -> None:
        self.limit = limit
        self._session = session
        self._executing = executing
        self._budgets: OrderedDict[str, _Budget] = OrderedDict()
        self._requested: OrderedDict[str, int] = OrderedDict()
        self._last: tuple[str, dict[str, Any]] = ("", {})
        #: The latest execute_request a client sent, as (msg_id, header).
        self._latest: tuple[str, dict[str, Any]] | None = None
        #: The keys of the executions running at the last message, and of those that ended
        #: lately or were sent lately and not seen running yet (with their parents), the
        #: latest last.
        self._running: dict[str, dict[str, Any]] = {}
        self._trailing: OrderedDict[str, dict[str, Any]] = OrderedDict()
        #: The executions whose tails are held back, in the order they began holding (more
        #: than one only while cells run on subshells at once).
        self._held: dict[str, None] = {}

    def request(self, frames: Message) -> None:
        """Note a request from a client (its signature checked): an execute_request may
        narrow its own limit (see :func:`requested_limit`); a wider one is ignored."""
        index = find_delimiter(frames)
        if index is None:
            return
        header = load_dict(frames[index + 2])
        if header.get("msg_type") != "execute_request":
            return
        msg_id = str(header.get("msg_id", ""))
        self._latest = (msg_id, header)
        # Output may claim it once it is sent, whenever it runs: the bridge can read its
        # reply and the next cell's start before any of its output (it leaves this list
        # for the running ones, then comes back to it as it ends, see _ran).
        self._trailing[msg_id] = header
        self._trailing.move_to_end(msg_id)
        self._forget_trailing()
        self._requested.pop(msg_id, None)
        limit = requested_limit(load_dict(frames[index + 4]))
        if limit is not None and limit < self.limit:
            self._requested[msg_id] = limit
            while len(self._requested) > _MAX_REQUESTED:
                self._requested.popitem(last=False)

    def charge(self, frames: Message) -> bool:
        """Whether a prompt of the kernel (a stdin message) fits the budget of the execution
        it is charged to (as :meth:`admit` charges output); if so, it is charged."""
        index = find_delimiter(frames)
        if index is None:
            return False
        # As the auditor lets prompts through: its own execution's, if it runs.
        key, parent, _ = self._charged(frames, index, trailing=False)
        budget = self._budget(key, parent)
        held = budget.tail.held if budget.tail is not None else 0
        size = _size(frames)
        if budget.over or budget.passed + held + size > budget.limit:
            return False
        budget.passed += size
        return True

    def _charged(
        self, frames: Message, index: int, *, trailing: bool = True
    ) -> tuple[str, dict[str, Any], Mapping[str, Any]]:
        """(key, parent) of the execution the message ``frames`` is charged to, and those
        running now (by key).

        That is the one whose parent the message claims, if it runs or (unless not
        ``trailing``) ended or was sent lately (see :data:`_MAX_TRAILING`); else the one
        begun first;
        between requests, the last one a client sent: its reply may overtake the tail of
        its output in the bridge (or all of it), and idle output opens no budget of its own.
        """
        executing = self._executing()
        running = dict(executing)
        if running.keys() != self._running.keys():
            self._ran(running)
        lately = self._trailing if trailing else {}
        # (Which of several: subshells, or a reply just passed.)
        claimed = _claimed(frames, index) if len(executing) + len(lately) > 1 else None
        if claimed in running:
            self._last = (claimed, running[claimed])
        elif claimed in lately:
            self._last = (claimed, lately[claimed])
        elif executing:
            self._last = executing[0]
        elif self._latest is not None:
            self._last = self._latest
        return (*self._last, running)

    def _ran(self, running: dict[str, dict[str, Any]]) -> None:
        """The executions running now are ``running``: those gone from it have ended."""
        for key, parent in self._running.items():
            if key not in running:
                self._trailing[key] = parent
        for key in running:
            self._trailing.pop(key, None)
        self._forget_trailing()
        self._running = running

    def _forget_trailing(self) -> None:
        """The oldest of those that ended or were sent lately, past :data:`_MAX_TRAILING`."""
        while len(self._trailing) > _MAX_TRAILING:
            self._trailing.popitem(last=False)

    def admit(self, frames: Message) -> list[Message]:
        """The messages to send in place of ``frames``: itself, parts of it, a notice,
        a held tail, or nothing. Only stdout/stderr content past the budget is read."""
        size = _size(frames)
        index = find_delimiter(frames)
        if index is None:
            return []  # not a Jupyter message: no client could use it
        key, parent, running = self._charged(frames, index)
        out: list[Message] = []
        if self._held:
            for ended in [other for other in self._held if other != key and other not in running]:
                out += self._release(ended)  # the execution it belongs to is over
        budget = self._budget(key, parent)
        if not budget.over and budget.tail is None and budget.passed + size <= budget.head_room:
            budget.passed += size
            return [*out, frames]
        kind = load_dict(frames[index + 2], limit=MAX_HEADER_FRAME).get("msg_type")
        if kind == "stream":
            stream = _stream(frames[index + 5])
            if stream is not None:
                return out + self._hold(key, budget, *stream)
        elif kind == "status" and size <= _SMALL_STATUS:
            state = _plain_state(frames[index + 5])
            if state == "idle" and key in self._held and _claimed(frames, index) == key:
                out += self._release(key)  # the kernel is done with it: its tail goes first
            if state is not None and budget.statuses < _STATUS_PAST_CAP:
                budget.statuses += 1
                budget.passed += size
                return [*out, frames]
        held = budget.tail.held if budget.tail is not None else 0
        if not budget.over and budget.passed + held + size <= budget.limit:
            out += self._release(key)  # what is held came before this
            budget.passed += size
            return [*out, frames]
        budget.dropped += size
        budget.over = True
        return out + self._notice_once(budget)

    def refused(self, size: int) -> list[Message]:
        """The messages to send for IOPub messages of the kernel's that the meter dropped
        whole, unread (``size`` bytes counted of them): charged as dropped output to the
        execution running now (or the last one a client sent). Past its budget (as a
        message over the channel's cap is under any limit below the cap) its client is told
        as of any output past it, and its stdout after that is held, shown when it ends
        with the amount dropped; under a limit above the cap, told once."""
        executing = self._executing()
        if executing:
            key, parent = executing[0]
        elif self._latest is not None:
            key, parent = self._latest
        else:
            return []
        budget = self._budget(key, parent)
        budget.dropped += size
        held = budget.tail.held if budget.tail is not None else 0
        if budget.over or budget.passed + held + size > budget.limit:
            budget.over = True
            return self._notice_once(budget)
        if budget.refused_noticed:
            return []
        budget.refused_noticed = True
        text = (
            "Output dropped: a message larger than the host takes from a kernel. "
            "Write large results to a file in the workspace instead."
        )
        return [stderr_notice(self._session, text, parent)]

    def release(self, notice: Message | None = None) -> list[Message]:
        """The held tails, to send now: for each, a marker saying how much was dropped,
        then the text.

        The bridge calls it before one of the host's own notices (``notice``) reaches
        clients (the kernel died, a limit stopped it, a reply was lost): the tail of the
        execution the notice is about, and those of the executions that no longer run (a
        cell running on another shell keeps its own); and, with no notice, when the
        kernel is replaced: all of them.
        """
        keys = list(self._held)
        index = find_delimiter(notice) if notice is not None else None
        if notice is not None and index is not None:
            about = _claimed(notice, index)
            if about is not None:
                running = [key for key, _ in self._executing()]
                keys = [key for key in keys if key == about or key not in running]
        return [message for key in keys for message in self._release(key)]

    def _release(self, key: str) -> list[Message]:
        """The tail held for the execution ``key``, if any, to send now."""
        if key not in self._held:
            return []
        del self._held[key]
        budget = self._budgets.get(key)
        if budget is None or budget.tail is None:
            return []
        tail, budget.tail = budget.tail, None
        pieces = tail.take()
        dropped = budget.dropped + tail.dropped
        out: list[Message] = []
        if dropped and (pieces or budget.markers <= _MARKERS_WITHOUT_TEXT):
            budget.dropped, budget.markers = 0, budget.markers + 1
            whose = (
                f"this kernel's output limit of {amount(budget.limit)} per execution"
                if budget.limit >= self.limit
                else f"the output limit of {amount(budget.limit)} set for this execution"
            )
            marker = f"\n[... {amount(dropped)} of output dropped: over {whose} ...]\n"
            out.append(
                stream_message(self._session, pieces[0][0] if pieces else tail.name, marker, budget.parent)
            )
        else:
            budget.dropped = dropped  # (told with the next marker)
        out += [stream_message(self._session, name, text, budget.parent) for name, text in pieces]
        budget.passed += sum(_size(message) for message in out)
        return out

    def _budget(self, key: str, parent: dict[str, Any]) -> _Budget:
        budget = self._budgets.get(key)
        if budget is not None:
            self._budgets.move_to_end(key)
            return budget
        budget = _Budget(min(self.limit, self._requested.pop(key, self.limit)), parent)
        self._budgets[key] = budget
        excess = len(self._budgets) - _MAX_TRACKED
        if excess > 0:  # the oldest, but never a held one (its tail) nor a running one's
            kept = self._held.keys() | self._running.keys()
            for old in list(itertools.islice((old for old in self._budgets if old not in kept), excess)):
                del self._budgets[old]
        return budget

    def _hold(self, key: str, budget: _Budget, name: str, text: str) -> list[Message]:
        """Past the head room: the head of the first such stream message passes, the rest
        of stdout/stderr goes to the tail."""
        out: list[Message] = []
        if budget.tail is None:
            room = budget.head_room - budget.passed
            # What the head's message costs besides its text.
            overhead = _size(stream_message(self._session, name, "", budget.parent))
            head = "" if budget.over else _utf8_prefix(text, room - overhead)
            while head:
                message = stream_message(self._session, name, _printable(head), budget.parent)
                # JSON writes some characters longer than UTF-8 does (a newline in two bytes,
                # a control character in six): a head of many short lines would spend the
                # tail's reserve. Each character costs at least its UTF-8 bytes, so cutting
                # the excess in UTF-8 bytes off its end makes it fit (once, as a rule).
                excess = _size(message) - room
                if excess <= 0:
                    budget.passed += _size(message)
                    out.append(message)
                    text = text[len(head) :]
                    break
                head = _utf8_prefix(head, _utf8_len(head) - excess)
            budget.tail = _Tail(max(0, min(tail_reserve(budget.limit), budget.limit - budget.passed)))
            self._held[key] = None
        budget.tail.add(name, text)
        if budget.tail.dropped:
            budget.over = True
            out += self._notice_once(budget)
        return out

    def _notice_once(self, budget: _Budget) -> list[Message]:
        if budget.noticed:
            return []
        budget.noticed = True
        if budget.tail is not None:
            rest = (
                f"the rest is dropped, but for the last {amount(budget.tail.capacity)} of its stdout "
                "and stderr, shown when it ends."
            )
        else:
            rest = "the rest was dropped."
        text = (
            f"Output truncated: this execution produced more than {amount(budget.limit)} of output; "
            f"{rest} Write large results to a file in the workspace instead."
        )
        return [stderr_notice(self._session, text, budget.parent)]


def _claimed(frames: Message, index: int) -> str | None:
    """The msg_id of the request a message claims as its parent, if any (one padded past
    :data:`~.wire.MAX_HEADER_FRAME` claims none)."""
    claimed = load_dict(frames[index + 3], limit=MAX_HEADER_FRAME).get("msg_id")
    return claimed if isinstance(claimed, str) else None


def _size(frames: Message) -> int:
    return sum(len(frame) for frame in frames)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _utf8_prefix(text: str, size: int) -> str:
    """The longest start of ``text`` whose UTF-8 form is at most ``size`` bytes."""
    if size <= 0:
        return ""
    data = text[:size].encode("utf-8", "surrogatepass")
    if len(data) <= size:
        return text[:size]
    end = size
    while end > 0 and data[end] & 0xC0 == 0x80:  # inside a character: back to its start
        end -= 1
    return data[:end].decode("utf-8", "surrogatepass")


def _printable(text: str) -> str:
    """``text`` with any lone surrogate (JSON can carry them; UTF-8 cannot) replaced."""
    return text if text.isascii() else text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _stream(frame: zmq.Frame | bytes) -> tuple[str, str] | None:
    """(name, text) of a stdout/stderr stream message's content, or None if it is not one."""
    content = load_dict(frame, limit=None)
    name, text = content.get("name"), content.get("text")
    if name in ("stdout", "stderr") and isinstance(text, str):
        return name, text
    return None


def _plain_state(frame: zmq.Frame | bytes) -> str | None:
    """The state a status message's content says, if it says nothing else."""
    content = load_dict(frame)
    state = content.get("execution_state")
    if list(content) == ["execution_state"] and state in ("busy", "idle", "starting"):
        return str(state)
    return None
