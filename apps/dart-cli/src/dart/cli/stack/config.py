"""The run config: one YAML file composing every service's config.

``dart run FILE`` resolves it (embedded servers, run directory, model path) and hands the resolved
file to each ``dart serve <service> --config`` process, so the services of a local run read exactly
what a distributed deployment reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from dart.cli.cluster.config import ClusterSection
from dart.data.config import DataConfig
from dart.env.service.config import EnvServiceConfig
from dart.policy.models import MODEL_FAMILIES
from dart.protocol.config import ConfigModel, command_line_overrides, load_config
from dart.protocol.errors import ConfigError, SuiteError
from dart.protocol.messages import Sampling, TaskSpec
from dart.rollout.engine.hf_config import HFEngineConfig
from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLoraConfig
from dart.rollout.service.config import EngineConfig, RolloutConfig
from dart.runtime.bus import BusConfig
from dart.runtime.serving import store_or_local
from dart.runtime.store import StoreConfig
from dart.runtime.telemetry import TelemetryConfig
from dart.train.config import LoraSettings, TrainerConfig

_STOP_MARGIN_S = 5.0
"""What the rollout service's stop needs beyond its finishing and abort windows (closing engines), seconds."""

ServiceName = Literal["env", "rollout", "data", "train"]
SERVICES: tuple[ServiceName, ...] = ("env", "data", "train", "rollout")
"""Start order: envs and data first (they own state), the trainer, then rollout (it pulls work)."""


class RunSection(ConfigModel):
    """What the run is and how long it lasts."""

    name: str = Field(default="run", pattern=r"^[A-Za-z0-9_-]+$")
    """Run name; also the NATS run token (streams are scoped to it)."""
    runs_root: Path = Path("runs")
    """Where run directories are created."""
    run_dir: Path | None = None
    """The run directory; set by ``dart run`` when it resolves the config."""
    rl_duration_s: float = Field(default=600.0, gt=0)
    """Wall time of the RL phase, seconds (after warm start, from when the rollout service is ready); with
    ``min_versions``, its least length."""
    min_versions: int = Field(default=0, ge=0)
    """The RL phase goes on past ``rl_duration_s`` until this many versions are published (a condition, not
    a wall-clock guess: a loaded machine trains slower but learns as much), up to ``max_rl_duration_s``. With a
    short ``rl_duration_s`` the versions decide the phase's length (the summary's ``rl_ended_by: versions``)."""
    max_rl_duration_s: float | None = Field(default=None, gt=0)
    """Hard limit of the RL phase when ``min_versions`` is not reached, seconds; None: 4 x ``rl_duration_s``."""
    ready_timeout_s: float = Field(default=900.0, gt=0)
    """How long the rollout service may take to start its engines (vLLM servers take minutes), seconds."""
    embedded_nats: bool = True
    """Start an embedded nats-server (``bus.url`` is then replaced by its URL)."""
    nats_auth: bool = True
    """Give the embedded nats-server one user per service with permissions limited to its subjects
    (random passwords in ``<run_dir>/secrets``); False lets any local client in."""
    artifacts: Literal["local", "embedded_s3"] = "local"
    """Where artifacts go when ``store`` is not set: ``local``, ``<run_dir>/artifacts``;
    ``embedded_s3``, bucket ``dart`` prefix ``artifacts`` of an embedded S3 server (SeaweedFS)
    keeping its data in ``<run_dir>/s3``, stopped at the end of the run (see docs/storage.md)."""
    gpus: int | None = Field(default=None, ge=0)
    """GPUs of the machine ``dart run`` places its processes on (``CUDA_VISIBLE_DEVICES`` per trainer, vLLM
    server and hf engine; see ``dart.cli.stack.placement``); None counts what torch sees. Declaring a count
    plans for that machine: a run that needs more is refused before it starts."""
    share_gpus: bool = False
    """Let processes share GPUs when the plan needs more than the machine has: each process still gets the GPUs
    it needs, distinct from each other, handed out again from the first once all are given (one GPU: the
    trainer and the hf engines on it). Memory is then shared too: a launched vLLM server's
    ``gpu_memory_utilization`` counts the whole GPU. False refuses such a run before it starts."""
    torch_threads: int = Field(default=1, ge=1)
    """Intra-op threads for each torch process (engines, trainer, warm start)."""
    stop_timeout_s: float = Field(default=60.0, gt=0)
    """How long services get to stop gracefully before they are killed."""
    max_restarts: int = Field(default=3, ge=0)
    """Restarts per service when one dies during the run (see ``dart.cli.stack.supervisor``); 0 fails the run
    at the first death."""
    restart_backoff_s: float = Field(default=2.0, gt=0)
    """Wait before restarting a service that died, seconds; doubled for each further death (at most 60)."""
    seed: int = 0


class ModelSection(ConfigModel):
    """Where the initial policy comes from."""

    path: Path | None = None
    """An existing local checkpoint of a registered model family (its ``config.json`` says which); None writes
    a tiny random one into the run directory."""
    family: str = "qwen2.5-vl"
    """Registered model family of the tiny checkpoint when ``path`` is None (``qwen2.5-vl``, ``qwen3-vl``)."""
    tiny_seed: int = 0
    """Seed of the tiny checkpoint when ``path`` is None."""

    @field_validator("family")
    @classmethod
    def _registered_family(cls, family: str) -> str:
        return MODEL_FAMILIES.check_name(family)


class WarmStartSection(ConfigModel):
    """Supervised warm start on oracle demonstrations, so RL starts from non-zero success."""

    enabled: bool | None = None
    """None: on for the tiny policy ``dart run`` writes, off when ``model.path`` names a checkpoint (its
    weights are not to be overwritten by SFT on sim demonstrations at ``lr``); true or false decides."""
    episodes_per_task: int = Field(default=1, ge=1)
    """Oracle episodes recorded per task of the suite."""
    steps: int = Field(default=60, ge=1)
    """SFT optimizer steps."""
    batch_size: int = Field(default=16, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    threads: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    """Torch threads of the SFT steps: ``auto`` measures 1, half and all of the cores on the steps themselves
    every 100 steps and runs on the fastest (a busy machine runs faster on fewer; see
    ``dart.cli.stack.warmstart_threads``); a number fixes it."""
    max_slowdown: float = Field(default=10.0, ge=1)
    """The guard against a stuck machine: the warm start is cut once its SFT steps have taken this many times
    their expected time (the median of the first 10 steps' times x ``steps``). A machine that stays as slow as
    it began takes every step; see ``dart.cli.stack.warmstart_guard``."""
    guard_floor_s: float = Field(default=600.0, gt=0)
    """The guard never cuts the warm start before this many seconds of SFT."""
    max_seconds: float | None = Field(default=None, gt=0)
    """A hard wall-clock limit on the SFT steps, seconds, on top of the guard: past it the warm start stops
    after the step in progress however fast the machine is. None: only the guard."""
    cache_dir: Path | None = None
    """Keep warm-started policies here, keyed by everything that determines them (model, suite, env,
    prompt settings, SFT settings, seeds, package versions; see ``dart.cli.stack.warmstart_cache``), and
    reuse one instead of warm-starting again. Only complete warm starts (all ``steps`` taken) are kept.
    The key does not cover DART's own source: clear the directory after changing the code. None: off."""


class ValidationSection(ConfigModel):
    """Held-out validation during ``dart run``: greedy evaluations of published versions.

    It hosts its own env pool in the ``dart run`` process (``instances`` slots of the run's env
    backend, pool ``pool``), so it never takes a training env slot. The episodes are served by the
    run's own engines (``engine`` unset: the rollout service holds one engine at the version under
    test for the evaluation, vLLM servers included) or by an eval engine of its own (``engine``).
    """

    enabled: bool = False
    engine: EngineConfig | None = None
    """None: the run's engines serve the evaluations. An engine config (``kind: hf`` with its device and
    dtype, or ``kind: vllm`` with ``launch`` or ``attach``): the validator starts that engine and serves
    them itself (its ``model_path`` is the run's policy)."""
    suite: str = "builtin:heldout"
    """Held-out suite (same forms as ``suite``); no task may equal a training task."""
    every_versions: int = Field(default=10, ge=1)
    """Evaluate version 0, then the newest version at least this many versions after the last
    one evaluated, and the final version after RL."""
    at_start: bool = True
    """Evaluate version 0 when RL starts; off when version 0 is known already (runs that share one
    warm-started policy, as ``benchmarks/ablation.py``'s): the validator then never competes with
    early RL for the machine's cores."""
    episodes_per_task: int = Field(default=1, ge=1)
    sampling: Sampling = Field(default_factory=lambda: Sampling(temperature=0.0))
    """How the validation episodes sample; temperature 0 (the default) is greedy."""
    instances: int = Field(default=4, ge=1, le=256)
    """Env instances of the validation pool (episodes in flight)."""
    pool: str = Field(default="heldout", pattern=r"^[A-Za-z0-9_-]+$")
    """Env pool name of the validation instances (distinct from ``env.pool``)."""
    final_timeout_s: float = Field(default=900.0, gt=0)
    """Longest wait for the evaluation of the final version after RL, seconds."""
    train_split: bool = False
    """Also evaluate the training suite (the tasks the pool can run), the same way, at version 0 (with
    ``at_start``) and at the final version: what RL changed on the tasks it trained on, beside the held-out
    figures (the summary's ``train_greedy`` and ``train_greedy_gain``; ``<run_dir>/train_greedy.jsonl``)."""


class RunConfig(ConfigModel):
    """Everything a run needs; each service reads its own section plus bus/store/telemetry."""

    run: RunSection = Field(default_factory=RunSection)
    bus: BusConfig = Field(default_factory=BusConfig)
    store: StoreConfig | None = None
    """Artifact store; None uses ``file://<run_dir>/artifacts``."""
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    model: ModelSection = Field(default_factory=ModelSection)
    warm_start: WarmStartSection = Field(default_factory=WarmStartSection)
    suite: str = "builtin:smoke"
    """Task suite: ``builtin:<name>`` for a shipped sim suite, ``builtin:miniwob/<name>`` for a
    shipped MiniWoB++ suite, ``builtin:osworld/local`` for the shipped OSWorld-format local-desktop
    tasks, ``osworld:<dir>`` for the tasks of an OSWorld task directory that this host's local
    desktop runs, or a suite file path. Its tasks must suit ``env.backend``."""
    max_steps: int | None = Field(default=None, ge=1, le=1000)
    """Step budget of every task of the run (``suite`` and ``validation.suite``), replacing each task's
    own (OSWorld's tasks say 15; the paper's agent had 30): the data manager's adaptive length
    (``data.curation``) works within it. None keeps each task's own."""
    env: EnvServiceConfig = Field(default_factory=EnvServiceConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainerConfig = Field(default_factory=TrainerConfig)
    """Trainer settings; ``model_path`` is filled in by ``dart run``."""
    validation: ValidationSection = Field(default_factory=ValidationSection)
    """Held-out validation during the run (off by default)."""
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    """Where ``dart run`` starts the services: its own processes, or a Ray cluster (``dart.cli.cluster``)."""

    @model_validator(mode="after")
    def _coupled_needs_a_version_per_batch(self) -> RunConfig:
        # The coupled emitter waits for the version trained on each round's one batch.
        if self.data.emission.enabled and self.data.emission.mode == "coupled" and self.train.publish_every != 1:
            raise ValueError(
                f"data.emission.mode 'coupled' needs train.publish_every: 1 (got {self.train.publish_every}): "
                "each round waits for the model version trained on its batch"
            )
        return self

    @model_validator(mode="after")
    def _env_requests_outlast_env_ops(self) -> RunConfig:
        # A slow backend must be reported by the env service (env_failed), not guessed at by a runner's timeout.
        request, op = self.rollout.runner.env_request_timeout_s, self.env.op_timeout_s
        if request <= op:
            raise ValueError(
                f"rollout.runner.env_request_timeout_s ({request}) must exceed env.op_timeout_s ({op}): the env "
                "service answers a slow step with env_failed only after its op timeout"
            )
        return self

    @model_validator(mode="after")
    def _rollout_stops_before_it_is_killed(self) -> RunConfig:
        # dart run kills a service still running run.stop_timeout_s after asking it to stop; the rollout
        # service first lets running trajectories finish (rollout.stop_timeout_s), then publishes the
        # aborted ones (its abort window). Unset, the finishing window shrinks to fit.
        rollout, limit = self.rollout, self.run.stop_timeout_s
        room = limit - rollout.abort_window_s - _STOP_MARGIN_S
        if "stop_timeout_s" not in rollout.model_fields_set:
            if rollout.stop_timeout_s > room:
                self.rollout = rollout.model_copy(update={"stop_timeout_s": max(0.0, room)})
        elif rollout.stop_timeout_s > room:
            raise ValueError(
                f"rollout.stop_timeout_s ({rollout.stop_timeout_s:g}) must leave room within run.stop_timeout_s "
                f"({limit:g}) for the abort window ({rollout.abort_window_s:g} s) and {_STOP_MARGIN_S:g} s more: "
                f"at most {max(0.0, room):g}, or raise run.stop_timeout_s"
            )
        return self

    @model_validator(mode="after")
    def _prompt_images_go_where_the_screenshots_go(self) -> RunConfig:
        # Resized prompt images are stored beside the env's screenshots, under the same refresh rule.
        images, env = self.rollout.prompt_images, self.env
        if images.prefix is None or images.refresh_s is None:
            filled = images.model_copy(
                update={
                    "prefix": env.screenshot_prefix if images.prefix is None else images.prefix,
                    "refresh_s": env.screenshot_refresh_s if images.refresh_s is None else images.refresh_s,
                }
            )
            self.rollout = self.rollout.model_copy(update={"prompt_images": filled})
        return self

    @model_validator(mode="after")
    def _screenshot_retention_agrees_with_the_env(self) -> RunConfig:
        # Retention deletes unreferenced images older than its grace period; the env service and the
        # rollout's prompt images refresh an image they hand out once it is older than their refresh period.
        retention, images = self.data.retention, self.rollout.prompt_images
        if not retention.enabled:
            return self
        writers = [
            ("env.screenshot_", self.env.screenshot_prefix, self.env.screenshot_refresh_s),
            ("rollout.prompt_images.", images.prefix, images.refresh_s),
        ]
        for section, prefix, refresh_s in writers:
            prefix_name, refresh_name = f"{section}prefix", f"{section}refresh_s"
            assert prefix is not None and refresh_s is not None  # filled in above
            if retention.screenshot_prefix.strip("/") != prefix.strip("/"):
                raise ValueError(
                    f"data.retention.screenshot_prefix ({retention.screenshot_prefix!r}) must be {prefix_name} "
                    f"({prefix!r}): retention sweeps where the images are stored"
                )
            if retention.image_grace_s <= refresh_s:
                raise ValueError(
                    f"data.retention.image_grace_s ({retention.image_grace_s}) must exceed {refresh_name} "
                    f"({refresh_s}): an image handed out just before its refresh would be deleted before its "
                    "trajectory arrives"
                )
        return self

    @model_validator(mode="after")
    def _runners_lease_from_the_env_pool(self) -> RunConfig:
        # env.pool owns the name: runners not given a pool lease from it. One given another pool would
        # wait out its lease timeout on every work item.
        runner = self.rollout.runner
        if "pool" not in runner.model_fields_set:
            self.rollout = self.rollout.model_copy(update={"runner": runner.model_copy(update={"pool": self.env.pool})})
        elif runner.pool != self.env.pool:
            raise ValueError(
                f"rollout.runner.pool ({self.rollout.runner.pool!r}) must be env.pool ({self.env.pool!r}): the "
                "runners lease the instances the run's env service serves"
            )
        return self

    @model_validator(mode="after")
    def _data_asks_the_env_pool(self) -> RunConfig:
        # env.pool owns the name: the data manager asks that pool which of the suite's tasks it runs.
        if "env_pool" not in self.data.model_fields_set:
            self.data = self.data.model_copy(update={"env_pool": self.env.pool})
        elif self.data.env_pool != self.env.pool:
            raise ValueError(
                f"data.env_pool ({self.data.env_pool!r}) must be env.pool ({self.env.pool!r}): the data manager "
                "emits the tasks the run's env pool runs"
            )
        return self

    @model_validator(mode="after")
    def _validation_pool_is_its_own(self) -> RunConfig:
        if self.validation.enabled and self.validation.pool == self.env.pool:
            raise ValueError(
                f"validation.pool must differ from env.pool ({self.env.pool!r}): it gets its own env slots"
            )
        return self

    @model_validator(mode="after")
    def _engines_serve_the_adapters(self) -> RunConfig:
        # A LoRA run publishes adapters: the hf engine applies them with peft, vLLM servers need LoRA enabled.
        lora = self.train.lora
        if lora is None:
            return self
        if self.rollout.engine is not None:
            engine = _serving_adapters(self.rollout.engine, lora)
            self.rollout = self.rollout.model_copy(update={"engine": engine})
        if self.validation.engine is not None:
            engine = _serving_adapters(self.validation.engine, lora)
            self.validation = self.validation.model_copy(update={"engine": engine})
        return self


def _serving_adapters(engine: EngineConfig, lora: LoraSettings) -> EngineConfig:
    """``engine`` set up to serve the adapter versions ``lora`` trains (vLLM: servers started with LoRA on).

    Raises:
        ValueError: The engine cannot serve them as the trainer computes them.
    """
    if isinstance(engine, HFEngineConfig):
        return engine
    if not isinstance(engine, VLLMEngineConfig):
        raise ValueError(f"train.lora publishes adapters, which the hf and vllm engines serve, not {engine.kind}")
    if lora.adapt_vision:
        raise ValueError(
            "train.lora.adapt_vision adapts the vision tower, which vLLM serves without LoRA (its answers would "
            "not be the trainer's): adapt the language model only, or use rollout.engine.kind hf"
        )
    if engine.lora is None:
        return engine.model_copy(update={"lora": VLLMLoraConfig(max_rank=lora.rank)})
    if engine.lora.max_rank < lora.rank:
        raise ValueError(
            f"rollout.engine.lora.max_rank ({engine.lora.max_rank}) is below train.lora.rank ({lora.rank})"
        )
    return engine


def warm_start_on(config: RunConfig) -> bool:
    """Whether the run warm-starts its policy (see :attr:`WarmStartSection.enabled`)."""
    enabled = config.warm_start.enabled
    return enabled if enabled is not None else config.model.path is None


def load_run_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a run config file: environment overrides ``DART_<SECTION>__<FIELD>`` apply, then ``KEY=VALUE``
    command-line ``overrides`` (``run.rl_duration_s=30``)."""
    return load_config(
        RunConfig, path, overrides=command_line_overrides(RunConfig, overrides), overrides_source="command line"
    )


def store_config(config: RunConfig) -> StoreConfig:
    """The artifact store of the run (the run directory's local store by default).

    Raises:
        ConfigError: Neither ``store`` nor ``run.run_dir`` is set (``dart run`` sets the run directory).
    """
    return store_or_local(config.store, config.run.run_dir, "run config")


def load_tasks(config: RunConfig) -> list[TaskSpec]:
    """The suite's tasks (see :func:`dart.protocol.suite.resolve_suite` for the forms of ``suite``).

    Raises:
        ConfigError: A ``builtin:`` suite that does not exist, a suite file that is missing or invalid, or
            tasks for another backend than ``env.backend`` (the env service could not run them).
    """
    from dart.protocol.suite import resolve_suite

    try:
        suite = resolve_suite(config.suite, max_steps=config.max_steps)
    except SuiteError as exc:  # a suite file that is missing or invalid: a config error like any other
        raise ConfigError("run config", "suite", str(exc)) from None
    wrong = sorted({t.backend for t in suite.tasks} - {config.env.backend})
    if wrong:
        raise ConfigError(
            "run config",
            "suite",
            f"suite {suite.name!r} has tasks for backend(s) {wrong}, but env.backend is {config.env.backend!r}",
        )
    return list(suite.tasks)
