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
    """A prompt screenshot could not be read from the artifact store, or its digest differs.

    Attributes:
        uri: The image's URI.
        detail: Why.
    """

    def __init__(self, uri: str, detail: str) -> None:
        self.uri = uri
        self.detail = detail
        super().__init__(f"cannot read screenshot {uri}: {detail}")


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
