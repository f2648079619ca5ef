"""The sim GUI's input semantics, on windows built by the task families (no env, no rendering)."""

from __future__ import annotations

import pytest

from dart.env.sim.families import SUBMIT_ID, EnterTextGoal, SelectGoal, SimTask, SimTaskParams, build_task, evaluate
from dart.env.sim.interaction import apply_action, to_normalized, to_pixel
from dart.env.sim.widgets import SCROLL_ROWS_PER_WHEEL_CLICK, Button, Checkbox, ListBox, Rect, TextField
from dart.protocol.messages import (
    Click,
    DoubleClick,
    Drag,
    Hotkey,
    RightClick,
    Scroll,
    ScrollDirection,
    Type,
    Wait,
)

pytestmark = pytest.mark.unit

SIZE = 224


def _task(family: str, difficulty: str = "easy", seed: int = 0) -> SimTask:
    params = SimTaskParams.model_validate({"family": family, "difficulty": difficulty, "seed": seed})
    return build_task(params, seed, SIZE, SIZE)


def _at(rect: Rect) -> tuple[float, float]:
    return to_normalized(*rect.center, SIZE, SIZE)


def _click(task: SimTask, rect: Rect) -> str:
    x, y = _at(rect)
    return apply_action(task.window, Click(x=x, y=y))


def _field(task: SimTask) -> TextField:
    assert isinstance(task.goal, EnterTextGoal)
    field = task.window.widget(task.goal.field_id)
    assert isinstance(field, TextField)
    return field


def _list(task: SimTask) -> ListBox:
    lst = task.window.widget("list")
    assert isinstance(lst, ListBox)
    return lst


def test_pixel_mapping_round_trips_and_clamps() -> None:
    for px in (0, 1, 100, 223):
        x, y = to_normalized(px, px, SIZE, SIZE)
        assert to_pixel(x, y, SIZE, SIZE) == (px, px)
    assert to_pixel(1.0, 1.0, SIZE, SIZE) == (223, 223)
    assert to_pixel(0.0, 0.0, SIZE, SIZE) == (0, 0)


def test_click_on_a_button_presses_it_and_freezes_the_window() -> None:
    task = _task("click-button", "hard", 3)
    buttons = [w for w in task.window.widgets if isinstance(w, Button)]
    assert _click(task, buttons[0].rect) == f"press: {buttons[0].label}"
    assert task.window.pressed == buttons[0].id
    # Once pressed, nothing changes any more.
    assert _click(task, buttons[1].rect).startswith("ignored")
    assert task.window.pressed == buttons[0].id


def test_click_on_empty_space_blurs_and_right_click_does_nothing() -> None:
    task = _task("enter-text")
    field = _field(task)
    _click(task, field.box)
    assert task.window.focus == field.id
    x, y = _at(field.box)
    assert apply_action(task.window, RightClick(x=x, y=y)) == "right_click: no context menu"
    assert apply_action(task.window, Wait()) == "wait"
    assert task.window.focus == field.id
    apply_action(task.window, Click(x=0.01, y=0.99))  # the window frame: no widget
    assert task.window.focus is None


def test_typing_goes_to_the_focused_field_only() -> None:
    task = _task("enter-text")
    field = _field(task)
    assert apply_action(task.window, Type(text="abc")) == "type: no text field focused"
    assert field.text == ""
    _click(task, field.label_rect)  # a label focuses its field, as in HTML
    assert apply_action(task.window, Type(text="abc")) == f"type: 3 chars into {field.label}"
    assert field.text == "abc"
    field.max_len = 5
    apply_action(task.window, Type(text="defgh"))
    assert field.text == "abcde"
    assert not task.window.submitted


def test_type_with_trailing_newline_submits_the_form() -> None:
    task = _task("enter-text", "medium", 4)
    assert isinstance(task.goal, EnterTextGoal)
    _click(task, _field(task).box)
    event = apply_action(task.window, Type(text=task.goal.text + "\nignored"))
    assert event.endswith("press: Submit")
    assert task.window.pressed == SUBMIT_ID
    assert _field(task).text == task.goal.text  # characters after Enter are not typed
    assert evaluate(task)[0] == 1.0


def test_enter_hotkey_submits_and_select_all_replaces_or_clears() -> None:
    task = _task("enter-text", "hard", 1)
    field = _field(task)
    old = field.text
    assert old  # hard tasks start with text in the field
    _click(task, field.box)
    apply_action(task.window, Type(text="x"))
    assert field.text == old + "x"  # the caret is at the end
    apply_action(task.window, Hotkey(keys=("backspace",)))
    assert field.text == old
    apply_action(task.window, Hotkey(keys=("ctrl", "a")))
    assert field.all_selected
    apply_action(task.window, Hotkey(keys=("backspace",)))
    assert field.text == ""
    apply_action(task.window, Type(text="new"))
    apply_action(task.window, Hotkey(keys=("cmd", "a")))  # cmd counts as ctrl
    apply_action(task.window, Type(text="kept"))
    assert field.text == "kept"
    apply_action(task.window, Hotkey(keys=("Return",)))
    assert task.window.pressed == SUBMIT_ID


def test_double_click_and_drag_select_a_fields_text() -> None:
    task = _task("enter-text", "hard", 2)
    field = _field(task)
    x, y = _at(field.box)
    apply_action(task.window, DoubleClick(x=x, y=y))
    assert task.window.focus == field.id and field.all_selected
    apply_action(task.window, Type(text="w"))
    assert field.text == "w"
    apply_action(task.window, Drag(x1=x, y1=y, x2=x + 0.02, y2=y))
    assert field.all_selected


def test_click_toggles_a_checkbox_and_double_click_leaves_it() -> None:
    task = _task("tick-boxes", "medium", 0)
    box = next(w for w in task.window.widgets if isinstance(w, Checkbox))
    before = box.checked
    assert _click(task, box.label_rect).startswith(f"toggle: {box.label}")
    assert box.checked is not before
    x, y = _at(box.box)
    apply_action(task.window, DoubleClick(x=x, y=y))
    assert box.checked is not before  # two toggles
    apply_action(task.window, Hotkey(keys=("space",)))  # the box has focus
    assert box.checked is before


def test_tab_cycles_focus_and_escape_clears_it() -> None:
    task = _task("tick-boxes", "hard", 5)
    boxes = [w for w in task.window.widgets if isinstance(w, Checkbox)]
    apply_action(task.window, Hotkey(keys=("tab",)))
    assert task.window.focus == boxes[0].id
    apply_action(task.window, Hotkey(keys=("tab",)))
    assert task.window.focus == boxes[1].id
    apply_action(task.window, Hotkey(keys=("shift", "tab")))
    assert task.window.focus == boxes[0].id
    apply_action(task.window, Hotkey(keys=("escape",)))
    assert task.window.focus is None
    assert apply_action(task.window, Hotkey(keys=("f13",))) == "hotkey: f13 does nothing"


def test_scroll_makes_hidden_list_items_reachable() -> None:
    task = _task("select-item", "hard", 6)
    assert isinstance(task.goal, SelectGoal)
    lst = _list(task)
    target = task.goal.index
    assert lst.row_rect(target) is None  # hard: the target starts off screen
    x, y = _at(lst.rect)
    direction = ScrollDirection.DOWN if target >= lst.scroll else ScrollDirection.UP
    for _ in range(len(lst.items)):
        if lst.row_rect(target) is not None:
            break
        before = lst.scroll
        apply_action(task.window, Scroll(x=x, y=y, direction=direction))
        assert abs(lst.scroll - before) <= SCROLL_ROWS_PER_WHEEL_CLICK
    row = lst.row_rect(target)
    assert row is not None
    assert _click(task, row) == f"select: {lst.items[target]}"
    assert lst.selected == target


def test_scroll_outside_a_list_or_sideways_does_nothing() -> None:
    task = _task("select-item", "medium", 2)
    lst = _list(task)
    lst.items = lst.items + ("Extra1", "Extra2", "Extra3", "Extra4", "Extra5", "Extra6")
    x, y = _at(lst.rect)
    assert apply_action(task.window, Scroll(x=0.01, y=0.99, direction=ScrollDirection.DOWN)).endswith(
        "nothing to scroll"
    )
    assert apply_action(task.window, Scroll(x=x, y=y, direction=ScrollDirection.RIGHT)).endswith("nothing to scroll")
    assert lst.scroll == 0
    apply_action(task.window, Scroll(x=x, y=y, direction=ScrollDirection.DOWN, amount=100))
    assert lst.scroll == lst.max_scroll  # clamped
    apply_action(task.window, Scroll(x=x, y=y, direction=ScrollDirection.UP, amount=100))
    assert lst.scroll == 0


def test_scroll_bar_track_click_pages_and_thumb_drag_scrolls() -> None:
    task = _task("select-item", "hard", 9)
    lst = _list(task)
    lst.scroll = 0
    track, thumb = lst.scrollbar, lst.thumb
    assert track is not None and thumb is not None
    _click(task, Rect(track.x, thumb.bottom, track.w, track.bottom - thumb.bottom))  # below the thumb
    assert lst.scroll == min(lst.max_scroll, lst.visible_rows)
    lst.scroll = 0
    thumb = lst.thumb
    assert thumb is not None
    x, y = _at(thumb)
    apply_action(task.window, Drag(x1=x, y1=y, x2=x, y2=min(1.0, y + 0.5)))
    assert lst.scroll == lst.max_scroll
    apply_action(task.window, Drag(x1=0.01, y1=0.99, x2=0.5, y2=0.5))  # from nothing: no effect
    assert lst.scroll == lst.max_scroll


def test_arrow_keys_move_a_focused_lists_selection() -> None:
    task = _task("select-item", "medium", 3)
    lst = _list(task)
    _click(task, lst.rect)  # focuses and selects the clicked row
    assert task.window.focus == "list" and lst.selected is not None
    start = lst.selected
    apply_action(task.window, Hotkey(keys=("down",)))
    assert lst.selected == min(len(lst.items) - 1, start + 1)
    for _ in range(len(lst.items)):
        apply_action(task.window, Hotkey(keys=("down",)))
    assert lst.selected == len(lst.items) - 1
    assert lst.row_rect(lst.selected) is not None  # scrolled into view


def test_drag_press_and_release_on_one_button_is_a_click() -> None:
    task = _task("click-button", "easy", 1)
    button = next(w for w in task.window.widgets if isinstance(w, Button))
    x, y = _at(button.rect)
    apply_action(task.window, Drag(x1=x, y1=y, x2=0.01, y2=0.99))  # released elsewhere: no click
    assert task.window.pressed is None
    apply_action(task.window, Drag(x1=x, y1=y, x2=x, y2=y))
    assert task.window.pressed == button.id
