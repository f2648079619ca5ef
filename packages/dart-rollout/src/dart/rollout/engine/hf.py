"""``hf`` inference engine: a Qwen2.5-VL policy served with transformers, on CPU or one GPU.

Concurrent :meth:`HFEngine.generate` calls are collected for ``batch_wait_s`` (or until ``max_batch_size``)
and served by one left-padded ``model.generate`` call on a dedicated worker thread, so the asyncio loop
never blocks. ``generate`` handles Qwen2.5-VL's multimodal rotary positions (mrope) with padding; a
:class:`_RowSampler` logits processor replaces its sampling so each request keeps its own temperature,
top-p, seed and token budget, and records behaviour log-probs (of the distribution actually sampled from)
and entropies of the raw logits. The checkpoint's own ``generation_config`` sampling settings (repetition
penalty, top-k, ...) are dropped at start, with one warning naming them: a response is drawn from exactly the
distribution its :class:`~dart.protocol.messages.SamplingParams` record, which is what the trainer recomputes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dart.policy.adapters import AdapterMismatchError, peft_config, set_adapter_state, with_adapters
from dart.policy.loading import load_policy
from dart.policy.models import BANNED_TOKENS, STOP_TOKENS
from dart.protocol.errors import ConfigError
from dart.protocol.messages import SamplingParams
from dart.protocol.weights import AdapterSpec, adapter_spec_of, shard_files
from dart.rollout.engine.hf_config import HFEngineConfig
from dart.rollout.engine.interface import (
    EngineState,
    GenerationRequest,
    GenerationResult,
    GenerationTimings,
    InferenceEngine,
    start_all,
)
from dart.rollout.errors import EngineClosedError, WeightUpdateError

log = logging.getLogger("dart.rollout.hf")

_INERT_GENERATION_FIELDS = frozenset(
    {
        "_from_model_config",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "decoder_start_token_id",
        "use_cache",
        "cache_implementation",
        "max_length",
        "max_new_tokens",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "return_dict_in_generate",
    }
)
"""``generation_config`` fields that do not change which token is drawn or its log-prob."""
_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


@dataclass
class EngineStats:
    """Counters of an engine since start.

    Attributes:
        batches: Batches served.
        requests: Requests answered.
        last_batch_size: Size of the most recent batch.
        max_batch_size: Largest batch served.
        generated_tokens: Response tokens produced.
        weight_updates: Successful weight updates.
    """

    batches: int = 0
    requests: int = 0
    last_batch_size: int = 0
    max_batch_size: int = 0
    generated_tokens: int = 0
    weight_updates: int = 0


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    submitted_at: float


class _RowSampler:
    """Logits processor that samples each row with its own settings and records what the trainer needs.

    ``generate`` runs greedy (no built-in warpers), so the returned one-hot scores make it emit exactly
    the token chosen here. The recorded log-prob is the behaviour log-prob: of the token under the
    distribution it was drawn from (``softmax(logits / T)``, banned tokens masked, top-p nucleus
    renormalized), or for greedy rows under ``softmax(logits)`` with the banned tokens masked (the
    distribution the argmax is taken over); the entropy is that of the raw temperature-1 distribution.
    """

    def __init__(self, requests: list[GenerationRequest], eos_id: int, banned_ids: list[int]) -> None:
        self.requests = requests
        self.eos_id = eos_id
        self.banned_ids = banned_ids
        self.generators = []
        for req in requests:
            gen = torch.Generator()
            gen.manual_seed(req.seed if req.seed is not None else random.getrandbits(63))
            self.generators.append(gen)
        self.step = 0
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.logprobs: list[list[float]] = [[] for _ in requests]
        self.entropy: list[list[float]] = [[] for _ in requests]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float()
        logp = torch.log_softmax(logits, dim=-1)
        entropy = (-(logp.exp() * logp).sum(-1)).clamp_min(0.0)
        allowed = logits.clone()
        allowed[:, self.banned_ids] = -math.inf
        greedy_logp = torch.log_softmax(allowed, dim=-1)
        chosen = torch.empty(len(self.requests), dtype=torch.long)
        for i, req in enumerate(self.requests):
            if self.step >= req.max_new_tokens:
                # Past this row's budget: force a stop so generate can finish early; truncated away later.
                chosen[i] = self.eos_id
                continue
            token, sampled_lp = self._sample(allowed[i], req, self.generators[i])
            chosen[i] = token
            self.tokens[i].append(token)
            # Greedy rows draw nothing: the contract records the temperature-1 log-prob, banned tokens masked.
            self.logprobs[i].append(float(greedy_logp[i, token]) if req.sampling.temperature == 0 else sampled_lp)
            self.entropy[i].append(float(entropy[i]))
        self.step += 1
        out = torch.full_like(scores, -math.inf)
        out[torch.arange(len(self.requests)), chosen.to(scores.device)] = 0.0
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, req: GenerationRequest, gen: torch.Generator) -> tuple[int, float]:
        sampling = req.sampling
        if sampling.temperature == 0:
            return int(torch.argmax(logits)), 0.0
        probs = torch.softmax(logits.cpu() / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            probs /= probs.sum()
        token = int(torch.multinomial(probs, 1, generator=gen))
        return token, float(torch.log(probs[token]))


class HFEngine(InferenceEngine):
    """Transformers inference engine with request batching; see :mod:`dart.rollout.engine.interface` for the lifecycle.

    Usage::

        engine = await HFEngine.start(HFEngineConfig(model_path="/ckpt/tiny"))
        result = await engine.generate(GenerationRequest(prompt=build_prompt(...), max_new_tokens=64))
        await engine.update_weights("/ckpt/v1.safetensors", version=1)
        await engine.close()
    """

    def __init__(self, config: HFEngineConfig, model: Any, processor: Any) -> None:
        """Wrap a loaded model; use :meth:`start` to load from ``config.model_path``."""
        self.config = config
        self.stats = EngineStats()
        self._model = model
        self._processor = processor
        _drop_checkpoint_sampling(model, config.model_path)
        processor.tokenizer.padding_side = "left"
        tok = processor.tokenizer
        self._stop_ids = [tok.convert_tokens_to_ids(t) for t in STOP_TOKENS]
        self._banned_ids = [tok.convert_tokens_to_ids(t) for t in BANNED_TOKENS]
        self._pad_id = tok.pad_token_id if tok.pad_token_id is not None else self._stop_ids[-1]
        self._version = config.initial_version
        self._state = EngineState.SERVING
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._load = 0
        self._weights_lock = asyncio.Lock()
        # One worker thread owns the model: batches and weight loads never overlap and never block the loop.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._server = asyncio.get_running_loop().create_task(self._serve())

    @classmethod
    async def start(cls, config: HFEngineConfig) -> HFEngine:
        """Load the checkpoint (off the event loop) and start serving."""
        if not config.model_path:
            raise ConfigError("hf engine", "model_path", "no checkpoint to serve: set model_path (dart run sets it)")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype = getattr(torch, config.dtype)
        model, processor = await asyncio.to_thread(load_policy, config.model_path, dtype=dtype, device=config.device)
        return cls(config, model, processor)

    @property
    def version(self) -> int:
        return self._version

    def describe(self) -> str:
        return f"hf on {self.config.device} ({self.config.dtype})"

    @property
    def load(self) -> int:
        return self._load

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def model(self) -> Any:
        """The underlying transformers model (read it only between batches, e.g. in tests)."""
        return self._model

    @property
    def processor(self) -> Any:
        """The processor that tokenizes prompts and patches images."""
        return self._processor

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._state is EngineState.CLOSED:
            raise EngineClosedError("engine is closed; route the request to another engine")
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._load += 1
        try:
            self._queue.put_nowait(_Pending(request, future, time.monotonic()))
            return await future
        finally:
            self._load -= 1

    async def update_weights(self, weights: object, version: int) -> None:
        if self._state is EngineState.CLOSED:
            raise EngineClosedError("engine is closed")
        self._state = EngineState.DRAINING
        try:
            async with self._weights_lock:  # held by the serving loop for the duration of each batch
                self._state = EngineState.LOADING
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._executor, self._load_weights, weights, version)
                self._version = version
                self.stats.weight_updates += 1
        finally:
            if self._state is not EngineState.CLOSED:
                self._state = EngineState.SERVING

    async def close(self) -> None:
        if self._state is EngineState.CLOSED:
            return
        self._state = EngineState.CLOSED
        self._queue.put_nowait(None)
        await self._server
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if pending is not None and not pending.future.done():
                pending.future.set_exception(EngineClosedError("engine closed before serving the request"))
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            if first is None:
                return
            if self.config.batch_wait_s > 0:
                await asyncio.sleep(self.config.batch_wait_s)
            batch = [first]
            closing = False
            while len(batch) < self.config.max_batch_size and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    closing = True
                    break
                batch.append(item)
            batch = [p for p in batch if not p.future.cancelled()]
            if batch:
                async with self._weights_lock:
                    version = self._version
                    started = time.monotonic()
                    try:
                        results = await loop.run_in_executor(self._executor, self._run_batch, batch, version)
                    except Exception as exc:  # a failed batch fails its requests, not the engine
                        for p in batch:
                            if not p.future.done():
                                p.future.set_exception(exc)
                        results = None
                if results is not None:
                    elapsed = time.monotonic() - started
                    self.stats.batches += 1
                    self.stats.last_batch_size = len(batch)
                    self.stats.max_batch_size = max(self.stats.max_batch_size, len(batch))
                    for p, r in zip(batch, results, strict=True):
                        self.stats.requests += 1
                        self.stats.generated_tokens += len(r.response_token_ids)
                        timings = GenerationTimings(started - p.submitted_at, elapsed, len(batch))
                        if not p.future.done():
                            p.future.set_result(_with_timings(r, timings))
            if closing:
                return

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Pending], version: int) -> list[GenerationResult]:
        from transformers import GenerationConfig, LogitsProcessorList

        requests = [p.request for p in batch]
        images = [img for r in requests for img in r.prompt.images]
        inputs = self._processor(
            text=[r.prompt.text for r in requests], images=images or None, padding=True, return_tensors="pt"
        )
        inputs = {k: v.to(self._model.device) for k, v in inputs.items()}
        sampler = _RowSampler(requests, self._stop_ids[0], self._banned_ids)
        gen_config = GenerationConfig(  # type: ignore[no-untyped-call]  # an unannotated transformers API
            max_new_tokens=max(r.max_new_tokens for r in requests) + 1,  # +1: room for the forced stop
            do_sample=False,
            eos_token_id=self._stop_ids,
            pad_token_id=self._pad_id,
        )
        self._model.generate(**inputs, generation_config=gen_config, logits_processor=LogitsProcessorList([sampler]))
        mask = inputs["attention_mask"].bool().cpu()
        ids = inputs["input_ids"].cpu()
        results = []
        for i, req in enumerate(requests):
            tokens = sampler.tokens[i]
            end = next((j + 1 for j, t in enumerate(tokens) if t in self._stop_ids), None)
            finish = "stop" if end is not None else "length"
            end = end if end is not None else min(len(tokens), req.max_new_tokens)
            tokens = tokens[:end]
            results.append(
                GenerationResult(
                    prompt_token_ids=ids[i][mask[i]].tolist(),
                    response_token_ids=tokens,
                    response_logprobs=sampler.logprobs[i][:end],
                    response_entropy=sampler.entropy[i][:end],
                    sampling=SamplingParams.drawn(req.sampling, self._banned_ids),
                    text=self._processor.tokenizer.decode(tokens, skip_special_tokens=True),
                    finish_reason=finish,
                    policy_version=version,
                )
            )
        return results

    def _load_weights(self, weights: object, version: int) -> None:
        adapter: AdapterSpec | None = None
        if isinstance(weights, str | Path):
            from safetensors.torch import load_file

            state = {}
            try:
                adapter = adapter_spec_of(Path(weights))
                # A file, or a directory of shards and their index: each shard adds its tensors.
                for shard in shard_files(Path(weights)):
                    state.update(load_file(str(shard)))
            except Exception as exc:
                raise WeightUpdateError(version, f"cannot read {weights}: {exc}") from exc
        elif isinstance(weights, dict):
            state = weights
        else:
            raise WeightUpdateError(
                version,
                f"weights must be a state dict, a .safetensors path or a directory of shards, not {type(weights)}",
            )
        if adapter is not None:
            self._load_adapter(state, adapter, version)
            return
        current = self._model.state_dict(keep_vars=True)
        # A tied parameter is published once, under its first name (the embedding for tied heads).
        first: dict[int, str] = {}
        aliases = {n for n, t in current.items() if first.setdefault(id(t), n) != n}
        missing = sorted(set(current) - set(state) - aliases)
        unexpected = sorted(set(state) - set(current))
        if missing or unexpected:
            raise WeightUpdateError(version, "parameter names differ", missing, unexpected)
        bad = [k for k, v in state.items() if tuple(v.shape) != tuple(current[k].shape)]
        if bad:
            raise WeightUpdateError(version, f"shapes differ for {bad[:5]}")
        with torch.no_grad():
            self._model.load_state_dict(state, strict=False)

    def _load_adapter(self, state: dict[str, Any], spec: AdapterSpec, version: int) -> None:
        """Serve the base model with the LoRA adapter ``state`` (:mod:`dart.protocol.weights`).

        The first adapter wraps the model with peft (adapters built from ``spec``, ``B`` zero); every
        version then overwrites the adapter tensors in place, as the trainer's own model holds them.
        """
        from peft import PeftModel

        if not isinstance(self._model, PeftModel):
            # Adapters in the served dtype, as the trainer's own are after it casts its model (peft would
            # otherwise keep bfloat16 models' adapters in float32).
            self._model = with_adapters(self._model, peft_config(spec), adapter_dtype_float32=False).eval()
        try:
            set_adapter_state(self._model, state)
        except AdapterMismatchError as exc:
            reason = f"adapter tensors differ ({spec.target_modules}, rank {spec.rank}; shapes of {exc.misshapen[:5]})"
            raise WeightUpdateError(version, reason, exc.missing, exc.unexpected) from None


def _drop_checkpoint_sampling(model: Any, model_path: str | None) -> None:
    """Give ``model`` a generation config holding only its token ids, warning once about what it drops.

    ``generate`` fills every field left unset with the checkpoint's value, and the processors those
    values add (repetition penalty, n-gram blocking, ...) run before :class:`_RowSampler`: the recorded
    log-probs would then belong to a distribution the trainer never recomputes.
    """
    from transformers import GenerationConfig

    current = model.generation_config
    dropped = {k: v for k, v in current.to_diff_dict().items() if k not in _INERT_GENERATION_FIELDS}
    if dropped:
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(dropped.items()))
        log.warning(
            "%s/generation_config.json sets %s: ignored; responses are sampled only as each request's "
            "SamplingParams record (the distribution the trainer recomputes)",
            model_path,
            settings,
        )
    token_ids = {k: getattr(current, k, None) for k in _TOKEN_ID_FIELDS}
    model.generation_config = GenerationConfig(**{k: v for k, v in token_ids.items() if v is not None})  # type: ignore[no-untyped-call]  # an unannotated transformers API


def _with_timings(result: GenerationResult, timings: GenerationTimings) -> GenerationResult:
    from dataclasses import replace

    return replace(result, timings=timings)


async def start_hf_engines(config: HFEngineConfig, count: int) -> dict[str, HFEngine]:
    """``count`` hf engines by id (``engine-<i>``), each loading ``config.model_path`` (``device: cuda``: engine
    ``i`` on visible GPU ``i mod visible``); the ``hf`` entry of :data:`~dart.rollout.engine.interface.ENGINES`.

    Raises:
        ConfigError: No ``model_path``.
    """
    configs = [config] * count
    if config.device == "cuda" and count > 1:
        visible = max(1, torch.cuda.device_count())
        configs = [config.model_copy(update={"device": f"cuda:{i % visible}"}) for i in range(count)]
    engines = await start_all([HFEngine.start(c) for c in configs])
    return {f"engine-{i}": e for i, e in enumerate(engines)}
