"""Scripted oracles: the next correct action of a MiniWoB++ task, read off the page's DOM.

Each solver sees the instruction, a fresh :class:`~dart.env.miniwob.dom.DomSnapshot` and the
actions taken so far in the episode, and returns the next ``(thought, action)`` or None when it
has nothing left to do. Solvers decide from the page's state (focus, values, checked boxes), so
they recover when the policy took other actions before them; they are for demonstrations and
tests, never shown to the policy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from dart.env.miniwob.browser import TASK_HEIGHT, TASK_WIDTH
from dart.env.miniwob.dom import DomSnapshot, Element
from dart.protocol.messages import Action, Click, Hotkey, Type

Step = tuple[str, Action]
Solver = Callable[[str, DomSnapshot, Sequence[Action]], Step | None]


def _click(element: Element, what: str) -> Step:
    x, y = element.center
    return f"Click {what}.", Click(x=min(max(x / TASK_WIDTH, 0.0), 1.0), y=min(max(y / TASK_HEIGHT, 0.0), 1.0))


def _quoted(utterance: str) -> list[str]:
    return re.findall(r'"([^"]*)"', utterance)


E = TypeVar("E")


def _first(items: list[E]) -> E | None:
    return items[0] if items else None


def _fill(field: Element, value: str, what: str) -> Step | None:
    """Focus ``field`` and type ``value`` into it; None once it holds ``value``."""
    if field.value == value:
        return None
    if not field.focused:
        return _click(field, what)
    if field.value:
        return f"Select the wrong text in {what} to replace it.", Hotkey(keys=("ctrl", "a"))
    return f"Type {value!r} into {what}.", Type(text=value)


def _fill_then_submit(dom: DomSnapshot, fields: list[tuple[Element | None, str, str]], submit: str) -> Step | None:
    for field, value, what in fields:
        if field is None:
            return None
        if (step := _fill(field, value, what)) is not None:
            return step
    button = _first(dom.find("button", text=submit))
    return _click(button, f"the {submit} button") if button else None


def _by_id(dom: DomSnapshot, element_id: str) -> Element | None:
    return _first([e for e in dom.elements if e.id == element_id])


def _labelled(dom: DomSnapshot, input_type: str) -> list[tuple[str, Element]]:
    """``(label text, input)`` pairs: each input takes the text of the label it sits in."""
    pairs: list[tuple[str, Element]] = []
    label = ""
    for element in dom.elements:
        if element.tag == "label":
            label = element.text
        elif element.tag == "input" and element.type == input_type:
            pairs.append((label, element))
    return pairs


def click_test(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    button = _first(dom.find("button"))
    return _click(button, "the button") if button and not history else None


def click_button_named(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    """click-test-2 (``Click button ONE.``) and click-button (``Click on the "Ok" button.``)."""
    quoted = _quoted(utterance)
    match = re.search(r"Click button (\S+)\.", utterance)
    target = quoted[0] if quoted else (match.group(1) if match else "")
    button = _first(dom.find("button", text=target))
    return _click(button, f"the {target} button") if button and not history else None


def click_button_sequence(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    order = ("ONE", "TWO")
    if len(history) >= len(order):
        return None
    button = _first(dom.find("button", text=order[len(history)]))
    return _click(button, f"button {order[len(history)]}") if button else None


def _select_then_submit(dom: DomSnapshot, input_type: str, targets: set[str]) -> Step | None:
    for label, box in _labelled(dom, input_type):
        if (label in targets) != box.checked:
            return _click(box, f"the {input_type} {label!r}")
    button = _first(dom.find("button", text="Submit"))
    return _click(button, "Submit") if button else None


def click_checkboxes(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    match = re.search(r"Select (.*) and click Submit", utterance)
    words = match.group(1) if match else ""
    targets = set() if words == "nothing" else {w.strip() for w in re.split(r",\s*", words) if w.strip()}
    return _select_then_submit(dom, "checkbox", targets)


def click_option(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    match = re.search(r"Select (.*) and click Submit", utterance)
    return _select_then_submit(dom, "radio", {match.group(1)} if match else set())


def click_link(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    target = _first(_quoted(utterance))
    link = _first(dom.find("span", text=target, cls="alink"))
    return _click(link, f"the link {target!r}") if link and not history else None


def enter_text(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    """enter-text and enter-text-2 (``... in all lower case letters ...``)."""
    value = _first(_quoted(utterance)) or ""
    if "lower case" in utterance:
        value = value.lower()
    elif "upper case" in utterance:
        value = value.upper()
    return _fill_then_submit(dom, [(_by_id(dom, "tt"), value, "the text field")], "Submit")


def enter_password(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    password = _first(_quoted(utterance)) or ""
    fields = [(_by_id(dom, "password"), password, "the password field"), (_by_id(dom, "verify"), password, "verify")]
    return _fill_then_submit(dom, fields, "Submit")


def login_user(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    quoted = _quoted(utterance)
    if len(quoted) < 2:
        return None
    fields = [
        (_by_id(dom, "username"), quoted[0], "the username field"),
        (_by_id(dom, "password"), quoted[1], "the password field"),
    ]
    return _fill_then_submit(dom, fields, "Login")


_ORDINALS = {"1st": 0, "2nd": 1, "3rd": 2, "4th": 3, "5th": 4}


def focus_text(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    """focus-text and focus-text-2 (``Focus into the 2nd input textbox.``)."""
    match = re.search(r"the (\d\w\w) input", utterance)
    index = _ORDINALS.get(match.group(1), 0) if match else 0
    fields = dom.inputs("text")
    if history or index >= len(fields):
        return None
    return _click(fields[index], "the text box")


def click_dialog(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    close = _first(dom.find("button", cls="ui-dialog-titlebar-close"))
    return _click(close, "the x of the dialog") if close and not history else None


def click_dialog_2(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    target = _first(_quoted(utterance)) or ""
    if target.lower() in ("x", "close"):
        return click_dialog(utterance, dom, history)
    button = _first(dom.find("button", text=target))
    return _click(button, f"the {target} button") if button and not history else None


def click_tab(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    match = re.search(r"Tab #(\d+)", utterance)
    tab = _first(dom.find("a", text=f"Tab #{match.group(1)}")) if match else None
    return _click(tab, f"Tab #{match.group(1)}") if tab and match and not history else None


def click_collapsible(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    header = _first(dom.find("h3", cls="ui-accordion-header"))
    if header is None:
        return None
    if "ui-accordion-header-collapsed" in header.classes:
        return _click(header, "the section header to expand it")
    button = _first(dom.find("button", text="Submit"))
    return _click(button, "Submit") if button else None


def click_widget(utterance: str, dom: DomSnapshot, history: Sequence[Action]) -> Step | None:
    kind = _first(_quoted(utterance)) or ""
    for element in dom.elements:
        if (element.tag == "input" and element.type == kind) or (element.tag == kind and element.tag != "input"):
            return None if history else _click(element, f"the {kind} widget")
    return None


SOLVERS: dict[str, Solver] = {
    "click-test": click_test,
    "click-test-2": click_button_named,
    "click-button": click_button_named,
    "click-button-sequence": click_button_sequence,
    "click-checkboxes": click_checkboxes,
    "click-option": click_option,
    "click-link": click_link,
    "enter-text": enter_text,
    "enter-text-2": enter_text,
    "enter-password": enter_password,
    "login-user": login_user,
    "focus-text": focus_text,
    "focus-text-2": focus_text,
    "click-dialog": click_dialog,
    "click-dialog-2": click_dialog_2,
    "click-tab": click_tab,
    "click-collapsible-nodelay": click_collapsible,
    "click-widget": click_widget,
}
"""Task name -> solver: the tasks with an oracle."""
