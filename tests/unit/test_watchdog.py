"""The watchdog's pure judgements: CPU the host sees, not what the kernel says."""

from __future__ import annotations

from dataclasses import replace

from sandbox_kernel.lifecycle.judge import UntrackedCompute, exceeds_exec_timeout


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


# ---------------------------------------------------------------- judge()

from sandbox_kernel.lifecycle.judge import Act, Look, Watch, WatchLimits, judge  # noqa: E402

LIMITS = WatchLimits(exec_timeout=10, exec_kill_grace=4, idle_timeout=0, memory="1g")


def test_an_ended_kernel_is_noted_once_seen() -> None:
    assert judge(Look(0, deep=True, exit_code=137), Watch(), LIMITS).act is Act.EXITED
    # The cheap half-second look does not ask Docker: it cannot tell.
    assert judge(Look(0, exit_code=137), Watch(), LIMITS).act is Act.NOTHING


def test_an_execution_past_its_limit_is_interrupted_then_killed() -> None:
    watch = Watch()
    assert judge(Look(0, running=("a", 11.0)), watch, LIMITS).act is Act.NOTHING  # within 2 s
    assert judge(Look(0, running=("a", 12.0)), watch, LIMITS).act is Act.INTERRUPT
    assert judge(Look(0, running=("a", 13.0)), watch, LIMITS).act is Act.NOTHING  # interrupted once
    verdict = judge(Look(0, running=("a", 14.0)), watch, LIMITS)
    assert (verdict.act, verdict.ename) == (Act.KILL, "WallClockLimitExceeded")
    assert "10 s" in verdict.reason
    # A new execution gets its own interrupt.
    assert judge(Look(0, running=("b", 12.0)), watch, LIMITS).act is Act.INTERRUPT


def test_an_oom_kill_that_left_the_kernel_hanging_is_ended() -> None:
    watch = Watch()
    assert judge(Look(0, deep=True, oom_kills=2), watch, LIMITS).act is Act.NOTHING  # baseline
    assert judge(Look(1, deep=True, oom_kills=2), watch, LIMITS).act is Act.NOTHING
    verdict = judge(Look(2, deep=True, oom_kills=3), watch, LIMITS)
    assert (verdict.act, verdict.ename) == (Act.KILL, "MemoryLimitExceeded")
    assert "memory limit 1g exceeded" in verdict.reason


def test_computing_with_no_execution_running_is_killed_by_the_host_seen_cpu() -> None:
    watch = Watch()
    verdicts = [judge(Look(float(t), deep=True, cpu=float(t)), watch, LIMITS) for t in range(20)]
    kill = next(v for v in verdicts if v.act is not Act.NOTHING)
    assert (kill.act, kill.ename) == (Act.KILL, "WallClockLimitExceeded")
    assert "no execution running" in kill.reason
    # With no wall-clock limit, nothing bounds it.
    free = Watch()
    limits = WatchLimits(exec_timeout=0)
    assert all(
        judge(Look(float(t), deep=True, cpu=float(t)), free, limits).act is Act.NOTHING for t in range(20)
    )


def test_an_idle_kernel_is_stopped_only_past_its_idle_limit() -> None:
    limits = WatchLimits(idle_timeout=60)
    assert judge(Look(0, idle_for=59.0), Watch(), limits).act is Act.NOTHING
    assert judge(Look(0, idle_for=None), Watch(), limits).act is Act.NOTHING  # an execution pending
    verdict = judge(Look(0, idle_for=60.0), Watch(), limits)
    assert (verdict.act, verdict.ename) == (Act.STOP_IDLE, "IdleLimitExceeded")


def test_an_idle_kernel_is_paused_past_pause_after_unless_a_request_awaits_its_reply() -> None:
    limits = WatchLimits(pause_after=30)
    assert judge(Look(0, deep=True, idle_for=29.0), Watch(), limits).act is Act.NOTHING
    assert judge(Look(0, deep=True, idle_for=30.0), Watch(), limits).act is Act.PAUSE
    # A request awaits its reply (a completion, say); or whether one does is not known yet.
    assert judge(Look(0, deep=True, idle_for=30.0, busy=True), Watch(), limits).act is Act.NOTHING
    assert judge(Look(0, idle_for=30.0), Watch(), limits).act is Act.NOTHING
    # Idle past both limits: the idle limit, which frees the memory for good, wins.
    both = WatchLimits(pause_after=30, idle_timeout=30)
    assert judge(Look(0, deep=True, idle_for=31.0), Watch(), both).act is Act.STOP_IDLE


def test_a_quiet_kernel_is_frozen_once_nobody_used_it_for_freeze_after() -> None:
    """Quiet: no execution and no client message for that long (the host's record, never
    the kernel's word); decided on the once-a-second look, with no request awaiting its reply."""
    limits = WatchLimits(freeze_after=30)
    assert judge(Look(0, deep=True, idle_for=600.0, quiet_for=29.0), Watch(), limits).act is Act.NOTHING
    assert judge(Look(0, deep=True, idle_for=600.0, quiet_for=30.0), Watch(), limits).act is Act.FREEZE
    assert judge(Look(0, deep=True, idle_for=None, quiet_for=None), Watch(), limits).act is Act.NOTHING
    assert judge(Look(0, deep=True, quiet_for=30.0, busy=True), Watch(), limits).act is Act.NOTHING
    assert judge(Look(0, quiet_for=30.0), Watch(), limits).act is Act.NOTHING
    assert judge(Look(0, deep=True, quiet_for=60.0, frozen=True), Watch(), limits).act is Act.NOTHING
    never = WatchLimits(freeze_after=0)
    assert judge(Look(0, deep=True, idle_for=1e6, quiet_for=1e6), Watch(), never).act is Act.NOTHING


def test_a_kernel_whose_threads_compute_is_not_frozen_until_they_stop() -> None:
    """Work in a thread (a training loop, a local cluster) with no cell running and no
    client talking goes on: the sandbox's CPU time over 0.15 cores (gVisor's own idle
    work stays below) keeps it thawed, until it has been quiet that long too."""
    limits = WatchLimits(freeze_after=30)
    watch = Watch()
    quiet = Look(0, deep=True, idle_for=600.0, quiet_for=600.0, cpu=0.0)
    assert judge(quiet, watch, limits).act is Act.NOTHING  # what its threads do: not known yet
    for second in range(1, 100):  # a thread computing flat out
        computing = replace(quiet, now=float(second), cpu=float(second))
        assert judge(computing, watch, limits).act is Act.NOTHING
    idle_cpu = 99.0
    for second in range(100, 129):  # it stopped; gVisor's idle work, 3 % of a core
        idle_cpu += 0.03
        assert judge(replace(quiet, now=float(second), cpu=idle_cpu), watch, limits).act is Act.NOTHING
    assert judge(replace(quiet, now=129.0, cpu=idle_cpu + 0.03), watch, limits).act is Act.FREEZE


def test_a_frozen_kernel_still_pauses_and_stops_at_its_idle_limits() -> None:
    """The pause and the idle limit come before a freeze; the watchdog thaws it to carry them out."""
    limits = WatchLimits(freeze_after=30, pause_after=600, idle_timeout=3600)
    frozen = Look(0, deep=True, idle_for=600.0, quiet_for=600.0, frozen=True)
    assert judge(frozen, Watch(), limits).act is Act.PAUSE
    assert judge(replace(frozen, idle_for=3600.0), Watch(), limits).act is Act.STOP_IDLE
    # A freeze after the pause would never come: the pause is first, as it frees more.
    late = WatchLimits(freeze_after=900, pause_after=600)
    assert judge(Look(0, deep=True, idle_for=900.0, quiet_for=900.0), Watch(), late).act is Act.PAUSE


def test_frozen_time_neither_fills_nor_drains_the_untracked_compute() -> None:
    """A thread that computes between freezes adds up as it would without them: the idle
    allowance is for gVisor's idle work, which a frozen sandbox does not do."""
    limits = WatchLimits(exec_timeout=20, exec_kill_grace=5, freeze_after=30)
    watch, cpu, frozen_total, now, computed = Watch(), 0.0, 0.0, 0.0, 0
    verdict = judge(Look(now, deep=True, cpu=cpu), watch, limits)
    while verdict.act is not Act.KILL and computed < 100:
        if computed and computed % 10 == 0:  # 10 s computing flat out, then 1000 s frozen
            now, frozen_total = now + 1000, frozen_total + 1000
        now, cpu, computed = now + 1, cpu + 1, computed + 1
        verdict = judge(Look(now, deep=True, cpu=cpu, frozen_seconds=frozen_total), watch, limits)
    assert (verdict.act, verdict.ename) == (Act.KILL, "WallClockLimitExceeded")
    assert computed <= 30, "(exec_timeout + grace) / (1 - the idle allowance) seconds of computing"
