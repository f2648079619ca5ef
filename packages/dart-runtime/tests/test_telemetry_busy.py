"""Busy/idle accounting: exact interval arithmetic with an injected clock, no sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dart.runtime.telemetry import (
    BusyInterval,
    BusyTracker,
    Telemetry,
    TelemetryConfig,
    busy_ns,
    load_busy_intervals,
    merge_intervals,
    observed_window,
    read_jsonl,
    setup_telemetry,
    utilization,
    utilization_timeline,
)

pytestmark = pytest.mark.unit

S = 1_000_000_000  # one second in ns
T0 = 1_700_000_000 * S  # an arbitrary Unix time


class FakeClock:
    """A settable clock in Unix ns."""

    def __init__(self, t: int = T0) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t

    def at(self, seconds: float) -> FakeClock:
        self.t = T0 + int(seconds * S)
        return self


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def telemetry(tmp_path: Path) -> Iterator[Telemetry]:
    tel = setup_telemetry(
        "dart-env", version="0", run_id="r", config=TelemetryConfig(run_dir=tmp_path, metric_export_interval_s=60)
    )
    yield tel
    tel.shutdown()


def spans(tracker: BusyTracker) -> list[tuple[str, float, float]]:
    return [(i.activity, (i.start_ns - T0) / S, (i.end_ns - T0) / S) for i in tracker.intervals()]


def test_three_sections_accumulate_exactly(clock: FakeClock) -> None:
    tracker = BusyTracker("env", "env-0", clock=clock)
    for start, end, activity in [(1, 3, "reset"), (4, 5, "step"), (7, 10, "step")]:
        clock.at(start)
        with tracker.busy(activity):
            clock.at(end)
    assert spans(tracker) == [("reset", 1, 3), ("step", 4, 5), ("step", 7, 10)]
    assert tracker.totals() == {"reset": 2.0, "step": 4.0}
    assert tracker.busy_seconds == 6.0
    assert tracker.utilization(now_ns=clock.at(10).t) == 0.6  # created at 0, 6 busy of 10
    assert tracker.utilization(window_s=5, now_ns=T0 + 10 * S) == 3 / 5  # [5, 10): 7..10 busy
    assert not tracker.is_busy


def test_nested_sections_refine_instead_of_double_counting(clock: FakeClock) -> None:
    tracker = BusyTracker("trainer", "rank-0", clock=clock)
    with tracker.busy("train_step"):
        clock.at(2)
        with tracker.busy("backward"):
            clock.at(5)
        clock.at(10)
    assert spans(tracker) == [("train_step", 0, 2), ("backward", 2, 5), ("train_step", 5, 10)]
    assert tracker.totals() == {"train_step": 7.0, "backward": 3.0}
    assert tracker.busy_seconds == 10.0


def test_overlapping_sections_count_once(clock: FakeClock) -> None:
    # An engine serving two requests at once is busy 10 s, not 12.
    tracker = BusyTracker("engine", "e0", clock=clock)
    a = tracker.begin("generate")
    clock.at(4)
    b = tracker.begin("generate")
    clock.at(6)
    tracker.end(a)
    clock.at(10)
    tracker.end(b)
    assert spans(tracker) == [("generate", 0, 10)]
    assert tracker.busy_seconds == 10.0


def test_overlapping_different_activities_attribute_to_the_newest(clock: FakeClock) -> None:
    tracker = BusyTracker("engine", "e0", clock=clock)
    gen = tracker.begin("generate")
    clock.at(4)
    upd = tracker.begin("update_weights")
    clock.at(6)
    tracker.end(gen)  # the newest open section is still update_weights: no cut
    clock.at(8)
    tracker.end(upd)
    assert spans(tracker) == [("generate", 0, 4), ("update_weights", 4, 8)]
    assert sum(tracker.totals().values()) == 8.0


def test_in_progress_section_counts_in_totals_and_utilization(clock: FakeClock) -> None:
    tracker = BusyTracker("env", "env-0", clock=clock)
    clock.at(2)
    token = tracker.begin("step")
    clock.at(5)
    assert tracker.is_busy
    assert tracker.totals() == {"step": 3.0}
    assert tracker.utilization() == 3 / 5
    assert tracker.intervals() == []
    tracker.checkpoint()
    assert spans(tracker) == [("step", 2, 5)]
    clock.at(6)
    tracker.end(token)
    assert spans(tracker) == [("step", 2, 5), ("step", 5, 6)]


def test_misuse_is_reported(clock: FakeClock) -> None:
    tracker = BusyTracker("env", "env-0", clock=clock)
    token = tracker.begin()
    tracker.end(token)
    with pytest.raises(ValueError, match="env/env-0"):
        tracker.end(token)
    section = tracker.busy("x")
    with section, pytest.raises(RuntimeError, match="once"), section:
        pass


def test_a_clock_stepping_back_never_yields_negative_time(clock: FakeClock) -> None:
    tracker = BusyTracker("env", "env-0", clock=clock.at(5))
    with tracker.busy("step"):
        clock.at(3)
    assert tracker.intervals() == [] and tracker.busy_seconds == 0.0


async def test_async_with(clock: FakeClock) -> None:
    tracker = BusyTracker("env", "env-0", clock=clock)

    async def step(start: float, end: float) -> None:
        clock.at(start)
        async with tracker.busy("step"):
            await asyncio.sleep(0)
            clock.at(end)

    await step(1, 2)
    await step(3, 5)
    assert tracker.totals() == {"step": 3.0}


def test_intervals_and_metrics_reach_jsonl(telemetry: Telemetry, clock: FakeClock) -> None:
    envs = [telemetry.busy_tracker("env", f"env-{i}", clock=clock) for i in range(2)]
    clock.at(0)
    for start, end, env in [(0, 4, 0), (5, 7, 0), (2, 10, 1)]:
        clock.at(start)
        token = envs[env].begin("step")
        clock.at(end)
        envs[env].end(token)
    clock.at(8)
    open_section = envs[0].begin("reset")  # still open at shutdown: checkpointed up to now
    clock.at(9)
    telemetry.shutdown()
    del open_section

    records = list(read_jsonl(telemetry.jsonl_path, types={"busy"}))
    got = sorted((r["resource_id"], r["activity"], r["start_unix_ns"] - T0, r["end_unix_ns"] - T0) for r in records)
    assert got == [
        ("env-0", "reset", 8 * S, 9 * S),
        ("env-0", "step", 0, 4 * S),
        ("env-0", "step", 5 * S, 7 * S),
        ("env-1", "step", 2 * S, 10 * S),
    ]
    assert all(r["service"] == "dart-env" and r["run_id"] == "r" for r in records)

    intervals = load_busy_intervals(telemetry.jsonl_path)
    assert busy_ns([i for i in intervals if i.resource_id == "env-0"], T0, T0 + 10 * S) == 7 * S

    metrics = [r for r in read_jsonl(telemetry.jsonl_path, types={"metric"}) if r["name"] == "dart.resource.busy.time"]
    totals = {(m["attributes"]["resource.id"], m["attributes"]["activity"]): m["value"] for m in metrics}
    assert totals == {("env-0", "step"): 6.0, ("env-0", "reset"): 1.0, ("env-1", "step"): 8.0}
    assert all(m["monotonic"] and m["unit"] == "s" for m in metrics)
    busy_now = [r for r in read_jsonl(telemetry.jsonl_path, types={"metric"}) if r["name"] == "dart.resource.busy"]
    assert {m["attributes"]["resource.id"]: m["value"] for m in busy_now} == {"env-0": 1, "env-1": 0}


def test_observed_window_spans_the_service_lifetime(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            [
                f'{{"type": "event", "name": "telemetry.start", "ts_unix_ns": {T0}}}',
                f'{{"type": "busy", "resource_kind": "env", "resource_id": "a", "activity": "step", '
                f'"start_unix_ns": {T0 + 2 * S}, "end_unix_ns": {T0 + 3 * S}}}',
                f'{{"type": "event", "name": "telemetry.stop", "ts_unix_ns": {T0 + 4 * S}}}',
                f'{{"type": "event", "name": "other", "ts_unix_ns": {T0 + 100 * S}}}',
            ]
        )
        + "\n"
    )
    assert observed_window(path) == (T0, T0 + 4 * S)


def test_interval_functions() -> None:
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6)]) == [(0, 4), (5, 7)]
    assert busy_ns([(0, 10), (5, 15)], 0, 20) == 15
    assert utilization([(0, 10), (5, 15)], 0, 20) == 0.75
    assert utilization([(0, 10)], 5, 5) == 0.0
    assert utilization([BusyInterval("env", "a", "x", 2, 4)], 0, 8) == 0.25
    assert utilization_timeline([(0, 15), (25, 30)], 0, 35, 10) == [(0, 1.0), (10, 0.5), (20, 0.5), (30, 0.0)]
    assert utilization_timeline([(0, 3)], 0, 4, 3) == [(0, 1.0), (3, 0.0)]
    with pytest.raises(ValueError):
        utilization_timeline([], 0, 1, 0)


def test_record_roundtrip() -> None:
    interval = BusyInterval("engine", "e1", "generate", 10, 25)
    record: dict[str, Any] = interval.to_record()
    assert record["duration_s"] == 15e-9
    assert BusyInterval.from_record(record) == interval


intervals_st = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)).map(sorted).map(tuple), max_size=12)


@given(intervals_st, st.integers(0, 60), st.integers(0, 60))
def test_busy_time_equals_a_brute_force_count(items: list[tuple[int, int]], a: int, b: int) -> None:
    start, end = min(a, b), max(a, b)
    covered = {t for s, e in items for t in range(s, e) if start <= t < end}
    assert busy_ns(items, start, end) == len(covered)
    assert 0.0 <= utilization(items, start, end) <= 1.0


@given(intervals_st, st.integers(1, 13))
def test_timeline_buckets_add_up(items: list[tuple[int, int]], bucket: int) -> None:
    timeline = utilization_timeline(items, 0, 60, bucket)
    total = sum(frac * (min(t + bucket, 60) - t) for t, frac in timeline)
    assert total == pytest.approx(busy_ns(items, 0, 60))


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 10), st.sampled_from("abc")), max_size=10))
def test_tracker_never_double_counts(sections: list[tuple[int, int, str]]) -> None:
    # Arbitrary overlapping sections: the tracker's busy time equals the union of the sections.
    clock = FakeClock()
    tracker = BusyTracker("r", "0", clock=clock)
    events = sorted(
        [(start, 1, i, act) for i, (start, _, act) in enumerate(sections)]
        + [(start + length, 0, i, act) for i, (start, length, act) in enumerate(sections)]
    )
    tokens: dict[int, int] = {}
    for t, is_begin, i, act in events:
        clock.t = T0 + t
        if is_begin:
            tokens[i] = tracker.begin(act)
        else:
            tracker.end(tokens.pop(i))
    union = busy_ns([(T0 + s, T0 + s + n) for s, n, _ in sections], T0, T0 + 100)
    assert sum(i.end_ns - i.start_ns for i in tracker.intervals()) == union
    assert merge_intervals(tracker.intervals()) == merge_intervals(
        [(i.start_ns, i.end_ns) for i in tracker.intervals()]
    )
    ends = [(i.start_ns, i.end_ns) for i in tracker.intervals()]
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(ends, ends[1:], strict=False))
