"""Run K episodes per task through trajectory runners and summarize their outcomes.

Evaluation lifecycle (one :func:`evaluate` call)::

    K work items per task (temperature as given, ids ``eval-<label>-<task>-<i>``)
      -> ``concurrency`` runners pull them from one queue, each runs one episode at a time
         (lease from ``runner_config.pool``, engines from ``router``)
      -> ok / truncated trajectories count (success or not); env_failed / failed / aborted ones
         are infrastructure losses, reported as ``errors`` and left out of the rates; of those, an
         env_failed one without a step is a ``setup_failure`` (the env could not set the task up),
         counted apart so a suite the env cannot prepare does not pass for a policy's failures
      -> EvalReport

Nothing is published: trajectories stay in memory, so an evaluation never feeds training.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dart.protocol.messages import EvalResult, EvalTaskOutcome, Sampling, TaskSpec, Trajectory, WorkItem
from dart.protocol.messages.trajectory import TrajectoryStatus
from dart.rollout.eval.stats import pass_at_k, pass_ks, wilson_interval
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.images import ImageCache
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.runner import TrajectoryRunner
from dart.runtime.bus import Bus

_COUNTED = frozenset({TrajectoryStatus.OK, TrajectoryStatus.TRUNCATED})


def _setup_failed(traj: Trajectory) -> bool:
    """Whether the env could not set the episode's task up (it failed before the first step)."""
    return traj.status is TrajectoryStatus.ENV_FAILED and not traj.steps


@dataclass(frozen=True)
class TaskResult:
    """Outcomes of one task's episodes.

    Attributes:
        task_id: The task.
        n: Episodes that ran to an outcome (ok or truncated).
        successes: Of those, the successful ones.
        errors: Episodes lost to the infrastructure (env_failed, failed, aborted).
        mean_steps: Mean steps of the counted episodes (0 when none).
        setup_failures: Of the errors, episodes whose env could not set the task up (failed before a step).
    """

    task_id: str
    n: int
    successes: int
    errors: int
    mean_steps: float
    setup_failures: int = 0

    @property
    def success(self) -> float | None:
        """Success rate, None when no episode counted."""
        return self.successes / self.n if self.n else None

    @property
    def ci95(self) -> tuple[float, float]:
        """95% Wilson interval of the success rate."""
        return wilson_interval(self.successes, self.n)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {
            "task_id": self.task_id,
            "n": self.n,
            "successes": self.successes,
            "success": self.success,
            "ci95": list(self.ci95),
            "errors": self.errors,
            "setup_failures": self.setup_failures,
            "mean_steps": round(self.mean_steps, 2),
        }


GREEDY = Sampling(temperature=0.0)
"""Greedy decoding, the default of an evaluation."""


@dataclass(frozen=True)
class EvalReport:
    """The result of one evaluation.

    Attributes:
        label: What was evaluated (e.g. ``v3``), part of the work ids.
        policy_version: Lowest policy version any counted step was generated with (engines do
            not change version during an evaluation unless someone updates them).
        sampling: How every episode sampled (temperature 0 = greedy).
        episodes_per_task: K.
        tasks: Per-task outcomes, in suite order.
        seconds: Wall time of the evaluation.
    """

    label: str
    policy_version: int
    sampling: Sampling
    episodes_per_task: int
    tasks: tuple[TaskResult, ...]
    seconds: float
    statuses: dict[str, int] = field(default_factory=dict)
    """Trajectories by status value."""

    @property
    def n(self) -> int:
        """Counted episodes over all tasks."""
        return sum(t.n for t in self.tasks)

    @property
    def successes(self) -> int:
        """Successful episodes over all tasks."""
        return sum(t.successes for t in self.tasks)

    @property
    def errors(self) -> int:
        """Episodes lost to the infrastructure over all tasks."""
        return sum(t.errors for t in self.tasks)

    @property
    def setup_failures(self) -> int:
        """Episodes whose env could not set their task up, over all tasks (part of :attr:`errors`)."""
        return sum(t.setup_failures for t in self.tasks)

    @property
    def success(self) -> float | None:
        """Success rate over all counted episodes (every task weighs K episodes)."""
        return self.successes / self.n if self.n else None

    @property
    def ci95(self) -> tuple[float, float]:
        """95% Wilson interval of :attr:`success`, episodes taken as independent trials."""
        return wilson_interval(self.successes, self.n)

    def pass_at(self) -> dict[int, float | None]:
        """Unbiased pass@k averaged over tasks, for k in :func:`pass_ks`; tasks with fewer than
        k counted episodes are left out (None when no task has k)."""
        out: dict[int, float | None] = {}
        for k in pass_ks(self.episodes_per_task):
            values = [pass_at_k(t.n, t.successes, k) for t in self.tasks if t.n >= k]
            out[k] = sum(values) / len(values) if values else None
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (the ``dart eval`` line, the run summary's ``heldout`` entries)."""
        return {
            "label": self.label,
            "policy_version": self.policy_version,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "episodes_per_task": self.episodes_per_task,
            "num_tasks": len(self.tasks),
            "n": self.n,
            "successes": self.successes,
            "success": self.success,
            "ci95": list(self.ci95),
            "pass_at_k": {str(k): v for k, v in self.pass_at().items()},
            "errors": self.errors,
            "setup_failures": self.setup_failures,
            "statuses": dict(self.statuses),
            "seconds": round(self.seconds, 2),
            "tasks": [t.to_dict() for t in self.tasks],
        }

    def part(self, task_ids: set[str], label: str) -> EvalReport:
        """The report of ``task_ids`` alone, under ``label``: one suite of an evaluation that ran several
        together. ``seconds`` and ``statuses`` stay the whole evaluation's (they are not kept per task)."""
        return replace(self, label=label, tasks=tuple(t for t in self.tasks if t.task_id in task_ids))

    def to_result(self, engine_id: str, engine: str) -> EvalResult:
        """The wire form, naming the engine that served it."""
        return EvalResult(
            label=self.label,
            policy_version=self.policy_version,
            sampling=self.sampling,
            episodes_per_task=self.episodes_per_task,
            tasks=[
                EvalTaskOutcome(
                    task_id=t.task_id,
                    n=t.n,
                    successes=t.successes,
                    errors=t.errors,
                    mean_steps=t.mean_steps,
                    setup_failures=t.setup_failures,
                )
                for t in self.tasks
            ],
            seconds=self.seconds,
            statuses=dict(self.statuses),
            engine_id=engine_id,
            engine=engine,
        )

    @classmethod
    def from_result(cls, result: EvalResult) -> EvalReport:
        """The report of an evaluation a rollout service ran (see :meth:`to_result`)."""
        return cls(
            label=result.label,
            policy_version=result.policy_version,
            sampling=result.sampling,
            episodes_per_task=result.episodes_per_task,
            tasks=tuple(
                TaskResult(t.task_id, t.n, t.successes, t.errors, t.mean_steps, t.setup_failures) for t in result.tasks
            ),
            seconds=result.seconds,
            statuses=dict(result.statuses),
        )


async def evaluate(
    bus: Bus,
    router: EngineRouter,
    runner_config: RunnerConfig,
    tasks: Sequence[TaskSpec],
    *,
    episodes_per_task: int = 1,
    sampling: Sampling = GREEDY,
    concurrency: int = 4,
    label: str = "eval",
    images: ImageCache | None = None,
) -> EvalReport:
    """Evaluate the engines behind ``router`` on ``tasks``; see the module docstring.

    Args:
        bus: A connected bus reaching the env service of ``runner_config.pool``.
        router: The engines to generate with (their current weights are the policy evaluated).
        runner_config: Prompt, token budget and env pool, as the rollout service's runners use.
        tasks: The tasks; each runs ``episodes_per_task`` times with its own ``max_steps``.
        episodes_per_task: K, at least 1.
        sampling: Temperature 0 decodes greedily; above 0 samples (each episode seeded by its work id).
        concurrency: Episodes in flight at once (at most the env slots of the pool, usefully).
        label: Part of every work id, to tell evaluations apart in traces.
        images: Where screenshots sent by reference are read (the rollout service's cache); None: one
            per runner, for ``file://`` references.

    Raises:
        ValueError: No tasks, or K / concurrency below 1.
    """
    if not tasks:
        raise ValueError("evaluate needs at least one task")
    if episodes_per_task < 1 or concurrency < 1:
        raise ValueError(f"episodes_per_task and concurrency must be >= 1, got {episodes_per_task}, {concurrency}")
    started = time.monotonic()
    now = time.time()
    queue: asyncio.Queue[WorkItem] = asyncio.Queue()
    for t_index, task in enumerate(tasks):
        for i in range(episodes_per_task):
            queue.put_nowait(
                WorkItem(
                    work_id=f"eval-{label}-{t_index}-{i}",
                    task=task,
                    group_id=f"eval-{label}-{t_index}",
                    rollout_index=i,
                    group_size=episodes_per_task,
                    max_steps=task.max_steps,
                    sampling=sampling,
                    created_at=now,
                )
            )
    results: list[Trajectory] = []

    async def worker(runner: TrajectoryRunner) -> None:
        while True:
            try:
                work = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await runner.run(work))

    runners = [
        TrajectoryRunner(f"eval-{label}-{i}", bus, router, runner_config, images=images) for i in range(concurrency)
    ]
    await asyncio.gather(*(worker(r) for r in runners))
    return _report(label, tasks, episodes_per_task, sampling, results, time.monotonic() - started)


def _report(
    label: str,
    tasks: Sequence[TaskSpec],
    k: int,
    sampling: Sampling,
    trajectories: list[Trajectory],
    seconds: float,
) -> EvalReport:
    by_task: dict[str, list[Trajectory]] = {t.task_id: [] for t in tasks}
    statuses: dict[str, int] = {}
    for traj in trajectories:
        by_task[traj.task.task_id].append(traj)
        statuses[traj.status.value] = statuses.get(traj.status.value, 0) + 1
    results = []
    versions: list[int] = []
    for task in tasks:
        counted = [t for t in by_task[task.task_id] if t.status in _COUNTED]
        versions.extend(t.min_policy_version for t in counted)
        results.append(
            TaskResult(
                task_id=task.task_id,
                n=len(counted),
                successes=sum(1 for t in counted if t.success),
                errors=len(by_task[task.task_id]) - len(counted),
                mean_steps=sum(len(t.steps) for t in counted) / len(counted) if counted else 0.0,
                setup_failures=sum(1 for t in by_task[task.task_id] if _setup_failed(t)),
            )
        )
    return EvalReport(
        label=label,
        policy_version=min(versions, default=0),
        sampling=sampling,
        episodes_per_task=k,
        tasks=tuple(results),
        seconds=seconds,
        statuses=statuses,
    )
