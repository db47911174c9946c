"""What libzmq's I/O thread costs a kernel's messages, host vs gVisor.

Every ZeroMQ socket hands what it sends to libzmq's I/O thread, which writes it to the
connection, and takes what arrives from that thread, which read it: one hand-off between
threads each way, which gVisor makes dear when the I/O thread has slept (``wakeups.py``).
This measures what those hand-offs cost a kernel's round trip, with nothing of Jupyter's:
a server process (the standard library and pyzmq only, so that it runs with the kernel
image's own Python) that, on each request from a client on the host, sends five
messages of seven frames (what a kernel sends for a ``1+1``: ``busy``, ``execute_input``,
``execute_result``, the reply, ``idle``), each after 0.1 ms of work. The request reaches it,
and its messages leave it, by one of two ways:

* **libzmq**: a PULL socket for the request, a PUSH socket for the messages (libzmq's I/O
  thread between the server's thread and the unix socket, as in a kernel);
* **its own socket**: the server's thread reads the request from a unix socket itself and
  writes each message to one, in ZeroMQ's wire format (ZMTP 3.0 frames after a greeting
  written by hand, so that the host's side is still a libzmq PULL socket);
* and out, **its own, the reply by libzmq**: the fourth message (a kernel's reply, on
  another channel than its IOPub messages) by libzmq, the others on its own socket.

The five combinations run in a server on the host and in one in the kernel image under
runsc (the kernel's uid, capabilities and seccomp profile, as ``wakeups.py``), one sample
of each of the ten in an order shuffled per round, each after ``--idle`` seconds of
quiet; the table has the round trip's p50 and p95 in milliseconds. The hand-written side is
for measuring only: it is not a ZeroMQ socket (one peer, no subscriptions, no high-water
mark).

    .venv/bin/python bench/zmq_io_thread.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import zmq
from wakeups import IMAGE, RUNTIMES, docker_options, kernel_seccomp_file, progress

#: The ways in and out, in the table's order: (the request's way in, the messages' way out).
WAYS = (("libzmq", "libzmq"), ("libzmq", "own"), ("libzmq", "mixed"), ("own", "libzmq"), ("own", "own"))
#: The round trips in milliseconds, by (place, way in, way out).
Samples = dict[tuple[str, str, str], list[float]]
LABELS = {"libzmq": "libzmq's I/O thread", "own": "its own socket", "mixed": "its own, the reply by libzmq"}
#: Messages per request, and the frames of each (a Jupyter message's sizes, roughly).
MESSAGES = 5
#: Which of them is the reply (the others are IOPub's): the "mixed" way sends it by libzmq.
REPLY = 3
FRAMES = (b"x" * 40, b"<IDS|MSG>", b"a" * 64, b"{}" * 100, b"{}" * 40, b"{}", b"{}")
#: ZMTP 3.0's greeting with the NULL mechanism, as a server that does not care who is which.
GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)
READY = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
#: Requests: which way the messages go out, or stop.
OUT = {"libzmq": b"z", "own": b"o", "mixed": b"m"}
WAY_OUT = {request: way for way, request in OUT.items()}
STOP = b"q"


def by_libzmq(way_out: str, n: int) -> bool:
    """Whether message ``n`` (from 0) of a request answered ``way_out`` goes by libzmq."""
    return way_out == "libzmq" or (way_out == "mixed" and n == REPLY)


def recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            msg = "the peer closed the connection"
            raise EOFError(msg)
        data += more
    return data


def read_frame(conn: socket.socket) -> tuple[int, bytes]:
    """One ZMTP frame: its flags and body."""
    flags = recv_exact(conn, 1)[0]
    size = struct.unpack(">Q", recv_exact(conn, 8))[0] if flags & 0x02 else recv_exact(conn, 1)[0]
    return flags, recv_exact(conn, size)


def frame(body: bytes, flags: int) -> bytes:
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body


def message(frames: tuple[bytes, ...]) -> bytes:
    """One ZMTP message: every frame but the last has MORE (0x01)."""
    return b"".join(frame(part, 0x01 if i < len(frames) - 1 else 0) for i, part in enumerate(frames))


def accept_zmtp_peer(listener: socket.socket) -> socket.socket:
    """Accept one libzmq peer and greet it as a PUSH socket."""
    conn, _ = listener.accept()
    try:
        conn.sendall(GREETING)
        recv_exact(conn, len(GREETING))
        conn.sendall(frame(READY, 0x04))
        read_frame(conn)  # the peer's READY
    except BaseException:
        conn.close()
        raise
    return conn


def busy(seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


def serve(folder: str, work: float) -> int:
    """The server: answers each request on either way in, by either way out, until STOP."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with ExitStack() as held:
        held.callback(context.destroy, linger=0)
        zmq_in = context.socket(zmq.PULL)
        zmq_in.bind(f"ipc://{folder}/zmq-in")
        zmq_out = context.socket(zmq.PUSH)
        zmq_out.bind(f"ipc://{folder}/zmq-out")
        listeners = {}
        for name in ("own-in", "own-out"):
            listeners[name] = held.enter_context(socket.socket(socket.AF_UNIX))
            listeners[name].bind(f"{folder}/{name}")
            listeners[name].listen(1)
        with open(f"{folder}/ready", "w", encoding="utf-8"):
            pass
        own_in = held.enter_context(listeners["own-in"].accept()[0])
        own_out = held.enter_context(accept_zmtp_peer(listeners["own-out"]))
        poller = zmq.Poller()
        poller.register(zmq_in, zmq.POLLIN)
        poller.register(own_in, zmq.POLLIN)
        wire = message(FRAMES)
        while True:
            ready = dict(poller.poll())
            try:
                request = zmq_in.recv() if zmq_in in ready else read_frame(own_in)[1]
            except EOFError:  # the client is gone: its STOP may still be on its way
                break
            if request == STOP:
                break
            way_out = WAY_OUT[request]
            for n in range(MESSAGES):
                busy(work)
                if by_libzmq(way_out, n):
                    zmq_out.send_multipart(FRAMES)
                else:
                    own_out.sendall(wire)
    return 0


class Client:
    """The host's side of one server: sends a request one way, reads the five messages."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], folder: str) -> None:
        self.zmq_in = context.socket(zmq.PUSH)
        self.zmq_in.connect(f"ipc://{folder}/zmq-in")
        self.own_in = socket.socket(socket.AF_UNIX)
        self.own_in.connect(f"{folder}/own-in")
        self.out = {way: context.socket(zmq.PULL) for way in ("libzmq", "own")}
        self.out["libzmq"].connect(f"ipc://{folder}/zmq-out")
        self.out["own"].connect(f"ipc://{folder}/own-out")

    def sample(self, way_in: str, way_out: str) -> float:
        """One round trip, in milliseconds."""
        start = time.perf_counter()
        if way_in == "libzmq":
            self.zmq_in.send(OUT[way_out])
        else:
            self.own_in.sendall(frame(OUT[way_out], 0))
        for n in range(MESSAGES):
            self.out["libzmq" if by_libzmq(way_out, n) else "own"].recv_multipart()
        return (time.perf_counter() - start) * 1e3

    def stop(self) -> None:
        self.zmq_in.send(STOP)
        self.own_in.close()


@contextmanager
def server(place: str, folder: str, args: argparse.Namespace) -> Iterator[Client]:
    """A server on the host (place 'host') or under a Docker runtime, and its client."""
    serve_args = ["--serve", folder, "--work", str(args.work)]
    name = f"sandbox-kernel-zmq-io-{uuid.uuid4().hex[:8]}"
    if place == "host":
        command = [sys.executable, os.path.abspath(__file__), *serve_args]
    else:
        options = docker_options(kernel_seccomp_file(folder))
        bench = os.path.dirname(os.path.abspath(__file__))
        command = ["docker", "run", "--rm", "--name", name, "--runtime", place, "--network", "none", *options,
                   "-v", f"{folder}:{folder}", "-v", f"{bench}:/bench:ro", args.image,
                   "python", "/bench/zmq_io_thread.py", *serve_args]  # fmt: skip
    process = subprocess.Popen(command)  # noqa: S603
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client: Client | None = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{folder}/ready"):
            if process.poll() is not None or time.monotonic() > deadline:
                msg = f"the server did not start: {' '.join(command)}"
                raise RuntimeError(msg)
            time.sleep(0.05)
        client = Client(context, folder)
        yield client
        client.stop()
        process.wait(timeout=30)
    finally:
        if client is not None:
            client.own_in.close()  # (closed already after a stop)
        if process.poll() is None:
            process.kill()
            if place != "host":
                subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)  # noqa: S603, S607
        context.destroy(linger=0)


def measure(args: argparse.Namespace) -> Samples:
    places = ["host", args.runtime]
    samples: Samples = {(p, i, o): [] for p in places for i, o in WAYS}
    with tempfile.TemporaryDirectory(prefix="sandbox-kernel-zmq-io-") as top:
        folders = {place: os.path.join(top, str(n)) for n, place in enumerate(places)}
        for folder in folders.values():
            os.mkdir(folder)
            os.chmod(folder, 0o777)  # noqa: S103 (the server runs as the kernel's uid)
        with ExitStack() as stack:
            clients = {place: stack.enter_context(server(place, folders[place], args)) for place in places}
            keys = list(samples)
            for n in range(args.warmup + args.rounds):
                random.shuffle(keys)
                for place, way_in, way_out in keys:
                    time.sleep(args.idle)
                    ms = clients[place].sample(way_in, way_out)
                    if n >= args.warmup:
                        samples[place, way_in, way_out].append(ms)
                if (n + 1) % 100 == 0:
                    progress(f"round {n + 1}/{args.warmup + args.rounds}")
    return samples


def report(samples: Samples, runtime: str, args: argparse.Namespace) -> str:
    # latency.py's percentile, which readme.py reads these samples with (imported here: it
    # needs the host's packages, and the server's side of this file runs in the kernel image).
    from latency import percentile

    def p50(place: str, way: tuple[str, str]) -> float:
        return percentile(samples[(place, *way)], 50)

    header = ["way in; way out", "host p50", "host p95", "gVisor p50", "gVisor p95", "gVisor/host p50"]
    lines = [header]
    for way in WAYS:
        host, box = samples[("host", *way)], samples[(runtime, *way)]
        lines.append([
            f"{LABELS[way[0]]}; {LABELS[way[1]]}",
            *(f"{percentile(v, pct):.2f}" for v in (host, box) for pct in (50, 95)),
            f"{percentile(box, 50) / percentile(host, 50):.2f}x",
        ])  # fmt: skip
    widths = [max(len(line[col]) for line in lines) for col in range(len(header))]

    def render(line: list[str]) -> str:
        cells = zip(line[1:], widths[1:], strict=True)
        return "  ".join([line[0].ljust(widths[0]), *(value.rjust(width) for value, width in cells)])

    both, none = WAYS[0], WAYS[-1]
    saved = {place: p50(place, both) - p50(place, none) for place in ("host", runtime)}
    saved_in = p50(runtime, both) - p50(runtime, ("own", "libzmq"))
    saved_out = p50(runtime, both) - p50(runtime, ("libzmq", "own"))
    return "\n".join([
        f"A request and {MESSAGES} messages, {args.rounds} rounds, the {2 * len(WAYS)} ways in turns, "
        f"each after {args.idle * 1e3:g} ms quiet ({runtime}; load: {os.getloadavg()[0]:.2f}), ms",
        render(lines[0]),
        "  ".join("-" * w for w in widths),
        *map(render, lines[1:]),
        "",
        f"The server's thread on its own sockets saves {saved[runtime]:.2f} ms at p50 under gVisor (the "
        f"way in {saved_in:.2f} ms, the way out {saved_out:.2f} ms) and {saved['host']:.2f} ms on the host.",
        f"With only the reply sent by libzmq, a round trip takes {p50(runtime, ('libzmq', 'mixed')):.2f} ms "
        f"at p50 under gVisor, against {p50(runtime, both):.2f} ms with every message sent by libzmq.",
    ])  # fmt: skip


def as_json(samples: Samples, runtime: str) -> dict[str, dict[str, list[float]]]:
    """The samples by place ("host", "gvisor"), then by way ("IN OUT", e.g. "libzmq own")."""
    places = {"host": "host", runtime: "gvisor"}
    return {
        name: {f"{way_in} {way_out}": samples[place, way_in, way_out] for way_in, way_out in WAYS}
        for place, name in places.items()
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=300, help="samples of each way and place")
    parser.add_argument("--warmup", type=int, default=20, help="rounds left out first")
    parser.add_argument("--idle", type=float, default=0.005, help="seconds of quiet before each sample")
    parser.add_argument("--work", type=float, default=0.0001, help="seconds of work before each message")
    parser.add_argument("--image", default=IMAGE, help="the kernel image to run in")
    parser.add_argument("--runtime", default=RUNTIMES[0], help="the Docker runtime (runsc) to compare")
    parser.add_argument("--json", action="store_true", help="also print the samples as JSON")
    parser.add_argument("--serve", metavar="FOLDER", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args.serve, args.work)
    samples = measure(args)
    print(report(samples, args.runtime, args))
    if args.json:
        print(json.dumps(as_json(samples, args.runtime)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
