"""Latency and host memory of a sandboxed kernel compared with a local ipykernel.

For each of two kernelspecs -- the sandboxed one (default ``sandboxed-python``) and a
local ipykernel as the baseline (default ``python3``) -- this measures, the way a user
of ``jupyter_client`` would see it:

* startup: from ``KernelManager.start_kernel()`` to the kernel's first
  ``kernel_info`` reply inside ``client.wait_for_ready()``, and to the moment
  ``wait_for_ready()`` returns, over ``--starts`` fresh kernels (median and max).
  ``wait_for_ready()`` only returns once IOPub has been quiet for 0.2 s, so the second
  figure carries that fixed wait for both kernels; the first does not.
* restart: from ``KernelManager.restart_kernel()`` (what JupyterLab's restart button
  asks of the server: a graceful shutdown, then a new kernel with the same connection)
  to the new kernel's first ``kernel_info`` reply, over ``--restarts`` restarts of one
  kernel (median and max). The workspace stays; the interpreter is new.
* shutdown: ``KernelManager.shutdown_kernel()`` (graceful, as a server shuts down a
  notebook's kernel) until it returns, for each of the ``--starts`` kernels (median).
* execute round trip: ``client.execute_interactive("1+1")``, i.e. from sending the
  ``execute_request`` until both the ``execute_reply`` and the ``idle`` status on
  IOPub have arrived, ``--runs`` times after ``--warmup`` untimed runs, on one kernel
  (p50 and p95); and the same through the session API, ``SandboxSession.run("1+1")`` to
  its ``Execution`` (on a kernel of its own), which adds the host's CPU and peak-memory
  readings per run: for the sandboxed kernel only (the session API refuses a kernel that
  runs on the host), so compare it with the raw round trip of the same column.

* host memory of one kernel, idle and after ``import pandas`` (install pandas where the
  local kernel runs, e.g. ``.venv/bin/pip install pandas``, or that row reads nan): for the local kernel
  its process's PSS (``/proc/PID/smaps_rollup``); for the sandboxed one everything its
  container's memory cgroup is charged (guest memory, gVisor's sentry and gofer, page
  cache): under gVisor the guest's memory lives in a memory file that no host process's
  RSS/PSS reflects, so the cgroup is the honest figure of what the host pays.

* the warm pool: a temporary variant of the sandboxed kernelspec with ``pool_size``
  ``--pool-size`` (default 4): start -> first ``kernel_info`` reply of ``--pooled-starts``
  kernels, each claimed from a full pool (p50, p95; compared with the local kernel's cold
  start), and as many that narrow the policy (memory, cpus, pids) or set variables
  (``sandbox_env``), interleaved with them (p50 of each); ``--at-once`` kernels (default
  10) requested at the same moment through ``AsyncKernelManager`` (as a server or an
  assistant would), with no pool and with a full pool, until the last one's
  ``kernel_info`` reply; host memory of one idle pooled sandbox (its cgroup).
* idle CPU: those ``--at-once`` kernels left idle, host CPU over ``--idle-seconds``:
  for the sandboxed ones their containers' cgroups plus this process (the bridges and
  watchdogs run here), for local ones their processes plus this process; in % of one core
  for all of them together.

All kernels run in one temporary working folder made for the run (owned by uid 65533
when run as root, so the sandboxed kernel can write to it), one kernel at a time: each
is shut down before the next one starts. Progress goes to stderr, the table (and, with ``--json``,
the raw numbers) to stdout.

Run from the project root::

    .venv/bin/python bench/latency.py
    .venv/bin/python bench/latency.py --starts 5 --runs 200 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import docker
from jupyter_client import AsyncKernelManager, KernelManager
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.kernelspec import KernelSpecManager

from sandbox_kernel import SandboxPool, SandboxSession, warm_pool
from sandbox_kernel.host.cgroups import cpu_seconds, memory_usage
from sandbox_kernel.plan.plan import DEFAULT_KERNEL_UID

STARTUP_TIMEOUT = 120.0  # seconds for one kernel to become ready
EXECUTE_TIMEOUT = 30.0  # seconds for one `1+1` round trip
SANDBOX_UID = DEFAULT_KERNEL_UID  # the uid the sandboxed kernel runs as when we are root
CODE = "1+1"
#: A cell writing to file descriptor 1, as C libraries and child processes do (its output
#: reaches the client through ipykernel's pipe; over the output cap the sandbox drops it).
FLOOD_MIB = 20
#: A cell printing many short lines (each print a write to sys.stdout, through ipykernel's
#: output path): the median of PRINT_RUNS.
PRINTS = "for i in range(100_000):\n    print(i)"
PRINT_RUNS = 3
FLOOD = f"import os\nchunk = b'x' * 2**20\nfor _ in range({FLOOD_MIB}):\n    os.write(1, chunk)"


class StampedClient(BlockingKernelClient):
    """A blocking client that notes when wait_for_ready() got its kernel_info reply."""

    kernel_info_reply_at: float | None = None

    def _handle_kernel_info_reply(self, msg: dict[str, Any]) -> None:
        if self.kernel_info_reply_at is None:
            self.kernel_info_reply_at = time.perf_counter()
        super()._handle_kernel_info_reply(msg)


@dataclass
class StartedKernel:
    client: StampedClient
    manager: KernelManager
    kernel_info_s: float  # start_kernel() -> first kernel_info reply
    ready_s: float  # start_kernel() -> wait_for_ready() returned


@dataclass
class Timings:
    kernel_name: str
    kernel_info_s: list[float] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)
    shutdown_s: list[float] = field(default_factory=list)
    execute_ms: list[float] = field(default_factory=list)
    memory_idle_mib: float = math.nan
    memory_pandas_mib: float = math.nan
    pooled_kernel_info_s: list[float] = field(default_factory=list)
    #: Pooled starts that narrow the policy, and that set variables (``sandbox_env``).
    pooled_narrowed_s: list[float] = field(default_factory=list)
    pooled_env_s: list[float] = field(default_factory=list)
    at_once_s: float = math.nan
    at_once_pooled_s: float = math.nan
    memory_pooled_mib: float = math.nan
    idle_cpu_pct: float = math.nan
    session_run_ms: list[float] = field(default_factory=list)
    flood_s: float = math.nan
    prints_s: list[float] = field(default_factory=list)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def running_kernel(kernel_name: str, cwd: str, **start_kwargs: Any) -> Iterator[StartedKernel]:
    """Start a kernel (``start_kwargs``: a start's own policy or ``sandbox_env``), wait
    until it is ready, and always shut it down afterwards."""
    manager = KernelManager(kernel_name=kernel_name, client_factory=StampedClient)
    client: StampedClient | None = None
    started = time.perf_counter()
    try:
        # A local kernel echoes FLOOD to its own stdout (a sandboxed one, to its container's log).
        local = manager.kernel_spec.metadata.get("kernel_provisioner") is None
        manager.start_kernel(cwd=cwd, **({"stdout": subprocess.DEVNULL} if local else start_kwargs))
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=STARTUP_TIMEOUT)
        ready = time.perf_counter()
        reply_at = client.kernel_info_reply_at or ready
        yield StartedKernel(client, manager, kernel_info_s=reply_at - started, ready_s=ready - started)
    finally:
        if client is not None:
            client.stop_channels()
        if manager.has_kernel:
            manager.shutdown_kernel()


def ignore_output(msg: dict[str, Any]) -> None:
    """IOPub hook for execute_interactive(): drop output instead of printing it."""


def execute_once(client: BlockingKernelClient) -> float:
    """Seconds from sending `1+1` until its reply and its idle status are both in."""
    started = time.perf_counter()
    reply = client.execute_interactive(CODE, timeout=EXECUTE_TIMEOUT, output_hook=ignore_output)
    elapsed = time.perf_counter() - started
    if reply["content"]["status"] != "ok":
        msg = f"Executing {CODE!r} failed: {reply['content']}"
        raise RuntimeError(msg)
    return elapsed


def timed_cell(client: BlockingKernelClient, code: str, what: str) -> float:
    """Seconds from sending ``code`` (:data:`FLOOD`, :data:`PRINTS`) until its reply."""
    started = time.perf_counter()
    reply = client.execute_interactive(code, timeout=EXECUTE_TIMEOUT * 4, output_hook=ignore_output)
    if reply["content"]["status"] != "ok":
        msg = f"{what} failed: {reply['content']}"
        raise RuntimeError(msg)
    return time.perf_counter() - started


def measure(kernel_name: str, starts: int, restarts: int, runs: int, warmup: int, cwd: str) -> Timings:
    timings = Timings(kernel_name)
    for i in range(1, starts + 1):
        with running_kernel(kernel_name, cwd) as kernel:
            timings.kernel_info_s.append(kernel.kernel_info_s)
            timings.ready_s.append(kernel.ready_s)
            started = time.perf_counter()
            kernel.manager.shutdown_kernel()  # (as a server's, when a notebook's kernel is shut down)
            timings.shutdown_s.append(time.perf_counter() - started)
            progress(
                f"[{kernel_name}] start {i}/{starts}: kernel_info reply after "
                f"{kernel.kernel_info_s:.3f} s, ready after {kernel.ready_s:.3f} s; "
                f"shut down in {timings.shutdown_s[-1]:.3f} s"
            )

    progress(f"[{kernel_name}] execute {CODE!r}: {warmup} warm-up + {runs} timed runs on a new kernel")
    with running_kernel(kernel_name, cwd) as kernel:
        for i in range(1, restarts + 1):
            timings.restart_s.append(restart_once(kernel))
            progress(
                f"[{kernel_name}] restart {i}/{restarts}: kernel_info after {timings.restart_s[-1]:.3f} s"
            )
        for _ in range(warmup):
            execute_once(kernel.client)
        timings.execute_ms = [execute_once(kernel.client) * 1000 for _ in range(runs)]
        timings.flood_s = timed_cell(kernel.client, FLOOD, f"Writing {FLOOD_MIB} MiB to fd 1")
        timings.memory_idle_mib = host_memory_mib(kernel.manager)
        reply = kernel.client.execute_interactive(
            "import pandas", timeout=EXECUTE_TIMEOUT, output_hook=ignore_output
        )
        if reply["content"]["status"] == "ok":
            timings.memory_pandas_mib = host_memory_mib(kernel.manager)
        else:
            progress(f"[{kernel_name}] pandas is not installed for this kernel: no 'with pandas' figure")
        # After the memory readings: what 100,000 lines leave behind is not an idle kernel's.
        timings.prints_s = [
            timed_cell(kernel.client, PRINTS, "Printing 100,000 lines") for _ in range(PRINT_RUNS)
        ]
    if is_sandboxed(kernel_name):  # the session API refuses a kernel that runs on the host
        timings.session_run_ms = measure_session(kernel_name, runs, warmup, cwd)
    progress(
        f"[{kernel_name}] host memory: {timings.memory_idle_mib:.1f} MiB idle, "
        f"{timings.memory_pandas_mib:.1f} MiB with pandas"
    )
    progress(
        f"[{kernel_name}] execute: p50 {percentile(timings.execute_ms, 50):.2f} ms, "
        f"p95 {percentile(timings.execute_ms, 95):.2f} ms"
    )
    return timings


def is_sandboxed(kernel_name: str) -> bool:
    spec = KernelSpecManager().get_kernel_spec(kernel_name)
    provisioner = (spec.metadata or {}).get("kernel_provisioner") or {}
    return provisioner.get("provisioner_name") == "sandbox-provisioner"


def measure_session(kernel_name: str, runs: int, warmup: int, cwd: str) -> list[float]:
    """Milliseconds per ``SandboxSession.run(CODE)``: what an assistant's program waits for
    one structured result (the session API on jupyter_client, whatever the kernel)."""
    with SandboxSession(kernel_name, cwd) as session:
        for _ in range(warmup):
            session.run(CODE)
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            result = session.run(CODE)
            times.append((time.perf_counter() - started) * 1000)
            if result.text != "2":
                msg = f"SandboxSession.run({CODE!r}) gave {result.to_dict()}"
                raise RuntimeError(msg)
    return times


def restart_once(kernel: StartedKernel) -> float:
    """Seconds from restart_kernel() to the new kernel's first kernel_info reply."""
    client = kernel.client
    started = time.perf_counter()
    kernel.manager.restart_kernel()
    client.kernel_info_reply_at = None
    client.wait_for_ready(timeout=STARTUP_TIMEOUT)
    return (client.kernel_info_reply_at or time.perf_counter()) - started


def sandbox_pid(manager: KernelManager | AsyncKernelManager) -> int | None:
    """The host pid of a sandboxed kernel's container (its cgroups are the sandbox's); None if local."""
    container_id = getattr(manager.provisioner, "container_id", None)
    if container_id is None:
        return None
    client = docker.from_env()
    try:
        return int(client.api.inspect_container(container_id)["State"]["Pid"]) or None
    finally:
        client.close()


def host_memory_mib(manager: KernelManager) -> float:
    """What the host pays for the kernel now: the sandbox's cgroup, or the local process's PSS."""
    pid = sandbox_pid(manager)
    if pid is not None:
        usage = memory_usage(pid)
        return usage / 2**20 if usage is not None else math.nan
    process = getattr(manager.provisioner, "process", None)
    if process is None:
        return math.nan
    with open(f"/proc/{process.pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return math.nan


def kernelspec_variant(kernel_name: str, suffix: str, config: dict[str, Any], folder: Path) -> str:
    """A variant of ``kernel_name`` named ``kernel_name-suffix`` with ``config`` added to its
    provisioner's, written in ``folder``'s kernels (``folder`` put first on JUPYTER_PATH for
    the rest of the run); its name."""
    spec = KernelSpecManager().get_kernel_spec(kernel_name)
    data = spec.to_dict()
    data["metadata"]["kernel_provisioner"].setdefault("config", {}).update(config)
    name = f"{kernel_name}-{suffix}"
    (folder / "kernels" / name).mkdir(parents=True)
    (folder / "kernels" / name / "kernel.json").write_text(json.dumps(data))
    paths = os.environ.get("JUPYTER_PATH", "").split(os.pathsep)
    if str(folder) not in paths:
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(folder), *paths]))
    return name


def measure_pool(timings: Timings, kernel_name: str, pool_size: int, starts: int, cwd: str) -> None:
    """Pooled starts, each from a full pool, and one idle pooled sandbox's memory."""
    pool = SandboxPool.instance()
    warm_pool(kernel_name, cwd=cwd)
    memory = [pooled_sandbox_memory_mib(kernel_name)]
    # Interleaved: the kernelspec's own policy, one narrowed (as an assistant's session
    # narrows it per conversation), one setting variables.
    kinds: list[tuple[str, dict[str, Any], list[float]]] = [
        ("", {}, timings.pooled_kernel_info_s),
        (", narrowed", {"memory": "1g", "cpus": 0.5, "pids": 128}, timings.pooled_narrowed_s),
        (", env", {"sandbox_env": {"BENCH_RUN": "1", "OPENAI_BASE_URL": "http://x"}}, timings.pooled_env_s),
    ]
    for i in range(1, starts + 1):
        for kind, start_kwargs, into in kinds:
            pool.wait_ready(kernel_name, pool_size)
            with running_kernel(kernel_name, cwd, **start_kwargs) as kernel:
                if not getattr(kernel.manager.provisioner, "from_pool", False):
                    msg = f"a pooled start{kind} did not come from the pool (see the log above)"
                    raise RuntimeError(msg)
                into.append(kernel.kernel_info_s)
                progress(
                    f"[{kernel_name}] pooled start{kind} {i}/{starts}: "
                    f"kernel_info reply after {kernel.kernel_info_s:.3f} s"
                )
    timings.memory_pooled_mib = statistics.median(memory)
    pool.drain()


def pooled_sandbox_memory_mib(kernel_name: str) -> float:
    """The cgroup memory of one waiting sandbox of ``kernel_name``'s pool."""
    client = docker.from_env()
    try:
        for container in client.containers.list(filters={"label": "io.sandbox-kernel.pool"}):
            if container.name.startswith("sandbox-kernel-pool-"):
                usage = memory_usage(int(container.attrs["State"]["Pid"]))
                return usage / 2**20 if usage is not None else math.nan
    finally:
        client.close()
    return math.nan


async def start_at_once(kernel_name: str, count: int, cwd: str) -> tuple[float, list[AsyncKernelManager]]:
    """Start ``count`` kernels at the same moment; seconds until the last one answered
    ``kernel_info``, and their managers (still running)."""

    async def one() -> AsyncKernelManager:
        manager = AsyncKernelManager(kernel_name=kernel_name)
        await manager.start_kernel(cwd=cwd)
        client = manager.client()
        client.start_channels()
        await client.wait_for_ready(timeout=STARTUP_TIMEOUT)
        client.stop_channels()
        return manager

    started = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
    elapsed = time.perf_counter() - started
    managers = [r for r in results if isinstance(r, AsyncKernelManager)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await shutdown_all(managers)
        raise failures[0]
    return elapsed, managers


async def shutdown_all(managers: list[AsyncKernelManager]) -> None:
    """Shut every kernel down at once; a shutdown that fails is reported, not hidden (it
    may leave a container behind for `jupyter sandbox-kernel prune`)."""
    results = await asyncio.gather(
        *(m.shutdown_kernel() for m in managers if m.has_kernel), return_exceptions=True
    )
    for result in results:
        if isinstance(result, BaseException):
            progress(f"a kernel's shutdown failed: {result!r}")


def kernel_cpu_seconds(manager: AsyncKernelManager) -> float:
    """CPU the host spent on one kernel so far: its container's cgroup, or its process."""
    pid = sandbox_pid(manager)
    if pid is not None:
        return cpu_seconds(pid) or 0.0
    process = getattr(manager.provisioner, "process", None)
    if process is None:
        return 0.0
    fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure_at_once(
    timings: Timings, kernel_name: str, count: int, idle_seconds: float, cwd: str
) -> None:
    """``count`` kernels at once (no pool), then their idle CPU."""
    timings.at_once_s, managers = await start_at_once(kernel_name, count, cwd)
    progress(f"[{kernel_name}] {count} kernels at once: all ready after {timings.at_once_s:.2f} s")
    try:
        await asyncio.sleep(5)  # let start-up work settle
        before = sum(kernel_cpu_seconds(m) for m in managers) + time.process_time()
        wall = time.perf_counter()
        await asyncio.sleep(idle_seconds)
        used = sum(kernel_cpu_seconds(m) for m in managers) + time.process_time() - before
        timings.idle_cpu_pct = 100 * used / (time.perf_counter() - wall)
        progress(f"[{kernel_name}] {count} idle kernels: {timings.idle_cpu_pct:.1f} % of a core together")
    finally:
        await shutdown_all(managers)


async def measure_at_once_pooled(
    timings: Timings, kernel_name: str, count: int, pool_size: int, cwd: str
) -> None:
    pool = SandboxPool.instance()
    await asyncio.to_thread(warm_pool, kernel_name, cwd)
    await asyncio.to_thread(pool.wait_ready, kernel_name, pool_size)
    timings.at_once_pooled_s, managers = await start_at_once(kernel_name, count, cwd)
    progress(
        f"[{kernel_name}] {count} kernels at once, pool of {pool_size}: "
        f"all ready after {timings.at_once_pooled_s:.2f} s"
    )
    await shutdown_all(managers)
    await asyncio.to_thread(pool.drain)


def in_turns(
    sample: Callable[[str], float], names: Sequence[str], runs: int, warmup: int, every: int = 100
) -> dict[str, list[float]]:
    """Milliseconds of ``sample(name)`` (seconds) for each of ``names``, ``runs`` each, one of
    each per round in an order shuffled every round (so that the machine's load touches all
    alike), after ``warmup`` untimed rounds; progress every ``every`` rounds."""
    for _ in range(warmup):
        for name in names:
            sample(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    order = list(names)
    for done in range(runs):
        random.shuffle(order)
        for name in order:
            times[name].append(sample(name) * 1000)
        if (done + 1) % every == 0:
            progress(f"  {done + 1}/{runs} rounds")
    return times


def ratio_table(times: dict[str, list[float]], names: Sequence[str], label: str, local: str = "local") -> str:
    """p50 and p95 of each of ``names``, and their ratios to ``local``'s, aligned."""
    base = {pct: percentile(times[local], pct) for pct in (50, 95)}
    lines: list[tuple[str, ...]] = [(label, "p50 ms", "p95 ms", f"p50 / {local}", f"p95 / {local}")]
    for name in names:
        p50, p95 = percentile(times[name], 50), percentile(times[name], 95)
        lines.append((name, f"{p50:.2f}", f"{p95:.2f}", f"{p50 / base[50]:.2f}x", f"{p95 / base[95]:.2f}x"))
    return aligned(lines)


def percentile(values: list[float], pct: float) -> float:
    """Linearly interpolated percentile (numpy's default method); nan without values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * pct / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(t: Timings) -> dict[str, float]:
    # A local kernel has no pool: its pooled rows compare with its cold start.
    pooled = t.pooled_kernel_info_s or t.kernel_info_s
    return {
        "pooled_p50_s": percentile(pooled, 50),
        "pooled_p95_s": percentile(pooled, 95),
        "pooled_narrowed_p50_s": percentile(t.pooled_narrowed_s or t.kernel_info_s, 50),
        "pooled_env_p50_s": percentile(t.pooled_env_s or t.kernel_info_s, 50),
        "at_once_s": t.at_once_s,
        "at_once_pooled_s": t.at_once_pooled_s if t.pooled_kernel_info_s else t.at_once_s,
        "memory_pooled_mib": t.memory_pooled_mib if t.pooled_kernel_info_s else t.memory_idle_mib,
        "idle_cpu_pct": t.idle_cpu_pct,
        "kernel_info_median_s": statistics.median(t.kernel_info_s),
        "kernel_info_max_s": max(t.kernel_info_s),
        "ready_median_s": statistics.median(t.ready_s),
        "ready_max_s": max(t.ready_s),
        "restart_median_s": statistics.median(t.restart_s) if t.restart_s else math.nan,
        "restart_max_s": max(t.restart_s) if t.restart_s else math.nan,
        "shutdown_median_s": statistics.median(t.shutdown_s) if t.shutdown_s else math.nan,
        "execute_p50_ms": percentile(t.execute_ms, 50),
        "execute_p95_ms": percentile(t.execute_ms, 95),
        "session_p50_ms": percentile(t.session_run_ms, 50),
        "session_p95_ms": percentile(t.session_run_ms, 95),
        "flood_s": t.flood_s,
        "prints_s": statistics.median(t.prints_s) if t.prints_s else math.nan,
        "memory_idle_mib": t.memory_idle_mib,
        "memory_pandas_mib": t.memory_pandas_mib,
    }


#: Table rows: (summary key, label, unit).
ROWS = (
    ("kernel_info_median_s", "start -> kernel_info reply, median", "s"),
    ("kernel_info_max_s", "start -> kernel_info reply, max", "s"),
    ("ready_median_s", "start -> wait_for_ready() returns, median", "s"),
    ("ready_max_s", "start -> wait_for_ready() returns, max", "s"),
    ("restart_median_s", "restart -> kernel_info reply, median", "s"),
    ("restart_max_s", "restart -> kernel_info reply, max", "s"),
    ("shutdown_median_s", "shutdown_kernel() returns, median", "s"),
    ("execute_p50_ms", f"execute {CODE!r} round trip, p50", "ms"),
    ("execute_p95_ms", f"execute {CODE!r} round trip, p95", "ms"),
    ("session_p50_ms", f"SandboxSession.run({CODE!r}), p50", "ms"),
    ("session_p95_ms", f"SandboxSession.run({CODE!r}), p95", "ms"),
    ("flood_s", f"{FLOOD_MIB} MiB written to fd 1 -> reply", "s"),
    ("prints_s", f"100,000 print() lines -> reply, median of {PRINT_RUNS}", "s"),
    ("memory_idle_mib", "host memory, idle kernel", "MiB"),
    ("memory_pandas_mib", "host memory, after import pandas", "MiB"),
    ("pooled_p50_s", "pooled start -> kernel_info reply, p50 (local: cold)", "s"),
    ("pooled_p95_s", "pooled start -> kernel_info reply, p95 (local: cold)", "s"),
    ("pooled_narrowed_p50_s", "pooled start, narrowed -> kernel_info reply, p50 (local: cold)", "s"),
    ("pooled_env_p50_s", "pooled start, env -> kernel_info reply, p50 (local: cold)", "s"),
    ("at_once_s", "N kernels at once, all ready (no pool)", "s"),
    ("at_once_pooled_s", "N kernels at once, all ready (pool; local: none)", "s"),
    ("memory_pooled_mib", "host memory, one idle pooled sandbox (local: idle)", "MiB"),
    ("idle_cpu_pct", "host CPU of N idle kernels, % of one core", "%"),
)


def format_table(local: dict[str, float], sandboxed: dict[str, float], headers: tuple[str, str]) -> str:
    def cell(value: float, unit: str) -> str:
        return (
            f"{value:.3f} {unit}"
            if unit == "s"
            else f"{value:.1f} {unit}"
            if unit in ("MiB", "%")
            else f"{value:.2f} {unit}"
        )

    lines = [("metric", *headers, "ratio sandboxed/local")]
    for key, label, unit in ROWS:
        ratio = sandboxed[key] / local[key] if local[key] else math.nan
        lines.append((label, cell(local[key], unit), cell(sandboxed[key], unit), f"{ratio:.2f}x"))
    return aligned(lines)


def aligned(lines: Sequence[tuple[str, ...]]) -> str:
    """``lines`` (the first the header) as a plain-text table: the first column to the
    left, the others to the right, a rule under the header."""
    widths = [max(len(line[col]) for line in lines) for col in range(len(lines[0]))]

    def render(line: tuple[str, ...]) -> str:
        label, *values = line
        cells = [v.rjust(w) for v, w in zip(values, widths[1:], strict=True)]
        return "  ".join([label.ljust(widths[0]), *cells])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(lines[0]), rule, *(render(line) for line in lines[1:])])


def in_turns_main(
    doc: str,
    measure: Callable[[str, str, int, int, str], dict[str, list[float]]],
    format_table: Callable[[dict[str, list[float]]], str],
    argv: list[str] | None,
    *,
    runs: int,
    warmup: int,
    each: str,
) -> int:
    """The command line of a benchmark that times ``CODE`` on several kernels (or ``each``
    way to one) in turns: ``measure(kernel, baseline, runs, warmup, cwd)``'s samples as
    ``format_table`` renders them, and with ``--json`` the samples themselves."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs", type=positive_int, default=runs, help=f"timed {CODE!r} rounds (each {each} once)"
    )
    parser.add_argument("--warmup", type=positive_int, default=warmup, help="untimed rounds first")
    parser.add_argument("--kernel", default="sandboxed-python", help="sandboxed kernelspec")
    parser.add_argument("--baseline", default="python3", help="local kernelspec for the ratios")
    parser.add_argument("--json", action="store_true", help="also print the samples as JSON")
    args = parser.parse_args(argv)
    with workspace() as cwd:
        times = measure(args.kernel, args.baseline, args.runs, args.warmup, cwd)
    print(f"`{CODE}` round trip, {args.runs} rounds, {each}s in turns (load: {os.getloadavg()[0]:.2f})")
    print(format_table(times))
    if args.json:
        print(json.dumps(times))
    return 0


@contextmanager
def workspace() -> Iterator[str]:
    """A temporary working folder the sandboxed kernel (uid 65533 under root) can write to."""
    with tempfile.TemporaryDirectory(prefix="sandbox-kernel-bench-") as path:
        if os.geteuid() == 0:
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
        yield path


def positive_int(text: str) -> int:
    return int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return int_at_least(text, 0)


def int_at_least(text: str, minimum: int) -> int:
    value = int(text)
    if value < minimum:
        msg = f"must be at least {minimum}, got {value}"
        raise argparse.ArgumentTypeError(msg)
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--starts", type=positive_int, default=3, help="kernel starts to time")
    parser.add_argument("--restarts", type=non_negative_int, default=3, help="restarts to time")
    parser.add_argument("--runs", type=positive_int, default=50, help=f"timed {CODE!r} runs")
    parser.add_argument("--warmup", type=non_negative_int, default=5, help=f"untimed {CODE!r} runs first")
    parser.add_argument("--kernel", default="sandboxed-python", help="sandboxed kernelspec")
    parser.add_argument("--baseline", default="python3", help="local kernelspec to compare against")
    parser.add_argument("--pool-size", type=positive_int, default=4, help="pool size for the pooled rows")
    parser.add_argument(
        "--pooled-starts", type=non_negative_int, default=10, help="pooled starts to time (0: skip)"
    )
    parser.add_argument(
        "--at-once", type=non_negative_int, default=10, help="kernels started at once (0: skip)"
    )
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="how long idle CPU is measured")
    parser.add_argument(
        "--runtime",
        default="",
        help="Docker runtime of the sandboxed kernels, e.g. runsc-sandbox-kernel-ptrace",
    )
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.runtime:
        os.environ["SANDBOX_KERNEL_RUNTIME"] = args.runtime
    with workspace() as cwd, tempfile.TemporaryDirectory(prefix="sandbox-kernel-bench-specs-") as specs:
        local = measure(args.baseline, args.starts, args.restarts, args.runs, args.warmup, cwd)
        sandboxed = measure(args.kernel, args.starts, args.restarts, args.runs, args.warmup, cwd)
        if args.pooled_starts:
            pooled = kernelspec_variant(args.kernel, "bench-pool", {"pool_size": args.pool_size}, Path(specs))
            measure_pool(sandboxed, pooled, args.pool_size, args.pooled_starts, cwd)
        if args.at_once:
            asyncio.run(measure_at_once(local, args.baseline, args.at_once, args.idle_seconds, cwd))
            asyncio.run(measure_at_once(sandboxed, args.kernel, args.at_once, args.idle_seconds, cwd))
            if args.pooled_starts:
                asyncio.run(measure_at_once_pooled(sandboxed, pooled, args.at_once, args.pool_size, cwd))

    summaries = {"local": summarize(local), "sandboxed": summarize(sandboxed)}
    headers = (
        f"local ({args.baseline})",
        f"sandboxed ({args.kernel}{', ' + args.runtime if args.runtime else ''})",
    )
    print(
        f"Kernel latency and memory: {args.starts} starts and {args.restarts} restarts each; "
        f"{args.runs} timed runs of {CODE!r} "
        f"after {args.warmup} warm-up runs; pool of {args.pool_size}, {args.pooled_starts} pooled starts; "
        f"N = {args.at_once} kernels at once, idle CPU over {args.idle_seconds:g} s"
    )
    print(format_table(summaries["local"], summaries["sandboxed"], headers))
    if args.json:
        result = {
            "settings": {
                "starts": args.starts,
                "restarts": args.restarts,
                "runs": args.runs,
                "warmup": args.warmup,
                "at_once": args.at_once,
                "idle_seconds": args.idle_seconds,
            },
            "local": {**summaries["local"], "samples": asdict(local)},
            "sandboxed": {**summaries["sandboxed"], "samples": asdict(sandboxed)},
        }
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
