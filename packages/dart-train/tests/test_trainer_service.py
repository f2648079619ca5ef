"""TrainerService against a real nats-server: batches in, trained, acked; versions out in the KV and the store."""

from __future__ import annotations

import asyncio
import socket
import uuid
from pathlib import Path

import pytest

from dart.protocol.errors import ConfigError
from dart.protocol.messages import ModelVersion, TrainingBatch, TrainingSample
from dart.protocol.topology import LATEST_MODEL_KEY, STATE_BUCKET
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.store import LocalStore, StoreConfig
from dart.runtime.telemetry import TelemetryConfig, read_jsonl, setup_telemetry
from dart.runtime.topology import durable_name, ensure_topology
from dart.train.backend import TorchBackend
from dart.train.config import TrainerConfig
from dart.train.publish import WeightPublisher
from dart.train.service import TrainerService

pytestmark = pytest.mark.integration


def _batch(batch_id: str, samples: list[TrainingSample]) -> TrainingBatch:
    return TrainingBatch(
        batch_id=batch_id, samples=samples, group_ids=["g"], min_policy_version=0, max_policy_version=0, created_at=1.0
    )


async def test_trains_acks_and_publishes_each_batch(
    nats_url: str, tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    run = f"train-{uuid.uuid4().hex[:8]}"
    telemetry = setup_telemetry(
        "dart-train", version="0.1.0", run_id=run, config=TelemetryConfig(jsonl_path=tmp_path / "train.jsonl")
    )
    config = TrainerConfig(
        model_path=str(tiny_checkpoint),
        lr=1e-3,
        num_threads=2,
        publish_every=1,
        checkpoint_every=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
        retention={"keep_last": 2, "keep_every": None},
    )
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    async with await Bus.connect(BusConfig(url=nats_url, run=run)) as bus:
        await ensure_topology(bus)
        for i in range(2):
            await bus.js_publish(bus.subjects.stream_subject("batch"), _batch(f"b{i}", rollout_samples), f"b{i}")
        service = await TrainerService.start(config, bus, store, telemetry=telemetry)
        await asyncio.wait_for(service.run(max_batches=2), timeout=60)

        assert service.stats.batches == 2 and service.stats.published == 2 and service.stats.checkpoints == 1
        assert service.version == 2 and service.backend.step == 2
        state = await bus.kv(bus.subjects.kv_bucket(STATE_BUCKET), history=8)
        latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
        assert latest is not None and latest.version == 2 and latest.trainer_step == 2
        assert [e.value.version for e in await state.history(LATEST_MODEL_KEY, ModelVersion) if e.value] == [1, 2]
        assert (await bus.stream_state("model")).messages == 2
        assert store.exists("weights/v1/model.safetensors") and store.exists("weights/v2/manifest.json")
        assert (tmp_path / "ckpt" / "step-2" / "trainer_state.json").is_file()
        backlog = await bus.consumer_state("batch", durable_name(bus, "batch"))
        assert backlog.num_pending == 0 and backlog.num_ack_pending == 0

        # A restarted trainer resumes from the checkpoint and keeps numbering versions upward.
        again = await TrainerService.start(config, bus, store)
        assert again.version == 2 and again.backend.step == 2
        # A batch whose screenshot fails its digest is terminated, not retried, and changes nothing.
        bad_image = rollout_samples[0].images[0].model_copy(update={"sha256": "0" * 64})
        bad = rollout_samples[0].model_copy(update={"images": [bad_image, rollout_samples[0].images[1]]})
        await bus.js_publish(bus.subjects.stream_subject("batch"), _batch("b-bad", [bad]), "b-bad")
        task = asyncio.create_task(again.run(fetch_timeout_s=0.2))
        for _ in range(100):
            if again.stats.rejected:
                break
            await asyncio.sleep(0.05)
        await asyncio.wait_for(again.stop(), timeout=10)
        assert task.done() and again.stats.rejected == 1 and again.stats.batches == 0
        assert again.stats.skipped == {"image_corrupt": 1} and again.stats.failed == 0
        assert again.version == 2 and again.backend.step == 2
        backlog = await bus.consumer_state("batch", durable_name(bus, "batch"))
        assert backlog.num_pending == 0 and backlog.num_ack_pending == 0
        # Retention: publishing v3 with keep_last 2 deletes v1 and keeps the announced v3 and v2.
        await again.publish()
        assert not store.exists("weights/v1/model.safetensors") and not store.exists("weights/v1/manifest.json")
        assert store.exists("weights/v2/model.safetensors") and store.exists("weights/v3/model.safetensors")
    telemetry.shutdown()
    records = list(read_jsonl(tmp_path / "train.jsonl"))
    busy = [r for r in records if r["type"] == "busy" and r["resource_kind"] == "trainer"]
    assert {r["activity"] for r in busy} >= {"train_step", "publish"}
    steps = [r for r in records if r["type"] == "event" and r["name"] == "trainer.step"]
    assert [r["attributes"]["step"] for r in steps] == [1, 2]
    assert steps[0]["attributes"]["rollout_mismatch"] < 1e-4


def _unreachable_store(tmp_path: Path, samples: list[TrainingSample]) -> tuple[StoreConfig, list[TrainingSample]]:
    """An S3 store nothing listens for, and the samples with their images moved there."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "access").write_text("key")
    (tmp_path / "secret").write_text("secret")
    store_config = StoreConfig(
        uri="s3://shots",
        endpoint=f"http://127.0.0.1:{port}",
        access_key_file=tmp_path / "access",
        secret_key_file=tmp_path / "secret",
        max_retries=0,
        connect_timeout_s=1.0,
    )
    moved = [
        s.model_copy(
            update={"images": [i.model_copy(update={"uri": f"s3://shots/{n}.png"}) for n, i in enumerate(s.images)]}
        )
        for s in samples
    ]
    return store_config, moved


async def test_a_batch_whose_store_stays_unreachable_is_skipped_and_handed_back(
    nats_url: str, tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    # The samples are fine, the store is not (nothing listens on its port): terminating would lose them.
    store_config, unreachable = _unreachable_store(tmp_path, rollout_samples)
    config = TrainerConfig(
        model_path=str(tiny_checkpoint), num_threads=2, image_reads={"attempts": 2, "initial_delay_s": 0.0}
    )
    run = f"train-{uuid.uuid4().hex[:8]}"
    async with await Bus.connect(BusConfig(url=nats_url, run=run)) as bus:
        await ensure_topology(bus)
        await bus.js_publish(bus.subjects.stream_subject("batch"), _batch("b-down", unreachable), "b-down")
        service = await TrainerService.start(
            config, bus, LocalStore(tmp_path / "artifacts", fsync=False), store_config=store_config
        )
        task = asyncio.create_task(service.run(fetch_timeout_s=0.2))
        for _ in range(1200):  # a bound on a hang, not a timing: the read fails at once (connection refused)
            if service.stats.failed:
                break
            await asyncio.sleep(0.05)
        await asyncio.wait_for(service.stop(), timeout=60)
        # Skipped each time it came (a slow stop may see it redelivered once more), never terminated.
        assert task.done() and list(service.stats.skipped) == ["image_unavailable"]
        assert service.stats.failed == service.stats.skipped["image_unavailable"] >= 1
        assert service.stats.rejected == 0 and service.stats.batches == 0 and service.backend.step == 0
        # Handed back: the batch waits for its redelivery.
        backlog = await bus.consumer_state("batch", durable_name(bus, "batch"))
        assert backlog.num_ack_pending == 1


async def test_a_batch_failing_on_its_last_allowed_delivery_is_terminated(
    nats_url: str, tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    """JetStream would not deliver it again; left unacked it would hold the consumer's ack floor (what the
    data manager's retention waits on) below it for the rest of the run. Terminated, the floor moves past."""
    from dart.protocol.topology import STREAMS

    store_config, unreachable = _unreachable_store(tmp_path, rollout_samples)
    config = TrainerConfig(
        model_path=str(tiny_checkpoint), num_threads=2, image_reads={"attempts": 1, "initial_delay_s": 0.0}
    )
    limit = STREAMS["batch"].consumer.max_deliver  # type: ignore[union-attr]
    run = f"last-{uuid.uuid4().hex[:8]}"
    async with await Bus.connect(BusConfig(url=nats_url, run=run)) as bus:
        await ensure_topology(bus)
        ack = await bus.js_publish(bus.subjects.stream_subject("batch"), _batch("b-last", unreachable), "b-last")
        # Earlier trainers failed on it: every delivery but the last one used up (handed back at once).
        consumer = await bus.pull_consumer("batch", durable_name(bus, "batch"), TrainingBatch)
        for _ in range(limit - 1):
            [delivery] = await consumer.fetch(1, timeout=10)
            await delivery.nak()
        await consumer.close()
        service = await TrainerService.start(
            config, bus, LocalStore(tmp_path / "artifacts", fsync=False), store_config=store_config
        )
        task = asyncio.create_task(service.run(fetch_timeout_s=0.2))
        for _ in range(1200):  # a bound on a hang, not a timing
            if service.stats.failed:
                break
            await asyncio.sleep(0.05)
        await asyncio.wait_for(service.stop(), timeout=60)
        assert task.done() and service.stats.failed == 1 and service.stats.batches == 0
        for _ in range(200):
            state = await bus.consumer_state("batch", durable_name(bus, "batch"))
            if state.ack_floor >= ack.seq:
                break
            await asyncio.sleep(0.05)
        assert state.ack_floor == ack.seq and state.num_ack_pending == 0


async def test_samples_staler_than_the_batch_bound_are_dropped_and_counted(
    nats_url: str, tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    """Batches that waited on the stream while the trainer moved on: what lags more than the bound the
    batch was formed under is not trained on (experience-pool replays are, and are reported apart)."""
    run = f"stale-{uuid.uuid4().hex[:8]}"
    telemetry = setup_telemetry(
        "dart-train", version="0.1.0", run_id=run, config=TelemetryConfig(jsonl_path=tmp_path / "train.jsonl")
    )
    config = TrainerConfig(model_path=str(tiny_checkpoint), lr=1e-3, num_threads=2, publish_every=1)
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    fresh, old = rollout_samples
    # The trainer is at version 5; the bound is 2, so versions 3..5 are trained on.
    at_bound = fresh.model_copy(update={"policy_version": 3})
    too_old = old.model_copy(update={"policy_version": 2})
    pooled = old.model_copy(update={"trajectory_id": "pooled", "policy_version": 0, "from_experience_pool": True})

    def batch(batch_id: str, samples: list[TrainingSample]) -> TrainingBatch:
        versions = [s.policy_version for s in samples]
        return TrainingBatch(
            batch_id=batch_id,
            samples=samples,
            group_ids=["g"],
            min_policy_version=min(versions),
            max_policy_version=max(versions),
            created_at=1.0,
            max_staleness=2,
        )

    async with await Bus.connect(BusConfig(url=nats_url, run=run)) as bus:
        state = await ensure_topology(bus)
        # Version 5 as a trainer published it (a restarted trainer continues from its weights).
        weights = (await asyncio.to_thread(TorchBackend.load, config)).full_state_dict()
        v5 = await asyncio.to_thread(WeightPublisher(store).save, weights, 5, trainer_step=4, base_model="tiny")
        await state.put(LATEST_MODEL_KEY, v5)
        subject = bus.subjects.stream_subject("batch")
        await bus.js_publish(subject, batch("b-all-stale", [too_old.model_copy(update={"policy_version": 1})]), "b1")
        await bus.js_publish(subject, batch("b-mixed", [at_bound, too_old, pooled]), "b2")
        service = await TrainerService.start(config, bus, store, telemetry=telemetry)
        assert service.version == 5
        await asyncio.wait_for(service.run(max_batches=2), timeout=60)

        # One optimizer step (on the mixed batch's two usable samples), one new version.
        assert service.stats.batches == 1 and service.version == 6 and service.backend.step == 1
        assert (service.stats.stale_batches, service.stats.stale_samples) == (1, 2)
        backlog = await bus.consumer_state("batch", durable_name(bus, "batch"))
        assert backlog.num_pending == 0 and backlog.num_ack_pending == 0  # the stale batch is consumed too
    telemetry.shutdown()
    events = [r for r in read_jsonl(tmp_path / "train.jsonl", types={"event"})]
    drops = [e["attributes"] for e in events if e["name"] == "trainer.stale_dropped"]
    assert [(d["batch_id"], d["samples"], d["kept"], d["oldest_policy_version"]) for d in drops] == [
        ("b-all-stale", 1, 0, 1),
        ("b-mixed", 1, 2, 2),
    ]
    [step] = [e["attributes"] for e in events if e["name"] == "trainer.step"]
    assert step["samples"] == 2 and step["stale_dropped"] == 1
    assert step["max_policy_lag"] == 2 and step["pool_samples"] == 1 and step["pool_max_policy_lag"] == 5


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
async def test_a_trainer_without_a_checkpoint_continues_from_the_published_version_or_refuses(
    nats_url: str, tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path, lora: bool
) -> None:
    """A trainer restarted with no checkpoint after versions were published must not publish its initial
    weights under the next number: it takes the newest published version's weights (train.resume:
    latest_version, the default) or does not start (refuse)."""
    run = f"resume-{uuid.uuid4().hex[:8]}"
    config = TrainerConfig(
        model_path=str(tiny_checkpoint),
        lr=1e-2,
        num_threads=2,
        publish_every=1,
        lora={"rank": 4, "alpha": 8} if lora else None,
    )
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    telemetry = setup_telemetry(
        "dart-train", version="0.1.0", run_id=run, config=TelemetryConfig(jsonl_path=tmp_path / "train.jsonl")
    )
    async with await Bus.connect(BusConfig(url=nats_url, run=run)) as bus:
        await ensure_topology(bus)
        await bus.js_publish(bus.subjects.stream_subject("batch"), _batch("b0", rollout_samples), "b0")
        first = await TrainerService.start(config, bus, store)
        await asyncio.wait_for(first.run(max_batches=1), timeout=120)
        assert first.version == 1
        trained, _ = first.backend.published_weights()

        with pytest.raises(ConfigError, match=r"train\.resume.*version 1 was published.*no checkpoint"):
            await TrainerService.start(config.model_copy(update={"resume": "refuse"}), bus, store)

        again = await TrainerService.start(config, bus, store, telemetry=telemetry)
        assert again.version == 1 and not again.backend.optimizer.state  # numbered on, fresh moments
        restored, _ = again.backend.published_weights()
        assert restored.keys() == trained.keys()
        assert max(float((restored[k] - trained[k]).abs().max()) for k in trained) == 0.0
        await again.publish()
        state = await bus.kv(bus.subjects.kv_bucket(STATE_BUCKET), history=8)
        latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
        assert latest is not None and latest.version == 2
    telemetry.shutdown()
    resumed = [r for r in read_jsonl(tmp_path / "train.jsonl") if r.get("name") == "trainer.resumed"]
    assert [r["attributes"]["version"] for r in resumed] == [1]


async def test_a_clean_stop_writes_a_checkpoint_of_what_was_trained_since_the_last(
    nats_url: str, tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    run = f"stopck-{uuid.uuid4().hex[:8]}"
    config = TrainerConfig(
        model_path=str(tiny_checkpoint), lr=1e-3, num_threads=2, publish_every=1, checkpoint_dir=str(tmp_path / "ck")
    )
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    async with await Bus.connect(BusConfig(url=nats_url, run=run)) as bus:
        await ensure_topology(bus)
        await bus.js_publish(bus.subjects.stream_subject("batch"), _batch("b0", rollout_samples), "b0")
        first = await TrainerService.start(config, bus, store)
        await asyncio.wait_for(first.run(max_batches=1), timeout=120)
        assert first.stats.checkpoints == 1 and (tmp_path / "ck" / "step-1" / "trainer_state.json").is_file()
        # The restart resumes from it (optimizer moments included); a stop with nothing trained writes none.
        again = await TrainerService.start(config, bus, store)
        assert again.backend.step == 1 and again.version == 1 and again.backend.optimizer.state
        await asyncio.wait_for(again.run(max_batches=0), timeout=30)
        assert again.stats.checkpoints == 0
