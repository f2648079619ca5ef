"""What the data manager's parts share: the index and blobs, task statistics, the pool, the version.

The ingestor, the batch former and the emitters each do one job; they meet here. Everything that
blocks (SQL, blob reads and writes) runs on one worker thread through :meth:`DataState.db`, so the
index sees one writer and the event loop stays free.

Lifecycle: ``created`` -> :meth:`DataState.load` (migrate the database, reload task statistics, the
rejection counts and the experience pool) -> ``loaded`` -> :meth:`DataState.close` (release the database, the store
client and the worker thread) -> ``closed``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dart.data.blobs import TrajectoryBlobs
from dart.data.config import DataConfig
from dart.data.curation import ExperiencePool
from dart.data.index import TrajectoryIndex
from dart.data.stats import TaskStats
from dart.runtime.store import ArtifactStore
from dart.runtime.telemetry import Telemetry

log = logging.getLogger("dart.data")

R = TypeVar("R")


class DataState:
    """The data manager's shared state (one per service).

    Attributes:
        config: The data manager's configuration.
        clock: Monotonic seconds for group and work timeouts.
        telemetry: Where ``data.*`` events go; None writes none.
        index: The SQL index of trajectories, groups, statistics and the pool.
        blobs: Trajectory blobs in the artifact store.
        task_stats: Recent outcomes per task id (updated by the ingestor, read by the planner).
        pool: The experience pool of successes of hard tasks.
        counters: Event counts by name (``received``, ``stored``, ``batches``, ...).
        rejected: Deliveries refused at ingestion, by reason (reloaded from the index at start).
        branches_refused: Branch work answered as normal rollouts because the env refused the fork, by reason.
        replays: Actions the fork of each branch work item replays, by work id, until its trajectory is stored
            (then counted in ``counters["env_steps"]``).
        version: Newest model version seen.
        new_version: Set whenever ``version`` grows (the coupled emitter waits on it).
    """

    def __init__(
        self,
        config: DataConfig,
        store: ArtifactStore,
        telemetry: Telemetry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.telemetry = telemetry
        self.index = TrajectoryIndex(config.database_url)
        self.blobs = TrajectoryBlobs(store, config.blob_prefix, upload_concurrency=config.ingest.upload_concurrency)
        self.task_stats: dict[str, TaskStats] = {}
        self.pool = ExperiencePool(config.curation)
        self.counters: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.branches_refused: Counter[str] = Counter()
        self.replays: dict[str, int] = {}
        self.version = 0
        self.new_version = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dart-data-db")

    def env_budget_spent(self) -> bool:
        """Whether the stored trajectories took ``emission.max_env_steps`` env steps (never without a budget)."""
        budget = self.config.emission.max_env_steps
        return budget is not None and self.counters["env_steps"] >= budget

    async def load(self) -> None:
        """Migrate the database, then reload task statistics, rejection counts and the experience pool.

        Raises:
            SchemaVersionError: The database is newer than this code.
        """
        before, after = await self.db(self.index.migrate)
        if before != after:
            log.info("migrated the data index from schema %d to %d", before, after)
        self.task_stats.update(await self.db(self.index.task_stats))
        self.rejected.update(await self.db(self.index.rejections))
        for entry in reversed(await self.db(self.index.pool)):  # oldest first: the newest ends in front
            self.pool.add(await self.db(self.blobs.get, entry.blob_key))

    def observe_version(self, version: int) -> None:
        """A model version was published; only a newer one changes anything."""
        if version > self.version:
            self.version = version
            self.new_version.set()

    async def db(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run blocking database or store work on the one worker thread (keeps the loop free)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def close(self) -> None:
        """Release the database and the store client, then the worker thread."""
        await self.db(self.index.close)
        await self.db(self.blobs.close)
        self._executor.shutdown(wait=False)
