"""vLLM weight updates never mislabel what a response was generated with, and failed updates are retried.

The engine talks to the session's real vLLM server (``vllm_url``) through :class:`FaultProxy`, a small
real HTTP proxy that answers chosen routes with a 503 instead of forwarding them, or holds a reply back
until the test releases it: the failures a flaky network or an overloaded server produce, injected in
front of a real server. Without the vLLM environment every test here is skipped with that reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from dart.policy.loading import load_policy
from dart.policy.prompt import build_prompt, encode_prompt
from dart.protocol.messages import ModelVersion, Sampling
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.rollout.engine.interface import EngineState, GenerationRequest, GenerationResult
from dart.rollout.engine.vllm import VLLMEngine
from dart.rollout.engine.vllm_config import VLLMAttachConfig, VLLMEngineConfig
from dart.rollout.engine.vllm_server import VLLMServerProcess, bearer_headers
from dart.rollout.errors import WeightUpdateError
from dart.rollout.service.config import SyncConfig
from dart.rollout.service.sync import WeightSyncController
from dart.runtime.bus import Bus
from dart.runtime.topology import ensure_topology
from dart.train.loss import behaviour_logprobs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

LOGPROB_TOLERANCE = 1e-5


class FaultProxy:
    """An HTTP/1.1 proxy in front of a server that fails or holds chosen routes (one request per connection);
    it adds the server's bearer token to what it forwards.

    Attributes:
        failures: Route path -> how many more requests to answer 503 without forwarding them.
        holds: Route path -> an event; a forwarded request's reply is held back until it is set.
        held: Set once a reply is being held back.
        answered: Paths the server answered 200 to, in order.
    """

    def __init__(self, upstream: str, token: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.token = token
        self.failures: dict[str, int] = {}
        self.holds: dict[str, asyncio.Event] = {}
        self.held = asyncio.Event()
        self.answered: list[str] = []
        self._server: asyncio.Server | None = None
        self._client = httpx.AsyncClient(timeout=None)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def close(self) -> None:
        for gate in self.holds.values():
            gate.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self._client.aclose()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            except asyncio.IncompleteReadError:
                return  # a connection closed without a request (a client pool shutting down)
            method, target, _ = head[0].split(" ", 2)
            headers = dict(line.split(":", 1) for line in head[1:] if ":" in line)
            headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            path = target.split("?", 1)[0]
            if self.failures.get(path, 0) > 0:
                self.failures[path] -= 1
                status, content = 503, b'{"error": "injected fault"}'
            else:
                forwarded = {
                    "content-type": headers.get("content-type", "application/json"),
                    "authorization": f"Bearer {self.token}",
                }
                reply = await self._client.request(method, self.upstream + target, content=body, headers=forwarded)
                status, content = reply.status_code, reply.content
                if status == 200:
                    self.answered.append(path)
                if path in self.holds:
                    self.held.set()
                    await self.holds[path].wait()
            writer.write(
                f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(content)}\r\n"
                "connection: close\r\n\r\n".encode()
                + content
            )
            await writer.drain()
        finally:
            writer.close()


@pytest.fixture
async def proxy(vllm_server: VLLMServerProcess, vllm_token_file: Path, checkpoint: Path) -> AsyncIterator[FaultProxy]:
    """A fault proxy in front of the session's server; afterwards the server serves the start checkpoint again."""
    vllm_url = vllm_server.url
    assert vllm_server.token
    fault_proxy = FaultProxy(vllm_url, vllm_server.token)
    await fault_proxy.start()
    try:
        yield fault_proxy
    finally:
        await fault_proxy.close()
        # Whatever the test did, later tests get a resumed server with the checkpoint's weights.
        async with httpx.AsyncClient(timeout=120) as client:
            await client.post(f"{vllm_url}/resume", headers=bearer_headers(vllm_server.token))
        attach = VLLMAttachConfig(urls=[vllm_url], token_file=str(vllm_token_file))
        direct = await VLLMEngine.attach("cleanup", _config(checkpoint, vllm_url, attach=attach), vllm_url)
        try:
            await direct.update_weights(checkpoint / "model.safetensors", version=100)
        finally:
            await direct.close()


def _config(checkpoint: Path, url: str, **overrides: Any) -> VLLMEngineConfig:
    fields: dict[str, Any] = {
        "model_path": str(checkpoint),
        "attach": VLLMAttachConfig(urls=[url]),
        "control_retry": {"attempts": 5, "initial_delay_s": 0.05, "max_delay_s": 0.2},
    }
    return VLLMEngineConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def policy(checkpoint: Path) -> tuple[Any, Any]:
    return load_policy(str(checkpoint), dtype=torch.float32)


def _request(i: int = 1, max_new_tokens: int = 12) -> GenerationRequest:
    screen = Image.new("RGB", (224, 224), (30 * i, 120, 200 - 20 * i))
    prompt = build_prompt(f"Click the OK button {i}.", screen, [], max_images=1)
    return GenerationRequest(prompt, max_new_tokens=max_new_tokens, sampling=Sampling(temperature=1.0), seed=i)


def _logprobs(
    model: Any, processor: Any, request: GenerationRequest, result: GenerationResult, state: Any
) -> torch.Tensor:
    """The trainer's log-probs of the recorded response under the weights ``state``."""
    model.load_state_dict(state, strict=True)
    encoded = encode_prompt(processor, request.prompt)
    response = result.response_token_ids
    with torch.inference_mode():
        logits = model(**encoded.forward_inputs(response)).logits[0].float()
    start = len(encoded.input_ids) - 1
    sampling = result.sampling
    return behaviour_logprobs(
        logits[start : start + len(response)],
        torch.tensor(response),
        temperature=sampling.temperature,
        excluded_token_ids=sampling.excluded_token_ids,
        top_p=sampling.top_p,
    )[0]


async def test_failed_reset_and_resume_after_a_reload_leave_the_served_version_recorded(
    proxy: FaultProxy, checkpoint: Path, policy: tuple[Any, Any], tmp_path: Path
) -> None:
    """The reload succeeds, then ``/reset_prefix_cache`` keeps failing and ``/resume`` fails twice: the
    update is reported failed, yet the engine records the version the server now serves, the server is
    resumed (retried), and responses carry that version with log-probs of its weights."""
    model, processor = policy
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(2)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in original.items()}
    weights = tmp_path / "v1.safetensors"
    await asyncio.to_thread(save_file, perturbed, str(weights))
    engine = await VLLMEngine.attach("engine-f", _config(checkpoint, proxy.url), proxy.url)
    try:
        proxy.failures = {"/reset_prefix_cache": 1000, "/resume": 2}
        with pytest.raises(WeightUpdateError, match="reset_prefix_cache"):
            await engine.update_weights(weights, version=1)
        assert engine.version == 1 and engine.state is EngineState.SERVING
        assert proxy.answered[-2:] == ["/collective_rpc", "/resume"]  # reloaded, then resumed on the third try
        request = _request()
        result = await engine.generate(request)
        assert result.policy_version == 1
        recorded = torch.tensor(result.response_logprobs)
        new = await asyncio.to_thread(_logprobs, model, processor, request, result, perturbed)
        old = await asyncio.to_thread(_logprobs, model, processor, request, result, original)
        assert torch.allclose(new, recorded, atol=LOGPROB_TOLERANCE, rtol=0)
        assert (old - recorded).abs().max() > 1e-3  # the label matters: version 0 would give other log-probs
    finally:
        await asyncio.to_thread(model.load_state_dict, original, strict=True)
        await engine.close()


async def test_a_response_straddling_a_keep_mode_update_carries_the_older_version(
    proxy: FaultProxy, checkpoint: Path
) -> None:
    """``keep`` pause: a response in flight across an update is labelled with the version it started on.

    The proxy holds the server's reply until the update is done, so the response crosses it whatever the
    machine's speed; the engine cannot tell that from a generation the pause froze mid-way."""
    engine = await VLLMEngine.attach("engine-k", _config(checkpoint, proxy.url, pause_mode="keep"), proxy.url)
    try:
        proxy.holds["/v1/chat/completions"] = asyncio.Event()
        in_flight = asyncio.create_task(engine.generate(_request(2)))
        await proxy.held.wait()
        await engine.update_weights(checkpoint / "model.safetensors", version=7)
        assert engine.version == 7
        proxy.holds["/v1/chat/completions"].set()
        straddled = await in_flight
        assert engine.stats.straddled == 1
        assert straddled.policy_version == 0  # its first tokens came from version 0: lag 7, not 0
        del proxy.holds["/v1/chat/completions"]
        after = await engine.generate(_request(3))
        assert after.policy_version == 7 and engine.stats.straddled == 1
    finally:
        await engine.close()


def _model_version(path: Path, version: int) -> ModelVersion:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return ModelVersion(version=version, uri=path.as_uri(), sha256=digest, created_at=time.time())


async def test_a_failed_update_is_retried_without_a_new_version(proxy: FaultProxy, checkpoint: Path, bus: Bus) -> None:
    """The server fails the reload once: the weight sync tries the same version again after a backoff,
    with no further announcement, and the engine reaches it."""
    state = await ensure_topology(bus)
    engine = await VLLMEngine.attach("engine-r", _config(checkpoint, proxy.url), proxy.url)
    sync = WeightSyncController({"engine-r": engine}, SyncConfig(retry_backoff_s=0.1, retry_backoff_max_s=0.5))
    try:
        proxy.failures = {"/collective_rpc": 1}
        await sync.start(state)
        version = await asyncio.to_thread(_model_version, checkpoint / "model.safetensors", 1)
        await state.put(LATEST_MODEL_KEY, version)
        async with asyncio.timeout(300):  # a bound for a failing run; a passing one ends at the retry
            while len(sync.updates) < 2:  # noqa: ASYNC110  (the controller's record is the signal)
                await asyncio.sleep(0.05)
        assert [u.ok for u in sync.updates] == [False, True] and sync.retries == 1
        assert engine.stats.failed_updates == 1 and engine.stats.weight_updates == 1
        result = await engine.generate(_request(4, max_new_tokens=4))
        assert result.policy_version == 1
    finally:
        await sync.stop()
        await engine.close()
