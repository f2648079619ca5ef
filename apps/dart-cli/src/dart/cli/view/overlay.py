"""An action as shapes to draw over a screenshot, in that image's pixel coordinates.

Actions are in normalized screen coordinates (``x`` in [0, 1] from the left, ``y`` from the top; see
:mod:`dart.protocol.messages.actions`). An env maps ``x`` to the pixel ``x * width`` falls in (the sim env
takes ``int(x * width)``, the desktop and OSWorld backends round), so a marker centred on ``x * width``
of an image lies on the pixel the env acted on, on the original screenshot and, scaled, on the smaller
image the policy was fed. The page draws the shapes in an SVG whose ``viewBox`` is the image's size,
laid over the image, so they scale with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dart.protocol.messages import (
    Action,
    Click,
    DoubleClick,
    Drag,
    Fail,
    Finished,
    Hotkey,
    RightClick,
    Scroll,
    Type,
    Wait,
)

ShapeKind = Literal["point", "line", "label"]

_SCROLL_ARROW = {"up": (0.0, -1.0), "down": (0.0, 1.0), "left": (-1.0, 0.0), "right": (1.0, 0.0)}


@dataclass(frozen=True)
class Shape:
    """One thing to draw, in image pixels.

    Attributes:
        kind: ``point`` (a circle at ``x, y``), ``line`` (from ``x, y`` to ``x2, y2``, an arrow head at the
            end) or ``label`` (``text`` in a box whose top-left corner is ``x, y``).
        x: Horizontal position, pixels from the left edge.
        y: Vertical position, pixels from the top edge.
        x2: End of a line.
        y2: End of a line.
        r: Radius of a point, pixels.
        text: A label's text.
        role: What it marks (``click``, ``double_click``, ``right_click``, ``drag``, ``scroll``, ``type``,
            ``hotkey``, ``end``, ``wait``), for styling.
    """

    kind: ShapeKind
    x: float
    y: float
    x2: float = 0.0
    y2: float = 0.0
    r: float = 0.0
    text: str = ""
    role: str = ""


def action_shapes(action: Action | None, width: int, height: int) -> list[Shape]:
    """What to draw for ``action`` on an image of ``width`` x ``height`` pixels (nothing for no action)."""
    if action is None:
        return []
    r = max(4.0, 0.012 * max(width, height))
    size = max(10.0, 0.025 * max(width, height))  # label text height
    if isinstance(action, Click | DoubleClick | RightClick):
        return [Shape("point", action.x * width, action.y * height, r=r, role=action.kind)]
    if isinstance(action, Drag):
        x1, y1, x2, y2 = action.x1 * width, action.y1 * height, action.x2 * width, action.y2 * height
        return [
            Shape("line", x1, y1, x2=x2, y2=y2, role="drag"),
            Shape("point", x1, y1, r=r, role="drag"),
            Shape("point", x2, y2, r=r * 0.6, role="drag"),
        ]
    if isinstance(action, Scroll):
        x, y = action.x * width, action.y * height
        dx, dy = _SCROLL_ARROW[action.direction.value]
        length, caption = 4 * r, f"scroll {action.direction.value} x{action.amount}"
        return [
            Shape("point", x, y, r=r, role="scroll"),
            Shape("line", x, y, x2=x + dx * length, y2=y + dy * length, role="scroll"),
            Shape("label", x + r, y + r, r=size, text=caption, role="scroll"),
        ]
    return [Shape("label", size * 0.5, size * 0.5, r=size, text=_caption(action), role=_role(action))]


def _caption(action: Action) -> str:
    if isinstance(action, Type):
        text = action.text.replace("\n", "⏎")
        return f"type: {text[:80]}" + ("…" if len(text) > 80 else "")
    if isinstance(action, Hotkey):
        return "keys: " + " + ".join(action.keys)
    if isinstance(action, Wait):
        return f"wait {action.seconds:g} s"
    if isinstance(action, Finished):
        return "finished" + (f": {action.content[:80]}" if action.content else "")
    if isinstance(action, Fail):
        return "fail" + (f": {action.reason[:80]}" if action.reason else "")
    return action.kind


def _role(action: Action) -> str:
    return "end" if isinstance(action, Finished | Fail) else action.kind


def describe(action: Action | None) -> str:
    """One line saying what the action was, with its normalized coordinates."""
    if action is None:
        return "no action (the output did not parse)"
    if isinstance(action, Click | DoubleClick | RightClick):
        return f"{action.kind} at ({action.x:.4f}, {action.y:.4f})"
    if isinstance(action, Drag):
        return f"drag ({action.x1:.4f}, {action.y1:.4f}) -> ({action.x2:.4f}, {action.y2:.4f})"
    if isinstance(action, Scroll):
        return f"scroll {action.direction.value} x{action.amount} at ({action.x:.4f}, {action.y:.4f})"
    return _caption(action)
