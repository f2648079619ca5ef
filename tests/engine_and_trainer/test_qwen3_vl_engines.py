"""Qwen3-VL served and recomputed: a tiny random Qwen3-VL served by the hf engine and trained by the torch backend,
which recomputes the engine's log-probs on the same tokens and images; the same for a published size (Qwen3-VL-2B's
widths, cut to one layer) prompted with UI-TARS-1.5's format on a 1280x720 screen sized by its processor's rule."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from PIL import Image

from dart.policy.architectures import get_architecture
from dart.policy.formats import UI_TARS_15
from dart.policy.models import family_of
from dart.policy.prompt import HistoryStep, build_prompt
from dart.policy.random_init import write_checkpoint
from dart.policy.screen import ResizeRule
from dart.policy.tiny import write_tiny_checkpoint
from dart.policy.tiny_spec import TinyModelSpec
from dart.protocol.messages import Sampling, TrainingSample
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import GenerationRequest
from dart.runtime.store import LocalStore
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.testing import sample_of, store_png

pytestmark = pytest.mark.unit


LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3") / "ckpt"
    write_tiny_checkpoint(path, seed=3, spec=TinyModelSpec(family="qwen3-vl"))
    return path


async def _generate(checkpoint: Path, store: LocalStore, sampling: Sampling) -> tuple[TrainingSample, int]:
    engine = await HFEngine.start(HFEngineConfig(model_path=str(checkpoint), batch_wait_s=0.0, num_threads=2))
    try:
        older, current = Image.new("RGB", (224, 224), (10, 20, 30)), Image.new("RGB", (300, 200), (200, 40, 40))
        prompt = build_prompt("Click the OK button.", current, [HistoryStep("Action: wait()", older)], max_images=2)
        result = await engine.generate(GenerationRequest(prompt, max_new_tokens=24, sampling=sampling, seed=11))
        pad = engine.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    finally:
        await engine.close()
    refs = [store_png(store, f"qwen3/{sampling.temperature}/{j}.png", im) for j, im in enumerate(prompt.images)]
    sample = sample_of(result, refs, f"qwen3-{sampling.temperature}")
    return sample, result.prompt_token_ids.count(pad)


def test_a_published_qwen3_vl_size_is_written_served_and_recomputed(tmp_path: Path) -> None:
    """Qwen3-VL-2B's published widths, vocabulary and image processor (cut to 1 layer and 1 vision block):
    written with no download, sized by its own rule, prompted in UI-TARS-1.5's format, served by the hf
    engine and recomputed by the torch backend."""
    path = tmp_path / "qwen3-vl-2b"
    manifest = write_checkpoint(path, get_architecture("qwen3-vl-2b").cut(layers=1, vision_blocks=1), seed=5)
    assert manifest.model_class == "Qwen3VLForConditionalGeneration" and family_of(path).name == "qwen3-vl"
    rule = ResizeRule.of_checkpoint(path, max_pixels=409_600)  # the published bounds, fewer tokens
    assert (rule.min_pixels, rule.factor) == (65_536, 32)
    store = LocalStore(tmp_path / "shots")

    async def generate() -> tuple[TrainingSample, int]:
        engine = await HFEngine.start(HFEngineConfig(model_path=str(path), batch_wait_s=0.0, num_threads=2))
        try:
            screen = Image.new("RGB", (1280, 720), (30, 90, 160))
            prompt = build_prompt("Open the File menu.", screen, image_size=rule, prompt_format=UI_TARS_15)
            sampling = Sampling(temperature=1.0)
            result = await engine.generate(GenerationRequest(prompt, max_new_tokens=6, sampling=sampling, seed=3))
            pad = engine.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        finally:
            await engine.close()
        refs = [store_png(store, f"real/{j}.png", image) for j, image in enumerate(prompt.images)]
        return sample_of(result, refs, "qwen3-vl-2b"), result.prompt_token_ids.count(pad)

    sample, image_pads = asyncio.run(generate())
    assert image_pads == rule.visual_tokens(1280, 720) == (832 // 32) * (480 // 32)
    backend = TorchBackend.load(TrainerConfig(model_path=str(path), num_threads=2), image_source=StoreImageSource())
    recomputed = backend.compute_logprobs([sample])[0]
    gap = float((recomputed - torch.tensor(sample.rollout_logprobs)).abs().max())
    print(f"qwen3-vl-2b (1 layer): max |torch backend - hf engine|: {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0, top_p=0.9), Sampling(temperature=0.0)])
def test_the_torch_backend_recomputes_the_hf_engines_log_probs(
    qwen3_checkpoint: Path, tmp_path: Path, sampling: Sampling
) -> None:
    store = LocalStore(tmp_path / "shots")
    sample, image_pads = asyncio.run(_generate(qwen3_checkpoint, store, sampling))
    assert image_pads == 2 * 49 and sample.response_token_ids
    backend = TorchBackend.load(
        TrainerConfig(model_path=str(qwen3_checkpoint), num_threads=2), image_source=StoreImageSource()
    )
    assert type(backend.model).__name__ == "Qwen3VLForConditionalGeneration"
    recomputed = backend.compute_logprobs([sample])[0]
    gap = float((recomputed - torch.tensor(sample.rollout_logprobs)).abs().max())
    print(f"qwen3-vl: max |torch backend - hf engine| at T={sampling.temperature}: {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE
