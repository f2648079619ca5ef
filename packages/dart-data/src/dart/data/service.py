"""The data manager service: ingest trajectories, curate, form groups and batches, emit work.

Trajectory ingestion lifecycle: ``delivered`` from the ``traj`` stream -> screenshots and JSON
``stored`` as blobs (content-addressed, so a retry rewrites nothing) -> ``indexed`` (one row;
a redelivery finds the row and changes nothing) -> task statistics and experience pool
``updated`` (first delivery only) -> ``grouped`` (the assembler ignores a member it already has)
-> ``acked``. A storage failure naks the delivery, and the server redelivers it later.

Emission runs in one of two modes: ``decoupled`` (keep ``max_outstanding`` trajectories requested,
batches formed as groups complete) or ``coupled``, the synchronous baseline of rounds with a batch
barrier (round lifecycle in :mod:`dart.data.coupled`).

Service lifecycle: ``created`` -> :meth:`DataService.start` (migrate the database, reload task
statistics and the pool, ensure the bus topology, start the loops) -> ``running`` ->
:meth:`DataService.stop` (cancel the loops, release the consumer and the database) -> ``stopped``.
Groups still open or waiting in an unfinished batch at stop are not trained on; their
trajectories stay stored and indexed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dart.data.batches import BatchAssembler
from dart.data.blobs import StoredTrajectory, TrajectoryBlobs
from dart.data.config import DataConfig
from dart.data.coupled import CoupledRound
from dart.data.curation import ExperiencePool
from dart.data.groups import GroupAssembler, GroupPolicy, ReadyGroup
from dart.data.index import TrajectoryIndex, trajectory_row
from dart.data.stats import TaskStats
from dart.data.work import OutstandingWork, WorkPlanner, min_policy_version
from dart.protocol.bus import Bus, Delivery, KeyValueStore, PullConsumer
from dart.protocol.errors import ConfigError
from dart.protocol.messages import ModelVersion, TaskSpec, TrainingBatch, Trajectory, WorkItem
from dart.protocol.store import ArtifactStore
from dart.protocol.telemetry import Telemetry
from dart.protocol.topology import LATEST_MODEL_KEY, durable_name, ensure_topology

log = logging.getLogger("dart.data")

R = TypeVar("R")

_STOP_GRACE_S = 10.0
"""How long stop waits for a batch being published to be recorded."""


@dataclass
class DataStats:
    """Counters of the data manager (a snapshot from :attr:`DataService.stats`).

    Attributes:
        received: Trajectory deliveries handled (duplicates included).
        stored: New trajectories stored.
        duplicates: Redelivered or republished trajectories found already stored.
        ingest_errors: Deliveries nak'ed because storing failed.
        drops: Trajectories (or groups, for ``no_samples``) discarded, by reason.
        groups_emitted: Groups that went into a training batch.
        groups_dropped: Groups dropped, by reason.
        batches: Training batches published.
        samples: Step samples published.
        work_groups: Work groups emitted.
        work_items: Work items emitted.
        outstanding: Trajectories requested and not yet received.
        pool_size: Trajectories in the experience pool.
        pool_served: Times the pool filled a group.
        policy_version: Newest model version seen.
        task_success: Recent success rate per task.
        rounds: Coupled rounds closed.
        round_lost: Coupled-round trajectories still missing when their round timed out.
        sync_timeouts: Coupled rounds whose new model version did not come in time.
    """

    received: int = 0
    stored: int = 0
    duplicates: int = 0
    ingest_errors: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    groups_emitted: int = 0
    groups_dropped: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    samples: int = 0
    work_groups: int = 0
    work_items: int = 0
    outstanding: int = 0
    pool_size: int = 0
    pool_served: int = 0
    policy_version: int = 0
    task_success: dict[str, float] = field(default_factory=dict)
    rounds: int = 0
    round_lost: int = 0
    sync_timeouts: int = 0


class DataService:
    """The data manager: one per run.

    Example::

        service = DataService(DataConfig(database_url="sqlite:///run/data.sqlite3"), bus, store, tasks)
        await service.start()
        ...
        await service.stop()
    """

    def __init__(
        self,
        config: DataConfig,
        bus: Bus,
        store: ArtifactStore,
        tasks: Sequence[TaskSpec],
        telemetry: Telemetry | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create the service (nothing runs until :meth:`start`).

        Args:
            config: Service configuration.
            bus: A connected bus.
            store: Artifact store for trajectory blobs.
            tasks: Tasks to emit work for, cycled in order (the orchestrator loads the suite).
            telemetry: Where ``data.*`` events go; None writes none.
            clock: Monotonic seconds for group and work timeouts (injectable for tests).
        """
        self.config = config
        self.bus = bus
        self._clock = clock
        self.telemetry = telemetry
        self.index = TrajectoryIndex(config.database_url)
        self.blobs = TrajectoryBlobs(store, config.blob_prefix, upload_concurrency=config.upload_concurrency)
        self.task_stats: dict[str, TaskStats] = {}
        self.pool = ExperiencePool(config.curation)
        g = config.grouping
        self.assembler = GroupAssembler(
            GroupPolicy(g.timeout_s, g.min_group_size, g.max_staleness, g.drop_zero_variance),
            clock,
            fill=self._fill_from_pool,
            on_drop=self._group_dropped,
        )
        self.batcher = BatchAssembler(config.batching, config.curation)
        self.outstanding = OutstandingWork(clock)
        # No tasks is fine for an ingest-only data manager (emission off); start() checks.
        self.planner = WorkPlanner(tasks, config.curation, config.emission, self.task_stats) if tasks else None
        self._version = 0
        self._counters: Counter[str] = Counter()
        self._groups_dropped: Counter[str] = Counter()
        self._pending_writes: list[tuple[str, str, str]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dart-data-db")
        self._tasks: list[asyncio.Task[None]] = []
        self._consumer: PullConsumer[Trajectory] | None = None
        self._state: KeyValueStore | None = None
        self._capacity = asyncio.Event()
        self._ready_lock = asyncio.Lock()
        self._stopped = False
        self._coupled = config.emission.mode == "coupled"
        self._round: CoupledRound | None = None
        self._round_progress = asyncio.Event()
        self._new_version = asyncio.Event()

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Migrate the database, reload state, bind to the bus and start the loops.

        Raises:
            ConfigError: Emission is on without tasks.
            SchemaVersionError: The database is newer than this code.
        """
        emission = self.config.emission
        if emission.enabled and self.planner is None:
            raise ConfigError("DataService", "emission.enabled", "work emission needs tasks: pass a task list")
        before, after = await self._db(self.index.migrate)
        if before != after:
            log.info("migrated the data index from schema %d to %d", before, after)
        self.task_stats.update(await self._db(self.index.task_stats))
        for entry in reversed(await self._db(self.index.pool)):  # oldest first: the newest ends in front
            self.pool.add(await self._db(self.blobs.get, entry.blob_key))
        self._state = await ensure_topology(self.bus)
        latest = await self._state.get(LATEST_MODEL_KEY, ModelVersion)
        if latest is not None:
            self._version = latest.version
        self._consumer = await self.bus.pull_consumer("traj", durable_name(self.bus, "traj"), Trajectory)
        loops: list[Callable[[], Any]] = [self._ingest_loop, self._poll_loop, self._watch_model, self._stats_loop]
        if emission.enabled:
            loops.append(self._coupled_loop if self._coupled else self._emit_loop)
        self._tasks = [asyncio.create_task(loop(), name=f"dart-data{loop.__name__}") for loop in loops]

    async def stop(self) -> None:
        """Stop the loops and release the consumer and the database. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        tasks, self._tasks = self._tasks, []
        # Let a batch being published finish recording its groups, so the index matches the stream.
        try:
            await asyncio.wait_for(self._ready_lock.acquire(), _STOP_GRACE_S)
            locked = True
        except TimeoutError:
            locked = False
        try:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if locked:
                self._ready_lock.release()
        if self._consumer is not None:
            await self._consumer.close()
            self._consumer = None
        if tasks:
            self._emit_stats()
        await self._db(self.index.close)
        await self._db(self.blobs.close)
        self._executor.shutdown(wait=False)

    async def __aenter__(self) -> DataService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def policy_version(self) -> int:
        """Newest model version seen in the state bucket."""
        return self._version

    @property
    def stats(self) -> DataStats:
        """A snapshot of the service's counters."""
        c = self._counters
        return DataStats(
            received=c["received"],
            stored=c["stored"],
            duplicates=c["duplicates"],
            ingest_errors=c["ingest_errors"],
            drops=dict(self.assembler.drops),
            groups_emitted=c["groups_emitted"],
            groups_dropped=dict(self._groups_dropped),
            batches=c["batches"],
            samples=c["samples"],
            work_groups=c["work_groups"],
            work_items=c["work_items"],
            outstanding=self.outstanding.count,
            pool_size=self.pool.size(),
            pool_served=self.pool.served,
            policy_version=self._version,
            task_success={tid: s.success_rate for tid, s in self.task_stats.items()},
            rounds=c["rounds"],
            round_lost=c["round_lost"],
            sync_timeouts=c["sync_timeouts"],
        )

    # --- ingestion ------------------------------------------------------------------------------
    async def _ingest_loop(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                deliveries = await self._consumer.fetch(self.config.ingest_batch, timeout=1.0)
                for delivery in deliveries:
                    with delivery.span():
                        await self._ingest(delivery)
            except asyncio.CancelledError:
                raise
            except Exception:
                # The bus reconnects on its own; keep consuming rather than dying with it.
                log.exception("trajectory ingestion failed; retrying")
                await asyncio.sleep(1.0)

    async def _ingest(self, delivery: Delivery[Trajectory]) -> None:
        traj = delivery.message
        self._counters["received"] += 1
        try:
            stored, inserted, new_stats, group_closed = await self._db(self._store, traj)
        except Exception as exc:
            self._counters["ingest_errors"] += 1
            log.warning("storing trajectory %s failed, asking for redelivery: %s", traj.trajectory_id, exc)
            await delivery.nak(delay=1.0)
            return
        if inserted:
            self._counters["stored"] += 1
            if new_stats is not None:
                self.task_stats[new_stats.task_id] = new_stats
            if self.pool.should_pool(stored.trajectory, new_stats):
                await self._db(
                    self.index.add_to_pool,
                    traj.trajectory_id,
                    traj.task.task_id,
                    self.config.curation.pool_size_per_task,
                )
                self.pool.add(stored.trajectory)
            if self.outstanding.received(traj.group_id):
                self._capacity.set()
        else:
            self._counters["duplicates"] += 1
        # Duplicates of open groups are offered too: after a crash between indexing and acking,
        # the redelivery is the only way the trajectory reaches its group (the assembler drops
        # true repeats). A group already batched or dropped must not be formed a second time.
        if not group_closed:
            await self._handle_ready(self.assembler.add(stored.trajectory, self._version))
        # Counted only after its group was handled: the round's batch must see the group it closed.
        if inserted and self._round is not None and self._round.record(traj.group_id):
            self._round_progress.set()
        await delivery.ack()

    def _store(self, traj: Trajectory) -> tuple[StoredTrajectory, bool, TaskStats | None, bool]:
        """Blobs, then the row (and the task's statistics, in the same transaction). Worker thread.

        Returns:
            The stored trajectory, whether it was new, the task's new statistics (new trainable
            trajectories only) and, for a duplicate, whether its group was already closed.
        """
        stored = self.blobs.put(traj)
        new_stats = None
        if traj.trainable:
            old = self.task_stats.get(traj.task.task_id) or TaskStats(traj.task.task_id)
            new_stats = old.recorded(traj.success, len(traj.steps), self.config.curation.stats_window)
        inserted = self.index.store_trajectory(trajectory_row(stored), new_stats)
        if inserted:
            return stored, True, new_stats, False
        group = self.index.group(traj.group_id)
        return stored, False, None, group is not None and group["status"] != "open"

    # --- groups and batches ---------------------------------------------------------------------
    def _fill_from_pool(self, group_id: str, members: list[Trajectory]) -> Trajectory | None:
        return self.pool.fill(members, self.task_stats.get(members[0].task.task_id))

    def _group_dropped(self, group_id: str, task_id: str, reason: str) -> None:
        # Called synchronously from the assembler: queue the write for the next _handle_ready.
        self._groups_dropped[reason] += 1
        self._pending_writes.append((group_id, task_id, reason))

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                await self._handle_ready(self.assembler.poll(self._version))
                if self.outstanding.expire(self.config.emission.work_timeout_s):
                    self._capacity.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("group polling failed; retrying")

    async def _handle_ready(self, ready: list[ReadyGroup]) -> None:
        async with self._ready_lock:
            for gid, task_id, reason in self._pending_writes:
                await self._db(self.index.record_group, gid, task_id, 0, "dropped", reason=reason)
            self._pending_writes.clear()
            for group in ready:
                # Coupled: the batch is the whole round, formed when the round closes.
                accepted, batch = self.batcher.add(group, flush_when_full=not self._coupled)
                if not accepted:
                    self._groups_dropped["no_samples"] += 1
                    await self._db(
                        self.index.record_group,
                        group.group_id,
                        group.trajectories[0].task.task_id,
                        len(group.trajectories),
                        "dropped",
                        reason="no_samples",
                    )
                if batch is not None:
                    await self._publish_batch(batch.batch, batch.groups)

    async def _publish_batch(self, batch: TrainingBatch, groups: list[ReadyGroup]) -> None:
        subject = self.bus.subjects.stream_subject("batch")
        while True:
            try:
                await self.bus.js_publish(subject, batch, msg_id=batch.batch_id)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The batch id is derived from its groups, so a retry after a lost ack is stored once.
                log.warning("publishing batch %s failed, retrying: %s", batch.batch_id, exc)
                await asyncio.sleep(1.0)
        self._counters["batches"] += 1
        self._counters["samples"] += len(batch.samples)
        self._counters["groups_emitted"] += len(groups)
        if self.telemetry is not None:
            self.telemetry.event(
                "data.batch",
                batch_id=batch.batch_id,
                samples=len(batch.samples),
                groups=len(groups),
                min_policy_version=batch.min_policy_version,
                max_policy_version=batch.max_policy_version,
                staleness=self._version - batch.min_policy_version,
            )
        for group in groups:
            await self._db(
                self.index.record_group,
                group.group_id,
                group.trajectories[0].task.task_id,
                len(group.trajectories),
                "emitted",
                batch_id=batch.batch_id,
            )

    # --- work emission --------------------------------------------------------------------------
    async def _emit_loop(self) -> None:
        assert self.planner is not None
        emission = self.config.emission
        subject = self.bus.subjects.stream_subject("work")
        staleness = self.config.grouping.max_staleness
        items = None
        while emission.max_groups is None or self.planner.groups_planned < emission.max_groups or items:
            try:
                items = items or self.planner.next_group(self._version, staleness)
                outstanding = self.outstanding.count
                if outstanding and outstanding + len(items) > emission.max_outstanding:
                    self._capacity.clear()
                    try:
                        await asyncio.wait_for(self._capacity.wait(), emission.poll_interval_s)
                    except TimeoutError:
                        self.outstanding.expire(emission.work_timeout_s)
                    continue
                # Items planned before a wait may predate a new policy version: refresh their floor.
                floor = min_policy_version(self._version, staleness)
                if items[0].min_policy_version != floor:
                    items = [w.model_copy(update={"min_policy_version": floor}) for w in items]
                head = items[0]
                # Count before publishing: a fast runner's trajectory may arrive mid-group.
                self.outstanding.emitted(head.group_id, len(items))
                await self._db(self.index.record_group, head.group_id, head.task.task_id, len(items), "open")
                for item in items:
                    await self.bus.js_publish(subject, item, msg_id=item.work_id)
                self._counters["work_groups"] += 1
                self._counters["work_items"] += len(items)
                items = None
            except asyncio.CancelledError:
                raise
            except Exception:
                # Publishing the same items again is harmless: work ids are dedupe ids.
                log.exception("emitting work failed; retrying")
                await asyncio.sleep(1.0)

    async def _publish_work(self, items: list[WorkItem]) -> None:
        """Record and publish one group's work items, retrying until the bus takes them."""
        subject = self.bus.subjects.stream_subject("work")
        head = items[0]
        while True:
            try:
                await self._db(self.index.record_group, head.group_id, head.task.task_id, len(items), "open")
                for item in items:
                    await self.bus.js_publish(subject, item, msg_id=item.work_id)
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                # Publishing the same items again is harmless: work ids are dedupe ids.
                log.exception("emitting work failed; retrying")
                await asyncio.sleep(1.0)
        self._counters["work_groups"] += 1
        self._counters["work_items"] += len(items)

    # --- coupled rounds -------------------------------------------------------------------------
    async def _coupled_loop(self) -> None:
        assert self.planner is not None
        emission = self.config.emission
        index = 0
        while emission.max_groups is None or self.planner.groups_planned < emission.max_groups:
            index += 1
            started = self._clock()
            rnd = await self._emit_round(index)
            await self._await_round(rnd)
            collected = self._clock()
            samples, groups = await self._close_round(rnd)
            timed_out = False
            if samples:
                timed_out = not await self._await_version(rnd.version)
            if self.telemetry is not None:
                self.telemetry.event(
                    "data.round",
                    round=index,
                    version=rnd.version,
                    requested=rnd.requested,
                    lost=rnd.missing,
                    groups=groups,
                    samples=samples,
                    collect_s=round(collected - started, 3),
                    sync_s=round(self._clock() - collected, 3),
                    sync_timed_out=timed_out,
                )

    async def _emit_round(self, index: int) -> CoupledRound:
        """Plan and publish B groups at the current version (staleness 0)."""
        assert self.planner is not None
        emission = self.config.emission
        count = emission.coupled_tasks_per_round
        if emission.max_groups is not None:
            count = min(count, emission.max_groups - self.planner.groups_planned)
        rnd = CoupledRound(index, self._version, self._clock())
        groups = [self.planner.next_group(rnd.version, 0) for _ in range(count)]
        for items in groups:
            rnd.add_group(items[0].group_id, len(items))
        # Set before publishing: a fast runner's trajectory may arrive mid-round.
        self._round = rnd
        for items in groups:
            self.outstanding.emitted(items[0].group_id, len(items))
            await self._publish_work(items)
        log.info("coupled round %d: %d work items at version %d", index, rnd.requested, rnd.version)
        return rnd

    async def _await_round(self, rnd: CoupledRound) -> None:
        """The barrier: until every trajectory of the round arrived, or ``work_timeout_s``."""
        timeout_s = self.config.emission.work_timeout_s
        while not rnd.done():
            remaining = timeout_s - (self._clock() - rnd.started_at)
            if remaining <= 0:
                log.warning("coupled round %d timed out with %d trajectories missing", rnd.index, rnd.missing)
                break
            self._round_progress.clear()
            try:
                await asyncio.wait_for(self._round_progress.wait(), min(remaining, 1.0))
            except TimeoutError:
                pass

    async def _close_round(self, rnd: CoupledRound) -> tuple[int, int]:
        """Close the round's open groups and publish its one batch; returns (samples, groups)."""
        self._round = None
        self._counters["rounds"] += 1
        self._counters["round_lost"] += rnd.missing
        closed = [g for gid in rnd.expected for g in self.assembler.close(gid)]
        await self._handle_ready(closed)
        async with self._ready_lock:
            formed = self.batcher.flush()
            if formed is None:
                log.info("coupled round %d: no group to train on, skipping training", rnd.index)
                return 0, 0
            await self._publish_batch(formed.batch, formed.groups)
        return len(formed.batch.samples), len(formed.groups)

    async def _await_version(self, version: int) -> bool:
        """Wait for a model version newer than ``version``; False when it did not come in time."""
        deadline = self._clock() + self.config.emission.coupled_sync_timeout_s
        while self._version <= version:
            remaining = deadline - self._clock()
            if remaining <= 0:
                log.warning("no model version after %d came in time; emitting at the old one", version)
                self._counters["sync_timeouts"] += 1
                return False
            self._new_version.clear()
            try:
                await asyncio.wait_for(self._new_version.wait(), min(remaining, 1.0))
            except TimeoutError:
                pass
        return True

    # --- model version and telemetry ------------------------------------------------------------
    async def _watch_model(self) -> None:
        assert self._state is not None
        while True:
            try:
                async for entry in self._state.watch(ModelVersion, LATEST_MODEL_KEY):
                    if isinstance(entry.value, ModelVersion) and entry.value.version > self._version:
                        self._version = entry.value.version
                        self._new_version.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watching the model version failed; retrying")
                await asyncio.sleep(1.0)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            self._emit_stats()

    def _emit_stats(self) -> None:
        if self.telemetry is None:
            return
        s = self.stats
        self.telemetry.event(
            "data.stats",
            received=s.received,
            stored=s.stored,
            duplicates=s.duplicates,
            ingest_errors=s.ingest_errors,
            drops=s.drops,
            groups_emitted=s.groups_emitted,
            groups_dropped=s.groups_dropped,
            batches=s.batches,
            samples=s.samples,
            work_items=s.work_items,
            outstanding=s.outstanding,
            open_groups=self.assembler.open_groups,
            pool_size=s.pool_size,
            pool_served=s.pool_served,
            policy_version=s.policy_version,
            task_success=s.task_success,
            rounds=s.rounds,
            round_lost=s.round_lost,
            sync_timeouts=s.sync_timeouts,
        )

    async def _db(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run blocking database or store work on the one worker thread (keeps the loop free)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
