"""Fewer system calls and thread wake-ups on the sandboxed kernel's output path.

Under gVisor a system call costs a few times what it costs on the host, and waking a thread
that sleeps costs ten times as much or more (``bench/wakeups.py`` measures both). ipykernel
7 pays both where a local kernel hardly notices:

- Every ``write`` to ``sys.stdout``/``sys.stderr`` asks ``os.getpid()`` whether it runs in
  a forked child (``OutStream._is_master_process``): two system calls per ``print``. Here
  the process's pid is kept by a fork hook (``os.register_at_fork``), which every fork made
  by Python (``os.fork``, multiprocessing) runs in the child: the same answer, without the
  call. A cell printing 100,000 lines spent most of its time there.
- ``sys.stdout.flush()`` hands a flush to the IOPub thread and waits for that thread to
  answer, even with nothing to send: ipykernel flushes both streams three times per
  execution (before the result, before the reply, before "idle"), six round trips through
  the IOPub thread for ``1+1``. Here a flush returns at once when the stream holds nothing
  and nothing handed to the IOPub thread is still in its queue or being sent: then
  everything written before is on the IOPub socket already, which is what the wait is for.
  Otherwise the flush is ipykernel's own. (:data:`SKIP_EMPTY_FLUSHES` turns it off, as
  for a benchmark's "before".)
- Before each ``execute_reply`` ipykernel sleeps 0.5 ms ("on rare occasions, the flush
  doesn't seem to make it to the clients"), 1.1 ms under gVisor. Here it does not: the flush
  before it has handed every output to the IOPub socket, and the channel relay
  (kernel_relay.py) passes the kernel's IOPub messages on before its replies when both are
  waiting.

What goes out, in which order and with which parent, is unchanged: the IOPub thread still
sends every message, in the order it was handed them. :func:`install` returns what undoes
it. Like in_kernel_startup.py, it is copied into the launch folder by the host and uses the
standard library and ipykernel only.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

#: Whether a flush with nothing to send returns at once (read at each flush).
SKIP_EMPTY_FLUSHES = True
#: This process's pid, as the fork hook keeps it.
_pid = [os.getpid()]
_hooked = [False]
_MISSING = object()
#: What undoes each :func:`install` still in effect.
_undo: list[Callable[[], None]] = []


def current_pid() -> int:
    """This process's pid, without a system call (a forked child updates it as it starts)."""
    return _pid[0]


def _forked() -> None:
    _pid[0] = os.getpid()


class InFlight:
    """How many pieces of work the IOPub thread has been handed and not finished."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    def add(self, delta: int) -> None:
        with self.lock:
            self.count += delta

    def wrap(self, work: Callable[[], Any]) -> Callable[[], Any]:
        """``work``, counted from now until it has run."""
        self.add(1)

        def counted() -> Any:
            try:
                return work()
            finally:
                self.add(-1)

        return counted


def install(kernel: Any) -> Callable[[], None]:
    """Take the shortcuts above on ``kernel`` (ipykernel's Kernel); the function undoing them.

    Raises:
        AttributeError: this ipykernel has not the parts the shortcuts replace (then
            nothing is changed).
    """
    from ipykernel import iostream

    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, iostream.OutStream):
            stream._buffers, stream._buffer_lock  # noqa: B018 (what a flush looks at)
    pub_thread = kernel.iopub_thread
    stream_class, thread_class = iostream.OutStream, iostream.IOPubThread
    # Every part replaced, looked up first: an ipykernel without one is left as it is.
    originals = {
        "schedule": pub_thread.schedule,
        "flush": stream_class.flush,
        "_flush": stream_class._flush,
        "stream_master": stream_class._is_master_process,
        "thread_master": thread_class._is_master_process,
        "execute_sleep": kernel._execute_sleep,
    }
    if not _hooked[0]:
        os.register_at_fork(after_in_child=_forked)
        _hooked[0] = True
    _pid[0] = os.getpid()
    in_flight = InFlight()

    def schedule(work: Callable[[], Any]) -> Any:
        return originals["schedule"](in_flight.wrap(work))

    def counted_flush(self: Any) -> None:
        # The timer's flush runs on the IOPub thread, not through schedule: between taking
        # the buffers and handing their message over, it counts as work in flight.
        in_flight.add(1)
        try:
            originals["_flush"](self)
        finally:
            in_flight.add(-1)

    def flush(self: Any) -> None:
        if (
            SKIP_EMPTY_FLUSHES
            and self.echo is None
            and self.pub_thread is pub_thread
            and _nothing_to_wait_for(self, in_flight)
        ):
            return
        originals["flush"](self)

    def is_master_process(self: Any) -> bool:
        return bool(current_pid() == self._master_pid)

    replaced: list[tuple[Any, str, Any]] = [
        (pub_thread, "schedule", schedule),
        (stream_class, "_flush", counted_flush),
        (stream_class, "flush", flush),
        (stream_class, "_is_master_process", is_master_process),
        (thread_class, "_is_master_process", is_master_process),
    ]
    put_back = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in replaced]
    for owner, name, replacement in replaced:
        setattr(owner, name, replacement)
    kernel._execute_sleep = 0.0

    def uninstall() -> None:
        for owner, name, original in reversed(put_back):
            if original is _MISSING:
                delattr(owner, name)  # the class's own method again
            else:
                setattr(owner, name, original)
        kernel._execute_sleep = originals["execute_sleep"]

    _undo.append(uninstall)
    return uninstall


def uninstall() -> None:
    """Undo every :func:`install` (ipykernel's own output path again, as for a benchmark's
    "before" on the same kernel)."""
    while _undo:
        _undo.pop()()


def _nothing_to_wait_for(stream: Any, in_flight: InFlight) -> bool:
    """Whether ``stream`` holds no output and the IOPub thread has nothing left to send
    (a flush from the IOPub thread itself, or once it has ended, is ipykernel's own)."""
    thread = stream.pub_thread.thread
    if thread is None or not thread.is_alive() or thread.ident == threading.get_ident():
        return False
    with stream._buffer_lock:
        if stream._buffers:
            return False
    with in_flight.lock:
        return in_flight.count == 0
