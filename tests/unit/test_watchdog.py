"""The watchdog's pure judgements: CPU the host sees, not what the kernel says."""

from __future__ import annotations

from sandbox_kernel.watchdog import UntrackedCompute, exceeds_exec_timeout


def test_a_kernel_spinning_after_its_reply_runs_into_the_limit() -> None:
    meter = UntrackedCompute()
    seconds = 0.0
    for t in range(1, 11):  # one core busy, no execution running
        seconds = meter.observe(now=float(t), cpu=float(t), busy=False, new_execution=False)
    assert 7 < seconds < 8  # 9 s of CPU over 9 s, less the idle allowance
    assert exceeds_exec_timeout(seconds, exec_timeout=5, grace=2)
    assert not exceeds_exec_timeout(seconds, exec_timeout=0, grace=2)  # no limit set


def test_idle_work_and_executions_do_not_count() -> None:
    meter = UntrackedCompute()
    for t in range(1, 101):  # gVisor's idle cost, ~6 % of a core
        assert meter.observe(now=float(t), cpu=0.06 * t, busy=False, new_execution=False) == 0.0
    cpu = 6.0
    for t in range(101, 111):  # a running execution: the wall clock's business
        cpu += 1.0
        assert meter.observe(now=float(t), cpu=cpu, busy=True, new_execution=False) == 0.0


def test_a_new_execution_starts_the_count_again() -> None:
    meter = UntrackedCompute()
    meter.observe(0.0, 0.0, busy=False, new_execution=False)
    assert meter.observe(1.0, 1.0, busy=False, new_execution=False) > 0.8
    assert meter.observe(2.0, 1.0, busy=False, new_execution=True) == 0.0


def test_an_unknown_cpu_reading_counts_nothing() -> None:
    meter = UntrackedCompute()
    meter.observe(0.0, 0.0, busy=False, new_execution=False)
    assert meter.observe(1.0, None, busy=False, new_execution=False) == 0.0
    assert meter.observe(2.0, 50.0, busy=False, new_execution=False) == 0.0  # no baseline yet
