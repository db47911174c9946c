"""What the sandboxed kernel sets up as it starts: the module its start-up code runs.

The image does not have this package: the host copies this file into the kernel's launch
folder beside the start-up code (:mod:`~.in_kernel`, the kernel's ``PYTHONSTARTUP``),
which runs it as a module of its own, outside the user's namespace, and calls
:func:`start`. It uses the standard library and IPython only. It reads the kernel's
policy from ``SANDBOX_KERNEL_POLICY``. It is for the user's benefit, not enforcement (the
kernel's own code could undo all of it); the container's limits and the host's watchdog
are the bounds.

- The kernel starts with PYTHONSAFEPATH, so that nothing in the workspace runs before it
  is up; once it is, ``import mymodule`` of a file next to the notebook works as in a
  local kernel (``''`` where IPython puts it: after the standard library, before
  site-packages), and child processes (``!python script.py``) start without
  PYTHONSAFEPATH, finding their own folder's modules as usual.
- A cell that keeps allocating ends in a ``MemoryError`` naming the limit, and the kernel
  keeps its other variables. At the container's memory limit the host's OOM killer takes
  the whole sandbox, every variable with it, so a thread watches the kernel's resident
  memory and, a margin below the limit (for gVisor's own memory, /tmp and the channel
  relay), raises ``MemoryError`` in the running cell (and in threads the user's code
  started), as Ctrl-C raises ``KeyboardInterrupt``. An allocation gVisor refuses outright
  (larger than the limit) raises it as well. Not an address-space limit: that fails the
  first allocation past it in whichever thread makes it, and ZeroMQ's threads abort the
  kernel when theirs fails. Never inside an import (a module half-initialised by it
  could not be imported again): the cell is stopped once the import is over. One call
  made in C holds the GIL, so this thread cannot run until it returns: the channel relay
  (kernel_relay.py's MemoryClamp, another process) makes the allocations of one that
  keeps allocating fail (``list(range(10**9))``, a huge ``str.join``). What maps most of
  the limit at once and then fills it (``numpy.ones`` of most of it, the table
  ``dict.fromkeys`` grows near the limit) is beyond reach: the watchdog's kill remains.
- Code that tries a network the kernel does not have learns it in one line: a name that
  does not resolve says the kernel's network policy, and errors that carry it (or the
  egress proxy's refusal) are shown as that one line instead of the library's traceback.
- A ``FileNotFoundError`` for a path outside /workspace (a host path, ``../data`` above a
  workspace that is the notebook's folder) says that the workspace is the only host
  folder the kernel sees, its traceback kept.
- BLAS, OpenMP and polars start one thread per CPU the kernel may use, not per host core
  (``os.cpu_count()`` shows the host's), unless the kernelspec's ``env`` says otherwise.
- ``%pip install``, ``!pip install`` and pip run by a child process install into
  ``PIP_PREFIX``, by default /tmp/python-packages: the image is read-only, and a virtual
  environment, where pip refuses ``--user``. The folder is on ``sys.path`` ahead of the
  image's packages (on ``PYTHONPATH`` for child processes, its ``bin`` on ``PATH``), so
  ``import x`` works in the next cell; ``.pth`` files a package brings are read after each
  cell. In /tmp it belongs to this kernel alone, is bounded by the ``tmp_size`` limit and
  is gone with the kernel (a restart starts clean); a kernelspec's ``env`` may set another
  ``PIP_PREFIX`` (a folder in the workspace, to keep them). pip never checks for its own
  updates and keeps no cache (/tmp is small). With network ``none``, pip looks at no index
  and does not retry, so it fails at once instead of after 9 s of retries. pip takes one
  location: ``%pip install --target DIR`` drops the prefix, a script sets ``PIP_PREFIX=``.
- ``%pip`` fails the cell when pip fails (IPython's own reports success whatever pip
  did), with one line saying why, for instance that a kernel without network can install
  only local files.
- Output written to file descriptors 1 and 2 (a C library's, a child process's) reaches
  the notebook in 64 KiB reads instead of ipykernel's 1000 bytes: under gVisor each read
  costs system calls enough to slow a flood of it tenfold.
- With a wall-clock limit, a timer armed before each cell (SIGALRM; on a subshell, a
  thread's) raises a ``TimeoutError`` naming it, so the user keeps the kernel. Code that
  blocks or ignores it is the host's business: the provisioner interrupts, then kills the
  kernel.
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import resource
import selectors
import shlex
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import CodeType
from typing import Any

#: A memory limit as Docker writes sizes ("2g", "1.5G", "1536m", "512MiB", bytes).
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
#: The libraries' thread counts, set to the CPUs the kernel may use.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_MAX_THREADS",
    "POLARS_MAX_THREADS",
)
#: Bytes per second: more than a kernel allocates under gVisor.
FASTEST_GROWTH = 2 * 2**30
#: What the errors our network policy causes (or the egress proxy's refusal) say.
NETWORK_MARKS = ("this sandboxed kernel", "sandbox-kernel egress denied")
#: What the data-science image adds (images/datascience/Dockerfile), by import name.
DATASCIENCE_MODULES = {
    "scipy", "sklearn", "statsmodels", "seaborn", "plotly", "nbformat", "polars",
    "duckdb", "pyarrow", "openpyxl", "altair", "bokeh",
}  # fmt: skip
INSTALL_HINT = (
    "%pip install it (a kernel without network installs only files in its workspace), "
    "or ask the administrator to add it to the kernel's image "
    "(`jupyter sandbox-kernel build-image`, see docs/administrators/images.md)"
)
# glibc's sem_open makes a semaphore with a hard link, which the sandbox's seccomp
# profile refuses (a link in the workspace could point host code at another file).
NO_PROCESS_LOCKS = (
    "multiprocessing cannot create its locks in this sandbox (they need hard links, which it "
    "refuses), so process pools (multiprocessing.Pool, ProcessPoolExecutor, joblib's default) "
    "do not work here: use threads instead (concurrent.futures.ThreadPoolExecutor, "
    "joblib.Parallel(prefer='threads')); numpy, pandas and scikit-learn release the GIL in "
    "their heavy parts"
)
# Only the workspace of the host's files is in the sandbox: a path elsewhere (a host
# path, ../data above a workspace that is the notebook's folder) is missing for a reason.
SANDBOX_OWN = ("/workspace", "/tmp", "/proc", "/sys", "/dev")  # noqa: S108


def start() -> None:
    """Set the kernel up as this module says, in an order that matters: the claim's
    socket last, as its existence tells the host that the kernel is ready. A pooled
    sandbox's kernel is set up for its policy as it takes its claim, which may narrow it."""
    from IPython import get_ipython  # here: the host imports this module to find its file

    restore_working_folder()
    read_output_in_large_chunks()
    shell = get_ipython()
    take_output_shortcuts(shell)
    if not listen_for_claim(shell):
        set_up(shell)


def set_up(shell: Any) -> None:
    """What the kernel's policy (``SANDBOX_KERNEL_POLICY``) decides: its memory watch and
    messages, threads per CPU, pip, wall clock."""
    policy: dict[str, Any] = json.loads(os.environ.get("SANDBOX_KERNEL_POLICY") or "{}")
    memory = str(policy.get("memory", ""))
    limit = size_bytes(memory)
    exec_timeout = float(policy.get("exec_timeout") or 0)
    allowed = [str(domain) for domain in policy.get("allowed_domains") or []]

    limit_threads(policy)
    watch = MemoryWatch(memory, limit, shell)
    no_route = no_route_text(policy.get("network", "none"), allowed)
    explain_unresolved_names(no_route)
    errors = ErrorDisplay(watch, no_route, str(policy.get("image", "")))
    shell.set_custom_exc((MemoryError, OSError, ModuleNotFoundError), errors.show)
    around_executions(shell, watch.cell_started, watch.cell_finished)
    if limit > 0:
        threading.Thread(target=watch.watch, name="sandbox-kernel-memory", daemon=True).start()

    offline = policy.get("network", "none") == "none"
    packages = SitePackages(pip_prefix(offline))
    packages.changed()
    shell.register_magic_function(pip_magic_for(shell, packages, offline, no_route), "line", "pip")
    shell.events.register("post_run_cell", packages.changed)
    if exec_timeout > 0:
        arm_wall_clock(shell, exec_timeout)


def size_bytes(memory: str) -> int:
    """A memory limit in bytes; 0 for anything Docker would not write (then: no watch)."""
    size = SIZE.fullmatch(memory)
    return int(float(size[1]) * UNITS[size[2].lower()]) if size else 0


def site_packages_index(path: list[str]) -> int | None:
    """Where the first site-packages (or dist-packages) folder is on ``path``."""
    names = [os.path.basename(entry) for entry in path]
    packages = [i for i, name in enumerate(names) if name in ("site-packages", "dist-packages")]
    return packages[0] if packages else None


def restore_working_folder() -> None:
    """``''`` back on sys.path where IPython puts it; child processes without PYTHONSAFEPATH."""
    os.environ.pop("PYTHONSAFEPATH", None)
    if "" not in sys.path:
        at = site_packages_index(sys.path)
        sys.path.insert(at if at is not None else 0, "")


def limit_threads(policy: dict[str, Any]) -> None:
    """One thread of BLAS, OpenMP and polars per CPU the kernel may use, unless set."""
    for name in THREAD_VARIABLES:
        os.environ.setdefault(name, str(max(1, math.ceil(float(policy.get("cpus") or 1)))))


def read_output_in_large_chunks() -> None:
    # Output written to file descriptors 1 and 2 (os.write, C libraries, child processes)
    # reaches ipykernel through a pipe that it reads 1000 bytes at a time, each read with
    # its echo a few system calls, which gVisor makes dear: 2 MB/s. Reads of 64 KiB carry
    # it about as fast as a local kernel does.
    try:
        import ipykernel.iostream as iostream

        iostream.PIPE_BUFFER_SIZE = max(iostream.PIPE_BUFFER_SIZE, 2**16)
    except (ImportError, AttributeError):
        pass


def take_output_shortcuts(shell: Any) -> None:
    """Fewer system calls and thread wake-ups on ipykernel's output path (fast_io.py,
    beside this file, says which), where it is ipykernel's."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_io.py")
    spec = importlib.util.spec_from_file_location("sandbox_kernel_fast_io", path)
    if spec is None or spec.loader is None:
        msg = f"cannot load {path}"
        raise ImportError(msg)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module  # its uninstall(), for a benchmark's "before"
    try:
        module.install(kernel)
    except AttributeError:
        pass  # another ipykernel than the image's: its own output path, as it is


# ---------------------------------------------------------------- memory


class MemoryWatch:
    """The thread that stops cells a margin below the memory limit, and what it says."""

    def __init__(self, memory: str, limit: int, shell: Any = None) -> None:
        #: The limit as the policy writes it, for messages.
        self.memory = memory
        self.shell = shell  # whose event loops run the cells that await
        self.page = os.sysconf("SC_PAGE_SIZE")
        # The margin: gVisor's own memory and /tmp, and the channel relay (about 27 MiB,
        # the kernel's parent in the same container).
        self.threshold = limit - (96 * 2**20 + limit // 16)
        self.step = max(16 * 2**20, limit // 64)
        #: The executions running a cell (the main shell's, a subshell's) not stopped yet:
        #: each thread's current one, numbered, so that a stop meant for one never reaches
        #: the next on that thread. Each is stopped once, not again while its error is shown.
        self.executing: dict[int, int] = {}
        self._executions = 0
        #: Per thread, the execution beside which a callback of its loop was stopped.
        self._callbacks_stopped: dict[int, int] = {}
        self.lock = threading.Lock()
        #: The kernel's own threads, never stopped.
        self.kernel_threads = {thread.ident for thread in threading.enumerate()}

    def resident(self) -> int:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * self.page

    def watch(self) -> None:
        me = threading.get_ident()
        stopped_at = 0  # memory in use when cells were last stopped; 0: below the threshold
        left: dict[int, int] = {}  # cells to stop that were in their shell's own code
        while True:
            used = self.resident()
            if used < self.threshold:
                stopped_at, left = 0, {}
            elif not stopped_at or used >= stopped_at + self.step:
                with self.lock:
                    cells = dict(self.executing)
                threads = {
                    thread.ident
                    for thread in threading.enumerate()
                    if thread.ident not in self.kernel_threads
                    and thread.ident not in cells
                    and thread.ident != me
                    and not kernels_own(thread)
                    and not thread.name.startswith(OWN_THREADS)
                }
                if any(importing(ident) for ident in threads):
                    time.sleep(0.01)  # look again in a moment, once the import is done
                    continue
                for ident in threads:
                    if ident is not None:
                        raise_in(ident, MemoryError)
                stopped_at, left = used, cells
            if left:
                left = self.stop_cells(left)
                if left:  # in their shell's own code, or importing: look again in a moment
                    time.sleep(0.01)
                    continue
            # Look again before the fastest allocation could cross the threshold: an idle
            # kernel far below it costs a wake-up a second, one near it is watched closely.
            time.sleep(min(1.0, max(0.01, (self.threshold - used) / FASTEST_GROWTH)))

    def stop_cells(self, cells: dict[int, int]) -> dict[int, int]:
        """Stop the executions ``cells`` (thread: execution) still running; those that could
        not be stopped yet."""
        left = {}
        for ident, execution in cells.items():
            if not self.runs(ident, execution):
                continue
            if self.stop_cell(ident, execution):
                with self.lock:
                    if self.executing.get(ident) == execution:
                        del self.executing[ident]
            else:
                left[ident] = execution
        return left

    def stop_cell(self, ident: int, execution: int) -> bool:
        """Stop the cell that the thread ``ident`` runs: a MemoryError in its code, or, when
        it awaits, its task cancelled with the message (an error raised in its shell's event
        loop would end the loop: the kernel, on the main shell). Whether it was stopped."""
        if importing(ident):
            return False
        loop = shell_loop(self.shell, ident)
        if loop is None or running_code(ident):
            raise_in(ident, MemoryError)
            return True
        cancelled = cancel_from(loop, self.cancel_text, lambda: self.runs(ident, execution))
        if cancelled is not None:
            return cancelled
        # The loop did not answer in time. One that runs a callback of its own beside the
        # cell (a comm's handler, a hook) has that stopped, once per execution, as any code
        # the kernel runs; the cell is cancelled once the loop answers. One that waits for
        # its next event (late only: another thread held the GIL) gets nothing, as an
        # error there would end the loop.
        if in_loop_callback(ident) and self._callbacks_stopped.get(ident) != execution:
            self._callbacks_stopped[ident] = execution
            raise_in(ident, MemoryError)
        return False

    def runs(self, ident: int, execution: int) -> bool:
        """Whether the thread ``ident`` still runs ``execution``, not stopped yet."""
        with self.lock:
            return self.executing.get(ident) == execution

    def cancel_text(self) -> str:
        """The message of a cancelled cell (in its loop, as the cancel is made)."""
        lift_clamp()  # as the MemoryError's display does (see ErrorDisplay)
        return self.error_text(MemoryError())

    def cell_started(self) -> None:
        with self.lock:
            self._executions += 1
            self.executing[threading.get_ident()] = self._executions

    def cell_finished(self) -> None:
        with self.lock:
            self.executing.pop(threading.get_ident(), None)

    def error_text(self, value: BaseException) -> str:
        detail = str(value)
        return (
            f"memory limit {self.memory} of this sandboxed kernel reached"
            f" ({self.resident() // 2**20} MiB in use{'; ' + detail if detail else ''})"
            ": the cell was stopped and the kernel keeps its other variables;"
            " free memory (del) or ask for a higher limit"
        )


#: Seconds between two looks at a cell past its wall-clock limit that is not running code.
RAISE_RETRY = 0.05

#: The name of the threads sandbox-kernel starts in the kernel (the wall clock's timers),
#: which the memory watch leaves alone.
OWN_THREADS = "sandbox-kernel-"


def around_executions(shell: Any, started: Callable[[], None], finished: Callable[[], None]) -> None:
    """Call ``started`` as each execution a client asked for begins (an execute_request,
    silent ones too, on the main shell or a subshell: in its thread), ``finished`` as it
    ends, whatever happens. Not IPython's events: pre_run_cell skips silent executions,
    and pre_execute also fires for each comm message (a widget's) and for the cells a cell
    runs itself (``%run notebook.ipynb``), while the cell runs."""
    kernel = shell.kernel
    run = kernel.do_execute

    @functools.wraps(run)
    async def do_execute(*args: Any, **kwargs: Any) -> Any:
        started()
        try:
            reply = run(*args, **kwargs)
            return await reply if inspect.isawaitable(reply) else reply
        finally:
            finished()

    kernel.do_execute = do_execute


def raise_in(ident: int, error: type[BaseException]) -> None:
    """Raise ``error`` in the thread ``ident``, between two of its bytecodes."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(error))


def shell_loop(shell: Any, ident: int) -> asyncio.AbstractEventLoop | None:
    """The event loop of the shell whose thread is ``ident``: the main shell's (the
    kernel's own), or a subshell's (its thread's)."""
    if ident == threading.main_thread().ident:
        io_loop = getattr(getattr(shell, "kernel", None), "io_loop", None)
    else:
        thread = next((t for t in threading.enumerate() if t.ident == ident), None)
        io_loop = getattr(thread, "io_loop", None)
    loop = getattr(io_loop, "asyncio_loop", None)
    return loop if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_closed() else None


def cancel_awaiting(loop: asyncio.AbstractEventLoop, message: str) -> bool:
    """Cancel the task of the cell ``loop`` runs, with ``message``, if the cell's own code
    is what it awaits (call in the loop's own thread); whether it did."""
    task = cell_task(loop)
    if task is not None:
        task.cancel(message)
    return task is not None


def cell_task(loop: asyncio.AbstractEventLoop) -> asyncio.Task[Any] | None:
    """The task of the cell ``loop`` runs (ipykernel's for an async cell), if the cell's own
    code is what it awaits (call in the loop's own thread)."""
    for task in asyncio.all_tasks(loop):
        if getattr(task.get_coro(), "__name__", "") == "run_cell_async" and awaiting_in_cell(task):
            return task
    return None


def awaiting_in_cell(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` (ipykernel's for an async cell) waits in the cell's own code, where
    a CancelledError stops the cell alone and the cell gets its reply. Not a task that has
    not begun (cancelled then, it would end ipykernel's execute_request before any reply),
    nor IPython's code around the cell."""
    coro: Any = task.get_coro()
    for _ in range(64):  # the awaits from IPython's run_cell_async down to the cell's code
        code = getattr(coro, "cr_code", None)
        if code is None:
            return False
        if is_run_code(code):
            return coro.cr_await is not None
        coro = coro.cr_await
    return False


def cancel_from(
    loop: asyncio.AbstractEventLoop, message: Callable[[], str], still: Callable[[], bool]
) -> bool | None:
    """From another thread: cancel the awaiting cell of ``loop`` (see
    :func:`cancel_awaiting`) if ``still()`` holds when the loop gets to it. Whether it
    cancelled one; None if the loop did not answer within :data:`RAISE_RETRY` (it runs
    code), and then its answer, when it comes, cancels nothing, so that the caller may stop
    the cell otherwise."""
    answered, lock = threading.Event(), threading.Lock()
    outcome = {"open": True, "cancelled": False}

    def in_the_loop() -> None:
        try:
            with lock:
                task = cell_task(loop) if outcome["open"] and still() else None
                if task is not None:
                    task.cancel(message())
                    outcome["cancelled"] = True
        finally:
            answered.set()

    try:
        loop.call_soon_threadsafe(in_the_loop)
    except RuntimeError:  # closed meanwhile
        return False
    in_time = answered.wait(RAISE_RETRY)
    with lock:
        outcome["open"] = False
        return outcome["cancelled"] if in_time or answered.is_set() else None


#: Where the code of an event loop's machinery lives (see :func:`in_loop_callback`).
_MACHINERY = ("/asyncio/", "/tornado/", "/zmq/", "/selectors.py")


def in_loop_callback(ident: int) -> bool:
    """Whether the thread ``ident`` runs a callback of its event loop other than the cell
    and IPython's code around it (a comm's handler, a hook): where an exception stops that
    callback alone (asyncio reports it). Not while the loop waits for its next event, nor
    in the machinery that reads and sends messages (asyncio's, tornado's, pyzmq's own code
    running now), which an exception could leave without a message it took."""
    stack = list(codes(ident))
    if not stack or any(part in stack[0].co_filename for part in _MACHINERY):
        return False
    if any(code.co_filename.endswith("interactiveshell.py") for code in stack):
        return False
    return any(code.co_name == "_run" and code.co_filename.endswith("/asyncio/events.py") for code in stack)


def running_code(ident: int | None) -> bool:
    """Whether the thread ``ident`` runs a cell's code now (not awaiting, not in its
    shell's own code before or after it), where an exception stops the cell alone."""
    return any(is_run_code(code) for code in codes(ident))


def codes(ident: int | None) -> Iterator[CodeType]:
    """The code of each frame the thread ``ident`` runs now, innermost first."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        yield frame.f_code
        frame = frame.f_back


def is_run_code(code: CodeType) -> bool:
    """Whether ``code`` is IPython's ``run_code``, which runs (or awaits) a cell's code."""
    return code.co_name == "run_code" and code.co_filename.endswith("interactiveshell.py")


def kernels_own(thread: threading.Thread) -> bool:
    """One of ipykernel's threads that start after this watch: the shell-channel thread
    (at the first subshell request) and the subshells' own. An exception raised in one
    between requests ends its loop: the subshells stop answering. A subshell's cell is
    stopped as the main shell's are, as it starts (``cell_started``)."""
    base = getattr(sys.modules.get("ipykernel.thread"), "BaseThread", None)
    return base is not None and isinstance(thread, base)


def importing(ident: int | None) -> bool:
    # Never into an import: a module left half-initialised by the MemoryError cannot
    # be imported again in this process ("cannot load module more than once").
    return any(code.co_filename.startswith("<frozen importlib") for code in codes(ident))


def lift_clamp() -> None:
    # The channel relay may have lowered the address-space limit to stop a call made
    # in C (kernel_relay.py's MemoryClamp); it lets go once it sees it lifted.
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


# ---------------------------------------------------------------- network


def no_route_text(network: str, allowed: list[str]) -> str:
    """What the kernel's network policy lets it reach, for its messages."""
    if network == "none":
        return "this sandboxed kernel has no network (network policy: none)"
    shown = ", ".join(allowed[:8]) + (", ..." if len(allowed) > 8 else "")
    return f"this sandboxed kernel reaches only HTTP(S) to its allowed domains ({shown}), through its proxy"


def explain_unresolved_names(no_route: str) -> None:
    """A name that does not resolve says the kernel's network policy."""
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return real_getaddrinfo(host, *args, **kwargs)
        except socket.gaierror as exc:
            raise socket.gaierror(exc.errno, f"cannot resolve {host!r}: {no_route}") from None

    socket.getaddrinfo = getaddrinfo


def network_cause(value: BaseException) -> str | None:
    """The plainest message in ``value``'s chain that carries our network policy (or
    the proxy's refusal): libraries wrap the resolver's error several times over."""
    seen: set[int] = set()
    found: list[str] = []
    todo: list[object] = [value]
    while todo and len(seen) < 50:
        error = todo.pop()
        if not isinstance(error, BaseException) or id(error) in seen:
            continue
        seen.add(id(error))
        text = str(error)
        if any(mark in text for mark in NETWORK_MARKS):
            found.append(re.sub(r"^\[Errno -?\d+\] ", "", text))
        todo += [error.__cause__, error.__context__, getattr(error, "reason", None), *error.args]
    return min(found, key=len) if found else None


# ---------------------------------------------------------------- showing errors


def outside_workspace(value: BaseException) -> str | None:
    """Why a file outside /workspace is missing, if it is one."""
    if not isinstance(value, FileNotFoundError) or value.filename is None:
        return None
    if not os.path.isdir("/workspace"):  # not in a sandbox's layout: nothing to explain
        return None
    try:
        path = os.path.abspath(os.fsdecode(value.filename))
    except (TypeError, ValueError, OSError):
        return None
    if any(path == top or path.startswith(top + "/") for top in SANDBOX_OWN):
        return None
    named = "" if path == os.fsdecode(value.filename) else f"{path!r}: "
    return (
        f"{named}outside /workspace, the only host folder this sandboxed kernel sees; "
        "copy the file into the workspace"
    )


class ErrorDisplay:
    """IPython's handler of the errors the sandbox explains (``set_custom_exc``)."""

    def __init__(self, watch: MemoryWatch, no_route: str, image: str) -> None:
        self.watch = watch
        self.no_route = no_route
        self.image = image

    def show(
        self, shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: int | None = None
    ) -> None:
        if isinstance(value, ModuleNotFoundError) and value.name and not str(value).endswith(INSTALL_HINT):
            top = value.name.partition(".")[0]
            where = (
                'it is in the "Sandboxed Python (data science)" kernel (Kernel > Change Kernel); '
                if top in DATASCIENCE_MODULES and "datascience" not in self.image
                else ""
            )
            value.msg = f"{value.msg}: {where}{INSTALL_HINT}"
            value.args = (value.msg,)
        if isinstance(value, MemoryError):
            self.show_memory_error(shell, value, tb, tb_offset)
            return
        elsewhere = outside_workspace(value)
        if elsewhere is not None:
            shell.showtraceback((etype, FileNotFoundError(f"{value} ({elsewhere})"), tb), tb_offset=tb_offset)
            return
        if isinstance(value, PermissionError) and any(
            frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "synchronize.py"))
            for frame, _ in traceback.walk_tb(tb)
        ):
            shell._showtraceback(etype, value, [f"{etype.__name__}: {NO_PROCESS_LOCKS}"])
            return
        cause = network_cause(value)
        if cause is None:
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
            return
        # One line: the library's forty lines of retries say nothing more.
        shell._showtraceback(etype, value, [f"{etype.__name__}: {cause}"])

    def show_memory_error(self, shell: Any, value: BaseException, tb: Any, tb_offset: int | None) -> None:
        # The relay may clamp just after this lifts (the watch stopped the cell as the relay
        # saw it still growing): lift, and try again, a few times.
        for attempt in range(5):
            lift_clamp()
            try:
                message = self.watch.error_text(value)
                value.args = (message,)
                # Some errors (numpy's) render from their own fields: show a plain one instead.
                plain = value if str(value) == message else MemoryError(message)
                shell.showtraceback((type(plain), plain, tb), tb_offset=tb_offset)
                return
            except MemoryError:
                if attempt == 4:
                    raise
                time.sleep(0.02)


# ---------------------------------------------------------------- packages


def pip_prefix(offline: bool) -> str:
    """pip's defaults in the environment (each unless set); the folder it installs into."""
    pip_defaults = {"PIP_PREFIX": "/tmp/python-packages", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # noqa: S108
    pip_defaults |= {"PIP_NO_CACHE_DIR": "1", "PIP_NO_INPUT": "1"}
    if offline:
        pip_defaults |= {"PIP_NO_INDEX": "1", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"}
    for name, value in pip_defaults.items():
        os.environ.setdefault(name, value)
    return os.environ["PIP_PREFIX"]


class SitePackages:
    """The site folders under ``PIP_PREFIX``, on the path ahead of the image's packages."""

    def __init__(self, prefix: str) -> None:
        prefix_paths = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix}) if prefix else {}
        site_dirs = list(
            dict.fromkeys(prefix_paths[key] for key in ("purelib", "platlib") if key in prefix_paths)
        )
        try:
            for folder in site_dirs:
                os.makedirs(folder, exist_ok=True)
        except OSError:
            site_dirs = []  # pip will say what is wrong with the folder
        if site_dirs:
            at = site_packages_index(sys.path)
            at = at if at is not None else len(sys.path)
            sys.path[at:at] = [folder for folder in site_dirs if folder not in sys.path]
            for folder in site_dirs:
                site.addsitedir(folder)  # its .pth files; the folder is on the path already
            for name, first in (("PYTHONPATH", site_dirs), ("PATH", [prefix_paths["scripts"]])):
                os.environ[name] = os.pathsep.join([*first, *filter(None, [os.environ.get(name)])])
        self.site_dirs = site_dirs
        self.pth_seen = {
            (folder, name) for folder in site_dirs for name in os.listdir(folder) if name.endswith(".pth")
        }
        self.stamps: list[int] = []
        self.lock = threading.Lock()

    def changed(self, *args: Any) -> None:
        """After pip ran (%pip, !pip or a child process): what it installed imports now.
        Cells end on subshells too, at once: one at a time reads the ``.pth`` files."""
        with self.lock:
            stamps = [os.stat(folder).st_mtime_ns for folder in self.site_dirs if os.path.isdir(folder)]
            if stamps == self.stamps:
                return
            self.stamps[:] = stamps
            importlib.invalidate_caches()
            for folder in self.site_dirs:
                for name in sorted(os.listdir(folder)):
                    if name.endswith(".pth") and (folder, name) not in self.pth_seen:
                        self.pth_seen.add((folder, name))
                        site.addpackage(folder, name, None)


class PipError(Exception):
    """pip failed: one line under pip's own output, without this file's frames."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def run_streamed(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``command``, showing its output as it comes; its exit status and last output."""
    tail = ""
    with (
        subprocess.Popen(  # noqa: S603 (the user's own pip command, in their sandbox)
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        ) as process,
        selectors.DefaultSelector() as selector,
    ):
        try:
            for pipe, stream in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
                if pipe is not None:
                    decoder = codecs.getincrementaldecoder("utf-8")("replace")
                    selector.register(pipe, selectors.EVENT_READ, (stream, decoder))
            while selector.get_map():
                for key, _ in selector.select():
                    data = os.read(key.fd, 65536)
                    stream, decoder = key.data
                    text = decoder.decode(data, final=not data)
                    if not data:
                        selector.unregister(key.fileobj)
                    stream.write(text)
                    stream.flush()
                    tail = (tail + text)[-65536:]
            return process.wait(), tail
        finally:  # interrupted, or a limit struck: pip goes with the cell
            if process.poll() is None:
                process.kill()


def pip_failure_hint(output: str, subcommand: str, offline: bool, no_route: str) -> str:
    """Why pip failed, from its last output, in one sentence."""
    image_file = rf"\[Errno (13|30)\] (Permission denied|Read-only file system): '{re.escape(sys.prefix)}/"
    if re.search(image_file, output):
        return (
            "the packages of the kernel's image cannot be upgraded or removed (its files are "
            "read-only); --ignore-installed --no-deps installs another version ahead of one "
            "in the image, before its first import"
        )
    if offline and subcommand in ("install", "download", "wheel", "index"):
        return (
            f"{no_route}: pip can install only local files (wheels in the workspace); "
            "ask for a kernelspec whose allowed_domains include a package index"
        )
    if "sandbox-kernel egress denied" in output:
        return f"{no_route}; ask for a kernelspec whose allowed_domains include the package index"
    return "see pip's output above"


def pip_magic_for(shell: Any, packages: SitePackages, offline: bool, no_route: str) -> Callable[[str], None]:
    """The kernel's ``%pip``."""

    def pip_magic(line: str) -> None:
        """Run pip in a subprocess (as IPython's %pip) and fail the cell if pip fails."""
        args = shlex.split(line)
        env = dict(os.environ)
        elsewhere = ("-t", "--target", "--prefix", "--root", "--user")
        if any(arg.split("=")[0] in elsewhere or re.match(r"-t[^-]", arg) for arg in args):
            env.pop("PIP_PREFIX", None)  # pip allows one location: the user's
        try:
            status, output = run_streamed([sys.executable, "-m", "pip", *args], env)
        finally:
            packages.changed()
        shell.user_ns["_exit_code"] = status
        if status == 0:
            return
        subcommand = next((arg for arg in args if not arg.startswith("-")), "")
        hint = pip_failure_hint(output, subcommand, offline, no_route)
        msg = f"pip {subcommand or 'command'} failed (exit status {status}): {hint}"
        raise PipError(msg)

    return pip_magic


# ---------------------------------------------------------------- wall clock


def arm_wall_clock(shell: Any, exec_timeout: float) -> None:
    """Before each execution, a timer that stops the cell with an error naming the limit:
    SIGALRM on the main shell (it interrupts a blocking call too); on a subshell, whose
    thread no signal handler runs in, a timer thread. A cell running its code gets a
    TimeoutError there (on a subshell between two bytecodes: a call blocking in C is the
    host's to stop); a cell that awaits has its task cancelled, with the same message (an
    error raised in its shell's event loop would end the loop). Each shell arms and
    disarms its own."""
    message = (
        f"execution stopped: the wall-clock limit of {exec_timeout:g} s per execution was exceeded "
        "(sandbox-kernel exec_timeout); split the work into shorter cells or ask for a higher limit"
    )
    main = threading.main_thread()

    #: Whether the main shell's execution is armed (a SIGALRM handled after its disarm,
    #: or a retry, must not reach the next one).
    main_armed = threading.Event()

    def expired(signum: int, frame: Any) -> None:
        if not main_armed.is_set():
            return
        if running_code(main.ident):
            raise TimeoutError(message)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            signal.setitimer(signal.ITIMER_REAL, RAISE_RETRY)
            return
        # From the loop's own turn, which this wakes (a cancel made in the handler would
        # wait for whatever the loop waited on).
        loop.call_soon_threadsafe(cancel_on_main, loop)

    def cancel_on_main(loop: asyncio.AbstractEventLoop) -> None:
        if main_armed.is_set() and not cancel_awaiting(loop, message):  # (ipykernel's code around it)
            signal.setitimer(signal.ITIMER_REAL, RAISE_RETRY)

    class OutOfTime(TimeoutError):
        # Raised by its type alone (PyThreadState_SetAsyncExc): the message is its default,
        # and its name the main shell's, for the reply's ename and the traceback.
        def __init__(self, *args: object) -> None:
            super().__init__(*(args or (message,)))

    OutOfTime.__name__ = OutOfTime.__qualname__ = "TimeoutError"
    OutOfTime.__module__ = "builtins"
    timers: dict[int, threading.Event] = {}
    lock = threading.Lock()

    def out_of_time(ident: int, disarmed: threading.Event) -> None:
        if disarmed.wait(exec_timeout):
            return
        loop = shell_loop(shell, ident)

        def armed() -> bool:
            with lock:
                return timers.get(ident) is disarmed

        # A cell that awaits leaves its loop free, which cancels it in its own thread; a
        # loop that does not answer runs a cell's code (or ipykernel's around it), which
        # gets the error between two of its bytecodes.
        while armed():
            cancelled = None if loop is None else cancel_from(loop, lambda: message, armed)
            with lock:
                if timers.get(ident) is not disarmed:
                    return
                if cancelled or (cancelled is None and running_code(ident)):
                    timers.pop(ident)
                    if not cancelled:
                        raise_in(ident, OutOfTime)
                    return
            disarmed.wait(RAISE_RETRY)

    def arm() -> None:
        if threading.current_thread() is main:
            signal.signal(signal.SIGALRM, expired)
            main_armed.set()
            signal.setitimer(signal.ITIMER_REAL, exec_timeout)
            return
        ident, disarmed = threading.get_ident(), threading.Event()
        timer = threading.Thread(
            target=out_of_time, args=(ident, disarmed), name=f"{OWN_THREADS}wall-clock", daemon=True
        )
        with lock:
            timers[ident] = disarmed
        try:
            timer.start()
        except RuntimeError:  # no thread left under the pids limit: the host's watch holds
            with lock:
                timers.pop(ident, None)

    def disarm() -> None:
        if threading.current_thread() is main:
            main_armed.clear()
            signal.setitimer(signal.ITIMER_REAL, 0)
            return
        with lock:
            disarmed = timers.pop(threading.get_ident(), None)
        if disarmed is not None:
            disarmed.set()

    around_executions(shell, arm, disarm)


# ---------------------------------------------------------------- claim (pooled)


def listen_for_claim(shell: Any) -> bool:
    # A pooled sandbox starts before its kernel is asked for: the host hands it its
    # working folder (the workspace, attached meanwhile), environment and narrowed limits
    # through a socket it listens on once, and it answers "ok". Bound last: its existence
    # tells the host that the kernel is ready. Nobody else reaches the socket (it lies in
    # the server's private folder), and no code of a user has run yet. True: a pooled one.
    claim_path = os.environ.pop("SANDBOX_KERNEL_CLAIM", "")
    if not claim_path:
        return False
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(claim_path)
    listener.listen(1)
    claimed = functools.partial(await_claim, shell, listener)
    threading.Thread(target=claimed, name="sandbox-kernel-claim", daemon=True).start()
    return True


def await_claim(shell: Any, listener: socket.socket) -> None:
    """Take the claim (the working folder, environment, lower limits and, on a restart,
    the session key), then set the kernel up for its policy; "ok", or why not."""
    conn, _ = listener.accept()
    listener.close()  # a host socket would keep the sandbox from a checkpoint
    with conn:
        data = b""
        while len(data) < 1 << 20:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        try:
            take_claim(shell, json.loads(data))
        except Exception as exc:  # noqa: BLE001  # any: the host then starts the kernel cold
            conn.sendall(f"failed: {exc!r}"[:200].encode() + b"\n")
            return
        conn.sendall(b"ok\n")


def take_claim(shell: Any, claim: dict[str, Any]) -> None:
    """Become the claimed kernel: lower limits first, for every process of the sandbox
    (what a cold start's container gets; a process can only lower its own, and these are
    the kernel's uid's), then the start's environment, before any code of a user runs."""
    for name, value in claim.get("rlimits", {}).items():
        lower_limit(getattr(resource, f"RLIMIT_{str(name).upper()}"), int(value))
    for name in claim.get("unset", []):
        os.environ.pop(str(name), None)
    os.environ.update({str(k): str(v) for k, v in claim.get("env", {}).items()})
    cwd = str(claim["cwd"])
    os.chdir(cwd)
    shell.user_ns["_dh"] = [cwd]
    if "JPY_SESSION_NAME" in claim.get("env", {}):
        shell.user_ns["__session__"] = os.environ["JPY_SESSION_NAME"]
    if claim.get("key"):  # a restart: the session key the kernel's clients hold
        shell.kernel.session.key = str(claim["key"]).encode()
    set_up(shell)


def lower_limit(which: int, value: int) -> None:
    """Set the resource limit ``which`` to at most ``value`` on every process of the
    sandbox, this one last; raises if one is left above it."""
    me = os.getpid()
    pids = sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit() and int(entry) != me)
    for pid in [*pids, me]:
        try:
            soft, hard = (
                value if v == resource.RLIM_INFINITY else min(v, value) for v in resource.prlimit(pid, which)
            )
            resource.prlimit(pid, which, (soft, hard))
            left = resource.prlimit(pid, which)
        except ProcessLookupError:
            continue  # ended meanwhile
        if resource.RLIM_INFINITY in left or max(left) > value:
            msg = f"process {pid} keeps a limit above {value}"
            raise OSError(msg)
