"""Persistent X input and screen capture for one display: XTest over one python-xlib connection.

One :class:`XInput` per display holds one X connection and one ``mss`` grabber for its lifetime,
so an action costs a few X requests, not a new process (as ``xdotool`` or ``pyautogui`` per call
would). Every X call holds one lock, so threads may share an instance.

Keys are named as in UI-TARS / pyautogui hotkeys (``ctrl``, ``alt``, ``shift``, ``super``,
``enter``, ``tab``, ``esc``, ``backspace``, ``delete``, ``space``, ``home``, ``end``, ``pageup``,
``pagedown``, arrows, ``f1``..``f12``, single characters, or any X keysym name such as
``KP_Enter``). Text is typed character by character; a character with no keycode in the current
keymap (``é``, ``€``, CJK ...) is bound to a spare keycode for the duration of the call, then the
keycode is unbound again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mss
import mss.tools
import numpy as np
from Xlib import XK, X, display  # type: ignore[import-untyped]
from Xlib.error import ConnectionClosedError, DisplayError  # type: ignore[import-untyped]
from Xlib.ext import xtest  # type: ignore[import-untyped]

from dart.env.desktop.errors import DesktopError

KEY_ALIASES: dict[str, str] = {
    "ctrl": "Control_L",
    "control": "Control_L",
    "alt": "Alt_L",
    "option": "Alt_L",
    "shift": "Shift_L",
    "super": "Super_L",
    "win": "Super_L",
    "meta": "Super_L",
    "cmd": "Super_L",
    "command": "Super_L",
    "enter": "Return",
    "return": "Return",
    "tab": "Tab",
    "esc": "Escape",
    "escape": "Escape",
    "backspace": "BackSpace",
    "delete": "Delete",
    "del": "Delete",
    "insert": "Insert",
    "space": "space",
    "home": "Home",
    "end": "End",
    "pageup": "Prior",
    "page_up": "Prior",
    "pgup": "Prior",
    "pagedown": "Next",
    "page_down": "Next",
    "pgdn": "Next",
    "up": "Up",
    "down": "Down",
    "left": "Left",
    "right": "Right",
    "capslock": "Caps_Lock",
    "printscreen": "Print",
    **{f"f{i}": f"F{i}" for i in range(1, 13)},
}
"""Lower-case key names accepted in hotkeys, mapped to X keysym names."""

SCROLL_BUTTONS = {"up": 4, "down": 5, "left": 6, "right": 7}
"""X pointer buttons of one wheel click per direction."""

_CHAR_KEYSYMS = {"\n": XK.XK_Return, "\r": XK.XK_Return, "\t": XK.XK_Tab, "\b": XK.XK_BackSpace}
_RESTORE_DELAY_S = 0.15
"""Time a temporary key binding stays after its last use, so clients can read the keymap first."""
_DRAG_STEPS = 10


def char_keysym(ch: str) -> int:
    """The X keysym that types ``ch``: Latin-1 keysyms equal their code point, others are ``0x1000000 + ord``."""
    if ch in _CHAR_KEYSYMS:
        return int(_CHAR_KEYSYMS[ch])
    code = ord(ch)
    if 0x20 <= code <= 0x7E or 0xA0 <= code <= 0xFF:
        return code
    return 0x01000000 + code


def key_keysym(name: str) -> int:
    """Keysym of a hotkey name (alias, single character or X keysym name).

    Raises:
        ValueError: The name is not a known key.
    """
    alias = KEY_ALIASES.get(name.lower())
    if alias is not None:
        return int(XK.string_to_keysym(alias))
    if len(name) == 1:
        return char_keysym(name)
    keysym = int(XK.string_to_keysym(name))
    if keysym == X.NoSymbol:
        raise ValueError(
            f"unknown key {name!r}; use a single character, an X keysym name or one of {sorted(KEY_ALIASES)}"
        )
    return keysym


def to_pixel(fraction: float, size: int) -> int:
    """Pixel of a screen fraction in [0, 1]: ``floor(fraction * size)``, clamped to the last pixel."""
    return min(size - 1, max(0, int(fraction * size)))


class XInput:
    """Mouse, keyboard and screenshots of one X display.

    Lifecycle: open on construction; :meth:`close` releases the connection (idempotent). When the
    X server dies, every call raises :class:`DesktopError` (part ``xvfb``).

    Args:
        display_name: The X display (``:N``).

    Raises:
        DesktopError: The display cannot be opened or lacks the XTest extension.
    """

    def __init__(self, display_name: str) -> None:
        self.display_name = display_name
        self._lock = threading.RLock()
        try:
            self._d = display.Display(display_name)
        except (DisplayError, ConnectionClosedError, OSError) as exc:
            raise DesktopError("xvfb", f"cannot open display {display_name}: {exc}") from exc
        if not self._d.has_extension("XTEST"):
            self._d.close()
            raise DesktopError("xvfb", f"display {display_name} has no XTEST extension")
        self._has_xfixes = bool(self._d.has_extension("XFIXES"))
        if self._has_xfixes:
            self._d.xfixes_query_version()
        screen = self._d.screen()
        self._root = screen.root
        self.width = int(screen.width_in_pixels)
        self.height = int(screen.height_in_pixels)
        self._mss: Any = None
        self._closed = False

    # -- plumbing -----------------------------------------------------------------------------

    @contextmanager
    def _x(self) -> Iterator[Any]:
        """Hold the lock and translate a lost X connection into a DesktopError."""
        with self._lock:
            if self._closed:
                raise DesktopError("xvfb", f"input of display {self.display_name} is closed")
            try:
                yield self._d
            except (ConnectionClosedError, BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise DesktopError("xvfb", f"lost the X display {self.display_name}: {exc}") from exc

    def _fake(self, event: int, detail: int) -> None:
        xtest.fake_input(self._d, event, detail)

    def _flush(self) -> None:
        # sync (a round trip) rather than flush: the events have reached the server when we return.
        self._d.sync()

    # -- pointer ------------------------------------------------------------------------------

    def move(self, x: int, y: int) -> None:
        """Move the pointer to pixel ``(x, y)``."""
        with self._x():
            xtest.fake_input(self._d, X.MotionNotify, x=x, y=y)
            self._flush()

    def click(self, x: int, y: int, button: int = 1, clicks: int = 1) -> None:
        """Move to ``(x, y)`` and click ``button`` (1 left, 2 middle, 3 right) ``clicks`` times."""
        if button not in (1, 2, 3):
            raise ValueError(f"button must be 1, 2 or 3, got {button}")
        with self._x():
            xtest.fake_input(self._d, X.MotionNotify, x=x, y=y)
            for _ in range(clicks):
                self._fake(X.ButtonPress, button)
                self._fake(X.ButtonRelease, button)
            self._flush()

    def drag(self, x1: int, y1: int, x2: int, y2: int, button: int = 1) -> None:
        """Press at ``(x1, y1)``, move in steps to ``(x2, y2)``, release there."""
        with self._x():
            xtest.fake_input(self._d, X.MotionNotify, x=x1, y=y1)
            self._fake(X.ButtonPress, button)
            self._flush()
            for i in range(1, _DRAG_STEPS + 1):
                xi = round(x1 + (x2 - x1) * i / _DRAG_STEPS)
                yi = round(y1 + (y2 - y1) * i / _DRAG_STEPS)
                xtest.fake_input(self._d, X.MotionNotify, x=xi, y=yi)
                self._flush()
            self._fake(X.ButtonRelease, button)
            self._flush()

    def scroll(self, x: int, y: int, direction: str, amount: int = 1) -> None:
        """Move to ``(x, y)`` and turn the wheel ``amount`` clicks (``up``/``down``/``left``/``right``)."""
        button = SCROLL_BUTTONS.get(direction)
        if button is None:
            raise ValueError(f"scroll direction must be one of {sorted(SCROLL_BUTTONS)}, got {direction!r}")
        with self._x():
            xtest.fake_input(self._d, X.MotionNotify, x=x, y=y)
            for _ in range(amount):
                self._fake(X.ButtonPress, button)
                self._fake(X.ButtonRelease, button)
            self._flush()

    def cursor_position(self) -> tuple[int, int]:
        """Pointer position, pixels."""
        with self._x():
            reply = self._root.query_pointer()
            return int(reply.root_x), int(reply.root_y)

    # -- keyboard -----------------------------------------------------------------------------

    def _keycode(self, keysym: int, spare: dict[int, int]) -> tuple[int, bool]:
        """``(keycode, needs_shift)`` for a keysym, binding a spare keycode when the keymap lacks it."""
        best: tuple[int, bool] | None = None
        for keycode, index in self._d.keysym_to_keycodes(keysym):
            if index == 0:
                return int(keycode), False
            if index == 1 and best is None:
                best = (int(keycode), True)
        if best is not None:
            return best
        if keysym in spare:
            return spare[keysym], False
        keycode = self._bind_spare(keysym, spare)
        return keycode, False

    def _bind_spare(self, keysym: int, spare: dict[int, int]) -> int:
        first = int(self._d.display.info.min_keycode)
        count = int(self._d.display.info.max_keycode) - first + 1
        for attempt in range(2):
            mapping = self._d.get_keyboard_mapping(first, count)
            used = set(spare.values())
            for offset, syms in enumerate(mapping):
                keycode = first + offset
                if keycode not in used and not any(syms):
                    self._d.change_keyboard_mapping(keycode, [(keysym, keysym)])
                    self._d.sync()
                    spare[keysym] = keycode
                    return keycode
            if attempt == 0 and spare:
                # All spare keycodes hold earlier characters of this text: release them and reuse.
                self._unbind(spare)
        raise DesktopError("xvfb", "no spare keycode left to type a character missing from the keymap")

    def _unbind(self, spare: dict[int, int]) -> None:
        if not spare:
            return
        self._d.sync()
        time.sleep(_RESTORE_DELAY_S)
        for keycode in spare.values():
            self._d.change_keyboard_mapping(keycode, [(X.NoSymbol, X.NoSymbol)])
        self._d.sync()
        spare.clear()

    def _refresh_keymap(self) -> None:
        """Apply queued MappingNotify events (a task may have changed the keymap, e.g. setxkbmap)."""
        while self._d.pending_events():
            ev = self._d.next_event()
            if ev.type == X.MappingNotify:
                self._d.refresh_keyboard_mapping(ev)

    def _tap(self, keysyms: Sequence[int], spare: dict[int, int]) -> None:
        """Press keysyms in order, release them in reverse (a combo), with Shift where a keysym needs it."""
        pressed: list[int] = []
        for keysym in keysyms:
            keycode, shift = self._keycode(keysym, spare)
            if shift:
                shift_code, _ = self._keycode(int(XK.XK_Shift_L), spare)
                if shift_code not in pressed:
                    self._fake(X.KeyPress, shift_code)
                    pressed.append(shift_code)
            self._fake(X.KeyPress, keycode)
            pressed.append(keycode)
        for keycode in reversed(pressed):
            self._fake(X.KeyRelease, keycode)

    def hotkey(self, keys: Sequence[str]) -> None:
        """Press ``keys`` together (``["ctrl", "a"]``), then release them in reverse order.

        Raises:
            ValueError: A key name is unknown.
        """
        if not keys:
            raise ValueError("a hotkey needs at least one key")
        keysyms = [key_keysym(k) for k in keys]
        spare: dict[int, int] = {}
        with self._x():
            self._refresh_keymap()
            try:
                self._tap(keysyms, spare)
                self._flush()
            finally:
                self._unbind(spare)

    def type_text(self, text: str) -> None:
        """Type ``text`` exactly; ``\\n`` (or ``\\r\\n``) presses Return and ``\\t`` Tab."""
        text = text.replace("\r\n", "\n")
        spare: dict[int, int] = {}
        with self._x():
            self._refresh_keymap()
            try:
                for ch in text:
                    self._tap([char_keysym(ch)], spare)
                    # A sync per character keeps the event order and lets slow clients keep up.
                    self._flush()
            finally:
                self._unbind(spare)

    # -- screen -------------------------------------------------------------------------------

    def _grabber(self) -> Any:
        if self._mss is None:
            self._mss = mss.mss(display=self.display_name)
        return self._mss

    def screenshot_rgb(self, *, cursor: bool = False) -> np.ndarray:
        """The screen as an ``(height, width, 3)`` uint8 RGB array, optionally with the pointer drawn."""
        with self._x():
            try:
                shot = self._grabber().grab({"left": 0, "top": 0, "width": self.width, "height": self.height})
            except Exception as exc:  # mss raises its own ScreenShotError for a dead display
                raise DesktopError("xvfb", f"screenshot of {self.display_name} failed: {exc}") from exc
            bgra = np.frombuffer(shot.bgra, dtype=np.uint8).reshape(shot.height, shot.width, 4)
            rgb = np.ascontiguousarray(bgra[..., 2::-1])
            if cursor and self._has_xfixes:
                self._draw_cursor(rgb)
            return rgb

    def _draw_cursor(self, rgb: np.ndarray) -> None:
        image = self._d.xfixes_get_cursor_image(self._root)
        w, h = int(image.width), int(image.height)
        if w == 0 or h == 0:
            return
        argb = np.asarray(image.cursor_image, dtype=np.uint32).reshape(h, w)
        x0, y0 = int(image.x) - int(image.xhot), int(image.y) - int(image.yhot)
        sx0, sy0 = max(0, -x0), max(0, -y0)
        dx0, dy0 = max(0, x0), max(0, y0)
        dx1, dy1 = min(rgb.shape[1], x0 + w), min(rgb.shape[0], y0 + h)
        if dx1 <= dx0 or dy1 <= dy0:
            return
        part = argb[sy0 : sy0 + dy1 - dy0, sx0 : sx0 + dx1 - dx0]
        alpha = ((part >> 24) & 0xFF).astype(np.float32)[..., None] / 255.0
        # XFixes cursor pixels are premultiplied ARGB.
        src = np.stack([(part >> 16) & 0xFF, (part >> 8) & 0xFF, part & 0xFF], axis=-1).astype(np.float32)
        dst = rgb[dy0:dy1, dx0:dx1].astype(np.float32)
        rgb[dy0:dy1, dx0:dx1] = np.clip(src + dst * (1.0 - alpha), 0, 255).astype(np.uint8)

    def screenshot_png(self, *, cursor: bool = False, level: int = 1) -> bytes:
        """The screen as PNG bytes (zlib ``level`` 0-9; 1 is fast and still small for GUIs)."""
        rgb = self.screenshot_rgb(cursor=cursor)
        png = mss.tools.to_png(rgb.tobytes(), (rgb.shape[1], rgb.shape[0]), level=level)
        assert png is not None  # to_png returns bytes when no output path is given
        return png

    def close(self) -> None:
        """Close the X connection and the grabber. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._mss is not None:
                try:
                    self._mss.close()
                except Exception:  # a dead display may fail to close; nothing to do
                    pass
            try:
                self._d.close()
            except Exception:
                pass
