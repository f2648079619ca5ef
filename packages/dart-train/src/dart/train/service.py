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
from dataclasses import dataclass
from pathlib import Path

from dart.protocol.bus import Bus, Delivery, KeyValueStore, PullConsumer
from dart.protocol.messages import ModelVersion, TrainingBatch
from dart.protocol.store import ArtifactStore, StoreConfig
from dart.protocol.telemetry import BusyTracker, GpuSampler, Telemetry
from dart.protocol.topology import LATEST_MODEL_KEY, STREAMS, durable_name, ensure_topology
from dart.train.backend import TorchBackend, TrainStepMetrics
from dart.train.batching import StoreImageSource
from dart.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dart.train.config import TrainerConfig
from dart.train.errors import ImageFetchError, SampleError
from dart.train.publish import WeightPublisher
from dart.train.retention import prune_checkpoints, prune_weights

log = logging.getLogger("dart.train")


@dataclass
class TrainerStats:
    """Counters since start.

    Attributes:
        batches: Batches trained and acked.
        rejected: Batches terminated because a sample could not be rebuilt (bad tokens or images).
        failed: Batches handed back for redelivery after an unexpected error.
        published: Weight versions published.
        checkpoints: Checkpoints written.
    """

    batches: int = 0
    rejected: int = 0
    failed: int = 0
    published: int = 0
    checkpoints: int = 0


class TrainerService:
    """Pulls :class:`TrainingBatch` messages one at a time, trains on each, publishes every K steps.

    Lifecycle: ``starting`` in :meth:`start` (topology ensured, model loaded, resumed from the newest
    checkpoint in ``config.checkpoint_dir`` if any, numbering versions on from the newest of the
    checkpoint's and the KV's) -> ``running`` in :meth:`run`: fetch one batch -> train (busy
    ``train_step``, heartbeating the delivery) -> ack -> every ``publish_every`` steps publish ``version + 1`` -> every
    ``checkpoint_every`` steps checkpoint -> ``stopped`` once :meth:`stop` is called: the batch in
    training finishes and is acked, then the consumer is closed. A batch with an unusable sample is
    terminated (redelivery cannot fix it); any other failure naks it for redelivery.

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
        backend: TorchBackend,
        publisher: WeightPublisher,
        consumer: PullConsumer[TrainingBatch],
        *,
        version: int = 0,
        telemetry: Telemetry | None = None,
        instance_id: str = "trainer-0",
    ) -> None:
        self.config = config
        self.bus = bus
        self.backend = backend
        self.publisher = publisher
        self.consumer = consumer
        self.version = version
        """Latest published policy version (0 = the initial checkpoint)."""
        self.stats = TrainerStats()
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
        """Ensure the topology, load the model (off the loop), resume, and bind the batch consumer.

        Args:
            config: Trainer configuration.
            bus: Connected bus.
            store: Artifact store weights are published to.
            store_config: Store config used to read ``s3://`` screenshot references.
            telemetry: Service telemetry.
            instance_id: This trainer's id.
        """
        state: KeyValueStore = await ensure_topology(bus)
        backend = await asyncio.to_thread(TorchBackend.load, config, image_source=StoreImageSource(store_config))
        version = 0
        resume = latest_checkpoint(config.checkpoint_dir) if config.checkpoint_dir else None
        if resume is not None:
            saved = await asyncio.to_thread(load_checkpoint, backend, resume)
            version = saved.version
            log.info("resumed from %s at step %d, version %d", resume, saved.step, saved.version)
        latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
        # Versions published after the last checkpoint still count: a reused number would be deduplicated
        # on the model stream and engines would never see the new weights.
        version = max(version, latest.version if latest is not None else 0)
        consumer = await bus.pull_consumer("batch", durable_name(bus, "batch"), TrainingBatch)
        publisher = WeightPublisher(store, bus, state, prefix=config.weights_prefix)
        return cls(
            config, bus, backend, publisher, consumer, version=version, telemetry=telemetry, instance_id=instance_id
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
                deliveries = await self.consumer.fetch(1, timeout=fetch_timeout_s)
                for delivery in deliveries:
                    await self._handle(delivery)
                    done += 1
        finally:
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
            heartbeat = asyncio.create_task(self._heartbeat(delivery))
            try:
                if self._busy is not None:
                    async with self._busy.busy("train_step"):
                        metrics = await asyncio.to_thread(self.backend.train_step, batch)
                else:
                    metrics = await asyncio.to_thread(self.backend.train_step, batch)
            except (SampleError, ImageFetchError) as exc:
                log.error("terminating batch %s: %s", batch.batch_id, exc)
                self.stats.rejected += 1
                self._event("trainer.batch_rejected", batch_id=batch.batch_id, error=str(exc))
                await delivery.term()
                return
            except Exception:
                log.exception("training on batch %s failed; handing it back", batch.batch_id)
                self.stats.failed += 1
                await delivery.nak(delay=5.0)
                return
            finally:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
            await delivery.ack()
        self.stats.batches += 1
        self.last_metrics = metrics
        self._event(
            "trainer.step",
            batch_id=batch.batch_id,
            min_policy_version=batch.min_policy_version,
            max_policy_lag=self.version - batch.min_policy_version,
            **metrics.as_dict(),
        )
        if metrics.step % self.config.publish_every == 0:
            await self.publish()
        if (
            self.config.checkpoint_every
            and self.config.checkpoint_dir
            and metrics.step % self.config.checkpoint_every == 0
        ):
            await self.checkpoint()

    async def publish(self) -> ModelVersion:
        """Publish the current weights as ``version + 1`` (busy ``publish``)."""
        version = self.version + 1
        if self._busy is not None:
            async with self._busy.busy("publish"):
                model = await self._publish(version)
        else:
            model = await self._publish(version)
        self.version = version
        self.stats.published += 1
        self._event("trainer.published", version=version, uri=model.uri, sha256=model.sha256, step=model.trainer_step)
        if self.config.retention.enabled:
            pruned = await asyncio.to_thread(
                prune_weights, self.publisher.store, self.publisher.prefix, version, self.config.retention
            )
            if pruned:
                self._event("trainer.weights_pruned", versions=pruned)
        return model

    async def _publish(self, version: int) -> ModelVersion:
        weights = await asyncio.to_thread(self.backend.weights)
        return await self.publisher.publish(
            weights, version, trainer_step=self.backend.step, base_model=self.backend.base_model
        )

    async def checkpoint(self) -> Path:
        """Write a resumable checkpoint ``step-<n>`` under ``config.checkpoint_dir``."""
        assert self.config.checkpoint_dir is not None
        path = Path(self.config.checkpoint_dir) / f"step-{self.backend.step}"
        await asyncio.to_thread(save_checkpoint, self.backend, path, version=self.version)
        self.stats.checkpoints += 1
        self._event("trainer.checkpoint", path=str(path), step=self.backend.step, version=self.version)
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
