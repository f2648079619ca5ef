"""The simulated latency model: distribution shapes, the stall mixture, scaling and seeding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from dart.env.sim.latency import (
    ConstantLatency,
    LatencyConfig,
    LatencyModel,
    LogNormalLatency,
    UniformLatency,
)

pytestmark = pytest.mark.unit

N = 2000


def test_lognormal_median_and_spread_match_the_config() -> None:
    model = LatencyModel(LatencyConfig(step=LogNormalLatency(median_s=0.4, sigma=0.5), seed=3))
    samples = model.samples("step", N)
    assert samples.shape == (N,) and (samples > 0).all()
    # The sample median of 2000 log-normal draws is within ~5% of the true median (3 sigma).
    assert float(np.median(samples)) == pytest.approx(0.4, rel=0.08)
    assert float(np.std(np.log(samples))) == pytest.approx(0.5, rel=0.08)


def test_uniform_and_constant() -> None:
    model = LatencyModel(LatencyConfig(step=UniformLatency(low_s=0.1, high_s=0.3)))
    samples = model.samples("step", N)
    assert samples.min() >= 0.1 and samples.max() <= 0.3
    assert float(samples.mean()) == pytest.approx(0.2, rel=0.03)
    constant = LatencyModel(LatencyConfig(step=ConstantLatency(seconds=0.25)))
    assert constant.sample("step") == 0.25 and set(constant.samples("step", 10)) == {0.25}


def test_heavy_tail_mixture_stalls_with_the_given_probability() -> None:
    dist = ConstantLatency(seconds=0.1, tail_prob=0.1, tail_factor=20.0)
    samples = LatencyModel(LatencyConfig(step=dist, seed=5)).samples("step", N)
    assert set(np.round(samples, 9)) == {0.1, 2.0}
    stalled = float((samples > 1.0).mean())
    assert abs(stalled - 0.1) < 3 * math.sqrt(0.1 * 0.9 / N)
    lognormal = LogNormalLatency(median_s=0.2, sigma=0.3, tail_prob=0.05, tail_factor=10.0)
    tailed = LatencyModel(LatencyConfig(step=lognormal, seed=5)).samples("step", N)
    assert float(np.median(tailed)) == pytest.approx(0.2, rel=0.1)  # the median barely moves
    assert float(np.percentile(tailed, 99)) > 1.0  # but the tail is ten times longer


def test_streams_are_deterministic_under_seed_and_differ_between_instances() -> None:
    config = LatencyConfig(step=LogNormalLatency(median_s=0.3), seed=11)
    a, b = LatencyModel(config, stream=0), LatencyModel(config, stream=0)
    ops = ["reset", "step", "step", "evaluate"] * 5
    assert [a.sample(op) for op in ops] == [b.sample(op) for op in ops]  # type: ignore[arg-type]
    other = LatencyModel(config, stream=1).samples("step", 20)
    assert not np.array_equal(LatencyModel(config, stream=0).samples("step", 20), other)
    reseeded = LatencyModel(config.model_copy(update={"seed": 12}), stream=0).samples("step", 20)
    assert not np.array_equal(LatencyModel(config, stream=0).samples("step", 20), reseeded)


def test_per_operation_distributions_and_scale() -> None:
    config = LatencyConfig(
        step=ConstantLatency(seconds=0.2),
        reset=ConstantLatency(seconds=2.0),
        scale=0.5,
    )
    model = LatencyModel(config)
    assert (model.sample("step"), model.sample("reset"), model.sample("evaluate")) == (0.1, 1.0, 0.1)
    off = LatencyModel(config.model_copy(update={"scale": 0.0}))
    assert off.sample("reset") == 0.0


def test_config_parses_from_yaml_and_rejects_bad_values() -> None:
    text = """
step: {kind: lognormal, median_s: 0.4, sigma: 0.5, tail_prob: 0.02, tail_factor: 10}
reset: {kind: uniform, low_s: 1.0, high_s: 3.0}
scale: 1.0
seed: 0
"""
    config = LatencyConfig.model_validate(yaml.safe_load(text))
    assert isinstance(config.step, LogNormalLatency) and isinstance(config.reset, UniformLatency)
    assert LatencyConfig().distribution("evaluate") == ConstantLatency()
    with pytest.raises(ValidationError, match="high_s"):
        UniformLatency(low_s=2.0, high_s=1.0)
    with pytest.raises(ValidationError):
        LatencyConfig.model_validate({"step": {"kind": "gamma"}})
    with pytest.raises(ValidationError):
        LogNormalLatency(median_s=0.0)
    with pytest.raises(ValidationError):
        ConstantLatency(seconds=0.1, tail_prob=1.5)
