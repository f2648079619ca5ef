"""TorchBackend: recomputed log-probs equal the hf engine's, GRPO moves the policy the right way, checkpoints resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dart.protocol.messages import TrainingBatch, TrainingSample
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dart.train.config import TrainerConfig
from dart.train.errors import CheckpointError, ImageFetchError, SampleError
from dart.train.update import token_weights

pytestmark = pytest.mark.unit

# float32 on CPU: the engine's KV-cached decoding and one unpadded teacher-forced pass agree to ~1e-6.
LOGPROB_TOLERANCE = 1e-4


def _backend(checkpoint: Path, **overrides: object) -> TorchBackend:
    config = TrainerConfig.model_validate({"model_path": str(checkpoint), "num_threads": 2, **overrides})
    return TorchBackend.load(config, image_source=StoreImageSource())


def _batch(samples: list[TrainingSample]) -> TrainingBatch:
    return TrainingBatch(
        batch_id="b1", samples=samples, group_ids=["g"], min_policy_version=0, max_policy_version=0, created_at=0.0
    )


def test_recomputed_logprobs_match_the_hf_engine(tiny_checkpoint: Path, rollout_samples: list[TrainingSample]) -> None:
    backend = _backend(tiny_checkpoint)
    recomputed = backend.compute_logprobs(rollout_samples)
    worst = 0.0
    for sample, logp in zip(rollout_samples, recomputed, strict=True):
        assert logp.shape == (len(sample.response_token_ids),)
        worst = max(worst, float((logp - torch.tensor(sample.rollout_logprobs)).abs().max()))
    print(f"max |trainer - engine| logprob difference: {worst:.3e}")
    assert worst < LOGPROB_TOLERANCE


def test_train_step_raises_positive_and_lowers_negative_advantage(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    backend = _backend(tiny_checkpoint, lr=1e-3, micro_batch_size=1)
    before = [lp.sum().item() for lp in backend.compute_logprobs(rollout_samples)]
    first = backend.train_step(_batch(rollout_samples))
    # Fresh weights equal the engine's, so the mismatch is numerics only and the ratio starts at exactly 1.
    assert first.rollout_mismatch < LOGPROB_TOLERANCE
    assert first.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert first.tis_weight_mean == pytest.approx(1.0, abs=1e-3)
    assert first.step == 1 and first.tokens == sum(len(s.response_token_ids) for s in rollout_samples)
    assert first.grad_norm > 0 and first.entropy > 0
    for _ in range(2):
        last = backend.train_step(_batch(rollout_samples))
    after = [lp.sum().item() for lp in backend.compute_logprobs(rollout_samples)]
    assert after[0] > before[0] + 1e-3  # advantage +1
    assert after[1] < before[1] - 1e-3  # advantage -1
    # The policy moved away from the rollout's, which the mismatch metric sees.
    assert backend.step == 3 and last.rollout_mismatch > first.rollout_mismatch


def test_micro_batching_does_not_change_the_update(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    whole, split = _backend(tiny_checkpoint, lr=1e-3, micro_batch_size=8), _backend(tiny_checkpoint, lr=1e-3)
    split.config = split.config.model_copy(update={"micro_batch_size": 1})
    a, b = whole.train_step(_batch(rollout_samples)), split.train_step(_batch(rollout_samples))
    assert a.loss == pytest.approx(b.loss, abs=1e-6) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)


def test_trajectory_mean_gives_each_trajectory_equal_weight(rollout_samples: list[TrainingSample]) -> None:
    # Three steps of one trajectory and one step of another, of different token lengths.
    pick = [rollout_samples[i % len(rollout_samples)] for i in range(4)]
    samples = [s.model_copy(update={"trajectory_id": "long"}) for s in pick[:3]]
    samples.append(pick[3].model_copy(update={"trajectory_id": "short"}))
    lengths = [len(s.response_token_ids) for s in samples]
    weights = token_weights(samples, lengths, "trajectory_mean")
    per_traj = {
        "long": sum(w * n for w, n in zip(weights[:3], lengths[:3], strict=True)),
        "short": weights[3] * lengths[3],
    }
    assert per_traj == pytest.approx({"long": 0.5, "short": 0.5})
    token = token_weights(samples, lengths, "token_mean")
    assert sum(w * n for w, n in zip(token, lengths, strict=True)) == pytest.approx(1.0)
    assert token[0] == pytest.approx(1.0 / sum(lengths))


def test_kl_to_the_initial_policy_grows_as_training_moves_away(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    backend = _backend(tiny_checkpoint, lr=1e-3, loss={"kl_coef": 0.1})
    assert backend.ref_model is not None
    first = backend.train_step(_batch(rollout_samples))
    assert first.kl == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    for _ in range(2):
        last = backend.train_step(_batch(rollout_samples))
    assert last.kl is not None and last.kl > 1e-6
    assert _backend(tiny_checkpoint).ref_model is None  # no copy kept without a KL term


def test_checkpoint_resume_restores_weights_optimizer_and_step(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    batch = _batch(rollout_samples)
    trained = _backend(tiny_checkpoint, lr=1e-3)
    trained.train_step(batch)
    save_checkpoint(trained, tmp_path / "step-1", version=4)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"
    resumed = _backend(tiny_checkpoint, lr=1e-3)
    state = load_checkpoint(resumed, tmp_path / "step-1")
    assert state.step == 1 and state.version == 4 and resumed.step == 1
    # Same weights and same Adam moments: the next step is identical on both.
    trained.train_step(batch)
    resumed.train_step(batch)
    for (name, p), q in zip(trained.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    with pytest.raises(CheckpointError):
        load_checkpoint(resumed, tmp_path / "nothing")


def test_bad_samples_are_reported(tiny_checkpoint: Path, rollout_samples: list[TrainingSample]) -> None:
    backend = _backend(tiny_checkpoint)
    sample = rollout_samples[0]
    with pytest.raises(SampleError):
        backend.sample_inputs(sample.model_copy(update={"images": sample.images[:1]}))
    wrong = sample.images[0].model_copy(update={"sha256": "0" * 64})
    with pytest.raises(ImageFetchError):
        backend.sample_inputs(sample.model_copy(update={"images": [wrong, sample.images[1]]}))
