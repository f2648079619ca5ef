"""The hf engine records the log-probs of exactly the distribution the trainer recomputes.

Whatever a checkpoint's ``generation_config.json`` says (a real Qwen2.5-VL-Instruct checkpoint sets
``repetition_penalty``, ``top_k``, ``top_p`` and ``temperature``), the engine samples only what the
recorded :class:`~dart.protocol.messages.SamplingParams` describe, at any temperature including greedy
(temperature 0, where the excluded tokens are still masked).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from dart.policy.prompt import HistoryStep, build_prompt
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

CHECKPOINT_SAMPLING = {"repetition_penalty": 1.3, "top_k": 5, "no_repeat_ngram_size": 2, "do_sample": True}
"""Sampling settings a checkpoint may ship (the first two as Qwen2.5-VL-Instruct's do)."""


@pytest.fixture(scope="module")
def opinionated_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with sampling settings in its generation_config.json."""
    path = tmp_path_factory.mktemp("opinionated") / "ckpt"
    shutil.copytree(tiny_checkpoint, path)
    config_file = path / "generation_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, **CHECKPOINT_SAMPLING}))
    return path


async def _generate(checkpoint: Path, store: LocalStore, temperature: float) -> TrainingSample:
    engine = await HFEngine.start(HFEngineConfig(model_path=str(checkpoint), batch_wait_s=0.0, num_threads=2))
    try:
        older, current = Image.new("RGB", (224, 224), (10, 20, 30)), Image.new("RGB", (300, 200), (200, 40, 40))
        prompt = build_prompt("Click the OK button.", current, [HistoryStep("Action: wait()", older)], max_images=2)
        request = GenerationRequest(
            prompt, max_new_tokens=24, sampling=Sampling(temperature=temperature, top_p=0.9), seed=5
        )
        result = await engine.generate(request)
    finally:
        await engine.close()
    refs = [store_png(store, f"agreement/{temperature}/{j}.png", im) for j, im in enumerate(prompt.images)]
    return sample_of(result, refs, f"agreement-{temperature}")


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_checkpoint_generation_config_does_not_change_what_is_sampled(
    opinionated_checkpoint: Path, shot_store: LocalStore, temperature: float, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dart.rollout.hf"):
        sample = asyncio.run(_generate(opinionated_checkpoint, shot_store, temperature))
    assert sample.response_token_ids  # the penalty also acts on tokens the prompt holds
    config = TrainerConfig(model_path=str(opinionated_checkpoint), num_threads=2)
    backend = TorchBackend.load(config, image_source=StoreImageSource())
    recomputed = backend.compute_logprobs([sample])[0]
    recorded = torch.tensor(sample.rollout_logprobs)
    gap = float((recomputed - recorded).abs().max())
    print(f"max |trainer - hf engine| at T={temperature} with checkpoint sampling settings: {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE
    warnings = [r.getMessage() for r in caplog.records if r.name == "dart.rollout.hf"]
    assert len(warnings) == 1, warnings  # one warning per engine, naming every field it overrides
    assert all(name in warnings[0] for name in ("repetition_penalty", "top_k", "no_repeat_ngram_size"))
