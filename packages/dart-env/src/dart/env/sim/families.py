"""The sim task families: generate a task from (family, difficulty, seed) and score its end state.

Every layout choice (labels, distractors, positions, pre-filled state) comes from one
``random.Random`` seeded by the task, so a task is rebuilt identically from its params, and the
policy has to read the screen to solve it.

What counts as success (reward 1.0; anything else is 0.0). Pressing any button ends the episode,
so a wrong button is final; an episode that ends on ``finished``/``fail`` or runs out of steps
without a button press scores 0.

- ``click-button``: the button pressed is the one named in the instruction.
- ``enter-text``: Submit was pressed (clicked, or Enter anywhere) while the named field holds
  exactly the word (case-sensitive) and every other field still holds its initial text.
- ``tick-boxes``: Submit was pressed while exactly the named boxes are ticked.
- ``select-item``: Submit was pressed while the named item is the list's selection.

Difficulty (``easy`` / ``medium`` / ``hard``) scales the number of distractors; ``medium`` and
``hard`` forms add a second button (Cancel, Reset ...) that ends the episode unsubmitted; ``hard``
adds state to undo (a pre-filled field, pre-ticked boxes) or a list that must be scrolled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from dart.env.sim.layout import Metrics, checkbox_at, frame, list_at, place, text_field_at
from dart.env.sim.render import text_width
from dart.env.sim.vocab import BUTTON_LABELS, CHECKBOX_LABELS, FIELD_LABELS, FORM_DISTRACTORS, LIST_ITEMS, WORDS
from dart.env.sim.widgets import Button, Checkbox, ListBox, Rect, TextField, Widget, Window
from dart.protocol.messages.observation import MetadataValue

FamilyName = Literal["click-button", "enter-text", "tick-boxes", "select-item"]
"""Names of the sim task families."""

FAMILIES: tuple[FamilyName, ...] = get_args(FamilyName)
"""Every family, in a fixed order."""

Difficulty = Literal["easy", "medium", "hard"]
"""How many distractors and how much state to undo."""

DIFFICULTIES: tuple[Difficulty, ...] = get_args(Difficulty)

MAX_STEPS: dict[FamilyName, int] = {"click-button": 3, "enter-text": 6, "tick-boxes": 10, "select-item": 8}
"""Step budget per family: the oracle's longest solution plus slack for a correction or two."""

SUBMIT_ID = "submit"
DISTRACTOR_ID = "other-button"


class SimTaskParams(BaseModel):
    """The ``params`` of a sim :class:`~dart.protocol.messages.TaskSpec`.

    Example: ``{family: select-item, difficulty: hard, seed: 7}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    family: FamilyName
    """Which task family."""
    difficulty: Difficulty = "easy"
    """Number of distractors and state to undo."""
    seed: int | None = Field(default=None, ge=0)
    """Seed of the layout. Without one, the env's reset seed picks the layout."""


@dataclass(frozen=True)
class ClickGoal:
    """Press the button ``button_id``."""

    button_id: str


@dataclass(frozen=True)
class EnterTextGoal:
    """Submit with ``text`` in field ``field_id`` and the other fields as they were (``others``)."""

    field_id: str
    text: str
    others: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class TickGoal:
    """Submit with exactly the boxes ``targets`` ticked."""

    targets: frozenset[str]


@dataclass(frozen=True)
class SelectGoal:
    """Submit with item ``index`` of list ``list_id`` selected."""

    list_id: str
    index: int


Goal = ClickGoal | EnterTextGoal | TickGoal | SelectGoal


@dataclass
class SimTask:
    """A generated task: its instruction, its live window and its goal.

    Lifecycle: built by :func:`build_task` at reset -> its window is changed by each step ->
    scored by :func:`evaluate` (any number of times) -> dropped at the next reset.
    """

    params: SimTaskParams
    seed: int
    instruction: str
    window: Window
    goal: Goal


def build_task(params: SimTaskParams, seed: int, width: int, height: int) -> SimTask:
    """Generate the task ``params`` describes with layout seed ``seed`` on a ``width`` x ``height`` screen.

    Raises:
        LayoutError: The screen is too small for the task.
    """
    rng = random.Random(f"sim:{params.family}:{params.difficulty}:{seed}")
    metrics = Metrics.for_screen(width, height)
    builder = _BUILDERS[params.family]
    instruction, window, goal = builder(rng, params.difficulty, metrics)
    return SimTask(params, seed, instruction, window, goal)


def evaluate(task: SimTask) -> tuple[float, dict[str, MetadataValue]]:
    """Score the task's current state (see the module docstring for what counts).

    Returns:
        The reward (1.0 or 0.0) and details: ``family``, ``submitted``, ``pressed`` (label of the
        button that ended the episode, or ``""``) and ``reason`` (why it failed, ``""`` on success).
    """
    window, goal = task.window, task.goal
    pressed = window.widget(window.pressed) if window.pressed else None
    details: dict[str, MetadataValue] = {
        "family": task.params.family,
        "submitted": window.submitted,
        "pressed": pressed.label if isinstance(pressed, Button) else "",
    }
    reason = _failure(window, goal)
    details["reason"] = reason or ""
    return (0.0 if reason else 1.0), details


def _failure(window: Window, goal: Goal) -> str | None:
    if window.pressed is None:
        return "no button was pressed"
    if isinstance(goal, ClickGoal):
        return None if window.pressed == goal.button_id else "a wrong button was pressed"
    if window.pressed != SUBMIT_ID:
        return "the form was not submitted"
    if isinstance(goal, EnterTextGoal):
        field = window.widget(goal.field_id)
        assert isinstance(field, TextField)
        if field.text != goal.text:
            return f"the {field.label} field holds {field.text!r}, not {goal.text!r}"
        if any(_field_text(window, fid) != text for fid, text in goal.others):
            return "another field was changed"
        return None
    if isinstance(goal, TickGoal):
        ticked = {w.id for w in window.widgets if isinstance(w, Checkbox) and w.checked}
        return None if ticked == goal.targets else "the wrong boxes are ticked"
    lst = window.widget(goal.list_id)
    assert isinstance(lst, ListBox)
    return None if lst.selected == goal.index else "the wrong item is selected"


def _field_text(window: Window, field_id: str) -> str:
    field = window.widget(field_id)
    assert isinstance(field, TextField)
    return field.text


def _join(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"


def _form_buttons(
    rng: random.Random, difficulty: Difficulty, metrics: Metrics
) -> tuple[list[tuple[str, str, bool]], list[tuple[int, int]]]:
    """(id, label, default) and sizes of a form's buttons: Submit, plus a distractor above easy."""
    buttons = [(SUBMIT_ID, "Submit", True)]
    if difficulty != "easy":
        buttons.append((DISTRACTOR_ID, rng.choice(FORM_DISTRACTORS), False))
    return buttons, [metrics.button_size(label) for _, label, _ in buttons]


def _buttons(specs: list[tuple[str, str, bool]], rects: list[Rect]) -> list[Widget]:
    return [Button(bid, label, rect, default=default) for (bid, label, default), rect in zip(specs, rects, strict=True)]


def _click_button(rng: random.Random, difficulty: Difficulty, m: Metrics) -> tuple[str, Window, Goal]:
    low, high = {"easy": (2, 3), "medium": (3, 4), "hard": (5, 6)}[difficulty]
    labels = rng.sample(BUTTON_LABELS, rng.randint(low, high))
    target = rng.randrange(len(labels))
    instruction = f'Click the "{labels[target]}" button.'
    window = frame(m, instruction)
    rects = place(rng, window, m, [m.button_size(label) for label in labels])
    window.widgets = [
        Button(f"button-{i}", label, rect) for i, (label, rect) in enumerate(zip(labels, rects, strict=True))
    ]
    return instruction, window, ClickGoal(f"button-{target}")


def _enter_text(rng: random.Random, difficulty: Difficulty, m: Metrics) -> tuple[str, Window, Goal]:
    labels = rng.sample(FIELD_LABELS, 1 if difficulty == "easy" else 2)
    target = rng.randrange(len(labels))
    word = rng.choice(WORDS)
    others = [w for w in WORDS if w != word]
    # Hard: every field starts filled, so the target's old text must be replaced.
    texts = [rng.choice(others) if difficulty == "hard" else "" for _ in labels]
    instruction = f'Enter "{word}" in the {labels[target]} field and press Submit.'
    window = frame(m, instruction)
    box_w = max(text_width(w, m.font_px) for w in WORDS) + 2 * m.font_px
    buttons, button_sizes = _form_buttons(rng, difficulty, m)
    rects = place(rng, window, m, [m.text_field_size(label, box_w) for label in labels] + button_sizes)
    fields = [
        text_field_at(f"field-{i}", label, rect, m, box_w, text)
        for i, (label, rect, text) in enumerate(zip(labels, rects[: len(labels)], texts, strict=True))
    ]
    window.widgets = [*fields, *_buttons(buttons, rects[len(labels) :])]
    kept = tuple((f.id, f.text) for i, f in enumerate(fields) if i != target)
    return instruction, window, EnterTextGoal(f"field-{target}", word, kept)


def _tick_boxes(rng: random.Random, difficulty: Difficulty, m: Metrics) -> tuple[str, Window, Goal]:
    count = {"easy": 3, "medium": rng.randint(4, 5), "hard": rng.randint(5, 6)}[difficulty]
    labels = rng.sample(CHECKBOX_LABELS, count)
    n_targets = {"easy": 1, "medium": rng.randint(1, 2), "hard": rng.randint(2, 3)}[difficulty]
    targets = sorted(rng.sample(range(count), n_targets))
    checked = [False] * count
    if difficulty == "hard":
        # Some boxes start ticked: the policy must untick wrong ones and leave right ones alone.
        for index in rng.sample(range(count), rng.randint(1, 2)):
            checked[index] = True
    instruction = f"Tick only {_join([labels[i] for i in targets])}, then press Submit."
    window = frame(m, instruction)
    buttons, button_sizes = _form_buttons(rng, difficulty, m)
    rects = place(rng, window, m, [m.checkbox_size(label) for label in labels] + button_sizes)
    boxes = [checkbox_at(f"box-{i}", labels[i], rects[i], m, checked[i]) for i in range(count)]
    window.widgets = [*boxes, *_buttons(buttons, rects[count:])]
    return instruction, window, TickGoal(frozenset(f"box-{i}" for i in targets))


def _select_item(rng: random.Random, difficulty: Difficulty, m: Metrics) -> tuple[str, Window, Goal]:
    if difficulty == "easy":
        count = rng.randint(4, 6)
        visible = count
    elif difficulty == "medium":
        count, visible = rng.randint(7, 10), 5
    else:
        count, visible = rng.randint(11, 16), rng.randint(4, 5)
    items = tuple(rng.sample(LIST_ITEMS, count))
    scroll = rng.randint(0, count - visible) if difficulty == "hard" else 0
    if difficulty == "hard":
        # The target is off screen: it must be scrolled into view before it can be clicked.
        target = rng.choice([i for i in range(count) if not scroll <= i < scroll + visible])
    else:
        target = rng.randrange(count)
    instruction = f'Select "{items[target]}" in the list and press Submit.'
    window = frame(m, instruction)
    buttons, button_sizes = _form_buttons(rng, difficulty, m)
    rects = place(rng, window, m, [m.list_size(items, visible), *button_sizes])
    window.widgets = [list_at("list", items, rects[0], m, scroll), *_buttons(buttons, rects[1:])]
    return instruction, window, SelectGoal("list", target)


_BUILDERS = {
    "click-button": _click_button,
    "enter-text": _enter_text,
    "tick-boxes": _tick_boxes,
    "select-item": _select_item,
}
