"""Pure judgements of a kernel's watchdog, from what the host can observe and trust.

The kernel's own messages are its word: code in it can forge an ``execute_reply`` for
the running request and keep computing, and the host would see an idle kernel. The
container's CPU time is not its word; it is read from the host's cgroup.
"""

from __future__ import annotations

from dataclasses import dataclass

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
