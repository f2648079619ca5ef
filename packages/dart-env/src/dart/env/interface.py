"""The interface every env backend implements (sim, MiniWoB++, desktop, OSWorld), and their registry.

The env service hosts backend instances in pools and calls them from its asyncio loop; a backend
must never block that loop (slow work goes to a thread or a subprocess). Backends are found by name in
:data:`ENV_BACKENDS` (entry-point group ``dart.env_backends``; see :mod:`dart.protocol.registry`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import StrEnum
from types import TracebackType
from typing import Any, ClassVar

from dart.env.errors import EpisodeStateError, ForkRefusedError
from dart.protocol.messages import Action, Observation, TaskSpec
from dart.protocol.messages.observation import MetadataValue
from dart.protocol.registry import Registry


class BackendState(StrEnum):
    """Where a backend instance is in its lifecycle (see :class:`EnvBackend`)."""

    CREATED = "created"
    """Constructed; nothing started yet."""
    READY = "ready"
    """Started (browser up, desktop booted); waiting for the first reset."""
    IN_EPISODE = "in_episode"
    """Reset to a task; accepting steps."""
    DONE = "done"
    """The episode ended (a terminal action, or the task itself ended it); evaluate or reset."""
    CLOSED = "closed"
    """Shut down for good; every call but :meth:`EnvBackend.close` raises."""


_HINTS = {
    BackendState.CREATED: "call reset first",
    BackendState.READY: "no episode yet; call reset first",
    BackendState.DONE: "the episode has ended; evaluate it, or reset to start a new one",
    BackendState.CLOSED: "the env was closed; use another instance",
}


class EnvBackend(ABC):
    """One GUI environment instance.

    Lifecycle::

        created --start()--> ready --reset(task)--> in_episode --step()...--> done
                                          ^                                    |
                                          +------------- reset(task) ----------+
        any state --close()--> closed

    - :meth:`start` brings the environment up (launch a browser, boot a desktop); backends that
      need nothing do nothing. :meth:`reset` on a ``created`` backend starts it first.
    - :meth:`reset` is allowed in every state but ``closed`` and abandons a running episode.
    - :meth:`step` is allowed only ``in_episode``; it returns ``done=True`` (and the backend moves
      to ``done``) after ``finished``/``fail`` or when the task ends the episode itself (the sim
      form was submitted, a MiniWoB episode timed out).
    - :meth:`evaluate` is allowed in ``in_episode`` and ``done`` and may be called repeatedly; it
      scores the current state.
    - :meth:`close` is idempotent. Calls in a state that does not allow them raise
      :class:`~dart.env.errors.EpisodeStateError`; a crashed environment raises another
      :class:`~dart.env.errors.EnvError`, and the service replaces the instance.
    """

    name: ClassVar[str]
    """Backend name, as in :attr:`TaskSpec.backend`."""
    forks: ClassVar[bool] = False
    """Whether :meth:`fork` rebuilds an episode's state exactly (the same task, seed and actions give the same
    screens); the env service then reports the ``fork`` feature and the data manager may branch its episodes.
    False by default: a desktop or a VM does not replay to the same pixels."""

    def __init__(self) -> None:
        self._state = BackendState.CREATED

    @property
    def state(self) -> BackendState:
        """The current lifecycle state."""
        return self._state

    @property
    @abstractmethod
    def screen_size(self) -> tuple[int, int]:
        """Screenshot size ``(width, height)`` in pixels."""

    async def start(self) -> None:
        """Bring the environment up (``created -> ready``); a no-op once started.

        Raises:
            EpisodeStateError: The backend is closed.
        """
        self._require("start", BackendState.CREATED, BackendState.READY, BackendState.IN_EPISODE, BackendState.DONE)
        if self._state == BackendState.CREATED:
            self._state = BackendState.READY

    @abstractmethod
    async def reset(self, task: TaskSpec, seed: int | None = None) -> tuple[Observation, str]:
        """Start an episode of ``task``.

        Args:
            task: The task; its ``backend`` must name this backend.
            seed: Randomness of the episode where the task leaves some open.

        Returns:
            The first observation and the instruction as the backend resolved it.

        Raises:
            TaskParamsError: The task is not for this backend or its params are invalid.
            EpisodeStateError: The backend is closed.
        """

    async def fork(self, task: TaskSpec, seed: int | None, actions: list[Action]) -> tuple[list[Observation], str]:
        """Start an episode of ``task`` in the state ``actions`` lead to (:meth:`_replay`), where :attr:`forks`
        says the backend can. The env service checks the screens against the parent's.

        Returns:
            The observation after the reset and after each action (``len(actions) + 1``), and the instruction.

        Raises:
            ForkRefusedError: The backend does not fork (``fork_unsupported``), or an action ended the episode
                (``fork_ended``: the parent went on after each of them, so the replay diverged).
            TaskParamsError: As :meth:`reset`.
        """
        if not self.forks:
            raise ForkRefusedError("fork_unsupported", f"the {self.name} backend cannot fork an episode")
        return await self._replay(task, seed, actions)

    async def _replay(self, task: TaskSpec, seed: int | None, actions: list[Action]) -> tuple[list[Observation], str]:
        """What :meth:`fork` does: a reset, then each action stepped (a backend that rebuilds its state cheaper
        overrides it)."""
        first, instruction = await self.reset(task, seed)
        observations = [first]
        for i, action in enumerate(actions):
            observation, done, _info = await self.step(action)
            observations.append(observation)
            if done:  # the parent went on after every one of them
                raise ForkRefusedError("fork_ended", f"replayed action {i} ({action.kind}) ended the episode")
        return observations, instruction

    @abstractmethod
    async def step(self, action: Action) -> tuple[Observation, bool, dict[str, MetadataValue]]:
        """Execute one action.

        Returns:
            The observation after it, whether the episode is done, and info scalars.

        Raises:
            EpisodeStateError: No episode is running (never reset, done, or closed).
        """

    @abstractmethod
    async def evaluate(self) -> tuple[float, bool, dict[str, MetadataValue]]:
        """Score the episode in its current state.

        Returns:
            The reward, whether the task succeeded, and detail scalars.

        Raises:
            EpisodeStateError: There is no episode (never reset, or closed).
        """

    @abstractmethod
    async def close(self) -> None:
        """Shut the environment down (idempotent)."""

    @property
    def spent(self) -> bool:
        """Whether the backend cannot start another clean episode (a VM that cannot revert after serving one):
        the env service then replaces it before the next lease. False by default."""
        return False

    @property
    def provider_name(self) -> str | None:
        """Where the backend's machines come from (osworld: ``local``, ``docker``, ``remote``); None by default."""
        return None

    def features(self) -> frozenset[str]:
        """What this backend can run, as the requirement names tasks carry (:attr:`TaskSpec.requires
        <dart.protocol.messages.TaskSpec.requires>`, e.g. ``app:chrome``); the env service reports them to the
        data manager, which keeps the tasks whose requirements they cover. None by default (tasks of a backend
        without requirements need none)."""
        return frozenset()

    def task_from_id(self, task_id: str) -> TaskSpec | None:
        """The task this backend generates from its id alone (the sim's ``sim/<family>/<difficulty>/<seed>``),
        or None for an id it generates nothing from (the default: a backend whose tasks are data, such as
        OSWorld's). An env pool with no configured suite runs only these (:mod:`dart.env.service.pool_tasks`)."""
        return None

    def process_ids(self) -> list[int]:
        """The OS processes this backend runs (a browser's driver, an X server), whose memory, with their
        descendants', is its health's ``rss_mib``; none for an in-process backend (the default)."""
        return []

    def oracle_action(self) -> tuple[str, Action] | None:
        """The next correct action and a thought, where the backend knows it (demonstrations).

        Returns:
            ``(thought, action)``, or None when the backend has no oracle or the episode is over.
        """
        return None

    async def __aenter__(self) -> EnvBackend:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _require(self, operation: str, *allowed: BackendState) -> None:
        """Raise :class:`EpisodeStateError` unless the backend is in one of ``allowed``."""
        if self._state not in allowed:
            raise EpisodeStateError(operation, self._state.value, _HINTS.get(self._state, ""))


BackendFactory = Callable[[Any, int], EnvBackend]
"""Creates one backend instance, unstarted (the service starts it): ``factory(config, stream)`` with ``config``
the env service's :class:`~dart.env.service.config.EnvServiceConfig` (typed loosely here: that module refers
to this one). ``stream``
differs between instances (and between an instance and its replacements), for backends with per-instance
randomness. The factory reads its settings from ``config`` (its own section, or ``config.plugin`` for a
backend from another package)."""


def _is_factory(obj: object) -> None:
    if not callable(obj):
        raise TypeError(f"an env backend factory must be callable (config, stream) -> EnvBackend, got {obj!r}")


ENV_BACKENDS: Registry[BackendFactory] = Registry(
    "env_backends", what="env backend", config_field="env.backend", check=_is_factory
)
"""Env backends by name (``env.backend``): ``sim``, ``miniwob``, ``osworld`` ship with dart-env."""
