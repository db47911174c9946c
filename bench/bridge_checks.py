"""What the host's bridge costs a sandboxed kernel's round trip: its checks, toggled on one
kernel between samples, and the bridge's thread timed per round trip.

Every message between clients and a sandboxed kernel crosses the bridge's thread on the
host (``sandbox_kernel/channels/bridge.py``): its signature checked, shown to the auditor
(the audit lines, the wall-clock limit), charged to the output budget and cleaned. This
times ``1+1`` (``execute_interactive``, to the reply and the idle status) on one sandboxed
kernel with the bridge's checks as they run and with parts of them left out, switched
between samples (in an order shuffled per round, so that the machine's load touches all
of them alike), and a local ipykernel as the reference:

* ``all checks``: the bridge as it runs;
* ``no auditor``, ``no output limit``, ``no cleaning``: one check left out;
* ``no checks``: signatures only (and the meter, which bounds whole messages).

Leaving a check out is for measuring only: a kernel's bridge always runs them all. Then
it times the bridge's thread for ``--runs`` more round trips with every check (in turns
with the local kernel's), by the wall clock and by the thread's CPU clock: in the bridge's
handling of each message, in each check, and in its sends alone (pyzmq's, which let go
of the interpreter's lock for each frame, so that the wall-clock time beyond the CPU time
is the thread waiting: for the lock, or for one of the machine's cores). Run from the project root::

    .venv/bin/python bench/bridge_checks.py
    .venv/bin/python bench/bridge_checks.py --runs 1000 --json
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from latency import execute_once, in_turns, in_turns_main, percentile, progress, ratio_table, running_kernel

WAYS = ("local", "all checks", "no auditor", "no output limit", "no cleaning", "no checks")
#: Which of (auditor, output limiter, cleaner) each sandboxed way keeps.
KEPT = {
    "all checks": (True, True, True),
    "no auditor": (False, True, True),
    "no output limit": (True, False, True),
    "no cleaning": (True, True, False),
    "no checks": (False, False, False),
}
#: Filled by measure(): the bridge's thread per round trip (µs), for the table's footer.
THREAD: dict[str, float] = {}


def measure(kernel: str, baseline: str, runs: int, warmup: int, cwd: str) -> dict[str, list[float]]:
    """Milliseconds per way, ``runs`` each, in a shuffled order every round."""
    with ExitStack() as stack:
        progress(f"starting a local {baseline} kernel and a {kernel} kernel")
        local = stack.enter_context(running_kernel(baseline, cwd)).client
        sandboxed = stack.enter_context(running_kernel(kernel, cwd))
        bridge = sandboxed.manager.provisioner.channels.bridge
        checks = (bridge._tap, bridge._limiter, bridge._sanitizer)

        def sample(way: str) -> float:
            if way == "local":
                return execute_once(local)
            bridge._tap, bridge._limiter, bridge._sanitizer = (
                check if kept else None for check, kept in zip(checks, KEPT[way], strict=True)
            )
            return execute_once(sandboxed.client)

        try:
            times = in_turns(sample, WAYS, runs, warmup)
        finally:
            bridge._tap, bridge._limiter, bridge._sanitizer = checks
        progress("timing the bridge's thread")
        with ExitStack() as timing:
            spans = {
                name: timing.enter_context(timed(owner, method))
                for name, owner, method in (
                    ("handling", bridge, "_forward"),
                    ("sending", bridge, "_pass"),
                    ("signatures", bridge, "_check"),
                    ("auditor", bridge, "_tap"),
                    ("output limit", bridge._limiter, "admit"),
                    ("output limit, requests", bridge._limiter, "request"),
                    ("cleaning", bridge._sanitizer, "clean"),
                )
            }
            for _ in range(runs):
                # In turns with the local kernel, as above: the bridge's threads sleep
                # between requests, as they do between a person's.
                execute_once(local)
                execute_once(sandboxed.client)
        for name, (wall, cpu) in spans.items():
            THREAD[f"{name} wall"], THREAD[f"{name} cpu"] = wall / runs * 1e6, cpu / runs * 1e6
        progress("stopping the kernels")
    return times


@contextmanager
def timed(owner: Any, method: str) -> Iterator[list[float]]:
    """[wall, cpu] seconds the bridge's thread spends in ``owner.method`` (a method, or a
    callable the instance holds) while in the block."""
    spent = [0.0, 0.0]
    held = method in vars(owner)  # the bridge's tap: an attribute of the instance
    original: Callable[..., Any] = getattr(owner, method)

    def wrapper(*args: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args)
        finally:
            spent[0] += time.perf_counter() - wall
            spent[1] += time.thread_time() - cpu

    setattr(owner, method, wrapper)
    try:
        yield spent
    finally:
        if held:
            setattr(owner, method, original)
        else:
            delattr(owner, method)  # (the instance's own attribute: the class's method again)


def format_table(times: dict[str, list[float]]) -> str:
    full, bare = percentile(times["all checks"], 50), percentile(times["no checks"], 50)
    footer = [
        f"The checks cost {full - bare:.2f} ms at p50 ({(full - bare) / full:.0%} of the round trip).",
        "The bridge's thread per round trip (every check): handling the messages "
        f"{THREAD['handling wall']:.0f} µs by the wall clock, {THREAD['handling cpu']:.0f} µs of its CPU; "
        "of that, sending them on "
        f"{THREAD['sending wall']:.0f} µs, {THREAD['sending cpu']:.0f} µs of its CPU.",
        "Its CPU per round trip by check: "
        + ", ".join(
            f"{label} {THREAD[f'{name} cpu']:.0f} µs"
            for label, name in (
                ("signatures and replies' routes", "signatures"),
                ("the auditor", "auditor"),
                ("the output limit", "output limit"),
                ("its requests", "output limit, requests"),
                ("cleaning", "cleaning"),
                ("the sends", "sending"),
            )
        )
        + ".",
    ]
    return "\n".join([ratio_table(times, WAYS, "way"), "", *footer])


def main(argv: list[str] | None = None) -> int:
    return in_turns_main(__doc__, measure, format_table, argv, runs=500, warmup=20, each="way")


if __name__ == "__main__":
    sys.exit(main())
