"""The trainer's staleness check: which samples of a batch are trained on, and the lag figures of those."""

from __future__ import annotations

import pytest

from dart.protocol.messages import TrainingSample
from dart.train.staleness import policy_lag, split_stale

pytestmark = pytest.mark.unit


def _sample(trajectory_id: str, version: int, *, pool: bool = False) -> TrainingSample:
    return TrainingSample(
        trajectory_id=trajectory_id,
        step_index=0,
        group_id="g",
        task_id="task",
        advantage=1.0,
        reward=1.0,
        policy_version=version,
        prompt_token_ids=[1, 2],
        response_token_ids=[3],
        rollout_logprobs=[-0.5],
        from_experience_pool=pool,
    )


def test_samples_beyond_the_bound_are_dropped_and_pool_replays_kept() -> None:
    at_bound, too_old, fresh = _sample("a", 3), _sample("b", 2), _sample("c", 5)
    pooled = _sample("p", 0, pool=True)  # old on purpose: replayed, never dropped for staleness
    split = split_stale(5, [at_bound, too_old, fresh, pooled], max_staleness=2)
    assert split.kept == [at_bound, fresh, pooled] and split.dropped == [too_old]
    assert policy_lag(5, split.kept)["max_policy_lag"] == 2
    # Bound 0: only the trainer's own version is trained on.
    assert [s.trajectory_id for s in split_stale(5, [at_bound, fresh, pooled], 0).kept] == ["c", "p"]
    # No bound: everything is kept, whatever its age.
    assert split_stale(100, [too_old, pooled], None).dropped == []


def test_policy_lag_counts_pool_samples_apart() -> None:
    fresh = [_sample("a", 4), _sample("b", 5)]
    pooled = [_sample("p", 1, pool=True)]
    lag = policy_lag(5, fresh + pooled)
    assert lag["max_policy_lag"] == 1 and lag["mean_policy_lag"] == 0.5 and lag["min_policy_version"] == 4
    assert lag["pool_samples"] == 1 and lag["pool_max_policy_lag"] == 4
    assert policy_lag(5, pooled)["max_policy_lag"] == 0 and policy_lag(5, pooled)["min_policy_version"] == 1
