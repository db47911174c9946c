"""What sending IOPub messages from the thread that makes them saves a sandboxed kernel.

Inside the sandbox the kernel's start-up code (``sandbox_kernel/inside/fast_io.py``) sends
each IOPub message (busy, the input, the result, idle) from the thread that makes it when
the IOPub thread has nothing left to do, instead of handing every one to the IOPub thread,
which wakes to send it. This times ``1+1`` (``execute_interactive``, to the reply and the
idle status) on three kernels in one run, one sample of each per round in an order
shuffled per round, so that the machine's load and the kernels' threads falling asleep
between samples touch all three alike:

* ``local``: a local ipykernel (``--baseline``), the reference for the ratios;
* ``sandboxed``: a sandboxed kernel (``--kernel``) as it runs;
* ``sandboxed, handed``: a second one, alike but for ``fast_io.DIRECT_SENDS`` turned off:
  every IOPub message through the IOPub thread, as ipykernel sends them.

Each kernel has one client, so each publishes to one subscriber. Run from the project
root::

    .venv/bin/python bench/iopub_sends.py
    .venv/bin/python bench/iopub_sends.py --runs 500 --json
"""

from __future__ import annotations

import random
import sys
from contextlib import ExitStack

from latency import (
    aligned,
    execute_once,
    in_turns_main,
    percentile,
    progress,
    running_kernel,
)

KERNELS = ("local", "sandboxed", "sandboxed, handed")
#: Run in the second sandboxed kernel: every IOPub message through its IOPub thread.
HAND_EVERY_MESSAGE = "import sys; sys.modules['sandbox_kernel_fast_io'].DIRECT_SENDS = False"


def measure(kernel: str, baseline: str, runs: int, warmup: int, cwd: str) -> dict[str, list[float]]:
    """Milliseconds per kernel, ``runs`` each, in a shuffled order every round."""
    with ExitStack() as stack:
        progress(f"starting a local {baseline} kernel and two {kernel} kernels")
        clients = {
            name: stack.enter_context(running_kernel(spec, cwd)).client
            for name, spec in zip(KERNELS, (baseline, kernel, kernel), strict=True)
        }
        reply = clients["sandboxed, handed"].execute_interactive(HAND_EVERY_MESSAGE, timeout=60)
        if reply["content"]["status"] != "ok":
            msg = f"cannot turn fast_io's direct sends off: {reply['content']}"
            raise RuntimeError(msg)
        for _ in range(warmup):
            for client in clients.values():
                execute_once(client)
        times: dict[str, list[float]] = {name: [] for name in KERNELS}
        order = list(KERNELS)
        for done in range(runs):
            random.shuffle(order)
            for name in order:
                times[name].append(execute_once(clients[name]) * 1000)
            if (done + 1) % 100 == 0:
                progress(f"  {done + 1}/{runs} rounds")
        progress("stopping the kernels")
    return times


def format_table(times: dict[str, list[float]]) -> str:
    local = {pct: percentile(times["local"], pct) for pct in (50, 95)}
    lines: list[tuple[str, ...]] = [("kernel", "p50 ms", "p95 ms", "p50 / local", "p95 / local")]
    for name in KERNELS:
        p50, p95 = percentile(times[name], 50), percentile(times[name], 95)
        lines.append((name, f"{p50:.2f}", f"{p95:.2f}", f"{p50 / local[50]:.2f}x", f"{p95 / local[95]:.2f}x"))
    sandboxed, handed = percentile(times["sandboxed"], 50), percentile(times["sandboxed, handed"], 50)
    footer = (
        f"Sending from the thread that makes each message: {handed - sandboxed:+.2f} ms at p50 "
        f"({(handed - sandboxed) / handed:.0%} of the handed kernel's round trip)"
    )
    return "\n".join([aligned(lines), "", footer])


def main(argv: list[str] | None = None) -> int:
    return in_turns_main(__doc__, measure, format_table, argv, runs=300, warmup=20, each="kernel")


if __name__ == "__main__":
    sys.exit(main())
