"""Evaluation of a policy on a task suite with the rollout machinery (no trainer, no dart-data).

:func:`evaluate` runs K episodes per task through :class:`~dart.rollout.service.TrajectoryRunner`
against whatever env pool and engines it is given, and returns an :class:`EvalReport` (per-task
success with Wilson intervals, overall success, pass@k). ``dart eval`` and the held-out validation
of ``dart run`` both call it, so a figure means the same thing in both places.
"""

from __future__ import annotations

from dart.rollout.eval.evaluate import EvalReport, TaskResult, evaluate
from dart.rollout.eval.stats import difference_interval, pass_at_k, pass_ks, wilson_interval

__all__ = ["EvalReport", "TaskResult", "difference_interval", "evaluate", "pass_at_k", "pass_ks", "wilson_interval"]
