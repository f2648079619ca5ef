"""``vllm`` inference engine: one vLLM OpenAI-compatible server per engine, reached over HTTP.

Token-in/token-out: the server renders DART's prompt text verbatim (a pass-through chat template, see
:mod:`dart.rollout.engine.vllm_server`), and returns the prompt ids it consumed (image pads expanded),
the response ids and, with ``--logprobs-mode processed_logprobs``, each token's log-prob under the
distribution it was sampled from (temperature, banned tokens via ``bad_words``, top-p). vLLM gives no
entropy: ``response_entropy`` is empty (the trainer computes it from full logits).

Weight update (:meth:`VLLMEngine.update_weights`), every HTTP call with ``control_timeout_s``::

    serving --> draining (new generate calls wait here; ``wait`` mode: in-flight ones finish)
            --> loading: POST /pause?mode=wait|keep -> POST /collective_rpc reload_weights(dir)
                         -> version = v (the server serves v from here, whatever fails next)
                         -> POST /reset_prefix_cache
            --> POST /resume (also after a failure: the previous weights keep serving) --> serving

Pause, reset and resume are retried with backoff (``control_retry``); a reload is not (the weight sync
retries the whole update). A failed reload restores the weights served before. A response carries the
version its request started on: in ``keep`` mode one that straddles an update is labelled with the older
version, so its tokens' lag is never understated.

With ``lora`` set, adapter versions (a LoRA run's) are served as adapters beside the base model instead,
without pausing the server (:mod:`dart.rollout.engine.vllm_lora`).

A launched server that dies is restarted with exponential backoff (state ``loading`` meanwhile, requests in
flight fail with :class:`EngineUnavailableError`); the weights it served are reloaded before it serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dart.policy.models import BANNED_TOKENS, STOP_TOKENS
from dart.protocol.messages import SamplingParams
from dart.protocol.weights import AdapterSpec, adapter_spec_of
from dart.rollout.engine.interface import (
    EngineState,
    GenerationRequest,
    GenerationResult,
    GenerationTimings,
    InferenceEngine,
    start_all,
)
from dart.rollout.engine.vllm_config import VLLMEngineConfig
from dart.rollout.engine.vllm_lora import AdapterVersions, ServedAdapter, adapter_name, check_adapter, stage_adapter
from dart.rollout.engine.vllm_server import VLLMServerProcess, bearer_headers
from dart.rollout.engine.vllm_wire import chat_messages, reference_header, stage_weights, weights_header
from dart.rollout.errors import (
    EngineClosedError,
    EngineError,
    EngineRequestError,
    EngineStartError,
    EngineUnavailableError,
    WeightUpdateError,
)
from dart.runtime.retry import Backoff, pause, retry_async
from dart.runtime.telemetry import current_telemetry

log = logging.getLogger("dart.rollout.vllm")
# httpx logs every request at INFO: thousands of lines per run in the rollout log; failures are ours to report.
logging.getLogger("httpx").setLevel(logging.WARNING)


@dataclass
class VLLMEngineStats:
    """Counters of a vLLM engine since start.

    Attributes:
        requests: Requests answered.
        generated_tokens: Response tokens produced.
        weight_updates: Successful weight updates.
        failed_updates: Weight updates that failed (the previous version kept serving).
        restarts: Times the launched server was restarted after dying.
        straddled: Responses that were in flight across a weight update (``keep`` pause mode only).
        last_update_s: Duration of the last successful update, pause to resume, seconds.
    """

    requests: int = 0
    generated_tokens: int = 0
    weight_updates: int = 0
    failed_updates: int = 0
    restarts: int = 0
    straddled: int = 0
    last_update_s: float = 0.0


class VLLMEngine(InferenceEngine):
    """An engine backed by one vLLM server; see the module docstring.

    Usage::

        engine = await VLLMEngine.launch("engine-0", VLLMEngineConfig(model_path=p, launch=VLLMLaunchConfig()))
        engine = await VLLMEngine.attach("engine-0", config, "http://gpu-0:8000")
        result = await engine.generate(GenerationRequest(prompt, max_new_tokens=64))
        await engine.update_weights("/weights/v1.safetensors", version=1)   # or a directory of shards + index
        await engine.close()
    """

    def __init__(
        self,
        engine_id: str,
        config: VLLMEngineConfig,
        url: str,
        server: VLLMServerProcess | None = None,
        *,
        token: str | None = None,
    ) -> None:
        """Wrap a running server that requires ``token`` (sent on every request); use :meth:`launch` or
        :meth:`attach`."""
        self.engine_id = engine_id
        self.config = config
        self.url = url.rstrip("/")
        self.server = server
        self._token = token
        self.stats = VLLMEngineStats()
        self._version = config.initial_version
        self._state = EngineState.SERVING
        self._serving = asyncio.Event()
        self._serving.set()
        self._lock = asyncio.Lock()  # one update or restart at a time
        self._load = 0
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._epoch = 0  # bumped whenever the served weights may change (update, restart)
        self._weights_dir: Path | None = None  # what the server serves when not its start checkpoint
        self._reference: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix=f"dart-vllm-{engine_id}-")
        self._client: httpx.AsyncClient | None = None  # made off the loop: loading CA certificates takes a while
        self._stop_ids: list[int] = []
        self._banned_ids: list[int] = []
        self._monitor: asyncio.Task[None] | None = None
        self._adapters = AdapterVersions()
        self._retiring: set[asyncio.Task[None]] = set()

    @classmethod
    async def launch(cls, engine_id: str, config: VLLMEngineConfig, index: int = 0) -> VLLMEngine:
        """Start a server from ``config.launch`` and serve through it (it is restarted when it dies).

        Raises:
            EngineStartError: The server did not come up (its log says why).
        """
        server = VLLMServerProcess(engine_id, config, index)
        await server.start()
        engine = cls(engine_id, config, server.url, server, token=server.token)
        try:
            await engine._connect()
        except BaseException:
            await engine.close()
            raise
        engine._monitor = asyncio.create_task(engine._watch_server(), name=f"{engine_id}-watch")
        return engine

    @classmethod
    async def attach(cls, engine_id: str, config: VLLMEngineConfig, url: str) -> VLLMEngine:
        """Serve through a server someone else runs at ``url`` (it must have the dev-mode routes), sending the
        token in ``attach.token_file`` when set.

        Raises:
            EngineStartError: The token file cannot be read or is empty.
        """
        engine = cls(engine_id, config, url, token=_attach_token(config))
        try:
            await engine._connect()
        except BaseException:
            await engine.close()
            raise
        return engine

    @property
    def version(self) -> int:
        return self._version

    def describe(self) -> str:
        return f"vllm at {self.url}"

    @property
    def load(self) -> int:
        return self._load

    @property
    def state(self) -> EngineState:
        return self._state

    def _closed(self) -> bool:
        # A method, not the attribute: re-checked after awaits, where close() may have run meanwhile.
        return self._state is EngineState.CLOSED

    @property
    def banned_token_ids(self) -> list[int]:
        """Token ids the server never samples (vision placeholders, ``<|im_start|>``)."""
        return list(self._banned_ids)

    async def _connect(self) -> None:
        """Check the server answers for ``served_model_name`` and learn the stop and banned token ids."""
        models = await self._call("GET", "/v1/models", timeout=self.config.control_timeout_s)
        names = [m.get("id") for m in models.get("data", [])]
        if self.config.served_model_name not in names:
            raise EngineRequestError(
                f"vLLM server {self.url} serves {names}, not {self.config.served_model_name!r}; "
                "start it with --served-model-name or set rollout.engine.served_model_name"
            )
        self._stop_ids = [await self._token_id(t) for t in STOP_TOKENS]
        self._banned_ids = [await self._token_id(t) for t in BANNED_TOKENS]
        if self.config.model_path:
            self._reference = reference_header(Path(self.config.model_path))

    async def _token_id(self, token: str) -> int:
        body = {"model": self.config.served_model_name, "prompt": token, "add_special_tokens": False}
        reply = await self._call("POST", "/tokenize", json=body, timeout=self.config.control_timeout_s)
        ids = reply.get("tokens", [])
        if len(ids) != 1:
            raise EngineRequestError(f"the served tokenizer maps {token!r} to {ids}, not one special token")
        return int(ids[0])

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._state is EngineState.CLOSED:
            raise EngineClosedError("engine is closed; route the request to another engine")
        submitted = time.monotonic()
        self._load += 1
        try:
            # A request routed here just before an update or restart waits until the engine serves again.
            await self._serving.wait()
            if self._closed():
                raise EngineClosedError("engine closed before serving the request")
            # Counted from here: a ``wait`` update drains this request before it pauses the server.
            self._in_flight += 1
            self._idle.clear()
            epoch, version = self._epoch, self._version
            adapter = self._adapters.acquire()  # its version is ``version``: switched together
            started = time.monotonic()
            try:
                messages = await asyncio.to_thread(chat_messages, request.prompt)
                body = self._body(request, messages, adapter)
                reply = await self._call("POST", "/v1/chat/completions", json=body)
            finally:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.set()
                if adapter is not None and (done := self._adapters.release(adapter)) is not None:
                    self._retire(done)
            elapsed = time.monotonic() - started
            if epoch != self._epoch:
                # Only ``keep`` pauses (or a restart) let a response cross a weight change: flag it. Its
                # first tokens came from ``version``: the older label overstates its lag, never understates.
                self.stats.straddled += 1
                _event("engine.response.straddled", engine_id=self.engine_id, version=version, to=self._version)
            result = self._result(request, reply, GenerationTimings(started - submitted, elapsed, 1), version)
            self.stats.requests += 1
            self.stats.generated_tokens += len(result.response_token_ids)
            return result
        finally:
            self._load -= 1

    def _body(
        self, request: GenerationRequest, messages: list[dict[str, Any]], adapter: ServedAdapter | None
    ) -> dict[str, Any]:
        greedy = request.sampling.temperature == 0
        body: dict[str, Any] = {
            "model": adapter.name if adapter is not None else self.config.served_model_name,
            "messages": messages,
            "max_completion_tokens": request.max_new_tokens,
            "temperature": request.sampling.temperature,
            "top_p": 1.0 if greedy else request.sampling.top_p,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": True,
            "add_special_tokens": False,
            "stop_token_ids": self._stop_ids,
            "bad_words": list(BANNED_TOKENS),
        }
        if request.seed is not None:
            body["seed"] = request.seed % (2**63)
        return body

    def _result(
        self, request: GenerationRequest, reply: dict[str, Any], timings: GenerationTimings, version: int
    ) -> GenerationResult:
        try:
            choice = reply["choices"][0]
            prompt_ids = [int(t) for t in reply["prompt_token_ids"]]
            tokens = [int(t) for t in choice["token_ids"]]
            logprobs = [float(c["logprob"]) for c in choice["logprobs"]["content"]]
            finish = choice["finish_reason"]
            text = choice["message"].get("content") or ""
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineRequestError(f"malformed chat completion from {self.url}: {exc!r}") from exc
        if finish not in ("stop", "length"):
            raise EngineRequestError(f"vLLM server {self.url} ended the response with finish_reason={finish!r}")
        if len(logprobs) != len(tokens):
            raise EngineRequestError(f"{len(logprobs)} log-probs for {len(tokens)} tokens from {self.url}")
        if finish == "stop" and tokens and tokens[-1] not in self._stop_ids:
            finish = "length"  # never: stop strings are not used; keep the contract's meaning anyway
        sampling = SamplingParams.drawn(request.sampling, self._banned_ids)
        return GenerationResult(
            prompt_token_ids=prompt_ids,
            response_token_ids=tokens,
            response_logprobs=logprobs,
            response_entropy=[],
            sampling=sampling,
            text=text,
            finish_reason=finish,
            policy_version=version,
            timings=timings,
        )

    async def update_weights(self, weights: object, version: int) -> None:
        if self._state is EngineState.CLOSED:
            raise EngineClosedError("engine is closed")
        if not isinstance(weights, str | Path):
            raise WeightUpdateError(
                version, f"the vllm engine loads a .safetensors path or a directory of shards, not {type(weights)}"
            )
        path = Path(weights)
        spec = await asyncio.to_thread(_adapter_spec, path)
        if spec is not None:
            await self._update_adapter(path, spec, version)
            return
        if self._adapters.current is not None:
            raise WeightUpdateError(
                version, f"{path} holds full weights, but this engine serves LoRA adapter versions over its base"
            )
        # Staged first (hard links into the engine's own directory, every shard and the index): from here
        # on the bytes stay readable for the load and for reloads after a restart, whatever the store's
        # retention deletes. The names and shapes of all shards together are checked before the server is.
        directory = Path(self._tmp.name) / f"v{version}"
        try:
            await asyncio.to_thread(stage_weights, directory, path)
            header = await asyncio.to_thread(weights_header, directory)
            self._check_against_reference(header, version)
        except (OSError, ValueError, WeightUpdateError) as exc:
            if directory != self._weights_dir:  # never the directory the server serves from
                await asyncio.to_thread(shutil.rmtree, directory, True)
            if isinstance(exc, WeightUpdateError):
                raise
            raise WeightUpdateError(version, f"cannot read {path}: {exc}") from exc
        async with self._lock:
            if self._closed():
                raise EngineClosedError("engine is closed")
            started = time.monotonic()
            try:
                async with self._requests_held(drain=self.config.pause_mode == "wait"):
                    await self._swap(directory, version, header)
                self.stats.weight_updates += 1
                self.stats.last_update_s = time.monotonic() - started
            except (EngineError, TimeoutError) as exc:
                self.stats.failed_updates += 1
                if self._weights_dir != directory:
                    await asyncio.to_thread(shutil.rmtree, directory, True)
                if isinstance(exc, WeightUpdateError):
                    raise
                raise WeightUpdateError(version, f"{type(exc).__name__}: {exc}") from exc

    @contextlib.asynccontextmanager
    async def _requests_held(self, *, drain: bool) -> AsyncIterator[None]:
        """New generate calls wait (DRAINING) while the body runs (LOADING); with ``drain`` the body starts once
        the requests in flight have finished. Serving again afterwards, whatever the body raised."""
        self._state = EngineState.DRAINING
        self._serving.clear()
        try:
            if drain:
                await asyncio.wait_for(self._idle.wait(), self.config.control_timeout_s)
            self._state = EngineState.LOADING
            yield
        finally:
            if self._state is not EngineState.CLOSED:
                self._state = EngineState.SERVING
                self._serving.set()

    async def _update_adapter(self, path: Path, spec: AdapterSpec, version: int) -> None:
        """Serve adapter version ``version`` from the next request on; see :mod:`dart.rollout.engine.vllm_lora`."""
        if self.config.lora is None:
            raise WeightUpdateError(
                version,
                f"{path} is a LoRA adapter and this engine's servers run without LoRA: set rollout.engine.lora "
                "(dart run sets it from train.lora)",
            )
        name = adapter_name(self.config.served_model_name, version)
        if self._adapters.current is not None and self._adapters.current.name == name:
            return  # already served (a repeated update)
        directory = Path(self._tmp.name) / f"lora-v{version}"
        try:
            await asyncio.to_thread(check_adapter, path, spec, self._reference, self.config.lora.server_rank)
            await asyncio.to_thread(stage_adapter, directory, path, spec)
        except (OSError, ValueError) as exc:
            await asyncio.to_thread(shutil.rmtree, directory, True)
            raise WeightUpdateError(version, f"cannot serve the adapter {path}: {exc}") from exc
        adapter = ServedAdapter(name, version, directory)
        async with self._lock:
            if self._closed():
                raise EngineClosedError("engine is closed")
            started = time.monotonic()
            # Only the first adapter holds requests: base requests never share a batch with adapter requests.
            first = self._adapters.current is None
            try:
                async with self._requests_held(drain=True) if first else contextlib.nullcontext():
                    await self._load_adapter(adapter)
            except (EngineError, TimeoutError) as exc:
                self.stats.failed_updates += 1
                await asyncio.to_thread(shutil.rmtree, directory, True)
                raise WeightUpdateError(version, f"{type(exc).__name__}: {exc}") from exc
            superseded = self._adapters.switch(adapter)
            self._version = version
            self.stats.weight_updates += 1
            self.stats.last_update_s = time.monotonic() - started
        if superseded is not None:
            self._retire(superseded)

    async def _load_adapter(self, adapter: ServedAdapter) -> None:
        body = {"lora_name": adapter.name, "lora_path": str(adapter.directory)}
        await self._call("POST", "/v1/load_lora_adapter", json=body, timeout=self.config.control_timeout_s, text=True)

    def _retire(self, adapter: ServedAdapter) -> None:
        """Unload a superseded adapter whose last request ended, and remove its staged files (in the background)."""

        async def retire() -> None:
            try:
                body = {"lora_name": adapter.name}
                timeout = self.config.control_timeout_s
                await self._call("POST", "/v1/unload_lora_adapter", json=body, timeout=timeout, text=True)
            except EngineError as exc:  # a restarted server no longer has it; the files go either way
                log.info("engine %s: unloading adapter %s: %s", self.engine_id, adapter.name, exc)
            await asyncio.to_thread(shutil.rmtree, adapter.directory, True)

        task = asyncio.create_task(retire(), name=f"{self.engine_id}-retire-{adapter.name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _check_against_reference(self, header: dict[str, tuple[str, tuple[int, ...]]], version: int) -> None:
        """Refuse weights whose names or shapes differ from what the server serves, before touching it."""
        if self._reference is None:
            return
        missing = sorted(set(self._reference) - set(header))
        unexpected = sorted(set(header) - set(self._reference))
        if missing or unexpected:
            raise WeightUpdateError(version, "parameter names differ", missing, unexpected)
        bad = [k for k, (_, shape) in header.items() if shape != self._reference[k][1]]
        if bad:
            raise WeightUpdateError(version, f"shapes differ for {bad[:5]}")

    async def _swap(self, directory: Path, version: int, header: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        """Pause, reload from the staged ``directory``, record ``version``, reset the prefix cache; always resume.

        Raises:
            EngineError: A step failed after its retries; the recorded version is still the served one.
        """
        error: EngineError | None = None
        try:
            await self._control("/pause", params={"mode": self.config.pause_mode})
            self._epoch += 1  # from here the served weights may change: responses in flight straddle
            try:
                await self._reload(directory)
            except EngineError:
                await self._restore()
                raise
            # The server serves the new weights from here on, whatever fails next: record them now.
            self._version, self._reference = version, header
            previous, self._weights_dir = self._weights_dir, directory
            if previous is not None and previous != directory:  # the server no longer needs those bytes
                await asyncio.to_thread(shutil.rmtree, previous, True)
            await self._control("/reset_prefix_cache")
        except EngineError as exc:
            error = exc
        try:
            await self._control("/resume")
        except EngineError as exc:
            log.error("engine %s: the server stays paused, /resume failed: %s", self.engine_id, exc)
            if error is None:
                error = exc
        if error is not None:
            raise error

    async def _control(self, route: str, *, params: dict[str, str] | None = None) -> None:
        """POST a control route, retried with backoff (``control_retry``) until the engine is closed."""
        await retry_async(
            lambda: self._call("POST", route, params=params, timeout=self.config.control_timeout_s),
            policy=self.config.control_retry,
            retryable=lambda exc: isinstance(exc, EngineError) and not self._closed(),
            what=f"engine {self.engine_id}: POST {route}",
        )

    async def _reload(self, directory: Path) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}}
        await self._call("POST", "/collective_rpc", json=body, timeout=self.config.control_timeout_s)

    async def _restore(self) -> None:
        """After a failed reload: load what served before (the start checkpoint or the last version)."""
        previous = self._weights_dir or (Path(self.config.model_path) if self.config.model_path else None)
        if previous is None:
            log.error("engine %s: reload failed and nothing to restore from; weights may be mixed", self.engine_id)
            return
        try:
            await self._reload(previous)
        except EngineError as exc:
            log.error("engine %s: restoring %s after a failed reload failed too: %s", self.engine_id, previous, exc)

    async def _call(
        self,
        method: str,
        route: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
        text: bool = False,
    ) -> dict[str, Any]:
        """The JSON reply of ``route``; with ``text`` (routes that answer a sentence) an empty dict.

        Raises:
            EngineUnavailableError: No answer.
            EngineRequestError: A status other than 200, or a reply that is not JSON where JSON was due.
        """
        if self._client is None:
            timeout_config = httpx.Timeout(self.config.request_timeout_s, connect=10.0)
            self._client = await asyncio.to_thread(httpx.AsyncClient, timeout=timeout_config)
        try:
            reply = await self._client.request(
                method,
                self.url + route,
                json=json,
                params=params,
                headers=bearer_headers(self._token),
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TimeoutException as exc:
            raise EngineUnavailableError(f"{method} {self.url}{route} timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"{method} {self.url}{route} failed: {exc!r}") from exc
        if reply.status_code != 200:
            raise EngineRequestError(f"{method} {self.url}{route} answered {reply.status_code}: {reply.text[:500]}")
        if not reply.content or text:
            return {}
        try:
            data = reply.json()
        except ValueError as exc:
            raise EngineRequestError(f"{method} {self.url}{route} answered non-JSON: {reply.text[:200]}") from exc
        return data if isinstance(data, dict) else {"results": data}

    async def _watch_server(self) -> None:
        """Restart the launched server whenever it dies, with exponential backoff."""
        assert self.server is not None and self.config.launch is not None
        launch = self.config.launch
        backoff = Backoff(launch.restart_backoff_s, max_s=launch.restart_backoff_max_s)
        delays = backoff.delays()
        while self._state is not EngineState.CLOSED:
            await asyncio.sleep(0.2)
            if not self.server.exited or self._closed():
                continue
            async with self._lock:
                if self._closed():
                    return
                self._state = EngineState.LOADING
                self._serving.clear()
                self._epoch += 1
                self.stats.restarts += 1
                started = time.time()
                _event("engine.restart.start", engine_id=self.engine_id, version=self._version, ts=started)
                delay = next(delays)
                log.error("engine %s: vLLM server died; restarting in %.3gs", self.engine_id, delay)
                await pause(delay)
                try:
                    await self.server.start()
                    self.url, self._token = self.server.url, self.server.token
                    if self._weights_dir is not None:
                        await self._reload(self._weights_dir)  # serve the version it served before
                    if self._adapters.current is not None:
                        await self._load_adapter(self._adapters.current)
                except EngineError as exc:
                    log.error("engine %s: restart failed: %s", self.engine_id, exc)
                    await self.server.stop()
                    _event("engine.restart.end", engine_id=self.engine_id, ok=False, error=str(exc), ts=time.time())
                    continue
                delays = backoff.delays()  # a restart that worked starts the next death at the first delay
                self._state = EngineState.SERVING
                self._serving.set()
                _event(
                    "engine.restart.end",
                    engine_id=self.engine_id,
                    version=self._version,
                    ok=True,
                    started_at=started,
                    ts=time.time(),
                )

    async def close(self) -> None:
        if self._state is EngineState.CLOSED:
            return
        self._state = EngineState.CLOSED
        self._serving.set()  # waiting generate calls wake up and see CLOSED
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for task in list(self._retiring):
            task.cancel()
        if self.server is not None:
            await self.server.stop()
        if self._client is not None:
            await self._client.aclose()
        self._tmp.cleanup()


def _event(name: str, **attrs: object) -> None:
    telemetry = current_telemetry()
    if telemetry is not None:
        telemetry.event(name, **attrs)


async def start_vllm_engines(config: VLLMEngineConfig, count: int) -> dict[str, VLLMEngine]:
    """Engines by id: ``count`` launched servers, or one per ``attach`` URL.

    Raises:
        EngineStartError: A launched server did not come up (the others are stopped).
    """
    if config.attach is not None:
        engines = await start_all(
            [VLLMEngine.attach(f"engine-{i}", config, u) for i, u in enumerate(config.attach.urls)]
        )
    else:
        engines = await start_all([VLLMEngine.launch(f"engine-{i}", config, i) for i in range(count)])
    return {e.engine_id: e for e in engines}


def _attach_token(config: VLLMEngineConfig) -> str | None:
    """The token in ``attach.token_file``; None where no file is set."""
    token_file = config.attach.token_file if config.attach is not None else None
    if token_file is None:
        return None
    try:
        token = Path(token_file).read_text().strip()
    except OSError as exc:
        raise EngineStartError(f"cannot read rollout.engine.attach.token_file {token_file!r}: {exc}") from exc
    if not token:
        raise EngineStartError(f"rollout.engine.attach.token_file {token_file!r} is empty: write the servers' token")
    return token


def _adapter_spec(path: Path) -> AdapterSpec | None:
    """The spec of the LoRA adapter version at ``path``; None for full weights (and for unreadable ones,
    which staging reports)."""
    try:
        return adapter_spec_of(path)
    except (OSError, ValueError):
        return None
