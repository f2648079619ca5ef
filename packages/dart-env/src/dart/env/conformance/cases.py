"""The conformance cases and each backend's plan for them.

Ground truth per backend: the sim window's widgets; the MiniWoB++ page's DOM (read through the
browser's WebDriver, as the oracles do); the X events the probe app recorded on the local desktop
(see :mod:`dart.env.conformance.xevents`), for the ``desktop`` and ``osworld`` backends alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dart.env.conformance.model import Case, Located, NotApplicable, Plan, Point, Verdict, verdict
from dart.env.miniwob import miniwob_task
from dart.env.sim import SimEnv, sim_task
from dart.env.sim.families import ClickGoal
from dart.env.sim.interaction import to_normalized
from dart.env.sim.widgets import ListBox, Rect, TextField
from dart.protocol.messages import Action, Click, Drag, Hotkey, RightClick, Scroll, ScrollDirection, TaskSpec, Type

TYPED_TEXT = "Hello, DART!"
"""What the typing case types: capitals and punctuation exercise shifted keys."""
WRONG_TEXT = "wrong"
RIGHT_TEXT = "right"


# -- sim plans: the sim window's widgets are the ground truth --------------------------------


def _sim_window(env: SimEnv) -> Any:
    assert env.task is not None, "reset first"
    return env.task.window


def _sim_point(env: SimEnv, rect: Rect) -> Point:
    window = _sim_window(env)
    return to_normalized(*rect.center, window.width, window.height)


def _sim_widget(env: SimEnv, kind: type[Any]) -> Any:
    found = [w for w in _sim_window(env).widgets if isinstance(w, kind)]
    assert found, f"the sim task has no {kind.__name__}"
    return found[0]


async def _sim_locate_goal_button(env: SimEnv) -> Located:
    assert env.task is not None and isinstance(env.task.goal, ClickGoal)
    button = _sim_window(env).widget(env.task.goal.button_id)
    return Located({"button": _sim_point(env, button.rect)}, {"button_id": button.id})


async def _sim_check_pressed(env: SimEnv, located: Located, actions: Sequence[Action]) -> Verdict:
    _, success, _ = await env.evaluate()
    pressed = _sim_window(env).pressed
    return verdict(pressed == located.before["button_id"] and success, located.before["button_id"], pressed)


async def _sim_locate_field(env: SimEnv) -> Located:
    field_ = _sim_widget(env, TextField)
    return Located({"field": _sim_point(env, field_.box)}, {"field_id": field_.id})


def _sim_check_field(text: str) -> Callable[[SimEnv, Located, Sequence[Action]], Awaitable[Verdict]]:
    async def check(env: SimEnv, located: Located, actions: Sequence[Action]) -> Verdict:
        field_ = _sim_window(env).widget(located.before["field_id"])
        assert isinstance(field_, TextField)
        return verdict(field_.text == text, text, field_.text)

    return check


async def _sim_locate_list(env: SimEnv) -> Located:
    lst = _sim_widget(env, ListBox)
    assert lst.thumb is not None and lst.scroll < lst.max_scroll, "pick a seed with room to scroll down"
    body = Rect(lst.rect.x + 2, lst.rect.y + 2, lst.rect.w // 2, lst.rect.h - 4)
    track, thumb = lst.scrollbar, lst.thumb
    assert track is not None
    drop = (thumb.center[0], track.bottom - 2)  # the bottom of the scroll bar track
    return Located(
        {
            "scrollable": _sim_point(env, body),
            "handle": _sim_point(env, thumb),
            "drop": to_normalized(*drop, _sim_window(env).width, _sim_window(env).height),
        },
        {"scroll": lst.scroll, "max_scroll": lst.max_scroll, "items": len(lst.items), "track_h": track.h},
    )


async def _sim_check_scrolled(env: SimEnv, located: Located, actions: Sequence[Action]) -> Verdict:
    from dart.env.sim.widgets import SCROLL_ROWS_PER_WHEEL_CLICK

    lst = _sim_widget(env, ListBox)
    clicks = sum(a.amount for a in actions if isinstance(a, Scroll))
    want = min(located.before["max_scroll"], located.before["scroll"] + clicks * SCROLL_ROWS_PER_WHEEL_CLICK)
    return verdict(lst.scroll == want, f"list at row {want}", f"list at row {lst.scroll}")


async def _sim_check_dragged(env: SimEnv, located: Located, actions: Sequence[Action]) -> Verdict:
    # The thumb was dragged to the bottom of its track: the list shows its last rows.
    lst = _sim_widget(env, ListBox)
    return verdict(lst.scroll == lst.max_scroll, f"list at row {lst.max_scroll}", f"list at row {lst.scroll}")


# -- miniwob plans: the page's DOM is the ground truth ---------------------------------------

_RECT_JS = (
    "const e = document.querySelector(arguments[0]); if (!e) return null;"
    "const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2];"
)


def _driver(env: Any) -> Any:
    browser = env.browser
    assert browser is not None, "the browser is not running"
    return browser.driver


def _miniwob_point(env: Any, selector: str) -> Point:
    from dart.env.miniwob.browser import TASK_HEIGHT, TASK_WIDTH

    center = _driver(env).execute_script(_RECT_JS, selector)
    assert center is not None, f"no element {selector!r} on the page"
    return center[0] / TASK_WIDTH, center[1] / TASK_HEIGHT


async def _in_thread(func: Callable[[], Any]) -> Any:
    return await asyncio.to_thread(func)


async def _miniwob_locate_named_button(env: Any) -> Located:
    # The oracle reads the named button off the DOM; its click is the target.
    step = env.oracle_action()
    assert step is not None and isinstance(step[1], Click), "click-button has an oracle"
    return Located({"button": (step[1].x, step[1].y)})


async def _miniwob_check_reward(env: Any, located: Located, actions: Sequence[Action]) -> Verdict:
    reward, success, details = await env.evaluate()
    return verdict(success, "raw reward 1.0", f"raw reward {details['raw_reward']} ({details['reason']})")


async def _miniwob_locate_field(env: Any) -> Located:
    return Located({"field": await _in_thread(lambda: _miniwob_point(env, "#tt"))})


def _miniwob_check_field(text: str) -> Callable[[Any, Located, Sequence[Action]], Awaitable[Verdict]]:
    async def check(env: Any, located: Located, actions: Sequence[Action]) -> Verdict:
        value = await _in_thread(lambda: _driver(env).execute_script("return document.querySelector('#tt').value;"))
        return verdict(value == text, text, value)

    return check


_SCROLL_JS = "const t = document.querySelector('#text-area'); return [t.scrollTop, t.scrollHeight - t.clientHeight];"


async def _miniwob_locate_textarea(env: Any) -> Located:
    def locate() -> Located:
        top, max_top = _driver(env).execute_script(_SCROLL_JS)
        return Located({"scrollable": _miniwob_point(env, "#text-area")}, {"top": top, "max_top": max_top})

    located: Located = await _in_thread(locate)
    return located


async def _miniwob_check_scrolled(env: Any, located: Located, actions: Sequence[Action]) -> Verdict:
    from dart.env.miniwob.browser import SCROLL_PX

    clicks = sum(a.amount for a in actions if isinstance(a, Scroll))
    want = min(located.before["max_top"], located.before["top"] + clicks * SCROLL_PX)
    top, _ = await _in_thread(lambda: _driver(env).execute_script(_SCROLL_JS))
    return verdict(top == want, f"scrollTop {want}", f"scrollTop {top}")


async def _miniwob_locate_boxes(env: Any) -> Located:
    def locate() -> Located:
        return Located(
            {"handle": _miniwob_point(env, "#draggableSmall"), "drop": _miniwob_point(env, "#draggableLarge")}
        )

    located: Located = await _in_thread(locate)
    return located


async def _miniwob_check_contained(env: Any, located: Located, actions: Sequence[Action]) -> Verdict:
    inside = await _in_thread(lambda: _driver(env).execute_script("return smallBoxContained();"))
    return verdict(inside is True, "the small box inside the large one", f"smallBoxContained() = {inside}")


_CONTEXT_MENU_JS = (
    "window.__dartContext = [];"
    "document.addEventListener('contextmenu', e => { window.__dartContext.push([e.clientX, e.clientY]); "
    "e.preventDefault(); }, true);"
)


async def _miniwob_locate_context(env: Any) -> Located:
    def locate() -> Located:
        _driver(env).execute_script(_CONTEXT_MENU_JS)
        return Located({"button": _miniwob_point(env, "#subbtn")})

    located: Located = await _in_thread(locate)
    return located


async def _miniwob_check_context(env: Any, located: Located, actions: Sequence[Action]) -> Verdict:
    from dart.env.miniwob.browser import TASK_HEIGHT, TASK_WIDTH

    events = await _in_thread(lambda: _driver(env).execute_script("return window.__dartContext;"))
    x, y = located.points["button"]
    want = [[int(x * TASK_WIDTH), int(y * TASK_HEIGHT)]]
    return verdict(events == want, f"one contextmenu event at {want[0]}", events)


# -- desktop plans: the probe app's X events are the ground truth ----------------------------


PROBE_FILE = "dart-probe.jsonl"
"""Name of the probe app's event log in the osworld desktop's HOME."""


def _probe_plans(case: str, points: dict[str, Point]) -> dict[str, Plan]:
    """The desktop and osworld plans of a case: the probe app fills the screen, so any points work;
    the check compares the X events it recorded with those the case's actions must produce."""

    async def locate(harness: Any) -> Located:
        await harness.probe_ready()
        return Located(points)

    async def check(harness: Any, located: Located, actions: Sequence[Action]) -> Verdict:
        checker: Callable[[Sequence[Action]], Awaitable[Verdict]] = harness.check_events
        return await checker(actions)

    # The desktop's python3 is the service's Python (dart.env.desktop.interpreter), runnable by the desktop's user.
    probe = f'exec python3 -m dart.env.desktop.probe --out "$HOME/{PROBE_FILE}"'
    osworld_task = TaskSpec(
        task_id=f"conformance/{case}",
        backend="osworld",
        instruction=f"Action conformance: {case}",
        params={
            "id": f"dart-conformance-{case}",
            "instruction": f"Action conformance: {case}",
            "config": [{"type": "launch", "parameters": {"command": probe, "shell": True}}],
            "evaluator": {"func": "infeasible"},
        },
    )
    return {
        "desktop": Plan("the probe app full screen on an XDesktop, actions via POST /dart/action", None, locate, check),
        "osworld": Plan("an OSWorld-format task whose setup launches the probe app", osworld_task, locate, check),
    }


# -- the cases -------------------------------------------------------------------------------


CASES: tuple[Case, ...] = (
    Case(
        name="click-button",
        expected="the named button is pressed (once, at its pixel)",
        actions=lambda p: [Click(x=p["button"][0], y=p["button"][1])],
        plans={
            "sim": Plan(
                "sim click-button/medium seed 3",
                sim_task("click-button", "medium", 3),
                _sim_locate_goal_button,
                _sim_check_pressed,
            ),
            "miniwob": Plan(
                "miniwob click-button seed 2",
                miniwob_task("click-button", 2),
                _miniwob_locate_named_button,
                _miniwob_check_reward,
            ),
            **_probe_plans("click-button", {"button": (0.3125, 0.4)}),
        },
    ),
    Case(
        name="type-text",
        expected=f"the focused text field holds exactly {TYPED_TEXT!r}",
        actions=lambda p: [Click(x=p["field"][0], y=p["field"][1]), Type(text=TYPED_TEXT)],
        plans={
            "sim": Plan(
                "sim enter-text/easy seed 5",
                sim_task("enter-text", "easy", 5),
                _sim_locate_field,
                _sim_check_field(TYPED_TEXT),
            ),
            "miniwob": Plan(
                "miniwob enter-text seed 1",
                miniwob_task("enter-text", 1),
                _miniwob_locate_field,
                _miniwob_check_field(TYPED_TEXT),
            ),
            **_probe_plans("type-text", {"field": (0.5, 0.25)}),
        },
    ),
    Case(
        name="hotkey-select-all",
        expected=f"after typing {WRONG_TEXT!r}, ctrl+a then typing {RIGHT_TEXT!r} leaves exactly {RIGHT_TEXT!r}",
        actions=lambda p: [
            Click(x=p["field"][0], y=p["field"][1]),
            Type(text=WRONG_TEXT),
            Hotkey(keys=("ctrl", "a")),
            Type(text=RIGHT_TEXT),
        ],
        plans={
            "sim": Plan(
                "sim enter-text/easy seed 5",
                sim_task("enter-text", "easy", 5),
                _sim_locate_field,
                _sim_check_field(RIGHT_TEXT),
            ),
            "miniwob": Plan(
                "miniwob enter-text seed 1",
                miniwob_task("enter-text", 1),
                _miniwob_locate_field,
                _miniwob_check_field(RIGHT_TEXT),
            ),
            **_probe_plans("hotkey-select-all", {"field": (0.5, 0.25)}),
        },
    ),
    Case(
        name="scroll",
        expected="the content under the pointer moves down by exactly one wheel click (clamped at the end)",
        actions=lambda p: [
            Scroll(x=p["scrollable"][0], y=p["scrollable"][1], direction=ScrollDirection.DOWN, amount=1)
        ],
        plans={
            "sim": Plan(
                "sim select-item/hard seed 3 (a scrollable list)",
                sim_task("select-item", "hard", 3),
                _sim_locate_list,
                _sim_check_scrolled,
            ),
            "miniwob": Plan(
                "miniwob scroll-text-2 seed 1 (a scrollable textarea)",
                miniwob_task("scroll-text-2", 1),
                _miniwob_locate_textarea,
                _miniwob_check_scrolled,
            ),
            **_probe_plans("scroll", {"scrollable": (0.75, 0.6)}),
        },
    ),
    Case(
        name="drag",
        expected="the handle pressed at the start point is released at the drop point",
        actions=lambda p: [Drag(x1=p["handle"][0], y1=p["handle"][1], x2=p["drop"][0], y2=p["drop"][1])],
        plans={
            "sim": Plan(
                "sim select-item/hard seed 3: the list's scroll bar thumb dragged to the track's end",
                sim_task("select-item", "hard", 3),
                _sim_locate_list,
                _sim_check_dragged,
            ),
            "miniwob": Plan(
                "miniwob drag-box seed 1: the small box dragged into the large one",
                miniwob_task("drag-box", 1),
                _miniwob_locate_boxes,
                _miniwob_check_contained,
            ),
            **_probe_plans("drag", {"handle": (0.2, 0.7), "drop": (0.6, 0.3)}),
        },
    ),
    Case(
        name="right-click",
        expected="one context-menu (right button) press at the target's pixel",
        actions=lambda p: [RightClick(x=p["button"][0], y=p["button"][1])],
        plans={
            "sim": NotApplicable("the sim GUI has no context menus: right_click does nothing by design"),
            "miniwob": Plan(
                "miniwob click-test seed 0: a contextmenu listener on the page",
                miniwob_task("click-test", 0),
                _miniwob_locate_context,
                _miniwob_check_context,
            ),
            **_probe_plans("right-click", {"button": (0.55, 0.85)}),
        },
    ),
)
"""The conformance suite."""
