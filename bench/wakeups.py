"""gVisor's floor: what one system call and one wake-up of another thread cost, host vs runsc.

A minimal, self-contained reproduction (the standard library and pyzmq only, so that it runs
with the kernel image's own Python), of the operations a Jupyter round trip is made of:

* ``getpid()``: one system call that does nothing (``os.getpid`` is not cached by glibc);
* ``write(/dev/null)``: one system call on a file descriptor;
* two threads waking each other in turn (a ping-pong, so one round = two wake-ups):
  ``threading.Event``, a pipe, and a ZeroMQ ``inproc`` PAIR socket pair;
* a ZeroMQ REQ/REP round trip over tcp loopback, both ends in one process (the message
  also crosses ZeroMQ's I/O threads, as every kernel message does) and with the REP end in
  another process (as a client and its kernel).

Each figure is the median, over ``--batches`` batches, of one batch's time per operation,
in microseconds.

Run alone (``python bench/wakeups.py --here``) it measures where it runs and prints one
column. Run on the host without ``--here`` (the default) it measures the host and, with
``docker run``, the same file inside the kernel image under each ``--runtime`` (runsc on
systrap, runsc on ptrace), ``--rounds`` times interleaved (host, systrap, ptrace, host,
...), and prints them side by side with their ratios to the host::

    .venv/bin/python bench/wakeups.py
    docker run --rm --runtime runsc-sandbox-kernel --network none --security-opt seccomp=unconfined \\
        -v "$PWD/bench:/bench:ro" sandbox-kernel/python:latest python /bench/wakeups.py --here

(Docker's default seccomp profile, which runsc applies with ``--oci-seccomp``, makes
libzmq's I/O thread abort; the comparison runs with the kernel's own profile, uid and
capabilities.) The "after 2 ms idle" rows are what a kernel pays: between two messages
every thread of it sleeps, and under gVisor waking a thread that slept costs far more than
waking one that has just run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import zmq

IMAGE = "sandbox-kernel/python:latest"
RUNTIMES = ("runsc-sandbox-kernel", "runsc-sandbox-kernel-ptrace")
#: (key, label, operations per round of the timed function): rows of the table, in order.
ROWS = (
    ("getpid", "getpid() system call", "call"),
    ("devnull", "write(2) of 1 byte to /dev/null", "call"),
    ("event", "threading.Event ping-pong between 2 threads", "round (2 wakes)"),
    ("pipe", "pipe ping-pong between 2 threads", "round (2 wakes)"),
    ("inproc", "zmq inproc PAIR ping-pong between 2 threads", "round (2 wakes)"),
    ("tcp_threads", "zmq tcp loopback REQ/REP, 2 threads", "round trip"),
    ("tcp_process", "zmq tcp loopback REQ/REP, 2 processes", "round trip"),
    ("event_idle", "threading.Event ping-pong, after 2 ms idle", "round (2 wakes)"),
    ("inproc_idle", "zmq inproc PAIR ping-pong, after 2 ms idle", "round (2 wakes)"),
    ("tcp_process_idle", "zmq tcp REQ/REP, 2 processes, after 2 ms idle", "round trip"),
    ("ipc_process", "zmq ipc (unix socket) REQ/REP, 2 processes", "round trip"),
    ("ipc_process_idle", "zmq ipc REQ/REP, 2 processes, after 2 ms idle", "round trip"),
)
#: Seconds of quiet before each operation of the "after idle" rows.
IDLE = 0.002


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def per_op_us(run: Callable[[int], None], count: int, batches: int) -> float:
    """Median over ``batches`` of one batch's microseconds per operation (one warm-up batch)."""
    run(max(1, count // 10))
    times = []
    for _ in range(batches):
        started = time.perf_counter()
        run(count)
        times.append((time.perf_counter() - started) / count * 1e6)
    return statistics.median(times)


def after_idle_us(run: Callable[[int], None], count: int, idle: float = IDLE) -> float:
    """Median microseconds of one operation started after ``idle`` seconds of quiet (every
    thread asleep: how a kernel waits for the next request), over ``count`` of them."""
    run(1)
    times = []
    for _ in range(count):
        time.sleep(idle)
        started = time.perf_counter()
        run(1)
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def syscalls(count: int) -> None:
    getpid = os.getpid
    for _ in range(count):
        getpid()


def devnull_writes(fd: int) -> Callable[[int], None]:
    def run(count: int) -> None:
        write = os.write
        for _ in range(count):
            write(fd, b"x")

    return run


class PingPong:
    """A second thread that answers each ping with a pong, for ever (a daemon)."""

    def __init__(
        self,
        ping: Callable[[], None],
        wait_ping: Callable[[], None],
        pong: Callable[[], None],
        wait_pong: Callable[[], None],
    ) -> None:
        self.ping, self.wait_ping, self.pong, self.wait_pong = ping, wait_ping, pong, wait_pong
        threading.Thread(target=self.answer, daemon=True).start()

    def answer(self) -> None:
        while True:
            self.wait_ping()
            self.pong()

    def __call__(self, count: int) -> None:
        for _ in range(count):
            self.ping()
            self.wait_pong()


def event_ping_pong() -> PingPong:
    ping, pong = threading.Event(), threading.Event()

    def wait_ping() -> None:
        ping.wait()
        ping.clear()

    def wait_pong() -> None:
        pong.wait()
        pong.clear()

    return PingPong(ping.set, wait_ping, pong.set, wait_pong)


def pipe_ping_pong() -> PingPong:
    to_thread, from_main = os.pipe()
    to_main, from_thread = os.pipe()
    return PingPong(
        lambda: os.write(from_main, b"."),
        lambda: os.read(to_thread, 1) and None,
        lambda: os.write(from_thread, b"."),
        lambda: os.read(to_main, 1) and None,
    )


def inproc_ping_pong(context: zmq.Context[zmq.Socket[bytes]]) -> PingPong:
    main, thread = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    main.bind("inproc://wakeups")
    thread.connect("inproc://wakeups")
    # Each socket is used by one thread only from here on (the second thread's after start).
    return PingPong(
        lambda: main.send(b"."),
        lambda: thread.recv() and None,
        lambda: thread.send(b"."),
        lambda: main.recv() and None,
    )


def echo_forever(sock: zmq.Socket[bytes]) -> None:
    while True:
        sock.send(sock.recv())


def req_rep(req: zmq.Socket[bytes]) -> Callable[[int], None]:
    def run(count: int) -> None:
        for _ in range(count):
            req.send(b".")
            req.recv()

    return run


def tcp_threads(context: zmq.Context[zmq.Socket[bytes]]) -> Callable[[int], None]:
    rep, req = context.socket(zmq.REP), context.socket(zmq.REQ)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    req.connect(f"tcp://127.0.0.1:{port}")
    threading.Thread(target=echo_forever, args=(rep,), daemon=True).start()
    return req_rep(req)


def echo_process(
    context: zmq.Context[zmq.Socket[bytes]], folder: str
) -> tuple[Callable[[int], None], Callable[[int], None], subprocess.Popen[bytes]]:
    """Round trips to another process: over zmq tcp loopback, and over a zmq ipc (unix)
    socket in ``folder``; and that process."""
    echo = subprocess.Popen(  # noqa: S603 (this very file, as the echo server)
        [sys.executable, os.path.abspath(__file__), "--echo", folder], stdout=subprocess.PIPE
    )
    assert echo.stdout is not None  # noqa: S101 (stdout=PIPE)
    port, path = echo.stdout.readline().split()
    tcp, ipc = context.socket(zmq.REQ), context.socket(zmq.REQ)
    tcp.connect(f"tcp://127.0.0.1:{int(port)}")
    ipc.connect(f"ipc://{path.decode()}")
    return req_rep(tcp), req_rep(ipc), echo


def serve_echo(folder: str) -> int:
    """The other process of ``echo_process``: REP sockets (tcp, ipc in ``folder``) echoing
    until killed."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    tcp, ipc = context.socket(zmq.REP), context.socket(zmq.REP)
    path = os.path.join(folder, "echo")
    ipc.bind(f"ipc://{path}")
    print(tcp.bind_to_random_port("tcp://127.0.0.1"), path, flush=True)
    poller = zmq.Poller()
    poller.register(tcp, zmq.POLLIN)
    poller.register(ipc, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            sock.send(sock.recv())


def measure_here(count: int, batches: int) -> dict[str, float]:
    """Every row's microseconds per operation, in this process."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    devnull = os.open(os.devnull, os.O_WRONLY)
    folder = tempfile.TemporaryDirectory(prefix="wakeups-")
    remote, remote_ipc, echo = echo_process(context, folder.name)
    try:
        event, inproc = event_ping_pong(), inproc_ping_pong(context)
        runs: dict[str, tuple[Callable[[int], None], int]] = {
            "getpid": (syscalls, count * 10),
            "devnull": (devnull_writes(devnull), count * 10),
            "event": (event, count),
            "pipe": (pipe_ping_pong(), count),
            "inproc": (inproc, count),
            "tcp_threads": (tcp_threads(context), count),
            "tcp_process": (remote, count),
            "ipc_process": (remote_ipc, count),
        }
        result = {key: per_op_us(run, n, batches) for key, (run, n) in runs.items()}
        idle_count = max(1, count // 10)
        result["event_idle"] = after_idle_us(event, idle_count)
        result["inproc_idle"] = after_idle_us(inproc, idle_count)
        result["tcp_process_idle"] = after_idle_us(remote, idle_count)
        result["ipc_process_idle"] = after_idle_us(remote_ipc, idle_count)
        return result
    finally:
        echo.kill()
        echo.wait()
        os.close(devnull)
        folder.cleanup()


def where() -> str:
    """'runsc' inside gVisor (its kernel says 4.4.0), else 'host'."""
    return "runsc" if os.uname().release == "4.4.0" else "host"


def docker_options(profile_file: str | None) -> list[str]:
    """The kernel's own hardening: its uid, no capabilities, its seccomp profile (Docker's
    default profile, which runsc applies with --oci-seccomp, makes libzmq's I/O thread
    abort: "Operation not permitted (src/thread.cpp:241)")."""
    seccomp = f"seccomp={profile_file}" if profile_file else "seccomp=unconfined"
    return ["--user", "65533:65533", "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true",
            "--security-opt", seccomp]  # fmt: skip


def kernel_seccomp_file(folder: str) -> str | None:
    """The sandboxed kernel's seccomp profile, written to a file in ``folder`` (None when
    sandbox_kernel is not importable here: then no profile)."""
    try:
        from sandbox_kernel.backends.docker_args import SECCOMP_PROFILE
    except ImportError:
        return None
    path = os.path.join(folder, "seccomp.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(SECCOMP_PROFILE)
    return path


def measure_in_docker(runtime: str, options: list[str], args: argparse.Namespace) -> dict[str, float]:
    folder = os.path.dirname(os.path.abspath(__file__))
    command = ["docker", "run", "--rm", "--runtime", runtime, "--network", "none", *options]
    command += ["-v", f"{folder}:/bench:ro", args.image, "python", "/bench/wakeups.py", "--here", "--json"]
    command += ["--count", str(args.count), "--batches", str(args.batches)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)  # noqa: S603
    if done.returncode != 0:
        msg = f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}"
        raise RuntimeError(msg)
    result: dict[str, float] = json.loads(done.stdout)
    return result


def format_table(columns: dict[str, dict[str, float]]) -> str:
    names = list(columns)
    base = columns[names[0]]
    header = ["operation (µs per)", *names, *(f"{name}/{names[0]}" for name in names[1:])]
    lines = [header]
    for key, label, unit in ROWS:
        values = [f"{columns[name][key]:.2f}" for name in names]
        ratios = [f"{columns[name][key] / base[key]:.1f}x" for name in names[1:]]
        lines.append([f"{label} ({unit})", *values, *ratios])
    widths = [max(len(line[col]) for line in lines) for col in range(len(header))]

    def render(line: list[str]) -> str:
        return "  ".join(
            [line[0].ljust(widths[0]), *(v.rjust(w) for v, w in zip(line[1:], widths[1:], strict=True))]
        )

    return "\n".join([render(lines[0]), "  ".join("-" * w for w in widths), *map(render, lines[1:])])


def median_columns(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    names = list(rounds[0])
    return {
        name: {key: statistics.median(r[name][key] for r in rounds) for key, _, _ in ROWS} for name in names
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--here", action="store_true", help="measure only where this runs")
    parser.add_argument(
        "--json", action="store_true", help="also print the medians as JSON (with --here: only them)"
    )
    parser.add_argument("--echo", metavar="FOLDER", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=2000, help="rounds per batch (system calls: 10x)")
    parser.add_argument("--batches", type=int, default=7, help="timed batches per row")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every column")
    parser.add_argument("--image", default=IMAGE, help="the kernel image to run in")
    parser.add_argument(
        "--runtime", action="append", help=f"Docker runtimes to compare (default: {', '.join(RUNTIMES)})"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.echo:
        return serve_echo(args.echo)
    if args.here:
        result = measure_here(args.count, args.batches)
        print(json.dumps(result) if args.json else format_table({where(): result}))
        return 0
    runtimes = args.runtime or list(RUNTIMES)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="sandbox-kernel-wakeups-") as folder:
        options = docker_options(kernel_seccomp_file(folder))
        for i in range(1, args.rounds + 1):
            columns = {"host": measure_here(args.count, args.batches)}
            for runtime in runtimes:
                columns[column_name(runtime)] = measure_in_docker(runtime, options, args)
            progress(f"round {i}/{args.rounds} done")
            rounds.append(columns)
    print(
        f"One system call and one wake-up, host vs gVisor (runsc {', '.join(runtimes)}): medians of "
        f"{args.rounds} interleaved rounds, each the median of {args.batches} batches of {args.count} "
        f"rounds; load average {os.getloadavg()[0]:.2f} at the end"
    )
    print(format_table(median_columns(rounds)))
    if args.json:
        print(json.dumps(median_columns(rounds)))
    return 0


def column_name(runtime: str) -> str:
    """'systrap' for the default runtime, 'ptrace' for runsc-sandbox-kernel-ptrace."""
    if runtime == RUNTIMES[0]:
        return "systrap"
    return runtime.removeprefix(RUNTIMES[0] + "-") or runtime


if __name__ == "__main__":
    sys.exit(main())
