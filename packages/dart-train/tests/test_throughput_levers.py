"""The trainer's throughput levers change nothing but speed and memory, on real tiny models: packed rows give
each sample its own log-probs, entropies and gradients (Qwen2.5-VL and Qwen3-VL, images of different sizes and
text-only rows side by side); a packed update (its separate logp_old and KL-reference passes packed too) ends
where the unpacked one does; activation checkpointing recomputes every decoder layer and leaves the update
unchanged (full weights and LoRA); the for-loop, foreach and fused AdamW kernels agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from dart.policy.prompt import HistoryStep, build_prompt, encode_prompt
from dart.policy.tiny import write_tiny_checkpoint
from dart.policy.tiny_spec import TinyModelSpec
from dart.protocol.messages import TrainingSample
from dart.train.backend import TorchBackend
from dart.train.batching import ModelInputs, StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.sft import SftSample, sft_step
from dart.train.testing import OpCount

pytestmark = pytest.mark.unit

TOLERANCE = 1e-5


def _backend(checkpoint: Path, **overrides: Any) -> TorchBackend:
    config = TrainerConfig.model_validate({"model_path": str(checkpoint), "num_threads": 2, **overrides})
    return TorchBackend.load(config, image_source=StoreImageSource())


def _prompts(backend: TorchBackend) -> list[tuple[list[int], list[int], list[Image.Image]]]:
    """(prompt ids, response ids, images as fed) of rows of different lengths: two screenshots (of two sizes),
    text only, one small screenshot."""
    pad = int(backend.model.config.image_token_id)
    text = [t for t in range(10, 200) if t != pad]
    out = []
    for i, (size, history) in enumerate([((300, 200), True), (None, False), ((120, 90), False)]):
        response = text[20 + i : 23 + 3 * i]
        if size is None:
            out.append((text[:17], response, []))
            continue
        screen = Image.new("RGB", size, (40 * i, 120, 200))
        screen.putpixel((3, 3), (255, 0, 0))
        steps = [HistoryStep("Action: wait()", Image.new("RGB", (224, 224), (9, 9, 9)))] if history else []
        prompt = build_prompt(f"Click the OK button {i}.", screen, steps, max_images=2)
        out.append((encode_prompt(backend.processor, prompt).input_ids, response, list(prompt.images)))
    return out


def _rows(backend: TorchBackend) -> list[ModelInputs]:
    return [backend.raw_inputs(prompt, response, images) for prompt, response, images in _prompts(backend)]


def assert_same_update(model: Any, other: Any, initial: Any, rel: float = 1e-3) -> None:
    """Every trained tensor of ``other`` is where ``model``'s is, within ``rel`` of how far it moved from ``initial``.
    Adam moves a weight by about lr * sign(gradient), so float noise on a near-zero gradient can flip one entry's
    step: updates are compared per tensor as a whole, not entry by entry."""
    moved = 0.0
    for (name, p), q, p0 in zip(model.named_parameters(), other.parameters(), initial.parameters(), strict=True):
        if p.requires_grad:
            step = float((p - p0).detach().norm())
            assert float((q - p).detach().norm()) <= rel * step, name
            moved = max(moved, step)
    assert moved > 1e-3  # the updates did move the weights


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3") / "ckpt"
    write_tiny_checkpoint(path, seed=3, spec=TinyModelSpec(family="qwen3-vl"))
    return path


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_packed_rows_give_each_sample_its_own_logprobs_and_gradients(
    tiny_checkpoint: Path, qwen3_checkpoint: Path, family: str
) -> None:
    checkpoint = tiny_checkpoint if family == "qwen2.5-vl" else qwen3_checkpoint
    backend = _backend(checkpoint, packing=True)
    rows = _rows(backend)
    assert len({int(r.input_ids.shape[1]) for r in rows}) == len(rows)  # no two rows alike in length
    samplings: list[dict[str, Any]] = [{"temperature": 0.7, "top_p": 0.9}, {}, {"temperature": 1.3}]

    def run(pack: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        backend.model.zero_grad(set_to_none=True)
        backend.config = backend.config.model_copy(update={"packing": pack})
        outs = backend.forward_logprobs_many(rows, samplings)
        sum((logp * (i + 1)).sum() - 0.1 * ent.sum() for i, (logp, ent) in enumerate(outs)).backward()  # type: ignore[misc]
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
        return [(logp.detach(), ent.detach()) for logp, ent in outs], grads

    forwards: list[int] = []
    hook = backend.model.model.language_model.register_forward_hook(lambda *_: forwards.append(1))
    packed, packed_grads = run(True)
    assert len(forwards) == 1  # one forward pass for the three rows
    unpacked, grads = run(False)
    hook.remove()
    assert len(forwards) == 1 + len(rows)
    for (logp, ent), (ref_logp, ref_ent), row in zip(packed, unpacked, rows, strict=True):
        assert logp.shape == ref_logp.shape == (row.response_len,)
        assert torch.allclose(logp, ref_logp, rtol=0, atol=TOLERANCE), (logp - ref_logp).abs().max()
        assert torch.allclose(ent, ref_ent, rtol=0, atol=TOLERANCE), (ent - ref_ent).abs().max()
    assert set(packed_grads) == set(grads) and any("visual" in n for n in grads)
    for name, grad in grads.items():
        gap = float((packed_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12))
        assert gap < TOLERANCE, (name, gap)


def _text_samples(backend: TorchBackend, lengths: list[tuple[int, int]]) -> list[TrainingSample]:
    pad = int(backend.model.config.image_token_id)
    text = [t for t in range(10, 300) if t != pad]
    return [
        TrainingSample(
            trajectory_id=f"x{i}",
            step_index=0,
            group_id="g",
            task_id="t",
            advantage=0.5 if i % 2 else -1.0,
            reward=float(i % 2),
            policy_version=0,
            prompt_token_ids=text[i : i + prompt],
            response_token_ids=text[50 + i : 50 + i + response],
            rollout_logprobs=[-2.0] * response,
        )
        for i, (prompt, response) in enumerate(lengths)
    ]


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8}], ids=["full", "lora"])
def test_a_packed_update_ends_where_the_unpacked_one_does(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], lora: dict[str, Any] | None
) -> None:
    # Two epochs: logp_old and the KL reference come from their own passes (packed 3 at a time), then two steps.
    settings: dict[str, Any] = {"lr": 1e-2, "grad_clip": None, "ppo_epochs": 2, "micro_batch_size": 2}
    settings |= {"loss": {"kl_coef": 0.1}, "lora": lora}
    plain = _backend(tiny_checkpoint, **settings)
    packed = _backend(tiny_checkpoint, packing=True, logprob_micro_batch_size=3, **settings)
    samples = [*rollout_samples, *_text_samples(plain, [(9, 4), (31, 2), (5, 7)])]
    a = plain.train_step(samples)
    b = packed.train_step(samples)
    assert a.optimizer_steps == b.optimizer_steps == 2 and a.clip_fraction > 0.0
    for key in ("loss", "grad_norm", "ratio_mean", "clip_fraction", "rollout_mismatch", "entropy", "kl"):
        assert getattr(b, key) == pytest.approx(getattr(a, key), rel=1e-4, abs=1e-6), key
    assert_same_update(plain.model, packed.model, _backend(tiny_checkpoint, **settings).model)


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8}], ids=["full", "lora"])
def test_activation_checkpointing_recomputes_each_layer_and_changes_no_update(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], lora: dict[str, Any] | None
) -> None:
    settings: dict[str, Any] = {"lr": 1e-2, "grad_clip": None, "micro_batch_size": 2, "lora": lora}
    plain = _backend(tiny_checkpoint, **settings)
    saving = _backend(tiny_checkpoint, activation_checkpointing=True, **settings)
    with OpCount() as plain_ops:
        a = plain.train_step(rollout_samples)
    with OpCount() as saving_ops:
        b = saving.train_step(rollout_samples)
    # Checkpointed, every decoder layer and vision block runs its forward again in the backward pass: each of their
    # activations (SiLU, in every one of them, and nowhere else) is computed twice.
    assert plain_ops.calls["silu"] > 0 and saving_ops.calls["silu"] == 2 * plain_ops.calls["silu"]
    assert b.loss == pytest.approx(a.loss, rel=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    for (name, p), q in zip(plain.model.named_parameters(), saving.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), name


def test_the_adamw_kernels_agree(tiny_checkpoint: Path, rollout_samples: list[TrainingSample]) -> None:
    backends = {
        impl: _backend(tiny_checkpoint, lr=1e-2, optimizer_impl=impl) for impl in ("for_loop", "foreach", "fused")
    }
    assert backends["fused"].optimizer.defaults["fused"] is True
    assert backends["foreach"].optimizer.defaults["foreach"] is True
    assert backends["for_loop"].optimizer.defaults["foreach"] is False
    for backend in backends.values():
        for _ in range(2):
            backend.train_step(rollout_samples)
    initial = _backend(tiny_checkpoint).model
    for impl in ("foreach", "fused"):
        assert_same_update(backends["for_loop"].model, backends[impl].model, initial)


def test_an_out_of_memory_logp_old_pass_runs_again_at_half_the_size(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    settings: dict[str, Any] = {"lr": 1e-2, "grad_clip": None, "ppo_epochs": 2, "packing": True}
    backend = _backend(tiny_checkpoint, logprob_micro_batch_size=4, **settings)
    samples = [*rollout_samples, *_text_samples(backend, [(9, 4), (31, 2)])]
    real, sizes = backend.forward_logprobs_many, []

    def failing(rows: list[ModelInputs], samplings: list[dict[str, Any]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # A test-only fault: the pass without gradient does not fit above 2 samples.
        if not torch.is_grad_enabled():
            sizes.append(len(rows))
            if len(rows) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.10 GiB")
        return real(rows, samplings)

    backend.forward_logprobs_many = failing  # type: ignore[method-assign]
    metrics = backend.train_step(samples)
    assert sizes == [4, 2, 2]
    reference = _backend(tiny_checkpoint, logprob_micro_batch_size=2, **settings).train_step(samples)
    for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
        assert getattr(metrics, key) == pytest.approx(getattr(reference, key), rel=1e-6), key


def test_a_packed_warm_start_step_equals_the_unpacked_one(tiny_checkpoint: Path) -> None:
    plain = _backend(tiny_checkpoint, lr=1e-2, micro_batch_size=3)
    packed = _backend(tiny_checkpoint, lr=1e-2, micro_batch_size=3, packing=True)
    demos = [SftSample(prompt, response, images) for prompt, response, images in _prompts(plain)]
    a, b = sft_step(plain, demos), sft_step(packed, demos)
    assert b.loss == pytest.approx(a.loss, rel=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    assert_same_update(plain.model, packed.model, _backend(tiny_checkpoint).model)
