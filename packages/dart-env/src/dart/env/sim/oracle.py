"""The sim oracle: the next correct action, read from the env's internal state (not the screenshot).

It solves every task of every family in the fewest actions this GUI allows, using only actions
the UI-TARS text grammar can express (scrolls are single wheel clicks), so its episodes can be
written out as warm-start demonstrations. Each action comes with a short thought in the style a
policy is trained to produce.
"""

from __future__ import annotations

from typing import TypeVar

from dart.env.sim.families import SUBMIT_ID, ClickGoal, EnterTextGoal, SelectGoal, SimTask, TickGoal
from dart.env.sim.interaction import to_normalized
from dart.env.sim.widgets import Button, Checkbox, ListBox, Rect, TextField, Window
from dart.protocol.messages import Action, Click, Hotkey, Scroll, ScrollDirection, Type

W = TypeVar("W", Button, TextField, Checkbox, ListBox)


def oracle_action(task: SimTask) -> tuple[str, Action] | None:
    """The next action that makes progress towards the task's goal, with its thought.

    Returns:
        ``(thought, action)``, or None once the episode is over (a button was pressed).
    """
    window, goal = task.window, task.goal
    if window.submitted:
        return None
    if isinstance(goal, ClickGoal):
        button = _widget(window, goal.button_id, Button)
        return f'The task asks for the "{button.label}" button; I click it.', _click(window, button.rect)
    if isinstance(goal, EnterTextGoal):
        return _enter_text(window, goal)
    if isinstance(goal, TickGoal):
        return _tick_boxes(window, goal)
    return _select_item(window, goal)


def _enter_text(window: Window, goal: EnterTextGoal) -> tuple[str, Action]:
    field = _widget(window, goal.field_id, TextField)
    if window.focus != field.id:
        return f"I click the {field.label} field to type into it.", _click(window, field.box)
    if field.text == goal.text:
        return f'The {field.label} field says "{goal.text}"; I press Enter to submit.', Hotkey(keys=("enter",))
    if field.text and not field.all_selected:
        return f"The {field.label} field holds old text; I select all of it to replace it.", Hotkey(keys=("ctrl", "a"))
    return f'I type "{goal.text}" and press Enter to submit.', Type(text=goal.text + "\n")


def _tick_boxes(window: Window, goal: TickGoal) -> tuple[str, Action]:
    for widget in window.widgets:
        if isinstance(widget, Checkbox) and widget.checked != (widget.id in goal.targets):
            verb = "untick" if widget.checked else "tick"
            return f"{widget.label} should be {verb}ed; I click its box.", _click(window, widget.box)
    submit = _widget(window, SUBMIT_ID, Button)
    return "Exactly the right boxes are ticked; I press Submit.", _click(window, submit.rect)


def _select_item(window: Window, goal: SelectGoal) -> tuple[str, Action]:
    lst = _widget(window, goal.list_id, ListBox)
    item = lst.items[goal.index]
    if lst.selected == goal.index:
        submit = _widget(window, SUBMIT_ID, Button)
        return f"{item} is selected; I press Submit.", _click(window, submit.rect)
    row = lst.row_rect(goal.index)
    if row is not None:
        return f"I click {item} in the list to select it.", _click(window, row)
    direction = ScrollDirection.UP if goal.index < lst.scroll else ScrollDirection.DOWN
    x, y = to_normalized(*lst.rect.center, window.width, window.height)
    thought = f"{item} is not visible in the list; I scroll {direction.value} to find it."
    return thought, Scroll(x=x, y=y, direction=direction, amount=1)


def _click(window: Window, rect: Rect) -> Click:
    x, y = to_normalized(*rect.center, window.width, window.height)
    return Click(x=x, y=y)


def _widget(window: Window, widget_id: str, kind: type[W]) -> W:
    widget = window.widget(widget_id)
    assert isinstance(widget, kind), f"{widget_id} is a {type(widget).__name__}, not a {kind.__name__}"
    return widget
