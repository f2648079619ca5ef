"""Configuration of the rollout service: runners, weight sync, engines.

Example (YAML)::

    rollout:
      num_engines: 2
      runners: 8
      engine: {kind: hf, model_path: /ckpt/tiny, device: cpu}   # or {kind: vllm, launch: {...} | attach: {...}}
      runner: {pool: sim, max_new_tokens: 256, prompt: {max_images: 2}}   # real checkpoints: image_size: model
      sync: {mode: decoupled, max_updating_fraction: 0.5}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from dart.policy.config import PromptConfig
from dart.protocol.config import ConfigModel
from dart.protocol.topology import STREAMS
from dart.rollout.engine.hf_config import HFEngineConfig
from dart.rollout.engine.interface import PluginEngineConfig
from dart.rollout.engine.vllm_config import VLLMEngineConfig
from dart.runtime.store import ArtifactStore
from dart.runtime.store.images import DEFAULT_PREFIX, DEFAULT_REFRESH_S, ImageOffload


def _engine_kind(value: Any) -> str:
    # ``kind`` may be left out: configs written before there was a choice mean the hf engine.
    kind = value.get("kind", "hf") if isinstance(value, dict) else getattr(value, "kind", "hf")
    return str(kind) if kind in ("hf", "vllm") else "plugin"


EngineConfig = Annotated[
    Annotated[HFEngineConfig, Tag("hf")]
    | Annotated[VLLMEngineConfig, Tag("vllm")]
    | Annotated[PluginEngineConfig, Tag("plugin")],
    Discriminator(_engine_kind),
]
"""``rollout.engine``: ``kind: hf`` (transformers, in process; the default), ``kind: vllm`` (vLLM servers), or
an engine another package registers (:class:`~dart.rollout.engine.interface.PluginEngineConfig`)."""


_MOVED_TO_PROMPT = frozenset(PromptConfig.model_fields)


class RunnerConfig(ConfigModel):
    """How one trajectory runner talks to envs and engines, and the prompt it builds."""

    pool: str = "sim"
    """Env pool to lease from (``subjects.env_lease(pool)``); in a run config it defaults to ``env.pool``."""
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    """What the policy is shown (screenshots, their sizing, the coordinate space it answers in)."""
    max_new_tokens: int = Field(default=256, ge=1)
    """Response token budget per step."""
    lease_ttl_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    """Lease lifetime without a heartbeat, seconds; the client heartbeats well within it."""
    lease_timeout_s: float = Field(default=300.0, gt=0.0)
    """How long to keep retrying a full pool before the episode ends as env_failed, seconds."""
    lease_backoff_s: float = Field(default=0.05, gt=0.0)
    """First pause after an ``unavailable`` lease reply, seconds; doubles up to ``lease_backoff_max_s``."""
    lease_backoff_max_s: float = Field(default=2.0, gt=0.0)
    """Longest pause between lease attempts, seconds."""
    env_request_timeout_s: float = Field(default=150.0, gt=0.0)
    """Reply deadline of reset/step/evaluate, seconds: above the env service's own op timeout, so
    a slow backend is reported by the service (``env_failed``) rather than guessed here."""
    env_gone_after_s: float = Field(default=3.0, ge=0.0)
    """How long heartbeats must find nobody serving a leased instance before the lease counts as lost
    (its env service died) and the call in flight ends ``env_failed``, seconds."""
    env_gone_probe_s: float = Field(default=0.5, gt=0.0)
    """Heartbeat pause while the instance is unserved, seconds (instead of the lease's interval)."""
    env_call_check_s: float = Field(default=3.0, gt=0.0)
    """Once a reset/step/evaluate has waited this long, heartbeats come this often and check that the env
    service received it and that its reply is not lost, seconds (a broker node that dies loses the
    requests and replies on it)."""
    env_call_resends: int = Field(default=2, ge=0)
    """How many times a call the bus lost is sent again before the lease counts as lost."""
    engine_wait_s: float = Field(default=600.0, gt=0.0)
    """How long a step waits for any serving engine before the trajectory fails, seconds."""
    min_version_wait_s: float = Field(default=5.0, ge=0.0)
    """How long to wait for an engine at the work item's ``min_policy_version`` before using any
    serving engine, seconds (staleness is then visible in the step versions)."""

    @model_validator(mode="before")
    @classmethod
    def _prompt_settings_live_in_prompt(cls, data: Any) -> Any:
        # Configs written before the prompt settings had their own section: say where they went.
        if isinstance(data, dict):
            moved = sorted(_MOVED_TO_PROMPT & set(data))
            if moved:
                raise ValueError(
                    f"{', '.join(moved)} moved to rollout.runner.prompt (e.g. rollout.runner.prompt.{moved[0]})"
                )
        return data


def resolve_runner(runner: RunnerConfig, model_path: str | Path | None) -> RunnerConfig:
    """``runner`` with its prompt's pixel bounds filled in from the checkpoint (see :meth:`PromptConfig.resolved`)."""
    return runner.model_copy(update={"prompt": runner.prompt.resolved(model_path)})


class SyncConfig(ConfigModel):
    """How new model versions reach the engines."""

    mode: Literal["decoupled", "coupled"] = "decoupled"
    """``decoupled``: a bounded fraction updates at a time while the rest serve; ``coupled``: every
    engine updates at once (the synchronous baseline)."""
    max_updating_fraction: float = Field(default=0.5, gt=0.0, le=1.0)
    """Most engines updating at once, as a fraction of all engines (at least one). In decoupled mode
    with two or more engines at least one engine always keeps serving, whatever the fraction."""
    cache_dir: str | None = None
    """Where fetched weights are kept for remote URIs; None uses a temporary directory."""
    keep_versions: int | None = Field(default=2, ge=1)
    """Versions left in ``cache_dir`` after each download, the newest (the one just fetched always among
    them); None keeps every one (a 7B version is 16.6 GB in bf16)."""
    retry_backoff_s: float = Field(default=1.0, gt=0.0)
    """Pause before retrying a version that some engine failed to load (or whose weights could not be
    fetched), seconds; doubles per consecutive failure. A newer version announced meanwhile goes first."""
    retry_backoff_max_s: float = Field(default=30.0, gt=0.0)
    """Longest pause between two tries of the same version, seconds."""


class PromptImagesConfig(ConfigModel):
    """Which resized prompt images go by reference, and where (see :mod:`dart.runtime.store.images`).

    They are stored beside the env service's screenshots and swept by the same retention, so ``dart run``
    fills in the env's prefix and refresh period where these are None.
    """

    inline_max_bytes: int | None = Field(default=16 * 1024, ge=0)
    """Largest resized image recorded inline in a step, bytes; larger ones are written to the artifact
    store once per distinct image and the step records an ``ImageRef``. None records every one inline."""
    prefix: str | None = None
    """Key prefix of the stored images; None: ``env.screenshot_prefix`` under ``dart run``, else
    ``screenshots``."""
    refresh_s: float | None = Field(default=None, gt=0)
    """A stored image is referenced only while its last write is younger than this, seconds (retention's
    ``image_grace_s`` must exceed it); None: ``env.screenshot_refresh_s`` under ``dart run``, else 600."""

    def offload(self, store: ArtifactStore | None) -> ImageOffload:
        """The offload these settings describe, writing to ``store`` (None keeps every image inline)."""
        return ImageOffload(
            store,
            self.inline_max_bytes,
            DEFAULT_PREFIX if self.prefix is None else self.prefix,
            refresh_s=DEFAULT_REFRESH_S if self.refresh_s is None else self.refresh_s,
            setting="rollout.prompt_images.inline_max_bytes",
        )


class RolloutConfig(ConfigModel):
    """The rollout service: engines, runners and weight sync."""

    engine: EngineConfig | None = None
    """The engine each of ``num_engines`` is (``kind: hf | vllm``); None when engines are passed in by code."""
    num_engines: int = Field(default=1, ge=1, le=64)
    """Engines to start from ``engine``; with ``vllm`` ``attach`` there is one engine per URL."""
    runners: int = Field(default=4, ge=1, le=4096)
    """Concurrent trajectory runners (each runs one trajectory at a time)."""
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    image_cache_mb: int = Field(default=256, ge=1, le=65536)
    """Bound of the cache of screenshots read by reference (shared by the runners), MiB."""
    prompt_images: PromptImagesConfig = Field(default_factory=PromptImagesConfig)
    """Which of the images the prompts were fed go in the trajectory by reference: a screenshot fed as
    captured keeps the env's form; one resized (``runner.prompt.image_size``) is a new PNG, sent by
    reference above ``inline_max_bytes`` (a 1920x1080 screen resized by the model's rule is hundreds of KB)."""
    sync: SyncConfig = Field(default_factory=SyncConfig)
    fetch_timeout_s: float = Field(default=1.0, gt=0.0, le=30.0)
    """Long-poll of one work fetch, seconds; also bounds how fast a stop is noticed."""
    in_progress_interval_s: float = Field(default=15.0, gt=0.0)
    """How often a running trajectory tells JetStream its work item is still in progress, seconds
    (well within the work consumer's ack_wait)."""
    gpu_sample_interval_s: float | None = Field(default=1.0, gt=0.0)
    """How often GPU utilization and memory are sampled through NVML into telemetry, seconds; None
    disables it. Without a GPU (or NVML) nothing is sampled."""
    stop_timeout_s: float = Field(default=30.0, ge=0.0)
    """On stop, how long running trajectories may finish before they are aborted, seconds (then
    :attr:`abort_window_s` more for the aborted ones to be published)."""
    publish_retry_s: float = Field(default=30.0, ge=0.0)
    """How long a trajectory's publish is tried again while JetStream refuses it (a stream electing its
    leader after a node died) before its work item is handed back, seconds."""

    @property
    def abort_window_s(self) -> float:
        """On stop, how long aborted trajectories have to be published after the finishing window, seconds."""
        return max(5.0, self.fetch_timeout_s * 2)

    @model_validator(mode="after")
    def _in_progress_within_the_ack_wait(self) -> RolloutConfig:
        # The work consumer redelivers an item whose runner stayed silent for its ack_wait.
        consumer = STREAMS["work"].consumer
        assert consumer is not None
        if self.in_progress_interval_s > consumer.ack_wait_s / 2:
            raise ValueError(
                f"in_progress_interval_s ({self.in_progress_interval_s}) must be at most half the work consumer's "
                f"ack_wait ({consumer.ack_wait_s} s), or a running trajectory's work item goes to another runner"
            )
        return self

    @model_validator(mode="after")
    def _engine_count_fits(self) -> RolloutConfig:
        if self.engine is not None:
            self.engine.engine_count(self.num_engines)
        return self
