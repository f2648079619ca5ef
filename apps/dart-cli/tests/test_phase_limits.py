"""How long `dart run`'s phases last: the warm start takes its steps unless a machine is stuck (the guard's
arithmetic), and the RL phase ends by duration, by versions or at its hard limit, saying which."""

from __future__ import annotations

import pytest

from dart.cli.stack.config import RunSection, WarmStartSection
from dart.cli.stack.rl_clock import RlPhaseClock
from dart.cli.stack.summary import phase_times
from dart.cli.stack.warmstart_guard import REFERENCE_STEPS, WarmStartGuard, guard_limit_s, warm_start_row

pytestmark = pytest.mark.unit


def test_the_limit_is_a_multiple_of_the_expected_time_and_never_below_the_floor() -> None:
    assert guard_limit_s(2.0, 700, 10.0, 600.0) == 14_000.0  # 10 x (2 s x 700 steps)
    assert guard_limit_s(0.1, 60, 10.0, 600.0) == 600.0  # 60 s of expected work: the floor
    assert WarmStartGuard(700, 10.0, 600.0).limit_s == float("inf")  # nothing measured yet


def _run(guard: WarmStartGuard, step_times: list[float]) -> int:
    """Feed ``step_times`` to ``guard`` as the warm start would; the steps taken."""
    for done, step_s in enumerate(step_times, start=1):
        if guard.step_done(step_s):
            return done
    return len(step_times)


def test_a_machine_slow_from_the_start_takes_every_step() -> None:
    guard = WarmStartGuard(700, 10.0, 600.0)
    assert _run(guard, [5.0] * 700) == 700  # 3,500 s, far past the old fixed 900 s cap
    assert guard.cut_by is None
    assert guard.report() == {"warm_start_cut": False, "warm_start_planned_steps": 700}


def test_a_machine_that_slows_down_under_load_takes_every_step() -> None:
    # Quiet for the reference steps, then 6x slower for the rest: under 10 x the expected time.
    guard = WarmStartGuard(700, 10.0, 600.0)
    assert _run(guard, [0.3] * REFERENCE_STEPS + [1.8] * (700 - REFERENCE_STEPS)) == 700
    assert guard.cut_by is None


def test_a_stuck_machine_is_cut_with_the_steps_done_reported() -> None:
    # 0.05 s steps: 35 s expected, so the floor (600 s) is the limit; then steps of 100 s.
    guard = WarmStartGuard(700, 10.0, 600.0)
    done = _run(guard, [0.05] * 20 + [100.0] * 680)
    assert done == 26  # 1 s + 5 x 100 s = 501 s, then 601 s > 600 s
    assert guard.cut_by == "guard" and guard.done == done
    report = guard.report()
    assert report == {
        "warm_start_cut": True,
        "warm_start_planned_steps": 700,
        "warm_start_cut_by": "guard",
        "warm_start_limit_s": 600.0,
    }
    row = warm_start_row({"warm_start_steps": done, **report})
    assert row is not None and "CUT at 26 of 700 steps by guard" in row


def test_the_reference_is_the_median_of_the_first_steps() -> None:
    guard = WarmStartGuard(100, 10.0, 1.0)
    guard.step_done(50.0)  # the first step allocates and warms caches
    for _ in range(REFERENCE_STEPS - 1):
        guard.step_done(1.0)
    assert guard.limit_s == 10.0 * 1.0 * 100
    guard.step_done(1_000.0)  # later steps do not move the reference
    assert guard.limit_s == 1_000.0


def test_max_seconds_is_a_hard_limit_on_top_of_the_guard() -> None:
    guard = WarmStartGuard(100, 10.0, 600.0, max_seconds=30.0)
    assert _run(guard, [1.0] * 100) == 31
    assert guard.report()["warm_start_cut_by"] == "max_seconds"
    assert guard.report()["warm_start_limit_s"] == 30.0


def test_the_last_step_is_never_a_cut() -> None:
    guard = WarmStartGuard(3, 10.0, 1.0, max_seconds=1.0)
    assert _run(guard, [0.1, 0.1, 5.0]) == 3
    assert guard.cut_by is None


def test_the_defaults_guard_without_a_fixed_cap() -> None:
    ws = WarmStartSection()
    assert ws.max_seconds is None and ws.max_slowdown == 10.0 and ws.guard_floor_s == 600.0


def _clock(duration_s: float, min_versions: int, max_s: float | None = None) -> RlPhaseClock:
    return RlPhaseClock.start(1_000.0, duration_s, min_versions, max_s)


def test_rl_ends_by_duration_when_the_versions_are_out() -> None:
    clock = _clock(480.0, 0)
    assert clock.ended_by(1_000.0 + 479.0, 0) is None
    assert clock.ended_by(1_000.0 + 480.0, 0) == "duration"
    assert _clock(60.0, 2).ended_by(1_060.0, 5) == "duration"  # they came before the duration passed


def test_rl_ends_by_versions_when_it_waited_for_them() -> None:
    clock = _clock(60.0, 40, 1_800.0)
    assert clock.ended_by(1_030.0, 12) is None
    assert clock.ended_by(1_060.0, 12) is None  # past the duration: waits for version 40
    assert clock.ended_by(1_900.0, 39) is None
    assert clock.ended_by(1_901.0, 40) == "versions"


def test_rl_ends_at_the_hard_limit_when_the_versions_do_not_come() -> None:
    clock = _clock(60.0, 40, 1_800.0)
    assert clock.ended_by(1_060.0, 3) is None
    assert clock.ended_by(2_800.0, 39) == "max_duration"
    assert _clock(75.0, 2).max_duration_s == 300.0  # None: 4 x rl_duration_s


def test_the_quickstart_runs_to_versions_with_a_cap() -> None:
    from pathlib import Path

    from dart.cli.stack.config import load_run_config

    config = load_run_config(Path(__file__).resolve().parents[3] / "examples" / "quickstart.yaml")
    run: RunSection = config.run
    assert run.min_versions > 0 and run.max_rl_duration_s is not None
    assert run.rl_duration_s < run.max_rl_duration_s
    assert config.warm_start.max_seconds is None  # its steps decide; only the guard stops a stuck machine


def test_the_run_ends_by_printing_where_its_time_went() -> None:
    summary = {
        "model_init_s": 2.5,
        "warm_start_s": 1_300.0,
        "warm_start_steps": 476,
        "warm_start_planned_steps": 700,
        "warm_start_cut": True,
        "warm_start_steps_by_threads": {"1": 400, "2": 76},
        "rl_seconds": 1_800.2,
        "versions_published": 61,
        "rl_ended_by": "max_duration",
        "total_seconds": 3_200.0,
    }
    assert phase_times(summary) == (
        "phases: model init 2.5 s, warm start 1300.0 s (476 of 700 steps CUT; steps by threads 1: 400, 2: 76), "
        "RL 1800.2 s (61 versions, ended by max_duration), total 3200.0 s"
    )
    reused = {"warm_start_cached": True, "rl_seconds": 60.0, "versions_published": 80, "rl_ended_by": "versions"}
    assert phase_times({**reused, "total_seconds": 70.0}) == (
        "phases: warm start reused, RL 60.0 s (80 versions, ended by versions), total 70.0 s"
    )
