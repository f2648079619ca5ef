"""Multi-process trainer: rank 0 runs the service and drives the other ranks with commands.

Only rank 0 talks to NATS and the artifact store. Before each collective operation it leaves a command on
the process group's store (torchrun's rendezvous store: ``dart/command/<n>``, numbered by the store's own
counter), and every other rank, in :func:`follow`, waits for the next number there and makes the same
backend calls. No rank waits inside a collective while rank 0 has nothing to do: an idle hour (engines
filling a batch at real scale) is not a collective timeout (``train.backend.collective_timeout_s`` bounds
the collectives of the work itself). Rank 0 removes a command two numbers later: every command but
``stop`` ends in a collective, so by then every follower has read it.

- ``("train", [sample dicts], min_samples)``: the shared RL update on the same samples (:func:`train_batch`:
  each rank builds its share of the inputs, then all agree on what trains before any collective of the
  update; see :mod:`dart.train.shares`);
- ``("publish",)``: gather what a version publishes (rank 0 publishes it): the full state dict, or the adapters;
- ``("save", path, version)`` / ``("load", path)``: distributed checkpoint;
- ``("load_published",)``: take the weights rank 0 read from a published version (a restart without a newer
  checkpoint; each rank receives its shards from rank 0), with fresh optimizer state;
- ``("stop",)``: leave the loop.

Nothing happens with one rank: :class:`Commander` is a no-op then.

Ranks never fall out of step over a batch: building inputs (reading screenshots, checking tokens against
images) can fail on one rank alone. The ranks agree on the outcome before the update
(:mod:`dart.train.shares`): the same samples dropped as unusable, or the same
:class:`~dart.train.errors.BatchSkippedError` raised everywhere, which rank 0's service terminates or naks
by its ``retryable``.
Inside the update, each step is agreed too (:mod:`dart.train.lockstep`): a failure on one rank raises the same
:class:`~dart.train.errors.RankFailureError` on every rank, so a follower notes it and waits for the next command.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dart.protocol.messages import TrainingSample
from dart.train import collectives
from dart.train.admission import admissible
from dart.train.checkpoint import load_checkpoint, save_checkpoint
from dart.train.config import TrainerConfig
from dart.train.errors import BatchSkippedError, RankFailureError, SampleError
from dart.train.shares import Reader, build_share
from dart.train.update import RLUpdate, TrainStepMetrics

log = logging.getLogger("dart.train")


COMMAND_PREFIX = "dart/command/"
WAIT_S = 60.0
"""How long a follower waits on the store at a time before waiting again (a wake-up, not a limit)."""


def _command_key(number: int) -> str:
    return f"{COMMAND_PREFIX}{number}"


class Commander:
    """Rank 0's side: announce the next collective operation to the other ranks. Instances share the
    numbering (it lives in the store), so the service may make one wherever it needs one."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def send(self, *command: Any) -> None:
        """Leave ``command`` (a picklable tuple) for the other ranks; returns at once (nothing to do with one rank)."""
        if self.world_size <= 1:
            return
        store = collectives.command_store()
        number = int(store.add(f"{COMMAND_PREFIX}count", 1)) - 1
        store.set(_command_key(number), pickle.dumps(command))
        if number >= 2:
            store.delete_key(_command_key(number - 2))


class CommandReader:
    """A follower's side: the commands in order, each waited for on the store without a timeout."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self.next = 0
        self.wait_s = wait_s

    def receive(self) -> tuple[Any, ...]:
        """The next command from rank 0 (blocks until it is sent, however long that takes)."""
        store, key = collectives.command_store(), _command_key(self.next)
        while True:
            try:
                store.wait([key], datetime.timedelta(seconds=self.wait_s))
                break
            except RuntimeError as exc:  # DistStoreError from TCP and hash stores, RuntimeError from file stores
                if "timeout" not in str(exc).lower():
                    raise  # not a wait that ran out: the store is gone
        # The store is the job's own rendezvous store: what is there was written by its rank 0.
        command: tuple[Any, ...] = pickle.loads(store.get(key))
        self.next += 1
        return command


def train_batch(
    backend: Any,
    config: TrainerConfig,
    reader: Reader,
    samples: Sequence[TrainingSample],
    min_samples: int | None = None,
) -> TrainStepMetrics:
    """Admit the samples, build this rank's share of their inputs, agree with the other ranks on what trains
    (:mod:`dart.train.shares`), then run the shared update (the same calls on every rank). The metrics count
    the samples dropped as unusable.

    Raises:
        BatchSkippedError: The batch cannot train (a rank could not read a sample, or too few are usable);
            nothing was updated on any rank.
        SampleError: Every sample was refused by admission (the same on every rank).
    """
    keep, refused = admissible(samples, config.max_abs_advantage)
    if not keep:
        raise SampleError(samples[0].trajectory_id, samples[0].step_index, f"every sample refused: {dict(refused)}")
    share = build_share(
        reader,
        [samples[i] for i in keep],
        rank=backend.rank,
        world_size=backend.world_size,
        dp_rank=backend.dp_rank,
        dp_size=backend.dp_size,
        mini_batches=config.mini_batches,
        min_samples=min_samples,
    )
    metrics = RLUpdate(backend, config).run(share.samples, share.inputs, share.owners)
    return replace(
        metrics,
        refused_samples=sum(refused.values()),
        dropped_samples=sum(share.dropped.values()),
        dropped_by_reason=share.dropped,
    )


def follow(backend: Any, config: TrainerConfig, reader: Reader, *, wait_s: float = WAIT_S) -> None:
    """A non-main rank's loop: execute rank 0's commands until ``stop``."""
    commands = CommandReader(wait_s)
    while True:
        command = commands.receive()
        kind = command[0]
        if kind == "train":
            samples = [TrainingSample.model_validate(s) for s in command[1]]
            try:
                train_batch(backend, config, reader, samples, command[2])
            except (BatchSkippedError, RankFailureError) as exc:
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
        elif kind == "load_published":
            backend.load_published({})  # rank 0 holds the weights and sends each rank its shards
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown trainer command {kind!r}")
