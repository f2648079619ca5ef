"""Simulated operation latency: how long a slow real desktop would take to reset, step and evaluate.

The sim env renders in about a millisecond; real GUI environments take hundreds of milliseconds
to seconds per step, with occasional stalls. To benchmark the rollout system under realistic
timing, each sim operation waits a time drawn from a configured distribution. Example (YAML)::

    latency:
      step: {kind: lognormal, median_s: 0.4, sigma: 0.5, tail_prob: 0.02, tail_factor: 10}
      reset: {kind: uniform, low_s: 1.0, high_s: 3.0}
      scale: 1.0     # 0 disables waiting (tests)
      seed: 0
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import Field, model_validator

from dart.protocol.config import ConfigModel

Operation = Literal["reset", "step", "evaluate"]
"""The env operations that take simulated time."""


class _Distribution(ConfigModel):
    tail_prob: float = Field(default=0.0, ge=0.0, le=1.0)
    """Probability that an operation stalls: its time is multiplied by ``tail_factor``."""
    tail_factor: float = Field(default=10.0, ge=1.0, le=1e4)
    """How many times longer a stalled operation takes."""


class ConstantLatency(_Distribution):
    """Always the same time."""

    kind: Literal["constant"] = "constant"
    seconds: float = Field(default=0.0, ge=0.0, le=3600.0)
    """The time, seconds."""


class UniformLatency(_Distribution):
    """Uniform between two bounds."""

    kind: Literal["uniform"] = "uniform"
    low_s: float = Field(ge=0.0, le=3600.0)
    """Lower bound, seconds."""
    high_s: float = Field(ge=0.0, le=3600.0)
    """Upper bound, seconds; at least ``low_s``."""

    @model_validator(mode="after")
    def _ordered(self) -> UniformLatency:
        if self.high_s < self.low_s:
            raise ValueError(f"high_s ({self.high_s}) must be >= low_s ({self.low_s})")
        return self


class LogNormalLatency(_Distribution):
    """Log-normal: ``median_s * exp(sigma * N(0, 1))``, the usual shape of service latencies."""

    kind: Literal["lognormal"] = "lognormal"
    median_s: float = Field(gt=0.0, le=3600.0)
    """Median, seconds."""
    sigma: float = Field(default=0.5, ge=0.0, le=5.0)
    """Standard deviation of the log of the time; 0.5 puts the 95th percentile at 2.3x the median."""


LatencyDistribution = Annotated[ConstantLatency | UniformLatency | LogNormalLatency, Field(discriminator="kind")]
"""Any latency distribution, chosen by ``kind``."""


class LatencyConfig(ConfigModel):
    """Simulated latency of each env operation."""

    step: LatencyDistribution = Field(default_factory=ConstantLatency)
    """Time of one step (execute the action, capture the screen)."""
    reset: LatencyDistribution | None = None
    """Time of a reset; None: the same as ``step``."""
    evaluate: LatencyDistribution | None = None
    """Time of an evaluation; None: the same as ``step``."""
    scale: float = Field(default=1.0, ge=0.0, le=1000.0)
    """Multiplies every sampled time; 0 makes the env as fast as it can be (tests)."""
    seed: int = Field(default=0, ge=0)
    """Seed of the latency stream (combined with each env instance's stream number)."""

    def distribution(self, op: Operation) -> ConstantLatency | UniformLatency | LogNormalLatency:
        """The distribution ``op`` draws from."""
        if op == "reset" and self.reset is not None:
            return self.reset
        if op == "evaluate" and self.evaluate is not None:
            return self.evaluate
        return self.step


class LatencyModel:
    """A seeded stream of simulated operation times.

    Lifecycle: created from a config and a stream number -> :meth:`sample` / :meth:`samples` any
    number of times. The sequence of times is a pure function of ``(config.seed, stream)`` and
    the sequence of operations asked for, so two env instances with different streams wait
    differently and a rerun waits the same.
    """

    def __init__(self, config: LatencyConfig, stream: int = 0) -> None:
        """Create the stream.

        Args:
            config: Distributions, scale and seed.
            stream: Distinguishes env instances sharing one config (e.g. the pool slot index).
        """
        self.config = config
        self._rng = np.random.default_rng([config.seed, stream])

    def sample(self, op: Operation) -> float:
        """The time of one ``op``, seconds (already multiplied by ``config.scale``)."""
        return float(self.samples(op, 1)[0])

    def samples(self, op: Operation, n: int) -> NDArray[np.float64]:
        """The times of ``n`` successive ``op`` operations, seconds (scaled)."""
        dist = self.config.distribution(op)
        if isinstance(dist, ConstantLatency):
            base = np.full(n, dist.seconds)
        elif isinstance(dist, UniformLatency):
            base = self._rng.uniform(dist.low_s, dist.high_s, n)
        else:
            base = dist.median_s * np.exp(dist.sigma * self._rng.standard_normal(n))
        if dist.tail_prob > 0.0:
            stalled = self._rng.random(n) < dist.tail_prob
            base = np.where(stalled, base * dist.tail_factor, base)
        result: NDArray[np.float64] = base * self.config.scale
        return result
