"""A deterministic engine that answers with scripted text: for tests and system benchmarks.

It is a real :class:`~dart.rollout.engine.interface.InferenceEngine` (same lifecycle, load and
versioning as the ``hf`` engine), only its "model" is a list of outputs. Tests use it to drive a
runner's status logic with oracle-like answers (``finished``, ``wait``, unparseable text) and to
make weight updates slow enough to observe; everything else in such tests is real (bus, env service).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dart.protocol.messages import SamplingParams
from dart.rollout.engine.interface import (
    EngineState,
    GenerationRequest,
    GenerationResult,
    GenerationTimings,
    InferenceEngine,
)
from dart.rollout.errors import EngineClosedError, EngineError


@dataclass(frozen=True)
class GenerateCall:
    """One answered request, for assertions about when an engine served.

    Attributes:
        started: Loop time the request began, seconds.
        finished: Loop time it was answered, seconds.
        version: Policy version that answered it.
    """

    started: float
    finished: float
    version: int


class ScriptedEngine(InferenceEngine):
    """Answers the i-th request with ``outputs[i % len(outputs)]``, or with ``answer(request)``.

    See the module docstring.

    Args:
        outputs: Response texts, cycled (when ``answer`` is not given).
        version: Initial policy version.
        generate_s: Time each request takes, seconds.
        update_s: Time loading new weights takes, seconds.
        fail_with: Raise this from every generate (an engine that broke).
        answer: Computes the response from the request (e.g. an oracle that reads the instruction
            in the prompt); overrides ``outputs``.
    """

    def __init__(
        self,
        outputs: Sequence[str],
        *,
        version: int = 0,
        generate_s: float = 0.0,
        update_s: float = 0.0,
        fail_with: EngineError | None = None,
        answer: Callable[[GenerationRequest], str] | None = None,
    ) -> None:
        if not outputs and answer is None:
            raise ValueError("a ScriptedEngine needs at least one output")
        self._outputs = list(outputs)
        self._version = version
        self._generate_s = generate_s
        self._update_s = update_s
        self._fail_with = fail_with
        self._answer = answer
        self._state = EngineState.SERVING
        self._load = 0
        self._inflight = 0
        self._served = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.calls: list[GenerateCall] = []
        """Every answered request, in completion order."""
        self.loaded: list[object] = []
        """The ``weights`` argument of every update, in order."""

    @property
    def version(self) -> int:
        return self._version

    @property
    def load(self) -> int:
        return self._load

    @property
    def state(self) -> EngineState:
        return self._state

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._state is EngineState.CLOSED:
            raise EngineClosedError("scripted engine is closed")
        loop = asyncio.get_running_loop()
        self._load += 1
        try:
            await self._resumed.wait()  # like the hf engine: requests queue while it updates
            self._inflight += 1
            self._idle.clear()
            try:
                started = loop.time()
                await asyncio.sleep(self._generate_s)
                if self._fail_with is not None:
                    raise self._fail_with
                if self._answer is not None:
                    text = self._answer(request)
                else:
                    text = self._outputs[self._served % len(self._outputs)]
                self._served += 1
                tokens = [ord(c) % 1000 for c in text][: request.max_new_tokens]
                self.calls.append(GenerateCall(started, loop.time(), self._version))
            finally:
                self._done_one()
            return GenerationResult(
                prompt_token_ids=[1, 2, 3],
                response_token_ids=tokens,
                response_logprobs=[-0.5] * len(tokens),
                response_entropy=[1.0] * len(tokens),
                sampling=SamplingParams.drawn(request.sampling, []),
                text=text,
                finish_reason="stop",
                policy_version=self._version,
                timings=GenerationTimings(generate_s=self._generate_s),
            )
        finally:
            self._load -= 1

    def _done_one(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def update_weights(self, weights: object, version: int) -> None:
        if self._state is EngineState.CLOSED:
            raise EngineClosedError("scripted engine is closed")
        self._state = EngineState.DRAINING
        self._resumed.clear()
        try:
            await self._idle.wait()
            self._state = EngineState.LOADING
            await asyncio.sleep(self._update_s)
            self.loaded.append(weights)
            self._version = version
        finally:
            if self._state is not EngineState.CLOSED:
                self._state = EngineState.SERVING
            self._resumed.set()

    async def close(self) -> None:
        self._state = EngineState.CLOSED
        self._resumed.set()
