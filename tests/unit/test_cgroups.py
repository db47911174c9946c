"""Reading a sandbox's memory use and OOM kills from its host cgroup, v1 and v2."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from sandbox_kernel.host import cgroups


@pytest.fixture
def fake_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", root)
    return proc, root


def _process(proc: Path, pid: int, cgroup_lines: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(cgroup_lines)


def test_cgroup_v1_memory_controller(fake_host: tuple[Path, Path]) -> None:
    proc, root = fake_host
    _process(proc, 7, "5:devices:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    folder = root / "memory" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (folder / "memory.usage_in_bytes").write_text("535252992\n")
    (folder / "memory.limit_in_bytes").write_text("536870912\n")
    (folder / "memory.max_usage_in_bytes").write_text("600000000\n")
    assert cgroups.oom_kills(7, proc) == 2
    assert cgroups.peak_memory(7, proc) == 600000000
    assert (folder / "memory.max_usage_in_bytes").read_text() == "600000000\n"  # read, not reset
    assert cgroups.memory_usage(7, proc) == 535252992
    assert cgroups.memory_limit(7, proc) == 512 * 2**20
    (folder / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "none"
    assert cgroups.memory_limit(7, proc) is None


def test_cgroup_v2_unified(fake_host: tuple[Path, Path]) -> None:
    proc, root = fake_host
    _process(proc, 8, "0::/system.slice/docker-abc.scope\n")
    folder = root / "system.slice" / "docker-abc.scope"
    folder.mkdir(parents=True)
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    (folder / "memory.current").write_text("1048576\n")
    (folder / "memory.max").write_text("1073741824\n")
    (folder / "memory.peak").write_text("2097152\n")
    assert cgroups.oom_kills(8, proc) == 1
    assert cgroups.peak_memory(8, proc) == 2097152
    assert cgroups.memory_usage(8, proc) == 1048576
    assert cgroups.memory_limit(8, proc) == 2**30
    (folder / "memory.max").write_text("max\n")
    assert cgroups.memory_limit(8, proc) is None


def test_unknown_processes_and_missing_files_are_none(fake_host: tuple[Path, Path]) -> None:
    proc, _ = fake_host
    assert cgroups.oom_kills(9, proc) is None
    assert cgroups.memory_usage(9, proc) is None
    _process(proc, 10, "4:memory:/docker/gone\n")
    assert cgroups.oom_kills(10, proc) is None
    assert cgroups.memory_usage(10, proc) is None


def test_cpu_time_from_cgroup_v1_and_v2(fake_host: tuple[Path, Path]) -> None:
    proc, root = fake_host
    _process(proc, 7, "3:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    v1 = root / "cpu,cpuacct" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpuacct.usage").write_text("2500000000\n")
    assert cgroups.cpu_seconds(7, proc) == 2.5
    _process(proc, 8, "0::/system.slice/docker-abc.scope\n")
    v2 = root / "system.slice" / "docker-abc.scope"
    v2.mkdir(parents=True)
    (v2 / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    assert cgroups.cpu_seconds(8, proc) == 1.5
    assert cgroups.cpu_seconds(9, proc) is None


def test_a_sandboxs_usage_reads_its_cgroups_found_once(fake_host: tuple[Path, Path]) -> None:
    """What a session reads around each run: the CPU time and the peak memory, from the
    folders found when it first met the sandbox (/proc/PID/cgroup is not read again)."""
    proc, root = fake_host
    _process(proc, 8, "0::/system.slice/docker-abc.scope\n")
    folder = root / "system.slice" / "docker-abc.scope"
    folder.mkdir(parents=True)
    (folder / "cpu.stat").write_text("usage_usec 1500000\n")
    (folder / "memory.peak").write_text("4096\n")
    usage = cgroups.SandboxUsage(8, proc)
    (proc / "8" / "cgroup").unlink()
    assert usage.cpu_seconds() == 1.5
    (folder / "cpu.stat").write_text("usage_usec 2000000\n")
    assert usage.cpu_seconds() == 2.0
    peak = usage.peak_memory()
    assert (folder / "memory.peak").read_bytes().startswith(b"reset"), "reset for this run"
    (folder / "memory.peak").write_text("8192\n")
    assert peak.read() == 8192
    peak.close()
    assert cgroups.SandboxUsage(9, proc).cpu_seconds() is None
    assert cgroups.SandboxUsage(9, proc).peak_memory().read() is None


def test_a_sandboxs_freezer_under_cgroup_v1_and_v2(fake_host: tuple[Path, Path]) -> None:
    """What the idle freeze writes and reads: v1's freezer.state; v2's cgroup.freeze, and
    cgroup.events for whether every process has stopped yet."""
    proc, root = fake_host
    _process(proc, 7, "7:freezer:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    v1 = root / "freezer" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "freezer.state").write_text("THAWED\n")
    freezer = cgroups.CgroupFreezer.of_pid(7, proc)
    assert freezer is not None
    assert freezer.set(True)
    assert (v1 / "freezer.state").read_text() == "FROZEN"
    (v1 / "freezer.state").write_text("FREEZING\n")  # what the kernel says until all stopped
    assert freezer.state() == "freezing"
    assert freezer.set(False)
    assert freezer.state() == "thawed"
    _process(proc, 8, "0::/system.slice/docker-abc.scope\n")
    v2 = root / "system.slice" / "docker-abc.scope"
    v2.mkdir(parents=True)
    (v2 / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    freezer = cgroups.CgroupFreezer.of_pid(8, proc)
    assert freezer is not None
    assert freezer.set(True)
    assert (v2 / "cgroup.freeze").read_text() == "1"
    assert freezer.state() == "freezing"
    (v2 / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    assert freezer.state() == "frozen"
    assert cgroups.freeze(8, False, proc)
    assert freezer.state() == "thawed"
    _process(proc, 9, "4:memory:/docker/gone\n")
    assert cgroups.CgroupFreezer.of_pid(9, proc) is None, "no freezer: it never freezes"
    (v1 / "freezer.state").unlink()
    v1.rmdir()
    assert not cgroups.CgroupFreezer(v1, 1).set(True), "the sandbox is gone"


@pytest.mark.parametrize(
    ("layout", "state_file", "thawed"),
    [
        ("freezer/docker/{id}", "freezer.state", "THAWED"),  # v1, cgroupfs driver
        ("freezer/system.slice/docker-{id}.scope", "freezer.state", "THAWED"),  # v1, systemd
        ("system.slice/docker-{id}.scope", "cgroup.freeze", "0"),  # v2, systemd
    ],
)
def test_a_container_is_thawed_from_its_id_alone(
    fake_host: tuple[Path, Path], layout: str, state_file: str, thawed: str
) -> None:
    _, root = fake_host
    container_id = "ab" * 32
    folder = root / layout.format(id=container_id)
    folder.mkdir(parents=True)
    (folder / state_file).write_text("FROZEN" if state_file == "freezer.state" else "1")
    assert cgroups.thaw_container(container_id)
    assert (folder / state_file).read_text() == thawed


def test_only_a_full_container_id_names_a_cgroup(fake_host: tuple[Path, Path]) -> None:
    _, root = fake_host
    (root / "freezer" / "docker").mkdir(parents=True)
    (root / "freezer" / "docker" / "freezer.state").write_text("FROZEN")
    for name in ("", "..", "abc", "../docker", "AB" * 32):
        assert not cgroups.thaw_container(name)
    assert (root / "freezer" / "docker" / "freezer.state").read_text() == "FROZEN"
    assert not cgroups.thaw_container("cd" * 32)  # no such container


def test_the_host_sockets_a_sandbox_holds_are_read_from_its_gofers_network_namespace(tmp_path: Path) -> None:
    proc = tmp_path / "proc"

    def process(
        pid: int,
        ppid: int,
        cmdline: bytes,
        unix: tuple[str, ...] | list[str] = (),
        sockets: tuple[int, ...] | list[int] = (),
    ) -> None:
        folder = proc / str(pid)
        (folder / "net").mkdir(parents=True)
        (folder / "fd").mkdir()
        (folder / "stat").write_text(f"{pid} (exe) S {ppid} 1 1 0 -1")
        (folder / "cmdline").write_bytes(cmdline)
        header = "Num       RefCount Protocol Flags    Type St Inode Path"
        (folder / "net" / "unix").write_text("\n".join([header, *unix]) + "\n")
        for number, inode in enumerate(sockets):
            (folder / "fd" / str(number)).symlink_to(f"socket:[{inode}]")

    process(10, 1, b"containerd-shim\0")
    bound = [
        "0: 00000002 0 00010000 0001 01 7 /workspace/held.sock",  # the sandbox holds it
        "0: 00000002 0 00010000 0001 01 8 /run/sandbox-kernel/kernel-1",  # let go of
        "0: 00000003 0 00000000 0001 03 9",  # connected, no path
    ]
    process(11, 10, b"runsc-gofer\0--root=/x\0", unix=bound)
    process(12, 10, b"runsc-sandbox\0--host-uds=create\0", sockets=[7, 9])
    process(13, 99, b"runsc-gofer\0", unix=["0: 2 0 10000 1 1 7 /another/sandbox.sock"])
    assert cgroups.held_host_sockets(12, proc) == ["/workspace/held.sock"]
    assert cgroups.held_host_sockets(404, proc) is None, "unreadable: nothing known (the checkpoint is tried)"


def test_a_process_that_exited_has_ended_even_before_it_is_reaped() -> None:
    """A sandbox gVisor saved stops a moment after runsc returns, and its parent (the
    shim) reaps it later still: a zombie has ended."""
    assert not cgroups.process_ended(os.getpid())
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while not cgroups.process_ended(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cgroups.process_ended(child.pid), "exited, not yet reaped"
    assert child.poll() == 0
    assert cgroups.process_ended(child.pid), "reaped: gone"
    assert cgroups.stat_fields("12 (a) b (c)) S 1 12")[:2] == ["S", "1"]
