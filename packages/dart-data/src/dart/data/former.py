"""Groups into training batches, onto the batch stream, with every group's fate in the index.

A trajectory offered by the ingestor joins its GRPO group (:class:`dart.data.groups.GroupAssembler`:
staleness and variance filters, the experience-pool fill); a group that completes or times out goes
to the :class:`dart.data.batches.BatchAssembler`; a full batch is published (retried until the
stream took it: its id is derived from its groups, so a retry is stored once) and its groups are
recorded ``emitted``. A group the filters drop is recorded ``dropped`` with the reason.

Group lifecycle here: ``open`` -> ``ready`` (complete, timed out, or closed by the coupled emitter)
-> ``emitted`` in one published batch, or ``dropped``; never both, never twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from dart.data.batches import BatchAssembler
from dart.data.config import GroupingConfig
from dart.data.groups import GroupAssembler, ReadyGroup
from dart.data.state import DataState
from dart.protocol.messages import TrainingBatch, Trajectory
from dart.runtime.bus import Bus

log = logging.getLogger("dart.data")


class BatchFormer:
    """Forms groups and batches and publishes the batches.

    Example::

        former = BatchFormer(state, bus, flush_when_full=True)
        await former.offer(trajectory)         # from the ingestor
        task = asyncio.create_task(former.poll_loop())   # timeouts and staleness
    """

    def __init__(self, state: DataState, bus: Bus, *, flush_when_full: bool) -> None:
        """Create the former.

        Args:
            state: The data manager's shared state.
            bus: A connected bus (batches go to its ``batch`` stream).
            flush_when_full: Publish a batch as soon as it is full (decoupled); False keeps every
                group until :meth:`flush` (coupled: one batch per round).
        """
        self._state = state
        self._bus = bus
        self._flush_when_full = flush_when_full
        g: GroupingConfig = state.config.grouping
        self.groups = GroupAssembler(
            g,
            state.clock,
            fill=self._fill_from_pool,
            on_drop=self._group_dropped,
        )
        self.batches = BatchAssembler(state.config.batching, state.config.curation, max_staleness=g.max_staleness)
        self.groups_dropped: Counter[str] = Counter()
        """Groups dropped, by reason."""
        self._pending_drops: list[tuple[str, str, str]] = []
        # Held while ready groups are turned into batches and recorded: stop waits on it so that the
        # index matches the stream.
        self.lock = asyncio.Lock()

    async def offer(self, traj: Trajectory, *, branches: int = 0) -> None:
        """A stored trajectory joins its group (the assembler ignores a member it already has); ``branches``:
        how many of its branches were just emitted, for the group to wait for."""
        await self._handle(self.groups.add(traj, self._state.version, branches=branches))

    async def poll_loop(self) -> None:
        """Close groups that timed out or went stale, every ``grouping.poll_interval_s``."""
        while True:
            await asyncio.sleep(self._state.config.grouping.poll_interval_s)
            try:
                await self._handle(self.groups.poll(self._state.version))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("group polling failed; retrying")

    async def close_groups(self, group_ids: list[str]) -> None:
        """Close these groups now with what they have (the coupled round's end)."""
        await self._handle([g for gid in group_ids for g in self.groups.close(gid)])

    async def flush(self) -> tuple[int, int]:
        """Publish every group kept so far as one batch; returns (samples, groups), (0, 0) if none."""
        async with self.lock:
            formed = self.batches.flush()
            if formed is None:
                return 0, 0
            await self._publish(formed.batch, formed.groups)
        return len(formed.batch.samples), len(formed.groups)

    async def _handle(self, ready: list[ReadyGroup]) -> None:
        db, index = self._state.db, self._state.index
        async with self.lock:
            for gid, task_id, reason in self._pending_drops:
                await db(index.record_group, gid, task_id, 0, "dropped", reason=reason)
            self._pending_drops.clear()
            for group in ready:
                accepted, formed = self.batches.add(group, flush_when_full=self._flush_when_full)
                if not accepted:
                    self.groups_dropped["no_samples"] += 1
                    task_id = group.trajectories[0].task.task_id
                    members = len(group.trajectories)
                    await db(index.record_group, group.group_id, task_id, members, "dropped", reason="no_samples")
                if formed is not None:
                    await self._publish(formed.batch, formed.groups)

    async def _publish(self, batch: TrainingBatch, groups: list[ReadyGroup]) -> None:
        state = self._state
        subject = self._bus.subjects.stream_subject("batch")
        while True:
            try:
                ack = await self._bus.js_publish(subject, batch, msg_id=batch.batch_id)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The batch id is derived from its groups, so a retry after a lost ack is stored once
                # (and the server answers a duplicate with the first copy's sequence).
                log.warning("publishing batch %s failed, retrying: %s", batch.batch_id, exc)
                await asyncio.sleep(1.0)
        state.counters["batches"] += 1
        state.counters["samples"] += len(batch.samples)
        state.counters["groups_emitted"] += len(groups)
        if state.telemetry is not None:
            state.telemetry.event(
                "data.batch",
                batch_id=batch.batch_id,
                samples=len(batch.samples),
                groups=len(groups),
                group_ids=[g.group_id for g in groups],
                min_policy_version=batch.min_policy_version,
                max_policy_version=batch.max_policy_version,
                staleness=state.version - batch.min_policy_version,
            )
        members = [(g.group_id, g.trajectories[0].task.task_id, len(g.trajectories)) for g in groups]
        carried = [t.trajectory_id for g in groups for t in g.trajectories]
        await state.db(state.index.record_batch, batch.batch_id, ack.seq, members, carried)

    def _fill_from_pool(self, group_id: str, members: list[Trajectory]) -> Trajectory | None:
        return self._state.pool.fill(members, self._state.task_stats.get(members[0].task.task_id))

    def _group_dropped(self, group_id: str, task_id: str, reason: str) -> None:
        # Called synchronously from the assembler: the write is queued for the next _handle.
        self.groups_dropped[reason] += 1
        self._pending_drops.append((group_id, task_id, reason))
