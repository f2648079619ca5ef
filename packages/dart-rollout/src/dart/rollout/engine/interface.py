"""The inference engine interface every backend (``hf``, ``vllm``) implements, its config base and registry.

Engines are found by ``rollout.engine.kind`` in :data:`ENGINES` (entry-point group ``dart.engines``, see
:mod:`dart.protocol.registry`): each name maps to a function that starts that many engines from a config.
dart-rollout registers ``hf`` and ``vllm``; another package adds one with an entry point, and its settings
come as ``rollout.engine: {kind: <name>, model_path, options: {...}}`` (:class:`PluginEngineConfig`).

Lifecycle of an engine::

    serving --update_weights()--> draining --in-flight batch done--> loading --weights swapped--> serving
    serving / draining / loading --close()--> closed

- **serving**: requests are batched and generated.
- **draining**: an update was requested; the running batch finishes, new requests wait in the queue.
- **loading**: the new weights are loaded; on success ``version`` becomes the new version, on failure the
  old weights stay and :class:`~dart.rollout.errors.WeightUpdateError` is raised; either way the engine serves again.
- **closed**: queued requests fail with :class:`~dart.rollout.errors.EngineClosedError`.

The weight-sync controller triggers updates; trajectory runners call :meth:`InferenceEngine.generate`
concurrently; the router reads :attr:`InferenceEngine.load`.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dart.policy.prompt import ChatPrompt
from dart.protocol.messages import Sampling, SamplingParams
from dart.protocol.registry import Registry


class EngineState(StrEnum):
    """Where an engine is in its lifecycle (see the module docstring)."""

    SERVING = "serving"
    DRAINING = "draining"
    LOADING = "loading"
    CLOSED = "closed"


@dataclass(frozen=True)
class GenerationRequest:
    """One generation call.

    Attributes:
        prompt: The rendered chat prompt (text with image placeholders, and the images).
        max_new_tokens: Upper bound on response tokens, the stop token included.
        sampling: Temperature (0 means greedy, the argmax) and nucleus mass.
        seed: Seed of this request's sampler; same seed, prompt and weights give the same response.
    """

    prompt: ChatPrompt
    max_new_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class GenerationTimings:
    """Where a request's time went, seconds.

    Attributes:
        queued_s: From submission until its batch started.
        generate_s: Duration of the batch that served it (encoding, prefill and decode).
        batch_size: Requests in that batch.
    """

    queued_s: float = 0.0
    generate_s: float = 0.0
    batch_size: int = 1


@dataclass(frozen=True)
class GenerationResult:
    """One generated response, with everything the trainer needs to recompute and compare log-probs.

    The arrays are aligned: index ``i`` of every ``response_*`` list belongs to ``response_token_ids[i]``.

    Attributes:
        prompt_token_ids: The exact prompt tokens the model consumed (image pads expanded).
        response_token_ids: Generated tokens, the stop token (``<|im_end|>``) included when generated.
        response_logprobs: Behaviour log-prob of each token: under the distribution it was sampled from, as
            ``sampling`` describes it (temperature, excluded tokens, top-p nucleus), nats. For greedy
            requests (temperature 0) the log-probs at temperature 1, excluded tokens masked.
        response_entropy: Entropy of the raw (temperature 1) next-token distribution at each position, nats;
            empty when the engine cannot report it (vLLM).
        sampling: The behaviour distribution ``response_logprobs`` belong to.
        text: Decoded response without special tokens.
        finish_reason: ``"stop"`` when the stop token was generated, ``"length"`` at max_new_tokens.
        policy_version: Version of the weights that produced every token of this response.
        timings: Where the time went.
    """

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    response_entropy: list[float]
    sampling: SamplingParams
    text: str
    finish_reason: str
    policy_version: int
    timings: GenerationTimings = field(default_factory=GenerationTimings)


class InferenceEngine(abc.ABC):
    """A policy server that turns prompts into responses; see the module docstring for its lifecycle."""

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one response; concurrent calls may be batched together.

        Raises:
            EngineClosedError: The engine is closed.
        """

    @abc.abstractmethod
    async def update_weights(self, weights: object, version: int) -> None:
        """Swap in new weights: drain the in-flight batch, load, set ``version``, resume serving.

        Args:
            weights: A state dict (name -> tensor), a path to a ``.safetensors`` file, or a directory
                holding the shards of a version and their ``model.safetensors.index.json``.
            version: The policy version the weights are.

        Raises:
            WeightUpdateError: The weights do not match the model; the previous version keeps serving.
        """

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights now serving."""

    @property
    @abc.abstractmethod
    def load(self) -> int:
        """Requests submitted and not yet answered (queued plus in flight); the router balances on it."""

    @property
    @abc.abstractmethod
    def state(self) -> EngineState:
        """Lifecycle state."""

    def describe(self) -> str:
        """What this engine is, for reports (kind and device, or server); the class name by default."""
        return type(self).__name__

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop serving: fail queued requests, wait for the running batch, release the model."""


class EngineConfigBase(BaseModel):
    """What every engine config has: the registered kind, the checkpoint it serves and that checkpoint's version.

    Subclasses add their own settings and may refine :meth:`serving` and :meth:`engine_count`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    """The engine's name in :data:`ENGINES`."""
    model_path: str | None = None
    """Local checkpoint directory the engines start from (``dart run`` fills it in with the run's policy)."""
    initial_version: int = Field(default=0, ge=0)
    """Policy version of that checkpoint."""

    def serving(
        self, model_path: str, *, num_threads: int | None = None, log_dir: str | None = None, single: bool = False
    ) -> Self:
        """This config set to serve ``model_path`` as version 0.

        Args:
            model_path: The checkpoint to serve.
            num_threads: CPU threads an in-process engine uses when its config leaves them open.
            log_dir: Where engines that run as server processes write their logs, when not configured.
            single: Narrow the config to one engine (an evaluation's), e.g. the first of several server URLs.
        """
        return self.model_copy(update={"model_path": model_path, "initial_version": 0})

    def engine_count(self, num_engines: int) -> int:
        """How many engines starting this config with ``rollout.num_engines`` gives.

        Raises:
            ValueError: ``num_engines`` does not fit this config.
        """
        return num_engines


class PluginEngineConfig(EngineConfigBase):
    """An engine another package registers: its own settings travel as ``options``, validated when it starts."""

    options: dict[str, Any] = Field(default_factory=dict)
    """The engine's own settings."""

    @field_validator("kind")
    @classmethod
    def _registered(cls, kind: str) -> str:
        return ENGINES.check_name(kind)


E = TypeVar("E", bound=InferenceEngine)


async def start_all(starts: Sequence[Awaitable[E]]) -> list[E]:
    """Start engines concurrently; if any start fails, close the ones that started and raise the first error."""
    results = await asyncio.gather(*starts, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    started = [r for r in results if not isinstance(r, BaseException)]
    if errors:
        for engine in started:
            await engine.close()
        raise errors[0]
    return started


EngineStarter = Callable[[Any, int], Awaitable[Mapping[str, InferenceEngine]]]
"""Starts engines from their config: ``await starter(config, count)`` -> engines by id (``engine-<i>``). On
failure it closes what it started and raises."""


def _is_starter(obj: object) -> None:
    if not callable(obj):
        raise TypeError(f"an engine starter must be callable (config, count) -> engines by id, got {obj!r}")


ENGINES: Registry[EngineStarter] = Registry(
    "engines", what="inference engine", config_field="rollout.engine.kind", check=_is_starter
)
"""Inference engines by ``rollout.engine.kind``: ``hf`` and ``vllm`` ship with dart-rollout."""
