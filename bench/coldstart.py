"""Where a sandboxed kernel's cold start goes, step by step, against the host (issue 25).

Each round measures every step once, in turn (host, then runsc, then runc), so that a
busy machine weighs on all of them alike; the table gives medians and ratios to the local
ipykernel's start (``start_kernel()`` to its first ``kernel_info`` reply), measured in the
same run:

* ``docker run --rm --network none IMAGE true``: the container alone (runsc; runc only
  for the account: the provisioner never falls back to it);
* ``python -c pass`` and ``python -c "import ipykernel.kernelapp"``, on the host (this
  interpreter) and in a container of the image (wall clock, and the import timed inside);
* the local kernel's start, and the sandboxed kernel's (no pool), split into our steps:
  the checks of runtime and image, the workspace, the container's create and start
  (Docker), and the rest (in the sandbox: Python, ipykernel's imports, the kernel and its
  relay binding their sockets; then the bridge and the first reply);
* the kernelspec's argv run directly, as VS Code and other front ends that ignore
  provisioners start a kernel (the sandboxed one's is the launcher, a fresh process that
  imports sandbox_kernel first), to its first ``kernel_info`` reply, local and sandboxed;
* a ready kernel restored from a prepared checkpoint (``docker start --checkpoint``, our
  uncompressed runsc image) to its first output, against a cold ``docker start`` of the
  same container to the same point: whether a prepared checkpoint would beat a cold start
  with the installed runsc;
* once: ``python -X importtime`` under runsc (the imports that cost most), and how many
  file system calls the import makes on the host (``strace -c``, where strace is
  installed: under gVisor each first lookup of a path is a call to the gofer).

The runsc in use is reported (``runsc --version``), with whether its ``restore`` offers
``--background`` (release-20240930.0 and later: the application runs while its pages
load); Docker 20.10's runc shim passes no such flag, see docs/benchmarks.md.

Run as root from the project root, on a host set up by ``bash .ci/setup``::

    .venv/bin/python bench/coldstart.py
    .venv/bin/python bench/coldstart.py --rounds 5 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import docker
from jupyter_client import BlockingKernelClient
from jupyter_client.connect import write_connection_file
from jupyter_client.kernelspec import KernelSpecManager
from latency import progress, running_kernel, workspace

from sandbox_kernel.backends.docker import DockerBackend

IMAGE = "sandbox-kernel/python:latest"
RUNTIME = "runsc-sandbox-kernel"
IMPORT = "import ipykernel.kernelapp"
TIMED_IMPORT = f"import time; t = time.perf_counter(); {IMPORT}; print(time.perf_counter() - t)"
#: A kernel's interpreter made ready (ipykernel imported, an IPython shell that has run a
#: cell), saying when it is, and again when its clock jumps (it was saved and restored).
#: Not a whole IPKernelApp: its ZeroMQ threads cannot start under Docker's default
#: seccomp profile, which the kernel's container does not use.
READY_KERNEL = """
import threading, time
import ipykernel.kernelapp
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("1+1", silent=True)
print("ready", flush=True)
last = time.time()
while True:
    time.sleep(0.005)
    now = time.time()
    if now - last > 0.3:
        print("resumed", flush=True)
    last = now
"""
#: Backend calls of a sandboxed start, timed as steps (in this order).
START_STEPS = ("check_runtime", "check_image", "prepare_workspace", "create")

Rows = defaultdict[str, dict[str, list[float]]]


def timed_run(argv: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=True)  # noqa: S603 (our own argv)
    return time.perf_counter() - started, done.stdout


def in_container(runtime: str, image: str, *argv: str) -> list[str]:
    return ["docker", "run", "--rm", "--runtime", runtime, "--network", "none", image, *argv]


def runsc_facts(runtime: str) -> dict[str, Any]:
    """The runsc behind ``runtime``: its version, and whether restore offers --background."""
    info = docker.from_env().info()
    path = str(((info.get("Runtimes") or {}).get(runtime) or {}).get("path") or "runsc")
    said = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)  # noqa: S603
    version = said.stdout.split("\n")[0]
    helped = subprocess.run([path, "restore", "--help"], capture_output=True, text=True, check=False)  # noqa: S603
    return {"runsc": version, "restore_background": "-background" in helped.stdout + helped.stderr}


def process_round(rows: Rows, image: str, runtime: str, runc: bool) -> None:
    """One sample of each process-level step: host, runsc, runc."""
    runtimes = [("runsc", runtime)] + ([("runc", "runc")] if runc else [])
    for label, rt in runtimes:
        rows["docker run --rm IMAGE true"].setdefault(label, []).append(
            timed_run(in_container(rt, image, "true"))[0]
        )
    for code, row in (("pass", "python -c pass"), (IMPORT, f"python -c {IMPORT!r}")):
        rows[row].setdefault("host", []).append(timed_run([sys.executable, "-c", code])[0])
        for label, rt in runtimes:
            rows[row].setdefault(label, []).append(
                timed_run(in_container(rt, image, "python", "-c", code))[0]
            )
    row = f"{IMPORT}, timed inside"
    rows[row].setdefault("host", []).append(float(timed_run([sys.executable, "-c", TIMED_IMPORT])[1]))
    for label, rt in runtimes:
        out = timed_run(in_container(rt, image, "python", "-c", TIMED_IMPORT))[1]
        rows[row].setdefault(label, []).append(float(out))


@contextmanager
def timed_methods(names: tuple[str, ...], marks: dict[str, float]) -> Iterator[None]:
    """Note in ``marks`` when each of DockerBackend's methods ``names`` begins and ends
    (the last call's), for the while."""
    originals = {name: getattr(DockerBackend, name) for name in names}

    def timing(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        async def timed_call(*args: Any, **kwargs: Any) -> Any:
            marks[f"{name} begin"] = time.perf_counter()
            try:
                return await call(*args, **kwargs)
            finally:
                marks[f"{name} end"] = time.perf_counter()

        return timed_call

    for name, call in originals.items():
        setattr(DockerBackend, name, timing(name, call))
    try:
        yield
    finally:
        for name, call in originals.items():
            setattr(DockerBackend, name, call)


def kernel_round(rows: Rows, kernel: str, baseline: str, cwd: str) -> None:
    """One local and one sandboxed start (no pool), the sandboxed one in steps."""
    with running_kernel(baseline, cwd) as local:
        rows["kernel start -> kernel_info reply"].setdefault("host", []).append(local.kernel_info_s)
    marks: dict[str, float] = {}
    with timed_methods(START_STEPS, marks):
        started = time.perf_counter()
        with running_kernel(kernel, cwd) as sandboxed:
            reply = started + sandboxed.kernel_info_s
    rows["kernel start -> kernel_info reply"].setdefault("runsc", []).append(sandboxed.kernel_info_s)
    previous = started
    for name in START_STEPS:
        if f"{name} end" in marks:
            rows[f"  sandboxed start: up to {name} done"].setdefault("runsc", []).append(
                marks[f"{name} end"] - previous
            )
            previous = marks[f"{name} end"]
    rows["  sandboxed start: container started -> kernel_info reply"].setdefault("runsc", []).append(
        reply - previous
    )
    rows[ARGV_ROW].setdefault("host", []).append(argv_start_s(baseline, cwd))
    rows[ARGV_ROW].setdefault("runsc", []).append(argv_start_s(kernel, cwd))


ARGV_ROW = "kernelspec argv run directly (VS Code) -> kernel_info reply"


def argv_start_s(kernel_name: str, cwd: str) -> float:
    """Seconds from running the kernelspec's argv (as VS Code and other front ends that
    ignore provisioners do: for a sandboxed kernelspec, the launcher, a fresh process that
    imports sandbox_kernel first) to its first ``kernel_info`` reply; then shut it down."""
    spec = KernelSpecManager().get_kernel_spec(kernel_name)
    with tempfile.TemporaryDirectory(prefix="sandbox-kernel-bench-argv-") as folder:
        connection_file = os.path.join(folder, "kernel.json")
        write_connection_file(connection_file)
        argv = [a.replace("{connection_file}", connection_file) for a in spec.argv]
        if argv[0] == "python":
            argv[0] = sys.executable
        client = BlockingKernelClient(connection_file=connection_file)
        client.load_connection_file()
        started = time.perf_counter()
        process = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: S603
        try:
            client.start_channels()
            deadline = started + 120
            while True:  # no manager: ask until a reply comes (its heartbeat starts late)
                msg_id = client.kernel_info()
                with contextlib.suppress(queue.Empty):
                    while client.get_shell_msg(timeout=0.25)["parent_header"].get("msg_id") != msg_id:
                        pass
                    break
                if process.poll() is not None or time.perf_counter() > deadline:
                    msg = f"{kernel_name}: its argv exited ({process.returncode}) or gave no reply"
                    raise RuntimeError(msg)
            took = time.perf_counter() - started
            client.shutdown()
            process.wait(timeout=60)
            return took
        finally:
            client.stop_channels()
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=60)


def _log_has(log_path: Path, word: str, after: int) -> bool:
    try:
        with log_path.open("rb") as f:
            f.seek(after)
            return word.encode() in f.read()
    except OSError:
        return False


def _wait_log(log_path: Path, word: str, after: int, timeout: float = 120) -> float:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if _log_has(log_path, word, after):
            return time.perf_counter()
        time.sleep(0.002)
    msg = f"no {word!r} in {log_path} within {timeout} s"
    raise RuntimeError(msg)


def checkpoint_round(rows: Rows, image: str, runtime: str) -> None:
    """A ready kernel's container: restored from its checkpoint, against started cold."""
    client = docker.from_env()
    backend = DockerBackend()
    argv = ["python", "-c", READY_KERNEL]
    cold = client.containers.create(image, argv, runtime=runtime, network_mode="none", user="65533")
    warm = client.containers.create(image, argv, runtime=runtime, network_mode="none", user="65533")
    try:
        warm.start()
        log = Path(client.api.inspect_container(warm.id)["LogPath"])
        _wait_log(log, "ready", 0)
        asyncio.run(backend.checkpoint(warm.id, "prepared"))
        size = log.stat().st_size
        started = time.perf_counter()
        asyncio.run(backend.restore(warm.id, "prepared"))
        returned = time.perf_counter()
        first = _wait_log(log, "resumed", size)
        rows["ready kernel: restore prepared checkpoint -> first output"].setdefault("runsc", []).append(
            first - started
        )
        rows["  docker start --checkpoint returned"].setdefault("runsc", []).append(returned - started)
        started = time.perf_counter()
        cold.start()
        first = _wait_log(Path(client.api.inspect_container(cold.id)["LogPath"]), "ready", 0)
        rows["ready kernel: docker start (cold) -> ready"].setdefault("runsc", []).append(first - started)
    finally:
        for container in (cold, warm):
            asyncio.run(backend.remove(container.id))


def import_account(image: str, runtime: str, top: int) -> dict[str, Any]:
    """``python -X importtime`` of ipykernel.kernelapp under runsc and on the host: the
    modules whose own import costs most (µs), and the file system calls on the host."""
    account: dict[str, Any] = {}
    for where, argv in (
        ("runsc", in_container(runtime, image, "python", "-X", "importtime", "-c", IMPORT)),
        ("host", [sys.executable, "-X", "importtime", "-c", IMPORT]),
    ):
        done = subprocess.run(argv, capture_output=True, text=True, check=True)  # noqa: S603
        selfs: dict[str, int] = {}
        for line in done.stderr.splitlines():
            found = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
            if found:
                selfs[found[4]] = int(found[1])
        account[where] = {"modules": len(selfs), "self_us": sum(selfs.values()), "by_module": selfs}
    slowest = sorted(account["runsc"]["by_module"].items(), key=lambda item: -item[1])[:top]
    account["slowest"] = [(name, us, account["host"]["by_module"].get(name)) for name, us in slowest]
    strace = shutil.which("strace")
    if strace:
        done = subprocess.run(  # noqa: S603 (strace of this interpreter)
            [strace, "-f", "-c", "-e", "trace=%file,getdents64", sys.executable, "-c", IMPORT],
            capture_output=True,
            text=True,
        )
        calls = [line.split() for line in done.stderr.splitlines() if re.match(r"\s*\d+\.\d+\s", line)]
        account["host_file_calls"] = {
            row[-1]: int(row[3]) for row in calls if len(row) >= 5 and row[-1] != "total"
        }
    return account


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def format_table(rows: Rows, rounds: int) -> str:
    local = median(rows["kernel start -> kernel_info reply"].get("host", []))
    lines = [(f"step (median of {rounds}, seconds)", "host", "runsc", "runc", "runsc / local kernel start")]
    for step, found in rows.items():
        cells = [f"{median(found[k]):.3f}" if k in found else "" for k in ("host", "runsc", "runc")]
        ratio = f"{median(found['runsc']) / local:.2f}x" if "runsc" in found and local > 0 else ""
        lines.append((step, *cells, ratio))
    widths = [max(len(line[col]) for line in lines) for col in range(5)]
    rendered = [
        "  ".join(
            [line[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True))]
        )
        for line in lines
    ]
    rendered.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(rendered)


def format_imports(account: dict[str, Any]) -> str:
    lines = [
        f"python -X importtime -c {IMPORT!r}: {account['runsc']['modules']} modules, "
        f"{account['runsc']['self_us'] / 1e6:.2f} s under runsc, "
        f"{account['host']['self_us'] / 1e6:.2f} s on the host",
        "  slowest under runsc (own time): "
        + ", ".join(
            f"{name} {us / 1000:.0f} ms (host {(host or 0) / 1000:.0f})"
            for name, us, host in account["slowest"]
        ),
    ]
    calls = account.get("host_file_calls")
    if calls:
        total = sum(calls.values())
        top = ", ".join(f"{name} {n}" for name, n in sorted(calls.items(), key=lambda item: -item[1])[:6])
        lines.append(f"  file system calls of the import on the host: {total} ({top})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="samples of each step, interleaved")
    parser.add_argument("--image", default=IMAGE)
    parser.add_argument("--runtime", default=RUNTIME, help="the Docker runtime of the sandboxed kernel")
    parser.add_argument("--no-runc", action="store_true", help="leave out the runc rows")
    parser.add_argument("--kernel", default="sandboxed-python", help="sandboxed kernelspec")
    parser.add_argument("--baseline", default="python3", help="local kernelspec to compare against")
    parser.add_argument("--top", type=int, default=8, help="slowest imports to list")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        progress("run as root: the prepared checkpoint is saved with runsc itself, as the backend does")
        return 2
    facts = runsc_facts(args.runtime)
    rows: Rows = defaultdict(dict)
    with workspace() as cwd:
        for i in range(1, args.rounds + 1):
            process_round(rows, args.image, args.runtime, not args.no_runc)
            kernel_round(rows, args.kernel, args.baseline, cwd)
            checkpoint_round(rows, args.image, args.runtime)
            progress(f"round {i}/{args.rounds} done; load {os.getloadavg()[0]:.2f}")
    account = import_account(args.image, args.runtime, args.top)
    print(
        f"Cold start, step by step: {args.rounds} round(s), interleaved; {facts['runsc']}, "
        f"restore --background {'offered' if facts['restore_background'] else 'not offered'}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(format_table(rows, args.rounds))
    print(format_imports(account))
    if args.json:
        print(json.dumps({"facts": facts, "rows": rows, "imports": account}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
