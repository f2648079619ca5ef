"""The ``megatron`` trainer backend: Qwen2.5-VL with a megatron-core language model, tensor-parallel.

Launch one process per rank with torchrun; every rank builds the backend with the same settings::

    torchrun --nproc-per-node 2 my_trainer.py        # in it:
    config = TrainerConfig(model_path="/ckpt/qwen", backend={"kind": "megatron", "tensor_parallel_size": 2})
    backend = MegatronBackend.create(config)
    logp, entropy = backend.forward_logprobs(inputs, temperature=1.0)   # every rank, same inputs per TP group
    (loss_of(logp)).backward()
    grad_norm = backend.optimizer_step()
    weights = backend.full_state_dict()          # Hugging Face names on rank 0, {} elsewhere

Layout: ``world_size = tensor_parallel_size * data_parallel_size``; the ranks of one TP group must be
fed the same sample (they each hold a slice of every layer), different DP groups different samples
(``data_parallel_rank`` / ``data_parallel_size`` say which share). Gradients are averaged over DP
ranks in :meth:`optimizer_step`, as DDP/FSDP do. Pipeline parallelism is not supported (see README).

Megatron's own DDP, distributed optimizer, schedules and grad-norm are CUDA-only; this backend uses
``torch.optim.AdamW``, its own loop and a TP-aware gradient norm instead, so it runs on CPU (gloo)
and on GPUs (NCCL) alike. With ``dtype: bfloat16`` the model computes in bfloat16 and AdamW updates
float32 master weights (:class:`~dart.train.precision.MasterWeights`, the torch backend's scheme);
gradients are averaged and clipped in float32, and checkpoints hold the masters.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dart.policy.models import MODEL_FAMILIES, family_of
from dart.train import collectives
from dart.train.batching import ModelInputs
from dart.train.config import MegatronBackendSettings, TrainerConfig
from dart.train.errors import CheckpointError, ParallelismError, TrainerError
from dart.train.interface import TrainerBackend
from dart.train.loss import behaviour_logprobs
from dart.train.megatron.convert import LMSpec, hf_to_megatron, is_language_model_key, megatron_to_hf
from dart.train.megatron.model import QwenVLMegatron, build_gpt, import_megatron, install_cpu_memory_buffer
from dart.train.optimizer import adamw
from dart.train.packing import pack, row_logprobs
from dart.train.precision import MasterWeights, needs_master_weights

_META = "megatron_meta.json"
_FORMAT = "dart-megatron-1"
VISUAL_PREFIX = "model.visual."
"""Where the vision tower's tensors sit in the Hugging Face state dict (it is not converted: the same module)."""


class MegatronBackend(TrainerBackend):
    """A Qwen2.5-VL policy whose language model is a tensor-parallel megatron-core GPTModel, with AdamW.

    Lifecycle: :meth:`create` (collective: every rank) -> per update, :meth:`forward_logprobs` and
    ``backward()`` as often as needed, then :meth:`optimizer_step` (collective) -> :meth:`full_state_dict`
    to publish, :meth:`save_checkpoint` / :meth:`load_checkpoint` to persist (collective) ->
    :meth:`close`. Not thread-safe.

    Attributes:
        step: Optimizer steps taken.
        rank, world_size, is_main: Global rank, world size, rank 0 (which publishes).
        tensor_parallel_size, tensor_parallel_rank: TP layout of this rank.
        data_parallel_size, data_parallel_rank: Which share of the samples this rank's TP group takes.
        model: The :class:`QwenVLMegatron` module.
        processor: The checkpoint's transformers processor.
        hf_config: The checkpoint's ``Qwen2_5_VLConfig``.
    """

    def __init__(self, config: TrainerConfig, model: QwenVLMegatron, processor: Any, device: torch.device) -> None:
        mcore = import_megatron()
        ps = mcore.parallel_state
        self.config = config
        self.image_source: Any = None
        self.model = model
        self.processor = processor
        self.hf_config = model.hf_config
        self.device = device
        self.step = 0
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.tensor_parallel_size = ps.get_tensor_model_parallel_world_size()
        self.tensor_parallel_rank = ps.get_tensor_model_parallel_rank()
        self.data_parallel_size = ps.get_data_parallel_world_size()
        self.data_parallel_rank = ps.get_data_parallel_rank()
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()
        self._tp_src = ps.get_tensor_model_parallel_src_rank()
        trainable = [p for p in model.parameters() if p.requires_grad]
        # Float32 masters for a low-precision model (AdamW on bfloat16 weights rounds updates of lr away).
        self.masters = MasterWeights(trainable) if needs_master_weights(getattr(torch, config.dtype)) else None
        # The tensors AdamW updates, whose gradients are averaged, measured and clipped.
        self.params: list[torch.nn.Parameter] = self.masters.masters if self.masters else trainable
        self.optimizer = adamw(self.params, config)

    @classmethod
    def load(cls, config: TrainerConfig, *, image_source: Any = None) -> MegatronBackend:
        """Build from the trainer config (the ``TrainerBackend`` constructor; collective, every rank).

        ``image_source`` is kept for the caller that rebuilds sample inputs (``backend.image_source``).

        Raises:
            TrainerError: ``loss.kl_coef > 0``: this backend keeps no reference model.
        """
        kl_coef = config.loss.kl_coef
        if kl_coef > 0.0:
            raise TrainerError(
                f"train.backend megatron keeps no reference model: set train.loss.kl_coef to 0 (got {kl_coef})"
            )
        backend = cls.create(config)
        backend.image_source = image_source
        return backend

    @classmethod
    def create(cls, config: TrainerConfig) -> MegatronBackend:
        """Build the backend on every rank: process groups, the model converted from ``config.model_path``.

        The layout is ``config.backend`` (``kind: megatron``); the optimizer, dtype, seed and threads are the
        trainer config's own settings.

        Uses the process group torchrun set up (``env://``), or a one-rank one; CUDA (NCCL, device
        ``LOCAL_RANK``) when available, else CPU (gloo).

        Raises:
            ParallelismError: The layout does not fit the world size or the model.
            TrainerError: ``config.backend`` is not the megatron backend's, or the checkpoint is of a model
                family it does not convert.
            FileNotFoundError: ``model_path`` holds no ``config.json``.
        """
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

        layout = config.backend
        if not isinstance(layout, MegatronBackendSettings):
            raise TrainerError(f"MegatronBackend needs train.backend.kind megatron, got {layout.kind}")
        path = Path(config.model_path)
        family = family_of(path)
        if not family.megatron:
            converted = [n for n in MODEL_FAMILIES.names() if MODEL_FAMILIES.get(n).megatron]
            raise TrainerError(
                f"train.backend megatron converts {', '.join(converted)} checkpoints only; {path} is "
                f"{family.name} (its deepstack vision features and interleaved rotary sections have no "
                "megatron-core conversion here): use train.backend torch or fsdp"
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # Megatron warns at every forward without it (it orders async TP all-reduces on GPUs).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        collectives.init_process_group(device.type, layout.collective_timeout_s)
        tp = layout.tensor_parallel_size
        world = dist.get_world_size()
        if tp < 1 or world % tp:
            raise ParallelismError(f"tensor_parallel_size {tp} does not divide the world size {world}")
        dtype = getattr(torch, config.dtype)
        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=dtype)
        LMSpec.from_hf_config(hf.config).check_tp(tp)

        mcore = import_megatron()
        ps = mcore.parallel_state
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=1,
            # Its groups (tensor- and data-parallel) time out as the world's does, in whole minutes.
            distributed_timeout_minutes=max(1, math.ceil(layout.collective_timeout_s / 60)),
        )
        if not cuda:
            install_cpu_memory_buffer()
        torch.manual_seed(config.seed)
        # On CPU the "inference" tracker avoids CUDA RNG states; attention forks it even with dropout 0.
        mcore.tensor_parallel.model_parallel_cuda_manual_seed(
            config.seed, inference_rng_tracker=not cuda, force_reset_rng=True
        )
        gpt = build_gpt(hf.config, tp, dtype, device)
        shard = hf_to_megatron(
            hf.state_dict(), LMSpec.from_hf_config(hf.config), ps.get_tensor_model_parallel_rank(), tp
        )
        _load_params(gpt, shard)
        model = QwenVLMegatron(hf, gpt, ps.get_tensor_model_parallel_group()).to(device)
        # No dropout anywhere; train mode changes nothing numerically but says what this module is for (and
        # the vision tower's activation checkpointing acts in train mode only).
        model.train()
        if config.activation_checkpointing:
            model.checkpoint_activations()
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)  # type: ignore[no-untyped-call]  # an unannotated transformers API
        return cls(config, model, processor, device)

    # --- forward ---------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: ranks of one TP group share it and must be fed the same samples."""
        return int(self.data_parallel_rank)

    @property
    def dp_size(self) -> int:
        """Data-parallel groups; the samples of a mini-batch are spread over them."""
        return int(self.data_parallel_size)

    @property
    def dp_group(self) -> Any:
        """The data-parallel group: one rank per TP group, over which per-sample figures are gathered."""
        return self._dp_group

    def forward_logprobs(
        self,
        inputs: ModelInputs,
        *,
        temperature: float = 1.0,
        excluded_token_ids: Sequence[int] = (),
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced ``(logp, entropy)`` of the response tokens, each ``(R,)`` float32, with grad when enabled.

        ``logp`` is of the sampling distribution (``softmax(logits / temperature)``, excluded ids masked,
        top-p nucleus; temperature 0 means temperature 1, excluded ids masked), ``entropy`` that of the raw
        temperature-1 distribution, computed by the loss module's shared code on the full-vocabulary
        logits. Collective over the TP group: its ranks must pass the same inputs.
        """
        start = inputs.prompt_len - 1  # position t predicts token t + 1
        logits = self.model(inputs, start, inputs.response_len)
        targets = inputs.input_ids[0, inputs.prompt_len :].to(self.device)
        return behaviour_logprobs(
            logits, targets, temperature=temperature, excluded_token_ids=excluded_token_ids, top_p=top_p
        )

    def forward_logprobs_many(
        self, rows: Sequence[ModelInputs], samplings: Sequence[Mapping[str, Any]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`forward_logprobs` of several rows: with ``train.packing`` one forward pass over them packed
        (:mod:`dart.train.packing`, a block-causal mask in the attention), else one per row. Collective over the
        TP group."""
        if not self.config.packing or len(rows) < 2:
            return super().forward_logprobs_many(rows, samplings)
        return row_logprobs(self.model.forward_packed(pack(rows, self.model.rope_owner)), rows, samplings)

    # --- optimization ----------------------------------------------------------------------------
    def grad_norm(self) -> float:
        """Global L2 norm of the gradients: TP-sharded parameters summed over the TP group, replicated ones once."""
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.tensor_parallel_size > 1:
            collectives.all_reduce(sharded, group=self._tp_group)
        return math.sqrt(float(sharded + replicated))

    def optimizer_step(self) -> float:
        """Average gradients over DP ranks, clip to ``grad_clip`` by the TP-aware global norm, AdamW step, clear.

        Collective over all ranks. Returns the pre-clip norm; ``step`` increases by one.
        """
        if collectives.needed(self.data_parallel_size):
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                collectives.all_reduce(p.grad, group=self._dp_group)
                p.grad.div_(self.data_parallel_size)
        norm = self.grad_norm()
        clip = self.config.grad_clip
        if clip is not None and math.isfinite(norm):
            coef = clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
            if coef < 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.copy_to_model()
        self.step += 1
        return norm

    # --- weights ---------------------------------------------------------------------------------
    def _gather_hf(self, tensors: dict[str, torch.Tensor], visual: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face tensors from this TP group's GPT shards (named like the GPT parameters); rank 0 only."""
        if self.data_parallel_rank != 0:
            return {}
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tensor_parallel_size)]
        for name in sorted(tensors):
            local = tensors[name].detach().contiguous()
            if self.tensor_parallel_size == 1:
                shards[0][name] = local.cpu()
                continue
            parts = collectives.all_gather(local, size=self.tensor_parallel_size, group=self._tp_group)
            for r, part in enumerate(parts):
                shards[r][name] = part.cpu()
        if not self.is_main:
            return {}
        out = megatron_to_hf(shards, self.model.spec)
        out.update({VISUAL_PREFIX + k: v.detach().cpu().contiguous() for k, v in visual.items()})
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full Hugging Face Qwen2.5-VL state dict (names of ``Qwen2_5_VLForConditionalGeneration.state_dict()``)
        on CPU, in ``dtype`` (what the engines serve), on rank 0; ``{}`` on the other ranks. Collective."""
        gpt = dict(self.model.gpt.named_parameters())
        weights = self._gather_hf(gpt, dict(self.model.visual.state_dict()))
        # megatron keeps its RMSNorm weights in float32 whatever the model's dtype.
        dtype = getattr(torch, self.config.dtype)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """The current gradients in Hugging Face layout and names (zeros where none), on rank 0. Collective."""

        def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
            return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in module.named_parameters()}

        return self._gather_hf(grads(self.model.gpt), grads(self.model.visual))

    # --- checkpoints -----------------------------------------------------------------------------
    def _shard_file(self, path: Path) -> Path:
        return path / f"megatron_tp{self.tensor_parallel_rank:02d}_of_{self.tensor_parallel_size:02d}.pt"

    def save_checkpoint(self, path: str | Path) -> None:
        """Write this layout's weights, AdamW moments and step under ``path`` (one file per TP rank). Collective."""
        path = Path(path)
        if self.data_parallel_rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            state = {
                "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items() if "_extra_state" not in k},
                "optimizer": self.optimizer.state_dict(),
                "masters": [m.detach().cpu() for m in self.masters.masters] if self.masters else None,
                "step": self.step,
            }
            target = self._shard_file(path)
            tmp = target.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, target)
        collectives.barrier(size=self.world_size)
        if self.is_main:
            meta = {"format": _FORMAT, "tensor_parallel_size": self.tensor_parallel_size, "step": self.step}
            (path / _META).write_text(json.dumps(meta))
        collectives.barrier(size=self.world_size)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore weights, AdamW moments and step written by :meth:`save_checkpoint` with the same TP size.

        Raises:
            CheckpointError: Missing files, another format, or another tensor-parallel size.
        """
        path = Path(path)
        meta_file = path / _META
        if not meta_file.is_file():
            raise CheckpointError(str(path), f"no {_META}: not a megatron backend checkpoint")
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != _FORMAT:
            raise CheckpointError(str(path), f"format {meta.get('format')!r}, expected {_FORMAT!r}")
        if meta.get("tensor_parallel_size") != self.tensor_parallel_size:
            raise CheckpointError(
                str(path),
                f"written with tensor_parallel_size {meta.get('tensor_parallel_size')}, this run uses "
                f"{self.tensor_parallel_size}; reshard through full_state_dict() (weights only) instead",
            )
        shard = self._shard_file(path)
        if not shard.is_file():
            raise CheckpointError(str(path), f"missing {shard.name}")
        state = torch.load(shard, map_location=self.device, weights_only=True)
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if "_extra_state" not in k]
        if missing or unexpected:
            raise CheckpointError(str(path), f"weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
        saved = state.get("masters")
        if saved is not None:
            # A low-precision run's float32 masters: the weights above were rounded, these resume exactly.
            with torch.no_grad():
                for p, value in zip(self.params, saved, strict=True):
                    p.copy_(value)
        elif self.masters is not None:
            # A float32 run's checkpoint: its weights, as loaded into this model, start the masters.
            self.masters.load([p.detach() for p in self.masters.params])
        if self.masters is not None:
            self.masters.copy_to_model()
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        collectives.barrier(size=self.world_size)

    def load_published(self, weights: dict[str, torch.Tensor]) -> None:
        """Take a published version's weights (the Hugging Face state dict :meth:`full_state_dict` gives) with
        fresh optimizer state; collective: rank 0 passes them, the other ranks ``{}``, and every rank converts
        its own tensor-parallel shard.

        Raises:
            CheckpointError: The weights do not fit the model (vision names checked on rank 0 before any
                collective; a missing language-model tensor on every rank alike).
        """
        visual_names = {VISUAL_PREFIX + k for k in self.model.visual.state_dict()}
        if self.is_main:
            missing = sorted(visual_names - set(weights))
            unexpected = sorted(k for k in weights if k not in visual_names and not is_language_model_key(k))
            if missing or unexpected:
                raise CheckpointError(
                    "published weights", f"do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
                )
        full = collectives.broadcast_tensors(weights if self.is_main else {}, size=self.world_size)
        try:
            shard = hf_to_megatron(full, self.model.spec, self.tensor_parallel_rank, self.tensor_parallel_size)
        except KeyError as exc:
            raise CheckpointError("published weights", f"do not fit the model: missing {exc}") from exc
        _load_params(self.model.gpt, shard)
        visual = {k.removeprefix(VISUAL_PREFIX): v for k, v in full.items() if k in visual_names}
        self.model.visual.load_state_dict(visual, strict=True)
        if self.masters is not None:  # the weights as loaded (in the model's dtype) start the masters
            self.masters.load([p.detach() for p in self.masters.params])
        self.optimizer.state.clear()

    def close(self) -> None:
        """Tear down megatron's process groups (the default group stays: torchrun's owner destroys it)."""
        mcore = import_megatron()
        if mcore.parallel_state.model_parallel_is_initialized():
            mcore.parallel_state.destroy_model_parallel()


def _load_params(gpt: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    """Copy converted tensors into the GPTModel's parameters; every parameter must be covered exactly."""
    params = dict(gpt.named_parameters())
    if set(params) != set(shard):
        raise ParallelismError(
            f"conversion and GPTModel disagree: only in model {sorted(set(params) - set(shard))[:4]}, "
            f"only in conversion {sorted(set(shard) - set(params))[:4]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != shard[name].shape:
                raise ParallelismError(f"{name}: model shape {tuple(p.shape)}, converted {tuple(shard[name].shape)}")
            p.copy_(shard[name])
