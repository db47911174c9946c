"""How many idle sandboxed kernels one host holds: host CPU and memory per idle kernel,
with and without the idle freeze, and one kernel's ``1+1`` among them.

For each count N of ``--counts`` (``max``: as many as the memory left allows, see
below), N sandboxed kernels are started (``--parallel`` at a time, through
``AsyncKernelManager``, as a server starts them) from a variant of the sandboxed
kernelspec with ``freeze_idle_after`` = ``--freeze-after``. Then, over ``--idle-seconds``
each:

* running: right after the start settled, before any is quiet long enough to freeze
  (what every idle kernel costs without the freeze; skipped for counts above
  ``--unfrozen-max``, which would take more cores than the host has);
* frozen: once every one of them is frozen;

host CPU in % of one core per kernel: their containers' cgroups, this process (the
bridges and watchdogs of all of them run here) and Docker's daemons and shims; memory
per kernel: their cgroups' charge and the host's ``MemAvailable`` drop. And ``1+1`` p50 of
one kernel among them (the first request thaws it), against the same kernel's figure
when it was the only one and a local ipykernel's (``--local``), measured in this run.

``max`` is bounded by memory: the host's ``MemAvailable`` less ``--reserve-gib`` (others
work on this machine), divided by what the first kernels took each. Progress goes to
stderr, the table to stdout (``--json``: the raw numbers).

    .venv/bin/python bench/density.py --counts 10,50,max
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jupyter_client import AsyncKernelManager
from latency import kernelspec_variant, sandbox_pid

from sandbox_kernel.host.cgroups import cpu_seconds, memory_usage

SANDBOX_UID = 65533
STARTUP_TIMEOUT = 300


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def process_cpu(names: tuple[str, ...]) -> dict[int, float]:
    """CPU-seconds so far of each process whose name starts with one of ``names``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name.startswith(names):
            fields = stat.rsplit(")", 1)[1].split()
            found[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


def used_since(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU used between two readings: of processes seen at both, and all of those new
    since (one that ended meanwhile, a shim of a removed container, is not known)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


DAEMONS = ("dockerd", "containerd")  # containerd-shim* too


@dataclass
class Row:
    count: int
    start_s: float = 0.0
    #: % of a core per kernel: (sandboxes, this process, Docker's daemons), running and frozen
    cpu_running: tuple[float, float, float] = (float("nan"),) * 3
    cpu_frozen: tuple[float, float, float] = (float("nan"),) * 3
    memory_cgroup_mib: float = float("nan")
    memory_host_mib: float = float("nan")
    one_plus_one_running_ms: float = float("nan")
    one_plus_one_frozen_ms: float = float("nan")
    first_after_thaw_ms: float = float("nan")
    frozen: int = 0
    loads: list[float] = field(default_factory=list)


class Kernels:
    def __init__(self, managers: list[AsyncKernelManager], pids: list[int]) -> None:
        self.managers, self.pids = managers, pids

    def sandbox_cpu(self) -> float:
        return sum(cpu_seconds(pid) or 0.0 for pid in self.pids)

    def memory(self) -> int:
        return sum(memory_usage(pid) or 0 for pid in self.pids)

    def frozen(self) -> int:
        return sum(bool(m.provisioner.watchdog.freezer.frozen) for m in self.managers)


async def start_many(kernel_name: str, count: int, parallel: int, cwd: str) -> Kernels:
    semaphore = asyncio.Semaphore(parallel)

    async def one() -> AsyncKernelManager:
        async with semaphore:
            manager = AsyncKernelManager(kernel_name=kernel_name)
            await manager.start_kernel(cwd=cwd)
            client = manager.client()
            client.start_channels()
            await client.wait_for_ready(timeout=STARTUP_TIMEOUT)
            client.stop_channels()
            return manager

    results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
    managers = [r for r in results if isinstance(r, AsyncKernelManager)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await shutdown_all(managers)
        raise failures[0]
    pids = [await asyncio.to_thread(sandbox_pid, m) for m in managers]
    return Kernels(managers, [p for p in pids if p])


async def shutdown_all(managers: list[AsyncKernelManager]) -> None:
    for start in range(0, len(managers), 16):
        results = await asyncio.gather(
            *(m.shutdown_kernel(now=True) for m in managers[start : start + 16]), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                progress(f"a kernel's shutdown failed: {result!r}")


async def all_frozen(kernels: Kernels, timeout: float) -> int:
    """How many are frozen once all are, or ``timeout`` seconds have passed."""
    for _ in range(int(timeout) + 1):
        if kernels.frozen() == len(kernels.managers):
            break
        await asyncio.sleep(1)
    return kernels.frozen()


async def wake_all(kernels: Kernels) -> None:
    """A client's message to each: all run (thawed) from now on, until quiet again."""
    for manager in kernels.managers:
        client = manager.client()
        client.start_channels()
        try:
            await client.kernel_info(reply=True, timeout=60)
        finally:
            client.stop_channels()


def per_kernel_pct(used: tuple[float, float, float], count: int) -> tuple[float, float, float]:
    sandboxes, here, daemons = (round(100 * part / count, 4) for part in used)
    return sandboxes, here, daemons


async def idle_cpu(kernels: Kernels, seconds: float) -> tuple[float, float, float]:
    """(sandboxes', this process's, Docker's daemons') CPU-seconds per second over
    ``seconds``, all kernels together (the daemons serve every container on the host)."""
    sandboxes, here, daemons = kernels.sandbox_cpu(), time.process_time(), process_cpu(DAEMONS)
    wall = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - wall
    return (
        (kernels.sandbox_cpu() - sandboxes) / elapsed,
        (time.process_time() - here) / elapsed,
        used_since(daemons, process_cpu(DAEMONS)) / elapsed,
    )


async def round_trips(manager: AsyncKernelManager, runs: int) -> tuple[float, float]:
    """(first ``1+1``, p50 of the ``runs`` after it) in ms."""
    client = manager.client()
    client.start_channels()
    try:
        times = []
        for _ in range(runs + 1):
            started = time.perf_counter()
            await client.execute_interactive("1+1", timeout=60, output_hook=lambda msg: None)
            times.append(1000 * (time.perf_counter() - started))
        return times[0], statistics.median(times[1:])
    finally:
        client.stop_channels()


async def measure(kernel_name: str, count: int, args: argparse.Namespace, cwd: str) -> Row:
    row = Row(count)
    available = mem_available()
    started = time.perf_counter()
    progress(f"starting {count} kernels, {args.parallel} at a time")
    kernels = await start_many(kernel_name, count, args.parallel, cwd)
    row.start_s = time.perf_counter() - started
    progress(f"{count} kernels ready after {row.start_s:.0f} s")
    try:
        await asyncio.sleep(3)
        row.memory_cgroup_mib = kernels.memory() / count / 2**20
        row.memory_host_mib = (available - mem_available()) / count / 2**20
        if count <= args.unfrozen_max:
            await wake_all(kernels)  # those started first may be frozen already
            await asyncio.sleep(2)
            used = await idle_cpu(kernels, min(args.idle_seconds, args.freeze_after - 8))
            row.cpu_running = per_kernel_pct(used, count)
            _, row.one_plus_one_running_ms = await round_trips(kernels.managers[0], args.runs)
            progress(f"{count} running: {sum(row.cpu_running):.2f} % of a core each {row.cpu_running}")
        row.frozen = await all_frozen(kernels, args.freeze_after + 120)
        await asyncio.sleep(2)
        row.cpu_frozen = per_kernel_pct(await idle_cpu(kernels, args.idle_seconds), count)
        progress(f"{row.frozen}/{count} frozen: {sum(row.cpu_frozen):.3f} % of a core each {row.cpu_frozen}")
        row.first_after_thaw_ms, row.one_plus_one_frozen_ms = await round_trips(
            kernels.managers[-1], args.runs
        )
        row.loads = [float(x) for x in os.getloadavg()]
    finally:
        await shutdown_all(kernels.managers)
    return row


async def alone(kernel_name: str, runs: int, cwd: str) -> float:
    kernels = await start_many(kernel_name, 1, 1, cwd)
    try:
        await asyncio.sleep(2)
        return (await round_trips(kernels.managers[0], runs))[1]
    finally:
        await shutdown_all(kernels.managers)


def variant(kernel_name: str, freeze_after: float, folder: Path) -> str:
    """A kernelspec like ``kernel_name`` whose kernels freeze after ``freeze_after`` s."""
    return kernelspec_variant(kernel_name, "density", {"freeze_idle_after": freeze_after}, folder)


def table(rows: list[Row], single_ms: float, local_ms: float) -> str:
    """One line per N: % of a core per kernel (sandbox + this process + Docker's daemons)."""
    lines = [
        f"1+1 p50 alone: {single_ms:.1f} ms sandboxed, {local_ms:.1f} ms local ipykernel "
        f"({single_ms / local_ms:.2f}x)",
        "",
        "   N  start  CPU/kernel running (sbx+srv+docker)  frozen (sbx+srv+docker)    MiB/kernel"
        "  1+1 running  1+1 frozen (x alone)  first  frozen  load",
    ]
    for r in rows:
        run, frz = r.cpu_running, r.cpu_frozen
        lines.append(
            f"{r.count:4d}  {r.start_s:4.0f}s  {sum(run):6.2f}% ({run[0]:.2f}+{run[1]:.2f}+{run[2]:.2f})"
            f"        {sum(frz):6.3f}% ({frz[0]:.3f}+{frz[1]:.3f}+{frz[2]:.3f})"
            f"  {r.memory_cgroup_mib:4.0f} ({r.memory_host_mib:4.0f} host)"
            f"  {r.one_plus_one_running_ms:8.1f} ms  {r.one_plus_one_frozen_ms:6.1f} ms"
            f" ({r.one_plus_one_frozen_ms / single_ms:.2f})  {r.first_after_thaw_ms:4.0f} ms"
            f"  {r.frozen}/{r.count}  {r.loads[0] if r.loads else float('nan'):.1f}"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="sandbox-kernel-density-") as kernelspecs:
        folder = Path(kernelspecs)
        return await _measure_all(args, variant(args.kernel, args.freeze_after, folder))


async def _measure_all(args: argparse.Namespace, name: str) -> int:
    with tempfile.TemporaryDirectory(prefix="sandbox-kernel-bench-") as cwd:
        if os.geteuid() == 0:
            os.chown(cwd, SANDBOX_UID, SANDBOX_UID)
        local_ms = await alone(args.local, args.runs, cwd)
        single_ms = await alone(name, args.runs, cwd)
        progress(f"1+1 alone: sandboxed {single_ms:.1f} ms, local {local_ms:.1f} ms")
        rows: list[Row] = []
        per_kernel = 0.0
        for text in args.counts.split(","):
            if text == "max":
                room = mem_available() - args.reserve_gib * 2**30
                count = int(room / (per_kernel or 120 * 2**20))
                progress(f"max: {room / 2**30:.1f} GiB to use, {per_kernel / 2**20:.0f} MiB each: {count}")
            else:
                count = int(text)
            if count < 1:
                continue
            row = await measure(name, count, args, cwd)
            per_kernel = max(per_kernel, row.memory_host_mib * 2**20, row.memory_cgroup_mib * 2**20)
            rows.append(row)
    print(table(rows, single_ms, local_ms))
    if args.json:
        print(json.dumps({"single_ms": single_ms, "local_ms": local_ms, "rows": [asdict(r) for r in rows]}))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernel", default="sandboxed-python")
    parser.add_argument("--local", default="python3", help="the local ipykernel's kernelspec")
    parser.add_argument("--counts", default="10,50,max")
    parser.add_argument("--parallel", type=int, default=6, help="kernels started at a time")
    parser.add_argument("--freeze-after", type=float, default=30.0, help="the variant's freeze_idle_after")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=30, help="1+1 round trips per figure")
    parser.add_argument("--unfrozen-max", type=int, default=50, help="largest N measured running")
    parser.add_argument("--reserve-gib", type=float, default=6.0, help="memory left to others")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
