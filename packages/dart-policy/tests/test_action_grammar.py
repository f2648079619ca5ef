"""The UI-TARS action grammar: parses what it should, never raises, and round-trips with the formatter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dart.policy.action_grammar import format_action, format_output, parse_action
from dart.protocol import messages as m

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Thought: press OK\nAction: click(start_box='(100,200)')", m.Click(x=0.1, y=0.2)),
        ("Action: click(start_box='<|box_start|>(100,200)<|box_end|>')", m.Click(x=0.1, y=0.2)),
        ("Action: click(start_box='(100,200,300,400)')", m.Click(x=0.2, y=0.3)),
        ("Action: click(point='<point>500 250</point>')", m.Click(x=0.5, y=0.25)),
        ("Action: left_double(start_box='(0,1000)')", m.DoubleClick(x=0.0, y=1.0)),
        ("Action: right_single(start_box='(10,10)')", m.RightClick(x=0.01, y=0.01)),
        ("Action: drag(start_box='(0,0)', end_box='(1000,500)')", m.Drag(x1=0, y1=0, x2=1, y2=0.5)),
        ("Action: hotkey(key='Control C')", m.Hotkey(keys=("ctrl", "c"))),
        ("Action: hotkey(key='ctrl+shift+t')", m.Hotkey(keys=("ctrl", "shift", "t"))),
        ("Action: press(key='enter')", m.Hotkey(keys=("enter",))),
        ("Action: type(content='it\\'s done\\n')", m.Type(text="it's done\n")),
        (
            "Action: scroll(start_box='(500,500)', direction='UP')",
            m.Scroll(x=0.5, y=0.5, direction=m.ScrollDirection.UP),
        ),
        ("Action: scroll(direction='down')", m.Scroll(x=0.5, y=0.5, direction=m.ScrollDirection.DOWN)),
        ("Action: wait()", m.Wait()),
        ("Action: finished(content='42')", m.Finished(content="42")),
        ("Action: finished()", m.Finished()),
        ("Action: call_user()", m.Fail()),
        ("Thought: multi\nline\nAction: wait()\ntrailing text", m.Wait()),
    ],
)
def test_parses_ui_tars_output(text: str, expected: m.Action) -> None:
    out = parse_action(text)
    assert out.error is None
    assert out.action == expected


def test_thought_is_extracted() -> None:
    assert parse_action("Thought: the button is red\nAction: wait()").thought == "the button is red"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "no 'Action:'"),
        ("Thought: hmm", "no 'Action:'"),
        ("Action: teleport(to='(1,1)')", "unknown action"),
        ("Action: click", "not a call"),
        ("Action: click(start_box=(1,2))", "cannot read arguments"),
        ("Action: click(start_box='(1200,5)')", "outside"),
        ("Action: click(start_box='here')", "cannot read a position"),
        ("Action: click()", "missing position"),
        ("Action: hotkey(key='')", "hotkey needs"),
        ("Action: hotkey(key='a b c d e f g')", "invalid hotkey"),
        ("Action: scroll(direction='sideways')", "scroll direction"),
        ("Action: drag(start_box='(1,1)')", "missing position"),
        ("x" * 20000, "longer than"),
    ],
)
def test_unparseable_output_is_an_error_not_an_exception(text: str, reason: str) -> None:
    out = parse_action(text)
    assert out.action is None
    assert out.error is not None and reason in out.error


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_never_raises(text: str) -> None:
    out = parse_action(text)
    assert (out.action is None) != (out.error is None)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["click", "left_double", "right_single", "drag", "hotkey", "type", "scroll", "finished", "fail"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
)
def test_fuzz_call_shaped_never_raises(name: str, arg: str) -> None:
    out = parse_action(f"Action: {name}(start_box='{arg}', content='{arg}', key='{arg}', end_box='{arg}')")
    assert (out.action is None) != (out.error is None)


grid = st.integers(min_value=0, max_value=1000).map(lambda v: v / 1000)
actions = st.one_of(
    st.builds(m.Click, x=grid, y=grid),
    st.builds(m.DoubleClick, x=grid, y=grid),
    st.builds(m.RightClick, x=grid, y=grid),
    st.builds(m.Drag, x1=grid, y1=grid, x2=grid, y2=grid),
    st.builds(
        m.Type, text=st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")) | st.just("\n"), max_size=50)
    ),
    st.builds(
        m.Hotkey,
        keys=st.lists(st.sampled_from(["ctrl", "shift", "alt", "a", "enter", "f5"]), min_size=1, max_size=3).map(tuple),
    ),
    st.builds(m.Scroll, x=grid, y=grid, direction=st.sampled_from(list(m.ScrollDirection))),
    st.builds(m.Finished, content=st.text(alphabet="abc '\\", max_size=10)),
    st.builds(m.Fail, reason=st.text(alphabet="xyz'", max_size=10)),
    st.just(m.Wait()),
)


@settings(max_examples=400, deadline=None)
@given(actions, st.text(alphabet="abc .", max_size=30))
def test_format_then_parse_round_trips(action: m.Action, thought: str) -> None:
    out = parse_action(format_output(thought, action))
    assert out.error is None, (format_action(action), out.error)
    assert out.action == action
    assert out.thought == thought.strip()
