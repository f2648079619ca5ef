"""Each rank's share of a batch's inputs: built where they are used, unusable samples dropped alike everywhere.

A sample's inputs (its decoded screenshots and pixel tensors: on the order of 100 MB of float32 at 1920x1080)
are built only by the data-parallel rank that owns it (:func:`~dart.train.update.owners_of`), and by the
other ranks of its tensor-parallel group, which compute it together. Building can fail in two ways:

- **The sample's own fault** (:class:`~dart.train.errors.SampleError`: tokens that disagree with the images;
  a screenshot missing or failing its digest): no redelivery can fix it, and it says nothing about the other
  samples. The sample is **dropped alone**. The batch trains on the rest when at least
  ``min(min_samples, len(batch))`` remain (``min_samples``: the size the data manager formed it for); the
  group baselines its advantages were computed with stay as they are.
- **Anything else** (the store unreadable through its retries, an unexpected error): the samples are fine and
  the batch is handed back whole (:class:`~dart.train.errors.BatchSkippedError`, retryable).

The ranks then agree (collective, every rank once per batch): one MIN all-reduce of an "all built" flag, and
only when some rank dropped a sample or failed, a gather of what each saw. Every rank ends with the same kept
samples, or raises the same :class:`~dart.train.errors.BatchSkippedError`. A rank left with no sample of its
own (a batch smaller than the data-parallel size, or its share all dropped) builds one kept sample's inputs
more, to run as a weight-0 row in step with the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dart.protocol.messages import TrainingSample
from dart.train import collectives
from dart.train.batching import ModelInputs
from dart.train.errors import BatchSkippedError, ImageCorruptError, ImageFetchError, ImageMissingError, SampleError
from dart.train.update import owners_of

log = logging.getLogger("dart.train")

Reader = Callable[[TrainingSample], ModelInputs]
"""Builds one sample's model inputs (a :class:`~dart.train.update.SampleReader`)."""


def skip_reason(exc: Exception, rank: int) -> BatchSkippedError:
    """What a failure to build a sample's inputs on ``rank`` means: reason and whether a redelivery could fix it."""
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


@dataclass(frozen=True)
class Share:
    """This rank's part of an agreed batch.

    Attributes:
        samples: The kept samples, in batch order (the same on every rank).
        owners: The data-parallel rank that owns each kept sample (the same on every rank).
        inputs: The inputs this rank built, by index into ``samples``: its own samples', or one spare.
        dropped: Samples dropped, by reason (the same on every rank).
    """

    samples: list[TrainingSample]
    owners: list[int]
    inputs: dict[int, ModelInputs]
    dropped: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Seen:
    """What one rank saw while building: positions it dropped (reason, detail), or the failure of the batch."""

    rank: int
    dropped: dict[int, tuple[str, str]]
    failure: tuple[str, str, bool] | None  # reason, detail, retryable


def _agree(seen: _Seen, world_size: int) -> list[_Seen]:
    """Every rank's :class:`_Seen` where some rank dropped or failed, else ``[]`` (collective)."""
    if not collectives.needed(world_size):
        return [seen] if seen.dropped or seen.failure else []
    if collectives.min_int(0 if seen.dropped or seen.failure else 1) == 1:
        return []
    return [s for s in collectives.gather_objects(seen, size=world_size) if s.dropped or s.failure]


def _raise_failure(seen: list[_Seen]) -> None:
    """Raise the lowest failing rank's failure, if any rank failed (the same on every rank)."""
    failed = [s for s in seen if s.failure is not None]
    if failed:
        first = min(failed, key=lambda s: s.rank)
        assert first.failure is not None
        reason, detail, retryable = first.failure
        raise BatchSkippedError(reason, first.rank, detail, retryable=retryable)


def _build(
    reader: Reader, samples: Sequence[TrainingSample], positions: Sequence[int], rank: int
) -> tuple[dict[int, ModelInputs], _Seen]:
    built: dict[int, ModelInputs] = {}
    dropped: dict[int, tuple[str, str]] = {}
    for p in positions:
        try:
            built[p] = reader(samples[p])
        except Exception as exc:
            skip = skip_reason(exc, rank)
            if skip.retryable:  # not the sample's fault: the whole batch goes back
                return {}, _Seen(rank, dropped, (skip.reason, skip.detail, True))
            dropped[p] = (skip.reason, skip.detail)
    return built, _Seen(rank, dropped, None)


def build_share(
    reader: Reader,
    samples: Sequence[TrainingSample],
    *,
    rank: int,
    world_size: int,
    dp_rank: int,
    dp_size: int,
    mini_batches: int,
    min_samples: int | None = None,
) -> Share:
    """Build this rank's share of ``samples`` and agree with the other ranks on what trains (collective).

    Raises:
        BatchSkippedError: A rank could not read a sample for a reason other than the sample's own (retryable),
            or too few samples are left (``too_few_samples``; every sample dropped: the first drop's reason);
            raised on every rank alike, before any update.
    """
    owners = owners_of(len(samples), mini_batches, dp_size)
    built, seen = _build(reader, samples, [p for p in range(len(samples)) if owners[p] == dp_rank], rank)
    agreed = _agree(seen, world_size)
    _raise_failure(agreed)
    drops: dict[int, tuple[str, str]] = {}
    for s in sorted(agreed, key=lambda s: s.rank):
        for p, why in s.dropped.items():
            drops.setdefault(p, why)
    kept = [p for p in range(len(samples)) if p not in drops]
    by_reason: dict[str, int] = {}
    for reason, _ in drops.values():
        by_reason[reason] = by_reason.get(reason, 0) + 1
    if drops:
        log.warning("rank %d: dropping %d unusable samples of %d: %s", rank, len(drops), len(samples), by_reason)
    needed = min(min_samples or 1, len(samples))
    if len(kept) < needed:
        reason, detail = drops[min(drops)]
        if kept:
            reason = "too_few_samples"
            detail = f"{len(kept)} of {len(samples)} samples usable, fewer than {needed} ({by_reason}; first: {detail})"
        raise BatchSkippedError(reason, rank, detail, retryable=False)
    renumber = {p: i for i, p in enumerate(kept)}
    share = Share(
        samples=[samples[p] for p in kept],
        owners=[owners[p] for p in kept],
        inputs={renumber[p]: x for p, x in built.items() if p in renumber},
        dropped=by_reason,
    )
    return _spare_rows(reader, share, rank=rank, world_size=world_size, dp_rank=dp_rank, dp_size=dp_size)


def _spare_rows(reader: Reader, share: Share, *, rank: int, world_size: int, dp_rank: int, dp_size: int) -> Share:
    """``share`` with one kept sample's inputs more on each rank that owns none (collective where any rank
    needs one: every rank can tell from the owners)."""
    needy = set(range(dp_size)) - set(share.owners)
    if not needy:
        return share
    built, seen = _build(reader, share.samples, [0] if dp_rank in needy else [], rank)
    if seen.dropped:  # a sample another rank just built: not its fault here, hand the batch back
        ((reason, detail),) = seen.dropped.values()
        seen = _Seen(rank, {}, (reason, detail, True))
    _raise_failure(_agree(seen, world_size))
    return Share(share.samples, share.owners, {**share.inputs, **built}, share.dropped)
