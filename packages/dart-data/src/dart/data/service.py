"""The data manager service: the composition of its parts, bound to the bus.

One job per part: :class:`dart.data.ingest.Ingestor` (the ``traj`` stream into the store, the
index, statistics and groups), :class:`dart.data.former.BatchFormer` (groups into batches onto the
``batch`` stream), an emitter (:class:`dart.data.emit.DecoupledEmitter`, or
:class:`dart.data.coupled.CoupledEmitter` for the synchronous baseline),
:class:`dart.data.retention.Retention` (deletes the blobs and screenshots nothing needs any more) and
their shared :class:`dart.data.state.DataState`. The service watches the model version, reports ``data.stats``
and owns the lifecycle.

Service lifecycle: ``created`` -> :meth:`DataService.start` (migrate the database, reload task
statistics and the pool, open the bus topology, start the loops) -> ``running`` ->
:meth:`DataService.stop` (cancel the loops, release the consumer and the database) -> ``stopped``.
Groups still open or waiting in an unfinished batch at stop are not trained on; their
trajectories stay stored and indexed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dart.data.branching import Brancher
from dart.data.config import DataConfig
from dart.data.coupled import CoupledEmitter
from dart.data.curation import max_steps_for
from dart.data.emit import DecoupledEmitter, Emitter, publish_work
from dart.data.former import BatchFormer
from dart.data.ingest import Ingestor
from dart.data.retention import Retention
from dart.data.state import DataState
from dart.data.stats import TaskStats
from dart.data.work import WorkPlanner, min_policy_version
from dart.protocol.errors import ConfigError
from dart.protocol.messages import ModelVersion, TaskSpec, Trajectory
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.runtime.bus import Bus, KeyValueStore, PullConsumer
from dart.runtime.capabilities import request_capabilities
from dart.runtime.store import ArtifactStore
from dart.runtime.telemetry import Telemetry
from dart.runtime.topology import durable_name, open_topology
from dart.runtime.waiting import cancel_and_wait

log = logging.getLogger("dart.data")

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
        rejected: Deliveries refused at ingestion (meaningless or undecodable), by reason; recorded in
            the index's ``rejected_trajectories`` (see :mod:`dart.data.admission`).
        drops: Trajectories (or groups, for ``no_samples``) discarded, by reason.
        groups_emitted: Groups that went into a training batch.
        groups_dropped: Groups dropped, by reason.
        batches: Training batches published.
        samples: Step samples published.
        work_groups: Work groups emitted.
        work_items: Work items emitted (branches included).
        env_steps: Env steps the stored trajectories took: their steps, plus the actions forks replayed.
        branches: Branch work items emitted (:mod:`dart.data.branching`).
        branches_refused: Branch work answered as normal rollouts because the env refused the fork, by reason.
        forks: Whether the env pool forks episodes; None until it said (or when branching is off).
        outstanding: Trajectories requested and not yet received.
        pool_size: Trajectories in the experience pool.
        pool_served: Times the pool filled a group.
        policy_version: Newest model version seen.
        task_success: Recent success rate per task.
        success_rate: Recent success rate over every task: the successes in all tasks' recent windows
            over their outcomes (0 before the first trainable trajectory).
        rounds: Coupled rounds closed.
        round_lost: Coupled-round trajectories still missing when their round timed out.
        sync_timeouts: Coupled rounds whose new model version did not come in time.
        emission_throttles: Times decoupled emission paused because more than
            ``emission.decoupled.max_queued_batches`` batches waited for the trainer.
        pruned_trajectories: Trajectories whose objects retention deleted (this service's life).
        pruned_objects: Objects retention deleted (trajectory JSON and images, shared screenshots).
        pruned_bytes: Their size.
        pruned_screenshots: Shared screenshots among them.
        tasks: Tasks work is emitted for (the suite's, less those the env pool does not run).
        tasks_excluded: The suite's tasks left out because the env pool does not run them.
        tasks_excluded_by: Requirement the env pool lacks -> tasks it kept out (a task lacking several
            counts under each), most first (see :mod:`dart.runtime.capabilities`).
    """

    received: int = 0
    stored: int = 0
    duplicates: int = 0
    ingest_errors: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)
    groups_emitted: int = 0
    groups_dropped: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    samples: int = 0
    work_groups: int = 0
    work_items: int = 0
    env_steps: int = 0
    branches: int = 0
    branches_refused: dict[str, int] = field(default_factory=dict)
    forks: bool | None = None
    outstanding: int = 0
    pool_size: int = 0
    pool_served: int = 0
    policy_version: int = 0
    task_success: dict[str, float] = field(default_factory=dict)
    success_rate: float = 0.0
    rounds: int = 0
    round_lost: int = 0
    sync_timeouts: int = 0
    emission_throttles: int = 0
    pruned_trajectories: int = 0
    pruned_objects: int = 0
    pruned_bytes: int = 0
    pruned_screenshots: int = 0
    tasks: int = 0
    tasks_excluded: int = 0
    tasks_excluded_by: dict[str, int] = field(default_factory=dict)


def _pooled_success_rate(stats: Iterable[TaskStats]) -> float:
    outcomes = [outcome for task in stats for outcome in task.recent]
    return sum(outcomes) / len(outcomes) if outcomes else 0.0


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
        tasks_excluded_by: Mapping[str, int] | None = None,
        tasks_excluded: int = 0,
    ) -> None:
        """Create the service (nothing runs until :meth:`start`).

        Args:
            config: Service configuration.
            bus: A connected bus.
            store: Artifact store for trajectory blobs.
            tasks: Tasks to emit work for, in seeded shuffled passes (the orchestrator loads the suite).
            telemetry: Where ``data.*`` events go; None writes none.
            clock: Monotonic seconds for group and work timeouts (injectable for tests).
            tasks_excluded: How many of the suite's tasks were left out because the env pool does not run
                them (:func:`dart.data.tasks.runnable_on_pool`); reported in the stats.
            tasks_excluded_by: Those tasks by the requirement the pool lacks.
        """
        self.config = config
        self.bus = bus
        self.state = DataState(config, store, telemetry, clock)
        self._task_count = len(tasks)
        self._tasks_excluded = tasks_excluded
        self._tasks_excluded_by = dict(tasks_excluded_by or {})
        emission = config.emission
        coupled = emission.mode == "coupled"
        self.former = BatchFormer(self.state, bus, flush_when_full=not coupled)
        # No tasks is fine for an ingest-only data manager (emission off); start() checks.
        self.planner = WorkPlanner(tasks, config.curation, emission, self.state.task_stats) if tasks else None
        self.emitter: Emitter | None = None
        if self.planner is not None:
            if coupled:
                self.emitter = CoupledEmitter(emission, self.state, bus, self.planner, self.former)
            else:
                self.emitter = DecoupledEmitter(emission, self.state, bus, self.planner)
        arrived = self.emitter.arrived if self.emitter is not None and emission.enabled else None
        self.brancher = Brancher(config.curation.branching)
        branching = config.curation.branching.enabled and emission.enabled
        # Where this data manager emits the run's work, a trajectory must answer work it emitted.
        self.ingestor = Ingestor(
            config.ingest,
            self.state,
            self.former,
            arrived=arrived,
            tasks={t.task_id: t for t in tasks},
            require_work=emission.enabled,
            branch=self._branch if branching else None,
        )
        outstanding = self.emitter.outstanding if self.emitter is not None and emission.enabled else None
        self.retention = Retention(
            config.retention,
            self.state,
            bus,
            in_flight_s=None if outstanding is None else lambda: outstanding.oldest_age(emission.work_timeout_s),
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._consumer: PullConsumer[Trajectory] | None = None
        self._kv: KeyValueStore | None = None
        self._stopped = False

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Migrate the database, reload state, bind to the bus and start the loops.

        Raises:
            ConfigError: Emission is on without tasks.
            SchemaVersionError: The database is newer than this code.
        """
        if self.config.emission.enabled and self.emitter is None:
            raise ConfigError("DataService", "emission.enabled", "work emission needs tasks: pass a task list")
        await self.state.load()
        self._kv = await open_topology(self.bus)
        latest = await self._kv.get(LATEST_MODEL_KEY, ModelVersion)
        if latest is not None:
            self.state.observe_version(latest.version)
        self._consumer = await self.bus.pull_consumer("traj", durable_name(self.bus, "traj"), Trajectory)
        self._consumer.on_undecodable = functools.partial(self.ingestor.undecodable, self._consumer.stream)
        loops: dict[str, Coroutine[Any, Any, None]] = {
            "ingest": self.ingestor.run(self._consumer),
            "groups": self.former.poll_loop(),
            "model": self._watch_model(),
            "stats": self._stats_loop(),
        }
        if self.config.emission.enabled and self.emitter is not None:
            loops["emit"] = self.emitter.run()
            if self.config.curation.branching.enabled:
                loops["forks"] = self._ask_forks()
        if self.config.retention.enabled:
            loops["retention"] = self.retention.run()
        self._tasks = [asyncio.create_task(coro, name=f"dart-data-{name}") for name, coro in loops.items()]

    async def stop(self) -> None:
        """Stop the loops and release the consumer and the database. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        tasks, self._tasks = self._tasks, []
        # Let a batch being published finish recording its groups, so the index matches the stream.
        try:
            await asyncio.wait_for(self.former.lock.acquire(), _STOP_GRACE_S)
            locked = True
        except TimeoutError:
            locked = False
        try:
            await cancel_and_wait(tasks)
        finally:
            if locked:
                self.former.lock.release()
        if self._consumer is not None:
            await self._consumer.close()
            self._consumer = None
        if tasks:
            self._emit_stats()
        await self.state.close()

    async def __aenter__(self) -> DataService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def policy_version(self) -> int:
        """Newest model version seen in the state bucket."""
        return self.state.version

    @property
    def stats(self) -> DataStats:
        """A snapshot of the service's counters."""
        state, c = self.state, self.state.counters
        return DataStats(
            received=c["received"],
            stored=c["stored"],
            duplicates=c["duplicates"],
            ingest_errors=c["ingest_errors"],
            rejected=dict(state.rejected),
            drops=dict(self.former.groups.drops),
            groups_emitted=c["groups_emitted"],
            groups_dropped=dict(self.former.groups_dropped),
            batches=c["batches"],
            samples=c["samples"],
            work_groups=c["work_groups"],
            work_items=c["work_items"],
            env_steps=c["env_steps"],
            branches=c["branches"],
            branches_refused=dict(state.branches_refused),
            forks=self.brancher.forks,
            outstanding=self.emitter.outstanding.count if self.emitter is not None else 0,
            pool_size=state.pool.size(),
            pool_served=state.pool.served,
            policy_version=state.version,
            task_success={tid: s.success_rate for tid, s in state.task_stats.items()},
            success_rate=_pooled_success_rate(state.task_stats.values()),
            rounds=c["rounds"],
            round_lost=c["round_lost"],
            sync_timeouts=c["sync_timeouts"],
            emission_throttles=c["emission_throttles"],
            pruned_trajectories=c["pruned_trajectories"],
            pruned_objects=c["pruned_objects"],
            pruned_bytes=c["pruned_bytes"],
            pruned_screenshots=c["pruned_screenshots"],
            tasks=self._task_count,
            tasks_excluded=self._tasks_excluded,
            tasks_excluded_by=dict(self._tasks_excluded_by),
        )

    # --- branching ------------------------------------------------------------------------------
    async def _ask_forks(self) -> None:
        """Ask the env pool whether it forks (no branch is planned before it answers)."""
        pool = self.config.env_pool
        while True:
            try:
                capabilities = await request_capabilities(self.bus, pool, timeout_s=self.config.capabilities_timeout_s)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # unreachable so far, or a refusal: ask again, branching waits
                log.warning("branching waits for env pool %s to say whether it forks: %s", pool, exc)
                await asyncio.sleep(1.0)
        self.brancher.forks = "fork" in capabilities.features
        if not self.brancher.forks:
            log.warning(
                "env pool %s (%s) does not fork episodes: curation.branching asks for no branches",
                pool,
                capabilities.backend,
            )

    async def _branch(self, traj: Trajectory) -> int:
        """Emit the branches of a newly stored rollout; returns how many (its group waits for them)."""
        state, grouping = self.state, self.config.grouping
        if self.former.groups.closed(traj.group_id) or self.former.groups.is_stale(traj, state.version):
            return 0
        if state.env_budget_spent():
            return 0
        budget = max_steps_for(traj.task, state.task_stats.get(traj.task.task_id), self.config.curation)
        items = self.brancher.plan(
            traj,
            max_steps=budget,
            min_policy_version=min_policy_version(state.version, grouping.max_staleness),
            sampling=self.config.emission.sampling,
        )
        if not items:
            return 0
        for item in items:
            if item.branch is not None:
                state.replays[item.work_id] = len(item.branch.actions)
        if self.emitter is not None:
            self.emitter.outstanding.add(traj.group_id, len(items))
        await publish_work(state, self.bus, items, new_group=False)
        if state.telemetry is not None:
            state.telemetry.event(
                "data.branches",
                group_id=traj.group_id,
                parent_trajectory_id=traj.trajectory_id,
                steps=sorted({item.branch.step_index for item in items if item.branch is not None}),
                work_items=len(items),
            )
        return len(items)

    # --- model version and telemetry ------------------------------------------------------------
    async def _watch_model(self) -> None:
        assert self._kv is not None
        while True:
            try:
                async for entry in self._kv.watch(ModelVersion, LATEST_MODEL_KEY):
                    if isinstance(entry.value, ModelVersion):
                        self.state.observe_version(entry.value.version)
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
        telemetry = self.state.telemetry
        if telemetry is None:
            return
        s = self.stats
        telemetry.event(
            "data.stats",
            received=s.received,
            stored=s.stored,
            duplicates=s.duplicates,
            ingest_errors=s.ingest_errors,
            rejected=s.rejected,
            drops=s.drops,
            groups_emitted=s.groups_emitted,
            groups_dropped=s.groups_dropped,
            batches=s.batches,
            samples=s.samples,
            work_items=s.work_items,
            env_steps=s.env_steps,
            branches=s.branches,
            branches_refused=s.branches_refused,
            outstanding=s.outstanding,
            open_groups=self.former.groups.open_groups,
            pool_size=s.pool_size,
            pool_served=s.pool_served,
            policy_version=s.policy_version,
            task_success=s.task_success,
            success_rate=s.success_rate,
            rounds=s.rounds,
            round_lost=s.round_lost,
            sync_timeouts=s.sync_timeouts,
            emission_throttles=s.emission_throttles,
            pruned_trajectories=s.pruned_trajectories,
            pruned_objects=s.pruned_objects,
            pruned_bytes=s.pruned_bytes,
            pruned_screenshots=s.pruned_screenshots,
            tasks=s.tasks,
            tasks_excluded=s.tasks_excluded,
            tasks_excluded_by=s.tasks_excluded_by,
        )
