"""The ``torch`` trainer backend: one process, one device, a Qwen2.5-VL policy updated with step-wise GRPO + TIS.

Usage::

    backend = TorchBackend.load(TrainerConfig(model_path="/ckpt/tiny"), image_source=StoreImageSource(store))
    metrics = backend.train_step(batch)          # one optimizer step on one TrainingBatch
    logps = backend.compute_logprobs(samples)    # teacher-forced log-probs of the response tokens

Everything here is blocking (CPU/GPU work); asyncio callers run it in a worker thread.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dart.protocol.messages import TrainingBatch, TrainingSample
from dart.train.batching import ImageSource, InputBuilder, ModelInputs, StoreImageSource, decode_screenshot, pad_rows
from dart.train.config import TrainerConfig
from dart.train.errors import TrainerError
from dart.train.loss import LossConfig, grpo_loss, token_logprobs


@dataclass(frozen=True)
class TrainStepMetrics:
    """What one optimizer step did.

    Attributes:
        step: Optimizer steps taken so far, this one included.
        loss: The batch's token-mean GRPO loss.
        clip_fraction: Fraction of response tokens whose ratio was clipped.
        ratio_mean: Token-mean of ``exp(logp - logp_old)`` (1 on the first pass of a batch).
        tis_weight_mean: Token-mean truncated importance weight.
        tis_truncated_fraction: Fraction of tokens whose weight hit the cap.
        grad_norm: Global gradient L2 norm before clipping.
        tokens: Response tokens trained on.
        samples: Samples (steps) in the batch.
        rollout_mismatch: Token-mean ``|logp_old - logp_rollout|`` in nats: engine-vs-trainer numerics
            plus policy lag; near 0 for on-policy data served by the same weights.
        entropy: Token-mean entropy of the current policy on the response tokens, nats.
        advantage_mean: Mean sample advantage.
        duration_s: Wall time of the step, seconds.
        kl: k3 estimate of KL(policy || reference) before the step, when ``loss.kl_coef > 0``.
    """

    step: int
    loss: float
    clip_fraction: float
    ratio_mean: float
    tis_weight_mean: float
    tis_truncated_fraction: float
    grad_norm: float
    tokens: int
    samples: int
    rollout_mismatch: float
    entropy: float
    advantage_mean: float
    duration_s: float
    kl: float | None = None

    def as_dict(self) -> dict[str, float | int]:
        """Plain dict, for telemetry events."""
        return asdict(self)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


class TorchBackend:
    """A Qwen2.5-VL policy with its AdamW optimizer on one device.

    Lifecycle: ``loaded`` by :meth:`load` (step 0, weights of ``config.model_path``) -> each
    :meth:`train_step` (or :meth:`~dart.train.sft.sft_step`) takes one optimizer step and increments
    :attr:`step` -> :func:`~dart.train.checkpoint.save_checkpoint` / ``load_checkpoint`` persist and
    restore weights, optimizer moments and the step. Not thread-safe: one caller at a time.

    Args:
        config: Trainer configuration.
        model: A ``Qwen2_5_VLForConditionalGeneration``.
        processor: Its processor.
        image_source: Reads screenshot references (default: local ``file://`` URIs only).
    """

    def __init__(
        self, config: TrainerConfig, model: Any, processor: Any, image_source: ImageSource | None = None
    ) -> None:
        self.config = config
        self.model = model
        # The KL term compares against the initial policy: a frozen copy, kept only when it is used.
        self.ref_model: Any = None
        if config.loss.kl_coef > 0.0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.processor = processor
        self.image_source: ImageSource = image_source or StoreImageSource()
        self.loss_config: LossConfig = config.loss.to_loss_config()
        self.device = torch.device(config.device)
        self.dtype = _dtype(config.dtype)
        self.step = 0
        vision = getattr(model.config, "vision_config", None)
        self.inputs = InputBuilder(
            processor,
            image_token_id=int(model.config.image_token_id),
            merge_size=int(getattr(vision, "spatial_merge_size", 2)),
        )
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )

    @classmethod
    def load(cls, config: TrainerConfig, *, image_source: ImageSource | None = None) -> TorchBackend:
        """Load the policy and processor from ``config.model_path`` (a local directory; the hub is never used).

        Raises:
            FileNotFoundError: ``model_path`` holds no ``config.json``.
        """
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

        path = Path(config.model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no checkpoint at {path}: expected {path / 'config.json'}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            path, local_files_only=True, dtype=_dtype(config.dtype)
        )
        model.to(config.device)  # type: ignore[arg-type]  # transformers stubs mistype .to
        # Train mode only matters for dropout; Qwen2.5-VL has none, so log-probs match eval mode exactly.
        model.train()
        return cls(config, model, processor, image_source)

    # --- inputs and log-probs ---------------------------------------------------------------
    def sample_inputs(self, sample: TrainingSample) -> ModelInputs:
        """Model inputs of a recorded sample: its exact tokens and its screenshots fetched by reference.

        Raises:
            SampleError: Tokens and images disagree.
            ImageFetchError: A screenshot cannot be read or fails its digest.
        """
        images = [decode_screenshot(self.image_source(ref)) for ref in sample.images]
        return self.inputs.build(
            sample.prompt_token_ids,
            sample.response_token_ids,
            images,
            sample_id=(sample.trajectory_id, sample.step_index),
        )

    def raw_inputs(
        self, prompt_token_ids: Sequence[int], response_token_ids: Sequence[int], images: Sequence[Image.Image]
    ) -> ModelInputs:
        """Model inputs from token ids and the images exactly as the prompt was fed them (``ChatPrompt.images``)."""
        return self.inputs.build(prompt_token_ids, response_token_ids, [im.convert("RGB") for im in images])

    def forward_logprobs(self, inputs: ModelInputs, model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced ``(logp, entropy)`` of the response tokens, each ``(R,)`` float32.

        Runs with gradient when autograd is enabled; wrap in ``torch.no_grad()`` for evaluation.
        ``model`` defaults to the policy being trained (the reference model is the other use).
        """
        kwargs = inputs.kwargs(self.device, self.dtype)
        logits = (model or self.model)(**kwargs, use_cache=False).logits[0]
        # Position t predicts token t + 1: the response's R tokens are predicted by positions P-1 .. P+R-2.
        start = inputs.prompt_len - 1
        pred = logits[start : start + inputs.response_len]
        targets = kwargs["input_ids"][0, inputs.prompt_len :]
        return token_logprobs(pred, targets)

    def compute_logprobs(self, samples: Sequence[TrainingSample]) -> list[torch.Tensor]:
        """Current-policy log-probs of each sample's response tokens (no gradient), ``(R_i,)`` float32 on CPU."""
        with torch.no_grad():
            return [self.forward_logprobs(self.sample_inputs(s))[0].cpu() for s in samples]

    # --- optimization -------------------------------------------------------------------------
    def clip_and_step(self) -> float:
        """Clip the accumulated gradients, take an optimizer step, clear them; returns the pre-clip norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    def train_step(self, batch: TrainingBatch | Sequence[TrainingSample]) -> TrainStepMetrics:
        """One optimizer step of step-wise GRPO + TIS on a batch.

        ``logp_old`` is recomputed with the current weights before any update (so the PPO ratio starts
        at 1 and the TIS weight corrects the rollout/trainer mismatch); gradients of the token-mean
        loss accumulate over micro-batches, are clipped, and one AdamW step is taken.

        Raises:
            SampleError, ImageFetchError: A sample cannot be rebuilt (nothing was updated).
        """
        started = time.perf_counter()
        samples = list(batch.samples if isinstance(batch, TrainingBatch) else batch)
        if not samples:
            raise TrainerError("train_step needs at least one sample")
        inputs = [self.sample_inputs(s) for s in samples]
        with torch.no_grad():
            logp_old = [self.forward_logprobs(x)[0] for x in inputs]
            logp_ref = [self.forward_logprobs(x, self.ref_model)[0] for x in inputs] if self.ref_model else None
        rollout = [torch.tensor(s.rollout_logprobs, dtype=torch.float32, device=self.device) for s in samples]
        total_tokens = sum(x.response_len for x in inputs)
        token_weight = self._token_weights(samples, [x.response_len for x in inputs])
        mismatch = float(sum((o - r).abs().sum() for o, r in zip(logp_old, rollout, strict=True))) / total_tokens

        keys = ("loss", "clip_fraction", "ratio_mean", "tis_weight_mean", "tis_truncated_fraction")
        sums = dict.fromkeys(keys + (("kl",) if logp_ref is not None else ()), 0.0)
        entropy_sum = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        mbs = self.config.micro_batch_size
        for lo in range(0, len(samples), mbs):
            idx = range(lo, min(lo + mbs, len(samples)))
            outs = [self.forward_logprobs(inputs[i]) for i in idx]
            logp, mask = pad_rows([o[0] for o in outs])
            old, _ = pad_rows([logp_old[i] for i in idx])
            roll, _ = pad_rows([rollout[i] for i in idx])
            adv = torch.tensor([samples[i].advantage for i in idx], dtype=torch.float32, device=self.device)
            # Per-token weights ride in the mask: grpo_loss normalizes by the mask's sum, so it returns the
            # weighted mean over this micro-batch, and ``share`` scales it to its part of the batch total.
            weights = mask.to(self.device) * torch.tensor([token_weight[i] for i in idx], device=self.device)[:, None]
            ref = pad_rows([logp_ref[i] for i in idx])[0] if logp_ref is not None else None
            loss, metrics = grpo_loss(logp, old, roll, adv, weights, self.loss_config, logp_ref=ref)
            share = sum(token_weight[i] * inputs[i].response_len for i in idx)
            (loss * share).backward()
            for key in sums:
                sums[key] += metrics[key] * share
            entropy_sum += float(sum(o[1].detach().sum() for o in outs))
        grad_norm = self.clip_and_step()
        return TrainStepMetrics(
            step=self.step,
            loss=sums["loss"],
            clip_fraction=sums["clip_fraction"],
            ratio_mean=sums["ratio_mean"],
            tis_weight_mean=sums["tis_weight_mean"],
            tis_truncated_fraction=sums["tis_truncated_fraction"],
            grad_norm=grad_norm,
            tokens=total_tokens,
            samples=len(samples),
            rollout_mismatch=mismatch,
            entropy=entropy_sum / total_tokens,
            advantage_mean=sum(s.advantage for s in samples) / len(samples),
            duration_s=time.perf_counter() - started,
            kl=sums.get("kl"),
        )

    def _token_weights(self, samples: Sequence[TrainingSample], lengths: Sequence[int]) -> list[float]:
        """Weight of each token of each sample; the weights of all tokens of the batch sum to 1."""
        if self.config.loss_aggregation == "token_mean":
            total = sum(lengths)
            return [1.0 / total] * len(samples)
        per_traj: dict[str, int] = {}
        for s, n in zip(samples, lengths, strict=True):
            per_traj[s.trajectory_id] = per_traj.get(s.trajectory_id, 0) + n
        return [1.0 / (len(per_traj) * per_traj[s.trajectory_id]) for s in samples]

    # --- weights ------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """The model's state dict on CPU, contiguous and detached (what safetensors stores)."""
        return {k: v.detach().to("cpu").contiguous() for k, v in self.model.state_dict().items()}

    @property
    def base_model(self) -> str:
        """Name of the initial checkpoint (its directory name), recorded in weight manifests."""
        return Path(self.config.model_path).name
