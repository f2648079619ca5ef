"""What an environment shows the agent: a screenshot, text, and metadata."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from dart.protocol.messages.base import NonEmptyStr, Value

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
"""Lower-case hex sha256 digest."""

MetadataValue = str | int | float | bool | None


class InlineImage(Value):
    """A PNG carried inside the message (small screenshots, below the inline threshold)."""

    kind: Literal["inline"] = "inline"
    png: bytes = Field(max_length=8 * 1024 * 1024)
    """PNG file bytes (base64 on the JSON wire)."""
    width: int = Field(ge=1, le=16384)
    """Width in pixels."""
    height: int = Field(ge=1, le=16384)
    """Height in pixels."""

    @field_validator("png")
    @classmethod
    def _is_png(cls, png: bytes) -> bytes:
        if not png.startswith(PNG_SIGNATURE):
            raise ValueError("screenshot bytes are not a PNG file (bad signature)")
        return png


class ImageRef(Value):
    """A PNG stored in the artifact store (large screenshots, stored trajectories)."""

    kind: Literal["ref"] = "ref"
    uri: NonEmptyStr
    """Artifact URI, ``s3://bucket/key`` or ``file:///path``."""
    sha256: Sha256Hex
    """Digest of the PNG bytes."""
    width: int = Field(ge=1, le=16384)
    height: int = Field(ge=1, le=16384)


Image = Annotated[InlineImage | ImageRef, Field(discriminator="kind")]
"""A screenshot, inline or by reference."""


class Observation(Value):
    """One observation of the screen."""

    screenshot: Image | None = None
    """The screen, or None for text-only environments."""
    text: str = Field(default="", max_length=65536)
    """Text shown to the policy (e.g. the task instruction); never oracle-only data."""
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    """Backend-specific scalars (url, window title, step counter) for logging, not for the policy."""
