"""The trainer service: consumes training batches from the bus, trains, publishes weight versions.

Usage::

    service = await TrainerService.start(config, bus, store, telemetry=telemetry)
    await service.run()          # until stop() is called (from another task or a signal handler)
    await service.stop()

The blocking model work runs in a worker thread, so the event loop keeps heartbeating the batch being
trained (``in_progress``) and answering the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from dart.protocol.errors import ConfigError, DartError
from dart.protocol.messages import ModelVersion, TrainingBatch, TrainingSample
from dart.protocol.topology import LATEST_MODEL_KEY, STREAMS
from dart.protocol.weights import AdapterSpec
from dart.runtime.bus import Bus, Delivery, KeyValueStore, PullConsumer
from dart.runtime.store import ArtifactStore, StoreConfig
from dart.runtime.telemetry import BusyTracker, GpuSampler, Telemetry
from dart.runtime.topology import durable_name, open_topology
from dart.train.batching import StoreImageSource
from dart.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dart.train.config import TrainerConfig
from dart.train.distributed import Commander, train_batch
from dart.train.errors import BatchSkippedError, RankFailureError, SampleError
from dart.train.interface import TrainerBackend, load_backend
from dart.train.publish import WeightPublisher
from dart.train.retention import prune_checkpoints, prune_weights
from dart.train.staleness import policy_lag, split_stale
from dart.train.update import SampleReader, TrainStepMetrics

log = logging.getLogger("dart.train")


@dataclass
class TrainerStats:
    """Counters since start.

    Attributes:
        batches: Batches trained and acked.
        rejected: Batches terminated because a sample cannot be rebuilt (bad tokens, a screenshot missing
            or corrupt): redelivery cannot fix them.
        failed: Batches handed back for redelivery: a screenshot store unreadable through its retries, or an
            unexpected error.
        published: Weight versions published.
        checkpoints: Checkpoints written.
        skipped: Batches skipped on every rank before the update, by reason (see
            :class:`~dart.train.errors.BatchSkippedError`); each is also in ``rejected`` or ``failed``.
        stale_samples: Samples dropped because they lagged more than their batch's ``max_staleness``
            behind the trainer's version (experience-pool replays are never dropped).
        stale_batches: Batches acked untrained because every sample was stale.
        samples_dropped: Unusable samples (tokens that disagree with the images, a screenshot missing or
            corrupt) dropped from batches that trained on the rest, by reason.
        batches_retried: Mini-batches run again at half the micro-batch size after a rank ran out of memory.
        batches_failed: Batches whose update failed on a rank (every rank stopped with it), by reason
            (``out_of_memory``, ``error``; see :class:`~dart.train.errors.RankFailureError`); each is also in
            ``rejected`` or ``failed``.
    """

    batches: int = 0
    rejected: int = 0
    failed: int = 0
    published: int = 0
    checkpoints: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    stale_samples: int = 0
    stale_batches: int = 0
    samples_dropped: dict[str, int] = field(default_factory=dict)
    batches_retried: int = 0
    batches_failed: dict[str, int] = field(default_factory=dict)


async def _catch_up(
    config: TrainerConfig,
    backend: TrainerBackend,
    publisher: WeightPublisher,
    latest: ModelVersion,
    checkpoint: Path | None,
    telemetry: Telemetry | None,
) -> None:
    """Bring a trainer whose weights are older than the newest announced version up to it, or refuse to start
    (``train.resume``): it must never publish older weights under a newer number.

    Raises:
        ConfigError: ``train.resume`` is ``refuse``, or the backend cannot load published weights.
        CheckpointError: The published version cannot be read back.
    """
    held = f"the newest checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint"
    if config.resume == "refuse":
        raise ConfigError(
            "TrainerConfig",
            "train.resume",
            f"is refuse and version {latest.version} was published, but this trainer has {held} "
            f"(train.checkpoint_dir: {config.checkpoint_dir}): set train.resume: latest_version to continue from "
            "the published weights, or point train.checkpoint_dir at the run's checkpoints",
        )
    weights = await asyncio.to_thread(publisher.read, latest)
    Commander(backend.world_size).send("load_published")
    await asyncio.to_thread(backend.load_published, weights)
    log.warning(
        "%s, version %d was published: continuing from its weights, with fresh optimizer state", held, latest.version
    )
    if telemetry is not None:
        telemetry.event("trainer.resumed", source="published", version=latest.version, checkpoint=str(checkpoint))


class TrainerService:
    """Pulls :class:`TrainingBatch` messages one at a time, trains on each, publishes every K steps.

    Lifecycle: ``starting`` in :meth:`start` (topology opened, model loaded, resumed from the newest
    checkpoint in ``config.checkpoint_dir`` if any, or from the newest published version when that is newer
    (``train.resume``), numbering versions on from the newest of the checkpoint's and the KV's) ->
    ``running`` in :meth:`run`: fetch one batch -> train (busy ``train_step``, heartbeating the delivery)
    -> ack -> every ``publish_every`` steps publish ``version + 1`` -> every ``checkpoint_every`` steps
    checkpoint -> ``stopped`` once :meth:`stop` is called: the batch in training finishes and is acked, a
    checkpoint is written when ``checkpoint_dir`` is set and steps were trained since the last one, then
    the consumer is closed. Before training, samples more than
    the batch's ``max_staleness`` versions behind ``version`` are dropped (counted; a batch left empty
    is acked untrained).

    A sample whose inputs cannot be built for a fault of its own (tokens that disagree with the images, a
    screenshot missing after retries or failing its digest) is dropped alone, on every rank, and counted in
    ``stats.samples_dropped`` by reason; the batch trains on the rest while at least
    ``min(batch.min_samples, len(batch))`` remain, and is otherwise terminated (redelivery would fail the
    same way). A batch whose inputs cannot be built for any other reason (the store unreadable through the
    retries, an unexpected error) is skipped on every rank (nothing updated), counted in ``stats.skipped``
    by reason, and nak'ed: the samples are fine, and terminating would lose them.

    Args:
        config: Trainer configuration.
        bus: Connected bus.
        backend: The loaded model and optimizer.
        publisher: Where weight versions go.
        consumer: Bound consumer of the ``batch`` stream.
        telemetry: Where busy time and step events go; None records nothing.
        instance_id: This trainer's id in busy records.
    """

    def __init__(
        self,
        config: TrainerConfig,
        bus: Bus,
        backend: TrainerBackend,
        publisher: WeightPublisher,
        consumer: PullConsumer[TrainingBatch],
        *,
        version: int = 0,
        telemetry: Telemetry | None = None,
        instance_id: str = "trainer-0",
        store_config: StoreConfig | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.backend = backend
        self.reader = SampleReader(config, StoreImageSource(store_config, retry=config.image_reads))
        self.commander = Commander(backend.world_size)
        """Drives the other ranks of a multi-process backend (see :mod:`dart.train.distributed`)."""
        self.publisher = publisher
        self.consumer = consumer
        self.version = version
        """Latest published policy version (0 = the initial checkpoint)."""
        self.stats = TrainerStats()
        self._checkpointed_step = backend.step  # what a clean stop need not write again
        self.telemetry = telemetry
        self.last_metrics: TrainStepMetrics | None = None
        self._busy: BusyTracker | None = telemetry.busy_tracker("trainer", instance_id) if telemetry else None
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stopped.set()

    @classmethod
    async def start(
        cls,
        config: TrainerConfig,
        bus: Bus,
        store: ArtifactStore,
        *,
        store_config: StoreConfig | None = None,
        telemetry: Telemetry | None = None,
        instance_id: str = "trainer-0",
    ) -> TrainerService:
        """Open the topology, load the model (off the loop), resume, and bind the batch consumer.

        Args:
            config: Trainer configuration.
            bus: Connected bus.
            store: Artifact store weights are published to.
            store_config: Store config used to read ``s3://`` screenshot references.
            telemetry: Service telemetry.
            instance_id: This trainer's id.

        Raises:
            ConfigError: ``checkpoint_every`` is set without ``checkpoint_dir``.
        """
        if config.checkpoint_every is not None and config.checkpoint_dir is None:
            raise ConfigError("TrainerConfig", "checkpoint_dir", "checkpoint_every needs a directory to write to")
        state: KeyValueStore = await open_topology(bus)
        images = StoreImageSource(store_config, retry=config.image_reads)
        backend = await asyncio.to_thread(load_backend, config, image_source=images)
        version = 0
        resume = latest_checkpoint(config.checkpoint_dir) if config.checkpoint_dir else None
        if resume is not None:
            Commander(backend.world_size).send("load", str(resume))
            saved = await asyncio.to_thread(load_checkpoint, backend, resume)
            version = saved.version
            log.info("resumed from %s at step %d, version %d", resume, saved.step, saved.version)
        publisher = WeightPublisher(store, bus, state, prefix=config.weights_prefix, config=config.publish)
        latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
        if latest is not None and latest.version > version:
            # Versions were published after the newest checkpoint (or with none): its weights are older.
            await _catch_up(config, backend, publisher, latest, resume, telemetry)
        # A reused number would be deduplicated on the model stream and engines would never see the weights.
        version = max(version, latest.version if latest is not None else 0)
        consumer = await bus.pull_consumer("batch", durable_name(bus, "batch"), TrainingBatch)
        return cls(
            config,
            bus,
            backend,
            publisher,
            consumer,
            version=version,
            telemetry=telemetry,
            instance_id=instance_id,
            store_config=store_config,
        )

    async def run(self, *, max_batches: int | None = None, fetch_timeout_s: float = 1.0) -> None:
        """Train on batches until :meth:`stop` (or after ``max_batches`` batches); then close the consumer."""
        self._stopped.clear()
        done = 0
        gpu = GpuSampler(self.telemetry, source="train") if self.telemetry is not None else None
        if gpu is not None:  # gpu.sample events when a GPU is visible, one gpu.unavailable otherwise
            await gpu.start()
        try:
            while not self._stopping.is_set() and (max_batches is None or done < max_batches):
                try:
                    deliveries = await self.consumer.fetch(1, timeout=fetch_timeout_s)
                except DartError as exc:  # e.g. a cluster electing the stream's new leader: ask again
                    log.warning("fetching a batch failed: %s", exc)
                    await asyncio.sleep(fetch_timeout_s)
                    continue
                for delivery in deliveries:
                    await self._handle(delivery)
                    done += 1
            if self.config.checkpoint_dir is not None and self.backend.step > self._checkpointed_step:
                await self.checkpoint()  # a clean stop: a restart resumes from here, not from the last interval
        finally:
            self.commander.send("stop")
            if gpu is not None:
                await gpu.stop()
            await self.consumer.close()
            self._stopped.set()

    async def stop(self) -> None:
        """Stop after the batch in training (if any) is finished and acked. Idempotent."""
        self._stopping.set()
        await self._stopped.wait()

    async def _handle(self, delivery: Delivery[TrainingBatch]) -> None:
        batch = delivery.message
        with delivery.span():
            split = split_stale(self.version, batch.samples, batch.max_staleness)
            if split.dropped:
                self._stale(batch, len(split.dropped), len(split.kept))
            if not split.kept:
                # Redelivery would be as stale: the batch is consumed untrained.
                self.stats.stale_batches += 1
                await delivery.ack()
                return
            heartbeat = asyncio.create_task(self._heartbeat(delivery))
            try:
                if self._busy is not None:
                    async with self._busy.busy("train_step"):
                        metrics = await self._train_step(split.kept, batch.min_samples)
                else:
                    metrics = await self._train_step(split.kept, batch.min_samples)
            except BatchSkippedError as exc:
                await self._skip(delivery, exc)
                return
            except RankFailureError as exc:
                await self._failed(delivery, exc)
                return
            except SampleError as exc:
                # Every sample was refused by the update's admission check, on every rank alike (same
                # samples, same rule): redelivery would be refused the same way.
                log.error("terminating batch %s: %s", batch.batch_id, exc)
                self.stats.rejected += 1
                self._event("trainer.batch_refused", batch_id=batch.batch_id, error=str(exc))
                await delivery.term()
                return
            except Exception:
                log.exception("training on batch %s failed; handing it back", batch.batch_id)
                self.stats.failed += 1
                await self._hand_back(delivery)
                return
            finally:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
            await delivery.ack()
        self.stats.batches += 1
        self.last_metrics = metrics
        for retry in metrics.retried:
            self.stats.batches_retried += 1
            self._event(
                "trainer.batch_retried",
                batch_id=batch.batch_id,
                reason=retry.reason,
                rank=retry.rank,
                micro_batch_size=retry.to_size,
                failed_micro_batch_size=retry.from_size,
            )
        for reason, count in metrics.dropped_by_reason.items():
            self.stats.samples_dropped[reason] = self.stats.samples_dropped.get(reason, 0) + count
            self._event("trainer.samples_dropped", batch_id=batch.batch_id, reason=reason, samples=count)
        self._event(
            "trainer.step",
            batch_id=batch.batch_id,
            stale_dropped=len(split.dropped),
            **policy_lag(self.version, split.kept),
            **metrics.as_dict(),
        )
        # A batch may take several optimizer steps: act when its steps crossed a multiple of K.
        before = metrics.step - metrics.optimizer_steps
        if metrics.step // self.config.publish_every > before // self.config.publish_every:
            await self.publish()
        every = self.config.checkpoint_every
        if every and self.config.checkpoint_dir and metrics.step // every > before // every:
            await self.checkpoint()

    async def _skip(self, delivery: Delivery[TrainingBatch], exc: BatchSkippedError) -> None:
        """Count a batch every rank skipped; terminate it if its samples are at fault, else hand it back."""
        self.stats.skipped[exc.reason] = self.stats.skipped.get(exc.reason, 0) + 1
        await self._give_up(delivery, exc, "trainer.batch_skipped", "skipped")

    async def _failed(self, delivery: Delivery[TrainingBatch], exc: RankFailureError) -> None:
        """Count a batch whose update failed on a rank (every rank stopped); hand it back, or terminate it when
        not even one sample per micro-batch fits."""
        self.stats.batches_failed[exc.reason] = self.stats.batches_failed.get(exc.reason, 0) + 1
        what = f"failed on rank {exc.rank} ({exc.reason})"
        await self._give_up(delivery, exc, "trainer.batch_failed", what, micro_batch_size=exc.micro_batch_size)

    async def _give_up(
        self,
        delivery: Delivery[TrainingBatch],
        exc: BatchSkippedError | RankFailureError,
        event: str,
        what: str,
        **attributes: object,
    ) -> None:
        """Record a batch no rank trained (``event`` with its reason, rank, error and ``attributes``), then hand it
        back when ``exc`` is retryable, else terminate it."""
        batch_id = delivery.message.batch_id
        self._event(
            event,
            batch_id=batch_id,
            reason=exc.reason,
            rank=exc.rank,
            error=exc.detail,
            redelivered=exc.retryable,
            **attributes,
        )
        if exc.retryable:
            log.error("batch %s %s; handing it back: %s", batch_id, what, exc)
            self.stats.failed += 1
            await self._hand_back(delivery)
        else:
            log.error("terminating batch %s: %s", batch_id, exc)
            self.stats.rejected += 1
            await delivery.term()

    async def _hand_back(self, delivery: Delivery[TrainingBatch]) -> None:
        """Ask for redelivery; on the last delivery the consumer allows, terminate instead. JetStream would not
        deliver it again anyway, but a message left at its delivery limit is never acked, so the consumer's
        ack floor (what the data manager's retention waits on) would stay below it for the rest of the run."""
        consumer = STREAMS["batch"].consumer
        if consumer is not None and consumer.max_deliver > 0 and delivery.num_delivered >= consumer.max_deliver:
            log.error(
                "batch %s failed on its last allowed delivery (%d): terminated",
                delivery.message.batch_id,
                delivery.num_delivered,
            )
            self._event(
                "trainer.batch_abandoned", batch_id=delivery.message.batch_id, deliveries=delivery.num_delivered
            )
            await delivery.term()
        else:
            await delivery.nak(delay=5.0)

    def _stale(self, batch: TrainingBatch, dropped: int, kept: int) -> None:
        self.stats.stale_samples += dropped
        oldest = min(s.policy_version for s in batch.samples if not s.from_experience_pool)
        log.info(
            "batch %s: dropped %d of %d samples older than version %d - %s (oldest %d)",
            batch.batch_id,
            dropped,
            dropped + kept,
            self.version,
            batch.max_staleness,
            oldest,
        )
        self._event(
            "trainer.stale_dropped",
            batch_id=batch.batch_id,
            version=self.version,
            max_staleness=batch.max_staleness,
            samples=dropped,
            kept=kept,
            oldest_policy_version=oldest,
        )

    async def _train_step(self, samples: list[TrainingSample], min_samples: int | None) -> TrainStepMetrics:
        if self.config.debug_step_delay_s:
            await asyncio.sleep(self.config.debug_step_delay_s)
        return await asyncio.to_thread(self.train, samples, min_samples)

    def train(self, samples: list[TrainingSample], min_samples: int | None = None) -> TrainStepMetrics:
        """Build each rank's share of the samples' inputs and run the shared RL update (blocking). Unusable
        samples are dropped alone while at least ``min(min_samples, len(samples))`` remain.

        Raises:
            BatchSkippedError: The batch cannot train (see :func:`~dart.train.distributed.train_batch`); no
                rank updated.
        """
        self.commander.send("train", [s.model_dump(mode="json") for s in samples], min_samples)
        return train_batch(self.backend, self.config, self.reader, samples, min_samples)

    async def publish(self) -> ModelVersion:
        """Publish the current weights as ``version + 1`` (busy ``publish``)."""
        version = self.version + 1
        if self._busy is not None:
            async with self._busy.busy("publish"):
                model, adapter = await self._publish(version)
        else:
            model, adapter = await self._publish(version)
        self.version = version
        self.stats.published += 1
        # What a version is travels with it (its file says so); the event says it for the summary and report.
        kind = {"kind": "lora adapter", "adapter_rank": adapter.rank} if adapter is not None else {"kind": "weights"}
        self._event(
            "trainer.published",
            version=version,
            uri=model.uri,
            sha256=model.sha256,
            step=model.trainer_step,
            bytes=model.size_bytes,
            **kind,
        )
        if self.config.retention.enabled:
            pruned = await asyncio.to_thread(
                prune_weights, self.publisher.store, self.publisher.prefix, version, self.config.retention
            )
            if pruned:
                self._event("trainer.weights_pruned", versions=pruned)
        return model

    async def _publish(self, version: int) -> tuple[ModelVersion, AdapterSpec | None]:
        self.commander.send("publish")
        weights, adapter = await asyncio.to_thread(self.backend.published_weights)
        model = await self.publisher.publish(
            weights,
            version,
            trainer_step=self.backend.step,
            base_model=Path(self.config.model_path).name,
            adapter=adapter,
        )
        return model, adapter

    async def checkpoint(self) -> Path:
        """Write a resumable checkpoint ``step-<n>`` under ``config.checkpoint_dir``."""
        assert self.config.checkpoint_dir is not None
        path = Path(self.config.checkpoint_dir) / f"step-{self.backend.step}"
        started = time.perf_counter()
        self.commander.send("save", str(path), self.version)
        await asyncio.to_thread(save_checkpoint, self.backend, path, version=self.version)
        self.stats.checkpoints += 1
        self._checkpointed_step = self.backend.step
        self._event(
            "trainer.checkpoint",
            path=str(path),
            step=self.backend.step,
            version=self.version,
            seconds=time.perf_counter() - started,
        )
        if self.config.retention.enabled:
            keep = self.config.retention.checkpoint_keep_last
            await asyncio.to_thread(prune_checkpoints, self.config.checkpoint_dir, keep)
        return path

    async def _heartbeat(self, delivery: Delivery[TrainingBatch]) -> None:
        # Long steps must not outlive the consumer's ack_wait, or the batch is redelivered mid-training.
        interval = max(1.0, STREAMS["batch"].consumer.ack_wait_s / 3) if STREAMS["batch"].consumer else 30.0
        while True:
            await asyncio.sleep(interval)
            await delivery.in_progress()

    def _event(self, name: str, **attrs: object) -> None:
        if self.telemetry is not None:
            self.telemetry.event(name, **attrs)
