"""Step-wise GRPO loss with clipped ratios and truncated importance sampling (TIS).

Three policies meet in one update:

- the *rollout* policy that generated the tokens (its log-probs come from the inference engine,
  ``logp_rollout``), possibly several versions behind;
- the *old training* policy, the trainer's weights when the batch was taken (``logp_old``,
  recomputed by the trainer on exactly the rollout's tokens);
- the *current* policy being optimized (``logp``).

The PPO-style ratio ``exp(logp - logp_old)`` is clipped to ``[1 - clip_low, 1 + clip_high]``
(separate bounds, as in DAPO's clip-higher). The mismatch between the rollout engine and the
trainer (different kernels, stale versions) is corrected per token by the truncated importance
weight ``min(exp(logp_old - logp_rollout), tis_cap)``, detached from the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    """Knobs of the GRPO+TIS objective.

    Attributes:
        clip_low: Lower clip range (ratio >= 1 - clip_low).
        clip_high: Upper clip range (ratio <= 1 + clip_high).
        tis_cap: Truncation C of the importance weight; None disables TIS.
        kl_coef: Weight of the k3 KL estimate to a reference policy; 0 disables it.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = 2.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap must be positive, got {self.tis_cap}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each next-token distribution.

    Args:
        logits: ``[..., T, V]`` logits whose position t predicts ``targets[..., t]``.
        targets: ``[..., T]`` token ids.

    Returns:
        ``(logp, entropy)``, both ``[..., T]``, in nats, computed in float32.
    """
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def truncated_is_weight(logp_old: torch.Tensor, logp_rollout: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Per-token TIS weight ``min(exp(logp_old - logp_rollout), cap)``, without gradient."""
    if cap is None:
        return torch.ones_like(logp_old)
    log_ratio = (logp_old - logp_rollout).detach()
    # Clamp in log space first so a huge mismatch cannot overflow exp().
    return torch.exp(torch.clamp(log_ratio, max=torch.log(torch.tensor(cap)).item()))


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    logp_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-mean clipped surrogate loss with TIS (and optional KL), to minimize.

    Args:
        logp: ``[B, T]`` log-probs of the response tokens under the current policy (with grad).
        logp_old: ``[B, T]`` log-probs under the training policy when the batch was taken.
        logp_rollout: ``[B, T]`` log-probs recorded by the rollout engine.
        advantages: ``[B]`` per-sample (per-step) advantages, broadcast over tokens.
        mask: ``[B, T]`` 1 for response tokens that count, 0 for padding / unselected tokens; fractional
            values weight tokens (the loss is the mask-weighted mean).
        config: Clip, TIS and KL settings.
        logp_ref: ``[B, T]`` reference-policy log-probs, required when ``config.kl_coef > 0``.

    Returns:
        ``(loss, metrics)`` where metrics hold the clip fraction, mean TIS weight, fraction of
        truncated weights, mean ratio and (if used) the KL estimate.
    """
    if not (logp.shape == logp_old.shape == logp_rollout.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, "
            f"logp_rollout {tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}"
        )
    mask = mask.to(logp.dtype)
    # The mask may carry fractional per-token weights; an all-zero mask gives a zero loss, not NaN.
    n_tokens = mask.sum().clamp(min=torch.finfo(mask.dtype).tiny)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - logp_old.detach())
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    weight = truncated_is_weight(logp_old, logp_rollout, config.tis_cap)
    loss = -(weight * surrogate * mask).sum() / n_tokens
    metrics = {
        "clip_fraction": float(((unclipped != clipped).to(logp.dtype) * mask).sum() / n_tokens),
        "ratio_mean": float((ratio.detach() * mask).sum() / n_tokens),
        "tis_weight_mean": float((weight * mask).sum() / n_tokens),
        "tis_truncated_fraction": float(
            ((weight < torch.exp(logp_old - logp_rollout).detach()).to(logp.dtype) * mask).sum() / n_tokens
        ),
    }
    if config.kl_coef > 0.0:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs logp_ref")
        # k3 estimator of KL(current || ref): unbiased, always >= 0.
        delta = logp_ref.detach() - logp
        kl = ((torch.exp(delta) - delta - 1.0) * mask).sum() / n_tokens
        loss = loss + config.kl_coef * kl
        metrics["kl"] = float(kl.detach())
    metrics["loss"] = float(loss.detach())
    return loss, metrics
