"""One rank's failure is every rank's: a step of the update runs on every rank, then the ranks agree on how it went.

A rank that raises inside the update (an out-of-memory error is the usual one: ranks hold different samples)
must not leave the others waiting in the next collective of the model. So each step of the update that can
fail on one rank alone (one row's forward pass with its log-probs, one micro-batch's loss and backward) goes
through :func:`together`: the step runs, then one MIN all-reduce of a status (2 ok, 1 out of memory, 0 any
other error) over every rank of the job. Where it is not ok, every rank raises the same
:class:`~dart.train.errors.RankFailureError` (the lowest failing rank's, gathered only then), at the same point,
and the caller clears what the step accumulated.

What this cannot catch: a rank that fails inside a collective of the model itself (midway through an FSDP
unit's all-gather or reduce-scatter, a tensor-parallel reduction) leaves the others in that collective; the
process group's timeout (``train.backend.collective_timeout_s``) ends them. An out-of-memory error usually comes
from the largest allocation of a step, the vocabulary-wide log-softmax of its log-probs, which runs between
the model's collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from dart.train import collectives
from dart.train.errors import RankFailureError

log = logging.getLogger("dart.train")

T = TypeVar("T")

OK, OUT_OF_MEMORY, ERROR = 2, 1, 0
"""A step's status on one rank; the ranks agree on the least."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error (``torch.OutOfMemoryError`` or a RuntimeError saying so)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def together(step: Callable[[], T], *, rank: int, world_size: int, what: str, micro_batch_size: int = 0) -> T:
    """Run ``step`` on this rank, then agree with every rank of the job on whether it went well (collective).

    Args:
        step: The work; may raise.
        rank: This rank (global).
        world_size: Ranks of the job; with one, nothing is exchanged (unless collectives are strict).
        what: What the step is, for the log (``"micro-batch"``, ``"logp_old"``).
        micro_batch_size: The micro-batch size the step ran at (0 where none applies), carried by the error.

    Raises:
        RankFailureError: ``step`` raised on some rank (this one or another): ``reason`` ``out_of_memory``
            where every failing rank ran out of memory, else ``error``; the same on every rank.
    """
    failure: BaseException | None = None
    result: T | None = None
    try:
        result = step()
    except Exception as exc:
        failure = exc
        log.error("rank %d: %s failed (%s): %s", rank, what, type(exc).__name__, exc)
    status = OK if failure is None else OUT_OF_MEMORY if is_out_of_memory(failure) else ERROR
    agreed = collectives.min_int(status) if collectives.needed(world_size) else status
    if agreed == OK:
        return result  # type: ignore[return-value]  # set: step() returned on this rank
    mine = None if failure is None else (rank, f"{type(failure).__name__}: {failure}")
    if collectives.needed(world_size):
        failed = [f for f in collectives.gather_objects(mine, size=world_size) if f is not None]
    else:
        failed = [mine] if mine is not None else []
    first_rank, detail = min(failed)
    reason = "out_of_memory" if agreed == OUT_OF_MEMORY else "error"
    raise RankFailureError(reason, first_rank, detail, what=what, micro_batch_size=micro_batch_size) from failure
