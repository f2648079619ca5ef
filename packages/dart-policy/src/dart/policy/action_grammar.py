"""UI-TARS-style action text: parse model output into typed actions, and format actions as text.

The policy answers in the UI-TARS format::

    Thought: the OK button is at the bottom right.
    Action: click(start_box='(912,871)')

Coordinates in the text live in a ``coord_scale`` x ``coord_scale`` grid (UI-TARS uses 1000), or in
a ``(width, height)`` space (the pixels of the screenshot the model was shown, see
:mod:`dart.policy.screen`), and become normalized [0, 1] coordinates. Boxes ``(x1,y1,x2,y2)``
resolve to their centre; the ``<|box_start|>``/``<|box_end|>`` wrappers and ``<point>x y</point>`` are accepted too.

:func:`parse_action` never raises: unparseable output yields a :class:`ParsedOutput` whose
``error`` says why, and the runner records it as a step with a parse error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import ValidationError

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

DEFAULT_COORD_SCALE = 1000
CoordScale = int | float | tuple[float, float]
"""A square grid's side, or the ``(width, height)`` that positions are divided by."""
MAX_OUTPUT_CHARS = 16384

_ACTION_LINE = re.compile(r"^\s*Action:\s*(?P<call>.*)", re.DOTALL | re.MULTILINE)
_THOUGHT = re.compile(r"Thought:[ \t]*(?P<thought>.*?)(?=\s*^\s*Action:|\Z)", re.DOTALL | re.MULTILINE)
_CALL = re.compile(r"^\s*(?P<name>[a-z_]+)\s*\((?P<args>.*)\)\s*$", re.DOTALL)
# key='value' pairs; values are single-quoted with backslash escapes.
_ARG = re.compile(r"\s*(?P<key>[a-z_]+)\s*=\s*'(?P<value>(?:[^'\\]|\\.)*)'\s*(?:,|$)", re.DOTALL)
_NUMBER = r"-?\d+(?:\.\d+)?"
_POINT_TAG = re.compile(rf"<point>\s*({_NUMBER})\s+({_NUMBER})\s*</point>")
_TUPLE = re.compile(rf"\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*(?:,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*)?\)")

_NAME_ALIASES = {
    "click": "click",
    "left_single": "click",
    "left_double": "double_click",
    "double_click": "double_click",
    "right_single": "right_click",
    "right_click": "right_click",
    "drag": "drag",
    "select": "drag",
    "hotkey": "hotkey",
    "press": "hotkey",
    "type": "type",
    "scroll": "scroll",
    "wait": "wait",
    "finished": "finished",
    "fail": "fail",
    "call_user": "fail",
}
_KEY_ALIASES = {"control": "ctrl", "return": "enter", "esc": "escape", "del": "delete", "arrowdown": "down"}


@dataclass(frozen=True)
class ParsedOutput:
    """Result of parsing one model output.

    Attributes:
        action: The typed action, or None when parsing failed.
        thought: The ``Thought:`` text, possibly empty.
        error: Why parsing failed, or None.
    """

    action: Action | None
    thought: str
    error: str | None


class _ParseFailure(Exception):
    pass


def parse_action(text: str, coord_scale: CoordScale = DEFAULT_COORD_SCALE) -> ParsedOutput:
    """Parse UI-TARS-style model output into a typed action. Never raises.

    Args:
        text: Raw decoded model output.
        coord_scale: Size of the coordinate space the model writes positions in (a grid's side, or
            ``(width, height)``).
    """
    try:
        if not isinstance(text, str):
            raise _ParseFailure(f"output is {type(text).__name__}, not text")
        if len(text) > MAX_OUTPUT_CHARS:
            raise _ParseFailure(f"output longer than {MAX_OUTPUT_CHARS} characters")
        thought_match = _THOUGHT.search(text)
        thought = thought_match.group("thought").strip() if thought_match else ""
        try:
            return ParsedOutput(_parse_call(text, coord_scale), thought, None)
        except _ParseFailure as exc:
            return ParsedOutput(None, thought, str(exc))
    except _ParseFailure as exc:
        return ParsedOutput(None, "", str(exc))
    except Exception as exc:  # the contract is "never raises": keep the reason instead
        return ParsedOutput(None, "", f"internal parser error: {type(exc).__name__}: {exc}")


def _parse_call(text: str, scale: CoordScale) -> Action:
    match = _ACTION_LINE.search(text)
    if match is None:
        raise _ParseFailure("no 'Action:' line")
    call_text = match.group("call").strip().splitlines()[0] if match.group("call").strip() else ""
    call = _CALL.match(call_text)
    if call is None:
        raise _ParseFailure(f"action is not a call like name(arg='...'): {call_text[:80]!r}")
    name = _NAME_ALIASES.get(call.group("name"))
    if name is None:
        raise _ParseFailure(f"unknown action {call.group('name')!r}")
    args = _parse_args(call.group("args"))
    try:
        return _build(name, args, scale)
    except ValidationError as exc:
        raise _ParseFailure(f"invalid {name} arguments: {exc.errors()[0]['msg']}") from None


def _parse_args(text: str) -> dict[str, str]:
    args: dict[str, str] = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        match = _ARG.match(text, pos)
        if match is None:
            raise _ParseFailure(f"cannot read arguments at {text[pos : pos + 40]!r}")
        args[match.group("key")] = _unescape(match.group("value"))
        pos = match.end()
    return args


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), value)


def _scales(scale: CoordScale) -> tuple[float, float]:
    return (float(scale[0]), float(scale[1])) if isinstance(scale, tuple) else (float(scale), float(scale))


def _point(value: str | None, scale: CoordScale) -> tuple[float, float]:
    if value is None:
        raise _ParseFailure("missing position argument")
    value = value.replace("<|box_start|>", "").replace("<|box_end|>", "")
    tag = _POINT_TAG.search(value)
    if tag:
        x, y = float(tag.group(1)), float(tag.group(2))
    else:
        tup = _TUPLE.search(value)
        if tup is None:
            raise _ParseFailure(f"cannot read a position from {value[:40]!r}")
        nums = [float(g) for g in tup.groups() if g is not None]
        x, y = (nums[0], nums[1]) if len(nums) == 2 else ((nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2)
    sx, sy = _scales(scale)
    nx, ny = x / sx, y / sy
    if not (0.0 <= nx <= 1.0 and 0.0 <= ny <= 1.0):
        space = f"{sx:g}x{sy:g} screenshot" if isinstance(scale, tuple) else f"0..{sx:g} screen grid"
        raise _ParseFailure(f"position ({x:g},{y:g}) is outside the {space}")
    return nx, ny


def _keys(value: str | None) -> tuple[str, ...]:
    if value is None or not value.strip():
        raise _ParseFailure("hotkey needs key='...'")
    keys = tuple(_KEY_ALIASES.get(k.lower(), k.lower()) for k in re.split(r"[\s+]+", value.strip()) if k)
    return keys


def _build(name: str, args: dict[str, str], scale: CoordScale) -> Action:
    box = args.get("start_box", args.get("point"))
    if name == "click":
        x, y = _point(box, scale)
        return Click(x=x, y=y)
    if name == "double_click":
        x, y = _point(box, scale)
        return DoubleClick(x=x, y=y)
    if name == "right_click":
        x, y = _point(box, scale)
        return RightClick(x=x, y=y)
    if name == "drag":
        x1, y1 = _point(box or args.get("start_point"), scale)
        x2, y2 = _point(args.get("end_box", args.get("end_point")), scale)
        return Drag(x1=x1, y1=y1, x2=x2, y2=y2)
    if name == "hotkey":
        return Hotkey(keys=_keys(args.get("key", args.get("keys"))))
    if name == "type":
        return Type(text=args.get("content", args.get("text", "")))
    if name == "scroll":
        x, y = _point(box, scale) if box is not None else (0.5, 0.5)
        direction = args.get("direction", "down").strip().lower()
        if direction not in {d.value for d in ScrollDirection}:
            raise _ParseFailure(f"scroll direction {direction!r} is not up/down/left/right")
        return Scroll(x=x, y=y, direction=ScrollDirection(direction))
    if name == "wait":
        return Wait()
    if name == "finished":
        return Finished(content=args.get("content", ""))
    return Fail(reason=args.get("reason", args.get("content", "")))


def format_action(action: Action, coord_scale: CoordScale = DEFAULT_COORD_SCALE) -> str:
    """Format a typed action as the call text the policy is trained to emit (no ``Action:`` prefix)."""
    sx, sy = _scales(coord_scale)

    def pt(x: float, y: float) -> str:
        return f"'({round(x * sx)},{round(y * sy)})'"

    def quote(s: str) -> str:
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"

    match action:
        case Click(x=x, y=y):
            return f"click(start_box={pt(x, y)})"
        case DoubleClick(x=x, y=y):
            return f"left_double(start_box={pt(x, y)})"
        case RightClick(x=x, y=y):
            return f"right_single(start_box={pt(x, y)})"
        case Drag(x1=x1, y1=y1, x2=x2, y2=y2):
            return f"drag(start_box={pt(x1, y1)}, end_box={pt(x2, y2)})"
        case Hotkey(keys=keys):
            return f"hotkey(key={quote(' '.join(keys))})"
        case Type(text=text):
            return f"type(content={quote(text)})"
        case Scroll(x=x, y=y, direction=d):
            return f"scroll(start_box={pt(x, y)}, direction='{d.value}')"
        case Wait():
            return "wait()"
        case Finished(content=content):
            return f"finished(content={quote(content)})"
        case Fail(reason=reason):
            return f"fail(reason={quote(reason)})"
    raise TypeError(f"not an action: {action!r}")


def format_output(thought: str, action: Action, coord_scale: CoordScale = DEFAULT_COORD_SCALE) -> str:
    """The full model output for a demonstration step: ``Thought: ...`` then ``Action: ...``."""
    return f"Thought: {thought}\nAction: {format_action(action, coord_scale)}"
