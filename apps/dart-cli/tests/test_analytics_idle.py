"""The idle breakdown: every category computed exactly from synthetic intervals and events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dart.cli.analytics import idle_breakdown, idle_breakdown_from_dir
from dart.runtime.telemetry import BusyInterval, BusyTracker, TelemetryConfig, setup_telemetry

pytestmark = pytest.mark.unit

S = 1_000_000_000
T0 = 1_700_000_000 * S
COUNTS = {"env": 2, "engine": 2, "runner": 2, "trainer": 1}


def iv(kind: str, rid: str, activity: str, a: float, b: float) -> BusyInterval:
    return BusyInterval(kind, rid, activity, T0 + int(a * S), T0 + int(b * S))


def event(name: str, at: float, **attrs: Any) -> dict[str, Any]:
    return {"type": "event", "name": name, "ts_unix_ns": T0 + int(at * S), "attributes": attrs}


def scenario() -> tuple[list[BusyInterval], list[dict[str, Any]]]:
    """10 s window, 2 envs, 2 runners, 2 engines, 1 trainer, with known answers."""
    intervals = [
        # runner-0 holds env-0 from 0 to 8: waits 1 s for an engine, generates 2 s, 4 s of env calls
        iv("runner", "runner-0", "lease_wait", 0, 0),
        iv("runner", "runner-0", "leased", 0, 1),
        iv("runner", "runner-0", "pick", 1, 2),
        iv("runner", "runner-0", "generate", 2, 4),
        iv("runner", "runner-0", "env_call", 4, 8),
        # runner-1 waits 2 s for a lease, then holds env-1 from 2 to 6, generating 1 s
        iv("runner", "runner-1", "lease_wait", 0, 2),
        iv("runner", "runner-1", "env_call", 2, 5),
        iv("runner", "runner-1", "generate", 5, 6),
        # the envs themselves: busy 3.5 s of runner-0's 4 s env calls (0.5 s is bus round trips)
        iv("env", "env-0", "reset", 4, 6),
        iv("env", "env-0", "step", 6, 7.5),
        iv("env", "env-1", "reset", 2, 5),
        # engines: generating 3 s and 1 s; engine-1 also updates for 2 s
        iv("engine", "engine-0", "generate", 2, 4),
        iv("engine", "engine-0", "generate", 3, 5),  # overlaps: counted once
        iv("engine", "engine-1", "generate", 5, 6),
        # trainer: trains 4 s, publishes 1 s
        iv("trainer", "trainer-0", "train_step", 1, 5),
        iv("trainer", "trainer-0", "publish", 5, 6),
        # outside the window: ignored
        iv("env", "env-0", "step", 20, 30),
    ]
    events = [
        event("engine.update.end", 9, engine_id="engine-1", started_at=(T0 + 7 * S) / 1e9, version=1),
        event("data.round", 10, sync_s=3.0),  # the pipeline waited for weights from 7 to 10
        event("trainer.step", 5, samples=4),  # not used
    ]
    return intervals, events


def test_every_category_of_a_known_scenario() -> None:
    intervals, events = scenario()
    b = idle_breakdown(intervals, events, T0, T0 + 10 * S, COUNTS)
    assert b.wall_s == 10
    env = b.seconds["env"]
    # leased: runner-0 8 s + runner-1 4 s = 12; busy 3.5 + 3 = 6.5; pick 1, generate 3
    assert env == pytest.approx(
        {"busy": 6.5, "waiting_for_weights": 1.0, "waiting_for_action": 3.0, "leased_overhead": 1.5, "no_lease": 8.0}
    )
    assert b.seconds["engine"] == pytest.approx(
        {"generating": 4.0, "updating_weights": 2.0, "waiting_for_requests": 14.0}
    )
    assert b.seconds["trainer"] == pytest.approx({"training": 4.0, "publishing": 1.0, "waiting_for_batches": 5.0})
    assert b.seconds["runner"] == pytest.approx({"in_lease": 12.0, "lease_wait": 2.0, "waiting_for_work": 6.0})
    assert b.seconds["pipeline"] == pytest.approx({"barrier_waiting_for_weights": 3.0, "running": 7.0})
    assert b.fractions["env"]["busy"] == pytest.approx(6.5 / 20)
    for kind, cats in b.fractions.items():
        assert sum(cats.values()) == pytest.approx(1.0), kind
    assert b.to_dict()["counts"] == COUNTS


def test_window_clips_every_interval_and_event() -> None:
    intervals, events = scenario()
    b = idle_breakdown(intervals, events, T0 + 5 * S, T0 + 8 * S, COUNTS)
    assert b.seconds["env"]["busy"] == pytest.approx(2.5)  # env-0 5..7.5
    assert b.seconds["engine"]["updating_weights"] == pytest.approx(1.0)  # 7..8
    assert b.seconds["pipeline"]["barrier_waiting_for_weights"] == pytest.approx(1.0)  # 7..8
    assert b.seconds["trainer"]["publishing"] == pytest.approx(1.0)


def test_decoupled_run_has_no_barrier_and_unknown_kinds_are_left_out() -> None:
    intervals, _ = scenario()
    b = idle_breakdown(intervals, [], T0, T0 + 10 * S, {"env": 2})
    assert set(b.seconds) == {"env", "pipeline"}
    assert b.seconds["pipeline"]["barrier_waiting_for_weights"] == 0


def test_env_busy_without_runner_records_counts_as_leased() -> None:
    # Runners without telemetry: env busy time still bounds leased time from below.
    b = idle_breakdown([iv("env", "env-0", "step", 0, 4)], [], T0, T0 + 10 * S, {"env": 1})
    assert b.seconds["env"] == pytest.approx(
        {"busy": 4, "waiting_for_action": 0, "waiting_for_weights": 0, "leased_overhead": 0, "no_lease": 6}
    )


def test_bad_windows_and_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="empty window"):
        idle_breakdown([], [], T0, T0, COUNTS)
    with pytest.raises(ValueError, match="negative"):
        idle_breakdown([], [], T0, T0 + S, {"env": -1})


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["env", "runner", "engine", "trainer"]),
            st.sampled_from(["a", "b"]),
            st.sampled_from(["leased", "pick", "generate", "env_call", "lease_wait", "step", "train_step"]),
            st.integers(0, 20),
            st.integers(0, 20),
        ),
        max_size=30,
    )
)
def test_fractions_always_add_up_and_stay_in_range(raw: list[tuple[str, str, str, int, int]]) -> None:
    intervals = [BusyInterval(k, r, a, T0 + min(x, y) * S, T0 + max(x, y) * S) for k, r, a, x, y in raw]
    b = idle_breakdown(intervals, [], T0 + 2 * S, T0 + 12 * S, COUNTS)
    for kind, cats in b.fractions.items():
        assert sum(cats.values()) == pytest.approx(1.0), kind
        assert all(-1e-9 <= v <= 1 + 1e-9 for v in cats.values()), (kind, cats)


def test_from_telemetry_files(tmp_path: Path) -> None:
    """Trackers writing through a real Telemetry sink are read back the same way."""
    clock = iter(T0 + i * S for i in range(100))
    tel = setup_telemetry(
        "dart-rollout", version="0", run_id="r", config=TelemetryConfig(run_dir=tmp_path, metric_export_interval_s=60)
    )
    try:
        runner = BusyTracker("runner", "runner-0", tel, clock=lambda: next(clock))
        env = BusyTracker("env", "env-0", tel, clock=lambda: next(clock))
        lease = runner.begin("leased")  # t=2 (creation took 0 and 1)
        with env.busy("reset"):  # 3..4
            pass
        with runner.busy("generate"):  # 5..6
            pass
        runner.end(lease)  # 7
    finally:
        tel.shutdown()
    b = idle_breakdown_from_dir(tmp_path, T0, T0 + 10 * S, {"env": 1, "runner": 1})
    assert b.seconds["env"] == pytest.approx(
        {"busy": 1, "waiting_for_action": 1, "waiting_for_weights": 0, "leased_overhead": 3, "no_lease": 5}
    )
