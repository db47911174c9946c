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
- Every IOPub message (busy, the input, the result, idle, each display) is handed to the
  IOPub thread, which wakes to send it: four wakes for ``1+1``, the IOPub thread's and
  then ZeroMQ's I/O thread's. Here the thread that makes a message sends it on the IOPub
  socket itself when the IOPub thread has nothing handed to it still to do (so nothing can
  be overtaken), holding the lock that counts that work: the socket is used by one thread
  at a time, as ZeroMQ requires, and messages go in the order they were made. Whatever the
  IOPub thread still has goes after it, through it, as before. The IOPub socket's own
  reading (a client's subscription, answered with ``iopub_welcome``) counts as its work
  too; a send that finds a subscription waiting wakes the IOPub thread for it, since a
  ZeroMQ socket signals it only once, to whichever thread looks first.
  (:data:`DIRECT_SENDS` turns it off.)
- ipykernel hands work to the IOPub thread through an event pipe that the IOPub thread
  alone reads, also work that the IOPub thread hands itself: a print and a flush there
  (a finalizer the garbage collector runs on that thread, a progress bar's ``__del__``)
  each send on it, and 2000 unread (ZeroMQ's high-water marks) stop the thread in that
  send for good, and with it all the kernel's output. Here such work goes on its loop.
- ipykernel asks ``Thread.is_alive()`` of the IOPub thread for every message. On Python
  3.11 an exception from a signal handler landing inside it (an interrupt, a timeout)
  marks the running thread stopped for good, and from then on ipykernel sends every
  message from the calling thread beside the IOPub thread: messages are cut and lost.
  Here the IOPub thread's ``is_alive()`` reads the thread's lock without taking it.
- Before each ``execute_reply`` ipykernel sleeps 0.5 ms ("on rare occasions, the flush
  doesn't seem to make it to the clients"), 1.1 ms under gVisor. Here it does not: the flush
  before it has handed every output to the IOPub socket. Jupyter orders messages within a
  channel, not across channels (a client waits for the ``idle`` status, which follows the
  reply on IOPub); a client reading both channels in one thread, IOPub first, saw a reply
  before its ``execute_result`` in 2 to 15 of 300 executions here, as many with the
  channels relayed as without, and in 1 of 300 on a local kernel, with its sleep.

What goes out, in which order and with which parent, is unchanged: every message is sent
in the order it was made or handed to the IOPub thread. :func:`install` returns what undoes
it (the IOPub socket's reading stays counted, which changes nothing by itself). Like
in_kernel_startup.py, it is copied into the launch folder by the host and uses the
standard library, pyzmq and ipykernel only.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

#: Whether a flush with nothing to send returns at once (read at each flush).
SKIP_EMPTY_FLUSHES = True
#: Whether a thread sends an IOPub message itself when the IOPub thread has nothing to do
#: (read at each send).
DIRECT_SENDS = True
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
    """How many pieces of work the IOPub thread has been handed and not finished, and the
    lock under which that count changes, work is handed over and a message is sent directly.

    A thread holding the lock can run Python code meanwhile that makes output of its own:
    a signal handler, or a finalizer the garbage collector runs. That code must neither wait
    for the lock (the thread would wait for itself) nor reach the socket in the middle of
    a message: :meth:`holding` tells it, and what it makes goes after (:meth:`later`,
    :meth:`run_deferred`).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        #: This thread's own: ``mine.holding``, set and reset by the senders inline (a
        #: method call between would let a signal handler's exception in before the reset,
        #: and the thread would defer all its output for ever), and what it deferred.
        self.mine = threading.local()

    def holding(self) -> bool:
        """Whether this thread is about to take the lock, holds it, or has just let it go."""
        return bool(getattr(self.mine, "holding", False))

    def later(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``call`` once this thread has let go of the lock (what it made meanwhile)."""
        deferred = getattr(self.mine, "deferred", None)
        if deferred is None:
            deferred = self.mine.deferred = []
        deferred.append((call, args, kwargs))

    def run_deferred(self) -> None:
        """What this thread made while it held the lock, in the order it made it."""
        deferred = getattr(self.mine, "deferred", None)
        while deferred and not self.holding():
            call, args, kwargs = deferred.pop(0)
            call(*args, **kwargs)

    def add(self, delta: int) -> None:
        with self.lock:
            self.count += delta

    def __enter__(self) -> None:
        """``with in_flight:`` the work in it counts as in flight while it runs."""
        self.add(1)

    def __exit__(self, *exc: object) -> None:
        self.add(-1)

    def counted(self, work: Callable[[], Any]) -> Callable[[], Any]:
        """``work``, that takes its count back once it has run (the count is the caller's)."""

        def counted() -> Any:
            try:
                return work()
            finally:
                self.add(-1)

        return counted

    def after_fork_in_child(self) -> None:
        """Another thread may have held the lock at the fork: the child's own, free."""
        self.lock = threading.Lock()
        self.mine = threading.local()


def install(kernel: Any) -> Callable[[], None]:
    """Take the shortcuts above on ``kernel`` (ipykernel's Kernel); the function undoing them.

    Raises:
        AttributeError: this ipykernel has not the parts the shortcuts replace (then
            nothing is changed).
    """
    import zmq
    from ipykernel import iostream

    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, iostream.OutStream):
            stream._buffers, stream._buffer_lock  # noqa: B018 (what a flush looks at)
    pub_thread = kernel.iopub_thread
    stream_class, thread_class = iostream.OutStream, iostream.IOPubThread
    # Every part replaced, looked up first: an ipykernel without one is left as it is.
    originals = {
        "schedule": pub_thread.schedule,
        "send_multipart": pub_thread.send_multipart,
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
        if in_flight.holding():  # from a handler or finalizer amid this thread's hand-over
            in_flight.later(schedule, work)
            return None
        if not thread.is_alive():
            return originals["schedule"](work)  # ipykernel's: runs it here
        counted = in_flight.counted(work)
        # The count and the hand-over under the lock, with no call between them that could
        # run a signal handler: an exception from one cannot leave one without the other.
        mine = in_flight.mine
        try:
            mine.holding = True
            with in_flight.lock:
                in_flight.count += 1
                pub_thread._events.append(counted)
        finally:
            mine.holding = False
        if threading.get_ident() == thread.ident:
            # The IOPub thread itself (a finalizer the garbage collector runs there, or a
            # print in its own work): its loop runs the work after what it runs now. Not
            # through the event pipe, which only this thread reads: a print and a flush
            # each send on it, and 2000 unread (ZeroMQ's high-water marks) stop this
            # thread in a send for good, and every thread that waits for it.
            pub_thread.io_loop.add_callback(pub_thread._handle_event, None)
        else:
            pub_thread._event_pipe.send(b"")  # wakes the IOPub thread (ipykernel's own)
        in_flight.run_deferred()
        return None

    def counted_flush(self: Any) -> None:
        # The timer's flush runs on the IOPub thread, not through schedule: between taking
        # the buffers and handing their message over, it counts as work in flight.
        with in_flight:
            originals["_flush"](self)

    def flush(self: Any) -> None:
        if in_flight.holding():
            return  # from a handler or finalizer amid a send: waiting would wait for itself
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

    # Thread.is_alive() on Python 3.11 and earlier: an exception from a signal handler
    # (an interrupt, a timeout) landing inside it marks the running thread stopped for
    # good (CPython's fallback for bpo-45274 releases the lock the thread itself holds).
    # ipykernel asks it of the IOPub thread for every message: once wrong, it sends
    # every message from the calling thread, alongside the IOPub thread, and messages
    # are cut. Here the answer reads that lock without taking it.
    thread = pub_thread.thread
    running = thread._tstate_lock

    def io_thread_alive() -> bool:
        return bool(running.locked()) and current_pid() == pub_thread._master_pid

    # The IOPub socket's reading (XPUB: a client's subscription) runs on the IOPub thread;
    # counted as its work, it never meets a send from another thread. Sends go direct
    # only once the IOPub thread has taken that up (it cannot be changed from here).
    xpub: Any = getattr(pub_thread, "_xpub_stream", None)
    reading_counted = threading.Event()

    def counted_reading(fd: Any, events: int) -> None:
        with in_flight:
            type(xpub)._handle_events(xpub, fd, events)

    def count_reading() -> None:
        if xpub is not None and xpub.socket is not None:
            xpub._handle_events = counted_reading  # what its own callbacks look up
            xpub.io_loop.remove_handler(xpub.socket)
            xpub.io_loop.add_handler(xpub.socket, counted_reading, xpub.io_loop.READ)
        reading_counted.set()

    send_frames = whole_message_sender()

    def send_multipart(msg: list[Any], *args: Any, **kwargs: Any) -> None:
        if in_flight.holding():  # from a handler or finalizer amid this thread's send
            in_flight.later(send_multipart, msg, *args, **kwargs)
            return
        direct = waiting = False
        mine = in_flight.mine
        try:
            mine.holding = True
            with in_flight.lock:
                direct = (
                    DIRECT_SENDS
                    and send_frames is not None
                    and not args
                    and not kwargs.get("track")
                    and in_flight.count == 0
                    and reading_counted.is_set()
                    and thread.is_alive()
                    and not pub_thread.closed
                    and bool(msg)
                    and all(type(frame) is bytes for frame in msg)
                )
                if direct and send_frames is not None:
                    send_frames(pub_thread.socket, msg)
                    # The send may have taken the socket's signal of a subscription waiting.
                    waiting = xpub is not None and bool(pub_thread.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        finally:
            mine.holding = False
        if not direct:
            originals["send_multipart"](msg, *args, **kwargs)  # through the IOPub thread
        elif waiting:
            pub_thread.io_loop.add_callback(counted_reading, xpub.socket, 0)
        in_flight.run_deferred()

    # The IOPub thread closes its loop, and with it the socket, as it ends: from then on no
    # direct send (the count never comes back to 0).
    close_loop = pub_thread.io_loop.close

    def close_for_good(*args: Any, **kwargs: Any) -> None:
        in_flight.add(1)
        close_loop(*args, **kwargs)

    replaced: list[tuple[Any, str, Any]] = [
        *([(thread, "is_alive", io_thread_alive)] if running is not None else []),  # (once started)
        (pub_thread, "schedule", schedule),
        (pub_thread, "send_multipart", send_multipart),
        (pub_thread.io_loop, "close", close_for_good),  # what the IOPub thread calls as it ends
        (stream_class, "_flush", counted_flush),
        (stream_class, "flush", flush),
        (stream_class, "_is_master_process", is_master_process),
        (thread_class, "_is_master_process", is_master_process),
    ]
    put_back = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in replaced]
    for owner, name, replacement in replaced:
        setattr(owner, name, replacement)
    kernel._execute_sleep = 0.0
    os.register_at_fork(after_in_child=in_flight.after_fork_in_child)
    schedule(count_reading)  # after whatever was handed to the IOPub thread before

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


@functools.cache
def whole_message_sender() -> Callable[[Any, list[bytes]], None] | None:
    """A send of a message's frames on a ZeroMQ socket that no signal handler can stop
    between two frames; None where this pyzmq offers no way to it.

    A thread other than the IOPub thread sending on its own is the main thread, mostly,
    where Python runs signal handlers: one raising (KeyboardInterrupt, a timeout) between
    two frames of pyzmq's ``send_multipart``, which checks for signals after each frame,
    would leave a message cut, and the next one would be read as its rest. Here the
    frames go through libzmq's ``zmq_send`` by ctypes, which checks for none, called by
    ``map`` in C and holding the interpreter's lock (``PyDLL``: a send to a PUB socket
    never waits): no Python code runs between two frames, so no handler can. libzmq may
    refuse a frame with EINTR (a signal during its poll, on Linux; gVisor's poll with no
    timeout returns at once): the rest of the message then goes with signals blocked.
    Made once: the IOPub sends here and the shell replies of kernel_app.py share it.
    """
    import ctypes
    import errno as errnos
    import itertools
    import signal

    import zmq

    try:
        from zmq.backend.cython import _zmq

        library = ctypes.PyDLL(_zmq.__file__, use_errno=True)
        zmq_send = library.zmq_send
    except (ImportError, OSError, AttributeError):
        return None
    zmq_send.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
    zmq_send.restype = ctypes.c_int
    more = zmq.SNDMORE
    accepted = (0).__le__  # (in C: the frames stop at the first one refused)

    def send(socket: Any, frames: list[bytes]) -> None:
        count, handle = len(frames), socket.underlying
        flags = [more] * (count - 1) + [0]
        sends = map(zmq_send, [handle] * count, frames, map(len, frames), flags)
        done = len(list(itertools.takewhile(accepted, sends)))
        if done == count:
            return
        error = ctypes.get_errno()  # the refused frame's
        if error in (errnos.ENOTSOCK, zmq.ETERM):  # the socket closing (as ipykernel's)
            return
        if error != errnos.EINTR:
            raise zmq.ZMQError(error)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            while done < count:
                if zmq_send(handle, frames[done], len(frames[done]), flags[done]) >= 0:
                    done += 1
                elif ctypes.get_errno() != errnos.EINTR:
                    raise zmq.ZMQError(ctypes.get_errno())
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    return send


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
