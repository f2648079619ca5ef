"""Step-wise GRPO loss with clipped ratios and an off-policy correction: TIS or AReaL's decoupled PPO.

Three policies meet in one update:

- the *behaviour* policy that generated the tokens (its log-probs come from the inference engine,
  ``logp_rollout``, under the distribution actually sampled from: temperature, excluded tokens, top-p),
  possibly several versions behind and computed by other kernels;
- the *proximal* (old training) policy, the trainer's weights when the batch was taken (``logp_old``,
  recomputed by the trainer once per batch, before any update, on exactly the rollout's tokens and under
  the same sampling distribution, see :func:`behaviour_logprobs`);
- the *current* policy being optimized (``logp``); with several PPO epochs or mini-batches per batch it
  drifts from the proximal one, so the ratio leaves 1 and clipping acts.

The PPO-style ratio ``exp(logp - logp_old)`` is clipped to ``[1 - clip_low, 1 + clip_high]`` (separate
bounds, as in DAPO's clip-higher). The behaviour/proximal gap is corrected per token by a detached weight
``w = exp(logp_old - logp_rollout)``; the two objectives differ only in what happens to large weights:

- ``tis`` (truncated importance sampling, Yao et al. / verl): ``w`` is truncated to ``min(w, tis_cap)``;
  every token keeps contributing, tokens the engine found much less likely than the trainer does count
  at most ``tis_cap`` times.
- ``decoupled`` (AReaL's decoupled PPO, ``use_decoupled_loss`` with ``behav_imp_weight_cap``): tokens whose
  ``w`` exceeds ``behav_cap`` are *dropped* from the loss (weight 0, still counted in the denominator, as
  AReaL counts its loss mask), the others keep their full ``w``. The proximal policy is the trust region's
  centre and is independent of the behaviour policy, so very stale tokens (large gaps) are filtered out
  rather than kept with a biased weight. With ``behav_cap=None`` nothing is dropped and ``w`` is used
  untruncated.

Both coincide when the behaviour and proximal policies agree (``w = 1``). Losses are weighted *sums*:
the caller gives each token its weight (the batch's aggregation), so padding and micro-batching do not
change the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from dart.train.config import LossConfig


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each next-token distribution (temperature 1).

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


def behaviour_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    excluded_token_ids: Sequence[int] = (),
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` under the sampling distribution, and the raw entropy of each position.

    The distribution is the one :class:`~dart.protocol.messages.SamplingParams` describes:
    ``softmax(logits / temperature)`` with ``excluded_token_ids`` masked, then the smallest set of most
    likely tokens whose mass reaches ``top_p`` (a token is kept when the mass of the tokens ranked above it
    is below ``top_p``; ties broken by the sort), renormalized. ``temperature == 0`` (greedy) gives the
    temperature-1 log-probs with ``excluded_token_ids`` masked and no nucleus: the distribution the
    engines take their argmax over, and the log-probs they record for it.

    Nucleus boundary: the nucleus is chosen on *these* logits, without gradient, and the target token is
    always kept in it. A token the engine sampled from inside its nucleus can fall just outside the
    trainer's when the two computations differ by rounding (or the policy moved); keeping it gives a
    finite log-prob (its mass renormalized over the nucleus plus itself) instead of ``-inf``, so the
    importance weight stays bounded and gradients stay finite. Gradients flow through the logits of the
    kept tokens only, like a softmax restricted to the nucleus.

    Args:
        logits: ``[T, V]`` (or ``[..., T, V]``) logits; position t predicts ``targets[..., t]``.
        targets: ``[..., T]`` token ids.
        temperature: Sampling temperature, >= 0.
        excluded_token_ids: Ids that could never be sampled.
        top_p: Nucleus mass in (0, 1].

    Returns:
        ``(logp, entropy)``, both ``[..., T]`` float32; the entropy is that of the raw (temperature 1,
        unmasked) distribution, the figure high-entropy step selection ranks by.
    """
    raw = logits.float()
    logp_raw = torch.log_softmax(raw, dim=-1)
    entropy = -(logp_raw.exp() * logp_raw).sum(-1)
    if temperature == 0.0:
        temperature, top_p = 1.0, 1.0
    if temperature == 1.0 and not excluded_token_ids and top_p >= 1.0:
        return logp_raw.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy
    scaled = raw / temperature
    if excluded_token_ids:
        scaled = scaled.index_fill(-1, torch.tensor(list(excluded_token_ids), device=scaled.device), -torch.inf)
    if top_p < 1.0:
        with torch.no_grad():
            probs = torch.softmax(scaled, dim=-1)
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
            keep.scatter_(-1, targets.unsqueeze(-1), True)
        scaled = scaled.masked_fill(~keep, -torch.inf)
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, entropy


def truncated_is_weight(logp_old: torch.Tensor, logp_rollout: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Per-token TIS weight ``min(exp(logp_old - logp_rollout), cap)``, without gradient."""
    if cap is None:
        return torch.ones_like(logp_old)
    log_ratio = (logp_old - logp_rollout).detach()
    # Clamp in log space first so a huge mismatch cannot overflow exp().
    return torch.exp(torch.clamp(log_ratio, max=torch.log(torch.tensor(cap)).item()))


def decoupled_weight(logp_prox: torch.Tensor, logp_behav: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Per-token behaviour weight of decoupled PPO: ``exp(logp_prox - logp_behav)``, 0 where it exceeds ``cap``."""
    log_ratio = (logp_prox - logp_behav).detach()
    if cap is None:
        return torch.exp(log_ratio)
    over = log_ratio > torch.log(torch.tensor(cap)).item()
    # exp() of a masked-out huge ratio would overflow before the where: clamp it first.
    return torch.where(over, torch.zeros_like(log_ratio), torch.exp(log_ratio.clamp(max=88.0)))


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    logp_ref: torch.Tensor | None = None,
    *,
    reduction: Literal["mean", "sum"] = "mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate loss with the off-policy correction (and optional KL), to minimize.

    Args:
        logp: ``[B, T]`` log-probs of the response tokens under the current policy (with grad).
        logp_old: ``[B, T]`` log-probs under the proximal (training) policy when the batch was taken.
        logp_rollout: ``[B, T]`` behaviour log-probs recorded by the rollout engine.
        advantages: ``[B]`` per-sample (per-step) advantages, broadcast over tokens.
        mask: ``[B, T]`` 1 for response tokens that count, 0 for padding / unselected tokens; fractional
            values weight tokens.
        config: Clip, correction and KL settings.
        logp_ref: ``[B, T]`` reference-policy log-probs, required when ``config.kl_coef > 0``.
        reduction: ``mean`` divides by the mask's sum (the mask-weighted mean); ``sum`` returns the
            mask-weighted sum, and every metric as a mask-weighted sum too (callers that give tokens
            weights summing to 1 over a batch add micro-batch results up).

    Returns:
        ``(loss, metrics)`` where metrics hold the clip fraction, mean correction weight, fraction of
        truncated (``tis``) or dropped (``decoupled``) tokens, mean ratio and (if used) the KL estimate.
    """
    if not (logp.shape == logp_old.shape == logp_rollout.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, "
            f"logp_rollout {tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}"
        )
    mask = mask.to(logp.dtype)
    if reduction == "mean":
        # An all-zero mask gives a zero loss, not NaN.
        denom = mask.sum().clamp(min=torch.finfo(mask.dtype).tiny)
    else:
        denom = torch.ones((), dtype=logp.dtype, device=logp.device)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - logp_old.detach())
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    if config.objective == "decoupled":
        weight = decoupled_weight(logp_old, logp_rollout, config.behav_cap)
        limited = (weight == 0.0) & (logp_old - logp_rollout > 0)
    else:
        weight = truncated_is_weight(logp_old, logp_rollout, config.tis_cap)
        limited = weight < torch.exp(logp_old - logp_rollout).detach()
    loss = -(weight * surrogate * mask).sum() / denom
    metrics = {
        # Clipped only where the min picked the clipped term (the token gets no gradient): a ratio past a
        # bound on the side the advantage does not push towards is not clipped.
        "clip_fraction": float(((clipped < unclipped).to(logp.dtype) * mask).sum() / denom),
        "ratio_mean": float((ratio.detach() * mask).sum() / denom),
        "tis_weight_mean": float((weight * mask).sum() / denom),
        "tis_truncated_fraction": float((limited.to(logp.dtype) * mask).sum() / denom),
    }
    if config.kl_coef > 0.0:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs logp_ref")
        # k3 estimator of KL(current || ref): unbiased, always >= 0.
        delta = logp_ref.detach() - logp
        kl = ((torch.exp(delta) - delta - 1.0) * mask).sum() / denom
        loss = loss + config.kl_coef * kl
        metrics["kl"] = float(kl.detach())
    metrics["loss"] = float(loss.detach())
    return loss, metrics
