"""Where a sandboxed kernel's ``1+1`` round trip goes: the same kernel reached at each
stretch of its path, interleaved in one run, against a local ipykernel.

A client's message to a sandboxed kernel crosses, in turn: the host's bridge (in the
client's process for a ``KernelManager``, signatures checked, output budgeted) and the
host-facing ipc sockets in the launch folder: shell's and IOPub's held by the kernel
itself, the other three by the channel relay inside the sandbox (the kernel's parent),
which passes their bytes on to the kernel's tcp ports on the sandbox's loopback. This
measures ``execute_interactive('1+1')`` (from the ``execute_request`` sent until its reply
and the ``idle`` status are in) four ways:

* ``local``: a local ipykernel, as the baseline;
* ``bridge``: the sandboxed kernel as every client reaches it (bridge -> the launch
  folder's sockets -> kernel);
* ``relay``: the same kernel from a host client connected straight to the launch folder's
  ipc sockets (the bridge left out: the difference to ``bridge`` is the bridge's);
* ``inside``: the same kernel from a client inside its sandbox (``docker exec``, the
  image's jupyter_client) on the kernel's own ports (relay and host sockets left out; the
  client pays gVisor's costs too, so this is an upper bound of the kernel's own share).

Each sample is also split in two by the kernel's own clock: the kernel itself (from its
``busy`` status to its ``idle`` one: ipykernel's handling of the request, in its own
process) and the rest, the path there and back (the client, the sockets and hops between,
and the kernel's process receiving the request before it says ``busy`` and sending the
last message after ``idle``).

Each round takes ``--batch`` samples of each way in turn, ``--rounds`` times, so that a
change of the machine's load touches all four alike. The sandboxed kernel's idle freeze is
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
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import docker
from jupyter_client import KernelManager
from jupyter_client.blocking import BlockingKernelClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import SANDBOX_UID, STARTUP_TIMEOUT, kernelspec_variant, percentile, progress
from roundtrip_once import once

#: Where the launch folder (connection file, the relay's ipc sockets) is in the sandbox.
LAUNCH_FOLDER = "/run/sandbox-kernel"
WAYS = ("local", "bridge", "relay", "inside")
LABELS = {
    "local": "local ipykernel",
    "bridge": "sandboxed: bridge -> sandbox's sockets -> kernel (what clients use)",
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


def relay_client(manager: KernelManager, docker_client: docker.DockerClient) -> BlockingKernelClient:
    """A host client on the launch folder's ipc sockets (``kernel-N``)."""
    container_id = manager.provisioner.container_id
    mounts = docker_client.api.inspect_container(container_id)["Mounts"]
    folder = next(m["Source"] for m in mounts if m["Destination"] == LAUNCH_FOLDER)
    inner = json.loads((Path(folder) / "connection.json").read_text())
    client = BlockingKernelClient()
    client.load_connection_info(
        {
            "transport": "ipc",
            "ip": f"{folder}/kernel",
            **{f"{name}_port": n for n, name in enumerate(("shell", "iopub", "stdin", "control", "hb"), 1)},
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
        try:
            started.append(start(local_name, str(cwd)))
            started.append(start(unfrozen, str(cwd)))
            (_, local), (sandboxed, bridge) = started
            relay = relay_client(sandboxed, docker_client)
            started.append((sandboxed, relay))
            inside = InsideClient(sandboxed.provisioner.container_id)
            clients = {"local": local, "bridge": bridge, "relay": relay}
            for client in clients.values():
                for _ in range(warmup):
                    once(client)
            inside.run(warmup)
            for r in range(1, rounds + 1):
                for way in WAYS:
                    if way == "inside":
                        samples[way] += inside.run(batch)
                    else:
                        samples[way] += [once(clients[way]) for _ in range(batch)]
                progress(
                    f"round {r}/{rounds}: "
                    + ", ".join(
                        f"{way} p50 {statistics.median(t for t, _ in samples[way]):.2f} ms" for way in WAYS
                    )
                )
        finally:
            if inside is not None:
                inside.close()
            for _, client in started:
                client.stop_channels()
            for manager in {id(m): m for m, _ in started}.values():
                if manager.has_kernel:
                    manager.shutdown_kernel()
    return samples


def format_table(samples: dict[str, list[list[float]]]) -> str:
    """The round trip of each way, and how much of it the kernel took itself (its busy
    to its idle status) and the path to it and back (the rest)."""
    totals = {way: [t for t, _ in samples[way]] for way in WAYS}
    kernel = {way: [k for _, k in samples[way]] for way in WAYS}
    path = {way: [t - k for t, k in samples[way]] for way in WAYS}
    base = {
        name: percentile(values["local"], 50) for name, values in (("t", totals), ("k", kernel), ("p", path))
    }
    rows = [
        "| path | p50 ms | p95 ms | p50 / local | the kernel itself, p50 ms | / local "
        "| the path there and back, p50 ms | / local |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for way in WAYS:
        t50, k50, p50 = percentile(totals[way], 50), percentile(kernel[way], 50), percentile(path[way], 50)
        rows.append(
            f"| {LABELS[way]} | {t50:.2f} | {percentile(totals[way], 95):.2f} | {t50 / base['t']:.2f}x "
            f"| {k50:.2f} | {k50 / base['k']:.2f}x | {p50:.2f} | {p50 / base['p']:.2f}x |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", default="sandboxed-python", help="the sandboxed kernelspec")
    parser.add_argument("--local", default="python3", help="the local kernelspec (the baseline)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of all four ways (default 8)")
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
