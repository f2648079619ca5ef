from __future__ import annotations

import math

import pytest
import torch

from dart.train.loss import LossConfig, behaviour_logprobs, grpo_loss, token_logprobs, truncated_is_weight

pytestmark = pytest.mark.unit


def test_token_logprobs_and_entropy_match_definitions() -> None:
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    logp, ent = token_logprobs(logits, torch.tensor([[0, 0]]))
    assert logp[0].tolist() == pytest.approx([math.log(0.5), math.log(0.75)])
    assert ent[0].tolist() == pytest.approx([math.log(2.0), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))])


def test_entropy_of_one_hot_is_zero() -> None:
    _, ent = token_logprobs(torch.tensor([[[100.0, -100.0, -100.0]]]), torch.tensor([[0]]))
    assert float(ent) == pytest.approx(0.0, abs=1e-6)


def test_tis_weight_truncates_and_is_detached() -> None:
    old = torch.tensor([0.0, -1.0, -5.0], requires_grad=True)
    rollout = torch.tensor([-1.0, -1.0, 0.0])
    w = truncated_is_weight(old, rollout, cap=2.0)
    assert w.tolist() == pytest.approx([2.0, 1.0, math.exp(-5.0)])
    assert not w.requires_grad
    assert truncated_is_weight(old, rollout, None).tolist() == [1.0, 1.0, 1.0]
    # No overflow for an absurd mismatch.
    assert float(truncated_is_weight(torch.tensor([500.0]), torch.tensor([-500.0]), 3.0)) == pytest.approx(3.0)


def _loss(
    ratio: float, adv: float, cfg: LossConfig, rollout_shift: float = 0.0
) -> tuple[float, float, dict[str, float]]:
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).clone().requires_grad_(True)
    loss, metrics = grpo_loss(logp, old, old - rollout_shift, torch.tensor([adv]), torch.ones(1, 1), cfg)
    loss.backward()
    assert logp.grad is not None
    return loss.item(), float(logp.grad), metrics


def test_clip_bounds_are_separate_and_stop_gradient() -> None:
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=None)
    # Positive advantage: ratio above 1 + clip_high is clipped (no gradient), below it is not.
    loss, grad, m = _loss(1.5, 1.0, cfg)
    assert loss == pytest.approx(-1.28) and grad == 0.0 and m["clip_fraction"] == 1.0
    loss, grad, _ = _loss(1.2, 1.0, cfg)
    assert loss == pytest.approx(-1.2) and grad == pytest.approx(-1.2)
    # Negative advantage: ratio below 1 - clip_low is clipped, above 1 + clip_high is not.
    loss, grad, _ = _loss(0.5, -1.0, cfg)
    assert loss == pytest.approx(0.8) and grad == 0.0
    loss, grad, _ = _loss(1.5, -1.0, cfg)
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5)


def test_clip_fraction_counts_only_tokens_where_the_clipped_term_is_chosen() -> None:
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=None)
    # (ratio, advantage) -> whether the min picks the clipped term (and the token loses its gradient).
    cases = {(1.5, 1.0): 1.0, (0.5, -1.0): 1.0, (0.5, 1.0): 0.0, (1.5, -1.0): 0.0, (1.1, 1.0): 0.0}
    for (ratio, adv), expected in cases.items():
        _, grad, m = _loss(ratio, adv, cfg)
        assert m["clip_fraction"] == expected, (ratio, adv)
        assert (grad == 0.0) == (expected == 1.0)


def test_tis_weight_scales_the_loss() -> None:
    cfg = LossConfig(tis_cap=2.0)
    base, _, _ = _loss(1.0, 1.0, LossConfig(tis_cap=None))
    # The trainer's policy likes the token more than the rollout engine did: weight e^0.5.
    weighted, _, m = _loss(1.0, 1.0, cfg, rollout_shift=0.5)
    assert weighted == pytest.approx(base * math.exp(0.5))
    assert m["tis_truncated_fraction"] == 0.0
    capped, _, m = _loss(1.0, 1.0, cfg, rollout_shift=3.0)
    assert capped == pytest.approx(base * 2.0)
    assert m["tis_truncated_fraction"] == 1.0


def test_mask_excludes_tokens_and_token_mean() -> None:
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), adv, mask, LossConfig())
    assert loss.item() == pytest.approx(-(1 + 1 - 1) / 3)
    loss.backward()
    assert logp.grad is not None and logp.grad[:, 2].abs().sum() == 0.0


def test_fractional_mask_is_a_weighted_mean_and_empty_mask_is_zero() -> None:
    logp = torch.zeros(2, 1, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    weights = torch.tensor([[0.3], [0.1]])
    loss, m = grpo_loss(logp, logp.detach(), logp.detach(), adv, weights, LossConfig())
    assert loss.item() == pytest.approx(-(0.3 - 0.1) / 0.4)
    assert m["ratio_mean"] == pytest.approx(1.0)
    empty, _ = grpo_loss(logp, logp.detach(), logp.detach(), adv, torch.zeros(2, 1), LossConfig())
    assert empty.item() == 0.0


def test_kl_penalty_is_zero_at_reference_and_positive_away() -> None:
    logp = torch.full((1, 2), -1.0, requires_grad=True)
    cfg = LossConfig(kl_coef=0.1)
    _, m = grpo_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), torch.ones(1, 2), cfg, logp_ref=logp.detach())
    assert m["kl"] == pytest.approx(0.0)
    _, m = grpo_loss(
        logp, logp.detach(), logp.detach(), torch.zeros(1), torch.ones(1, 2), cfg, logp_ref=logp.detach() - 1
    )
    assert m["kl"] > 0.0
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(logp, logp, logp, torch.zeros(1), torch.ones(1, 2), cfg)


def test_bad_config_and_shapes() -> None:
    with pytest.raises(ValueError, match="clip_low"):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 2), LossConfig()
        )


def test_gradient_pushes_up_positive_advantage_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    targets = torch.randint(0, 7, (4, 5))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    opt = torch.optim.SGD([logits], lr=0.5)
    before, _ = token_logprobs(logits.detach(), targets)
    for _ in range(5):
        logp, _ = token_logprobs(logits, targets)
        loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), adv, torch.ones(4, 5), LossConfig())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after, _ = token_logprobs(logits.detach(), targets)
    delta = (after - before).mean(-1)
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0 and delta[3] < 0


def test_decoupled_drops_tokens_over_the_behaviour_cap_instead_of_truncating() -> None:
    cfg = LossConfig(objective="decoupled", behav_cap=2.0)
    base, _, _ = _loss(1.0, 1.0, LossConfig(tis_cap=None))
    weighted, _, m = _loss(1.0, 1.0, cfg, rollout_shift=0.5)  # weight e^0.5 < cap: kept whole
    assert weighted == pytest.approx(base * math.exp(0.5)) and m["tis_truncated_fraction"] == 0.0
    dropped, grad, m = _loss(1.0, 1.0, cfg, rollout_shift=3.0)  # weight e^3 > cap: dropped, not capped
    assert dropped == 0.0 and grad == 0.0 and m["tis_truncated_fraction"] == 1.0
    tis, _, _ = _loss(1.0, 1.0, LossConfig(tis_cap=2.0), rollout_shift=3.0)
    assert tis == pytest.approx(base * 2.0)
    with pytest.raises(ValueError, match="behav_cap"):
        LossConfig(objective="decoupled", behav_cap=0.5)


def test_behaviour_logprobs_temperature_exclusions_and_nucleus() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    target = torch.tensor([1])
    raw, ent = behaviour_logprobs(logits, target)
    assert float(raw) == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))
    tempered, ent_t = behaviour_logprobs(logits, target, temperature=0.5)
    assert float(tempered) == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[0, 1]))
    assert float(ent_t) == pytest.approx(float(ent))  # entropy is always the raw distribution's
    excluded, _ = behaviour_logprobs(logits, target, excluded_token_ids=[0])
    assert float(excluded) == pytest.approx(float(torch.log_softmax(logits[:, 1:], -1)[0, 0]))
    # p = [.64, .24, .09, .03]: top_p 0.8 keeps tokens 0 and 1 (0 alone has .64 < .8).
    nucleus, _ = behaviour_logprobs(logits, target, top_p=0.8)
    assert float(nucleus) == pytest.approx(float(torch.log_softmax(logits[:, :2], -1)[0, 1]))
    # A target just outside the nucleus is kept with it (finite log-prob), not -inf.
    outside, _ = behaviour_logprobs(logits, torch.tensor([2]), top_p=0.8)
    assert float(outside) == pytest.approx(float(torch.log_softmax(logits[:, :3], -1)[0, 2]))
    assert float(behaviour_logprobs(logits, target, temperature=0.0)[0]) == pytest.approx(float(raw))
    # Greedy takes its argmax over the allowed tokens: temperature 1, exclusions masked, no nucleus (as
    # both engines record it; vLLM's processed log-probs apply its bad-words mask at temperature 0 too).
    greedy, _ = behaviour_logprobs(logits, target, temperature=0.0, excluded_token_ids=[0], top_p=0.5)
    assert float(greedy) == pytest.approx(float(excluded))


def test_sum_reduction_is_invariant_to_padding() -> None:
    cfg = LossConfig()
    short = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    alone, _ = grpo_loss(
        short, short.detach() + 0.1, short.detach(), torch.tensor([1.0]), torch.ones(1, 2), cfg, reduction="sum"
    )
    alone.backward()
    assert short.grad is not None
    g_alone = short.grad.clone()
    padded_rows = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.7, -0.9]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    padded, _ = grpo_loss(
        padded_rows,
        padded_rows.detach() + 0.1,
        padded_rows.detach(),
        torch.tensor([1.0, -1.0]),
        mask,
        cfg,
        reduction="sum",
    )
    padded.backward()
    assert padded.item() == alone.item()
    assert padded_rows.grad is not None and torch.equal(padded_rows.grad[0, :2], g_alone[0])


def test_backend_settings_are_kind_discriminated() -> None:
    from pydantic import ValidationError

    from dart.train.config import TrainerConfig

    assert TrainerConfig().backend.kind == "torch" and TrainerConfig().backend.world_size == 1
    fsdp = TrainerConfig.model_validate({"backend": "fsdp"}).backend
    assert fsdp.kind == "fsdp" and fsdp.world_size == 1
    assert TrainerConfig.model_validate({"backend": {"kind": "fsdp", "nproc": 2}}).backend.world_size == 2
    tp = TrainerConfig.model_validate({"backend": {"kind": "megatron", "tensor_parallel_size": 2}}).backend
    assert tp.world_size == 2
    with pytest.raises(ValidationError):
        TrainerConfig.model_validate({"backend": {"kind": "torch", "nproc": 2}})  # an fsdp option on torch
    with pytest.raises(ValidationError):
        TrainerConfig.model_validate({"loss": {"objective": "decoupled", "behav_cap": 1.0}})
