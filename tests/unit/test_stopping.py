"""Which sandboxes Docker is stopping: the runsc kill commands waiting, read from /proc."""

from __future__ import annotations

from pathlib import Path

from sandbox_kernel.host.stopping import being_stopped

ID = "d997afe3e54dc38b74fc4014b4f9fe01678a68cf99fa0c856f3b90bb0fd6a5b2"
OTHER = "aa2498151759ed697eb6fdf4980295d89c9e29d70ffee79a49e90ea9714a76f5"


def process(proc: Path, pid: int, comm: str, *args: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "comm").write_text(comm + "\n")
    (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")


def test_the_containers_a_runsc_kill_waits_for(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    # What Docker's shim runs to stop a container (through the runtime's wrapper script).
    process(
        proc,
        31540,
        "runsc",
        "/usr/bin/runsc",
        "--network=none",
        "--root",
        "/var/run/docker/runtime-runc/moby",
        "--log",
        "/x/log.json",
        "--log-format",
        "json",
        "kill",
        ID,
        "15",
    )
    process(
        proc,
        31539,
        "runsc-sandbox-k",
        "/bin/sh",
        "/var/lib/docker/runtimes/runsc-sandbox-kernel",
        "kill",
        OTHER,
    )
    process(proc, 31600, "runsc", "/usr/bin/runsc", "--root", "/r", "state", OTHER)  # not a kill
    process(proc, 31601, "runsc", "/usr/bin/runsc", "kill", "not-an-id", "9")
    process(proc, 31602, "python3", "python3", "-c", "kill", ID)  # not runsc
    (proc / "self").mkdir()
    (proc / "31603").mkdir()  # gone meanwhile: no files
    assert being_stopped(proc) == {ID}


def test_no_proc_no_containers(tmp_path: Path) -> None:
    assert being_stopped(tmp_path / "missing") == frozenset()
