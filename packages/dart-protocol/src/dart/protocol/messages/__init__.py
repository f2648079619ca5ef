"""DART wire messages: pydantic v2 models with a ``kind`` discriminator and a schema version."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, TypeAdapter

from dart.protocol.messages.actions import (
    ACTION_ADAPTER,
    TERMINAL_ACTION_KINDS,
    Action,
    Click,
    DoubleClick,
    Drag,
    Fail,
    Finished,
    Hotkey,
    RightClick,
    Scroll,
    ScrollDirection,
    Type,
    Wait,
)
from dart.protocol.messages.base import (
    MAX_BATCH_GROUPS,
    MAX_BATCH_SAMPLES,
    MAX_PROMPT_TOKENS,
    MAX_RESPONSE_TOKENS,
    MAX_STEPS,
    SCHEMA_VERSION,
    ErrorCode,
    ErrorReply,
    Message,
    Value,
)
from dart.protocol.messages.codec import decode, encode
from dart.protocol.messages.env import (
    CapabilitiesRequest,
    EnvCapabilities,
    EvaluateReply,
    EvaluateRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseReply,
    LeaseRequest,
    ReleaseReply,
    ReleaseRequest,
    ResetReply,
    ResetRequest,
    StepReply,
    StepRequest,
)
from dart.protocol.messages.evaluation import EvalRequest, EvalResult, EvalTaskOutcome
from dart.protocol.messages.observation import Image, ImageRef, InlineImage, Observation
from dart.protocol.messages.sampling import Sampling, SamplingParams
from dart.protocol.messages.tasks import BranchSpec, PrefixStep, TaskSpec, WorkItem
from dart.protocol.messages.training import ModelVersion, TrainingBatch, TrainingSample
from dart.protocol.messages.trajectory import (
    TRAINABLE_STATUSES,
    BranchOrigin,
    StepRecord,
    StepTimings,
    Trajectory,
    TrajectoryStatus,
)

AnyMessage = Annotated[
    ErrorReply
    | LeaseRequest
    | LeaseReply
    | HeartbeatRequest
    | HeartbeatReply
    | ResetRequest
    | ResetReply
    | StepRequest
    | StepReply
    | EvaluateRequest
    | EvaluateReply
    | ReleaseRequest
    | ReleaseReply
    | CapabilitiesRequest
    | EnvCapabilities
    | WorkItem
    | Trajectory
    | TrainingBatch
    | ModelVersion
    | EvalRequest
    | EvalResult,
    Field(discriminator="kind"),
]
"""Every top-level wire message, discriminated by ``kind``."""

ANY_MESSAGE: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)
"""Decoder for any top-level message: ``decode(data, ANY_MESSAGE)``."""

__all__ = [
    "BranchOrigin",
    "BranchSpec",
    "PrefixStep",
    "MAX_BATCH_GROUPS",
    "MAX_BATCH_SAMPLES",
    "MAX_PROMPT_TOKENS",
    "MAX_RESPONSE_TOKENS",
    "MAX_STEPS",
    "ACTION_ADAPTER",
    "ANY_MESSAGE",
    "SCHEMA_VERSION",
    "Sampling",
    "SamplingParams",
    "TERMINAL_ACTION_KINDS",
    "TRAINABLE_STATUSES",
    "Action",
    "AnyMessage",
    "CapabilitiesRequest",
    "Click",
    "DoubleClick",
    "Drag",
    "EnvCapabilities",
    "ErrorCode",
    "ErrorReply",
    "EvalRequest",
    "EvalResult",
    "EvalTaskOutcome",
    "EvaluateReply",
    "EvaluateRequest",
    "Fail",
    "Finished",
    "HeartbeatReply",
    "HeartbeatRequest",
    "Hotkey",
    "Image",
    "ImageRef",
    "InlineImage",
    "LeaseReply",
    "LeaseRequest",
    "Message",
    "ModelVersion",
    "Observation",
    "ReleaseReply",
    "ReleaseRequest",
    "ResetReply",
    "ResetRequest",
    "RightClick",
    "Scroll",
    "ScrollDirection",
    "StepRecord",
    "StepReply",
    "StepRequest",
    "StepTimings",
    "TaskSpec",
    "Trajectory",
    "TrajectoryStatus",
    "TrainingBatch",
    "TrainingSample",
    "Type",
    "Value",
    "Wait",
    "WorkItem",
    "decode",
    "encode",
]
