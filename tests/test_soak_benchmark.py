"""The soak benchmark's verdict (benchmarks/soak.py): a figure fails on the slope of a line fitted to the
second half of its samples, not on one sample, so warm-up growth, a one-off spike and noise pass and a
steady leak does not. (The benchmark itself is a 30-minute run: docs/benchmarks.md has its figures.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak

pytestmark = pytest.mark.unit


def rows(rss: list[float], store: list[float] | None = None) -> list[dict[str, Any]]:
    """One sample a minute, every service with the same figures."""
    out = []
    for minute, value in enumerate(rss):
        row: dict[str, Any] = {"minute": float(minute), "bus_pending": 0, "store_mib": (store or rss)[minute]}
        for service in soak.SERVICES:
            row[service] = {"pid": 1, "rss_mib": value, "fds": 20, "threads": 10}
        out.append(row)
    return out


def test_growth_that_levels_off_passes_and_a_steady_leak_fails() -> None:
    warm_then_flat = [100, 300, 500, 600, 600, 601, 600, 602, 601, 600]
    verdicts = soak.judge(rows(warm_then_flat, store=[1.0] * 10))
    assert all(v["ok"] for v in verdicts.values()), verdicts
    leak = [100 + 5 * m for m in range(10)]  # 5 MiB a minute, past the 2 MiB bound
    verdicts = soak.judge(rows(leak, store=[1.0] * 10))
    assert not verdicts["train.rss_mib"]["ok"] and verdicts["train.rss_mib"]["slope_per_min"] == pytest.approx(5.0)
    assert verdicts["train.fds"]["ok"] and verdicts["store_mib"]["ok"]


def test_a_one_off_spike_is_not_a_trend() -> None:
    spike = [500.0] * 20
    spike[16] = 560.0  # one sample 60 MiB up, in the judged half: a fitted slope of about 1.1 MiB a minute
    verdicts = soak.judge(rows(spike, store=[1.0] * 20))
    assert verdicts["env.rss_mib"]["ok"] and 0 < verdicts["env.rss_mib"]["slope_per_min"] < 2.0


def test_slope_is_least_squares() -> None:
    assert soak.slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert soak.slope([(0, 1)]) == 0.0
    assert soak.slope([(1, 1), (1, 5)]) == 0.0
