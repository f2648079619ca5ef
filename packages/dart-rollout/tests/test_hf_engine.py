"""The hf engine: batching, aligned token arrays, exact log-prob recomputation, weight updates."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from dart.policy.prompt import ChatPrompt, HistoryStep, build_prompt, encode_prompt
from dart.protocol.messages import Sampling
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import EngineState, GenerationRequest
from dart.rollout.errors import WeightUpdateError

pytestmark = pytest.mark.unit

# float32 on CPU: batched, left-padded, KV-cached decoding vs one unpadded forward pass agree to ~1e-6.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture
async def engine(checkpoint: Path) -> AsyncIterator[HFEngine]:
    engine = await HFEngine.start(HFEngineConfig(model_path=str(checkpoint), batch_wait_s=0.05, num_threads=2))
    try:
        yield engine
    finally:
        await engine.close()


def _prompts(n: int) -> list[ChatPrompt]:
    screens = [Image.new("RGB", (300, 200), (40 * i, 200 - 30 * i, 90)) for i in range(n)]
    return [
        build_prompt(
            f"Click the OK button {i}.", screens[i], [HistoryStep("Action: wait()", screens[i])] * i, max_images=2
        )
        for i in range(n)
    ]


async def test_concurrent_requests_share_one_batch_and_logprobs_recompute_exactly(engine: HFEngine) -> None:
    prompts = _prompts(4)
    requests = [
        GenerationRequest(p, max_new_tokens=12 + i, sampling=Sampling(temperature=1.0, top_p=0.9), seed=i)
        for i, p in enumerate(prompts)
    ]
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    assert engine.stats.batches == 1 and engine.stats.last_batch_size == 4
    assert engine.load == 0
    for prompt, request, result in zip(prompts, requests, results, strict=True):
        n = len(result.response_token_ids)
        assert 1 <= n <= request.max_new_tokens
        assert n == len(result.response_logprobs) == len(result.response_entropy)
        assert all(lp <= 0 for lp in result.response_logprobs)
        assert all(h >= 0 for h in result.response_entropy)
        assert result.timings.batch_size == 4 and result.policy_version == 0
        encoded = encode_prompt(engine.processor, prompt)
        assert result.prompt_token_ids == encoded.input_ids
        # The trainer's view: one teacher-forced forward over prompt + response with the same weights.
        with torch.inference_mode():
            logits = engine.model(**encoded.forward_inputs(result.response_token_ids)).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        start = len(result.prompt_token_ids) - 1
        positions = torch.arange(start, start + n)
        targets = torch.tensor(result.response_token_ids)
        entropy = -(logp[positions].exp() * logp[positions]).sum(-1)
        # Behaviour log-probs: tempered, banned ids masked, top-p nucleus renormalized (the target kept).
        assert result.sampling.temperature == 1.0 and result.sampling.top_p == 0.9
        assert result.sampling.excluded_token_ids
        scaled = logits[positions] / result.sampling.temperature
        scaled[:, result.sampling.excluded_token_ids] = -torch.inf
        probs = torch.softmax(scaled, -1)
        sorted_p, order = torch.sort(probs, -1, descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (sorted_p.cumsum(-1) - sorted_p) < 0.9)
        keep[torch.arange(n), targets] = True
        recomputed = torch.log_softmax(scaled.masked_fill(~keep, -torch.inf), -1)[torch.arange(n), targets]
        assert (recomputed - logp[positions, targets]).abs().max() > 1e-3  # the nucleus is not the raw distribution
        assert torch.allclose(recomputed, torch.tensor(result.response_logprobs), atol=LOGPROB_TOLERANCE, rtol=0)
        assert torch.allclose(entropy, torch.tensor(result.response_entropy), atol=LOGPROB_TOLERANCE, rtol=0)


async def test_greedy_is_deterministic(engine: HFEngine) -> None:
    request = GenerationRequest(_prompts(2)[1], max_new_tokens=10, sampling=Sampling(temperature=0.0))
    first = await engine.generate(request)
    second = await engine.generate(request)
    assert first.response_token_ids == second.response_token_ids
    assert first.sampling.temperature == 0.0  # greedy: the recorded log-probs are the temperature-1 ones


async def test_update_weights_changes_outputs_and_version(engine: HFEngine, tmp_path: Path) -> None:
    request = GenerationRequest(_prompts(1)[0], max_new_tokens=6, sampling=Sampling(temperature=0.0))
    before = await engine.generate(request)
    generator = torch.Generator().manual_seed(1)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in engine.model.state_dict().items()}
    path = tmp_path / "v1.safetensors"
    save_file({k: v.contiguous() for k, v in new_state.items()}, str(path))
    await engine.update_weights(path, version=1)
    after = await engine.generate(request)
    assert engine.version == 1 and after.policy_version == 1 and engine.state is EngineState.SERVING
    assert after.response_logprobs != before.response_logprobs


async def test_mismatched_weights_are_rejected_and_old_version_serves(engine: HFEngine) -> None:
    state = dict(engine.model.state_dict())
    state.pop(next(iter(state)))
    with pytest.raises(WeightUpdateError) as info:
        await engine.update_weights(state, version=7)
    assert info.value.missing and engine.version == 0 and engine.state is EngineState.SERVING
