"""Routes generation requests to the least-loaded serving engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from dart.rollout.engine.interface import EngineState, InferenceEngine
from dart.rollout.errors import NoEngineError
from dart.runtime.telemetry import BusySection, BusyTracker, Telemetry


class EngineRouter:
    """Picks an engine per request: the least loaded among those SERVING.

    Engines that are draining or loading (a weight update) or closed are skipped, so an update
    on one engine shifts its traffic to the others instead of queueing behind it, and so are engines
    ``admits`` turns away (the rollout service's: engines lent to an evaluation). When no engine is
    serving, :meth:`pick` waits until one is. Ties go round-robin so idle engines share work.

    Engine busy time (any request in flight) is accounted per engine with a
    :class:`~dart.runtime.telemetry.BusyTracker`; wrap each generate call in :meth:`busy`.

    Example::

        router = EngineRouter({"e0": engine0, "e1": engine1})
        engine = await router.pick()
        with router.busy(engine):
            result = await engine.generate(request)

    Args:
        engines: Engines by id (a sequence gets ids ``engine-0`` ...).
        telemetry: Where busy intervals go; None keeps them in memory.
        poll_interval_s: How often a waiting :meth:`pick` re-checks engine states, seconds
            (engines do not announce state changes).
        admits: Whether an engine id may take requests now, beyond its state (e.g.
            :meth:`~dart.rollout.service.sync.WeightSyncController.serves_training`); None admits every
            serving engine.
    """

    def __init__(
        self,
        engines: dict[str, InferenceEngine] | Sequence[InferenceEngine],
        *,
        telemetry: Telemetry | None = None,
        poll_interval_s: float = 0.01,
        admits: Callable[[str], bool] | None = None,
    ) -> None:
        if not isinstance(engines, dict):
            engines = {f"engine-{i}": engine for i, engine in enumerate(engines)}
        if not engines:
            raise ValueError("an EngineRouter needs at least one engine")
        self._engines = dict(engines)
        self._ids = {id(engine): engine_id for engine_id, engine in self._engines.items()}
        self._busy = {engine_id: BusyTracker("engine", engine_id, telemetry) for engine_id in self._engines}
        self._poll_interval_s = poll_interval_s
        self._admits = admits
        self._turn = 0

    @property
    def engines(self) -> dict[str, InferenceEngine]:
        """Engines by id."""
        return dict(self._engines)

    def engine_id(self, engine: InferenceEngine) -> str:
        """The id the router knows ``engine`` by."""
        return self._ids[id(engine)]

    def busy(self, engine: InferenceEngine) -> BusySection:
        """A context manager marking ``engine`` busy (a generate call in flight)."""
        return self._busy[self.engine_id(engine)].busy("generate")

    def busy_seconds(self) -> dict[str, float]:
        """Busy time so far per engine id, seconds."""
        return {engine_id: tracker.busy_seconds for engine_id, tracker in self._busy.items()}

    def try_pick(self, min_version: int = 0) -> InferenceEngine | None:
        """The least-loaded serving (and admitted) engine at ``min_version`` or newer, or None right now."""
        candidates = [
            e
            for engine_id, e in self._engines.items()
            if e.state is EngineState.SERVING
            and e.version >= min_version
            and (self._admits is None or self._admits(engine_id))
        ]
        if not candidates:
            return None
        least = min(e.load for e in candidates)
        tied = [e for e in candidates if e.load == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    async def pick(
        self, *, min_version: int = 0, min_version_wait_s: float = 0.0, timeout_s: float | None = None
    ) -> InferenceEngine:
        """The least-loaded serving engine, waiting for one when none is serving.

        Args:
            min_version: Prefer engines at this policy version or newer.
            min_version_wait_s: How long to wait for such an engine before taking any serving one.
            timeout_s: Give up after this long without any serving engine; None waits forever.

        Raises:
            NoEngineError: No engine served within ``timeout_s``.
        """
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started
            engine = self.try_pick(min_version)
            if engine is None and min_version > 0 and waited >= min_version_wait_s:
                engine = self.try_pick(0)
            if engine is not None:
                return engine
            if all(e.state is EngineState.CLOSED for e in self._engines.values()):
                raise NoEngineError(waited, len(self._engines))
            if timeout_s is not None and waited >= timeout_s:
                raise NoEngineError(waited, len(self._engines))
            await asyncio.sleep(self._poll_interval_s)
