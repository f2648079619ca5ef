"""Fixtures of dart-train's tests: a tiny Qwen2.5-VL checkpoint and samples drawn from it token by token
(:func:`dart.train.testing.sample_response`; the engines' own samples are tests/engine_and_trainer's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from dart.policy.loading import load_policy
from dart.policy.prompt import HistoryStep, build_prompt
from dart.protocol.messages import Sampling, TrainingSample
from dart.runtime.store import LocalStore
from dart.train.testing import sample_of, sample_response, store_png


def _rollout(checkpoint: Path, store: LocalStore, n: int) -> list[TrainingSample]:
    model, processor = load_policy(checkpoint)
    samples = []
    for i in range(n):
        older, current = Image.new("RGB", (224, 224)), Image.new("RGB", (300, 200), (30 * i, 100, 200 - 20 * i))
        prompt = build_prompt(
            f"Click the OK button {i}.", current, [HistoryStep("Action: wait()", older)], max_images=2
        )
        drawn = sample_response(model, processor, prompt, max_new_tokens=10, sampling=Sampling(temperature=1.0), seed=i)
        # The images as fed (the prompt resized them), as a runner records them in StepRecord.prompt_images.
        refs = [store_png(store, f"shots/{i}/{j}.png", im) for j, im in enumerate(prompt.images)]
        sample = sample_of(drawn, refs, f"t{i}")
        samples.append(
            sample.model_copy(update={"advantage": 1.0 if i % 2 == 0 else -1.0, "reward": float(i % 2 == 0)})
        )
    return samples


@pytest.fixture(scope="session")
def rollout_samples(tiny_checkpoint: Path, shot_store: LocalStore) -> list[TrainingSample]:
    """Two samples drawn from ``tiny_checkpoint`` (advantages +1 and -1), screenshots stored."""
    return _rollout(tiny_checkpoint, shot_store, 2)
