"""Draw a sim window with Pillow and encode it as PNG.

Rendering is a pure function of the window's state: the same state gives the same pixels and the
same PNG bytes (Pillow's drawing and zlib are deterministic; no timestamps or metadata chunks are
written). Text uses Pillow's bundled default font (no font files are read or downloaded), so the
result depends only on the installed Pillow version.
"""

from __future__ import annotations

import io
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

from dart.env.errors import EnvError
from dart.env.sim.widgets import Button, Checkbox, ListBox, Rect, TextField, Window

PNG_COMPRESS_LEVEL = 1
"""zlib level for screenshots: level 1 is several times faster than the default 6 and the files
of these flat-colour screens stay small (a few KB)."""

DESKTOP = (58, 92, 128)
WINDOW_BG = (246, 246, 246)
FRAME = (70, 70, 70)
INSTRUCTION_BG = (255, 243, 176)
INSTRUCTION_BORDER = (214, 190, 90)
TEXT = (20, 20, 20)
BUTTON_BG = (221, 226, 233)
BUTTON_BORDER = (104, 112, 124)
BUTTON_PRESSED_BG = (160, 170, 186)
FIELD_BG = (255, 255, 255)
FIELD_BORDER = (128, 128, 128)
FOCUS = (38, 110, 235)
SELECTION_BG = (51, 103, 214)
SELECTION_TEXT = (255, 255, 255)
SCROLL_TRACK = (228, 228, 228)
SCROLL_THUMB = (150, 150, 150)


@lru_cache(maxsize=16)
def font(px: int) -> ImageFont.FreeTypeFont:
    """Pillow's default font at ``px`` pixels (cached; fonts are immutable).

    Raises:
        EnvError: Pillow was built without FreeType, so the default font cannot be scaled.
    """
    loaded = ImageFont.load_default(size=px)
    if not isinstance(loaded, ImageFont.FreeTypeFont):
        raise EnvError("the sim renderer needs Pillow built with FreeType (the PyPI wheels are); reinstall Pillow")
    return loaded


def text_width(text: str, px: int) -> int:
    """Rendered width of ``text`` in pixels at font size ``px``."""
    return int(round(font(px).getlength(text)))


def wrap_text(text: str, px: int, max_width: int) -> tuple[str, ...]:
    """Greedy word wrap to lines no wider than ``max_width`` (a single over-long word stays whole)."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if current and text_width(candidate, px) > max_width:
            lines.append(current)
            current = word
        else:
            current = candidate
    if current:
        lines.append(current)
    return tuple(lines)


def render_image(window: Window) -> Image.Image:
    """Draw the window as an RGB image of the window's screen size."""
    image = Image.new("RGB", (window.width, window.height), DESKTOP)
    draw = ImageDraw.Draw(image)
    fnt = font(window.font_px)
    draw.rectangle(_box(Rect(1, 1, window.width - 2, window.height - 2)), fill=WINDOW_BG, outline=FRAME)
    bar = window.instruction_rect
    draw.rectangle(_box(bar), fill=INSTRUCTION_BG, outline=INSTRUCTION_BORDER)
    line_h = window.font_px + 3
    for i, line in enumerate(window.instruction_lines):
        draw.text((bar.x + 4, bar.y + 3 + i * line_h), line, font=fnt, fill=TEXT)
    for widget in window.widgets:
        focused = widget.id == window.focus
        if isinstance(widget, Button):
            _button(draw, fnt, widget, pressed=widget.id == window.pressed)
        elif isinstance(widget, TextField):
            _text_field(draw, fnt, widget, focused)
        elif isinstance(widget, Checkbox):
            _checkbox(draw, fnt, widget, focused)
        else:
            _list(draw, fnt, widget, focused)
    return image


def render_png(window: Window) -> bytes:
    """Draw the window and encode it as PNG bytes (deterministic, fast compression)."""
    buffer = io.BytesIO()
    render_image(window).save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def _box(rect: Rect) -> tuple[int, int, int, int]:
    # Pillow's rectangles include their last pixel; Rect edges are exclusive.
    return rect.x, rect.y, rect.right - 1, rect.bottom - 1


def _button(draw: ImageDraw.ImageDraw, fnt: ImageFont.FreeTypeFont, button: Button, pressed: bool) -> None:
    # The default button has a heavier border, as desktop toolkits draw it.
    border_w = 2 if button.default else 1
    fill = BUTTON_PRESSED_BG if pressed else BUTTON_BG
    draw.rounded_rectangle(_box(button.rect), radius=3, fill=fill, outline=BUTTON_BORDER, width=border_w)
    draw.text(button.rect.center, button.label, font=fnt, fill=TEXT, anchor="mm")


def _text_field(draw: ImageDraw.ImageDraw, fnt: ImageFont.FreeTypeFont, field: TextField, focused: bool) -> None:
    label_x, label_y = field.label_rect.x, field.label_rect.center[1]
    draw.text((label_x, label_y), f"{field.label}:", font=fnt, fill=TEXT, anchor="lm")
    box = field.box
    draw.rectangle(_box(box), fill=FIELD_BG, outline=FOCUS if focused else FIELD_BORDER, width=2 if focused else 1)
    inner = box.w - 8
    shown = field.text
    # Long content scrolls left inside the box, as a real input does, so the caret stays visible.
    while shown and fnt.getlength(shown) > inner:
        shown = shown[1:]
    x, y = box.x + 4, box.center[1]
    width = int(round(fnt.getlength(shown)))
    if field.all_selected and shown:
        draw.rectangle((x - 1, box.y + 3, x + width, box.bottom - 4), fill=SELECTION_BG)
        draw.text((x, y), shown, font=fnt, fill=SELECTION_TEXT, anchor="lm")
    else:
        draw.text((x, y), shown, font=fnt, fill=TEXT, anchor="lm")
        if focused:
            draw.line((x + width + 1, box.y + 4, x + width + 1, box.bottom - 5), fill=TEXT, width=1)


def _checkbox(draw: ImageDraw.ImageDraw, fnt: ImageFont.FreeTypeFont, box: Checkbox, focused: bool) -> None:
    sq = box.box
    draw.rectangle(_box(sq), fill=FIELD_BG, outline=FOCUS if focused else FIELD_BORDER, width=2 if focused else 1)
    if box.checked:
        # A tick mark: short stroke down to the bottom third, long stroke up to the top right.
        x, y, s = sq.x, sq.y, sq.w
        points = [(x + s * 0.22, y + s * 0.52), (x + s * 0.42, y + s * 0.74), (x + s * 0.8, y + s * 0.26)]
        draw.line(points, fill=TEXT, width=max(2, s // 6), joint="curve")
    draw.text((box.label_rect.x, box.label_rect.center[1]), box.label, font=fnt, fill=TEXT, anchor="lm")


def _list(draw: ImageDraw.ImageDraw, fnt: ImageFont.FreeTypeFont, lst: ListBox, focused: bool) -> None:
    draw.rectangle(_box(lst.rect), fill=FIELD_BG, outline=FOCUS if focused else FIELD_BORDER)
    for index in range(lst.scroll, min(len(lst.items), lst.scroll + lst.visible_rows)):
        row = lst.row_rect(index)
        assert row is not None  # index is inside the visible window
        colour = TEXT
        if index == lst.selected:
            draw.rectangle(_box(row), fill=SELECTION_BG)
            colour = SELECTION_TEXT
        draw.text((row.x + 4, row.center[1]), lst.items[index], font=fnt, fill=colour, anchor="lm")
    track, thumb = lst.scrollbar, lst.thumb
    if track is not None and thumb is not None:
        draw.rectangle(_box(track), fill=SCROLL_TRACK)
        draw.rectangle(_box(thumb), fill=SCROLL_THUMB)
