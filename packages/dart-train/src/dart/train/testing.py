"""Helpers for tests that feed a policy's output to a trainer: a screenshot stored as the rollout stores it, a
response drawn from a checkpoint token by token (the trainer's tests' own rollout, no engine), a training sample
made of one generation, as the data manager would batch it, and a count of the operators a computation ran."""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from dart.policy.models import BANNED_TOKENS, STOP_TOKENS
from dart.policy.prompt import ChatPrompt, encode_prompt
from dart.protocol.messages import ImageRef, Sampling, SamplingParams, TrainingSample
from dart.train.loss import behaviour_logprobs

if TYPE_CHECKING:
    from dart.runtime.store import ArtifactStore


class Generation(Protocol):
    """What a one-step sample is made of: an engine's result, or :class:`Sampled`."""

    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def response_token_ids(self) -> list[int]: ...
    @property
    def response_logprobs(self) -> list[float]: ...
    @property
    def sampling(self) -> SamplingParams: ...


@dataclass(frozen=True)
class Sampled:
    """A response drawn by :func:`sample_response`, recorded as an engine records one."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    sampling: SamplingParams


def sample_response(
    model: Any, processor: Any, prompt: ChatPrompt, *, max_new_tokens: int, sampling: Sampling, seed: int
) -> Sampled:
    """A response drawn from ``model`` one token at a time (a full forward pass each, no cache), the chat's
    vision and turn tokens never sampled and its end-of-turn tokens ending it, as the engines do; each token's
    log-prob is the one :func:`~dart.train.loss.behaviour_logprobs` gives under the recorded distribution."""
    tokenizer = processor.tokenizer
    params = SamplingParams.drawn(sampling, [tokenizer.convert_tokens_to_ids(t) for t in BANNED_TOKENS])
    stops = {tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS}
    encoded = encode_prompt(processor, prompt)
    generator = torch.Generator().manual_seed(seed)
    response: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(**encoded.forward_inputs(response)).logits[0, -1].float()
            masked = logits.index_fill(0, torch.tensor(params.excluded_token_ids, dtype=torch.long), -torch.inf)
            if params.temperature == 0.0:
                token = int(torch.argmax(masked))
            else:
                probs = _nucleus(torch.softmax(masked / params.temperature, dim=-1), params.top_p)
                token = int(torch.multinomial(probs, 1, generator=generator))
            logp, _ = behaviour_logprobs(
                logits[None],
                torch.tensor([token]),
                temperature=params.temperature,
                excluded_token_ids=params.excluded_token_ids,
                top_p=params.top_p,
            )
            response.append(token)
            logprobs.append(float(logp[0]))
            if token in stops:
                break
    return Sampled(list(encoded.input_ids), response, logprobs, params)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` restricted to the smallest set of most likely tokens whose mass reaches ``top_p``."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return probs * keep


def store_png(store: ArtifactStore, key: str, image: Image.Image) -> ImageRef:
    """``image`` written to ``store`` under ``key`` as PNG, and the reference a step records for it."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    info = store.put(key, buf.getvalue(), content_type="image/png")
    assert info.sha256 is not None
    return ImageRef(uri=info.uri, sha256=info.sha256, width=image.width, height=image.height)


def sample_of(result: Generation, images: list[ImageRef], trajectory_id: str = "t") -> TrainingSample:
    """A one-step training sample (advantage 1, version 0) of a generation ``result`` on a prompt with ``images``."""
    return TrainingSample(
        trajectory_id=trajectory_id,
        step_index=0,
        group_id="g",
        task_id="task",
        advantage=1.0,
        reward=1.0,
        policy_version=0,
        prompt_token_ids=result.prompt_token_ids,
        response_token_ids=result.response_token_ids,
        rollout_logprobs=result.response_logprobs,
        sampling=result.sampling,
        images=images,
    )


class OpCount(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's dispatch mode is unannotated
    """Counts the aten operators run while it is active, by name (``with OpCount() as ops: ...; ops.calls["silu"]``):
    what a test checks that a computation ran, or ran again."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's dispatch mode is unannotated
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
