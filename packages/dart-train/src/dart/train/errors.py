"""Exceptions raised by dart-train.

Each carries structured fields so callers (the trainer service) can count and route them; messages
say what to do.
"""

from __future__ import annotations

from dart.protocol.errors import DartError


class TrainerError(DartError):
    """Base class of trainer errors."""


class SampleError(TrainerError):
    """A training sample cannot be turned into model inputs (it is dropped, never retried).

    Attributes:
        trajectory_id: Trajectory of the bad sample.
        step_index: Its step.
        detail: What is wrong.
    """

    def __init__(self, trajectory_id: str, step_index: int, detail: str) -> None:
        self.trajectory_id = trajectory_id
        self.step_index = step_index
        self.detail = detail
        super().__init__(f"sample {trajectory_id}#{step_index} is unusable: {detail}")


class ImageFetchError(TrainerError):
    """A prompt screenshot could not be read from the artifact store.

    This class itself means the store stayed unreadable through every retry (unreachable, I/O errors)
    or cannot be used at all (credentials): the sample is fine, so its batch is handed back for
    redelivery. The subclasses are faults of the sample itself, which no redelivery can fix.

    Attributes:
        uri: The image's URI.
        detail: Why.
        permanent: Whether reading it again cannot succeed (the sample is unusable).
    """

    permanent: bool = False

    def __init__(self, uri: str, detail: str) -> None:
        self.uri = uri
        self.detail = detail
        super().__init__(f"cannot read screenshot {uri}: {detail}")


class ImageMissingError(ImageFetchError):
    """No object is stored at a screenshot's URI, still after retries (or the URI is not one a store can hold)."""

    permanent = True


class ImageCorruptError(ImageFetchError):
    """A screenshot's bytes do not hash to the sha256 its reference records."""

    permanent = True


class BatchSkippedError(TrainerError):
    """A batch was not trained, on any rank, because building its inputs failed on (at least) one rank.

    Every rank raises the same error (the failure of the lowest failing rank), so all of them skip the
    batch together and none waits in a collective the others never join.

    Attributes:
        reason: ``sample`` (a sample's tokens and images disagree), ``image_missing``, ``image_corrupt``
            (permanent: redelivery cannot fix them), ``image_unavailable`` (the store stayed unreadable
            through the retries) or ``error`` (anything else; both transient).
        rank: The rank whose failure this is.
        detail: That rank's error message.
        retryable: Whether the batch may train if delivered again (the service naks it) or not (the
            service terminates it).
    """

    def __init__(self, reason: str, rank: int, detail: str, *, retryable: bool) -> None:
        self.reason = reason
        self.rank = rank
        self.detail = detail
        self.retryable = retryable
        super().__init__(f"batch skipped on every rank ({reason} on rank {rank}): {detail}")


class RankFailureError(TrainerError):
    """A step of the update failed on (at least) one rank: every rank raises the same error at the same point,
    and nothing of the failed step is applied (no optimizer step; its gradients are cleared).

    Attributes:
        reason: ``out_of_memory`` (every failing rank ran out of memory) or ``error`` (anything else).
        rank: The lowest failing rank.
        detail: That rank's error (type and message).
        what: The step (``micro-batch``, ``logp_old``).
        micro_batch_size: The micro-batch size the step ran at (0 where none applies).
        retryable: Whether the batch may train if delivered again (the service naks it) or not (the service
            terminates it): an out-of-memory error that halving ``train.micro_batch_size`` down to 1 did not
            cure is not.
    """

    def __init__(
        self,
        reason: str,
        rank: int,
        detail: str,
        *,
        what: str = "micro-batch",
        micro_batch_size: int = 0,
        retryable: bool = True,
        advice: str = "",
    ) -> None:
        self.reason = reason
        self.rank = rank
        self.detail = detail
        self.what = what
        self.micro_batch_size = micro_batch_size
        self.retryable = retryable
        at = f" at micro-batch size {micro_batch_size}" if micro_batch_size else ""
        super().__init__(f"{what} failed on every rank ({reason} on rank {rank}{at}): {detail}{advice}")


class CheckpointError(TrainerError):
    """A checkpoint directory is missing, incomplete or belongs to another model.

    Attributes:
        path: The checkpoint directory.
        detail: What is wrong.
    """

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"checkpoint {path}: {detail}")


class ParallelismError(TrainerError):
    """A parallel layout the model or backend cannot run (a size that does not divide the model, an
    unsupported kind of parallelism, a checkpoint written with another layout)."""
