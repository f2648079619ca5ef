"""bfloat16 training keeps float32 master weights: updates of lr 1e-6 move the weights as in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dart.protocol.messages import TrainingBatch, TrainingSample
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.checkpoint import load_checkpoint, save_checkpoint
from dart.train.config import TrainerConfig
from dart.train.errors import TrainerError

pytestmark = pytest.mark.unit

LR = 1e-6


def _backend(checkpoint: Path, dtype: str) -> TorchBackend:
    config = TrainerConfig.model_validate(
        {"model_path": str(checkpoint), "num_threads": 2, "dtype": dtype, "lr": LR, "micro_batch_size": 2}
    )
    return TorchBackend.load(config, image_source=StoreImageSource())


def _batch(samples: list[TrainingSample]) -> TrainingBatch:
    return TrainingBatch(
        batch_id="b1", samples=samples, group_ids=["g"], min_policy_version=0, max_policy_version=0, created_at=0.0
    )


def _saved(backend: TorchBackend, path: Path) -> dict[str, torch.Tensor]:
    """The weights a resume continues from: the checkpoint's model file."""
    save_checkpoint(backend, path, version=0)
    return load_file(str(path / "model.safetensors"))


def _delta(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(after[k].double() - before[k].double()).flatten() for k in sorted(before)])


def test_bfloat16_moves_the_weights_as_float32_does_and_resumes_exactly(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    batch = _batch(rollout_samples)
    deltas = {}
    for dtype in ("float32", "bfloat16"):
        backend = _backend(tiny_checkpoint, dtype)
        before = _saved(backend, tmp_path / dtype / "step-0")
        backend.train_step(batch)
        deltas[dtype] = _delta(before, _saved(backend, tmp_path / dtype / "step-1"))
        published = backend.full_state_dict()
        # Published weights stay in the dtype the model computes (and the engines serve) in.
        assert {v.dtype for v in published.values()} == {getattr(torch, dtype)}
    fp32, bf16 = deltas["float32"], deltas["bfloat16"]
    # Adam's first step moves each weight with a gradient by about lr (updates a bfloat16 weight rounds away).
    assert 0.5 * LR < float(fp32.abs().max()) < 2 * LR
    ratio = float(bf16.norm() / fp32.norm())
    cosine = float(bf16 @ fp32 / (bf16.norm() * fp32.norm()))
    print(f"bf16/fp32 update norm ratio {ratio:.4f}, cosine {cosine:.4f}")
    assert 0.9 < ratio < 1.1 and cosine > 0.9

    # The checkpoint holds the float32 masters and Adam's float32 moments: a resume continues exactly.
    trained = _backend(tiny_checkpoint, "bfloat16")
    trained.train_step(batch)
    save_checkpoint(trained, tmp_path / "resume" / "step-1", version=1)
    resumed = _backend(tiny_checkpoint, "bfloat16")
    load_checkpoint(resumed, tmp_path / "resume" / "step-1")
    trained.train_step(batch)
    resumed.train_step(batch)
    a, b = _saved(trained, tmp_path / "a"), _saved(resumed, tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert {v.dtype for v in a.values()} == {torch.float32}
    published_a, published_b = trained.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(published_a[k], published_b[k]) for k in published_a)


def test_fsdp_refuses_low_precision_weights_naming_the_fields(tiny_checkpoint: Path) -> None:
    from dart.train.fsdp import FsdpBackend

    config = TrainerConfig.model_validate({"model_path": str(tiny_checkpoint), "dtype": "bfloat16", "backend": "fsdp"})
    with pytest.raises(TrainerError, match=r"train\.dtype bfloat16.*mixed_precision"):
        FsdpBackend.load(config)
