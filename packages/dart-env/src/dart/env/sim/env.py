"""The ``sim`` env backend: a deterministic simulated GUI behind the async backend interface."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import NamedTuple

from pydantic import Field, ValidationError

from dart.env.errors import ForkRefusedError, TaskParamsError
from dart.env.interface import BackendState, EnvBackend
from dart.env.sim.catalog import sim_task_from_id
from dart.env.sim.families import SimTask, SimTaskParams, build_task, evaluate
from dart.env.sim.interaction import apply_action
from dart.env.sim.latency import LatencyConfig, LatencyModel, Operation
from dart.env.sim.oracle import oracle_action
from dart.env.sim.render import render_png
from dart.protocol.config import ConfigModel
from dart.protocol.messages import TERMINAL_ACTION_KINDS, Action, InlineImage, Observation, TaskSpec
from dart.protocol.messages.observation import MetadataValue


class SimConfig(ConfigModel):
    """Configuration of sim env instances."""

    width: int = Field(default=224, ge=192, le=2048)
    """Screen width in pixels. 224 = 8 x 28: Qwen2.5-VL's merged 28 px patches tile it exactly."""
    height: int = Field(default=224, ge=192, le=2048)
    """Screen height in pixels."""
    latency: LatencyConfig = Field(default_factory=LatencyConfig)
    """Simulated time of each operation (default: none)."""
    latency_log_size: int = Field(default=1024, ge=1, le=1_000_000)
    """How many recent latency samples :attr:`SimEnv.latencies` keeps."""


class LatencySample(NamedTuple):
    """One simulated wait."""

    op: Operation
    seconds: float


class SimEnv(EnvBackend):
    """A simulated GUI (see :mod:`dart.env.sim`) implementing :class:`~dart.env.interface.EnvBackend`.

    Lifecycle: that of :class:`~dart.env.interface.EnvBackend`. The episode also ends (``step``
    returns ``done=True``) as soon as a button is pressed, since every sim task ends with one.

    Deterministic: the same task, seed and action sequence give byte-identical screenshots and
    the same rewards. Each operation waits a time drawn from the configured latency model
    (``asyncio.sleep``, so many instances share one loop); the times are in :attr:`latencies`.

    Example::

        env = SimEnv(SimConfig())
        obs, instruction = await env.reset(task)
        while (step := env.oracle_action()) is not None:
            obs, done, info = await env.step(step[1])
        reward, success, details = await env.evaluate()
    """

    name = "sim"
    forks = True

    def __init__(self, config: SimConfig | None = None, *, stream: int = 0) -> None:
        """Create an instance.

        Args:
            config: Screen size and latency; defaults to :class:`SimConfig`'s defaults.
            stream: Latency stream number, so instances sharing a config wait differently (use
                the pool slot index).
        """
        super().__init__()
        self.config = config or SimConfig()
        self._latency = LatencyModel(self.config.latency, stream)
        self.latencies: deque[LatencySample] = deque(maxlen=self.config.latency_log_size)
        """Recent simulated waits, oldest first."""
        self._task: SimTask | None = None
        self._task_id = ""
        self._steps = 0

    @property
    def screen_size(self) -> tuple[int, int]:
        """Screenshot size ``(width, height)`` in pixels."""
        return self.config.width, self.config.height

    @property
    def last_latency_s(self) -> float:
        """The latest simulated wait, seconds (0 before any operation)."""
        return self.latencies[-1].seconds if self.latencies else 0.0

    @property
    def task(self) -> SimTask | None:
        """The current task with its live window and goal (for tests and tools, not the policy)."""
        return self._task

    async def reset(self, task: TaskSpec, seed: int | None = None) -> tuple[Observation, str]:
        """Start an episode of a sim task.

        Args:
            task: A task with ``backend: sim`` and :class:`SimTaskParams` as ``params``.
            seed: Layout seed for tasks whose params carry none (default 0); ignored otherwise,
                so every rollout of a suite task sees the same screen.

        Returns:
            The first observation and the generated instruction (the suite's text is only a
            copy; the generator is authoritative).

        Raises:
            TaskParamsError: Not a sim task, or invalid params.
            LayoutError: The configured screen is too small for the task.
            EpisodeStateError: The env is closed.
        """
        self._require("reset", BackendState.CREATED, BackendState.READY, BackendState.IN_EPISODE, BackendState.DONE)
        if self._state == BackendState.CREATED:
            await self.start()
        sim_task = self._begin(task, seed)
        observation = self._observe()
        await self._wait("reset")
        return observation, sim_task.instruction

    async def _replay(self, task: TaskSpec, seed: int | None, actions: list[Action]) -> tuple[list[Observation], str]:
        """Start an episode of ``task`` in the state ``actions`` lead to, at the cost of one reset.

        The sim's whole state is its task's window, a function of the task, the seed and the actions applied: it
        is rebuilt here without a step's simulated latency, which is the sim's way of copying an episode's state
        (and works on any instance, whichever one ran the parent).

        Raises:
            ForkRefusedError: An action ended the episode (``fork_ended``).
            TaskParamsError: As :meth:`reset`.
        """
        self._require("fork", BackendState.CREATED, BackendState.READY, BackendState.IN_EPISODE, BackendState.DONE)
        if self._state == BackendState.CREATED:
            await self.start()
        sim_task = self._begin(task, seed)
        observations = [self._observe()]
        for i, action in enumerate(actions):
            _event, done = self._apply(action)
            observations.append(self._observe())
            if done:
                raise ForkRefusedError("fork_ended", f"replayed action {i} ({action.kind}) ended the episode")
        await self._wait("reset")
        return observations, sim_task.instruction

    async def step(self, action: Action) -> tuple[Observation, bool, dict[str, MetadataValue]]:
        """Execute an action (see :mod:`dart.env.sim.interaction` for what each one does).

        Returns:
            The observation, whether the episode is done (a button was pressed, or the action was
            ``finished``/``fail``), and info: ``event`` (what happened), ``step`` (1-based).

        Raises:
            EpisodeStateError: No episode is running.
        """
        self._require("step", BackendState.IN_EPISODE)
        event, done = self._apply(action)
        observation = self._observe()
        await self._wait("step")
        return observation, done, {"event": event, "step": self._steps}

    async def evaluate(self) -> tuple[float, bool, dict[str, MetadataValue]]:
        """Score the episode (rules in :mod:`dart.env.sim.families`).

        Returns:
            Reward 1.0 or 0.0, success, and details: ``family``, ``submitted``, ``pressed``,
            ``reason`` (empty on success) and ``steps``.

        Raises:
            EpisodeStateError: There is no episode.
        """
        self._require("evaluate", BackendState.IN_EPISODE, BackendState.DONE)
        reward, details = evaluate(self._current())
        details["steps"] = self._steps
        await self._wait("evaluate")
        return reward, reward == 1.0, details

    async def close(self) -> None:
        """Drop the episode; further calls raise (idempotent)."""
        self._state = BackendState.CLOSED
        self._task = None

    def task_from_id(self, task_id: str) -> TaskSpec | None:
        """The sim task an id names (``sim/<family>/<difficulty>/<seed>``, as :func:`~dart.env.sim.sim_task` writes
        it), or None."""
        return sim_task_from_id(task_id)

    def oracle_action(self) -> tuple[str, Action] | None:
        """The next correct ``(thought, action)``, or None when no episode is running."""
        if self._state != BackendState.IN_EPISODE or self._task is None:
            return None
        return oracle_action(self._task)

    def screenshot(self) -> bytes:
        """The current screen as PNG bytes (no simulated latency).

        Raises:
            EpisodeStateError: There is no episode.
        """
        self._require("screenshot", BackendState.IN_EPISODE, BackendState.DONE)
        return render_png(self._current().window)

    @classmethod
    def parse_params(cls, task: TaskSpec) -> SimTaskParams:
        """Validate a task for this backend.

        Raises:
            TaskParamsError: Not a sim task, or its params are not :class:`SimTaskParams`.
        """
        if task.backend != cls.name:
            raise TaskParamsError(task.task_id, cls.name, f"it is a {task.backend!r} task")
        try:
            return SimTaskParams.model_validate(task.params)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "params"
            raise TaskParamsError(
                task.task_id, cls.name, f"params.{where}: {err['msg']} (expected {{family, difficulty, seed}})"
            ) from None

    def _begin(self, task: TaskSpec, seed: int | None) -> SimTask:
        """A new episode's state: the task's window, built from its params and layout seed."""
        params = self.parse_params(task)
        layout_seed = params.seed if params.seed is not None else (seed or 0)
        self._task = build_task(params, layout_seed, self.config.width, self.config.height)
        self._task_id, self._steps, self._state = task.task_id, 0, BackendState.IN_EPISODE
        return self._task

    def _apply(self, action: Action) -> tuple[str, bool]:
        """Apply an action to the window; returns what happened and whether the episode is done (then ``done``)."""
        task = self._current()
        event = apply_action(task.window, action)
        self._steps += 1
        done = action.kind in TERMINAL_ACTION_KINDS or task.window.submitted
        if done:
            self._state = BackendState.DONE
        return event, done

    def _current(self) -> SimTask:
        assert self._task is not None  # every state that reaches here has a task
        return self._task

    def _observe(self) -> Observation:
        task = self._current()
        png = render_png(task.window)
        return Observation(
            screenshot=InlineImage(png=png, width=self.config.width, height=self.config.height),
            text=task.instruction,
            metadata={"task_id": self._task_id, "family": task.params.family, "step": self._steps},
        )

    async def _wait(self, op: Operation) -> None:
        seconds = self._latency.sample(op)
        self.latencies.append(LatencySample(op, seconds))
        # Even a zero wait yields to the loop, so a pool of fast sim envs cannot starve other tasks.
        await asyncio.sleep(seconds)
