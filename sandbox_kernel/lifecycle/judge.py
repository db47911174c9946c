"""Pure judgements of a kernel's watchdog, from what the host can observe and trust.

The kernel's own messages are its word: code in it can forge an ``execute_reply`` for
the running request and keep computing, and the host would see an idle kernel. The
container's CPU time is not its word; it is read from the host's cgroup. Nor is whether it
is idle enough to freeze: that is what clients sent, the host's record of executions and
the sandbox's CPU time (a kernel whose threads compute is not idle), never what the
kernel says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

#: CPU (in cores) a kernel may use while it runs nothing the host knows of: gVisor's
#: own idle work, a completion, garbage collection.
IDLE_ALLOWANCE = 0.15


@dataclass
class UntrackedCompute:
    """CPU time a kernel spends while no request of a client is being worked on: a
    leaky bucket, filled by what it uses beyond :data:`IDLE_ALLOWANCE` and drained by
    what it leaves of it.

    So a kernel that keeps computing after its reply (a forged reply, or a background
    thread) runs into the same limit as an execution, whether or not clients send more
    cells meanwhile, while short bursts (a widget redrawing, garbage collection) drain
    away.
    """

    allowance: float = IDLE_ALLOWANCE
    seconds: float = 0.0
    _last: tuple[float, float] | None = None

    def observe(self, now: float, cpu: float | None, busy: bool) -> float:
        """Account for the time since the last look; returns the seconds in the bucket.

        ``busy``: a client's request is being worked on (its CPU is the request's, and
        the bucket neither fills nor drains).
        """
        if cpu is None:
            self._last = None
            return self.seconds
        if self._last is not None and not busy:
            then, used = self._last
            self.seconds = max(0.0, self.seconds + (cpu - used) - self.allowance * (now - then))
        self._last = (now, cpu)
        return self.seconds


def exceeds_exec_timeout(untracked: float, exec_timeout: float, grace: float) -> bool:
    """Whether compute outside executions has outrun the per-execution limit and its grace."""
    return exec_timeout > 0 and untracked >= exec_timeout + grace


@dataclass(frozen=True)
class WatchLimits:
    """The limits a watchdog enforces (the kernel's settings)."""

    exec_timeout: float = 0.0
    exec_kill_grace: float = 10.0
    idle_timeout: float = 0.0
    memory: str = ""
    pause_after: float = 0.0
    freeze_after: float = 0.0


@dataclass(frozen=True)
class Look:
    """What the host saw of a kernel at one moment.

    ``deep``: this look includes what costs a Docker call or a cgroup read (exit code,
    CPU, OOM kills), taken about once a second; the cheap part (what the bridge knows)
    is looked at every half second.
    """

    now: float
    deep: bool = False
    exit_code: int | None = None
    cpu: float | None = None
    oom_kills: int | None = None
    #: A client's request is being worked on (its CPU is the request's).
    busy: bool = False
    #: The execution the kernel is running: (msg_id, seconds running).
    running: tuple[str, float] | None = None
    #: Seconds since the last execution began or ended; None while one is pending.
    idle_for: float | None = None
    #: Seconds since then or since a client's last message, whichever is later.
    quiet_for: float | None = None
    #: The sandbox is frozen (see :mod:`~sandbox_kernel.kernel.freezer`).
    frozen: bool = False
    #: Seconds it has been frozen in all, this one included: no time for the CPU accounting.
    frozen_seconds: float = 0.0


@dataclass
class Watch:
    """What a kernel's watchdog carries from one look to the next."""

    oom_baseline: int | None = None
    interrupted: str | None = None
    compute: UntrackedCompute = field(default_factory=UntrackedCompute)
    #: The CPU time last seen, and when: (monotonic, CPU-seconds).
    cpu_seen: tuple[float, float] | None = None
    #: When the sandbox last used more than :data:`IDLE_ALLOWANCE` (monotonic).
    computed_at: float = float("-inf")

    def note_cpu(self, now: float, cpu: float | None) -> None:
        """Whether the sandbox computed since the last look (its threads, with no
        execution running: a kernel doing work is not one to freeze)."""
        if cpu is None:
            return
        if self.cpu_seen is None:
            self.computed_at = now  # not known yet: as if it had just computed
        elif now > self.cpu_seen[0]:
            then, used = self.cpu_seen
            if (cpu - used) / (now - then) > IDLE_ALLOWANCE:
                self.computed_at = now
        self.cpu_seen = (now, cpu)


class Act(Enum):
    NOTHING = "nothing"
    EXITED = "exited"  # the kernel ended on its own: note why, answer its clients
    INTERRUPT = "interrupt"  # SIGINT: an execution outran its wall-clock limit
    KILL = "kill"  # SIGKILL, telling clients ``ename``: ``reason``
    STOP_IDLE = "stop-idle"  # stop for good (no restart): idle past its limit
    PAUSE = "pause"  # save to disk and stop, until a client's next message: idle a while
    FREEZE = "freeze"  # stop scheduling it, until a client's next message: quiet a while


@dataclass(frozen=True)
class Verdict:
    act: Act
    ename: str = ""
    reason: str = ""
    #: For the server's log: what was seen.
    why: str = ""


NOTHING = Verdict(Act.NOTHING)


def memory_reason(memory: str) -> str:
    return (
        f"memory limit {memory} exceeded: the kernel was stopped and its variables are lost. "
        "Restart the kernel to go on (JupyterLab does it for you), and use less memory at once "
        "(files in /tmp count) or ask for a higher limit"
    )


def idle_reason(idle_timeout: float) -> str:
    return (
        f"stopped after {idle_timeout:g} s without executions (idle limit, sandbox-kernel "
        "idle_timeout) to free its memory; its variables are gone. Restart the kernel to continue"
    )


def judge(look: Look, watch: Watch, limits: WatchLimits) -> Verdict:
    """What to do about a kernel, from one look and what earlier looks left in ``watch``.

    In order: it ended; the host's OOM killer hit it without ending it (it hangs for
    good, see .cgroups); it keeps computing with no execution running; it is idle past
    its limit; it is idle long enough to pause; quiet (no client's message, no execution,
    no computing) long enough to freeze; an
    execution outran its wall-clock limit (interrupt, then kill).

    A frozen kernel's time does not count for the CPU it may use with no execution
    running: the allowance is for gVisor's idle work, which a frozen sandbox does not do,
    so a thread that computes between freezes adds up as it would without them.
    """
    if look.deep:
        if look.exit_code is not None:
            return Verdict(Act.EXITED)
        if watch.oom_baseline is None:
            watch.oom_baseline = look.oom_kills
        elif look.oom_kills is not None and look.oom_kills > watch.oom_baseline:
            return Verdict(
                Act.KILL,
                "MemoryLimitExceeded",
                memory_reason(limits.memory),
                f"ran out of memory (limit {limits.memory}) and hangs",
            )
        watch.note_cpu(look.now, look.cpu)
        if limits.exec_timeout > 0:
            untracked = watch.compute.observe(look.now - look.frozen_seconds, look.cpu, look.busy)
            if exceeds_exec_timeout(untracked, limits.exec_timeout, limits.exec_kill_grace):
                reason = (
                    f"killed: it kept computing for more than {limits.exec_timeout:g} s with no execution "
                    "running (a background thread, or code that answered for its own cell), beyond the "
                    "wall-clock limit per execution; it loses its state and must be restarted "
                    "(JupyterLab does it for you)"
                )
                why = f"kept computing for {untracked:g} CPU-seconds with no execution running"
                return Verdict(Act.KILL, "WallClockLimitExceeded", reason, why)
    if limits.idle_timeout > 0 and look.idle_for is not None and look.idle_for >= limits.idle_timeout:
        return Verdict(Act.STOP_IDLE, "IdleLimitExceeded", idle_reason(limits.idle_timeout), "idle")
    if limits.pause_after > 0 and look.idle_for is not None and look.idle_for >= limits.pause_after:
        if look.deep and not look.busy:
            return Verdict(
                Act.PAUSE, why=f"idle for {look.idle_for:.0f} s (pause_after {limits.pause_after:g} s)"
            )
        return NOTHING
    if limits.freeze_after > 0 and not look.frozen and (look.quiet_for or 0) >= limits.freeze_after:
        if look.deep and not look.busy and look.now - watch.computed_at >= limits.freeze_after:
            return Verdict(
                Act.FREEZE,
                why=f"quiet for {look.quiet_for:.0f} s (freeze_idle_after {limits.freeze_after:g} s)",
            )
        return NOTHING
    limit, grace = limits.exec_timeout, limits.exec_kill_grace
    if limit <= 0 or look.running is None:
        return NOTHING
    msg_id, age = look.running
    if age < limit + min(2.0, grace / 2):
        return NOTHING
    if watch.interrupted != msg_id:
        watch.interrupted = msg_id
        return Verdict(Act.INTERRUPT, why=f"an execution ignored its {limit:g} s wall-clock limit")
    if age >= limit + grace:
        reason = (
            f"killed: wall-clock limit of {limit:g} s per execution exceeded and the "
            "interrupt ignored; it loses its state and must be restarted "
            "(JupyterLab does it for you)"
        )
        why = f"an execution ignored its {limit:g} s wall-clock limit and the interrupt"
        return Verdict(Act.KILL, "WallClockLimitExceeded", reason, why)
    return NOTHING
