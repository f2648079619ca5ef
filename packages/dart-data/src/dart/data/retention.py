"""Bounded storage for what reaches the data manager: trajectory blobs and the env's screenshots.

A run writes three kinds of objects per episode: the trajectory's JSON and the images stored under its
directory (``<blob_prefix>/<trajectory>/``, written at ingestion), and images the env service (screenshots)
and the rollout service (resized prompt images) stored by reference (``<screenshot_prefix>/<sha256>.png``,
shared by every trajectory that saw the same screen). Published weights and checkpoints are the
trainer's (``train.retention``).

**Trajectories.** A pass deletes a trajectory's directory when nothing can need it for training:

- its group is closed: ``dropped`` and never replayed, or every batch that carried it was acked by
  the trainer. The data manager records on each trajectory the ``batch`` stream sequence of the newest
  batch holding its samples (``last_batch_seq``: its own group's, or a later one that replayed it from
  the experience pool) and compares it with the trainer's durable consumer's *ack floor*: every batch
  at or below it was trained, dropped as stale or refused, so its samples' images are read no more (a
  batch a trainer failed on its last allowed delivery is terminated, which moves the floor past it; one
  left at its delivery limit by a trainer that crashed holds the floor back, so a pass also counts every
  delivered batch as done whenever the trainer has none in flight);
- it is not in the experience pool;
- its newest step is older than the newest ``keep_versions`` versions and not of a version divisible by
  ``keep_every`` (kept to look back at).

The index row stays, with ``pruned_at`` set: statistics and reports keep every trajectory.

**Shared screenshots.** Ingestion records the keys of shared images each trajectory refers to
(``image_refs``); pruning a trajectory drops its references. A pass lists the screenshot prefix and deletes
an object that no stored trajectory refers to and that was last written more than ``image_grace_s`` ago. Why
that cannot pull an image from under a trajectory still on its way: a service rewrites an image it hands out
if its last write is older than its refresh period (the env's ``screenshot_refresh_s``, the rollout's
``prompt_images.refresh_s``; :class:`dart.runtime.store.images.ImageOffload`), so a reference handed out at
time t names an object written at or after ``t - refresh``; with ``image_grace_s`` above that plus the time
from observation to ingestion, the object outlives the trajectory's arrival, and from then on its reference
protects it. Episodes longer than the grace period are covered too: where this data manager emits the run's
work, the grace counts from the emission of the oldest group still awaited (written off after
``emission.work_timeout_s``), not from now, so a screenshot from the first step of a long desktop episode
stays until the episode's trajectory arrives. The reference check, a fresh ``stat`` and the delete run on
the data manager's database thread, the same thread that checks a new trajectory's images and records its
references, so the two never interleave. Screenshots no trajectory ever referred to (held-out evaluation
episodes, rejected trajectories) go the same way. Passes skip the screenshots while trajectories wait on the
stream (their references are not recorded yet), and never delete one last written before the index recorded
references (schema version 4).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice

from dart.data.config import RetentionConfig
from dart.data.state import DataState
from dart.protocol.errors import ArtifactNotFoundError
from dart.runtime.bus import Bus
from dart.runtime.store import ArtifactInfo
from dart.runtime.topology import durable_name

log = logging.getLogger("dart.data")

_CHUNK = 256
"""Screenshots checked against the index and deleted per call on the database thread."""


@dataclass(frozen=True)
class RetentionPass:
    """What one pass deleted.

    Attributes:
        trajectories: Trajectories whose objects were deleted.
        objects: Objects deleted (trajectory JSON and images, and shared screenshots).
        bytes: Their size.
        screenshots: Shared screenshots among them.
    """

    trajectories: int = 0
    objects: int = 0
    bytes: int = 0
    screenshots: int = 0


class Retention:
    """Deletes the data manager's objects that nothing needs any more (see the module doc).

    Args:
        config: What is kept.
        state: The data manager's state (index, blobs, version, counters, database thread).
        bus: The bus (the trainer's and the ingestor's consumer positions).
        in_flight_s: How long ago the oldest episode still awaited was requested, seconds (0 when none;
            None: nothing here emits work). Screenshots written since then, less the grace, are kept.
    """

    def __init__(
        self,
        config: RetentionConfig,
        state: DataState,
        bus: Bus,
        in_flight_s: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self._state = state
        self._bus = bus
        self._in_flight_s = in_flight_s

    async def run(self) -> None:
        """A pass every ``interval_s`` until cancelled; a failing pass is logged and retried."""
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("a retention pass failed; the next one retries")

    async def run_pass(self) -> RetentionPass:
        """Delete what is not kept now; counts go to the state's counters too."""
        state, config = self._state, self.config
        trainer = await self._bus.consumer_state("batch", durable_name(self._bus, "batch"))
        # With nothing in flight every delivered batch is done, even one a crashed trainer left at its
        # delivery limit (which holds the ack floor back for good).
        floor = max(trainer.ack_floor, trainer.delivered if trainer.num_ack_pending == 0 else 0)
        below = state.version - config.keep_versions + 1
        ids = await state.db(state.index.prunable, floor, below, config.keep_every, config.max_per_pass)
        # Objects first, rows after: a pass cut short in between finds the directories empty next time.
        objects, size = await asyncio.to_thread(self._delete_trajectories, ids)
        if ids:
            await state.db(state.index.mark_pruned, ids)
        ingest = await self._bus.consumer_state("traj", durable_name(self._bus, "traj"))
        shots = shot_bytes = 0
        if not (ingest.num_pending or ingest.num_ack_pending):  # else references are on their way
            shots, shot_bytes = await self._sweep_screenshots()
        done = RetentionPass(len(ids), objects + shots, size + shot_bytes, shots)
        counters = state.counters
        counters["pruned_trajectories"] += done.trajectories
        counters["pruned_objects"] += done.objects
        counters["pruned_bytes"] += done.bytes
        counters["pruned_screenshots"] += done.screenshots
        if done.objects and state.telemetry is not None:
            state.telemetry.event(
                "data.retention",
                trajectories=done.trajectories,
                objects=done.objects,
                bytes=done.bytes,
                screenshots=done.screenshots,
                ack_floor=floor,
                version=state.version,
            )
        return done

    def _delete_trajectories(self, trajectory_ids: list[str]) -> tuple[int, int]:
        """Delete every object under each trajectory's directory (a worker thread); returns (objects, bytes)."""
        blobs = self._state.blobs
        n = size = 0
        for trajectory_id in trajectory_ids:
            for info in list(blobs.store.list(blobs.directory(trajectory_id) + "/")):
                blobs.store.delete(info.key)
                n, size = n + 1, size + info.size
        return n, size

    async def _sweep_screenshots(self) -> tuple[int, int]:
        state = self._state
        since = await state.db(state.index.references_since)
        cutoff = self._cutoff()
        old = await asyncio.to_thread(self._old_screenshots, cutoff, since)
        n = size = 0
        for chunk in _chunks(old, _CHUNK):
            deleted = await state.db(self._delete_unreferenced, chunk, cutoff)
            n, size = n + len(deleted), size + sum(i.size for i in deleted)
        return n, size

    def _cutoff(self) -> float:
        """Screenshots last written before this wall-clock time may go: the grace period before now, or
        before the request of the oldest episode still awaited."""
        in_flight = self._in_flight_s() if self._in_flight_s is not None else 0.0
        return time.time() - in_flight - self.config.image_grace_s

    def _old_screenshots(self, cutoff: float, since: float) -> list[ArtifactInfo]:
        """Screenshots last written before ``cutoff`` and after ``since`` (listing thread)."""
        prefix = self.config.screenshot_prefix.strip("/") + "/"
        return [
            info
            for info in self._state.blobs.store.list(prefix)
            if info.modified is not None and since <= info.modified.timestamp() < cutoff
        ]

    def _delete_unreferenced(self, candidates: list[ArtifactInfo], cutoff: float) -> list[ArtifactInfo]:
        """Delete the candidates no trajectory refers to and nobody rewrote since the listing (database thread)."""
        state = self._state
        store = state.blobs.store
        referenced = state.index.referenced(info.key for info in candidates)
        deleted = []
        for info in candidates:
            if info.key in referenced:
                continue
            try:
                fresh = store.stat(info.key)
            except ArtifactNotFoundError:
                continue
            if fresh.modified is None or fresh.modified.timestamp() >= cutoff:
                continue  # the env service rewrote it: a new reference may be on its way
            store.delete(info.key)
            deleted.append(fresh)
        return deleted


def _chunks(items: list[ArtifactInfo], n: int) -> Iterator[list[ArtifactInfo]]:
    it = iter(items)
    while chunk := list(islice(it, n)):
        yield chunk
