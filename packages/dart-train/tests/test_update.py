"""The shared RL update on a real tiny model: clipping acts with several epochs, importance weights compare
the same (tempered, nucleus) distribution, padding and micro-batching leave the loss alone, a failed
micro-batch applies nothing and an out-of-memory one runs again at half the size."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from dart.policy.loading import load_policy
from dart.policy.prompt import build_prompt
from dart.protocol.messages import Sampling, SamplingParams, TrainingSample
from dart.runtime.store import LocalStore
from dart.train.backend import TorchBackend
from dart.train.batching import ModelInputs, StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.errors import RankFailureError
from dart.train.testing import sample_of, sample_response, store_png
from dart.train.update import Retry, RLUpdate, select_high_entropy

pytestmark = pytest.mark.unit


def _backend(checkpoint: Path, **overrides: object) -> TorchBackend:
    config = TrainerConfig.model_validate({"model_path": str(checkpoint), "num_threads": 2, **overrides})
    return TorchBackend.load(config, image_source=StoreImageSource())


def test_clipping_acts_only_once_the_policy_has_moved(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    one = _backend(tiny_checkpoint, lr=1e-2, grad_clip=None).train_step(rollout_samples)
    assert one.optimizer_steps == 1 and one.clip_fraction == 0.0 and one.ratio_mean == pytest.approx(1.0, abs=1e-6)
    two = _backend(tiny_checkpoint, lr=1e-2, grad_clip=None, ppo_epochs=2).train_step(rollout_samples)
    # The second epoch sees weights one step away from those logp_old came from.
    assert two.optimizer_steps == 2 and two.step == 2
    assert two.clip_fraction > 0.0
    minis = _backend(tiny_checkpoint, lr=1e-2, grad_clip=None, mini_batches=2).train_step(rollout_samples)
    assert minis.optimizer_steps == 2 and minis.ratio_mean != pytest.approx(1.0, abs=1e-6)


def _tempered(checkpoint: Path, store: LocalStore) -> TrainingSample:
    model, processor = load_policy(checkpoint)
    image = Image.new("RGB", (224, 224), (200, 40, 40))
    prompt = build_prompt("Press the red button.", image, [], max_images=1)
    sampling = Sampling(temperature=0.7, top_p=0.9)
    drawn = sample_response(model, processor, prompt, max_new_tokens=16, sampling=sampling, seed=3)
    assert drawn.sampling == SamplingParams(
        temperature=0.7, top_p=0.9, excluded_token_ids=drawn.sampling.excluded_token_ids
    )
    return sample_of(drawn, [store_png(store, "shots/tempered.png", image)], "tempered")


class CountedForward:
    """A backend's real ``forward_logprobs``, counting its passes with and without gradient."""

    def __init__(self, backend: TorchBackend) -> None:
        self.forward, self.calls = backend.forward_logprobs, {True: 0, False: 0}
        backend.forward_logprobs = self  # type: ignore[method-assign]  # test-only count

    def __call__(self, inputs: ModelInputs, **sampling: object) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls[torch.is_grad_enabled()] += 1
        return self.forward(inputs, **sampling)  # type: ignore[arg-type]


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_one_step_batches_take_logp_old_from_the_steps_own_forward_pass(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], kl_coef: float
) -> None:
    overrides = {"lr": 1e-2, "grad_clip": None, "micro_batch_size": 2, "loss": {"kl_coef": kl_coef}}
    one, two = _backend(tiny_checkpoint, **overrides), _backend(tiny_checkpoint, **overrides)
    one_count, two_count = CountedForward(one), CountedForward(two)
    n = len(rollout_samples)
    a = RLUpdate(one, one.config).run(rollout_samples, [one.sample_inputs(s) for s in rollout_samples])
    b = RLUpdate(two, two.config, one_pass=False).run(rollout_samples, [two.sample_inputs(s) for s in rollout_samples])
    # The reference policy's passes (KL) run without gradient in both: the policy's own are what differ.
    refs = n if kl_coef else 0
    assert one_count.calls == {True: n, False: refs} and two_count.calls == {True: n, False: n + refs}
    for key in ("loss", "grad_norm", "ratio_mean", "tis_weight_mean", "rollout_mismatch", "entropy", "kl"):
        x, y = getattr(a, key), getattr(b, key)
        assert (x is None and y is None) or x == pytest.approx(y, rel=1e-5, abs=1e-7), key
    assert a.ratio_mean == pytest.approx(1.0, abs=1e-6) and a.entropy > 0.0 and a.rollout_mismatch < 1e-3
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), name
    # More than one optimizer step over the batch: the separate pass runs before the first.
    CountedForward(again := _backend(tiny_checkpoint, ppo_epochs=2))
    again.train_step(rollout_samples)
    assert again.forward_logprobs.calls == {True: 2 * n, False: n}  # type: ignore[attr-defined]


def test_importance_weight_compares_the_sampled_distribution(tiny_checkpoint: Path, shot_store: LocalStore) -> None:
    sample = _tempered(tiny_checkpoint, shot_store)
    backend = _backend(tiny_checkpoint)
    rollout = torch.tensor(sample.rollout_logprobs)
    matched = float((backend.compute_logprobs([sample])[0] - rollout).abs().max())
    untempered = sample.model_copy(update={"sampling": SamplingParams()})
    ignored = float((backend.compute_logprobs([untempered])[0] - rollout).abs().max())
    print(f"max |trainer - sampler| at T=0.7, top_p=0.9: {matched:.2e}; ignoring the sampling params: {ignored:.2e}")
    assert matched < 1e-4
    assert ignored > 1e-2
    metrics = backend.train_step([sample])
    assert metrics.rollout_mismatch < 1e-4 and metrics.tis_weight_mean == pytest.approx(1.0, abs=1e-3)
    assert metrics.rollout_mismatch_max == pytest.approx(matched, abs=1e-6)
    # One token the rollout got wrong by 0.5 nats: the worst token shows it, the token mean dilutes it.
    wrong = sample.model_copy(
        update={"rollout_logprobs": [sample.rollout_logprobs[0] - 0.5, *sample.rollout_logprobs[1:]]}
    )
    skewed = _backend(tiny_checkpoint).train_step([wrong])
    assert skewed.rollout_mismatch_max == pytest.approx(0.5, abs=1e-3)
    assert skewed.rollout_mismatch < skewed.rollout_mismatch_max or len(sample.rollout_logprobs) == 1


def test_padding_and_micro_batching_leave_loss_and_gradients_unchanged(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    first, long_ = rollout_samples
    # A response prefix is a valid teacher-forced sample of its own: a short row beside a longer one.
    short = first.model_copy(
        update={"response_token_ids": first.response_token_ids[:4], "rollout_logprobs": first.rollout_logprobs[:4]}
    )
    assert len(short.response_token_ids) < len(long_.response_token_ids)
    alone = _backend(tiny_checkpoint, lr=1e-3, micro_batch_size=1, grad_clip=None)
    padded = _backend(tiny_checkpoint, lr=1e-3, micro_batch_size=2, grad_clip=None)
    a, b = alone.train_step([short, long_]), padded.train_step([short, long_])
    assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-7)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for (name, p), q in zip(alone.model.named_parameters(), padded.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), name


def test_high_entropy_selection_in_the_trainer(tiny_checkpoint: Path, rollout_samples: list[TrainingSample]) -> None:
    s = rollout_samples[0]
    samples = [s.model_copy(update={"trajectory_id": t, "step_index": i}) for t, i in (("a", 0), ("a", 1), ("b", 0))]
    entropies = [0.1, 2.0, 0.5]
    assert select_high_entropy(samples, entropies, 1.0) == [0, 1, 2]
    assert select_high_entropy(samples, entropies, 0.5, "batch") == [1, 2]
    assert select_high_entropy(samples, entropies, 0.5, "trajectory") == [1, 2]
    assert select_high_entropy(samples, entropies, 0.01) == [1]  # ceil: at least one
    metrics = _backend(tiny_checkpoint, entropy_top_fraction=0.5).train_step(rollout_samples)
    assert metrics.samples == 2 and metrics.selected_samples == 1


def test_trajectory_mean_weighs_trajectories_equally_over_the_whole_batch_with_mini_batches(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    s = rollout_samples[0]
    # Three steps of a trajectory with advantage +1 and one step of another with -1: the mini-batches
    # ([0, 2] and [1, 3]) hold two and one of the long trajectory's steps.
    samples = [s.model_copy(update={"trajectory_id": "long", "step_index": i, "advantage": 1.0}) for i in range(3)]
    samples.append(s.model_copy(update={"trajectory_id": "short", "step_index": 0, "advantage": -1.0}))
    # A learning rate too small to move the ratio from 1: each step's loss is -sum(weight * advantage).
    metrics = _backend(tiny_checkpoint, lr=1e-9, grad_clip=None, mini_batches=2).train_step(samples)
    assert metrics.optimizer_steps == 2
    # Equal trajectory shares over the batch cancel (+1 and -1); weighting per mini-batch gave the long
    # trajectory 1.5 of the 2 shares (loss -0.5).
    assert metrics.loss == pytest.approx(0.0, abs=1e-3)


def test_samples_with_meaningless_advantages_or_logprobs_are_refused_not_the_batch(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    from dart.train.errors import SampleError

    s = rollout_samples[0]
    n = len(s.rollout_logprobs)
    # An in-process caller skips the wire schema's finiteness check: model_construct does the same.
    bad = [
        s.model_copy(update={"trajectory_id": "huge", "advantage": 1e6}),
        s.model_copy(update={"trajectory_id": "positive", "rollout_logprobs": [0.5] * n}),
        TrainingSample.model_construct(**{**dict(s), "trajectory_id": "nan", "advantage": float("nan")}),
        TrainingSample.model_construct(**{**dict(s), "trajectory_id": "inf", "rollout_logprobs": [-math.inf] * n}),
    ]
    backend = _backend(tiny_checkpoint, lr=1e-3, max_abs_advantage=10.0)
    with pytest.raises(SampleError, match="every sample refused"):
        backend.train_step(bad)
    assert backend.step == 0
    metrics = backend.train_step([*bad, *rollout_samples])
    assert metrics.refused_samples == 4 and metrics.samples == len(rollout_samples) and backend.step == 1
    assert math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm)


def test_ownership_keeps_the_mini_batches_and_each_ranks_share_of_them() -> None:
    """With every sample chosen, the owners' split is exactly the mini-batches chosen[k::m], each dealt round-robin
    over the ranks; with a selection, every chosen sample is in exactly one mini-batch."""
    from dart.train.update import mini_batches, owners_of

    for n in range(1, 21):
        for m in range(1, 6):
            for dp in range(1, 5):
                owners = owners_of(n, m, dp)
                n_mini = min(m, n)
                minis = mini_batches(list(range(n)), owners, n_mini, dp)
                assert minis == [list(range(k, n, n_mini)) for k in range(n_mini)]
                for mini in minis:
                    for rank in range(dp):
                        assert [i for i in mini if owners[i] == rank] == mini[rank::dp]
                chosen = list(range(0, n, 3))
                picked = mini_batches(chosen, owners, min(m, len(chosen)), dp)
                assert sorted(i for part in picked for i in part) == chosen


class FailingForward:
    """A backend's real ``forward_logprobs`` raising ``error`` after its ``at``-th pass with gradient (counted from 1).
    The fault is this test's own: no production switch."""

    def __init__(self, backend: TorchBackend, at: int, error: Exception) -> None:
        self.forward, self.at, self.error, self.calls = backend.forward_logprobs, at, error, 0
        backend.forward_logprobs = self  # type: ignore[method-assign]  # test-only fault

    def __call__(self, inputs: ModelInputs, **sampling: object) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.forward(inputs, **sampling)  # type: ignore[arg-type]
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at:
                raise self.error
        return out


def test_a_failed_micro_batch_applies_nothing_and_out_of_memory_runs_it_again_at_half_the_size(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    # Micro-batch size 1: the first sample's gradients have accumulated when the second sample's forward fails.
    failing = _backend(tiny_checkpoint, lr=1e-3, micro_batch_size=1, grad_clip=None)
    before = {n: p.detach().clone() for n, p in failing.model.named_parameters()}
    FailingForward(failing, 2, RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"))
    with pytest.raises(RankFailureError) as caught:
        failing.train_step(rollout_samples)
    assert (caught.value.reason, caught.value.rank, caught.value.retryable) == ("error", 0, True)
    assert failing.step == 0
    assert all(p.grad is None for p in failing.model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in failing.model.named_parameters())

    # Out of memory at size 2: the mini-batch runs again at size 1 and lands where a run at size 1 does.
    retried = _backend(tiny_checkpoint, lr=1e-3, micro_batch_size=2, grad_clip=None)
    FailingForward(retried, 2, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB"))
    metrics = retried.train_step(rollout_samples)
    assert metrics.micro_batch_size == 1 and metrics.step == 1
    assert metrics.retried == (Retry(rank=0, reason="out_of_memory", from_size=2, to_size=1),)
    plain = _backend(tiny_checkpoint, lr=1e-3, micro_batch_size=1, grad_clip=None)
    reference = plain.train_step(rollout_samples)
    assert metrics.loss == pytest.approx(reference.loss, rel=1e-5, abs=1e-7)
    for (name, p), q in zip(retried.model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), name

    # Out of memory at size 1: nothing smaller to try; the error names the setting, and no redelivery helps.
    never = _backend(tiny_checkpoint, lr=1e-3, micro_batch_size=1, grad_clip=None)
    FailingForward(never, 1, RuntimeError("CUDA error: out of memory"))
    with pytest.raises(
        RankFailureError, match="train.micro_batch_size is 1: one sample's forward and backward do not fit"
    ) as caught:
        never.train_step(rollout_samples)
    assert (caught.value.reason, caught.value.retryable, never.step) == ("out_of_memory", False, 0)
