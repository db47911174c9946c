"""What the host's cgroups say about a sandbox (memory in use, out-of-memory kills), and its freezer.

Under gVisor the kernel's memory lives in the sandbox's host processes, so the host's
memory cgroup for the container is where the truth is. When that cgroup reaches its
limit, the host's OOM killer may kill just one of the sandbox's helper processes (with
the systrap platform, the one holding the kernel's address space): Docker then reports
no OOM kill, the container keeps running, and the kernel hangs for good. The cgroup's
``oom_kill`` counter is the reliable sign. Both cgroup v1 and v2 are read, from the
cgroup of the container's main process as ``/proc/PID/cgroup`` names it.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup(pid: int, controller: str, proc: Path = Path("/proc")) -> tuple[Path, int] | None:
    """(folder of ``pid``'s cgroup for ``controller``, cgroup version), or None if unknown."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    unified: str | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controller in names:
            return CGROUP_ROOT / ",".join(names) / path.lstrip("/"), 1
        if controllers == "":
            unified = path
    if unified is not None:
        return CGROUP_ROOT / unified.lstrip("/"), 2
    return None


def _read_keyed(path: Path) -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return values
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    return values


def oom_kills(pid: int, proc: Path = Path("/proc")) -> int | None:
    """How many processes the OOM killer has killed in ``pid``'s memory cgroup; None if unknown."""
    found = _cgroup(pid, "memory", proc)
    if found is None:
        return None
    folder, version = found
    values = _read_keyed(folder / ("memory.oom_control" if version == 1 else "memory.events"))
    return values.get("oom_kill")


def memory_usage(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Bytes of memory charged to ``pid``'s memory cgroup; None if unknown."""
    found = _cgroup(pid, "memory", proc)
    if found is None:
        return None
    folder, version = found
    try:
        return int((folder / ("memory.usage_in_bytes" if version == 1 else "memory.current")).read_text())
    except (OSError, ValueError):
        return None


def peak_memory(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The most bytes ``pid``'s memory cgroup was charged (since it was made, or its peak
    last reset), without resetting it; None if unknown."""
    found = _cgroup(pid, "memory", proc)
    if found is None:
        return None
    folder, version = found
    try:
        return int((folder / ("memory.max_usage_in_bytes" if version == 1 else "memory.peak")).read_text())
    except (OSError, ValueError):
        return None


def memory_limit(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The memory limit of ``pid``'s memory cgroup in bytes (what a pool claim narrowed it
    to, which Docker's record of the container does not know); None if unknown or none."""
    found = _cgroup(pid, "memory", proc)
    if found is None:
        return None
    folder, version = found
    try:
        text = (folder / ("memory.limit_in_bytes" if version == 1 else "memory.max")).read_text().strip()
        limit = int(text)
    except (OSError, ValueError):
        return None
    return limit if limit < 2**62 else None  # v1's "no limit" is a page-rounded 2**63 - 1


def cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float | None:
    """CPU time used so far by ``pid``'s cgroup (the whole sandbox), in seconds; None if unknown."""
    return _cpu_seconds_in(_cgroup(pid, "cpuacct", proc) or _cgroup(pid, "cpu", proc))


def _cpu_seconds_in(found: tuple[Path, int] | None) -> float | None:
    if found is None:
        return None
    folder, version = found
    if version == 1:
        try:
            return int((folder / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None
    usage = _read_keyed(folder / "cpu.stat").get("usage_usec")
    return None if usage is None else usage / 1e6


class CgroupFreezer:
    """The freezer of one cgroup (a sandbox's): each call one small file read or write,
    quick enough for any thread, a bridge's included.

    cgroup v1: ``freezer.state`` (THAWED, FREEZING, FROZEN); v2: ``cgroup.freeze`` to
    write, ``cgroup.events`` to read. Writing returns at once; the processes stop in the
    next moments (FREEZING, until every one of them has).
    """

    def __init__(self, folder: Path, version: int) -> None:
        self.folder = folder
        self.version = version

    @classmethod
    def of_pid(cls, pid: int, proc: Path = Path("/proc")) -> CgroupFreezer | None:
        """The freezer of ``pid``'s cgroup; None where the host has none."""
        found = _cgroup(pid, "freezer", proc)
        return cls(*found) if found is not None else None

    def set(self, frozen: bool) -> bool:
        """Freeze or thaw; False when the host does not let this process (not root, say)
        or the cgroup is gone."""
        try:
            if self.version == 1:
                (self.folder / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
            else:
                (self.folder / "cgroup.freeze").write_text("1" if frozen else "0")
        except OSError:
            return False
        return True

    def state(self) -> str | None:
        """One of frozen, freezing (asked, not all stopped yet) and thawed; None if unknown."""
        try:
            if self.version == 1:
                state = (self.folder / "freezer.state").read_text().strip()
                return {"FROZEN": "frozen", "FREEZING": "freezing", "THAWED": "thawed"}.get(state)
            asked = (self.folder / "cgroup.freeze").read_text().strip() == "1"
        except OSError:
            return None
        done = _read_keyed(self.folder / "cgroup.events").get("frozen") == 1
        return "frozen" if asked and done else "freezing" if asked else "thawed"


def freeze(pid: int, frozen: bool, proc: Path = Path("/proc")) -> bool:
    """Freeze (or thaw) every process of ``pid``'s cgroup, the whole sandbox; False when
    the host does not let us (no freezer, not root).

    A frozen sandbox costs no CPU at all: under runsc 20240729 an idle systrap sandbox
    otherwise keeps ~6 % of a core busy (a 400 µs polling loop in the sentry, which no
    flag turns off), and ``docker pause`` does not freeze a runsc container. Thawing
    takes well under a millisecond. Under cgroup v1 a frozen process cannot die, not
    even of SIGKILL: thaw a sandbox before removing it. Nor can a frozen runsc sandbox
    be signalled or saved: ``runsc kill`` and ``runsc checkpoint`` wait for its sentry.
    """
    freezer = CgroupFreezer.of_pid(pid, proc)
    return freezer is not None and freezer.set(frozen)


def lower_limits(
    pid: int, memory: int | None = None, cpus: float | None = None, proc: Path = Path("/proc")
) -> None:
    """Lower the memory limit (bytes, swap included) and the CPU quota of ``pid``'s
    cgroup, the whole sandbox, each read back (runsc 20240729 refuses ``docker update``).

    Raises:
        OSError: a limit could not be set (no such cgroup, not root, more memory in use).
    """
    if memory is not None:
        folder, version = _found(pid, "memory", proc)
        names = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes") if version == 1 else ("memory.max",)
        for name in names:  # v1: the limit first, as it may never be above the one with swap
            if name == names[0] or (folder / name).exists():
                (folder / name).write_text(str(memory))
                if int((folder / name).read_text()) > memory:
                    msg = f"{folder / name} stays above {memory}"
                    raise OSError(msg)
    if cpus is not None:
        folder, version = _found(pid, "cpu", proc)
        if version == 1:
            period = int((folder / "cpu.cfs_period_us").read_text())
            (folder / "cpu.cfs_quota_us").write_text(str(max(1000, int(cpus * period))))
            quota = int((folder / "cpu.cfs_quota_us").read_text())
        else:
            period = int((folder / "cpu.max").read_text().split()[1])
            (folder / "cpu.max").write_text(f"{max(1000, int(cpus * period))} {period}")
            written = (folder / "cpu.max").read_text().split()[0]
            quota = -1 if written == "max" else int(written)
        if not 0 < quota <= max(1000, int(cpus * period)):
            msg = f"the CPU quota of process {pid}'s cgroup stays above {cpus:g} CPUs"
            raise OSError(msg)


def _found(pid: int, controller: str, proc: Path) -> tuple[Path, int]:
    found = _cgroup(pid, controller, proc)
    if found is None:
        msg = f"no {controller} cgroup for process {pid}"
        raise OSError(msg)
    return found


#: Where Docker makes a container's cgroup in a hierarchy: its cgroupfs driver, its systemd driver.
DOCKER_CGROUPS = ("docker/{id}", "system.slice/docker-{id}.scope")


def thaw_container(container_id: str) -> bool:
    """Thaw a container's cgroup, found from its full id alone (asking Docker about a
    frozen gVisor sandbox may hang); True if there was one to thaw.

    Docker's kill of a frozen runsc sandbox waits until it is thawed, and holds up every
    later Docker call on the container meanwhile (an inspect, a second kill): whatever
    removes a sandbox thaws it first.
    """
    if len(container_id) != 64 or any(c not in "0123456789abcdef" for c in container_id):
        return False
    for layout in DOCKER_CGROUPS:
        folder = layout.format(id=container_id)
        for path, thawed in (
            (CGROUP_ROOT / "freezer" / folder / "freezer.state", "THAWED"),
            (CGROUP_ROOT / folder / "cgroup.freeze", "0"),
        ):
            try:
                path.write_text(thawed)
            except OSError:
                continue
            return True
    return False


class PeakMemory:
    """The most memory ``pid``'s cgroup (the whole sandbox) used since this was made.

    cgroup v2's ``memory.peak`` is reset for one open file by writing to it (Linux 6.12
    and later), so each measurement has its own. cgroup v1's ``memory.max_usage_in_bytes``
    is reset for everyone: fine for one execution at a time, which is how a kernel runs.
    :meth:`read` is None where neither can be done.
    """

    def __init__(self, pid: int, proc: Path = Path("/proc")) -> None:
        self._fd = _reset_peak(_cgroup(pid, "memory", proc))

    @classmethod
    def in_cgroup(cls, found: tuple[Path, int] | None) -> PeakMemory:
        """The same, of the memory cgroup ``found`` (folder, version) already."""
        peak = cls.__new__(cls)
        peak._fd = _reset_peak(found)
        return peak

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 64, 0))
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _reset_peak(found: tuple[Path, int] | None) -> int | None:
    """A descriptor of the memory cgroup ``found``'s peak, reset for it; None if none."""
    if found is None:
        return None
    folder, version = found
    name, reset = ("memory.peak", b"reset") if version == 2 else ("memory.max_usage_in_bytes", b"0")
    try:
        fd = os.open(folder / name, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        os.write(fd, reset)
    except OSError:  # an older kernel: that would be the peak since the sandbox started
        os.close(fd)
        return None
    return fd


class SandboxUsage:
    """The CPU time and peak memory of one sandbox (``pid``'s cgroups), its cgroup folders
    found once: a process stays in its cgroup while it lives, and reading
    ``/proc/PID/cgroup`` for each of them took ~0.17 ms a time on a loaded 2-core host
    (three a measured run)."""

    def __init__(self, pid: int, proc: Path = Path("/proc")) -> None:
        self.pid = pid
        self._cpu = _cgroup(pid, "cpuacct", proc) or _cgroup(pid, "cpu", proc)
        self._memory = _cgroup(pid, "memory", proc)

    def cpu_seconds(self) -> float | None:
        """As :func:`cpu_seconds`."""
        return _cpu_seconds_in(self._cpu)

    def peak_memory(self) -> PeakMemory:
        """A new measurement of the most memory the sandbox uses (see :class:`PeakMemory`)."""
        return PeakMemory.in_cgroup(self._memory)


def stat_fields(text: str) -> list[str]:
    """The fields of a ``/proc/PID/stat`` after the command name, which may hold spaces
    and parentheses: [0] is the state, [1] the parent's pid, [19] the start time."""
    return text.rsplit(")", 1)[1].split()


def process_ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped counts as ended)."""
    try:
        state = stat_fields(Path(f"/proc/{pid}/stat").read_text())[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def held_host_sockets(sandbox_pid: int, proc: Path = Path("/proc")) -> list[str] | None:
    """Paths (as the sandbox names them) of the unix sockets a gVisor sandbox holds bound
    on the host: its gofer binds them, in the container's network namespace (whose
    ``net/unix`` lists them), and the sandbox's process holds them open. gVisor cannot
    checkpoint a sandbox holding one, and a failed checkpoint ends the sandbox: this is
    asked first. None where it cannot be read."""
    try:
        held = {
            link.removeprefix("socket:[").rstrip("]")
            for link in (os.readlink(fd) for fd in (proc / str(sandbox_pid) / "fd").iterdir())
            if link.startswith("socket:[")
        }
        shim = stat_fields((proc / str(sandbox_pid) / "stat").read_text())[1]
    except (OSError, IndexError):
        return None
    for entry in proc.iterdir():
        try:
            if not entry.name.isdigit() or stat_fields((entry / "stat").read_text())[1] != shim:
                continue
            if not (entry / "cmdline").read_bytes().startswith(b"runsc-gofer"):
                continue
            lines = (entry / "net" / "unix").read_text().splitlines()[1:]
        except (OSError, IndexError):
            continue
        fields = [line.split() for line in lines]
        return sorted({f[7] for f in fields if len(f) > 7 and f[6] in held})
    return None
