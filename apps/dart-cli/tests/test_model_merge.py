"""`dart model merge` writes a published version as a standalone checkpoint: a LoRA adapter merged into its base
computes what the trainer's base + adapter computes, and loads with no peft and no DART metadata."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from dart.policy.prompt import build_prompt
from dart.policy.tiny import write_tiny_checkpoint
from dart.protocol.messages import Sampling, TrainingSample
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import GenerationRequest
from dart.runtime.store import LocalStore
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.config import LoraSettings, TrainerConfig
from dart.train.publish import WeightPublisher
from dart.train.testing import sample_of, store_png

pytestmark = pytest.mark.integration


def _merge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dart.cli", "model", "merge", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


async def _sample(checkpoint: Path, store: LocalStore) -> TrainingSample:
    engine = await HFEngine.start(HFEngineConfig(model_path=str(checkpoint), batch_wait_s=0.0, num_threads=2))
    try:
        prompt = build_prompt("Click the OK button.", Image.new("RGB", (300, 200), (200, 40, 40)))
        result = await engine.generate(GenerationRequest(prompt, max_new_tokens=12, sampling=Sampling(), seed=1))
    finally:
        await engine.close()
    return sample_of(result, [store_png(store, "shot.png", image) for image in prompt.images])


def test_a_merged_adapter_is_a_checkpoint_that_computes_base_plus_adapter(tmp_path: Path) -> None:
    base = tmp_path / "base"
    write_tiny_checkpoint(base, seed=0)
    store = LocalStore(tmp_path / "store", fsync=False)
    sample = asyncio.run(_sample(base, store))
    lora = LoraSettings(rank=4, alpha=8)
    trainer = TorchBackend.load(
        TrainerConfig(model_path=str(base), num_threads=2, lr=1e-2, lora=lora), image_source=StoreImageSource()
    )
    trainer.train_step([sample])
    weights, adapter = trainer.published_weights()
    version = WeightPublisher(store).save(weights, 1, trainer_step=trainer.step, base_model="base", adapter=adapter)

    out = tmp_path / "merged"
    proc = _merge(version.uri, str(out), "--base", str(base))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["adapter"] is True and summary["version"] == 1
    assert not (out / "adapter_config.json").exists()  # an ordinary checkpoint, not an adapter

    merged = TorchBackend.load(TrainerConfig(model_path=str(out), num_threads=2), image_source=StoreImageSource())
    plain = TorchBackend.load(TrainerConfig(model_path=str(base), num_threads=2), image_source=StoreImageSource())
    expected = trainer.compute_logprobs([sample])[0]
    got = merged.compute_logprobs([sample])[0]
    print(f"merged vs base + adapter: {float((got - expected).abs().max()):.2e}")
    assert float((got - expected).abs().max()) < 1e-5
    assert float((plain.compute_logprobs([sample])[0] - expected).abs().max()) > 1e-4  # the adapter mattered
    assert torch.equal(merged.model.lm_head.weight, plain.model.lm_head.weight)  # unadapted weights as they were


def test_merge_refuses_what_it_cannot_merge(tmp_path: Path) -> None:
    proc = _merge(f"file://{tmp_path}/weights/v3/model.safetensors", str(tmp_path / "out"))
    assert proc.returncode == 2 and "give --base" in proc.stderr
    proc = _merge(str(tmp_path), str(tmp_path / "out"))
    assert proc.returncode == 2 and "not a checkpoint directory" in proc.stderr
