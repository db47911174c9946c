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
* execute round trip: ``client.execute_interactive("1+1")``, i.e. from sending the
  ``execute_request`` until both the ``execute_reply`` and the ``idle`` status on
  IOPub have arrived, ``--runs`` times after ``--warmup`` untimed runs, on one kernel
  (p50 and p95).

* host memory of one kernel, idle and after ``import pandas`` (install pandas where the
  local kernel runs, e.g. ``.venv/bin/pip install pandas``, or that row reads nan): for the local kernel
  its process's PSS (``/proc/PID/smaps_rollup``); for the sandboxed one everything its
  container's memory cgroup is charged (guest memory, gVisor's sentry and gofer, page
  cache): under gVisor the guest's memory lives in a memory file that no host process's
  RSS/PSS reflects, so the cgroup is the honest figure of what the host pays.

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
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import docker
from jupyter_client import KernelManager
from jupyter_client.blocking import BlockingKernelClient

from sandbox_kernel.cgroups import memory_usage
from sandbox_kernel.policy import DEFAULT_KERNEL_UID

STARTUP_TIMEOUT = 120.0  # seconds for one kernel to become ready
EXECUTE_TIMEOUT = 30.0  # seconds for one `1+1` round trip
SANDBOX_UID = DEFAULT_KERNEL_UID  # the uid the sandboxed kernel runs as when we are root
CODE = "1+1"


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
    execute_ms: list[float] = field(default_factory=list)
    memory_idle_mib: float = math.nan
    memory_pandas_mib: float = math.nan


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def running_kernel(kernel_name: str, cwd: str) -> Iterator[StartedKernel]:
    """Start a kernel, wait until it is ready, and always shut it down afterwards."""
    manager = KernelManager(kernel_name=kernel_name, client_factory=StampedClient)
    client: StampedClient | None = None
    started = time.perf_counter()
    try:
        manager.start_kernel(cwd=cwd)
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


def measure(kernel_name: str, starts: int, restarts: int, runs: int, warmup: int, cwd: str) -> Timings:
    timings = Timings(kernel_name)
    for i in range(1, starts + 1):
        with running_kernel(kernel_name, cwd) as kernel:
            timings.kernel_info_s.append(kernel.kernel_info_s)
            timings.ready_s.append(kernel.ready_s)
            progress(
                f"[{kernel_name}] start {i}/{starts}: kernel_info reply after "
                f"{kernel.kernel_info_s:.3f} s, ready after {kernel.ready_s:.3f} s"
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
        timings.memory_idle_mib = host_memory_mib(kernel.manager)
        reply = kernel.client.execute_interactive(
            "import pandas", timeout=EXECUTE_TIMEOUT, output_hook=ignore_output
        )
        if reply["content"]["status"] == "ok":
            timings.memory_pandas_mib = host_memory_mib(kernel.manager)
        else:
            progress(f"[{kernel_name}] pandas is not installed for this kernel: no 'with pandas' figure")
    progress(
        f"[{kernel_name}] host memory: {timings.memory_idle_mib:.1f} MiB idle, "
        f"{timings.memory_pandas_mib:.1f} MiB with pandas"
    )
    progress(
        f"[{kernel_name}] execute: p50 {percentile(timings.execute_ms, 50):.2f} ms, "
        f"p95 {percentile(timings.execute_ms, 95):.2f} ms"
    )
    return timings


def restart_once(kernel: StartedKernel) -> float:
    """Seconds from restart_kernel() to the new kernel's first kernel_info reply."""
    client = kernel.client
    started = time.perf_counter()
    kernel.manager.restart_kernel()
    client.kernel_info_reply_at = None
    client.wait_for_ready(timeout=STARTUP_TIMEOUT)
    return (client.kernel_info_reply_at or time.perf_counter()) - started


def host_memory_mib(manager: KernelManager) -> float:
    """What the host pays for the kernel now: the sandbox's cgroup, or the local process's PSS."""
    container_id = getattr(manager.provisioner, "container_id", None)
    if container_id is not None:
        client = docker.from_env()
        try:
            pid = client.api.inspect_container(container_id)["State"]["Pid"]
        finally:
            client.close()
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


def percentile(values: list[float], pct: float) -> float:
    """Linearly interpolated percentile (numpy's default method)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * pct / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(t: Timings) -> dict[str, float]:
    return {
        "kernel_info_median_s": statistics.median(t.kernel_info_s),
        "kernel_info_max_s": max(t.kernel_info_s),
        "ready_median_s": statistics.median(t.ready_s),
        "ready_max_s": max(t.ready_s),
        "restart_median_s": statistics.median(t.restart_s) if t.restart_s else math.nan,
        "restart_max_s": max(t.restart_s) if t.restart_s else math.nan,
        "execute_p50_ms": percentile(t.execute_ms, 50),
        "execute_p95_ms": percentile(t.execute_ms, 95),
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
    ("execute_p50_ms", f"execute {CODE!r} round trip, p50", "ms"),
    ("execute_p95_ms", f"execute {CODE!r} round trip, p95", "ms"),
    ("memory_idle_mib", "host memory, idle kernel", "MiB"),
    ("memory_pandas_mib", "host memory, after import pandas", "MiB"),
)


def format_table(local: dict[str, float], sandboxed: dict[str, float], headers: tuple[str, str]) -> str:
    def cell(value: float, unit: str) -> str:
        return (
            f"{value:.3f} {unit}"
            if unit == "s"
            else f"{value:.1f} {unit}"
            if unit == "MiB"
            else f"{value:.2f} {unit}"
        )

    lines = [("metric", *headers, "ratio sandboxed/local")]
    for key, label, unit in ROWS:
        ratio = sandboxed[key] / local[key] if local[key] else math.nan
        lines.append((label, cell(local[key], unit), cell(sandboxed[key], unit), f"{ratio:.2f}x"))
    widths = [max(len(line[col]) for line in lines) for col in range(4)]

    def render(line: tuple[str, ...]) -> str:
        label, *values = line
        cells = [v.rjust(w) for v, w in zip(values, widths[1:], strict=True)]
        return "  ".join([label.ljust(widths[0]), *cells])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(lines[0]), rule, *(render(line) for line in lines[1:])])


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
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with workspace() as cwd:
        local = measure(args.baseline, args.starts, args.restarts, args.runs, args.warmup, cwd)
        sandboxed = measure(args.kernel, args.starts, args.restarts, args.runs, args.warmup, cwd)

    summaries = {"local": summarize(local), "sandboxed": summarize(sandboxed)}
    headers = (f"local ({args.baseline})", f"sandboxed ({args.kernel})")
    print(
        f"Kernel latency and memory: {args.starts} starts and {args.restarts} restarts each; "
        f"{args.runs} timed runs of {CODE!r} "
        f"after {args.warmup} warm-up runs"
    )
    print(format_table(summaries["local"], summaries["sandboxed"], headers))
    if args.json:
        result = {
            "settings": {
                "starts": args.starts,
                "restarts": args.restarts,
                "runs": args.runs,
                "warmup": args.warmup,
            },
            "local": {**summaries["local"], "samples": asdict(local)},
            "sandboxed": {**summaries["sandboxed"], "samples": asdict(sandboxed)},
        }
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
