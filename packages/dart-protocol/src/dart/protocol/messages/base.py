"""Base types shared by every DART message.

A message is a frozen pydantic model with a ``kind`` discriminator and a ``schema_version``.
Messages are strict (no type coercion) and closed (unknown fields are rejected), so a sender
built against another schema version fails loudly at the receiver instead of being misread.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION: Final = 1
"""Wire schema version. Bump on any incompatible change; receivers reject other versions."""

NonEmptyStr = Annotated[str, Field(min_length=1, max_length=512)]
"""An identifier-like string: non-empty, bounded."""

UnitFloat = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
"""A float in [0, 1], e.g. a normalized screen coordinate."""

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
PolicyVersion = Annotated[int, Field(ge=0)]
"""Monotonic model version number; 0 is the initial (warm-start or base) policy."""

MAX_PROMPT_TOKENS: Final = 262_144
"""Most token ids in one prompt (a long-context VLM's window with many screenshots)."""
MAX_RESPONSE_TOKENS: Final = 65_536
"""Most token ids in one response."""
MAX_STEPS: Final = 1_000
"""Most steps in one trajectory (the largest step budget a task may have)."""
MAX_BATCH_SAMPLES: Final = 65_536
"""Most step samples in one training batch."""
MAX_BATCH_GROUPS: Final = 4_096
"""Most groups in one training batch."""

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
"""A token id: non-negative, within a vocabulary any tokenizer has."""


class Message(BaseModel):
    """Base of every wire message.

    Subclasses set ``kind: Literal["..."] = "..."``; the literal doubles as the discriminator of
    the unions that carry them.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        ser_json_bytes="base64",
        val_json_bytes="base64",
        ser_json_inf_nan="constants",
        use_attribute_docstrings=True,
    )

    schema_version: Literal[1] = SCHEMA_VERSION
    """Wire schema version (see :data:`SCHEMA_VERSION`)."""

    wire_name: ClassVar[str] = "message"


class Value(BaseModel):
    """Base of nested value objects (not sent on their own): frozen, strict, closed."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        ser_json_bytes="base64",
        val_json_bytes="base64",
        use_attribute_docstrings=True,
    )


class ErrorCode(StrEnum):
    """Machine-readable reason of an :class:`ErrorReply`."""

    INVALID_REQUEST = "invalid_request"
    """The request did not validate against its schema."""
    NOT_FOUND = "not_found"
    """The referenced lease, instance, task or artifact does not exist."""
    CONFLICT = "conflict"
    """The request conflicts with current state (e.g. a lease held by someone else)."""
    UNAVAILABLE = "unavailable"
    """No capacity right now (e.g. no free env instance); retry later."""
    EXPIRED = "expired"
    """The lease expired before the request arrived."""
    ENV_FAILED = "env_failed"
    """The environment instance crashed or stopped responding."""
    INTERNAL = "internal"
    """An unexpected error inside the service; the service keeps running."""


class ErrorReply(Message):
    """Typed error answer to any request. Services never leave a request unanswered on bad input."""

    kind: Literal["error"] = "error"
    code: ErrorCode
    """Machine-readable reason."""
    message: str
    """What went wrong and what the caller can do."""
    details: dict[str, Any] = Field(default_factory=dict)
    """Structured context (field errors, ids)."""
    retryable: bool = False
    """Whether repeating the same request later may succeed."""
