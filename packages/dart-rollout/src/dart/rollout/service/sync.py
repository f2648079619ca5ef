"""Weight sync: new model versions reach the engines a bounded number at a time.

Engine update lifecycle (driven by :class:`WeightSyncController`)::

    ModelVersion v announced (state KV key LATEST_MODEL_KEY)
      -> fetch the version once (every shard, sha256-verified; :mod:`.fetch`); a failure leaves every
         engine serving its version; then a telemetry event rollout.weight_cache (host, versions, bytes
         of the host's download cache after pruning)
      -> for each engine below v, at most ``max_concurrent`` at a time:
           engine.update_weights(path, v): serving -> draining -> loading -> serving at v
           (path: the file of a one-shard version, the directory of index + shards of a sharded one)
           telemetry events engine.update.start / engine.update.end (engine id, version, times)
    a newer version announced meanwhile is applied next; versions in between are skipped.
    a failed fetch or engine update is retried after ``retry_backoff_s`` (doubling up to
    ``retry_backoff_max_s``) without waiting for another announcement; a newer version cuts the wait.

In ``decoupled`` mode with two or more engines, at least one engine is serving at any time, so
trajectory runners never stall on an update; ``coupled`` mode updates every engine at once.

An evaluation holds one engine at the version under test (:meth:`WeightSyncController.hold`). An
engine lent to an evaluation serves training only at the rollout version (the newest announced or
applied; :meth:`WeightSyncController.serves_training`, which the service's router asks)::

    serving training --hold(v)--> held: out of updates; the least-loaded engine at v, or else the
        least-loaded one, loaded with v once the training requests it had taken are answered.
        Out of training unless v is the rollout version (then until a newer one is announced).
      --the hold ends--> returning: out of training; the applier brings it to the rollout version
      --at the rollout version--> serving training (an engine already there skips ``returning``)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from dart.protocol.messages import ModelVersion
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.rollout.engine.interface import EngineState, InferenceEngine
from dart.rollout.errors import EngineError, NoEngineAtVersionError, WeightFetchError
from dart.rollout.service.config import SyncConfig
from dart.rollout.service.fetch import cache_root, cache_usage, fetch_weights
from dart.runtime.bus import KeyValueStore
from dart.runtime.retry import Backoff, pause
from dart.runtime.store import StoreConfig
from dart.runtime.telemetry import Telemetry, current_telemetry
from dart.runtime.waiting import cancel_and_wait

__all__ = ["EngineUpdate", "WeightSyncController", "fetch_weights", "max_concurrent_updates"]

log = logging.getLogger("dart.rollout.sync")

_DRAIN_POLL_S = 0.01
"""How often a hold re-reads the load of the engine it waits to load, seconds."""


@dataclass(frozen=True)
class EngineUpdate:
    """One engine update, as recorded by the controller.

    Attributes:
        engine_id: Which engine.
        version: The version it was updated to (or failed to load).
        started_at: Unix time the update began, seconds.
        finished_at: Unix time it ended, seconds.
        ok: Whether the engine serves ``version`` now.
        error: Why it failed, when it did.
    """

    engine_id: str
    version: int
    started_at: float
    finished_at: float
    ok: bool
    error: str | None = None


def max_concurrent_updates(num_engines: int, config: SyncConfig) -> int:
    """How many engines may update at once under ``config``."""
    if config.mode == "coupled":
        return num_engines
    allowed = max(1, math.floor(config.max_updating_fraction * num_engines))
    # Decoupled means someone always serves: never take the last serving engine down.
    return min(allowed, num_engines - 1) if num_engines >= 2 else 1


class WeightSyncController:
    """Brings engines to the newest announced model version; see the module docstring.

    Example::

        sync = WeightSyncController({"e0": engine0, "e1": engine1}, SyncConfig())
        await sync.start(state_kv)      # watches LATEST_MODEL_KEY
        ...
        await sync.stop()

    Or, without a bus, ``await sync.apply(model_version)``.

    Args:
        engines: Engines by id.
        config: Mode and how many engines may update at once.
        telemetry: Where ``engine.update.*`` events go; None uses the active telemetry, if any.
        store_config: Endpoint and credentials for ``s3://`` weight URIs.
    """

    def __init__(
        self,
        engines: dict[str, InferenceEngine],
        config: SyncConfig,
        *,
        telemetry: Telemetry | None = None,
        store_config: StoreConfig | None = None,
    ) -> None:
        self._engines = dict(engines)
        self._store_config = store_config
        self._config = config
        self._telemetry = telemetry
        self._limit = max_concurrent_updates(len(self._engines), config)
        self._latest: ModelVersion | None = None
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._apply_lock = asyncio.Lock()
        self._held: dict[str, int] = {}  # engine id -> the version it is held at
        self._returning: set[str] = set()
        self._rollout_version = 0
        self.updates: list[EngineUpdate] = []
        """Every update attempted, in completion order."""
        self.failed_fetches = 0
        """Announced versions whose weights could not be fetched or verified."""
        self.retries = 0
        """Times a version was applied again after a failed fetch or engine update."""

    @property
    def max_concurrent(self) -> int:
        """Engines that may update at once."""
        return self._limit

    @property
    def rollout_version(self) -> int:
        """The newest version announced or applied (0 before any): what training is served with."""
        return self._rollout_version

    def serves_training(self, engine_id: str) -> bool:
        """Whether ``engine_id`` may take training requests now; the service's router admits only such engines.

        Every engine may, except one lent to an evaluation at another version than :attr:`rollout_version`
        (held there, or released and not yet back): held at the rollout version itself, it serves training
        beside the evaluation, until a newer version is announced.
        """
        if engine_id in self._returning:
            return False
        held_at = self._held.get(engine_id)
        return held_at is None or held_at == self._rollout_version == self._engines[engine_id].version

    async def start(self, state: KeyValueStore) -> None:
        """Watch ``state`` for new versions and apply them in the background."""
        self._tasks = [
            asyncio.create_task(self._watch(state), name="sync-watch"),
            asyncio.create_task(self._apply_forever(), name="sync-apply"),
        ]

    async def stop(self) -> None:
        """Stop watching; an update in progress is cancelled (its engine keeps its old weights)."""
        await cancel_and_wait(self._tasks)
        self._tasks = []

    def announce(self, version: ModelVersion) -> None:
        """Queue ``version`` for the background applier (newer versions replace older pending ones)."""
        if self._latest is None or version.version > self._latest.version:
            self._latest = version
            self._rollout_version = max(self._rollout_version, version.version)
            self._wakeup.set()

    async def apply(self, version: ModelVersion) -> list[EngineUpdate]:
        """Fetch ``version`` and update every engine below it, ``max_concurrent`` at a time.

        Returns:
            The updates made by this call.

        Raises:
            WeightFetchError: The weights could not be fetched or verified; no engine changed.
        """
        async with self._apply_lock:
            self._rollout_version = max(self._rollout_version, version.version)
            stale = [
                (eid, e) for eid, e in self._engines.items() if e.version < version.version and eid not in self._held
            ]
            if not stale:
                return []
            try:
                path = await self._fetch(version)
            except WeightFetchError:
                self.failed_fetches += 1
                raise
            gate = asyncio.Semaphore(self._limit)

            async def update(engine_id: str, engine: InferenceEngine) -> EngineUpdate:
                async with gate:
                    return await self._update_one(engine_id, engine, path, version.version)

            return list(await asyncio.gather(*(update(eid, e) for eid, e in stale)))

    @contextlib.asynccontextmanager
    async def hold(
        self, version: ModelVersion | None, *, timeout_s: float
    ) -> AsyncIterator[tuple[str, InferenceEngine]]:
        """One engine serving exactly ``version``, kept there until the block ends (see the module docstring).

        The least-loaded engine already at the version is taken; when none is, the least-loaded one
        is loaded with it once the training requests it had taken are answered (``version`` None means
        the checkpoint the engines started from, which is never loaded back). Updates wait while the
        choice and that load happen, not while the block runs. From the choice on, the engine takes
        training requests only while it is at :attr:`rollout_version` (:meth:`serves_training`); held at
        another version, it takes none until the sync has brought it back after the block.

        ``version`` is trusted: the caller passes a record the trainer announced (the rollout service
        reads it from the ``model`` stream), never one a request carried.

        Raises:
            NoEngineAtVersionError: Every engine is held or closed, or none serves the start checkpoint
                any more when ``version`` is None.
            WeightFetchError: The version's weights could not be fetched or verified.
            EngineError: The chosen engine failed to load the version (it is released to the sync).
            TimeoutError: No engine could be held within ``timeout_s`` (an update takes longer).
        """
        target = version.version if version is not None else 0
        async with asyncio.timeout(timeout_s), self._apply_lock:
            free = [
                (eid, e) for eid, e in self._engines.items() if eid not in self._held and e.state is EngineState.SERVING
            ]
            exact = [(eid, e) for eid, e in free if e.version == target]
            if not exact and (version is None or not free):
                served = sorted({e.version for _, e in free})
                raise NoEngineAtVersionError(target, served, len(self._engines) - len(free))
            engine_id, engine = min(exact or free, key=lambda pair: pair[1].load)
            self._held[engine_id] = target
            self._returning.discard(engine_id)
            try:
                if engine.version != target:
                    assert version is not None
                    # Requests the router gave it before the hold would be answered by the evaluated
                    # weights if they waited in its queue through the load: let them finish first.
                    while engine.load > 0:  # noqa: ASYNC110  (engines do not announce their load)
                        await asyncio.sleep(_DRAIN_POLL_S)
                    path = await self._fetch(version)
                    record = await self._update_one(engine_id, engine, path, target)
                    if not record.ok:
                        raise EngineError(f"engine {engine_id} could not load version {target}: {record.error}")
            except BaseException:
                self._release(engine_id)
                raise
        try:
            yield engine_id, engine
        finally:
            self._release(engine_id)

    async def _fetch(self, version: ModelVersion) -> Path:
        """``version``'s weights on this host (:func:`~dart.rollout.service.fetch.fetch_weights`); when they were
        downloaded, a ``rollout.weight_cache`` event: what the host's download cache holds after its pruning."""
        cache_dir = self._config.cache_dir
        path = await fetch_weights(
            version, store_config=self._store_config, cache_dir=cache_dir, keep=self._config.keep_versions
        )
        if path.parent == cache_root(cache_dir):  # a file:// version is read in place: nothing downloaded
            versions, size = await asyncio.to_thread(cache_usage, cache_dir)
            self._event("rollout.weight_cache", host=socket.gethostname(), versions=versions, bytes=size)
        return path

    def _release(self, engine_id: str) -> None:
        self._held.pop(engine_id, None)
        if self._engines[engine_id].version < self._rollout_version:
            self._returning.add(engine_id)
            self._wakeup.set()  # the applier brings it to the rollout version

    async def _update_one(self, engine_id: str, engine: InferenceEngine, path: Path, version: int) -> EngineUpdate:
        started = time.time()
        self._event("engine.update.start", engine_id=engine_id, version=version, ts=started)
        error: str | None = None
        try:
            await engine.update_weights(path, version)
        except EngineError as exc:
            error = str(exc)
            log.error("engine %s could not load version %d: %s", engine_id, version, exc)
        record = EngineUpdate(engine_id, version, started, time.time(), error is None, error)
        if engine.version >= self._rollout_version:
            self._returning.discard(engine_id)  # back from an evaluation: it serves training again
        self.updates.append(record)
        self._event(
            "engine.update.end",
            engine_id=engine_id,
            version=version,
            ts=record.finished_at,
            started_at=started,
            ok=record.ok,
            error=error or "",
        )
        return record

    def _event(self, name: str, **attrs: object) -> None:
        telemetry = self._telemetry or current_telemetry()
        if telemetry is not None:
            telemetry.event(name, **attrs)

    async def _watch(self, state: KeyValueStore) -> None:
        async for entry in state.watch(ModelVersion, LATEST_MODEL_KEY):
            if entry.value is not None:
                self.announce(entry.value)

    async def _apply_forever(self) -> None:
        backoff = Backoff(self._config.retry_backoff_s, max_s=self._config.retry_backoff_max_s)
        delays = backoff.delays()
        failed_version: int | None = None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            version = self._latest
            if version is None:
                continue
            if version.version == failed_version:
                self.retries += 1
            else:
                delays = backoff.delays()  # a new version starts at the first delay
            try:
                failed = not all(u.ok for u in await self.apply(version))
            except WeightFetchError as exc:
                log.error("%s", exc)
                failed = True
            if not failed:
                failed_version = None
                continue
            failed_version = version.version
            # Try again after a backoff, or at once when a newer version is announced meanwhile.
            delay = next(delays)
            log.warning("version %d did not reach every engine; retrying in %.3gs", version.version, delay)
            await pause(delay, wake=self._wakeup)
            self._wakeup.set()
