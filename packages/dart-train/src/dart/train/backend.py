"""The ``torch`` trainer backend: one process, one device, a Qwen2.5-VL policy and its AdamW optimizer.

Usage::

    backend = TorchBackend.load(TrainerConfig(model_path="/ckpt/tiny"), image_source=StoreImageSource(store))
    metrics = backend.train_step(batch)          # the shared RL update (dart.train.update) on one TrainingBatch
    logps = backend.compute_logprobs(samples)    # teacher-forced log-probs of the response tokens

Everything here is blocking (CPU/GPU work); asyncio callers run it in a worker thread.

With ``dtype: bfloat16`` (or float16) the model computes in that dtype, the one the engines serve, and
AdamW updates float32 master weights (:class:`~dart.train.precision.MasterWeights`): bfloat16 weights
updated in place would round updates of ``lr`` away. Checkpoints hold the masters.

With ``train.lora`` the model is wrapped with LoRA adapters (:mod:`dart.train.lora`): only they train (and
have masters), the KL reference is the same model with its adapters switched off, versions publish the
adapters alone, and checkpoints hold the adapters and their optimizer state.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dart.policy.models import family_of
from dart.protocol.messages import TrainingBatch, TrainingSample
from dart.protocol.weights import AdapterSpec
from dart.train.batching import ImageSource, ModelInputs, StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.errors import CheckpointError
from dart.train.interface import TrainerBackend
from dart.train.lora import adapter_state, add_adapters, spec_of
from dart.train.loss import behaviour_logprobs
from dart.train.optimizer import adamw
from dart.train.packing import pack, row_logprobs
from dart.train.precision import MasterWeights, needs_master_weights
from dart.train.tied import missing_are_tied, without_tied_aliases
from dart.train.update import RLUpdate, SampleReader, TrainStepMetrics

__all__ = ["TorchBackend", "TrainStepMetrics"]

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


def checkpoint_activations(model: Any, config: TrainerConfig) -> None:
    """With ``train.activation_checkpointing``, recompute each decoder layer's and vision block's activations in the
    backward pass (non-reentrant checkpointing, which FSDP and LoRA's frozen inputs work with)."""
    if config.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


class TorchBackend(TrainerBackend):
    """A Qwen2.5-VL policy with its AdamW optimizer on one device.

    Lifecycle: ``loaded`` by :meth:`load` (step 0, weights of ``config.model_path``) -> each
    :meth:`optimizer_step` (driven by :meth:`train_step` or :meth:`~dart.train.sft.sft_step`) increments
    :attr:`step` -> :func:`~dart.train.checkpoint.save_checkpoint` / ``load_checkpoint`` persist and
    restore weights, optimizer moments and the step. Not thread-safe: one caller at a time.

    Args:
        config: Trainer configuration.
        model: A ``Qwen2_5_VLForConditionalGeneration``; with a low-precision ``config.dtype`` its float32
            values (when given in float32) become the masters and it is cast to ``config.dtype``.
        processor: Its processor.
        image_source: Reads screenshot references (default: local ``file://`` URIs only).
    """

    def __init__(
        self, config: TrainerConfig, model: Any, processor: Any, image_source: ImageSource | None = None
    ) -> None:
        self.config = config
        self.dtype = _dtype(config.dtype)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.masters: MasterWeights | None = None
        if needs_master_weights(self.dtype):
            self.masters = MasterWeights(trainable)
            model.to(self.dtype)
        self.model = model
        # The KL term compares against the initial policy: a frozen copy, kept only when it is used (with
        # LoRA the base model is that policy: the adapters are switched off instead).
        self.ref_model: Any = None
        if config.loss.kl_coef > 0.0 and config.lora is None:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.processor = processor
        self.image_source: ImageSource = image_source or StoreImageSource()
        self.device = torch.device(config.device)
        self.step = 0
        self.rank, self.world_size, self.is_main = 0, 1, True
        self.reader = SampleReader(config, self.image_source, processor=processor)
        self.inputs = self.reader.builder
        # The tensors AdamW updates: the float32 masters, or the model's own float32 parameters.
        self.trainable: list[torch.nn.Parameter] = self.masters.masters if self.masters else trainable
        self.optimizer = adamw(self.trainable, config)

    @classmethod
    def load(cls, config: TrainerConfig, *, image_source: ImageSource | None = None) -> TorchBackend:
        """Load the policy and processor from ``config.model_path`` (a local directory; the hub is never used).

        Raises:
            FileNotFoundError: ``model_path`` holds no ``config.json``.
            ConfigError: The checkpoint belongs to no registered model family.
        """
        from transformers import AutoProcessor

        path = Path(config.model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no checkpoint at {path}: expected {path / 'config.json'}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)  # type: ignore[no-untyped-call]  # an unannotated transformers API
        # Loaded in float32 so the masters start from the checkpoint's exact values; __init__ casts the model.
        model = family_of(path).model_cls().from_pretrained(path, local_files_only=True, dtype=torch.float32)
        if config.lora is not None:
            model = add_adapters(model, config.lora)
        model.to(config.device)
        # Train mode only matters for dropout (Qwen2.5-VL has none, so log-probs match eval mode exactly) and for
        # activation checkpointing, which acts in train mode only.
        model.train()
        checkpoint_activations(model, config)
        return cls(config, model, processor, image_source)

    # --- inputs and log-probs ---------------------------------------------------------------
    def sample_inputs(self, sample: TrainingSample) -> ModelInputs:
        """Model inputs of a recorded sample: its exact tokens and its screenshots fetched by reference.

        Raises:
            SampleError: Tokens and images disagree.
            ImageFetchError: A screenshot cannot be read or fails its digest.
        """
        return self.reader(sample)

    def raw_inputs(
        self, prompt_token_ids: Sequence[int], response_token_ids: Sequence[int], images: Sequence[Image.Image]
    ) -> ModelInputs:
        """Model inputs from token ids and the images exactly as the prompt was fed them (``ChatPrompt.images``)."""
        return self.inputs.build(prompt_token_ids, response_token_ids, [im.convert("RGB") for im in images])

    def forward_logprobs(
        self,
        inputs: ModelInputs,
        *,
        temperature: float = 1.0,
        excluded_token_ids: Sequence[int] = (),
        top_p: float = 1.0,
        model: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced ``(logp, entropy)`` of the response tokens, each ``(R,)`` float32.

        ``logp`` is of the sampling distribution (see :func:`~dart.train.loss.behaviour_logprobs`), the
        entropy that of the raw distribution. Runs with gradient when autograd is enabled; wrap in
        ``torch.no_grad()`` for evaluation. ``model`` defaults to the policy being trained (the reference
        model is the other use).
        """
        kwargs = inputs.kwargs(self.device, self.dtype)
        # Position t predicts token t + 1: the response's R tokens are predicted by positions P-1 .. P+R-2,
        # the last R + 1 but one. Only those go through the head: a prompt's logits (P x vocabulary, gigabytes
        # for a screenshot prompt at a real vocabulary) are never made.
        response = inputs.response_len
        logits = (model or self.model)(**kwargs, use_cache=False, logits_to_keep=response + 1).logits[0]
        pred = logits[:response]
        targets = kwargs["input_ids"][0, inputs.prompt_len :]
        return behaviour_logprobs(
            pred, targets, temperature=temperature, excluded_token_ids=excluded_token_ids, top_p=top_p
        )

    def forward_logprobs_many(
        self, rows: Sequence[ModelInputs], samplings: Sequence[Mapping[str, Any]], *, model: Any = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`forward_logprobs` of several rows (``samplings[i]`` holds row i's sampling keywords): with
        ``train.packing`` one forward pass over the rows packed (:mod:`dart.train.packing`), else one per row."""
        if not self.config.packing or len(rows) < 2:
            return [self.forward_logprobs(x, model=model, **s) for x, s in zip(rows, samplings, strict=True)]
        packed = pack(rows, self._rope_owner())
        kwargs = packed.kwargs(self.device, self.dtype)
        keep = packed.kept_positions().to(self.device)
        logits = (model or self.model)(**kwargs, use_cache=False, logits_to_keep=keep).logits[0]
        return row_logprobs(logits, rows, samplings)

    def _rope_owner(self) -> Any:
        """The transformers module that computes the multimodal rope positions (``get_rope_index``)."""
        policy = self.model.get_base_model() if self.config.lora is not None else self.model
        return policy.model

    def reference_logprobs_many(
        self, rows: Sequence[ModelInputs], samplings: Sequence[Mapping[str, Any]]
    ) -> list[torch.Tensor]:
        """:meth:`reference_logprobs` of several rows, packed as :meth:`forward_logprobs_many` packs."""
        if self.config.lora is not None:
            with self.model.disable_adapter():
                return [logp for logp, _ in self.forward_logprobs_many(rows, samplings)]
        if self.ref_model is None:
            return super().reference_logprobs_many(rows, samplings)
        return [logp for logp, _ in self.forward_logprobs_many(rows, samplings, model=self.ref_model)]

    def reference_logprobs(self, inputs: ModelInputs, **sampling: Any) -> torch.Tensor:
        """Log-probs of the frozen initial policy (kept when ``loss.kl_coef > 0``) under the same sampling: the
        base model with its adapters switched off under LoRA."""
        if self.config.lora is not None:
            with self.model.disable_adapter():
                return self.forward_logprobs(inputs, **sampling)[0]
        if self.ref_model is None:
            return super().reference_logprobs(inputs, **sampling)
        return self.forward_logprobs(inputs, model=self.ref_model, **sampling)[0]

    def compute_logprobs(self, samples: Sequence[TrainingSample]) -> list[torch.Tensor]:
        """Current-policy behaviour log-probs of each sample's response tokens (no gradient), ``(R_i,)`` on CPU."""
        with torch.no_grad():
            out = []
            for s in samples:
                sp = s.sampling
                logp = self.forward_logprobs(
                    self.sample_inputs(s),
                    temperature=sp.temperature,
                    excluded_token_ids=sp.excluded_token_ids,
                    top_p=sp.top_p,
                )[0]
                out.append(logp.cpu())
            return out

    # --- optimization -------------------------------------------------------------------------
    def optimizer_step(self) -> float:
        """Clip the accumulated gradients, take an optimizer step, clear them; returns the pre-clip norm."""
        params = [p for p in self.trainable if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.copy_to_model()
        self.step += 1
        return norm

    clip_and_step = optimizer_step

    def train_step(self, batch: TrainingBatch | Sequence[TrainingSample]) -> TrainStepMetrics:
        """The shared RL update (:class:`~dart.train.update.RLUpdate`) on one batch.

        Raises:
            SampleError, ImageFetchError: A sample cannot be rebuilt (nothing was updated).
        """
        samples = list(batch.samples if isinstance(batch, TrainingBatch) else batch)
        inputs = [self.sample_inputs(s) for s in samples]
        return RLUpdate(self, self.config).run(samples, inputs)

    # --- weights and checkpoints --------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict on CPU, contiguous and detached (what safetensors stores), in ``config.dtype``:
        what the engines serve."""
        return {k: v.detach().to("cpu").contiguous() for k, v in self.model.state_dict().items()}

    weights = full_state_dict

    def published_weights(self) -> tuple[dict[str, torch.Tensor], AdapterSpec | None]:
        """What a version publishes: the adapters and their spec under LoRA, else the full state dict."""
        if self.config.lora is None:
            return self.full_state_dict(), None
        return adapter_state(self.model), spec_of(self.config.lora, self.base_model)

    def _checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of the model: every weight, or under LoRA the trainable (adapter) ones."""
        if self.config.lora is None:
            return self.full_state_dict()
        return {n: p.detach().to("cpu").contiguous() for n, p in self.model.named_parameters() if p.requires_grad}

    def _master_names(self) -> dict[str, torch.Tensor]:
        """State-dict name -> float32 master, for every parameter that has one."""
        if self.masters is None:
            return {}
        of = {id(p): m for p, m in zip(self.masters.params, self.masters.masters, strict=True)}
        return {n: of[id(p)] for n, p in self.model.named_parameters(remove_duplicate=False) if id(p) in of}

    def save_checkpoint(self, path: str | Path) -> None:
        """Write ``model.safetensors`` (float32 masters where the model computes in lower precision; under
        LoRA the adapters only) and ``optimizer.pt`` into directory ``path`` (created if missing)."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        weights = self._checkpoint_weights()
        for name, master in self._master_names().items():
            weights[name] = master.detach().to("cpu").contiguous()
        save_file(without_tied_aliases(weights), str(out / MODEL_FILE))
        torch.save(self.optimizer.state_dict(), out / OPTIMIZER_FILE)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore weights and optimizer state written by :meth:`save_checkpoint`.

        Raises:
            CheckpointError: Files are missing or the weights do not fit the model.
        """
        from safetensors.torch import load_file

        src = Path(path)
        missing = [n for n in (MODEL_FILE, OPTIMIZER_FILE) if not (src / n).is_file()]
        if missing:
            raise CheckpointError(
                str(src), f"missing {', '.join(missing)}; pass a directory written by save_checkpoint"
            )
        self._load_weights(load_file(str(src / MODEL_FILE), device=str(self.device)), str(src))
        self.optimizer.load_state_dict(torch.load(src / OPTIMIZER_FILE, map_location=self.device, weights_only=True))

    def load_published(self, weights: dict[str, torch.Tensor]) -> None:
        """Take a published version's weights (the full state dict, or under LoRA the adapters as peft names
        them) with fresh optimizer state.

        Raises:
            CheckpointError: The weights do not fit the model.
        """
        if self.config.lora is not None:
            from peft import set_peft_model_state_dict

            missing = sorted(set(adapter_state(self.model)) - set(weights))
            unexpected = list(set_peft_model_state_dict(self.model, weights).unexpected_keys)  # type: ignore[attr-defined]
            if missing or unexpected:
                raise CheckpointError(
                    "published adapter", f"does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
                )
            weights = self._checkpoint_weights()  # the adapters under the model's own names, for the masters
        self._load_weights({k: v.to(self.device) for k, v in weights.items()}, "published weights")
        self.optimizer.state.clear()

    def _load_weights(self, weights: dict[str, torch.Tensor], source: str) -> None:
        """Put ``weights`` (a checkpoint's or a published version's) into the model and its masters.

        Raises:
            CheckpointError: They do not fit the model.
        """
        try:
            result = self.model.load_state_dict(weights, strict=False)
        except RuntimeError as exc:
            raise CheckpointError(source, f"weights do not fit the model at {self.config.model_path}: {exc}") from exc
        if self.config.lora is not None:  # the frozen base comes from model_path; the adapters must all be here
            missing = sorted(set(self._checkpoint_weights()) - set(weights))
        else:
            missing = missing_are_tied(self.model, result.missing_keys)
        if missing or result.unexpected_keys:
            raise CheckpointError(
                source,
                f"weights do not fit the model at {self.config.model_path}: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}",
            )
        if self.masters is not None:
            # load_state_dict rounded the weights into the model; the masters take them exactly.
            named = self._master_names()
            by_master = {id(m): weights[n] for n, m in named.items() if n in weights}
            self.masters.load([by_master[id(m)] for m in self.masters.masters])

    @property
    def base_model(self) -> str:
        """Name of the initial checkpoint (its directory name), recorded in weight manifests."""
        return Path(self.config.model_path).name
