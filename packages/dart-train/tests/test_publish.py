"""WeightPublisher: safetensors + manifest in the store, and the hf engine serves exactly the trainer's weights."""

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
        # Greedy log-probs are those of the recorded distribution: temperature 1, excluded tokens masked.
        trainer_logp, _ = backend.forward_logprobs(inputs, excluded_token_ids=result.sampling.excluded_token_ids)
    assert torch.allclose(trainer_logp, torch.tensor(result.response_logprobs), atol=1e-4, rtol=0)


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
    from dart.protocol.bus import Bus, BusConfig
    from dart.protocol.messages import ModelVersion
    from dart.protocol.topology import LATEST_MODEL_KEY, ensure_topology

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
