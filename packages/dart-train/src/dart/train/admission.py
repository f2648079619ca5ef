"""Which batch samples the trainer trains on: a sample whose advantage or behaviour log-probs make no
sense is refused (counted in the step's ``refused_samples``), so one bad sample costs itself, not its batch.

dart-data checks trajectories at ingestion; this is the trainer's own guard for what reaches it by the
batch stream (the wire schema already refuses non-finite floats; an in-process caller does not go
through it). Reasons: ``advantage_not_finite``, ``advantage_out_of_bounds`` (``|advantage| >
train.max_abs_advantage``), ``logprob_not_finite``, ``logprob_positive``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from dart.protocol.messages import TrainingSample

LOGPROB_TOLERANCE = 1e-5
"""How far above 0 a behaviour log-prob may be (rounding of a renormalized distribution)."""


def sample_problem(sample: TrainingSample, max_abs_advantage: float) -> str | None:
    """Why a sample must not be trained on, or None."""
    if not math.isfinite(sample.advantage):
        return "advantage_not_finite"
    if abs(sample.advantage) > max_abs_advantage:
        return "advantage_out_of_bounds"
    if not all(math.isfinite(lp) for lp in sample.rollout_logprobs):
        return "logprob_not_finite"
    if any(lp > LOGPROB_TOLERANCE for lp in sample.rollout_logprobs):
        return "logprob_positive"
    return None


def admissible(samples: Sequence[TrainingSample], max_abs_advantage: float) -> tuple[list[int], Counter[str]]:
    """Indices of the samples to train on, and the refused ones counted by reason."""
    keep: list[int] = []
    refused: Counter[str] = Counter()
    for i, sample in enumerate(samples):
        problem = sample_problem(sample, max_abs_advantage)
        if problem is None:
            keep.append(i)
        else:
            refused[problem] += 1
    return keep, refused
