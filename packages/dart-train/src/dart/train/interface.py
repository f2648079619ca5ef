"""The seam between the trainer service / RL update and the model-parallel machinery: :class:`TrainerBackend`.

A backend owns the model, its optimizer and its process group; it knows nothing of batches, losses or
the bus. The shared RL update (:mod:`dart.train.update`) and the trainer service use only this
interface, so ``train.backend: torch | fsdp | megatron`` swaps the machinery without touching either.

Backends are found by ``train.backend.kind`` in :data:`TRAINER_BACKENDS` (entry-point group
``dart.trainer_backends``, see :mod:`dart.protocol.registry`): dart-train registers ``torch``, ``fsdp`` and
``megatron``; another package adds one by declaring an entry point to a :class:`TrainerBackend` subclass,
whose settings come as ``train.backend: {kind: <name>, nproc, nnodes, options: {...}}``. The class provides
``load(config, *, image_source=None)``.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dart.protocol.errors import ConfigError
from dart.protocol.weights import AdapterSpec
from dart.train.batching import ImageSource, ModelInputs
from dart.train.config import TRAINER_BACKENDS as TRAINER_BACKENDS
from dart.train.config import TrainerConfig
from dart.train.errors import TrainerError


class TrainerBackend(abc.ABC):
    """A policy with its optimizer, possibly spread over several processes.

    Lifecycle: loaded (step 0) -> repeated ``forward_logprobs`` (with gradient) ... ``optimizer_step``
    -> ``save_checkpoint`` / ``load_checkpoint`` persist and restore everything a resume needs.
    Every rank of a multi-process backend makes the same calls in the same order (collectives inside).

    Attributes:
        step: Optimizer steps taken.
        rank: This process's rank in the backend's process group (0 in one process).
        world_size: Processes of the backend.
        is_main: Whether this process consumes batches and publishes (rank 0).
    """

    step: int
    rank: int
    world_size: int
    is_main: bool

    @classmethod
    @abc.abstractmethod
    def load(cls, config: TrainerConfig, *, image_source: ImageSource | None = None) -> TrainerBackend:
        """Build the backend from the trainer config (collective: every rank of the backend calls it).

        Args:
            config: The trainer config; ``config.backend`` holds this backend's layout and settings.
            image_source: Where the screenshots of training samples are read (kept for the RL update).
        """

    @abc.abstractmethod
    def forward_logprobs(
        self,
        inputs: ModelInputs,
        *,
        temperature: float = 1.0,
        excluded_token_ids: Sequence[int] = (),
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced ``(logp, entropy)`` of the response tokens, each ``(R,)`` float32.

        ``logp`` is of the sampling distribution (see :func:`dart.train.loss.behaviour_logprobs`);
        ``entropy`` that of the raw temperature-1 distribution. With gradient when autograd is enabled.
        """

    @abc.abstractmethod
    def optimizer_step(self) -> float:
        """Clip accumulated gradients, step the optimizer, zero gradients, ``step += 1``; returns the pre-clip norm."""

    def zero_grad(self) -> None:
        """Drop every gradient accumulated since the last optimizer step (a failed micro-batch's): the optimizer's
        tensors' and the model's own (a backward cut short may leave some there)."""
        optimizer: Any = getattr(self, "optimizer", None)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        model: Any = getattr(self, "model", None)
        if model is not None:
            for param in model.parameters():
                param.grad = None

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full Hugging Face state dict on CPU (complete on the main rank; collective on all ranks)."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str | Path) -> None:
        """Write weights, optimizer state and step to directory ``path`` (collective)."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (collective)."""

    # --- optional, with defaults ------------------------------------------------------------------
    def load_published(self, weights: dict[str, torch.Tensor]) -> None:
        """Take a published version's weights (the full state dict, or a LoRA run's adapters) with fresh
        optimizer state: what a trainer that lost its checkpoint continues from (``train.resume``). Collective
        where the backend has several ranks: rank 0 passes the weights, the others ``{}``.

        Raises:
            ConfigError: This backend cannot (the default; the torch, fsdp and megatron backends can).
        """
        raise ConfigError(
            "TrainerConfig",
            "train.resume",
            f"latest_version loads published weights, which {type(self).__name__} cannot: set train.resume: "
            "refuse and keep checkpoints (train.checkpoint_every) so a restarted trainer resumes from one",
        )

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: ranks of equal ``dp_rank`` see the same samples (tensor parallelism)."""
        return self.rank

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks; samples of a mini-batch are spread over them."""
        return self.world_size

    @property
    def dp_group(self) -> Any:
        """Process group over which per-sample figures are gathered and summed (None: the default group)."""
        return None

    def published_weights(self) -> tuple[dict[str, torch.Tensor], AdapterSpec | None]:
        """What a new version publishes (collective): the full state dict and None, or an adapter's tensors
        and its :class:`~dart.protocol.weights.AdapterSpec` (backends that train adapters)."""
        return self.full_state_dict(), None

    def forward_logprobs_many(
        self, rows: Sequence[ModelInputs], samplings: Sequence[Mapping[str, Any]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`forward_logprobs` of several rows, ``samplings[i]`` holding row i's sampling keywords. Backends
        that pack (``train.packing``) run them as one forward pass; this default runs one pass per row."""
        return [self.forward_logprobs(x, **s) for x, s in zip(rows, samplings, strict=True)]

    def reference_logprobs_many(
        self, rows: Sequence[ModelInputs], samplings: Sequence[Mapping[str, Any]]
    ) -> list[torch.Tensor]:
        """:meth:`reference_logprobs` of several rows (one pass per row unless the backend packs)."""
        return [self.reference_logprobs(x, **s) for x, s in zip(rows, samplings, strict=True)]

    def reference_logprobs(self, inputs: ModelInputs, **sampling: Any) -> torch.Tensor:
        """Log-probs of the frozen initial policy (same sampling keywords as :meth:`forward_logprobs`), for
        ``loss.kl_coef > 0``; backends without one raise."""
        raise TrainerError(f"{type(self).__name__} keeps no reference model: set train.loss.kl_coef to 0")


def load_backend(config: TrainerConfig, *, image_source: ImageSource | None = None) -> Any:
    """Load the backend ``config.backend.kind`` names (call on every rank of a multi-process backend).

    Raises:
        TrainerError: The backend's module cannot be imported (a missing optional dependency), or no
            backend has that name.
    """
    try:
        backend = TRAINER_BACKENDS.get(config.backend.kind)
    except ConfigError as exc:
        raise TrainerError(str(exc)) from exc
    return backend.load(config, image_source=image_source)
