"""Every benchmark behind the README's "Speed and cost" in one run, and that section
written from it.

The scripts run one after another, each with ``--json`` (nothing else should run on the
machine meanwhile): ``latency.py`` (starts, restarts, the pool, ``1+1`` one kernel at a
time, printing, memory, idle CPU), ``agents.py`` (the session API and MCP),
``kernel_choices.py`` (``1+1`` with kernels in turns), ``roundtrip.py`` (where the round
trip goes), ``bridge_checks.py`` (the host's checks), ``coldstart.py`` (where a cold start
goes), ``wakeups.py`` (gVisor's floor), ``zmq_io_thread.py`` (what libzmq's I/O thread
costs a kernel's messages) and ``density.py`` (idle kernels by the hundred).
Every figure of the section then comes from this run, each ratio from two kernels
measured in it. ``--record`` keeps each script's own tables (a page of the docs);
``--write`` replaces the README's section between its two markers (checked before anything
runs). If a script fails, or a figure was not measured (nan), nothing is written and the
command says which and exits 1.

Run as root from the project root, on a host set up by ``bash .ci/setup`` (about
25 minutes on 2 cores; ``--quick``, fewer samples and density at 10 kernels only, about 7;
``--results`` keeps the numbers after each script, ``--from-results`` writes from them
again without running anything)::

    .venv/bin/python bench/readme.py --write README.md --record docs/benchmarks-run.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from latency import percentile as p
from latency import progress
from roundtrip_once import parts

HERE = Path(__file__).resolve().parent
BEGIN = "<!-- speed: written by bench/readme.py, do not edit by hand -->"
END = "<!-- speed: end -->"


@dataclass(frozen=True)
class Step:
    name: str
    args: tuple[str, ...]
    quick: tuple[str, ...]


STEPS = (
    Step("latency", (), ("--starts", "2", "--restarts", "2", "--pooled-starts", "4", "--at-once", "4")),
    Step("agents", ("--runs", "150"), ("--runs", "30")),
    Step("kernel_choices", ("--runs", "300"), ("--runs", "40")),
    Step("roundtrip", ("--rounds", "150", "--batch", "1"), ("--rounds", "20", "--batch", "1")),
    Step("bridge_checks", ("--runs", "500"), ("--runs", "60")),
    Step("coldstart", ("--rounds", "3"), ("--rounds", "1")),
    Step("wakeups", (), ("--rounds", "1", "--batches", "3")),
    Step("zmq_io_thread", ("--rounds", "300"), ("--rounds", "40")),
    Step("density", ("--counts", "10,50,max"), ("--counts", "10", "--idle-seconds", "10")),
)


class StepFailed(Exception):
    pass


def run_step(step: Step, quick: bool) -> tuple[str, Any]:
    """The script's tables (what it prints before its JSON) and its JSON."""
    command = [sys.executable, str(HERE / f"{step.name}.py"), *(step.quick if quick else step.args), "--json"]
    progress(f"== {step.name}: {' '.join(command[1:])}")
    started = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)  # noqa: S603
    if done.returncode != 0:
        msg = f"bench/{step.name}.py exited with {done.returncode} (its messages are above)"
        raise StepFailed(msg)
    progress(f"== {step.name} took {time.monotonic() - started:.0f} s")
    return split_output(step.name, done.stdout)


def split_output(name: str, printed: str) -> tuple[str, Any]:
    """What a script printed: its tables, then its JSON, the rest of its output."""
    lines = printed.splitlines()
    for at, line in enumerate(lines):
        if line.startswith(("{", "[")):
            try:
                return "\n".join(lines[:at]).rstrip(), json.loads("\n".join(lines[at:]))
            except json.JSONDecodeError:
                continue  # a table's line that looks like JSON: the JSON comes later
    msg = f"bench/{name}.py printed no JSON at the end of its output"
    raise StepFailed(msg)


def x(ratio: float, digits: int = 2) -> str:
    return f"{ratio:.{digits}f}x"


def us(value: float) -> str:
    """Microseconds, to as many places as mean something."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def render(results: dict[str, Any], when: str, loads: dict[str, float]) -> str:
    """The README's section (between the markers) from the scripts' JSON; ``loads``: the
    load average at the end of each script. A figure that was not measured reads nan."""
    lat_l, lat_s = results["latency"]["local"], results["latency"]["sandboxed"]
    agents = results["agents"]
    turns = results["kernel_choices"]
    trip = results["roundtrip"]
    checks = results["bridge_checks"]
    cold = results["coldstart"]
    floor = results["wakeups"]
    density = results["density"]

    keys = ("kernel_info_median_s", "restart_median_s", "shutdown_median_s")

    def start_cells(s: dict[str, float]) -> str:
        return "; ".join(f"{s[key]:.2f} s" for key in keys)

    starts = "; ".join(x(lat_s[k] / lat_l[k]) for k in keys)
    raw = p(agents["sandboxed raw"], 50)  # the same kernel by jupyter_client, in turns with the others
    session, mcp = p(agents["SandboxSession.run"], 50) - raw, p(agents["MCP run_code"], 50) - raw
    plain, mcp_floor = p(agents["MCP run_code, plain client"], 50) - raw, p(agents["MCP empty tool"], 50)
    t_local, t_sand = turns["local"], turns["sandboxed"]
    t_sub = turns["sandboxed, subshells started"]
    queued = turns.get("sandboxed, replies queued")  # (none in a run kept from before it)
    replies_says = (
        f"The kernel sending each `ok` reply as it makes it, not after its `idle`, saves "
        f"{p(queued, 50) - p(t_sand, 50):.1f} ms at p50 (`kernel_choices.py`, against a kernel of the same "
        "run with its replies queued). "
        if queued
        else ""
    )
    rows = density["rows"]
    # The most kernels measured both running and all frozen (density.py measures "running"
    # only up to its --unfrozen-max); without one, nan: nothing is written.
    both = [r for r in rows if r["frozen"] == r["count"] and not math.isnan(r["cpu_running"][0])]
    nan = float("nan")
    at: dict[str, Any] = both[-1] if both else {"count": 0, "cpu_running": [nan], "cpu_frozen": [nan]}
    biggest = rows[-1]
    local_n = results["latency"]["settings"]["at_once"]
    local_idle = lat_l["idle_cpu_pct"] / local_n
    alone = biggest["one_plus_one_frozen_ms"] / density["single_ms"]
    table = [
        "| | local ipykernel | sandboxed | ratio |",
        "|---|---|---|---|",
        "| start -> first `kernel_info` reply; restart -> the same; `shutdown_kernel()` "
        f"| {start_cells(lat_l)} | {start_cells(lat_s)} | {starts} |",
        f"| start claimed from the warm pool (narrowed, or with `env`: "
        f"{lat_s['pooled_narrowed_p50_s'] * 1000:.0f}, {lat_s['pooled_env_p50_s'] * 1000:.0f} ms) "
        f"| (cold {lat_l['kernel_info_median_s']:.2f} s) | {lat_s['pooled_p50_s']:.3f} s "
        f"| {x(lat_s['pooled_p50_s'] / lat_l['kernel_info_median_s'])} |",
        "| `1+1` round trip, p50 / p95, one kernel at a time (`latency.py`, not in turns) "
        f"| {lat_l['execute_p50_ms']:.1f} / {lat_l['execute_p95_ms']:.1f} ms "
        f"| {lat_s['execute_p50_ms']:.1f} / {lat_s['execute_p95_ms']:.1f} ms "
        f"| {x(lat_s['execute_p50_ms'] / lat_l['execute_p50_ms'])} / "
        f"{x(lat_s['execute_p95_ms'] / lat_l['execute_p95_ms'])} |",
        "| `1+1`, kernels in turns (`kernel_choices.py`), p50 / p95: as started; once a client "
        f"asked for a subshell | {p(t_local, 50):.1f} / {p(t_local, 95):.1f} ms "
        f"| {p(t_sand, 50):.1f} / {p(t_sand, 95):.1f} ms; {p(t_sub, 50):.1f} / {p(t_sub, 95):.1f} ms "
        f"| {x(p(t_sand, 50) / p(t_local, 50))} / {x(p(t_sand, 95) / p(t_local, 95))}; "
        f"{x(p(t_sub, 50) / p(t_local, 50))} / {x(p(t_sub, 95) / p(t_local, 95))} |",
        f"| a cell printing 100,000 lines | {lat_l['prints_s']:.2f} s | {lat_s['prints_s']:.2f} s "
        f"| {x(lat_s['prints_s'] / lat_l['prints_s'])} |",
        '| `SandboxSession.run("1+1")`, MCP `run_code` (the `mcp` package\'s client, whose own '
        f"floor is {mcp_floor:.1f} ms; a plain JSON-RPC client), p50, against raw `jupyter_client` "
        f"on the same kernel in turns ({raw:.1f} ms) | | raw {session:+.1f} ms, raw {mcp:+.1f} ms; "
        f"raw {plain:+.1f} ms | |",
        f"| host memory, idle kernel | {lat_l['memory_idle_mib']:.0f} MiB "
        f"| {lat_s['memory_idle_mib']:.0f} MiB | {x(lat_s['memory_idle_mib'] / lat_l['memory_idle_mib'])} |",
        f"| host CPU per idle kernel (local: {local_n} kernels; sandboxed: {at['count']}, frozen after "
        f"30 s quiet, before it {sum(at['cpu_running']):.1f} %) | {local_idle:.2f} % "
        f"| {sum(at['cpu_frozen']):.2f} % of a core | |",
        f"| {biggest['count']} idle kernels on this machine "
        f"| | {max(biggest['memory_host_mib'], biggest['memory_cgroup_mib']):.0f} MiB of host memory each; "
        f"one kernel's `1+1` among them (the others frozen) {x(alone)} its figure alone | |",
    ]

    def trip50(way: str, part: str = "total") -> float:
        """The p50 of one part of roundtrip.py's samples of ``way`` (a run kept from before
        the way in was measured has none of it, nor of the way out: nan)."""
        split = [
            parts(s) if len(s) > 2 else {"total": s[0], "kernel": s[1], "in": nan, "out": nan}
            for s in trip[way]
        ]
        return p([sample[part] for sample in split], 50)

    local_t, bridge_t, inside = trip50("local"), trip50("bridge"), trip50("inside")
    straight, bare, meter = (trip50(way) for way in ("relay", "bare", "meter"))
    kernel_more = trip50("bridge", "kernel") - trip50("local", "kernel")
    in_more, out_more = (trip50("bridge", part) - trip50("local", part) for part in ("in", "out"))
    floor_in, floor_out = (trip50("relay", part) - trip50("local", part) for part in ("in", "out"))
    kernel_says = (
        f"{kernel_more:.1f} ms more than locally (what its threads' hand-offs cost: `kernel_choices.py`)"
        if kernel_more >= 0.05
        else f"{-kernel_more:.1f} ms less than locally (waits of ipykernel's that the sandboxed kernel's "
        "start-up code leaves out)"
        if kernel_more <= -0.05
        else "as long as locally"
    )
    checks_ms = p(checks["all checks"], 50) - p(checks["no checks"], 50)
    docker_true = statistics.median(cold["rows"]["docker run --rm IMAGE true"]["runsc"])
    imports = cold["rows"]["import ipykernel.kernelapp, timed inside"]
    argv = cold["rows"]["kernelspec argv run directly (VS Code) -> kernel_info reply"]
    gvisor = "systrap" if "systrap" in floor else next(name for name in floor if name != "host")
    floor_rows = (
        ("a system call (`getpid`)", "getpid"),
        ("two threads waking each other, busy (`threading.Event`, a round of 2 wakes)", "event"),
        ("the same after 2 ms idle (how a kernel's threads wait for a message)", "event_idle"),
        ("a ZeroMQ hand-off between two threads and back, after 2 ms idle", "inproc_idle"),
        ("a ZeroMQ round trip between two processes, after 2 ms idle", "tcp_process_idle"),
    )
    io_thread = results.get("zmq_io_thread")  # (none in a run kept from before it)
    io_thread_says = ""
    if io_thread:

        def hand(place: str, way: str) -> float:
            return p(io_thread[place][way], 50)

        saved = {place: hand(place, "libzmq libzmq") - hand(place, "own own") for place in ("gvisor", "host")}
        mixed, every = hand("gvisor", "libzmq mixed"), hand("gvisor", "libzmq libzmq")
        io_thread_says = (
            "One of them each way is libzmq's I/O thread, between a kernel's thread and its sockets: a "
            "stand-in server sending a `1+1`'s five messages (`zmq_io_thread.py`) answers "
            f"{saved['gvisor']:.2f} ms sooner under gVisor when its thread reads and writes its "
            f"sockets itself ({saved['host']:.2f} ms sooner on the host); with its IOPub messages on its "
            f"own socket and only its reply left to libzmq it takes {mixed:.2f} ms, against {every:.2f} ms "
            f"with every message through libzmq"
            f"{': the one hand-off left pays the whole wake' if mixed >= every else ''}. "
        )
    wake = [
        "| operation | host | gVisor | ratio |",
        "|---|---:|---:|---:|",
        *(
            f"| {label} | {us(floor['host'][key])} | {us(floor[gvisor][key])} "
            f"| {x(floor[gvisor][key] / floor['host'][key], 1)} |"
            for label, key in floor_rows
        ),
    ]
    text = [
        f"Measured on this project's {os.cpu_count()}-core machine in one run of `bench/readme.py` "
        f"({when}; ratios against a local ipykernel of the same run). Every table of that run:",
        "[the last run](docs/benchmarks-run.md); how each is taken: [benchmarks](docs/benchmarks.md).",
        "",
        *table,
        "",
        "Where the round trip goes, in that run (`roundtrip.py`: one kernel reached six ways, one sample "
        "of each in turns, split by the kernel's own clock): of the "
        f"{bridge_t - local_t:.1f} ms over a local kernel ({bridge_t:.1f} against {local_t:.1f} ms), "
        f"ipykernel's own handling is {kernel_says}; the way in, from the client's request to the "
        f"kernel's `busy`, is {in_more:.1f} ms more than locally, and the way out, from the kernel's `idle` "
        f"until the client has it and the reply, {out_more:.1f} ms more. With nothing of the host's between "
        f"a client and the sandbox's sockets, the same kernel takes {straight:.1f} ms "
        f"({x(straight / local_t)} local; the way in {floor_in:+.1f} ms, the way out {floor_out:+.1f} ms): "
        "the sandbox's own floor. "
        "Through a bare byte relay on the host, "
        f"the least an observer outside the sandbox can add, it takes {bare:.1f} ms; through the bridge's "
        f"meter alone {meter:.1f} ms; the rest is the bridge's own sockets and checks (signatures, audit, "
        f"output limit, cleaning: {checks_ms:.2f} ms of a round trip, `bridge_checks.py`). A client inside "
        f"the sandbox on the kernel's own ports, which pays gVisor's wake-ups itself, takes {inside:.1f} ms. "
        f"{replies_says}A cold start is "
        f"Docker and runsc starting a sandbox ({docker_true:.2f} s) and Python importing ipykernel "
        f"through gVisor's file system ({statistics.median(imports['runsc']):.1f} s against "
        f"{statistics.median(imports['host']):.1f} s on the host, `coldstart.py`): the warm pool is the "
        "way around it. A front end that runs the kernelspec's argv itself (VS Code) has its first reply "
        f"after {statistics.median(argv['runsc']):.1f} s ({statistics.median(argv['host']):.1f} s for a "
        "local kernel).",
        "",
        "The sandbox's part of the gap is gVisor's own floor, shown without Jupyter by a minimal "
        "reproduction, `wakeups.py`: the same operations on the host and in the kernel image under runsc "
        f"({gvisor}), microseconds per operation (load {loads.get('wakeups', nan):.1f} at its end: a "
        "busier host makes gVisor's system calls and wakes dearer, and the host's less so):",
        "",
        *wake,
        "",
        "Waking a thread that slept is what gVisor makes dear, and a `1+1` is a dozen such wakes "
        f"(client, bridge, the kernel's threads, and back). {io_thread_says}Pinning a sandbox to one core, "
        "ptrace and KVM (it does not start on this VM) do not help: "
        "[gVisor's floor](docs/benchmarks.md#gvisors-floor-a-system-call-and-a-wake-up).",
    ]
    return "\n".join(text)


def replace_section(readme: str, section: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?\n" + re.escape(END), re.DOTALL)
    if len(pattern.findall(readme)) != 1:
        msg = f"the README must hold the section's markers once each:\n{BEGIN}\n{END}"
        raise ValueError(msg)
    return pattern.sub(lambda _: f"{BEGIN}\n{section}\n{END}", readme)


def record(tables: dict[str, str], when: str, loads: dict[str, float]) -> str:
    parts = [
        "# The last benchmark run",
        "",
        f'Every table of the run behind the README\'s "Speed and cost" ({when}), as each script',
        "printed it: `.venv/bin/python bench/readme.py --write README.md --record docs/benchmarks-run.md`.",
        "What each measures and how: [Benchmarks](benchmarks.md).",
    ]
    for name, printed in tables.items():
        load = f" (load {loads[name]:.1f} at its end)" if name in loads else ""
        parts += ["", f"## `bench/{name}.py`{load}", "", "```", printed, "```"]
    return "\n".join(parts) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--write", type=Path, metavar="README", help="replace the section in this file")
    parser.add_argument("--record", type=Path, metavar="PAGE", help="write every script's tables here")
    parser.add_argument("--quick", action="store_true", help="fewer samples, density up to 10 kernels")
    parser.add_argument("--results", type=Path, metavar="JSON", help="keep the run's numbers and tables here")
    parser.add_argument(
        "--from-results", type=Path, metavar="JSON", help="run nothing: write from a run kept with --results"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0 and not args.from_results:
        progress("run as root (coldstart.py saves a checkpoint with runsc, as the backend does)")
        return 2
    readme = None
    if args.write:  # before 25 minutes of benchmarks, not after
        try:
            readme = args.write.read_text()
            replace_section(readme, "")
        except (OSError, ValueError) as bad:
            progress(f"error: cannot write the section into {args.write}: {bad}")
            return 2
    if args.from_results:
        kept = json.loads(args.from_results.read_text())
        when, tables, results, loads = kept["when"], kept["tables"], kept["results"], kept["loads"]
    else:
        began = datetime.datetime.now().astimezone()
        before = os.getloadavg()[0]
        tables, results, loads = {}, {}, {}
        for step in STEPS:
            try:
                tables[step.name], results[step.name] = run_step(step, args.quick)
            except StepFailed as failed:
                progress(f"error: {failed}; nothing written")
                return 1
            loads[step.name] = os.getloadavg()[0]
            quick = ", --quick" if args.quick else ""
            when = (
                f"{began:%Y-%m-%d %H:%M}-{datetime.datetime.now().astimezone():%H:%M}, load {before:.1f} "
                f"before it, {min(loads.values()):.1f}-{max(loads.values()):.1f} at the ends of its "
                f"scripts{quick}"
            )
            if args.results:  # after each script: what ran is kept if a later one fails
                kept = {"when": when, "tables": tables, "results": results, "loads": loads}
                args.results.write_text(json.dumps(kept))
    try:
        section = render(results, when, loads)
    except (KeyError, IndexError, ZeroDivisionError) as missing:
        progress(f"error: a script's results lack {missing!r}; nothing written")
        return 1
    if "nan" in section.lower():
        progress(f"{section}\nerror: some figures were not measured (nan, above); nothing written")
        return 1
    print(section)
    if args.record:
        args.record.write_text(record(tables, when, loads))
        progress(f"wrote every table to {args.record}")
    if args.write and readme is not None:
        args.write.write_text(replace_section(readme, section))
        progress(f"wrote the section of {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
