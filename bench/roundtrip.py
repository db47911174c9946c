"""Where a sandboxed kernel's ``1+1`` round trip goes: the same kernel reached at each
stretch of its path, interleaved in one run, against a local ipykernel.

A client's message to a sandboxed kernel crosses, in turn: the host's bridge (in the
client's process for a ``KernelManager``, signatures checked, output budgeted) and the
host-facing ipc sockets in the launch folder: shell's and IOPub's held by the kernel
itself, the other three by the channel relay inside the sandbox (the kernel's parent),
which passes their bytes on to the kernel's tcp ports on the sandbox's loopback. This
measures ``execute_interactive('1+1')`` (from the ``execute_request`` sent until its reply
and the ``idle`` status are in) six ways:

* ``local``: a local ipykernel, as the baseline;
* ``bridge``: the sandboxed kernel as every client reaches it (bridge -> the launch
  folder's sockets -> kernel);
* ``meter``: the same kernel from a host client on the sockets of the bridge's meter,
  which reads the frames' headers of what the kernel sends and holds each message until
  its last frame is in (the bridge's own sockets and checks left out);
* ``relay``: the same kernel from a host client connected straight to the launch folder's
  ipc sockets (the bridge left out: the difference to ``bridge`` is the bridge's);
* ``bare``: the same host client through the least an observer on the host can be: a
  thread of this process (where a ``KernelManager``'s bridge runs too) copying bytes
  between the client's connections and the launch folder's sockets, one connection of
  its own per client connection, nothing read or checked (:class:`BareRelay`). The
  difference to ``relay`` is what any process between the client and the sandbox costs;
  the bridge's cost above it is its own (libzmq's sockets on both sides, the meter, the
  checks);
* ``inside``: the same kernel from a client inside its sandbox (``docker exec``, the
  image's jupyter_client) on the kernel's own ports (relay and host sockets left out; the
  client pays gVisor's costs too, so this is an upper bound of the kernel's own share).

Each sample is also split in three by the kernel's own clock: the way in (from the
client's sending the request to the kernel's ``busy`` status: the client, the hops between,
and the kernel's process receiving the request), the kernel itself (from its ``busy``
status to its ``idle`` one: ipykernel's handling of the request, in its own process) and
the way out (from the kernel's ``idle`` until the client has it and the reply: the
kernel's process sending its last messages, the hops, the client). The way in is read
across two clocks, the client's and the kernel's wall clocks: a gVisor sandbox's is the
host's (the sentry reads the host's clock).

Each round takes ``--batch`` samples of each way in turn, in an order shuffled every round,
``--rounds`` times, so that a change of the machine's load touches all six alike. With
``--batch 1`` each way's threads sleep while the others take their samples, as a kernel's
do between a person's or an assistant's requests (with larger batches, all but the first
sample of a batch find them awake). The sandboxed kernel's idle freeze is
turned off for the run (a kernelspec variant), since the ``relay`` and ``inside`` clients'
messages do not pass the bridge, which is what keeps a kernel thawed. Run as root from the
project root::

    .venv/bin/python bench/roundtrip.py
    .venv/bin/python bench/roundtrip.py --rounds 10 --batch 30 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import cast

import docker
from jupyter_client import KernelManager
from jupyter_client.blocking import BlockingKernelClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import SANDBOX_UID, STARTUP_TIMEOUT, kernelspec_variant, percentile, progress
from roundtrip_once import once, parts

#: Where the launch folder (connection file, the relay's ipc sockets) is in the sandbox.
LAUNCH_FOLDER = "/run/sandbox-kernel"
CHANNELS = ("shell", "iopub", "stdin", "control", "hb")
WAYS = ("local", "bridge", "meter", "bare", "relay", "inside")
LABELS = {
    "local": "local ipykernel",
    "bridge": "sandboxed: bridge -> sandbox's sockets -> kernel (what clients use)",
    "meter": "sandboxed: the bridge's meter alone -> sandbox's sockets -> kernel",
    "bare": "sandboxed: a bare byte relay on the host -> sandbox's sockets -> kernel",
    "relay": "sandboxed: host client -> sandbox's sockets -> kernel (no bridge)",
    "inside": "sandboxed: client in the sandbox -> kernel's ports",
}

#: Run with the image's Python inside the sandbox: on each line "N", N timed round trips
#: on the kernel's own ports; answers one line, their times in ms as a JSON list.
INSIDE_CLIENT = (
    """
import json, sys, time
from jupyter_client import BlockingKernelClient
client = BlockingKernelClient()
client.load_connection_file(sys.argv[1])
client.start_channels()
client.wait_for_ready(timeout=60)
"""
    + (Path(__file__).resolve().parent / "roundtrip_once.py").read_text()
    + """
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps([once(client) for _ in range(int(line))]), flush=True)
client.stop_channels()
"""
)


class InsideClient:
    """A jupyter_client program in the sandbox, on the kernel's own ports."""

    def __init__(self, container_id: str) -> None:
        docker_cli = shutil.which("docker") or "docker"
        self.process = subprocess.Popen(  # noqa: S603 (our own argv)
            [
                docker_cli,
                "exec",
                "-i",
                "-u",
                str(SANDBOX_UID),
                container_id,
                "python",
                "-c",
                INSIDE_CLIENT,
                f"{LAUNCH_FOLDER}/connection.json",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._line() != "ready":
            msg = "the client in the sandbox did not start"
            raise RuntimeError(msg)

    def _line(self) -> str:
        line = self.process.stdout.readline() if self.process.stdout is not None else ""
        if not line:
            msg = f"the client in the sandbox ended (exit code {self.process.wait()})"
            raise RuntimeError(msg)
        return line.strip()

    def run(self, count: int) -> list[list[float]]:
        if self.process.stdin is None:
            msg = "the client in the sandbox has no input"
            raise RuntimeError(msg)
        self.process.stdin.write(f"{count}\n")
        self.process.stdin.flush()
        return [[float(ms) for ms in pair] for pair in json.loads(self._line())]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class BareRelay:
    """Bytes copied, unread, between each connection to ``{here}-N`` and one of its own to
    ``{there}-N`` (N = 1..5, the channels), by one thread: the least a process between a
    client and the sandbox does."""

    def __init__(self, here: str, there: str) -> None:
        self.there = there
        self.selector = selectors.DefaultSelector()
        self.peers: dict[socket.socket, socket.socket] = {}
        self.listeners = []
        for n in range(1, len(CHANNELS) + 1):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(f"{here}-{n}")
            listener.listen()
            listener.setblocking(False)
            self.selector.register(listener, selectors.EVENT_READ, n)
            self.listeners.append(listener)
        self.wake_r, self.wake_w = socket.socketpair()
        self.selector.register(self.wake_r, selectors.EVENT_READ, 0)
        self.thread = threading.Thread(target=self._run, name="bare-relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            for key, _ in self.selector.select():
                sock = cast(socket.socket, key.fileobj)
                if key.data == 0:
                    return
                if isinstance(key.data, int):
                    self._accept(sock, key.data)
                    continue
                if sock not in self.peers:
                    continue  # (closed earlier in this round, with its peer)
                try:
                    data = sock.recv(65536)
                    if data:
                        self.peers[sock].sendall(data)
                except OSError:
                    data = b""
                if not data:  # (either end gone: both closed)
                    self._drop(sock)

    def _accept(self, listener: socket.socket, n: int) -> None:
        near, _ = listener.accept()
        far = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        far.connect(f"{self.there}-{n}")
        self.peers[near], self.peers[far] = far, near
        for sock in (near, far):
            self.selector.register(sock, selectors.EVENT_READ, "data")

    def _drop(self, sock: socket.socket) -> None:
        for one in (sock, self.peers.pop(sock)):
            self.peers.pop(one, None)
            self.selector.unregister(one)
            one.close()

    def close(self) -> None:
        self.wake_w.send(b"x")
        self.thread.join()
        for sock in [*self.listeners, *self.peers, self.wake_r, self.wake_w]:
            sock.close()
        self.selector.close()


def launch_folder(manager: KernelManager, docker_client: docker.DockerClient) -> str:
    """The host folder mounted at the sandbox's launch folder."""
    mounts = docker_client.api.inspect_container(manager.provisioner.container_id)["Mounts"]
    return str(next(m["Source"] for m in mounts if m["Destination"] == LAUNCH_FOLDER))


def meter_sockets(manager: KernelManager) -> tuple[str, dict[str, int]]:
    """Where the bridge's meter listens for each channel (``prefix-N``): the prefix, and N
    of each channel."""
    meter = manager.provisioner.channels.bridge._meter
    paths = {channel: listener.getsockname() for listener, (channel, _, _) in meter._listeners.items()}
    prefixes = {path.rsplit("-", 1)[0] for path in paths.values()}
    return prefixes.pop(), {channel: int(path.rsplit("-", 1)[1]) for channel, path in paths.items()}


def relay_client(folder: str, prefix: str, ports: dict[str, int] | None = None) -> BlockingKernelClient:
    """A host client on ipc sockets ``prefix-N`` (N: ``ports``, by default 1 to 5 in the
    order of :data:`CHANNELS`) with the launch folder's session key."""
    inner = json.loads((Path(folder) / "connection.json").read_text())
    client = BlockingKernelClient()
    client.load_connection_info(
        {
            "transport": "ipc",
            "ip": prefix,
            **{f"{name}_port": n for name, n in (ports or {c: n for n, c in enumerate(CHANNELS, 1)}).items()},
            "key": inner["key"],
            "signature_scheme": inner["signature_scheme"],
        }
    )
    client.start_channels()
    client.wait_for_ready(timeout=STARTUP_TIMEOUT)
    return client


def start(kernel_name: str, cwd: str) -> tuple[KernelManager, BlockingKernelClient]:
    manager = KernelManager(kernel_name=kernel_name)
    local = manager.kernel_spec.metadata.get("kernel_provisioner") is None
    manager.start_kernel(cwd=cwd, **({"stdout": subprocess.DEVNULL} if local else {}))
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=STARTUP_TIMEOUT)
    return manager, client


def measure(
    kernel_name: str, local_name: str, rounds: int, batch: int, warmup: int
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {way: [] for way in WAYS}
    docker_client = docker.from_env()
    with tempfile.TemporaryDirectory(prefix="bench-roundtrip-") as tmp:
        folder, cwd = Path(tmp) / "specs", Path(tmp) / "work"
        cwd.mkdir()
        if os.geteuid() == 0:
            os.chown(cwd, SANDBOX_UID, SANDBOX_UID)
        unfrozen = kernelspec_variant(kernel_name, "bench-unfrozen", {"freeze_idle_after": 0}, folder)
        started: list[tuple[KernelManager, BlockingKernelClient]] = []
        inside: InsideClient | None = None
        bare_relay: BareRelay | None = None
        try:
            started.append(start(local_name, str(cwd)))
            started.append(start(unfrozen, str(cwd)))
            (_, local), (sandboxed, bridge) = started
            launch = launch_folder(sandboxed, docker_client)
            relay = relay_client(launch, f"{launch}/kernel")
            started.append((sandboxed, relay))
            bare_relay = BareRelay(f"{tmp}/bare", f"{launch}/kernel")
            bare = relay_client(launch, f"{tmp}/bare")
            started.append((sandboxed, bare))
            meter = relay_client(launch, *meter_sockets(sandboxed))
            started.append((sandboxed, meter))
            inside = InsideClient(sandboxed.provisioner.container_id)
            clients = {"local": local, "bridge": bridge, "meter": meter, "bare": bare, "relay": relay}
            for client in clients.values():
                for _ in range(warmup):
                    once(client)
            inside.run(warmup)
            for r in range(1, rounds + 1):
                for way in random.sample(WAYS, len(WAYS)):
                    if way == "inside":
                        samples[way] += inside.run(batch)
                    else:
                        samples[way] += [once(clients[way]) for _ in range(batch)]
                progress(
                    f"round {r}/{rounds}: "
                    + ", ".join(
                        f"{way} p50 {statistics.median(s[0] for s in samples[way]):.2f} ms" for way in WAYS
                    )
                )
        finally:
            if inside is not None:
                inside.close()
            for _, client in started:
                client.stop_channels()
            if bare_relay is not None:
                bare_relay.close()
            for manager in {id(m): m for m, _ in started}.values():
                if manager.has_kernel:
                    manager.shutdown_kernel()
    return samples


def format_table(samples: dict[str, list[list[float]]]) -> str:
    """The round trip of each way, and how much of it was the way in (to the kernel's busy),
    the kernel itself (its busy to its idle status) and the way out (the rest)."""
    split = {way: [parts(sample) for sample in samples[way]] for way in WAYS}

    def p50(way: str, part: str) -> float:
        return percentile([sample[part] for sample in split[way]], 50)

    rows = [
        "| path | p50 ms | p95 ms | p50 / local | the way in, p50 ms | / local "
        "| the kernel itself, p50 ms | / local | the way out, p50 ms | / local |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for way in WAYS:
        cells = []
        for part in ("total", "in", "kernel", "out"):
            cells += [f"{p50(way, part):.2f}", f"{p50(way, part) / p50('local', part):.2f}x"]
        p95 = percentile([sample["total"] for sample in split[way]], 95)
        cells.insert(1, f"{p95:.2f}")
        rows.append(f"| {LABELS[way]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", default="sandboxed-python", help="the sandboxed kernelspec")
    parser.add_argument("--local", default="python3", help="the local kernelspec (the baseline)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of all six ways (default 8)")
    parser.add_argument("--batch", type=int, default=25, help="round trips of each way per round")
    parser.add_argument("--warmup", type=int, default=20, help="untimed round trips of each way first")
    parser.add_argument("--json", action="store_true", help="also print the samples as JSON")
    args = parser.parse_args(argv)
    samples = measure(args.kernel, args.local, args.rounds, args.batch, args.warmup)
    print(format_table(samples))
    if args.json:
        print(json.dumps(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
