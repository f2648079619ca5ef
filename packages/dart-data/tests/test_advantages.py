from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dart.data.advantages import group_advantages, has_variance

pytestmark = pytest.mark.unit


def test_binary_rewards() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0])


def test_known_values() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0)
    # mean 0.25, population std sqrt(0.1875)
    std = math.sqrt(0.1875)
    assert adv == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])


def test_no_variance_gives_zero() -> None:
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert not has_variance([0.5, 0.5])
    assert has_variance([0.5, 0.6])


def test_mean_baseline_only() -> None:
    assert group_advantages([2.0, 0.0], scale_by_std=False) == [1.0, -1.0]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        group_advantages([])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")])


@given(st.lists(st.floats(min_value=-100, max_value=100), min_size=2, max_size=16))
def test_zero_mean_and_unit_scale(rewards: list[float]) -> None:
    adv = group_advantages(rewards, eps=0.0) if has_variance(rewards, 1e-3) else group_advantages(rewards)
    assert abs(sum(adv)) < 1e-6 * len(adv) * (1 + max(abs(a) for a in adv))
    if has_variance(rewards, 1e-3):
        assert sum(a * a for a in adv) / len(adv) == pytest.approx(1.0, rel=1e-6)
