"""Trajectory ingestion: from the ``traj`` stream into the store, the index, statistics and groups.

A delivery's lifecycle: ``delivered`` -> ``checked`` (:mod:`dart.data.admission`: a trajectory that
is meaningless is ``rejected``: recorded in ``rejected_trajectories`` with its reason, counted in
``data.rejected``, logged once per reason, and acked, so it is neither redelivered nor stored, grouped,
counted in statistics or pooled; its work item, if real, expires as unanswered) -> screenshots and
JSON ``stored`` as blobs
(content-addressed, so a retry rewrites nothing) -> ``indexed`` (one row, in the same transaction
as the task's new statistics; a redelivery finds the row and changes nothing) -> statistics and
experience pool ``updated`` (first delivery only; a branch counts in neither) -> its branches ``emitted``
(first delivery only, where branching is on: :mod:`dart.data.branching`) -> ``grouped`` (offered to the batch former) ->
the emitter told it ``arrived`` (first delivery only) -> ``acked``. A storage failure naks the
delivery, and the stream redelivers it after ``ingest.retry_delay_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from dart.data.admission import Rejection, check_trajectory, undecodable_reason
from dart.data.blobs import StoredTrajectory
from dart.data.config import IngestConfig
from dart.data.former import BatchFormer
from dart.data.index import trajectory_row
from dart.data.state import DataState
from dart.data.stats import TaskStats
from dart.protocol.errors import MessageValidationError
from dart.protocol.messages import TaskSpec, Trajectory
from dart.runtime.bus import Delivery, PullConsumer

log = logging.getLogger("dart.data")


@dataclass(frozen=True)
class _Stored:
    stored: StoredTrajectory
    inserted: bool
    """Whether the trajectory was new (False: a redelivery found it stored)."""
    new_stats: TaskStats | None
    """The task's new statistics (new trainable trajectories only)."""
    group_closed: bool
    """For a redelivery: whether its group was already batched or dropped."""


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
        *,
        tasks: Mapping[str, TaskSpec] | None = None,
        require_work: bool = False,
        branch: Callable[[Trajectory], Awaitable[int]] | None = None,
    ) -> None:
        """Create the ingestor.

        Args:
            config: Ingestion settings.
            state: The data manager's shared state.
            former: Where stored trajectories join their groups.
            arrived: Told the group id of every new trajectory once its group was handled (the
                emitter's account of outstanding work); None when nothing emits work.
            tasks: The run's tasks by id: their declared reward ranges are what rewards are checked
                against (a trajectory's own copy of its task is used for tasks not listed).
            require_work: Refuse trajectories for work items this data manager did not emit (set
                when it emits the run's work).
            branch: Called with each newly stored trajectory before it joins its group; emits its branches
                (:mod:`dart.data.branching`) and returns how many, for the group to wait for. None: no branching.
        """
        self._config = config
        self._state = state
        self._former = former
        self._arrived = arrived
        self._tasks = dict(tasks or {})
        self._require_work = require_work
        self._branch = branch
        self._logged: set[str] = set()

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
        """Check, store, index, curate and group one delivered trajectory, then ack it."""
        state = self._state
        traj = delivery.message
        state.counters["received"] += 1
        try:
            outcome = await state.db(self._store, traj, delivery.stream, delivery.stream_seq)
        except Exception as exc:
            state.counters["ingest_errors"] += 1
            log.warning("storing trajectory %s failed, asking for redelivery: %s", traj.trajectory_id, exc)
            await delivery.nak(delay=self._config.retry_delay_s)
            return
        if isinstance(outcome, tuple):
            rejection, new = outcome
            if new:
                self._rejected(rejection, traj.trajectory_id, traj.work_id)
            # Acked: no redelivery can change what the message says.
            await delivery.ack()
            return
        stored, new_stats = outcome.stored, outcome.new_stats
        branches = 0
        if outcome.inserted:
            state.counters["stored"] += 1
            state.counters["env_steps"] += len(traj.steps) + state.replays.pop(traj.work_id, 0)
            if traj.branch_refused is not None:
                state.branches_refused[traj.branch_refused] += 1
            if new_stats is not None:
                state.task_stats[new_stats.task_id] = new_stats
            if state.pool.should_pool(stored.trajectory, new_stats):
                keep = state.config.curation.pool_size_per_task
                await state.db(state.index.add_to_pool, traj.trajectory_id, traj.task.task_id, keep)
                state.pool.add(stored.trajectory)
            if self._branch is not None:
                branches = await self._branch(stored.trajectory)
        else:
            state.counters["duplicates"] += 1
        # Duplicates of open groups are offered too: after a crash between indexing and acking,
        # the redelivery is the only way the trajectory reaches its group (the assembler drops
        # true repeats). A group already batched or dropped must not be formed a second time.
        if not outcome.group_closed:
            await self._former.offer(stored.trajectory, branches=branches)
        # Told only after its group was handled: a coupled round's batch must see the group it closed.
        if outcome.inserted and self._arrived is not None:
            self._arrived(traj.group_id)
        await delivery.ack()

    async def undecodable(self, stream: str, stream_seq: int, error: MessageValidationError) -> None:
        """Record a message that failed the wire schema (the consumer terminates it)."""
        state = self._state
        state.counters["received"] += 1
        rejection = undecodable_reason(error)
        if await state.db(state.index.record_rejection, stream, stream_seq, rejection.reason, rejection.detail):
            self._rejected(rejection, None, None)

    def _rejected(self, rejection: Rejection, trajectory_id: str | None, work_id: str | None) -> None:
        state = self._state
        state.rejected[rejection.reason] += 1
        if state.telemetry is not None:
            state.telemetry.event(
                "data.rejected",
                reason=rejection.reason,
                count=state.rejected[rejection.reason],
                trajectory_id=trajectory_id or "",
                work_id=work_id or "",
                detail=rejection.detail[:500],
            )
        # Once per reason: a misbehaving runner would otherwise flood the log; the table has every one.
        if rejection.reason not in self._logged:
            self._logged.add(rejection.reason)
            log.warning(
                "rejected trajectory %s (%s): %s; further %s rejections are counted in data.rejected, not logged",
                trajectory_id,
                rejection.reason,
                rejection.detail,
                rejection.reason,
            )

    def _store(self, traj: Trajectory, stream: str, stream_seq: int) -> _Stored | tuple[Rejection, bool]:
        """Checks, blobs, then the row (and the task's statistics, in the same transaction). Worker thread.

        Returns:
            What was stored, or the rejection and whether it was newly recorded (False for a
            redelivery of a message already rejected).
        """
        state = self._state
        index = state.index
        if index.trajectory(traj.trajectory_id) is None:  # a redelivery of a stored one was checked then
            rejection = check_trajectory(
                traj,
                work=index.work_item(traj.work_id) if self._require_work else None,
                require_work=self._require_work,
                task=self._tasks.get(traj.task.task_id),
                answered_by=index.trajectory_ids_of_work(traj.work_id),
                image_exists=state.blobs.image_exists,
                image_is_ours=state.blobs.is_ours,
            )
            if rejection is not None:
                new = index.record_rejection(
                    stream,
                    stream_seq,
                    rejection.reason,
                    rejection.detail,
                    trajectory_id=traj.trajectory_id,
                    work_id=traj.work_id,
                    task_id=traj.task.task_id,
                )
                return rejection, new
        stored = state.blobs.put(traj)
        new_stats = None
        if traj.trainable and traj.branch is None:  # a branch's outcome is conditioned on its parent's prefix
            old = state.task_stats.get(traj.task.task_id) or TaskStats(traj.task.task_id)
            new_stats = old.recorded(traj.success, len(traj.steps), state.config.curation.stats_window)
        shared = state.blobs.shared_image_keys(stored.trajectory)
        inserted = index.store_trajectory(trajectory_row(stored), new_stats, shared)
        if inserted:
            return _Stored(stored, True, new_stats, False)
        group = index.group(traj.group_id)
        return _Stored(stored, False, None, group is not None and group["status"] != "open")
