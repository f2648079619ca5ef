"""Geometry for building sim windows: sizes scaled to the screen and random non-overlapping placement.

Every size derives from one font size chosen for the screen, so a 224x224 screen and a 448x448
one show the same layout at different scales.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dart.env.errors import LayoutError
from dart.env.sim.render import text_width, wrap_text
from dart.env.sim.widgets import Checkbox, ListBox, Rect, TextField, Window

_PLACEMENT_TRIES = 400
_MAX_INSTRUCTION_LINES = 3


@dataclass(frozen=True)
class Metrics:
    """Sizes, in pixels, of everything drawn on a screen of a given size.

    Attributes:
        width: Screen width.
        height: Screen height.
        font_px: Font size; the unit the rest scales with.
        row_h: Height of a list row or check box line.
        control_h: Height of buttons and text fields.
        gap: Minimum space between widgets.
    """

    width: int
    height: int
    font_px: int
    row_h: int
    control_h: int
    gap: int

    @classmethod
    def for_screen(cls, width: int, height: int) -> Metrics:
        """Metrics for a screen: an 11 px font on 224x224, scaled linearly with the shorter side."""
        font_px = max(8, round(min(width, height) / 20))
        return cls(width, height, font_px, row_h=font_px + 6, control_h=font_px + 9, gap=max(3, font_px // 2))

    def button_size(self, label: str) -> tuple[int, int]:
        """Size of a button showing ``label``."""
        return text_width(label, self.font_px) + 2 * self.font_px, self.control_h

    def checkbox_size(self, label: str) -> tuple[int, int]:
        """Size of a check box block (square, gap, label)."""
        return self.font_px + 1 + 5 + text_width(label, self.font_px) + 2, self.row_h

    def text_field_size(self, label: str, box_w: int) -> tuple[int, int]:
        """Size of a text field block (label with colon, gap, box of width ``box_w``)."""
        return text_width(f"{label}:", self.font_px) + 5 + box_w, self.control_h

    def list_size(self, items: tuple[str, ...], visible_rows: int) -> tuple[int, int]:
        """Size of a list box showing ``visible_rows`` rows wide enough for its longest item and a scroll bar."""
        text_w = max(text_width(item, self.font_px) for item in items)
        return text_w + 8 + max(6, self.row_h // 2) + 4, visible_rows * self.row_h + 2


def frame(metrics: Metrics, instruction: str) -> Window:
    """An empty window showing ``instruction`` in its top bar.

    Raises:
        LayoutError: The instruction needs more than three lines at this screen width.
    """
    bar_w = metrics.width - 8
    lines = wrap_text(instruction, metrics.font_px, bar_w - 8)
    if len(lines) > _MAX_INSTRUCTION_LINES:
        raise LayoutError(f"instruction needs {len(lines)} lines at width {metrics.width}: {instruction!r}")
    bar = Rect(4, 4, bar_w, len(lines) * (metrics.font_px + 3) + 7)
    top = bar.bottom + metrics.gap
    content = Rect(6, top, metrics.width - 12, metrics.height - 6 - top)
    return Window(metrics.width, metrics.height, metrics.font_px, lines, bar, content)


def scatter(rng: random.Random, area: Rect, sizes: list[tuple[int, int]], gap: int) -> list[Rect]:
    """Place blocks of the given sizes at random, non-overlapping positions inside ``area``.

    Larger blocks are placed first (they are the hardest to fit); the result keeps the input order.

    Raises:
        LayoutError: The blocks do not fit (the screen is too small for this task).
    """
    placed: dict[int, Rect] = {}
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i][0] * sizes[i][1])
    for index in order:
        w, h = sizes[index]
        if w > area.w or h > area.h:
            raise LayoutError(f"a {w}x{h} widget does not fit the {area.w}x{area.h} content area")
        for _ in range(_PLACEMENT_TRIES):
            rect = Rect(rng.randint(area.x, area.right - w), rng.randint(area.y, area.bottom - h), w, h)
            if not any(rect.intersects(other, gap) for other in placed.values()):
                placed[index] = rect
                break
        else:
            raise LayoutError(f"cannot place {len(sizes)} widgets in a {area.w}x{area.h} content area")
    return [placed[i] for i in range(len(sizes))]


def place(rng: random.Random, window: Window, metrics: Metrics, blocks: list[tuple[int, int]]) -> list[Rect]:
    """:func:`scatter` into the window's content area, retrying whole layouts before giving up.

    Raises:
        LayoutError: No layout was found (the screen is too small for this task).
    """
    error: LayoutError | None = None
    for _ in range(20):
        try:
            return scatter(rng, window.content_rect, blocks, metrics.gap)
        except LayoutError as exc:
            error = exc
    assert error is not None
    raise error


def checkbox_at(widget_id: str, label: str, block: Rect, metrics: Metrics, checked: bool = False) -> Checkbox:
    """A check box inside ``block``: square on the left, label on the right."""
    side = metrics.font_px + 1
    square = Rect(block.x, block.y + (block.h - side) // 2, side, side)
    label_rect = Rect(square.right + 5, block.y, block.right - square.right - 5, block.h)
    return Checkbox(widget_id, label, square, label_rect, checked)


def text_field_at(widget_id: str, label: str, block: Rect, metrics: Metrics, box_w: int, text: str = "") -> TextField:
    """A text field inside ``block``: label on the left, input box of width ``box_w`` on the right."""
    label_rect = Rect(block.x, block.y, block.w - box_w - 5, block.h)
    box = Rect(block.right - box_w, block.y, box_w, block.h)
    return TextField(widget_id, label, label_rect, box, text=text)


def list_at(widget_id: str, items: tuple[str, ...], block: Rect, metrics: Metrics, scroll: int = 0) -> ListBox:
    """A list box filling ``block``."""
    lst = ListBox(widget_id, items, block, metrics.row_h)
    lst.scroll_by(scroll)
    return lst
