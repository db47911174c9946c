"""The watchdog's pure judgements: CPU the host sees, not what the kernel says."""

from __future__ import annotations

from sandbox_kernel.watchdog import UntrackedCompute, exceeds_exec_timeout


def test_a_kernel_spinning_after_its_reply_runs_into_the_limit() -> None:
    meter = UntrackedCompute()
    seconds = 0.0
    for t in range(1, 11):  # one core busy, no execution running
        seconds = meter.observe(now=float(t), cpu=float(t), busy=False)
    assert 7 < seconds < 8  # 9 s of CPU over 9 s, less the idle allowance
    assert exceeds_exec_timeout(seconds, exec_timeout=5, grace=2)
    assert not exceeds_exec_timeout(seconds, exec_timeout=0, grace=2)  # no limit set


def test_idle_work_and_requests_being_worked_on_do_not_count() -> None:
    meter = UntrackedCompute()
    for t in range(1, 101):  # gVisor's idle cost, ~6 % of a core
        assert meter.observe(now=float(t), cpu=0.06 * t, busy=False) == 0.0
    cpu = 6.0
    for t in range(101, 111):  # a running execution, a completion: the request's CPU
        cpu += 1.0
        assert meter.observe(now=float(t), cpu=cpu, busy=True) == 0.0


def test_bursts_drain_away_but_a_steady_half_core_does_not() -> None:
    """New cells do not empty the bucket: a background thread cannot hide behind an
    assistant that runs a cell every minute."""
    burst = UntrackedCompute()
    burst.observe(0.0, 0.0, busy=False)
    assert burst.observe(1.0, 1.0, busy=False) > 0.8
    assert burst.observe(20.0, 1.0, busy=False) == 0.0  # drained by idle time
    steady = UntrackedCompute()
    seconds = 0.0
    for t in range(0, 120):
        seconds = steady.observe(float(t), 0.5 * t, busy=t % 60 < 2)  # a short cell every minute
    assert exceeds_exec_timeout(seconds, exec_timeout=30, grace=5)


def test_an_unknown_cpu_reading_counts_nothing() -> None:
    meter = UntrackedCompute()
    meter.observe(0.0, 0.0, busy=False)
    assert meter.observe(1.0, None, busy=False) == 0.0
    assert meter.observe(2.0, 50.0, busy=False) == 0.0  # no baseline yet
