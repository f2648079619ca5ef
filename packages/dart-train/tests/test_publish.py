"""WeightPublisher: safetensors + manifest in the store, and the hf engine serves exactly the trainer's weights."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from dart.protocol.messages import TrainingBatch, TrainingSample
from dart.protocol.store import LocalStore
from dart.rollout.engine.base import GenerationRequest
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.model.prompt import build_prompt, encode_prompt
from dart.train.backend import TorchBackend
from dart.train.config import TrainerConfig
from dart.train.publish import WeightManifest, WeightPublisher, weights_file

pytestmark = pytest.mark.unit


async def test_published_weights_load_into_the_hf_engine_and_match_the_trainer(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    config = TrainerConfig(model_path=str(tiny_checkpoint), lr=1e-3, num_threads=2)
    backend = await asyncio.to_thread(TorchBackend.load, config)
    batch = TrainingBatch(
        batch_id="b", samples=rollout_samples, group_ids=["g"], min_policy_version=0, max_policy_version=0, created_at=0
    )
    await asyncio.to_thread(backend.train_step, batch)
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    publisher = WeightPublisher(store)
    model = await publisher.publish(backend.weights(), 1, trainer_step=backend.step, base_model=backend.base_model)

    path = weights_file(model)
    assert path == store.path("weights/v1/model.safetensors")
    assert model.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and model.size_bytes == path.stat().st_size
    assert model.manifest_uri is not None and publisher.last == model
    manifest = WeightManifest.model_validate(json.loads(store.get("weights/v1/manifest.json")))
    assert (manifest.version, manifest.sha256, manifest.trainer_step) == (1, model.sha256, 1)
    assert manifest.base_model == tiny_checkpoint.name

    engine = await HFEngine.start(HFEngineConfig(model_path=str(tiny_checkpoint), batch_wait_s=0.0, num_threads=2))
    try:
        await engine.update_weights(path, version=model.version)
        prompt = build_prompt("Click the OK button.", Image.new("RGB", (224, 224), (10, 200, 30)))
        result = await engine.generate(GenerationRequest(prompt, max_new_tokens=8, temperature=0.0))
        assert result.policy_version == 1
        encoded = encode_prompt(engine.processor, prompt)
    finally:
        await engine.close()
    inputs = backend.raw_inputs(encoded.input_ids, result.response_token_ids, list(prompt.images))
    with torch.no_grad():
        trainer_logp, _ = backend.forward_logprobs(inputs)
    assert torch.allclose(trainer_logp, torch.tensor(result.response_logprobs), atol=1e-4, rtol=0)
