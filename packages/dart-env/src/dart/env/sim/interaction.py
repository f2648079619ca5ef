"""How typed actions change the sim window: the input semantics of the simulated GUI.

Pointer actions hit the topmost widget under the pixel that the normalized point maps to.

- ``click``: a button is pressed (which ends the episode); a text field (box or label) takes focus
  with the caret at the end; a check box (box or label) toggles and takes focus; a list item is
  selected; a click on a list's scroll bar track pages the list up or down; a click on nothing
  clears the focus.
- ``double_click``: on a text field, focuses it and selects all its text; on a button, presses it
  once; elsewhere it is two clicks (so a check box ends where it started, as in a browser).
- ``right_click``: there are no context menus; nothing happens.
- ``drag`` (press at the start, release at the end): from a list's scroll bar thumb, scrolls the
  list by the distance moved; from a text field's box, selects all its text; press and release on
  the same other widget is a click; anything else does nothing.
- ``scroll``: over a list, moves it 3 rows per wheel click (up/down; left/right do nothing).
- ``type``: characters go to the focused text field (a selection is replaced; past ``max_len``
  they are dropped); ``\\n`` presses Enter, ``\\t`` presses Tab, a space toggles a focused check
  box; with no text field focused other characters are ignored.
- ``hotkey``: ``enter`` presses the window's default (Submit) button wherever the focus is;
  ``ctrl+a`` selects all text of the focused field; ``backspace`` deletes the selection or the
  last character, ``delete`` the selection; ``tab`` / ``shift+tab`` move the focus; ``escape``
  clears it; ``space`` toggles a focused check box; ``up`` / ``down`` move a focused list's
  selection; a single printable key types itself (``shift`` upper-cases it). ``cmd``, ``meta`` and
  ``super`` count as ``ctrl``. Other keys do nothing.
- ``wait``, ``finished``, ``fail``: no change to the window (the env ends the episode on the
  last two).

Once a button has been pressed the window is frozen and every action is ignored.
"""

from __future__ import annotations

from dart.env.sim.widgets import (
    FOCUSABLE,
    SCROLL_ROWS_PER_WHEEL_CLICK,
    Button,
    Checkbox,
    ListBox,
    TextField,
    Widget,
    Window,
)
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
    ScrollDirection,
    Type,
    Wait,
)

_KEY_ALIASES = {
    "return": "enter",
    "control": "ctrl",
    "cmd": "ctrl",
    "command": "ctrl",
    "meta": "ctrl",
    "super": "ctrl",
    "win": "ctrl",
    "esc": "escape",
    "del": "delete",
    "arrowup": "up",
    "arrowdown": "down",
}
_MODIFIERS = frozenset({"ctrl", "shift", "alt"})


def to_pixel(x: float, y: float, width: int, height: int) -> tuple[int, int]:
    """Map a normalized point to the pixel it falls in (1.0 maps to the last row/column)."""
    return min(width - 1, int(x * width)), min(height - 1, int(y * height))


def to_normalized(px: int, py: int, width: int, height: int) -> tuple[float, float]:
    """The normalized point at the centre of a pixel (inverse of :func:`to_pixel`)."""
    return (px + 0.5) / width, (py + 0.5) / height


def apply_action(window: Window, action: Action) -> str:
    """Execute one action on the window in place.

    Returns:
        A short description of what happened (``press: OK``, ``type: 4 chars into Name`` ...),
        for the step's info and for debugging.
    """
    if window.submitted:
        return "ignored: the form was already submitted"
    if isinstance(action, Click):
        return _click(window, *to_pixel(action.x, action.y, window.width, window.height))
    if isinstance(action, DoubleClick):
        return _double_click(window, *to_pixel(action.x, action.y, window.width, window.height))
    if isinstance(action, RightClick):
        return "right_click: no context menu"
    if isinstance(action, Drag):
        start = to_pixel(action.x1, action.y1, window.width, window.height)
        end = to_pixel(action.x2, action.y2, window.width, window.height)
        return _drag(window, start, end)
    if isinstance(action, Scroll):
        px, py = to_pixel(action.x, action.y, window.width, window.height)
        return _scroll(window, px, py, action.direction, action.amount)
    if isinstance(action, Type):
        return _type(window, action.text)
    if isinstance(action, Hotkey):
        return _hotkey(window, action.keys)
    if isinstance(action, Wait):
        return "wait"
    if isinstance(action, Finished):
        return "finished"
    if isinstance(action, Fail):
        return "fail"
    raise TypeError(f"not an action: {action!r}")  # unreachable while Action is a closed union


def _click(window: Window, px: int, py: int) -> str:
    widget = window.widget_at(px, py)
    if widget is None:
        window.focus = None
        return "click: nothing there"
    if isinstance(widget, Button):
        window.pressed = widget.id
        window.focus = None
        return f"press: {widget.label}"
    window.focus = widget.id
    if isinstance(widget, TextField):
        widget.all_selected = False
        return f"focus: {widget.label}"
    if isinstance(widget, Checkbox):
        widget.checked = not widget.checked
        return f"toggle: {widget.label} {'on' if widget.checked else 'off'}"
    return _click_list(widget, px, py)


def _click_list(lst: ListBox, px: int, py: int) -> str:
    bar, thumb = lst.scrollbar, lst.thumb
    if bar is not None and thumb is not None and bar.contains(px, py):
        if py < thumb.y:
            lst.scroll_by(-lst.visible_rows)
        elif py >= thumb.bottom:
            lst.scroll_by(lst.visible_rows)
        return f"scroll: list at row {lst.scroll}"
    index = lst.item_at(px, py)
    if index is None:
        return "focus: list"
    lst.selected = index
    return f"select: {lst.items[index]}"


def _double_click(window: Window, px: int, py: int) -> str:
    widget = window.widget_at(px, py)
    if isinstance(widget, TextField):
        _click(window, px, py)
        widget.all_selected = True
        return f"select all: {widget.label}"
    first = _click(window, px, py)
    if isinstance(widget, Button):
        return first
    return _click(window, px, py)


def _drag(window: Window, start: tuple[int, int], end: tuple[int, int]) -> str:
    widget = window.widget_at(*start)
    if isinstance(widget, ListBox) and widget.thumb is not None and widget.thumb.contains(*start):
        track = widget.scrollbar
        assert track is not None  # a thumb implies a track
        rows = round((end[1] - start[1]) * len(widget.items) / track.h)
        widget.scroll_by(rows)
        window.focus = widget.id
        return f"scroll: list at row {widget.scroll}"
    if isinstance(widget, TextField) and widget.box.contains(*start):
        window.focus = widget.id
        widget.all_selected = True
        return f"select all: {widget.label}"
    if widget is not None and window.widget_at(*end) is widget:
        return _click(window, *end)
    return "drag: nothing"


def _scroll(window: Window, px: int, py: int, direction: ScrollDirection, amount: int) -> str:
    widget = window.widget_at(px, py)
    if not isinstance(widget, ListBox) or direction in (ScrollDirection.LEFT, ScrollDirection.RIGHT):
        return "scroll: nothing to scroll"
    sign = 1 if direction == ScrollDirection.DOWN else -1
    widget.scroll_by(sign * amount * SCROLL_ROWS_PER_WHEEL_CLICK)
    return f"scroll: list at row {widget.scroll}"


def _type(window: Window, text: str) -> str:
    typed = 0
    events: list[str] = []
    for char in text:
        if window.submitted:
            break
        if char == "\n":
            events.append(_press_enter(window))
        elif char == "\t":
            events.append(_move_focus(window, 1))
        elif _insert(window, char):
            typed += 1
    target = window.focused()
    where = f" into {target.label}" if isinstance(target, TextField) else ""
    summary = f"type: {typed} chars{where}" if typed or not text.strip() else "type: no text field focused"
    return "; ".join([summary, *events])


def _insert(window: Window, char: str) -> bool:
    target = window.focused()
    if isinstance(target, Checkbox) and char == " ":
        target.checked = not target.checked
        return False
    if not isinstance(target, TextField) or not char.isprintable():
        return False
    if target.all_selected:
        target.text, target.all_selected = "", False
    if len(target.text) >= target.max_len:
        return False
    target.text += char
    return True


def _press_enter(window: Window) -> str:
    button = window.default_button()
    if button is None:
        return "enter: no default button"
    window.pressed = button.id
    window.focus = None
    return f"press: {button.label}"


def _move_focus(window: Window, step: int) -> str:
    order = [w for w in window.widgets if isinstance(w, FOCUSABLE)]
    if not order:
        return "tab: nothing focusable"
    ids = [w.id for w in order]
    current = ids.index(window.focus) if window.focus in ids else (-1 if step > 0 else 0)
    nxt: Widget = order[(current + step) % len(order)]
    window.focus = nxt.id
    if isinstance(nxt, TextField):
        # Tabbing into a field selects its content, as browsers do.
        nxt.all_selected = True
    return f"focus: {getattr(nxt, 'label', 'list')}"


def _hotkey(window: Window, raw_keys: tuple[str, ...]) -> str:
    keys = [_KEY_ALIASES.get(k.lower(), k.lower()) for k in raw_keys]
    mods = {k for k in keys if k in _MODIFIERS}
    main = [k for k in keys if k not in _MODIFIERS]
    name = "+".join(keys)
    target = window.focused()
    if len(main) != 1:
        return f"hotkey: {name} does nothing"
    key = main[0]
    if mods == {"ctrl"} and key == "a" and isinstance(target, TextField):
        target.all_selected = True
        return f"select all: {target.label}"
    if mods - {"shift"}:
        return f"hotkey: {name} does nothing"
    if key == "enter":
        return _press_enter(window)
    if key == "tab":
        return _move_focus(window, -1 if "shift" in mods else 1)
    if key == "escape":
        window.focus = None
        return "focus: none"
    if key in ("backspace", "delete") and isinstance(target, TextField):
        if target.all_selected:
            target.text, target.all_selected = "", False
        elif key == "backspace":
            target.text = target.text[:-1]
        return f"{key}: {target.label}"
    if key in ("up", "down") and isinstance(target, ListBox) and target.items:
        if target.selected is None:
            target.selected = target.scroll  # the first arrow press selects the top visible item
        else:
            target.selected = min(len(target.items) - 1, max(0, target.selected + (1 if key == "down" else -1)))
        target.scroll_into_view(target.selected)
        return f"select: {target.items[target.selected]}"
    char = " " if key == "space" else key
    if len(char) == 1 and char.isprintable():
        return _type(window, char.upper() if "shift" in mods else char)
    return f"hotkey: {name} does nothing"
