"""LoRA training on the torch backend: adapters on a frozen base, the base itself as the KL reference, and
checkpoints that hold the adapters and their optimizer state and resume exactly (the engines serving the
published adapters: tests/engine_and_trainer/test_lora_engines.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dart.policy.adapters import peft_config
from dart.protocol.messages import TrainingSample
from dart.protocol.weights import AdapterSpec
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.config import LANGUAGE_MODEL_ATTENTION, LoraSettings, TrainerConfig

pytestmark = pytest.mark.unit


def _lora_backend(checkpoint: Path, **lora: object) -> TorchBackend:
    config = TrainerConfig(model_path=str(checkpoint), num_threads=2, lr=5e-3, lora=LoraSettings(**lora))  # type: ignore[arg-type]
    return TorchBackend.load(config, image_source=StoreImageSource())


def _gap(a: torch.Tensor, samples: TrainingSample) -> float:
    return float((a - torch.tensor(samples.rollout_logprobs)).abs().max())


def test_only_the_adapters_train_and_the_base_is_the_reference(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    full = TorchBackend.load(TrainerConfig(model_path=str(tiny_checkpoint), num_threads=2))
    lora = _lora_backend(tiny_checkpoint, rank=4, alpha=8)
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all("language_model" in n and "visual" not in n for n in trainable)  # the vision tower stays frozen
    assert {p.numel() for p in lora.trainable} and sum(p.numel() for p in lora.trainable) < 0.05 * sum(
        p.numel() for p in full.model.parameters()
    )
    # B starts at zero: step 0 is the base policy.
    for a, b in zip(lora.compute_logprobs(rollout_samples), full.compute_logprobs(rollout_samples), strict=True):
        assert torch.equal(a, b)
    base_before = {n: p.detach().clone() for n, p in lora.model.named_parameters() if not p.requires_grad}
    lora.train_step(rollout_samples)
    moved = lora.compute_logprobs(rollout_samples)
    assert max(_gap(m, s) for m, s in zip(moved, rollout_samples, strict=True)) > 1e-4  # the adapters learned
    assert all(torch.equal(p, base_before[n]) for n, p in lora.model.named_parameters() if not p.requires_grad)
    # The KL reference is the base model: the adapters switched off, no second copy.
    assert lora.ref_model is None
    inputs = lora.sample_inputs(rollout_samples[0])
    sampling = rollout_samples[0].sampling
    ref = lora.reference_logprobs(
        inputs, temperature=sampling.temperature, top_p=sampling.top_p, excluded_token_ids=sampling.excluded_token_ids
    )
    assert torch.equal(ref, full.compute_logprobs(rollout_samples[:1])[0])


def test_a_vision_adapter_is_a_setting() -> None:
    settings = LoraSettings(adapt_vision=True)
    assert settings.targets() != LANGUAGE_MODEL_ATTENTION and "visual" in settings.targets()


def test_lora_is_refused_where_it_is_not_built() -> None:
    with pytest.raises(ValueError, match="train.lora is set but train.backend is megatron"):
        TrainerConfig(model_path="x", backend={"kind": "megatron"}, lora=LoraSettings())  # type: ignore[arg-type]


def test_a_lora_checkpoint_resumes_exactly(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    first = _lora_backend(tiny_checkpoint)
    first.train_step(rollout_samples)
    first.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").stat().st_size < 1_000_000  # the adapters, not the model
    second = _lora_backend(tiny_checkpoint)
    second.load_checkpoint(tmp_path / "ckpt")
    for backend in (first, second):
        backend.train_step(rollout_samples)
    a, b = first.published_weights()[0], second.published_weights()[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_adapter_spec_builds_the_trainers_adapters() -> None:
    spec = AdapterSpec(rank=4, alpha=8, target_modules=LANGUAGE_MODEL_ATTENTION, base_model="tiny")
    config = peft_config(spec)
    assert (config.r, config.lora_alpha, config.target_modules) == (4, 8, LANGUAGE_MODEL_ATTENTION)
