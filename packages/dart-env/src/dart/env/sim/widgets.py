"""The sim GUI's widget model: one window with an instruction bar and a handful of widgets.

Everything here is plain mutable data in pixel coordinates; :mod:`dart.env.sim.interaction`
changes it in response to actions and :mod:`dart.env.sim.render` draws it. Nothing here knows
about tasks or rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCROLL_ROWS_PER_WHEEL_CLICK = 3
"""Rows a list moves per wheel click, like a desktop's default of three lines."""


@dataclass(frozen=True)
class Rect:
    """An axis-aligned pixel rectangle; ``(x, y)`` is the top-left corner, edges exclusive."""

    x: int
    y: int
    w: int
    h: int

    @property
    def right(self) -> int:
        """First column right of the rectangle."""
        return self.x + self.w

    @property
    def bottom(self) -> int:
        """First row below the rectangle."""
        return self.y + self.h

    @property
    def center(self) -> tuple[int, int]:
        """The centre pixel."""
        return self.x + self.w // 2, self.y + self.h // 2

    def contains(self, px: int, py: int) -> bool:
        """Whether pixel ``(px, py)`` lies inside."""
        return self.x <= px < self.right and self.y <= py < self.bottom

    def intersects(self, other: Rect, margin: int = 0) -> bool:
        """Whether the rectangles overlap once this one is grown by ``margin`` on every side."""
        return not (
            self.right + margin <= other.x
            or other.right <= self.x - margin
            or self.bottom + margin <= other.y
            or other.bottom <= self.y - margin
        )

    def union(self, other: Rect) -> Rect:
        """The smallest rectangle holding both."""
        x, y = min(self.x, other.x), min(self.y, other.y)
        return Rect(x, y, max(self.right, other.right) - x, max(self.bottom, other.bottom) - y)


@dataclass
class Button:
    """A push button. Pressing any button ends the episode (it submits or cancels the form).

    Attributes:
        id: Unique widget id within the window.
        label: Text on the button.
        rect: Clickable area.
        default: Whether Enter presses it (the form's Submit button).
    """

    id: str
    label: str
    rect: Rect
    default: bool = False


@dataclass
class TextField:
    """A one-line text input with a label on its left.

    Attributes:
        id: Unique widget id.
        label: Text of the label (drawn with a trailing colon).
        label_rect: Where the label is drawn; clicking it focuses the field, as an HTML label does.
        box: The input box.
        text: Current content.
        all_selected: Whether the whole content is selected (typing replaces it).
        max_len: Characters beyond this are dropped, as with an HTML ``maxlength``.
    """

    id: str
    label: str
    label_rect: Rect
    box: Rect
    text: str = ""
    all_selected: bool = False
    max_len: int = 32

    @property
    def rect(self) -> Rect:
        """Clickable area: label and box."""
        return self.label_rect.union(self.box)


@dataclass
class Checkbox:
    """A check box with a label on its right; clicking either toggles it.

    Attributes:
        id: Unique widget id.
        label: Label text.
        box: The square.
        label_rect: Where the label is drawn.
        checked: Whether it is ticked.
    """

    id: str
    label: str
    box: Rect
    label_rect: Rect
    checked: bool = False

    @property
    def rect(self) -> Rect:
        """Clickable area: box and label."""
        return self.box.union(self.label_rect)


@dataclass
class ListBox:
    """A single-selection list showing ``visible_rows`` rows at a time, with a scroll bar when longer.

    Attributes:
        id: Unique widget id.
        items: Item texts, top to bottom.
        rect: Outer box, border included.
        row_h: Height of one row in pixels.
        selected: Index of the selected item, or None.
        scroll: Index of the first visible item.
    """

    id: str
    items: tuple[str, ...]
    rect: Rect
    row_h: int
    selected: int | None = None
    scroll: int = 0

    @property
    def visible_rows(self) -> int:
        """How many rows fit inside the border."""
        return max(1, (self.rect.h - 2) // self.row_h)

    @property
    def max_scroll(self) -> int:
        """Largest valid :attr:`scroll`."""
        return max(0, len(self.items) - self.visible_rows)

    @property
    def scrollbar(self) -> Rect | None:
        """The scroll bar track along the right edge, or None when every item fits."""
        if self.max_scroll == 0:
            return None
        width = max(6, self.row_h // 2)
        return Rect(self.rect.right - 1 - width, self.rect.y + 1, width, self.rect.h - 2)

    @property
    def thumb(self) -> Rect | None:
        """The scroll bar's thumb (its length shows the visible fraction), or None without a bar."""
        track = self.scrollbar
        if track is None:
            return None
        length = max(8, track.h * self.visible_rows // len(self.items))
        top = track.y + (track.h - length) * self.scroll // self.max_scroll
        return Rect(track.x, top, track.w, length)

    def row_rect(self, index: int) -> Rect | None:
        """Where item ``index`` is drawn, or None when it is scrolled out of view."""
        row = index - self.scroll
        if not 0 <= row < self.visible_rows or index >= len(self.items):
            return None
        bar = self.scrollbar
        width = (bar.x if bar else self.rect.right - 1) - (self.rect.x + 1)
        return Rect(self.rect.x + 1, self.rect.y + 1 + row * self.row_h, width, self.row_h)

    def item_at(self, px: int, py: int) -> int | None:
        """Index of the visible item under a pixel, or None."""
        for index in range(self.scroll, min(len(self.items), self.scroll + self.visible_rows)):
            row = self.row_rect(index)
            if row is not None and row.contains(px, py):
                return index
        return None

    def scroll_by(self, rows: int) -> None:
        """Scroll by ``rows`` (positive: down), clamped to the valid range."""
        self.scroll = min(self.max_scroll, max(0, self.scroll + rows))

    def scroll_into_view(self, index: int) -> None:
        """Scroll the least amount that makes item ``index`` visible."""
        if index < self.scroll:
            self.scroll = index
        elif index >= self.scroll + self.visible_rows:
            self.scroll = index - self.visible_rows + 1
        self.scroll_by(0)


Widget = Button | TextField | Checkbox | ListBox
"""Any widget."""

FOCUSABLE = (TextField, Checkbox, ListBox)
"""Widget types that take keyboard focus (Tab cycles through them in window order)."""


@dataclass
class Window:
    """The whole screen: an instruction bar at the top and widgets below.

    Lifecycle: built by a task family at reset -> changed in place by each action -> frozen once
    a button is pressed (:attr:`pressed` is set: the episode is over and input is ignored).

    Attributes:
        width: Screen width in pixels.
        height: Screen height in pixels.
        font_px: Font size everything is laid out for.
        instruction_lines: The instruction, already wrapped to the bar's width.
        instruction_rect: The instruction bar.
        content_rect: Where widgets live.
        widgets: Widgets in drawing and Tab order.
        focus: Id of the focused widget, or None.
        pressed: Id of the button that ended the episode, or None while it runs.
    """

    width: int
    height: int
    font_px: int
    instruction_lines: tuple[str, ...]
    instruction_rect: Rect
    content_rect: Rect
    widgets: list[Widget] = field(default_factory=list)
    focus: str | None = None
    pressed: str | None = None

    @property
    def submitted(self) -> bool:
        """Whether a button press ended the episode."""
        return self.pressed is not None

    def widget(self, widget_id: str) -> Widget:
        """The widget with this id.

        Raises:
            KeyError: No such widget.
        """
        for widget in self.widgets:
            if widget.id == widget_id:
                return widget
        raise KeyError(f"no widget {widget_id!r} in the window")

    def widget_at(self, px: int, py: int) -> Widget | None:
        """The topmost widget whose clickable area holds the pixel, or None."""
        for widget in reversed(self.widgets):
            if widget.rect.contains(px, py):
                return widget
        return None

    def default_button(self) -> Button | None:
        """The button Enter presses, or None when the window has none."""
        for widget in self.widgets:
            if isinstance(widget, Button) and widget.default:
                return widget
        return None

    def focused(self) -> Widget | None:
        """The focused widget, or None."""
        return None if self.focus is None else self.widget(self.focus)
