"""Multi-process trainer: rank 0 runs the service and drives the other ranks with broadcast commands.

Only rank 0 talks to NATS and the artifact store. Before each collective operation it broadcasts a
command (``broadcast_object_list`` on the default group), and every other rank, in :func:`follow`,
makes the same backend calls:

- ``("train", [sample dicts])``: the shared RL update on the same samples (:func:`train_batch`: each
  rank rebuilds the inputs, then all agree that every rank could before any collective of the update);
- ``("publish",)``: gather what a version publishes (rank 0 publishes it): the full state dict, or the adapters;
- ``("save", path, version)`` / ``("load", path)``: distributed checkpoint;
- ``("stop",)``: leave the loop.

Nothing happens with one rank: :class:`Commander` is a no-op then.

Ranks never fall out of step over a batch: building inputs (reading screenshots, checking tokens against
images) can fail on one rank alone, e.g. a store read that failed there. Each rank catches its own
failure, then an ok flag is all-reduced (MIN) over the world; if any rank failed, every rank raises the
same :class:`~dart.train.errors.BatchSkippedError` (the lowest failing rank's reason) and none enters
the update. Rank 0's service terminates or naks the batch by that error's ``retryable``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from dart.protocol.messages import TrainingSample
from dart.train import collectives
from dart.train.batching import ModelInputs
from dart.train.checkpoint import load_checkpoint, save_checkpoint
from dart.train.config import TrainerConfig
from dart.train.errors import BatchSkippedError, ImageCorruptError, ImageFetchError, ImageMissingError, SampleError
from dart.train.update import RLUpdate, TrainStepMetrics

log = logging.getLogger("dart.train")


class Commander:
    """Rank 0's side: announce the next collective operation to the other ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def send(self, *command: Any) -> None:
        """Broadcast ``command`` (a picklable tuple) from rank 0; returns at once with one rank."""
        if collectives.needed(self.world_size):
            collectives.broadcast_object(command, src=0)


def receive() -> tuple[Any, ...]:
    """The next command from rank 0 (blocks until it is sent)."""
    command: tuple[Any, ...] = collectives.broadcast_object(None, src=0)
    return command


Reader = Callable[[TrainingSample], ModelInputs]
"""Builds one sample's model inputs (a :class:`~dart.train.update.SampleReader`)."""


def skip_reason(exc: Exception, rank: int) -> BatchSkippedError:
    """What a failure to build a batch's inputs on ``rank`` means for the batch: reason and whether to retry it."""
    if isinstance(exc, BatchSkippedError):
        return exc
    if isinstance(exc, SampleError):
        reason = "sample"
    elif isinstance(exc, ImageMissingError):
        reason = "image_missing"
    elif isinstance(exc, ImageCorruptError):
        reason = "image_corrupt"
    elif isinstance(exc, ImageFetchError):
        reason = "image_unavailable"
    else:
        reason = "error"
    permanent = isinstance(exc, SampleError) or (isinstance(exc, ImageFetchError) and exc.permanent)
    return BatchSkippedError(reason, rank, str(exc), retryable=not permanent)


def agree(failure: BatchSkippedError | None, world_size: int) -> BatchSkippedError | None:
    """The failure every rank acts on: None if no rank failed, else the lowest failing rank's (collective).

    Every rank must call it once per batch, failed or not: an ok flag is all-reduced (MIN) over the
    world, and only when it is 0 do the ranks exchange their reasons.
    """
    if not collectives.needed(world_size):
        return failure
    if collectives.min_int(0 if failure else 1) == 1:
        return None
    mine = None if failure is None else (failure.reason, failure.rank, failure.detail, failure.retryable)
    reasons = collectives.gather_objects(mine, size=world_size)
    reason, rank, detail, retryable = next(r for r in reasons if r is not None)
    return BatchSkippedError(reason, rank, detail, retryable=retryable)


def build_inputs(reader: Reader, samples: Sequence[TrainingSample], *, rank: int, world_size: int) -> list[ModelInputs]:
    """Every sample's inputs on this rank, once all ranks have built theirs (collective).

    Raises:
        BatchSkippedError: Some rank could not build its inputs; raised on every rank alike.
    """
    inputs: list[ModelInputs] = []
    failure: BatchSkippedError | None = None
    try:
        inputs = [reader(s) for s in samples]
    except Exception as exc:
        failure = skip_reason(exc, rank)
    agreed = agree(failure, world_size)
    if agreed is not None:
        raise agreed
    return inputs


def train_batch(
    backend: Any, config: TrainerConfig, reader: Reader, samples: Sequence[TrainingSample]
) -> TrainStepMetrics:
    """Build the inputs on this rank, agree with the others, run the shared update (same call on every rank).

    Raises:
        BatchSkippedError: Some rank could not build its inputs; nothing was updated on any rank.
    """
    inputs = build_inputs(reader, samples, rank=backend.rank, world_size=backend.world_size)
    return RLUpdate(backend, config).run(samples, inputs)


def follow(backend: Any, config: TrainerConfig, reader: Reader) -> None:
    """A non-main rank's loop: execute rank 0's commands until ``stop``."""
    while True:
        command = receive()
        kind = command[0]
        if kind == "train":
            samples = [TrainingSample.model_validate(s) for s in command[1]]
            try:
                train_batch(backend, config, reader, samples)
            except BatchSkippedError as exc:
                # Rank 0 raised the same error and reports it; this rank only notes its part.
                log.warning("rank %d: %s", backend.rank, exc)
            except Exception:
                # Rank 0 failed on the same batch the same way (same samples, same code): keep following.
                log.exception("rank %d: update failed", backend.rank)
        elif kind == "publish":
            backend.published_weights()
        elif kind == "save":
            save_checkpoint(backend, command[1], version=command[2])
        elif kind == "load":
            load_checkpoint(backend, command[1])
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown trainer command {kind!r}")
