"""Sim task families: generation, rewards, the oracle, and a random policy as a baseline."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dart.env.sim.families import (
    DIFFICULTIES,
    DISTRACTOR_ID,
    FAMILIES,
    MAX_STEPS,
    SUBMIT_ID,
    ClickGoal,
    EnterTextGoal,
    SelectGoal,
    SimTask,
    SimTaskParams,
    TickGoal,
    build_task,
    evaluate,
)
from dart.env.sim.interaction import apply_action, to_normalized
from dart.env.sim.oracle import oracle_action
from dart.env.sim.vocab import WORDS
from dart.env.sim.widgets import Button, Checkbox, ListBox, Rect, TextField
from dart.protocol.messages import (
    Action,
    Click,
    DoubleClick,
    Drag,
    Finished,
    Hotkey,
    RightClick,
    Scroll,
    ScrollDirection,
    Type,
    Wait,
)

pytestmark = pytest.mark.unit


def _task(family: str, difficulty: str, seed: int, size: tuple[int, int] = (224, 224)) -> SimTask:
    params = SimTaskParams.model_validate({"family": family, "difficulty": difficulty, "seed": seed})
    return build_task(params, seed, *size)


def _all_tasks(per_cell: int, size: tuple[int, int] = (224, 224)) -> list[SimTask]:
    return [_task(f, d, s, size) for f in FAMILIES for d in DIFFICULTIES for s in range(per_cell)]


def _click(task: SimTask, rect: Rect) -> None:
    x, y = to_normalized(*rect.center, task.window.width, task.window.height)
    apply_action(task.window, Click(x=x, y=y))


def _run_oracle(task: SimTask, quantize: bool = False) -> list[Action]:
    actions: list[Action] = []
    while (step := oracle_action(task)) is not None:
        thought, action = step
        assert thought
        if quantize and isinstance(action, Click | Scroll):
            # The UI-TARS text form carries coordinates on a 0..1000 grid.
            action = action.model_copy(update={"x": round(action.x * 1000) / 1000, "y": round(action.y * 1000) / 1000})
        apply_action(task.window, action)
        actions.append(action)
        assert len(actions) <= MAX_STEPS[task.params.family], f"oracle loops on {task.params}"
    return actions


def test_oracle_solves_every_task_within_the_step_budget() -> None:
    tasks = _all_tasks(per_cell=30)  # 360 tasks
    lengths: dict[str, Counter[int]] = {f: Counter() for f in FAMILIES}
    for task in tasks:
        actions = _run_oracle(task, quantize=True)
        reward, details = evaluate(task)
        assert reward == 1.0, (task.params, details)
        assert details["reason"] == ""
        lengths[task.params.family][len(actions)] += 1
    assert set(lengths["click-button"]) == {1}
    assert set(lengths["enter-text"]) == {2, 3}  # click, [ctrl+a,] type "word\n"
    assert min(lengths["tick-boxes"]) >= 1 and max(lengths["tick-boxes"]) <= 7
    assert min(lengths["select-item"]) == 2 and max(lengths["select-item"]) > 3  # some need scrolling


def test_oracle_solves_tasks_on_other_screen_sizes() -> None:
    for size in ((192, 192), (320, 256), (448, 448)):
        for task in _all_tasks(per_cell=3, size=size):
            _run_oracle(task)
            assert evaluate(task)[0] == 1.0, (size, task.params)


def _random_action(rng: random.Random) -> Action:
    r, x, y = rng.random(), rng.random(), rng.random()
    if r < 0.5:
        return Click(x=x, y=y)
    if r < 0.55:
        return DoubleClick(x=x, y=y)
    if r < 0.6:
        return RightClick(x=x, y=y)
    if r < 0.65:
        return Drag(x1=x, y1=y, x2=rng.random(), y2=rng.random())
    if r < 0.75:
        return Type(text=rng.choice(WORDS) + rng.choice(["", "\n"]))
    if r < 0.85:
        return Hotkey(keys=rng.choice([("enter",), ("ctrl", "a"), ("backspace",), ("tab",)]))
    if r < 0.95:
        return Scroll(x=x, y=y, direction=rng.choice(list(ScrollDirection)))
    if r < 0.98:
        return Wait()
    return Finished()


def test_a_random_policy_rarely_succeeds() -> None:
    rng = random.Random(0)
    tasks = _all_tasks(per_cell=25)  # 300 tasks
    successes = 0
    for task in tasks:
        for _ in range(MAX_STEPS[task.params.family]):
            action = _random_action(rng)
            apply_action(task.window, action)
            if task.window.submitted or isinstance(action, Finished):
                break
        successes += evaluate(task)[0] == 1.0
    assert successes / len(tasks) < 0.1  # about 2% in practice


def test_generation_is_deterministic_and_seed_dependent() -> None:
    def layout(task: SimTask) -> list[tuple[str, str, Rect]]:
        return [(w.id, getattr(w, "label", ""), w.rect) for w in task.window.widgets]

    for family in FAMILIES:
        a, b = _task(family, "medium", 11), _task(family, "medium", 11)
        assert (a.instruction, layout(a), a.goal) == (b.instruction, layout(b), b.goal)
        others = {(t.instruction, str(layout(t))) for t in (_task(family, "medium", s) for s in range(12, 20))}
        assert len(others) == 8  # every seed gives a different screen


def test_instruction_names_the_target() -> None:
    for task in _all_tasks(per_cell=5):
        window, goal = task.window, task.goal
        if isinstance(goal, ClickGoal):
            target = window.widget(goal.button_id)
            assert isinstance(target, Button) and f'"{target.label}"' in task.instruction
        elif isinstance(goal, EnterTextGoal):
            field = window.widget(goal.field_id)
            assert isinstance(field, TextField)
            assert f'"{goal.text}"' in task.instruction and f"the {field.label} field" in task.instruction
        elif isinstance(goal, TickGoal):
            labels = [w.label for w in window.widgets if isinstance(w, Checkbox) and w.id in goal.targets]
            assert labels and all(label in task.instruction for label in labels)
        else:
            lst = window.widget(goal.list_id)
            assert isinstance(lst, ListBox) and f'"{lst.items[goal.index]}"' in task.instruction


def test_difficulty_scales_distractors() -> None:
    def buttons(task: SimTask) -> int:
        return sum(isinstance(w, Button) for w in task.window.widgets)

    assert {buttons(_task("click-button", "easy", s)) for s in range(20)} <= {2, 3}
    assert {buttons(_task("click-button", "hard", s)) for s in range(20)} <= {5, 6}
    for family in ("enter-text", "tick-boxes", "select-item"):
        assert all(buttons(_task(family, "easy", s)) == 1 for s in range(5))  # Submit only
        assert all(buttons(_task(family, "hard", s)) == 2 for s in range(5))  # Submit and a distractor
    hard_fields = [_task("enter-text", "hard", s) for s in range(5)]
    assert all(w.text for t in hard_fields for w in t.window.widgets if isinstance(w, TextField))


def test_wrong_end_states_score_zero() -> None:
    # A wrong button.
    task = _task("click-button", "medium", 0)
    assert isinstance(task.goal, ClickGoal)
    wrong = next(w for w in task.window.widgets if isinstance(w, Button) and w.id != task.goal.button_id)
    _click(task, wrong.rect)
    assert evaluate(task) == (0.0, {**evaluate(task)[1], "reason": "a wrong button was pressed"})

    # The distractor button on a form, even with the right content.
    task = _task("enter-text", "medium", 0)
    _run_until_submit(task)
    _click(task, task.window.widget(DISTRACTOR_ID).rect)
    reward, details = evaluate(task)
    assert reward == 0.0 and details["reason"] == "the form was not submitted"

    # Right text in the wrong field.
    task = _task("enter-text", "medium", 1)
    assert isinstance(task.goal, EnterTextGoal)
    other = next(w for w in task.window.widgets if isinstance(w, TextField) and w.id != task.goal.field_id)
    _click(task, other.box)
    apply_action(task.window, Type(text=task.goal.text + "\n"))
    assert evaluate(task)[0] == 0.0

    # One box too many.
    task = _task("tick-boxes", "medium", 2)
    _run_until_submit(task)
    extra = next(w for w in task.window.widgets if isinstance(w, Checkbox) and not w.checked)
    _click(task, extra.box)
    _click(task, task.window.widget(SUBMIT_ID).rect)
    assert evaluate(task)[1]["reason"] == "the wrong boxes are ticked"

    # The wrong list item.
    task = _task("select-item", "easy", 3)
    assert isinstance(task.goal, SelectGoal)
    lst = task.window.widget("list")
    assert isinstance(lst, ListBox)
    wrong_row = lst.row_rect((task.goal.index + 1) % len(lst.items))
    assert wrong_row is not None
    _click(task, wrong_row)
    apply_action(task.window, Hotkey(keys=("enter",)))
    assert evaluate(task)[1]["reason"] == "the wrong item is selected"


def test_a_solved_but_unsubmitted_form_scores_zero() -> None:
    for family in ("enter-text", "tick-boxes", "select-item"):
        task = _task(family, "easy", 7)
        _run_until_submit(task)
        assert evaluate(task)[0] == 0.0
        assert evaluate(task)[1]["reason"] == "no button was pressed"
        apply_action(task.window, Hotkey(keys=("enter",)))
        assert evaluate(task)[0] == 1.0


def _run_until_submit(task: SimTask) -> None:
    """Run the oracle up to (not including) the action that would submit."""
    while (step := oracle_action(task)) is not None:
        _, action = step
        if isinstance(action, Type):
            apply_action(task.window, Type(text=action.text.rstrip("\n")))
            return
        if isinstance(action, Click) and task.window.widget_at(int(action.x * 224), int(action.y * 224)) is (
            task.window.widget(SUBMIT_ID)
        ):
            return
        apply_action(task.window, action)


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="family"):
        SimTaskParams.model_validate({"family": "nope", "seed": 1})
    with pytest.raises(ValueError, match="extra"):
        SimTaskParams.model_validate({"family": "click-button", "target": "OK"})
    with pytest.raises(ValueError, match="greater than or equal"):
        SimTaskParams.model_validate({"family": "click-button", "seed": -1})
