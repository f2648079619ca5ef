"""Configuration of the trainer: optimizer, loss, publishing cadence, device.

A run's YAML composes it under ``train:``; every field can be overridden with ``DART_TRAIN__<FIELD>``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from dart.protocol.config import ConfigModel
from dart.protocol.registry import Registry
from dart.runtime.retry import RetryPolicy

Objective = Literal["tis", "decoupled"]


class LossConfig(ConfigModel):
    """Knobs of the GRPO objective (``train.loss``; see :mod:`dart.train.loss`)."""

    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Lower clip range of the ratio (ratio >= 1 - clip_low)."""
    clip_high: float = Field(default=0.28, ge=0.0)
    """Upper clip range of the ratio (ratio <= 1 + clip_high), DAPO's clip-higher."""
    tis_cap: float | None = Field(default=2.0, gt=0.0)
    """``tis``: truncation C of the rollout-to-trainer importance weight; None disables the correction."""
    kl_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the k3 KL estimate to the reference policy; 0 disables it (no reference model is kept)."""
    objective: Objective = "tis"
    """Off-policy correction: ``tis`` truncates the behaviour importance weight at ``tis_cap``;
    ``decoupled`` is AReaL's decoupled PPO, dropping tokens whose weight exceeds ``behav_cap``."""
    behav_cap: float | None = Field(default=5.0, gt=1.0)
    """``decoupled``: tokens whose behaviour importance weight exceeds this are dropped; None keeps every
    token. Above 1 (AReaL's constraint: a cap below 1 would drop on-policy tokens)."""


def _is_backend_class(obj: object) -> None:
    # Duck-typed: the TrainerBackend interface module imports this one.
    if not (isinstance(obj, type) and callable(getattr(obj, "load", None))):
        raise TypeError(f"a trainer backend must be a TrainerBackend subclass (with load), got {obj!r}")


TRAINER_BACKENDS: Registry[Any] = Registry(
    "trainer_backends", what="trainer backend", config_field="train.backend.kind", check=_is_backend_class
)
"""Trainer backends (:class:`~dart.train.interface.TrainerBackend` subclasses) by ``train.backend.kind``:
``torch``, ``fsdp``, ``megatron`` ship with dart-train; :mod:`dart.train.interface` re-exports it."""


class TorchBackendSettings(ConfigModel):
    """One process, one device (``train.device``)."""

    kind: Literal["torch"] = "torch"

    @property
    def world_size(self) -> int:
        """Processes the backend runs as."""
        return 1


class NodeSettings(ConfigModel):
    """Where the ranks of a multi-process backend run: one machine, or ``nnodes`` joined by torchrun's rendezvous.

    Every machine runs ``dart-train serve --config FILE`` with the same file except ``node_rank`` (set it per
    machine, e.g. ``DART_TRAIN__BACKEND__NODE_RANK=1``); each launches its own ranks with torchrun, and the
    ranks of all machines form one process group. Global rank 0 serves the trainer (consumes batches,
    publishes weights); every other rank follows it. With the ``static`` rendezvous global rank 0 is local
    rank 0 of node 0, which hosts the rendezvous store at ``rdzv_endpoint``; with ``c10d`` the rendezvous
    numbers the machines itself (any one may hold rank 0, so every machine must reach NATS and the store).
    """

    nnodes: int = Field(default=1, ge=1)
    """Machines the ranks span; 1 runs every rank here (torchrun ``--standalone``)."""
    node_rank: int = Field(default=0, ge=0)
    """This machine's index, ``0 .. nnodes-1`` (static rendezvous: node 0 holds global rank 0)."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the rendezvous (static: node 0's address and a free port there); needed to launch
    ``nnodes > 1`` (``dart run`` on a Ray cluster sets it per run: rank 0's node and a free port there)."""
    rdzv_backend: Literal["static", "c10d"] = "static"
    """torchrun's rendezvous: ``static`` (fixed node ranks, node 0 hosts the store) or ``c10d`` (the
    rendezvous assigns node ranks; the host of ``rdzv_endpoint`` keeps the store)."""
    rdzv_id: str = Field(default="dart-train", min_length=1)
    """Rendezvous id: the same on every machine of one trainer, different for two trainers sharing an endpoint."""
    rdzv_timeout_s: float = Field(default=900.0, gt=0.0)
    """How long a machine waits for the others to join (c10d; static waits on the store's timeout)."""
    collective_timeout_s: float = Field(default=1800.0, gt=0.0)
    """The process group's timeout: a collective (an all-reduce of gradients, a gather of a published state
    dict) that waits longer than this fails on every rank instead of hanging. Waiting for the next batch is
    not a collective (the ranks wait for rank 0's next command on the store), so idle time never counts;
    what must fit is the longest gap between two collectives of one update or publish (one micro-batch's
    forward and backward, a checkpoint's write)."""

    @model_validator(mode="after")
    def _nodes_fit(self) -> NodeSettings:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not below nnodes {self.nnodes}")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} is not host:port")
        if self.world_size % self.nnodes:
            raise ValueError(f"the world size {self.world_size} does not split evenly over nnodes {self.nnodes}")
        return self

    @property
    def world_size(self) -> int:
        """Processes the backend runs as, on all machines together."""
        raise NotImplementedError

    @property
    def nproc_per_node(self) -> int:
        """Ranks this machine launches."""
        return self.world_size // self.nnodes


class FsdpBackendSettings(NodeSettings):
    """PyTorch FSDP2: parameters, gradients and optimizer state sharded over the data-parallel ranks.

    Launched with torchrun when the world size exceeds 1 (``dart serve train`` / ``dart run`` do it); gloo on
    CPU, NCCL on GPU (rank r uses ``cuda:<local rank>``). ``nproc`` ranks per machine, ``nnodes`` machines.
    """

    kind: Literal["fsdp"] = "fsdp"
    nproc: int = Field(default=1, ge=1)
    """Ranks (processes) per machine; on GPU one per device."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """``bf16`` computes in bfloat16 with float32 master weights and gradient reduction (GPU only): the
    parameters are all-gathered in bfloat16 (half the traffic), the sharded float32 parameters are the masters
    AdamW updates."""
    prefetch: int = Field(default=1, ge=0)
    """Units whose all-gather a unit's forward (and backward) starts ahead of their turn, so communication
    overlaps compute: 1 starts the next decoder layer's (vision block's) while this one computes; 0 leaves
    FSDP's implicit order (each unit gathers when it is reached)."""

    @property
    def world_size(self) -> int:
        """Processes the backend runs as, on all machines together."""
        return self.nproc * self.nnodes


class MegatronBackendSettings(NodeSettings):
    """megatron-core: tensor- and data-parallel Qwen2.5-VL language model, vision tower from transformers.

    ``tensor_parallel_size * data_parallel_size`` ranks in all, split evenly over ``nnodes`` machines (a
    tensor-parallel group may span machines; keep it within one where the interconnect is faster).
    """

    kind: Literal["megatron"] = "megatron"
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Ranks one layer's weights are split over."""
    pipeline_parallel_size: int = Field(default=1, ge=1)
    """Pipeline stages: only 1 (refused at load otherwise; see the dart-train README)."""
    data_parallel_size: int = Field(default=1, ge=1)
    """Replicas of the tensor-parallel group; each takes its share of a mini-batch's samples."""

    @field_validator("pipeline_parallel_size")
    @classmethod
    def _no_pipeline(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                f"pipeline_parallel_size {value}: pipeline parallelism is not supported (the vision tower and "
                "the 3-D positions feed the first stage only, and megatron's pipeline schedules are CUDA-only); "
                "use tensor_parallel_size and data_parallel_size"
            )
        return value

    @property
    def world_size(self) -> int:
        """Processes the backend runs as, on all machines together."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


class PluginBackendSettings(NodeSettings):
    """A trainer backend another package registers (entry-point group ``dart.trainer_backends``).

    Its own settings travel as ``options``, which the backend validates when it loads; ``nproc`` and
    ``nnodes`` say how many ranks ``dart-train serve`` launches.
    """

    kind: str = Field(min_length=1)
    """The name the backend is registered under."""
    nproc: int = Field(default=1, ge=1)
    """Ranks (processes) per machine."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The backend's own settings."""

    @field_validator("kind")
    @classmethod
    def _registered(cls, kind: str) -> str:
        return TRAINER_BACKENDS.check_name(kind)

    @property
    def world_size(self) -> int:
        """Processes the backend runs as, on all machines together."""
        return self.nproc * self.nnodes


_BUILT_IN_BACKENDS = ("torch", "fsdp", "megatron")


def _backend_tag(value: Any) -> str:
    kind = value.get("kind", "torch") if isinstance(value, dict) else getattr(value, "kind", "torch")
    return str(kind) if kind in _BUILT_IN_BACKENDS else "plugin"


BackendSettings = Annotated[
    Annotated[TorchBackendSettings, Tag("torch")]
    | Annotated[FsdpBackendSettings, Tag("fsdp")]
    | Annotated[MegatronBackendSettings, Tag("megatron")]
    | Annotated[PluginBackendSettings, Tag("plugin")],
    Discriminator(_backend_tag),
]
"""``train.backend``: a built-in backend's settings, or a registered backend's (:class:`PluginBackendSettings`)."""


class RetentionConfig(ConfigModel):
    """What published weights and checkpoints are kept (see :mod:`dart.train.retention`)."""

    keep_last: int = Field(default=3, ge=2)
    """Newest weight versions always kept; at least 2, so the version engines may still be loading
    when the next is announced survives."""
    keep_every: int | None = Field(default=None, ge=1)
    """Also keep every version divisible by this (a sparse history to look back at, a full version's size
    each); None, the default, keeps no extra ones."""
    checkpoint_keep_last: int = Field(default=2, ge=1)
    """Newest ``step-<n>`` checkpoints kept."""
    enabled: bool = True
    """Delete what is not kept; False keeps everything."""


class PublishConfig(ConfigModel):
    """How weight versions are written (see :mod:`dart.train.publish`)."""

    shard_mib: float = Field(default=4096.0, gt=0.0)
    """Most tensor data per safetensors shard, MiB (2^20 bytes); a larger tensor gets a shard of its own.
    A version that fits is one ``model.safetensors``; the tiny test model always is."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype floating-point tensors are published in; None publishes them as the trainer holds them
    (``train.dtype``, float32 under fsdp). Set it to the engines' dtype (bfloat16 for engines serving
    bf16) to halve what each version writes and fetches."""
    concurrency: int = Field(default=2, ge=1)
    """Shards serialized, hashed and written at a time (each on its own thread: hashing and writing
    release the GIL, so a version of several shards uses that many cores)."""


LANGUAGE_MODEL_ATTENTION = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
"""The attention projections of a Qwen-VL language model (vision blocks excluded: their names hold ``visual``)."""
VISION_ATTENTION = r".*visual\.blocks\.\d+\.attn\.(qkv|proj)"
"""The attention projections of a Qwen-VL vision tower."""


class LoraSettings(ConfigModel):
    """LoRA training (``train.lora``): the base model stays frozen, low-rank adapters are trained and published.

    Each adapted linear ``W x`` becomes ``W x + (alpha / rank) * B A x``; ``B`` starts at zero, so step 0 is
    the base policy exactly. The KL reference is the base model itself with the adapters switched off (no
    second copy of the weights). Each version is the adapter alone (:class:`~dart.protocol.weights.AdapterSpec`).
    """

    rank: int = Field(default=8, ge=1, le=1024)
    """Rank ``r`` of each update."""
    alpha: int = Field(default=16, ge=1)
    """Scale numerator: updates are multiplied by ``alpha / rank``."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (0: the trainer's forward is exactly the engines')."""
    target_modules: str = LANGUAGE_MODEL_ATTENTION
    """Regular expression (full match) of the language-model modules to adapt; the default adapts the
    attention projections of every decoder layer."""
    adapt_vision: bool = False
    """Also adapt the vision tower's attention (``qkv``, ``proj``); false keeps the tower frozen."""

    def targets(self) -> str:
        """The full regular expression of adapted modules."""
        if not self.adapt_vision:
            return self.target_modules
        return f"(?:{self.target_modules})|(?:{VISION_ATTENTION})"


RUN_CHECKPOINT_EVERY = 10
"""``train.checkpoint_every`` under ``dart run`` when the config leaves it unset: optimizer steps."""


class TrainerConfig(ConfigModel):
    """Configuration of the ``torch`` trainer backend and the trainer service."""

    model_path: str = ""
    """Local checkpoint directory of the initial policy (``save_pretrained`` layout; never a hub id).
    Empty in a run config: ``dart run`` fills in the warm-started checkpoint."""
    lr: float = Field(default=1e-6, gt=0.0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    grad_clip: float | None = Field(default=1.0, gt=0.0)
    """Clip the global gradient L2 norm to this; None disables clipping (the norm is still reported)."""
    backend: BackendSettings = Field(default_factory=TorchBackendSettings)
    """Which trainer backend runs the model: ``torch``, ``fsdp`` or ``megatron`` (a bare name is accepted)."""
    micro_batch_size: int = Field(default=4, ge=1)
    """Samples per backward pass (per rank); gradients accumulate over a mini-batch's micro-batches. Each
    sample is its own forward pass, or with ``packing`` the micro-batch is one."""
    packing: bool = False
    """Run a micro-batch's samples as one packed row (:mod:`dart.train.packing`): no padding, the attention
    kept per sample, one forward pass where there were ``micro_batch_size``. Log-probs equal the unpacked
    ones up to the attention kernel's rounding. Every built-in backend packs."""
    logprob_micro_batch_size: int | None = Field(default=None, ge=1)
    """Samples per packed pass of the passes without gradient (``logp_old``, the KL reference): they keep
    no activations for a backward, so more fit than in a training micro-batch. None: ``micro_batch_size``.
    Used with ``packing`` only (unpacked, each sample is its own pass); halved on out of memory."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's and vision block's inputs in the forward pass and recompute the rest
    in the backward: activation memory of one layer instead of all, for about one more forward pass of
    compute, so larger micro-batches and longer samples fit. Gradients are unchanged (tested)."""
    optimizer_impl: Literal["auto", "for_loop", "foreach", "fused"] = "auto"
    """How AdamW runs its step: ``foreach`` (one kernel per operation over all tensors), ``fused`` (one kernel
    for the whole update, CPU or CUDA), ``for_loop`` (a kernel per tensor), or ``auto``, torch's choice
    (foreach on CUDA). The float32 masters are what it updates; the result is the same up to rounding."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each batch. From the second optimizer step of a batch on, the policy differs from the
    one ``logp_old`` was computed with, so the ratio leaves 1 and clipping acts."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer steps per epoch: the (selected) samples are split into this many mini-batches."""
    entropy_top_fraction: float = Field(default=1.0, gt=0.0, le=1.0)
    """Train on this fraction of steps, those with the highest exact mean token entropy (from the
    trainer's ``logp_old`` pass); 1.0 keeps all."""
    entropy_scope: Literal["batch", "trajectory"] = "batch"
    """Rank steps across the whole batch, or within each trajectory."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy-gradient objective."""
    loss_aggregation: Literal["trajectory_mean", "token_mean"] = "trajectory_mean"
    """How token losses are averaged over a batch. ``token_mean`` weights every token equally, so long
    trajectories (failures that ran to max_steps have the most steps) dominate the gradient with their
    negative advantages; ``trajectory_mean`` gives every trajectory the same total weight, spread over
    its steps' tokens, so successes and failures of a group count alike."""
    max_abs_advantage: float = Field(default=100.0, gt=0.0)
    """Samples whose advantage exceeds this in magnitude (or is not finite, or whose behaviour log-probs
    are not finite or above 0) are refused, counted in ``trainer.step``'s ``refused_samples``, and the rest
    of the batch is trained. GRPO's std-normalized advantages of a group of n stay within sqrt(n - 1)."""
    publish_every: int = Field(default=1, ge=1)
    """Publish new weights every this many optimizer steps (K)."""
    checkpoint_every: int | None = Field(default=None, ge=1)
    """Write a resumable checkpoint every this many optimizer steps; None writes one only at a clean stop
    (``dart run`` fills in :data:`RUN_CHECKPOINT_EVERY`)."""
    checkpoint_dir: str | None = None
    """Directory of resumable checkpoints (``step-<n>/`` under it), also written at a clean stop; needed
    when ``checkpoint_every`` is set (``dart run`` fills in ``<run_dir>/checkpoints``; a trainer started
    without one refuses to start)."""
    resume: Literal["latest_version", "refuse"] = "latest_version"
    """What a trainer does at start when the run already announced a newer version than its newest
    checkpoint holds (a restart without a checkpoint, or after an older one): ``latest_version`` loads that
    version's published weights from the store (fresh optimizer state; logged and recorded as
    ``trainer.resumed``) and numbers on from it; ``refuse`` does not start. Either way its older weights are
    never published under a newer number. Every built-in backend can (FSDP and megatron: rank 0 reads the
    version, each rank takes its shard)."""
    device: str = "cpu"
    """Torch device, ``cpu`` or ``cuda[:n]``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the model computes in and publishes (set it to the engines' dtype). Below float32 the torch and
    megatron backends keep float32 master weights for AdamW; fsdp takes float32 only (its bf16 compute is
    ``backend.mixed_precision``). float32 keeps recomputed log-probs within ~1e-5 of the hf engine's on CPU."""
    seed: int = 0
    """Seed of torch's RNG (dropout-free models are deterministic anyway)."""
    num_threads: int | None = Field(default=None, ge=1)
    """Torch intra-op CPU threads; None keeps torch's default."""
    weights_prefix: str = "weights"
    """Artifact-store key prefix of published weights (``<prefix>/v<version>/``: shards, index, manifest)."""
    publish: PublishConfig = Field(default_factory=PublishConfig)
    """Shard size and dtype of published weight versions."""
    lora: LoraSettings | None = None
    """Train LoRA adapters on the frozen base model and publish adapters (see :class:`LoraSettings`); None
    trains and publishes all weights."""
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    """Which published weight versions and checkpoints are kept."""
    image_reads: RetryPolicy = Field(default_factory=RetryPolicy)
    """Backoff of screenshot reads that fail with a transient store error (unreachable, I/O error, not
    found yet); a read still failing after ``attempts`` tries skips its batch on every rank."""
    debug_step_delay_s: float = Field(default=0.0, ge=0.0)
    """Test and benchmark knob: wait this long before each training step (counted as training time), so
    the trainer falls behind rollout and the staleness bounds act (``examples/smoke-slow-trainer.yaml``);
    0 in real runs."""

    @model_validator(mode="before")
    @classmethod
    def _backend_by_name(cls, data: Any) -> Any:
        # ``backend: fsdp`` is shorthand for ``backend: {kind: fsdp}``.
        if isinstance(data, dict) and isinstance(data.get("backend"), str):
            data = {**data, "backend": {"kind": data["backend"]}}
        return data

    @model_validator(mode="after")
    def _lora_on_the_torch_and_fsdp_backends(self) -> TrainerConfig:
        if self.lora is not None and self.backend.kind not in ("torch", "fsdp"):
            raise ValueError(
                f"train.lora is set but train.backend is {self.backend.kind}: LoRA training runs on the torch and "
                "fsdp backends (megatron-core has no adapter layers here)"
            )
        return self

    @model_validator(mode="after")
    def _collectives_outlast_a_step(self) -> TrainerConfig:
        timeout = getattr(self.backend, "collective_timeout_s", None)
        if timeout is not None and timeout <= self.debug_step_delay_s:
            raise ValueError(
                f"train.backend.collective_timeout_s {timeout:g} is not above train.debug_step_delay_s "
                f"{self.debug_step_delay_s:g}: the other ranks would time out in a collective while rank 0 waits "
                "before its step; raise train.backend.collective_timeout_s"
            )
        return self

    @model_validator(mode="after")
    def _megatron_has_no_reference_model(self) -> TrainerConfig:
        # Refused when the run starts rather than on every batch.
        if self.backend.kind == "megatron" and self.loss.kl_coef > 0.0:
            raise ValueError(
                f"train.loss.kl_coef is {self.loss.kl_coef} but train.backend megatron keeps no reference model: "
                "set train.loss.kl_coef to 0 or use train.backend torch"
            )
        return self
