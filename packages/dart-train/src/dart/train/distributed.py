"""Multi-process trainer: rank 0 runs the service and drives the other ranks with broadcast commands.

Only rank 0 talks to NATS and the artifact store. Before each collective operation it broadcasts a
command (``broadcast_object_list`` on the default group), and every other rank, in :func:`follow`,
makes the same backend calls:

- ``("train", [sample dicts])``: the shared RL update on the same samples (each rank rebuilds inputs);
- ``("publish",)``: gather the full state dict (rank 0 publishes it);
- ``("save", path, version)`` / ``("load", path)``: distributed checkpoint;
- ``("stop",)``: leave the loop.

Nothing happens with one rank: :class:`Commander` is a no-op then.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from dart.protocol.messages import TrainingSample
from dart.train.checkpoint import load_checkpoint, save_checkpoint
from dart.train.config import TrainerConfig
from dart.train.update import RLUpdate, SampleReader

log = logging.getLogger("dart.train")


class Commander:
    """Rank 0's side: announce the next collective operation to the other ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def send(self, *command: Any) -> None:
        """Broadcast ``command`` (a picklable tuple) from rank 0; returns at once with one rank."""
        if self.world_size > 1:
            dist.broadcast_object_list([command], src=0)


def receive() -> tuple[Any, ...]:
    """The next command from rank 0 (blocks until it is sent)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    command: tuple[Any, ...] = box[0]
    return command


def follow(backend: Any, config: TrainerConfig, reader: SampleReader) -> None:
    """A non-main rank's loop: execute rank 0's commands until ``stop``."""
    while True:
        command = receive()
        kind = command[0]
        if kind == "train":
            samples = [TrainingSample.model_validate(s) for s in command[1]]
            try:
                RLUpdate(backend, config).run(samples, [reader(s) for s in samples])
            except Exception:
                # Rank 0 failed on the same batch the same way (same samples, same code): keep following.
                log.exception("rank %d: update failed", backend.rank)
        elif kind == "publish":
            backend.full_state_dict()
        elif kind == "save":
            save_checkpoint(backend, command[1], version=command[2])
        elif kind == "load":
            load_checkpoint(backend, command[1])
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown trainer command {kind!r}")
