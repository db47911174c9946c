"""Pausing a sandboxed kernel to disk and resuming it, against a local ipykernel.

For each size (default 100 MiB and 1024 MiB) a kernel builds that much of live Python
objects (a list of random floats: ``[random.random() for _ in range(n)]``, 32 bytes
each), then:

* pause: ``provisioner.pause()`` (the relay lets go of its host sockets, runsc saves
  the gVisor sandbox, memory included, and stops it), in seconds; the image's size on
  disk; the host memory the kernel's cgroup held before, and after (none: stopped);
* resume to first reply: a client sends ``print(len(data))`` to the paused kernel (the
  bridge holds it and resumes the kernel) until the reply, in seconds; against the same
  cell on a running local ipykernel holding the same objects (the ratio column);
* where the pause and the resume go: ``runsc checkpoint`` writing the image, Docker
  seeing the sandbox stopped, ``docker start --checkpoint`` (runsc restoring the sandbox,
  its memory read back from the image), and the rest up to the reply (the relay binding
  its sockets again, the bridge passing the request on, the kernel answering);
* the alternative without pausing: a local kernel started afresh and the objects built
  again (what a restart costs a user whose kernel was stopped to free memory).

Progress goes to stderr, the table (and, with ``--json``, the numbers) to stdout. Run
from the project root, as root on a host set up by ``bash .ci/setup`` (Docker's
experimental mode)::

    .venv/bin/python bench/pause.py
    .venv/bin/python bench/pause.py --sizes 100 --repeat 3 --json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from coldstart import timed_methods
from jupyter_client import KernelManager
from jupyter_client.blocking import BlockingKernelClient
from jupyter_core.utils import run_sync
from latency import host_memory_mib, ignore_output, progress, workspace
from traitlets.config import Config

TIMEOUT = 600.0
BUILD = "import random\ndata = [random.random() for _ in range({n})]"
CHECK = "print(len(data))"


@dataclass
class Sample:
    size_mib: int
    build_s: list[float] = field(default_factory=list)
    pause_s: list[float] = field(default_factory=list)
    image_mib: list[float] = field(default_factory=list)
    memory_before_mib: list[float] = field(default_factory=list)
    memory_paused_mib: list[float] = field(default_factory=list)
    resume_reply_s: list[float] = field(default_factory=list)
    local_reply_s: list[float] = field(default_factory=list)
    local_rebuild_s: list[float] = field(default_factory=list)
    steps_s: dict[str, list[float]] = field(default_factory=dict)


@contextmanager
def kernel(name: str, cwd: str, memory_mib: int) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    config = Config({"SandboxProvisioner": {"memory": f"{memory_mib}m"}})
    manager = KernelManager(kernel_name=name, config=config)
    manager.start_kernel(cwd=cwd)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def timed(client: BlockingKernelClient, code: str) -> float:
    started = time.perf_counter()
    reply = client.execute_interactive(code, timeout=TIMEOUT, output_hook=ignore_output)
    if reply["content"]["status"] != "ok":
        msg = f"{code!r} failed: {reply['content']}"
        raise RuntimeError(msg)
    return time.perf_counter() - started


def measure(sandboxed: str, local: str, size_mib: int, repeat: int, cwd: str) -> Sample:
    sample = Sample(size_mib)
    build = BUILD.format(n=size_mib * 2**20 // 32)
    memory_mib = 2 * size_mib + 1024  # the objects, the list's growth, the interpreter
    for i in range(1, repeat + 1):
        with kernel(sandboxed, cwd, memory_mib) as (manager, client):
            sample.build_s.append(timed(client, build))
            sample.memory_before_mib.append(host_memory_mib(manager))
            marks: dict[str, float] = {}
            with timed_methods(STEPS, marks):
                started = time.perf_counter()
                paused = run_sync(manager.provisioner.pause)()
                sample.pause_s.append(time.perf_counter() - started)
                sample.image_mib.append((paused.size or 0) / 2**20)
                stopped = manager.provisioner.paused is not None  # its container (and cgroup): gone
                sample.memory_paused_mib.append(0.0 if stopped else host_memory_mib(manager))
                sent = time.perf_counter()
                sample.resume_reply_s.append(timed(client, CHECK))
            note_steps(sample, marks, sent + sample.resume_reply_s[-1])
        progress(
            f"[{size_mib} MiB, {i}/{repeat}] pause {sample.pause_s[-1]:.2f} s, "
            f"image {sample.image_mib[-1]:.0f} MiB, resume -> reply {sample.resume_reply_s[-1]:.2f} s"
        )
        with kernel(local, cwd, memory_mib) as (manager, client):
            started = time.perf_counter()
            manager.restart_kernel(now=True)
            client.wait_for_ready(timeout=120)
            timed(client, build)
            sample.local_rebuild_s.append(time.perf_counter() - started)
            sample.local_reply_s.append(timed(client, CHECK))
    return sample


#: The backend's steps of a pause and a resume, timed (DockerBackend's methods).
STEPS = ("_run_runsc_checkpoint", "_wait_stopped", "restore")
STEP_ROWS = {
    "_run_runsc_checkpoint": "pause: runsc checkpoint writes the image",
    "_wait_stopped": "pause: Docker sees the sandbox stopped",
    "restore": "resume: docker start --checkpoint (runsc restore)",
    "rest": "resume: relay binds again, request passed on, reply",
}


def note_steps(sample: Sample, marks: dict[str, float], replied: float) -> None:
    for name in STEPS:
        if f"{name} end" in marks:
            sample.steps_s.setdefault(name, []).append(marks[f"{name} end"] - marks[f"{name} begin"])
    if "restore end" in marks:
        sample.steps_s.setdefault("rest", []).append(replied - marks["restore end"])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def format_table(samples: list[Sample], repeat: int) -> str:
    lines = [(f"metric (median of {repeat})", "local ipykernel", "sandboxed", "ratio sandboxed/local")]
    for s in samples:
        size = f"{s.size_mib} MiB of objects"
        reply, local = median(s.resume_reply_s), median(s.local_reply_s)
        lines += [
            (f"{size}: build them", "", f"{median(s.build_s):.2f} s", ""),
            (f"{size}: host memory before pause", "", f"{median(s.memory_before_mib):.0f} MiB", ""),
            (f"{size}: pause (save + stop)", "", f"{median(s.pause_s):.2f} s", ""),
            (
                f"{size}: pause, per GiB held",
                "",
                f"{median(s.pause_s) * 1024 / s.size_mib:.2f} s",
                "",
            ),
            *(
                (f"{size}: {STEP_ROWS[name]}", "", f"{median(found):.2f} s", "")
                for name, found in s.steps_s.items()
            ),
            (f"{size}: image on disk", "", f"{median(s.image_mib):.0f} MiB", ""),
            (f"{size}: host memory while paused", "", f"{median(s.memory_paused_mib):.0f} MiB", ""),
            (
                f"{size}: paused -> first reply",
                f"{local:.3f} s (running)",
                f"{reply:.3f} s",
                f"{reply / local:.0f}x",
            ),
            (
                f"{size}: restart + rebuild (no pause)",
                f"{median(s.local_rebuild_s):.2f} s",
                f"{reply:.2f} s (resume)",
                f"{reply / median(s.local_rebuild_s):.2f}x",
            ),
        ]
    widths = [max(len(line[col]) for line in lines) for col in range(4)]
    rendered = []
    for label, *cells in lines:
        aligned = [cell.rjust(width) for cell, width in zip(cells, widths[1:], strict=True)]
        rendered.append("  ".join([label.ljust(widths[0]), *aligned]))
    rendered.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(rendered)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1024], help="MiB of live objects")
    parser.add_argument("--repeat", type=int, default=1, help="kernels paused and resumed per size")
    parser.add_argument("--kernel", default="sandboxed-python", help="sandboxed kernelspec")
    parser.add_argument("--baseline", default="python3", help="local kernelspec to compare against")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with workspace() as cwd:
        samples = [measure(args.kernel, args.baseline, size, args.repeat, cwd) for size in args.sizes]
    print(f"Pausing to disk and resuming: {args.repeat} kernel(s) per size; {args.kernel} vs {args.baseline}")
    print(format_table(samples, args.repeat))
    if args.json:
        result: dict[str, Any] = {"samples": [asdict(s) for s in samples]}
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
