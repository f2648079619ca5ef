"""The trajectory runner: one work item in, one trajectory out (rollout-wise sampling).

Trajectory lifecycle (one :meth:`TrajectoryRunner.run` call)::

    started --lease env--> leased --reset(task), or for a branch fork(parent's prefix)--> acting
    acting: prompt (instruction, last K screenshots, every earlier output as text)
            -> router.pick() -> engine.generate -> parse_action
            -> parse error: a step with parse_error, no env step (the observation stays)
            -> action: env.step -> a step with the action
            until the env says done, the action is finished/fail, or max_steps steps (TRUNCATED)
    acting --evaluate--> OK | TRUNCATED, with reward and success
    any state --EnvFailed--> ENV_FAILED (no reward); --engine error--> FAILED;
              --task cancelled--> ABORTED (run() returns instead of raising)
    finally: the env lease is released.

Branches: a work item with ``branch`` forks its parent trajectory at ``branch.step_index``: the reset replays
the parent's actions before it (the env service checks every screen against the parent's digests), the
history is rebuilt from the parent's outputs and the replayed screens, so the first prompt is the parent's
prompt at that step, and the steps sampled from there are numbered from the branch point
(``Trajectory.branch``). A refused fork (:class:`~dart.rollout.errors.ForkRefused`) leaves the lease held:
the work is answered as a normal rollout from the task's start, with ``Trajectory.branch_refused`` saying why.

Runner time is accounted with a :class:`~dart.runtime.telemetry.BusyTracker` of kind ``runner``
(the idle breakdown reads it): ``lease_wait`` (asking the pool), ``leased`` (from lease grant until
the release is done), refined by ``pick`` (waiting for a serving engine), ``generate`` (the engine
call) and ``env_call`` (reset/step/evaluate round trips).

Every step records the policy version of the engine result that produced it, so a trajectory that
spans a weight update carries both versions (``min_policy_version`` .. ``max_policy_version``), and
the exact inputs of its prompt: token ids and the images fed (``prompt_images``, see
:class:`~dart.policy.prompt.PromptImage`). Screenshots the env sends by reference are read
through the service's :class:`~dart.rollout.service.images.ImageCache`; one that cannot be read
ends the episode as ENV_FAILED.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field

from opentelemetry import trace

from dart.policy.action_grammar import parse_action
from dart.policy.prompt import ChatPrompt, HistoryStep, PromptImage, build_prompt
from dart.policy.screen import coordinate_scale
from dart.protocol.messages import (
    BranchOrigin,
    Fail,
    Finished,
    Observation,
    StepRecord,
    StepTimings,
    Trajectory,
    WorkItem,
)
from dart.protocol.messages.trajectory import TrajectoryStatus
from dart.rollout.engine.interface import GenerationRequest, GenerationResult
from dart.rollout.errors import EngineError, EnvFailed, ForkRefused, ImageFetchError, ImageStoreError, NoEngineError
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.env_client import EnvClient
from dart.rollout.service.images import ImageCache, PromptImages
from dart.rollout.service.router import EngineRouter
from dart.runtime.bus import Bus
from dart.runtime.store.images import ImageOffload
from dart.runtime.telemetry import BusyTracker, Telemetry

log = logging.getLogger("dart.rollout.runner")
tracer = trace.get_tracer("dart.rollout")


def trajectory_id_for(work: WorkItem) -> str:
    """The trajectory id of a work item: derived, so a redelivered item cannot publish twice."""
    return f"traj-{work.work_id}"


def _step_seed(work: WorkItem, index: int) -> int:
    # Deterministic per (work item, step): reruns of the same item on the same weights agree.
    digest = hashlib.sha256(f"{work.work_id}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass
class _Episode:
    """What a run has gathered so far; turned into a Trajectory however the run ends."""

    work: WorkItem
    started_at: float
    steps: list[StepRecord] = field(default_factory=list)
    instance_id: str | None = None
    start_version: int = 0
    lease_token: int | None = None
    first_step: int = 0
    """Index of the first step sampled here: a forked branch's branch point, else 0."""
    branch_refused: str | None = None
    """Why a branch work item's fork was refused (the episode then started afresh)."""


class TrajectoryRunner:
    """Runs work items to trajectories, one at a time; see the module docstring for the lifecycle.

    Cheap: a service runs many of these as concurrent asyncio tasks. Each run is one
    OpenTelemetry span ``trajectory`` whose children are the env and engine calls.

    Example::

        runner = TrajectoryRunner("runner-0", bus, router, RunnerConfig(pool="sim"))
        trajectory = await runner.run(work_item)

    Args:
        runner_id: Name of this runner (lease holder, ``Trajectory.runner_id``).
        bus: A connected bus (to reach the env service).
        router: Where engines are picked.
        config: Prompt, sampling and env settings.
        telemetry: Where the runner's busy records go; None keeps them in memory.
        images: Where screenshots sent by reference are read (the service shares one among its
            runners); None reads ``file://`` references through a cache of its own.
        offload: Where resized prompt images too large to travel inline are stored (the service
            shares one); None keeps them inline.
    """

    def __init__(
        self,
        runner_id: str,
        bus: Bus,
        router: EngineRouter,
        config: RunnerConfig,
        *,
        telemetry: Telemetry | None = None,
        images: ImageCache | None = None,
        offload: ImageOffload | None = None,
    ) -> None:
        self.runner_id = runner_id
        self._bus = bus
        self._router = router
        self._config = config
        self._sizing = config.prompt.image_sizing()
        self._images = PromptImages(images or ImageCache(), self._sizing, offload)
        self._format = config.prompt.prompt_format()
        self._space = config.prompt.space()
        self._chat = config.prompt.model_family().chat
        self.tracker = BusyTracker("runner", runner_id, telemetry)
        """Where this runner's time went (see the module docstring)."""

    async def run(self, work: WorkItem) -> Trajectory:
        """Run one episode for ``work`` and return its trajectory (never raises for episode failures).

        Cancelling the task that runs this aborts the trajectory: it returns with status ABORTED
        (the env is still released), so the caller can publish it.
        """
        episode = _Episode(work, time.time(), start_version=self._start_version())
        with tracer.start_as_current_span("trajectory") as span:
            span.set_attribute("dart.work_id", work.work_id)
            span.set_attribute("dart.task_id", work.task.task_id)
            span.set_attribute("dart.runner_id", self.runner_id)
            env = EnvClient(self._bus, self.runner_id, self._config)
            try:
                status, reward, success = await self._episode(env, episode)
                trajectory = self._close(episode, status, reward=reward, success=success)
            except (EnvFailed, ImageFetchError, ImageStoreError) as exc:
                trajectory = self._close(episode, TrajectoryStatus.ENV_FAILED, error=str(exc))
            except (EngineError, NoEngineError) as exc:
                trajectory = self._close(episode, TrajectoryStatus.FAILED, error=f"engine: {exc}")
            except asyncio.CancelledError:
                # Our owner asked us to abort: consume the request so the release below and the
                # caller's publish of the ABORTED trajectory can still await.
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                trajectory = self._close(episode, TrajectoryStatus.ABORTED, error="cancelled")
            except Exception as exc:  # a bug here must not lose the work item's outcome
                log.exception("runner %s failed on %s", self.runner_id, work.work_id)
                trajectory = self._close(episode, TrajectoryStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
            finally:
                try:
                    await env.release(reason="episode over")
                finally:
                    if episode.lease_token is not None:
                        self.tracker.end(episode.lease_token)
            span.set_attribute("dart.status", trajectory.status.value)
            span.set_attribute("dart.steps", len(trajectory.steps))
            span.set_attribute("dart.reward", trajectory.reward)
            return trajectory

    async def _episode(self, env: EnvClient, episode: _Episode) -> tuple[TrajectoryStatus, float, bool]:
        work = episode.work
        with tracer.start_as_current_span("env.lease"), self.tracker.busy("lease_wait"):
            lease = await env.lease(work.task.task_id)
        episode.lease_token = self.tracker.begin("leased")
        episode.instance_id = lease.instance_id
        instruction, observation, shown, history = await self._begin(env, episode)
        index = episode.first_step
        ended = False
        while index < work.max_steps:
            step_started = time.monotonic()
            prompt, result = await self._generate(work, instruction, shown, history, index)
            generate_s = time.monotonic() - step_started
            parsed = parse_action(result.text, self._coordinate_scale(shown))
            env_s = 0.0
            next_observation = observation
            if parsed.action is not None:
                env_started = time.monotonic()
                with tracer.start_as_current_span("env.step") as span, self.tracker.busy("env_call"):
                    span.set_attribute("dart.action", parsed.action.kind)
                    reply = await env.step(parsed.action)
                env_s = time.monotonic() - env_started
                next_observation = reply.observation
                ended = reply.done or isinstance(parsed.action, Finished | Fail)
            episode.steps.append(
                StepRecord(
                    index=index,
                    policy_version=result.policy_version,
                    observation=observation,
                    prompt_token_ids=result.prompt_token_ids,
                    prompt_images=list(prompt.records),
                    response_token_ids=result.response_token_ids,
                    response_logprobs=result.response_logprobs,
                    response_entropy=result.response_entropy,
                    sampling=result.sampling,
                    response_text=result.text,
                    action=parsed.action,
                    parse_error=parsed.error,
                    timings=StepTimings(generate_s=generate_s, env_s=env_s, total_s=time.monotonic() - step_started),
                )
            )
            self._remember(history, result.text, shown)
            index += 1
            if ended:
                break
            if next_observation is not observation:
                shown = await self._images.prepare(next_observation.screenshot)
            observation = next_observation
        with tracer.start_as_current_span("env.evaluate"), self.tracker.busy("env_call"):
            score = await env.evaluate()
        status = TrajectoryStatus.OK if ended else TrajectoryStatus.TRUNCATED
        return status, score.reward, score.success

    async def _begin(
        self, env: EnvClient, episode: _Episode
    ) -> tuple[str, Observation, PromptImage | None, list[HistoryStep]]:
        """Start the episode: a reset, or for a branch the fork of its parent with the parent's history rebuilt.

        Returns:
            The instruction, the observation the first step acts on, its prepared image, and the history.
        """
        work = episode.work
        branch = work.branch
        if branch is not None:
            try:
                with tracer.start_as_current_span("env.fork") as span, self.tracker.busy("env_call"):
                    span.set_attribute("dart.branch_step", branch.step_index)
                    forked = await env.reset(work.task, replay=branch.actions, expect_sha256=branch.screens)
            except ForkRefused as exc:
                log.info("%s: %s; answering it as a normal rollout", work.work_id, exc)
                episode.branch_refused = exc.reason
            else:
                episode.first_step = branch.step_index
                instruction = forked.instruction or work.task.instruction
                screens = [forked.observation, *forked.replayed]
                history: list[HistoryStep] = []
                at = 0
                shown = await self._images.prepare(screens[0].screenshot)
                for step in branch.prefix:
                    self._remember(history, step.response_text, shown)
                    if step.action is not None:
                        at += 1
                        shown = await self._images.prepare(screens[at].screenshot)
                return instruction, screens[at], shown, history
        with tracer.start_as_current_span("env.reset"), self.tracker.busy("env_call"):
            first = await env.reset(work.task)
        shown = await self._images.prepare(first.observation.screenshot)
        return first.instruction or work.task.instruction, first.observation, shown, []

    def _remember(self, history: list[HistoryStep], text: str, shown: PromptImage | None) -> None:
        """Add a step to the history: the model sees its own earlier outputs (bad ones too), and the screens they
        acted on, the newest ``prompt.max_images`` of them."""
        history.append(HistoryStep(text, shown))
        out_of_window = len(history) - self._config.prompt.max_images
        if out_of_window >= 0:
            # No later prompt shows it (history only grows): let its pixels go.
            history[out_of_window] = HistoryStep(history[out_of_window].text)

    def _coordinate_scale(self, shown: PromptImage | None) -> tuple[float, float]:
        """What the positions in the model's text divide by (the shown screenshot's size for ``pixels``)."""
        return coordinate_scale(self._space, shown.pixels.size if shown is not None else None)

    async def _generate(
        self, work: WorkItem, instruction: str, shown: PromptImage | None, history: list[HistoryStep], index: int
    ) -> tuple[ChatPrompt, GenerationResult]:
        prompt = build_prompt(
            instruction,
            shown,
            history,
            max_images=self._config.prompt.max_images,
            image_size=self._sizing,
            prompt_format=self._format,
            coordinates=self._space,
            chat=self._chat,
        )
        request = GenerationRequest(
            prompt,
            max_new_tokens=self._config.max_new_tokens,
            sampling=work.sampling,
            seed=_step_seed(work, index),
        )
        with self.tracker.busy("pick"):
            engine = await self._router.pick(
                min_version=work.min_policy_version,
                min_version_wait_s=self._config.min_version_wait_s,
                timeout_s=self._config.engine_wait_s,
            )
        with tracer.start_as_current_span("engine.generate") as span, self.tracker.busy("generate"):
            span.set_attribute("dart.engine_id", self._router.engine_id(engine))
            with self._router.busy(engine):
                result = await engine.generate(request)
            span.set_attribute("dart.policy_version", result.policy_version)
            span.set_attribute("dart.response_tokens", len(result.response_token_ids))
            # Where the engine's time went: waiting for a batch slot vs the batch (or HTTP call) serving it.
            span.set_attribute("dart.queued_s", result.timings.queued_s)
            span.set_attribute("dart.generate_s", result.timings.generate_s)
            span.set_attribute("dart.batch_size", result.timings.batch_size)
        return prompt, result

    def _start_version(self) -> int:
        return max((e.version for e in self._router.engines.values()), default=0)

    def _close(
        self,
        episode: _Episode,
        status: TrajectoryStatus,
        *,
        reward: float = 0.0,
        success: bool = False,
        error: str | None = None,
    ) -> Trajectory:
        work = episode.work
        versions = [s.policy_version for s in episode.steps] or [episode.start_version]
        return Trajectory(
            trajectory_id=trajectory_id_for(work),
            work_id=work.work_id,
            task=work.task,
            group_id=work.group_id,
            rollout_index=work.rollout_index,
            group_size=work.group_size,
            steps=list(episode.steps),
            status=status,
            reward=reward,
            success=success,
            min_policy_version=min(versions),
            max_policy_version=max(versions),
            env_instance_id=episode.instance_id,
            runner_id=self.runner_id,
            started_at=episode.started_at,
            finished_at=max(time.time(), episode.started_at),
            error=error,
            branch=(
                BranchOrigin(parent_trajectory_id=work.branch.parent_trajectory_id, step_index=episode.first_step)
                if work.branch is not None and episode.first_step > 0
                else None
            ),
            branch_refused=episode.branch_refused,
        )
