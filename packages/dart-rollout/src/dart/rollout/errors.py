"""Exceptions raised by dart-rollout's service: env, engine routing and weight sync failures.

Each carries structured fields so the runner can map it to a trajectory status without parsing
messages (see :class:`dart.rollout.service.runner.TrajectoryRunner`).
"""

from __future__ import annotations

from dart.protocol.errors import DartError


class RolloutError(DartError):
    """Base class of rollout service errors."""


class EnvFailed(RolloutError):
    """The leased environment is gone for this episode (it crashed, the lease expired or was lost), or it
    refused to set the episode's task up.

    The episode cannot continue; report the trajectory as ``env_failed`` and lease again.

    Attributes:
        instance_id: The env instance, or None when no lease was obtained.
        code: The env service's error code (``env_failed``, ``expired``, ``not_found``; at a reset, any code,
            e.g. ``invalid_request`` for a task it cannot run), or ``timeout`` / ``no_responders`` /
            ``unavailable`` when the service did not answer in time.
        detail: What happened.
    """

    def __init__(self, instance_id: str | None, code: str, detail: str) -> None:
        self.instance_id = instance_id
        self.code = code
        self.detail = detail
        where = f"env instance {instance_id}" if instance_id else "env pool"
        super().__init__(f"{where} failed ({code}): {detail}; the episode ends as env_failed")


class ForkRefused(RolloutError):
    """The env pool would not fork a branch's parent episode; the instance is sound and still leased, so the
    work is answered as a normal rollout from the task's start.

    Attributes:
        reason: ``fork_unsupported``, ``fork_ended`` or ``fork_mismatch`` (see the env service).
        detail: What the env service said.
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"fork refused ({reason}): {detail}")


class NoEngineError(RolloutError):
    """No engine was serving within the router's deadline.

    Attributes:
        waited_s: How long the router waited, seconds.
        engines: How many engines the router knows.
    """

    def __init__(self, waited_s: float, engines: int) -> None:
        self.waited_s = waited_s
        self.engines = engines
        super().__init__(
            f"none of {engines} engines was serving within {waited_s:.3g}s: are they all updating or closed?"
        )


class NoEngineAtVersionError(RolloutError):
    """No engine can be held at a version for an evaluation.

    Attributes:
        version: The version asked for.
        served: Versions the free engines serve.
        held: Engines held or not serving.
    """

    def __init__(self, version: int, served: list[int], held: int) -> None:
        self.version = version
        self.served = served
        self.held = held
        why = "every engine is held or not serving" if not served else f"free engines serve versions {served}"
        super().__init__(f"no engine can serve version {version} for an evaluation: {why} ({held} held or down)")


class WeightFetchError(RolloutError):
    """New weights could not be fetched or did not match their announced sha256.

    Attributes:
        uri: The artifact URI of the weights.
        version: The policy version announced.
    """

    def __init__(self, uri: str, version: int, detail: str) -> None:
        self.uri = uri
        self.version = version
        self.detail = detail
        super().__init__(
            f"cannot fetch weights of version {version} from {uri}: {detail}. "
            "Engines keep serving their current version; republish the version with a correct uri/sha256."
        )


class ImageFetchError(RolloutError):
    """A screenshot sent by reference could not be read from the artifact store, or is not the image it names.

    The episode cannot build its prompt; the trajectory ends as ``env_failed`` (the env service
    published a reference it did not store, or the store is unreachable).

    Attributes:
        uri: The image's URI.
        detail: What went wrong.
    """

    def __init__(self, uri: str, detail: str) -> None:
        self.uri = uri
        self.detail = detail
        super().__init__(
            f"cannot read screenshot {uri}: {detail}. "
            "Give the rollout service the store config the env service writes to."
        )


class ImageStoreError(RolloutError):
    """A resized prompt image too large to travel inline could not be written to the artifact store.

    The step cannot be recorded as fed; the trajectory ends as ``env_failed`` (not the policy's doing).

    Attributes:
        detail: What the store said.
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(
            f"cannot store a prompt image: {detail}. Check the rollout service's store, or raise "
            "rollout.prompt_images.inline_max_bytes to send the images inline."
        )


class EngineError(RolloutError):
    """Base class of inference engine errors."""


class EngineClosedError(EngineError):
    """The engine was closed; send the request to another engine."""


class WeightUpdateError(EngineError):
    """New weights could not be loaded; the engine keeps serving its previous version.

    Attributes:
        version: The version that failed to load.
        missing: Parameter names the model has but the new weights lack.
        unexpected: Names in the new weights the model does not have.
    """

    def __init__(
        self, version: int, reason: str, missing: list[str] | None = None, unexpected: list[str] | None = None
    ):
        self.version = version
        self.missing = missing or []
        self.unexpected = unexpected or []
        super().__init__(
            f"cannot load weights for version {version}: {reason}"
            + (f"; missing {self.missing[:5]}" if self.missing else "")
            + (f"; unexpected {self.unexpected[:5]}" if self.unexpected else "")
            + ". The engine keeps serving its previous version; publish weights saved from this architecture."
        )


class EngineStartError(EngineError):
    """A vLLM server did not come up: it exited or did not answer ``/health`` in time (see its log)."""


class EngineUnavailableError(EngineError):
    """The vLLM server could not be reached or broke the connection (crashed, restarting, network)."""


class EngineRequestError(EngineError):
    """The vLLM server refused or failed a request (HTTP error status, aborted or malformed answer)."""
