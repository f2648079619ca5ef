"""Supervised warm start: maximize the likelihood of demonstrated responses before RL.

Demonstrations are pre-tokenized (``prompt_token_ids`` exactly as the rollout prompt builder encodes
them, the oracle's response tokens, the prompt's screenshots), so this module depends on no prompt
format. The loss is the token-mean negative log-likelihood of the response tokens over the batch.

Usage::

    for epoch in range(3):
        metrics = sft_step(backend, demos)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image

from dart.train.backend import TorchBackend


@dataclass(frozen=True)
class SftSample:
    """One demonstration step.

    Attributes:
        prompt_token_ids: Prompt tokens, image pads expanded (as the rollout engine would consume them).
        response_token_ids: Target response tokens, ending with the end-of-turn token.
        images: The prompt's images in placeholder order, as fed (``ChatPrompt.images``: already resized).
    """

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    images: list[Image.Image] = field(default_factory=list)


@dataclass(frozen=True)
class SftMetrics:
    """What one SFT optimizer step did.

    Attributes:
        step: Optimizer steps so far, this one included.
        loss: Token-mean NLL of the response tokens before the update, nats.
        tokens: Response tokens.
        grad_norm: Global gradient norm before clipping.
        duration_s: Wall time, seconds.
    """

    step: int
    loss: float
    tokens: int
    grad_norm: float
    duration_s: float


def sft_step(backend: TorchBackend, samples: Sequence[SftSample]) -> SftMetrics:
    """One optimizer step on the token-mean NLL of ``samples``, in micro-batches of ``config.micro_batch_size`` (each
    one packed forward pass under ``config.packing``).

    Raises:
        ValueError: No samples.
        SampleError: A sample's image pads and images disagree.
    """
    if not samples:
        raise ValueError("sft_step needs at least one sample")
    started = time.perf_counter()
    inputs = [backend.raw_inputs(s.prompt_token_ids, s.response_token_ids, s.images) for s in samples]
    total = sum(x.response_len for x in inputs)
    backend.optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    mbs = backend.config.micro_batch_size
    for lo in range(0, len(inputs), mbs):
        # Summed NLL / batch tokens: micro-batches add up to the batch's token mean.
        rows = inputs[lo : lo + mbs]  # one packed forward pass under train.packing, else one per row
        nll = sum(-logp.sum() for logp, _ in backend.forward_logprobs_many(rows, [{}] * len(rows))) / total
        nll.backward()  # type: ignore[union-attr]  # a sum of tensors is a tensor
        loss_sum += float(nll.detach())  # type: ignore[union-attr]
    grad_norm = backend.clip_and_step()
    return SftMetrics(
        step=backend.step, loss=loss_sum, tokens=total, grad_norm=grad_norm, duration_s=time.perf_counter() - started
    )
