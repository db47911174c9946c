# Code that runs inside the sandboxed kernel as it starts (its PYTHONSTARTUP).
#
# The image does not have this package: the provisioner copies this file's text into the
# kernel's launch folder. It reads the kernel's policy from ``SANDBOX_KERNEL_POLICY`` and
# defines nothing in the user's namespace. It is for the user's benefit, not enforcement
# (the kernel's own code could undo all of it); the container's limits and the host's
# watchdog are the bounds.
#
# - The kernel starts with PYTHONSAFEPATH, so that nothing in the workspace runs before it
#   is up; once it is, ``import mymodule`` of a file next to the notebook works as in a
#   local kernel (``''`` where IPython puts it: after the standard library, before
#   site-packages), and child processes (``!python script.py``) start without
#   PYTHONSAFEPATH, finding their own folder's modules as usual.
# - A cell that keeps allocating ends in a ``MemoryError`` naming the limit, and the kernel
#   keeps its other variables. At the container's memory limit the host's OOM killer takes
#   the whole sandbox, every variable with it, so a thread watches the kernel's resident
#   memory and, a margin below the limit (for gVisor's own memory and /tmp), raises
#   ``MemoryError`` in the running cell (and in threads the user's code started), as
#   Ctrl-C raises ``KeyboardInterrupt``. An allocation gVisor refuses outright (larger
#   than the limit) raises it as well. Not an address-space limit: that fails the first
#   allocation past it in whichever thread makes it, and ZeroMQ's threads abort the
#   kernel when theirs fails. One allocation made in C that fills the rest (a
#   ``numpy.ones`` of most of the limit) is beyond reach: the watchdog's kill remains.
# - Code that tries a network the kernel does not have learns it in one line: a name that
#   does not resolve says the kernel's network policy, and errors that carry it (or the
#   egress proxy's refusal) are shown as that one line instead of the library's traceback.
# - BLAS, OpenMP and polars start one thread per CPU the kernel may use, not per host core
#   (``os.cpu_count()`` shows the host's), unless the kernelspec's ``env`` says otherwise.
# - With a wall-clock limit, a SIGALRM armed before each cell raises a ``TimeoutError``
#   naming it, so the user keeps the kernel. Code that blocks or ignores the signal is the
#   host's business: the provisioner interrupts, then kills the kernel.
#
# (A comment, not a docstring: the file runs in the user's namespace, whose __doc__ is
# IPython's.)

# No module-level imports: this file runs in the user's namespace, which keeps only what
# is not deleted at the end (and a __future__ import would change how their cells compile).


def _sandbox_kernel_startup() -> None:
    import ctypes
    import json
    import math
    import os
    import re
    import signal
    import socket
    import sys
    import threading
    import time
    from typing import Any

    from IPython import get_ipython

    policy: dict[str, Any] = json.loads(os.environ.get("SANDBOX_KERNEL_POLICY") or "{}")
    memory = str(policy.get("memory", ""))
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    memory_bytes = int(memory[:-1]) * units[memory[-1].lower()] if memory[-1:].isalpha() else int(memory or 0)
    exec_timeout = float(policy.get("exec_timeout") or 0)
    allowed = [str(domain) for domain in policy.get("allowed_domains") or []]

    os.environ.pop("PYTHONSAFEPATH", None)
    if "" not in sys.path:
        names = [os.path.basename(entry) for entry in sys.path]
        packages = [i for i, name in enumerate(names) if name in ("site-packages", "dist-packages")]
        sys.path.insert(packages[0] if packages else 0, "")
    for name in (
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "NUMEXPR_MAX_THREADS",
        "POLARS_MAX_THREADS",
    ):
        os.environ.setdefault(name, str(max(1, math.ceil(float(policy.get("cpus") or 1)))))

    shell = get_ipython()
    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * page

    # ---------------------------------------------------------------- memory
    threshold = memory_bytes - (64 * 2**20 + memory_bytes // 16)
    fastest_growth = 2 * 2**30  # bytes per second: more than a kernel allocates under gVisor
    step = max(16 * 2**20, memory_bytes // 64)
    executing = threading.Event()
    kernel_threads = {thread.ident for thread in threading.enumerate()}

    def watch_memory() -> None:
        me = threading.get_ident()
        stopped_at = 0  # memory in use when cells were last stopped; 0: below the threshold
        while True:
            used = resident()
            if used < threshold:
                stopped_at = 0
            elif not stopped_at or used >= stopped_at + step:
                stopped_at = used
                targets = [
                    thread.ident
                    for thread in threading.enumerate()
                    if thread.ident not in kernel_threads and thread.ident != me
                ]
                if executing.is_set():  # once per cell: not again while its error is shown
                    executing.clear()
                    targets.append(threading.main_thread().ident)
                for ident in targets:
                    if ident is not None:
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(ident), ctypes.py_object(MemoryError)
                        )
            # Look again before the fastest allocation could cross the threshold: an idle
            # kernel far below it costs a wake-up a second, one near it is watched closely.
            time.sleep(min(1.0, max(0.01, (threshold - used) / fastest_growth)))

    def memory_error_text(value: BaseException) -> str:
        detail = str(value)
        return (
            f"memory limit {memory} of this sandboxed kernel reached"
            f" ({resident() // 2**20} MiB in use{'; ' + detail if detail else ''})"
            ": the cell was stopped and the kernel keeps its other variables;"
            " free memory (del) or ask for a higher limit"
        )

    # ---------------------------------------------------------------- network
    if policy.get("network", "none") == "none":
        no_route = "this sandboxed kernel has no network (network policy: none)"
    else:
        shown = ", ".join(allowed[:8]) + (", ..." if len(allowed) > 8 else "")
        no_route = (
            f"this sandboxed kernel reaches only HTTP(S) to its allowed domains ({shown}), through its proxy"
        )
    marks = ("this sandboxed kernel", "sandbox-kernel egress denied")
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
            if any(mark in text for mark in marks):
                found.append(re.sub(r"^\[Errno -?\d+\] ", "", text))
            todo += [error.__cause__, error.__context__, getattr(error, "reason", None), *error.args]
        return min(found, key=len) if found else None

    # ---------------------------------------------------------------- showing errors
    def show(self: Any, etype: type, value: BaseException, tb: Any, tb_offset: int | None = None) -> None:
        if isinstance(value, MemoryError):
            message = memory_error_text(value)
            value.args = (message,)
            # Some errors (numpy's) render from their own fields: show a plain one instead.
            plain = value if str(value) == message else MemoryError(message)
            self.showtraceback((type(plain), plain, tb), tb_offset=tb_offset)
            return
        cause = network_cause(value)
        if cause is None:
            self.showtraceback((etype, value, tb), tb_offset=tb_offset)
            return
        # One line: the library's forty lines of retries say nothing more.
        self._showtraceback(etype, value, [f"{etype.__name__}: {cause}"])

    shell.set_custom_exc((MemoryError, OSError), show)
    shell.events.register("pre_run_cell", lambda info: executing.set())
    shell.events.register("post_run_cell", lambda result: executing.clear())
    if memory_bytes > 0:
        threading.Thread(target=watch_memory, name="sandbox-kernel-memory", daemon=True).start()

    # ---------------------------------------------------------------- wall clock
    def expired(signum: int, frame: Any) -> None:
        msg = (
            f"execution stopped: the wall-clock limit of {exec_timeout:g} s per execution was exceeded "
            "(sandbox-kernel exec_timeout); split the work into shorter cells or ask for a higher limit"
        )
        raise TimeoutError(msg)

    def arm(info: Any) -> None:
        signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, exec_timeout)

    def disarm(result: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)

    if exec_timeout > 0:
        shell.events.register("pre_run_cell", arm)
        shell.events.register("post_run_cell", disarm)

    # ---------------------------------------------------------------- claim (pooled)
    # A pooled sandbox starts before its kernel is asked for: the host hands it its
    # working folder (the workspace, attached meanwhile) and session variables through
    # a socket it listens on once, and it answers "ok". Bound last: its existence tells
    # the host that the kernel is ready. Nobody else reaches the socket (it lies in the
    # server's private folder), and no code of a user has run yet.
    claim_path = os.environ.pop("SANDBOX_KERNEL_CLAIM", "")
    if not claim_path:
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(claim_path)
    listener.listen(1)

    def await_claim() -> None:
        conn, _ = listener.accept()
        listener.close()  # a host socket would keep the sandbox from a checkpoint
        with conn:
            data = b""
            while len(data) < 1 << 20:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            claim = json.loads(data)
            os.environ.update({str(k): str(v) for k, v in claim.get("env", {}).items()})
            cwd = str(claim["cwd"])
            os.chdir(cwd)
            shell.user_ns["_dh"] = [cwd]
            if "JPY_SESSION_NAME" in claim.get("env", {}):
                shell.user_ns["__session__"] = os.environ["JPY_SESSION_NAME"]
            conn.sendall(b"ok\n")

    threading.Thread(target=await_claim, name="sandbox-kernel-claim", daemon=True).start()


if __name__ == "__main__":  # as the kernel's PYTHONSTARTUP
    _sandbox_kernel_startup()
    del _sandbox_kernel_startup
