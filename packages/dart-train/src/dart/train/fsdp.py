"""The ``fsdp`` trainer backend: PyTorch FSDP2 (``fully_shard``) over data-parallel ranks.

Each decoder layer and each vision block is its own FSDP unit, then the root (embeddings, final norm,
LM head, vision merger): parameters, gradients and AdamW moments are sharded across ranks, a unit's
parameters are all-gathered for its forward/backward and freed after. gloo on CPU, NCCL on GPU (rank r
on ``cuda:<LOCAL_RANK>``); with ``mixed_precision: bf16`` (GPU only) compute runs in bfloat16 while
master weights and gradient reduction stay float32.

With ``train.lora`` the adapters are added before sharding (:mod:`dart.train.lora`): the frozen base is sharded
beside them, only the adapters have gradients and moments, a version gathers the adapters alone, and a
checkpoint holds them and their optimizer state (the base comes from ``model_path``).

Launch: ``torchrun --nproc-per-node N`` (``dart serve train`` does it when ``train.backend.nproc > 1``, with
torchrun's rendezvous across machines when ``train.backend.nnodes > 1``);
without torchrun's environment the backend runs as a one-rank group. Checkpoints are
``torch.distributed.checkpoint`` directories (sharded, resharding on load); publishing gathers the full
Hugging Face state dict on rank 0 (CPU-offloaded), which the engines load unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dart.protocol.weights import AdapterSpec
from dart.train import collectives
from dart.train.backend import TorchBackend, _dtype, checkpoint_activations
from dart.train.batching import ImageSource
from dart.train.config import FsdpBackendSettings, TrainerConfig
from dart.train.errors import CheckpointError, TrainerError
from dart.train.lora import adapter_state, add_adapters, spec_of
from dart.train.tied import missing_are_tied


def prefetch(units: list[Any], depth: int) -> None:
    """Have each FSDP unit start the all-gathers of the next ``depth`` units in its forward (and of the ``depth``
    before it in its backward), so they overlap its compute; 0 leaves FSDP's implicit order."""
    if depth < 1:
        return
    for i, unit in enumerate(units):
        ahead, behind = units[i + 1 : i + 1 + depth], units[max(0, i - depth) : i][::-1]
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        if behind:
            unit.set_modules_to_backward_prefetch(behind)


class FsdpBackend(TorchBackend):
    """A Qwen2.5-VL policy sharded with FSDP2; see the module docstring. Same calls on every rank."""

    @classmethod
    def load(cls, config: TrainerConfig, *, image_source: ImageSource | None = None) -> FsdpBackend:
        """Join the process group, load ``config.model_path`` on every rank, shard it, build the optimizer.

        Raises:
            FileNotFoundError: ``model_path`` holds no ``config.json``.
            TrainerError: The settings cannot work (bf16 on CPU, a KL term, a rank count torchrun did not start,
                low-precision weights).
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoProcessor

        from dart.policy.models import family_of

        settings = config.backend
        if not isinstance(settings, FsdpBackendSettings):
            raise TrainerError(f"FsdpBackend needs train.backend.kind fsdp, got {settings.kind}")
        if config.loss.kl_coef > 0.0:
            raise TrainerError("train.backend fsdp keeps no reference model: set train.loss.kl_coef to 0")
        if config.dtype != "float32":
            # FSDP's float32 masters are its sharded parameters; AdamW on bfloat16 shards would round updates away.
            raise TrainerError(
                f"train.dtype {config.dtype} with train.backend fsdp would make AdamW update {config.dtype} "
                "weights: keep train.dtype float32 (the master weights) and set train.backend.mixed_precision "
                "bf16 to compute in bfloat16"
            )
        path = Path(config.model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no checkpoint at {path}: expected {path / 'config.json'}")
        device_type = torch.device(config.device).type
        if settings.mixed_precision == "bf16" and device_type != "cuda":
            raise TrainerError("train.backend.mixed_precision bf16 needs a GPU (train.device cuda)")
        rank, world, local_rank = collectives.init_process_group(device_type, settings.collective_timeout_s)
        if world != settings.world_size:
            raise TrainerError(
                f"train.backend wants {settings.world_size} ranks (nproc {settings.nproc} x nnodes "
                f"{settings.nnodes}) but {world} processes started: launch with dart-train serve on each machine"
            )
        device = torch.device(f"cuda:{local_rank}") if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)  # type: ignore[no-untyped-call]  # an unannotated transformers API
        model = family_of(path).model_cls().from_pretrained(path, local_files_only=True, dtype=_dtype(config.dtype))
        if config.lora is not None:
            model = add_adapters(model, config.lora)
        model.to(device)
        model.train()
        checkpoint_activations(model, config)
        kwargs: dict[str, Any] = {}
        if settings.mixed_precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = model.get_base_model() if config.lora is not None else model
        for block in policy.model.visual.blocks:
            fully_shard(block, **kwargs)
        for layer in policy.model.language_model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        for units in (list(policy.model.visual.blocks), list(policy.model.language_model.layers)):
            prefetch(units, settings.prefetch)
        backend = cls(config.model_copy(update={"device": str(device)}), model, processor, image_source)
        backend.rank, backend.world_size, backend.is_main = rank, world, rank == 0
        return backend

    def optimizer_step(self) -> float:
        """Clip the sharded gradients by their global norm, step AdamW on the shards; returns the pre-clip norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else float("inf")
        norm: Any = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        # The norm of DTensor gradients is a DTensor: materialize the (replicated) global value.
        value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return value

    clip_and_step = optimizer_step

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full Hugging Face state dict on CPU on rank 0 (``{}`` elsewhere); collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return {}
        # A model's state dict holds tensors only (get_model_state_dict's type allows any state value).
        return {k: v.contiguous() for k, v in full.items() if isinstance(v, torch.Tensor)}

    weights = full_state_dict

    def published_weights(self) -> tuple[dict[str, torch.Tensor], AdapterSpec | None]:
        """What a version publishes, on rank 0 (``{}`` elsewhere; collective): the full state dict, or under LoRA
        the adapters alone, gathered and named as peft saves them."""
        if self.config.lora is None:
            return self.full_state_dict(), None
        gathered = {}
        for name, param in self.model.named_parameters():
            if param.requires_grad:  # every rank, in the same order: each gather is a collective
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                if self.is_main:
                    gathered[name] = full.detach().to("cpu", copy=True)
        if not self.is_main:
            return {}, None
        return adapter_state(self.model, gathered), spec_of(self.config.lora, self.base_model)

    def load_published(self, weights: dict[str, torch.Tensor]) -> None:
        """Take a published version's weights with fresh optimizer state; collective: rank 0 passes what
        :meth:`published_weights` gave (the full state dict, or under LoRA the adapters as peft names them),
        every other rank ``{}``, and each rank receives its shards from rank 0.

        Raises:
            CheckpointError: The weights do not fit the model (raised on rank 0 before any collective; torchrun
                then ends the other ranks).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, Any] = dict(self._published_under_model_names(weights)) if self.is_main else {}
        # Not strict: a tied alias (lm_head of tied embeddings) or, under LoRA, the frozen base is absent.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(self.model, full, options=options)
        self.optimizer.state.clear()

    def _published_under_model_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``weights`` (a published version's) under the model's state-dict names, in its dtypes, checked to
        fit it: every weight but tied aliases, or under LoRA every adapter, each of the model's shape.

        Raises:
            CheckpointError: They do not fit.
        """
        local = self.model.state_dict()  # sharded tensors: names, global shapes and dtypes, no collective
        if self.config.lora is not None:
            from peft import get_peft_model_state_dict

            trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
            name_of = {id(p): n for n, p in trainable.items()}
            peft_to_model = {
                k: name_of[id(v)] for k, v in get_peft_model_state_dict(self.model, state_dict=trainable).items()
            }
            missing = sorted(set(peft_to_model) - set(weights))
            named = {peft_to_model.get(k, k): v for k, v in weights.items()}
            unexpected = sorted(k for k in weights if k not in peft_to_model)
        else:
            missing = missing_are_tied(self.model, set(local) - set(weights))
            named = dict(weights)
            unexpected = sorted(set(weights) - set(local))
        misshapen = sorted(k for k, v in named.items() if k in local and tuple(v.shape) != tuple(local[k].shape))
        if missing or unexpected or misshapen:
            raise CheckpointError(
                "published weights",
                f"do not fit the model at {self.config.model_path}: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}, another shape {misshapen[:5]}",
            )
        return {k: v.to(local[k].dtype) for k, v in named.items()}

    def _state_options(self) -> Any:
        """Checkpoints of a LoRA run hold the adapters: the frozen base comes from ``model_path``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        lora = self.config.lora is not None
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def save_checkpoint(self, path: str | Path) -> None:
        """Write sharded weights and optimizer state with ``torch.distributed.checkpoint`` (collective)."""
        from torch.distributed.checkpoint import state_dict_saver
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        state_dict_saver.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote, resharding to this world size (collective).

        Raises:
            CheckpointError: ``path`` holds no distributed checkpoint.
        """
        from torch.distributed.checkpoint import state_dict_loader
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if not (Path(path) / ".metadata").is_file():
            raise CheckpointError(
                str(path), "no torch.distributed.checkpoint metadata: not written by the fsdp backend"
            )
        options = self._state_options()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        # Loaded in place: dcp fills the tensors of the dicts it is given (and fails on one it lacks).
        state_dict_loader.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
        )
