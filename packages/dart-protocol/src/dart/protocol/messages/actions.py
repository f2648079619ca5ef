"""Typed GUI actions in normalized screen coordinates.

Coordinates are fractions of the screen: ``x`` in [0, 1] from the left edge, ``y`` in [0, 1] from
the top. Each env backend maps them to its own pixels. ``finished`` and ``fail`` end an episode.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, field_validator

from dart.protocol.messages.base import NonNegFloat, UnitFloat, Value


class Click(Value):
    """Left click at a point."""

    kind: Literal["click"] = "click"
    x: UnitFloat
    """Horizontal position, fraction of screen width."""
    y: UnitFloat
    """Vertical position, fraction of screen height."""


class DoubleClick(Value):
    """Left double click at a point."""

    kind: Literal["double_click"] = "double_click"
    x: UnitFloat
    y: UnitFloat


class RightClick(Value):
    """Right click at a point."""

    kind: Literal["right_click"] = "right_click"
    x: UnitFloat
    y: UnitFloat


class Drag(Value):
    """Press at the start point, move to the end point, release."""

    kind: Literal["drag"] = "drag"
    x1: UnitFloat
    y1: UnitFloat
    x2: UnitFloat
    y2: UnitFloat


class Type(Value):
    """Type text at the keyboard focus. A trailing newline presses Enter."""

    kind: Literal["type"] = "type"
    text: str = Field(max_length=4096)


class Hotkey(Value):
    """Press keys together, e.g. ``("ctrl", "c")``; a single key is a key press."""

    kind: Literal["hotkey"] = "hotkey"
    keys: tuple[str, ...] = Field(min_length=1, max_length=6)
    """Key names, lower case (``ctrl``, ``shift``, ``alt``, ``enter``, ``a`` ...)."""

    @field_validator("keys")
    @classmethod
    def _keys_nonempty(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        if any(not k or len(k) > 32 or k != k.strip() for k in keys):
            raise ValueError("each key must be a non-empty name without surrounding spaces, at most 32 characters")
        return keys


class ScrollDirection(StrEnum):
    """Direction of a scroll action."""

    UP = "up"
    DOWN = "down"
    LEFT = "left"
    RIGHT = "right"


class Scroll(Value):
    """Scroll at a point."""

    kind: Literal["scroll"] = "scroll"
    x: UnitFloat
    y: UnitFloat
    direction: ScrollDirection
    amount: int = Field(default=1, ge=1, le=100)
    """Number of wheel clicks."""


class Wait(Value):
    """Do nothing for a while (let the screen settle)."""

    kind: Literal["wait"] = "wait"
    seconds: NonNegFloat = Field(default=1.0, le=60.0)


class Finished(Value):
    """The agent declares the task done."""

    kind: Literal["finished"] = "finished"
    content: str = Field(default="", max_length=4096)
    """Optional answer text."""


class Fail(Value):
    """The agent declares the task infeasible."""

    kind: Literal["fail"] = "fail"
    reason: str = Field(default="", max_length=4096)


Action = Annotated[
    Click | DoubleClick | RightClick | Drag | Type | Hotkey | Scroll | Wait | Finished | Fail,
    Field(discriminator="kind"),
]
"""Any typed action; discriminated by ``kind``."""

ACTION_ADAPTER: TypeAdapter[Action] = TypeAdapter(Action)
"""Validator for a standalone action."""

TERMINAL_ACTION_KINDS = frozenset({"finished", "fail"})
"""Action kinds that end an episode."""
