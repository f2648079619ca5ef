"""Resumable trainer checkpoints: weights, optimizer moments, step and policy version in one directory.

Layout::

    <dir>/...                   what the backend's save_checkpoint writes (torch: model.safetensors and
                                optimizer.pt; fsdp: a torch.distributed.checkpoint directory)
    <dir>/trainer_state.json    {"step", "version", "model_path", "created_at"}, written by the main rank

A checkpoint is written to a temporary sibling directory and renamed into place, so a crash mid-write
never leaves a half checkpoint under the final name.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dart.train import collectives
from dart.train.errors import CheckpointError

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


def _barrier(backend: Any) -> None:
    collectives.barrier(size=backend.world_size)


def save_checkpoint(backend: Any, path: str | Path, *, version: int) -> TrainerState:
    """Write ``backend``'s checkpoint plus its step and ``version`` to directory ``path`` (collective).

    An existing checkpoint at ``path`` is replaced. ``path`` must be on storage every rank sees.
    """
    final = Path(path)
    tmp = final.with_name(f".tmp-{final.name}")
    if backend.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(backend)
    backend.save_checkpoint(tmp)
    _barrier(backend)
    state = TrainerState(
        step=backend.step, version=version, model_path=backend.config.model_path, created_at=time.time()
    )
    if backend.is_main:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier(backend)
    return state


def load_checkpoint(backend: Any, path: str | Path) -> TrainerState:
    """Restore ``backend`` from ``path`` and set its step; returns the saved counters (collective).

    Raises:
        CheckpointError: Files are missing or the weights do not fit the model.
    """
    src = Path(path)
    if not (src / STATE_FILE).is_file():
        raise CheckpointError(str(src), f"missing {STATE_FILE}; pass a directory written by save_checkpoint")
    backend.load_checkpoint(src)
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
