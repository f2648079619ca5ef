"""Resumable trainer checkpoints: weights, optimizer moments, step and policy version in one directory.

Layout::

    <dir>/model.safetensors     model state dict
    <dir>/optimizer.pt          optimizer state dict (torch.save, loaded with weights_only=True)
    <dir>/trainer_state.json    {"step", "version", "model_path", "created_at"}

A checkpoint is written to a temporary sibling directory and renamed into place, so a crash mid-write
never leaves a half checkpoint under the final name.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dart.train.backend import TorchBackend
from dart.train.errors import CheckpointError

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class TrainerState:
    """Counters saved with a checkpoint.

    Attributes:
        step: Optimizer steps taken.
        version: Last published policy version.
        model_path: The initial checkpoint training started from.
        created_at: Unix time, seconds.
    """

    step: int
    version: int
    model_path: str
    created_at: float


def save_checkpoint(backend: TorchBackend, path: str | Path, *, version: int) -> TrainerState:
    """Write ``backend``'s weights, optimizer state and step, plus ``version``, to directory ``path``.

    An existing checkpoint at ``path`` is replaced.
    """
    from safetensors.torch import save_file

    final = Path(path)
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(backend.weights(), str(tmp / MODEL_FILE))
    torch.save(backend.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    state = TrainerState(
        step=backend.step, version=version, model_path=backend.config.model_path, created_at=time.time()
    )
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return state


def load_checkpoint(backend: TorchBackend, path: str | Path) -> TrainerState:
    """Restore weights, optimizer state and step from ``path`` into ``backend``; returns the saved counters.

    Raises:
        CheckpointError: Files are missing or the weights do not fit the model.
    """
    from safetensors.torch import load_file

    src = Path(path)
    missing = [n for n in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE) if not (src / n).is_file()]
    if missing:
        raise CheckpointError(str(src), f"missing {', '.join(missing)}; pass a directory written by save_checkpoint")
    weights = load_file(str(src / MODEL_FILE), device=str(backend.device))
    try:
        backend.model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(str(src), f"weights do not fit the model at {backend.config.model_path}: {exc}") from exc
    optimizer_state = torch.load(src / OPTIMIZER_FILE, map_location=backend.device, weights_only=True)
    backend.optimizer.load_state_dict(optimizer_state)
    state = TrainerState(**json.loads((src / STATE_FILE).read_text()))
    backend.step = state.step
    return state


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The ``step-<n>`` subdirectory of ``directory`` with the largest n, or None."""
    root = Path(directory)
    if not root.is_dir():
        return None
    steps = [(int(p.name.split("-", 1)[1]), p) for p in root.glob("step-*") if p.name.split("-", 1)[1].isdigit()]
    return max(steps)[1] if steps else None
