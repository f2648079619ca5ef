"""Trajectory ingestion: from the ``traj`` stream into the store, the index, statistics and groups.

A delivery's lifecycle: ``delivered`` -> screenshots and JSON ``stored`` as blobs
(content-addressed, so a retry rewrites nothing) -> ``indexed`` (one row, in the same transaction
as the task's new statistics; a redelivery finds the row and changes nothing) -> statistics and
experience pool ``updated`` (first delivery only) -> ``grouped`` (offered to the batch former) ->
the emitter told it ``arrived`` (first delivery only) -> ``acked``. A storage failure naks the
delivery, and the stream redelivers it after ``ingest.retry_delay_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dart.data.blobs import StoredTrajectory
from dart.data.config import IngestConfig
from dart.data.former import BatchFormer
from dart.data.index import trajectory_row
from dart.data.state import DataState
from dart.data.stats import TaskStats
from dart.protocol.bus import Delivery, PullConsumer
from dart.protocol.messages import Trajectory

log = logging.getLogger("dart.data")


class Ingestor:
    """Consumes the trajectory stream.

    Example::

        ingestor = Ingestor(config.ingest, state, former, arrived=emitter.arrived)
        task = asyncio.create_task(ingestor.run(consumer))
    """

    def __init__(
        self,
        config: IngestConfig,
        state: DataState,
        former: BatchFormer,
        arrived: Callable[[str], None] | None = None,
    ) -> None:
        """Create the ingestor.

        Args:
            config: Ingestion settings.
            state: The data manager's shared state.
            former: Where stored trajectories join their groups.
            arrived: Told the group id of every new trajectory once its group was handled (the
                emitter's account of outstanding work); None when nothing emits work.
        """
        self._config = config
        self._state = state
        self._former = former
        self._arrived = arrived

    async def run(self, consumer: PullConsumer[Trajectory]) -> None:
        """Fetch and ingest until cancelled; a failing bus is retried, not fatal."""
        while True:
            try:
                deliveries = await consumer.fetch(self._config.fetch_batch, timeout=1.0)
                for delivery in deliveries:
                    with delivery.span():
                        await self.ingest(delivery)
            except asyncio.CancelledError:
                raise
            except Exception:
                # The bus reconnects on its own; keep consuming rather than dying with it.
                log.exception("trajectory ingestion failed; retrying")
                await asyncio.sleep(1.0)

    async def ingest(self, delivery: Delivery[Trajectory]) -> None:
        """Store, index, curate and group one delivered trajectory, then ack it."""
        state = self._state
        traj = delivery.message
        state.counters["received"] += 1
        try:
            stored, inserted, new_stats, group_closed = await state.db(self._store, traj)
        except Exception as exc:
            state.counters["ingest_errors"] += 1
            log.warning("storing trajectory %s failed, asking for redelivery: %s", traj.trajectory_id, exc)
            await delivery.nak(delay=self._config.retry_delay_s)
            return
        if inserted:
            state.counters["stored"] += 1
            if new_stats is not None:
                state.task_stats[new_stats.task_id] = new_stats
            if state.pool.should_pool(stored.trajectory, new_stats):
                keep = state.config.curation.pool_size_per_task
                await state.db(state.index.add_to_pool, traj.trajectory_id, traj.task.task_id, keep)
                state.pool.add(stored.trajectory)
        else:
            state.counters["duplicates"] += 1
        # Duplicates of open groups are offered too: after a crash between indexing and acking,
        # the redelivery is the only way the trajectory reaches its group (the assembler drops
        # true repeats). A group already batched or dropped must not be formed a second time.
        if not group_closed:
            await self._former.offer(stored.trajectory)
        # Told only after its group was handled: a coupled round's batch must see the group it closed.
        if inserted and self._arrived is not None:
            self._arrived(traj.group_id)
        await delivery.ack()

    def _store(self, traj: Trajectory) -> tuple[StoredTrajectory, bool, TaskStats | None, bool]:
        """Blobs, then the row (and the task's statistics, in the same transaction). Worker thread.

        Returns:
            The stored trajectory, whether it was new, the task's new statistics (new trainable
            trajectories only) and, for a duplicate, whether its group was already closed.
        """
        state = self._state
        stored = state.blobs.put(traj)
        new_stats = None
        if traj.trainable:
            old = state.task_stats.get(traj.task.task_id) or TaskStats(traj.task.task_id)
            new_stats = old.recorded(traj.success, len(traj.steps), state.config.curation.stats_window)
        inserted = state.index.store_trajectory(trajectory_row(stored), new_stats)
        if inserted:
            return stored, True, new_stats, False
        group = state.index.group(traj.group_id)
        return stored, False, None, group is not None and group["status"] != "open"
