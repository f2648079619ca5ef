"""WeightPublisher: safetensors shards + index + manifest in the store, and the hf engine serves exactly the
trainer's weights, whether a version is one file or several shards."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from dart.policy.prompt import build_prompt, encode_prompt
from dart.protocol.messages import Sampling, TrainingBatch, TrainingSample
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import GenerationRequest
from dart.rollout.service.fetch import fetch_weights
from dart.runtime.store import LocalStore
from dart.train.backend import TorchBackend
from dart.train.config import PublishConfig, TrainerConfig
from dart.train.publish import WeightManifest, WeightPublisher, weights_file

pytestmark = pytest.mark.unit


async def test_published_weights_load_into_the_hf_engine_and_match_the_trainer(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    backend = await _trained(tiny_checkpoint, rollout_samples)
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    publisher = WeightPublisher(store)
    model = await publisher.publish(backend.weights(), 1, trainer_step=backend.step, base_model=backend.base_model)

    path = weights_file(model)
    assert path == store.path("weights/v1/model.safetensors") and model.shards == 1
    assert model.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and model.size_bytes == path.stat().st_size
    assert model.manifest_uri is not None and publisher.last == model
    assert model.manifest_sha256 == hashlib.sha256(store.get("weights/v1/manifest.json")).hexdigest()
    manifest = WeightManifest.model_validate(json.loads(store.get("weights/v1/manifest.json")))
    assert (manifest.version, manifest.sha256, manifest.trainer_step) == (1, model.sha256, 1)
    assert manifest.base_model == tiny_checkpoint.name
    assert [(s.name, s.uri, s.sha256) for s in manifest.shards] == [("model.safetensors", model.uri, model.sha256)]
    await _greedy_matches_trainer(path, tiny_checkpoint, backend)


async def _trained(tiny_checkpoint: Path, rollout_samples: list[TrainingSample]) -> TorchBackend:
    config = TrainerConfig(model_path=str(tiny_checkpoint), lr=1e-3, num_threads=2)
    backend = await asyncio.to_thread(TorchBackend.load, config)
    batch = TrainingBatch(
        batch_id="b", samples=rollout_samples, group_ids=["g"], min_policy_version=0, max_policy_version=0, created_at=0
    )
    await asyncio.to_thread(backend.train_step, batch)
    return backend


async def _greedy_matches_trainer(engine_weights: Path, tiny_checkpoint: Path, backend: TorchBackend) -> None:
    """The hf engine serving ``engine_weights`` gives the trainer's log-probs for its greedy response."""
    engine = await HFEngine.start(HFEngineConfig(model_path=str(tiny_checkpoint), batch_wait_s=0.0, num_threads=2))
    try:
        await engine.update_weights(engine_weights, version=1)
        prompt = build_prompt("Click the OK button.", Image.new("RGB", (224, 224), (10, 200, 30)))
        result = await engine.generate(GenerationRequest(prompt, max_new_tokens=8, sampling=Sampling(temperature=0.0)))
        assert result.policy_version == 1
        encoded = encode_prompt(engine.processor, prompt)
    finally:
        await engine.close()
    inputs = backend.raw_inputs(encoded.input_ids, result.response_token_ids, list(prompt.images))
    with torch.no_grad():
        trainer_logp, _ = backend.forward_logprobs(inputs, excluded_token_ids=result.sampling.excluded_token_ids)
    assert torch.allclose(trainer_logp, torch.tensor(result.response_logprobs), atol=1e-4, rtol=0)


async def test_a_sharded_version_lists_every_shard_and_serves_the_trainers_logprobs(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    """A shard size a third of the model splits the tiny model: the manifest names every shard with the digest
    of its bytes, the index maps every tensor, and the fetched directory loads into the hf engine."""
    backend = await _trained(tiny_checkpoint, rollout_samples)
    weights = backend.weights()
    total_mib = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    publisher = WeightPublisher(store, config=PublishConfig(shard_mib=total_mib / 3))
    model = await publisher.publish(weights, 1, trainer_step=backend.step, base_model=backend.base_model)

    assert model.shards >= 3 and model.uri == store.uri("weights/v1/model.safetensors.index.json")
    manifest = WeightManifest.model_validate_json(store.get("weights/v1/manifest.json"))
    assert (manifest.weights_uri, manifest.sha256, manifest.dtype) == (model.uri, model.sha256, "float32")
    index_file = store.path("weights/v1/model.safetensors.index.json")
    assert model.sha256 == hashlib.sha256(index_file.read_bytes()).hexdigest()
    names = [f"model-{i:05d}-of-{model.shards:05d}.safetensors" for i in range(1, model.shards + 1)]
    assert [s.name for s in manifest.shards] == names
    for shard in manifest.shards:
        path = store.path(f"weights/v1/{shard.name}")
        assert shard.uri == store.uri(f"weights/v1/{shard.name}") and shard.size_bytes == path.stat().st_size
        assert shard.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest.size_bytes == model.size_bytes == sum(s.size_bytes for s in manifest.shards)
    weight_map = json.loads(index_file.read_text())["weight_map"]
    assert set(weight_map) == set(weights) and set(weight_map.values()) == set(names)
    for name, file in weight_map.items():
        with safe_open(str(store.path(f"weights/v1/{file}")), "pt") as f:
            assert torch.equal(f.get_tensor(name), weights[name])

    directory = await fetch_weights(model)
    assert directory == store.path("weights/v1") == weights_file(model)
    await _greedy_matches_trainer(directory, tiny_checkpoint, backend)


async def test_weights_are_published_in_the_configured_dtype(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    """A float32 trainer publishing bfloat16 writes every floating-point tensor as the trainer's value rounded
    to bf16 (half the bytes), and an engine loads it."""
    backend = await _trained(tiny_checkpoint, rollout_samples)
    weights = backend.weights()
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    full = await WeightPublisher(store).publish(weights, 1, trainer_step=1, base_model="tiny")
    half = await WeightPublisher(store, config=PublishConfig(dtype="bfloat16")).publish(
        weights, 2, trainer_step=1, base_model="tiny"
    )
    assert half.shards == 1 and half.size_bytes < 0.55 * full.size_bytes
    manifest = WeightManifest.model_validate_json(store.get("weights/v2/manifest.json"))
    assert manifest.dtype == "bfloat16" and [s.sha256 for s in manifest.shards] == [half.sha256]
    written = load_file(str(weights_file(half)))
    assert set(written) == set(weights)
    for name, tensor in weights.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert written[name].dtype == expected.dtype and torch.equal(written[name], expected), name
    engine = await HFEngine.start(HFEngineConfig(model_path=str(tiny_checkpoint), batch_wait_s=0.0, num_threads=2))
    try:
        await engine.update_weights(weights_file(half), version=2)
        served = engine.model.state_dict()
        name = next(n for n, t in weights.items() if t.is_floating_point() and t.numel() > 1)
        assert torch.equal(served[name], written[name].float())
    finally:
        await engine.close()


def _wait_exited(server: Any) -> None:
    while server.poll() is None:
        time.sleep(0.05)


@pytest.mark.integration
async def test_an_announcement_rides_out_a_broker_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """nats-server SIGKILLed before an announcement and restarted (same port and JetStream store) while it
    is retried: the version reaches the model stream once and the KV, and the publisher did not raise."""
    import logging
    import os
    import signal

    from dart.embedded.nats import EmbeddedNats
    from dart.protocol.messages import ModelVersion
    from dart.protocol.topology import LATEST_MODEL_KEY
    from dart.runtime.bus import Bus, BusConfig
    from dart.runtime.topology import ensure_topology

    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        config = BusConfig(url=nats.url, run="announce", request_timeout_s=2.0, connect_timeout_s=2.0)
        async with await Bus.connect(config) as bus:
            state = await ensure_topology(bus)
            publisher = WeightPublisher(LocalStore(tmp_path / "artifacts", fsync=False), bus, state)
            model = ModelVersion(version=1, uri="file:///w/v1/model.safetensors", sha256="0" * 64, created_at=0.0)
            assert nats.pid is not None
            os.kill(nats.pid, signal.SIGKILL)
            await asyncio.to_thread(_wait_exited, nats)  # the broker is gone before the announcement starts
            caplog.set_level(logging.WARNING, logger="dart.train.publish")
            announcing = asyncio.create_task(publisher.announce(model))
            while not any("retrying" in r.getMessage() for r in caplog.records):  # an attempt failed
                assert not announcing.done(), announcing.exception()
                await asyncio.sleep(0.05)
            await asyncio.to_thread(nats.restart)
            await asyncio.wait_for(announcing, 240.0)
            assert publisher.last == model
            stored = await state.get(LATEST_MODEL_KEY, ModelVersion)
            assert stored is not None and stored.version == 1
            assert (await bus.stream_state("model")).messages == 1
