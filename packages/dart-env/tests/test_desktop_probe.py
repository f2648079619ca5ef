"""Input conformance of the local desktop: DART actions through HTTP, as the probe app receives them.

The probe (``python -m dart.env.desktop.probe``) covers the screen and logs every X input event
it gets, so each test compares an action with the events a real X client saw.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from dart.env.desktop import DesktopConfig, XDesktop

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("Xvfb") is None, reason="Xvfb is not installed (apt-get install xvfb)"),
]

WIDTH, HEIGHT = 1280, 720


class Probe:
    """The probe app on a desktop and the events it logged."""

    def __init__(self, desk: XDesktop, out: Path) -> None:
        self.desk = desk
        self.out = out
        self.seen = 0

    def events(self) -> list[dict[str, Any]]:
        try:
            lines = self.out.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines]

    def act(self, body: dict[str, Any], until: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Run one action; return the events it caused once at least ``until`` have arrived."""
        resp = requests.post(self.desk.url + "/dart/action", headers=self.desk.headers, json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        deadline = time.monotonic() + timeout_s
        while True:
            new = self.events()[self.seen :]
            if len(new) >= until:
                time.sleep(0.1)  # let stragglers (events beyond the expected ones) arrive too
                new = self.events()[self.seen :]
                self.seen += len(new)
                return new
            if time.monotonic() > deadline:
                pytest.fail(f"{body}: expected {until} events, the probe saw {new}")
            time.sleep(0.02)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probe]:
    desk = XDesktop(DesktopConfig(width=WIDTH, height=HEIGHT, window_manager="none"))
    desk.start()
    out = tmp_path_factory.mktemp("probe") / "events.jsonl"
    # Started by the test, not through /setup/launch: under root the desktop's user may not reach this
    # interpreter (a root-only virtualenv) nor the test's temp dir.
    cmd = [sys.executable, "-m", "dart.env.desktop.probe", "--out", str(out)]
    app = subprocess.Popen(cmd, env=dict(os.environ, DISPLAY=desk.display), stdin=subprocess.DEVNULL)
    p = Probe(desk, out)
    deadline = time.monotonic() + 15
    while not p.events():
        assert time.monotonic() < deadline and app.poll() is None, "the probe did not report ready"
        time.sleep(0.05)
    assert p.events()[0] == {"type": "ready", "width": WIDTH, "height": HEIGHT}
    p.seen = len(p.events())
    yield p
    app.kill()
    app.wait()
    desk.close()


def buttons(events: list[dict[str, Any]]) -> list[tuple[str, int, int, int]]:
    return [(e["type"], e["button"], e["x"], e["y"]) for e in events if e["type"].startswith("button")]


def typed(events: list[dict[str, Any]]) -> str:
    return "".join(e["char"] for e in events if e["type"] == "key_press")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"kind": "click", "x": 0.25, "y": 0.5},
            [("button_press", 1, 320, 360), ("button_release", 1, 320, 360)],
        ),
        (
            {"kind": "double_click", "x": 0.5, "y": 0.25},
            [("button_press", 1, 640, 180), ("button_release", 1, 640, 180)] * 2,
        ),
        (
            {"kind": "right_click", "x": 0.75, "y": 0.75},
            [("button_press", 3, 960, 540), ("button_release", 3, 960, 540)],
        ),
        (
            {"kind": "click", "x": 1.0, "y": 1.0},
            [("button_press", 1, WIDTH - 1, HEIGHT - 1), ("button_release", 1, WIDTH - 1, HEIGHT - 1)],
        ),
        (
            {"kind": "click", "x": 0.0, "y": 0.0},
            [("button_press", 1, 0, 0), ("button_release", 1, 0, 0)],
        ),
    ],
)
def test_clicks_land_on_the_right_pixels(probe: Probe, body: dict[str, Any], expected: list[Any]) -> None:
    assert buttons(probe.act(body, until=len(expected))) == expected


@pytest.mark.parametrize(
    ("direction", "button", "amount"),
    [("down", 5, 3), ("up", 4, 2), ("left", 6, 1), ("right", 7, 4)],
)
def test_scroll_turns_the_wheel_amount_times(probe: Probe, direction: str, button: int, amount: int) -> None:
    events = probe.act(
        {"kind": "scroll", "x": 0.5, "y": 0.5, "direction": direction, "amount": amount}, until=2 * amount
    )
    presses = [e for e in events if e["type"] == "button_press"]
    assert [(e["button"], e["x"], e["y"]) for e in presses] == [(button, 640, 360)] * amount
    assert len([e for e in events if e["type"] == "button_release"]) == amount


def test_drag_presses_at_start_moves_and_releases_at_end(probe: Probe) -> None:
    events = probe.act({"kind": "drag", "x1": 0.1, "y1": 0.1, "x2": 0.5, "y2": 0.5}, until=3)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "button_press" and kinds[-1] == "button_release"
    assert (events[0]["button"], events[0]["x"], events[0]["y"]) == (1, 128, 72)
    assert (events[-1]["button"], events[-1]["x"], events[-1]["y"]) == (1, 640, 360)
    motions = [e for e in events if e["type"] == "motion"]
    assert motions and all("button1" in e["modifiers"] for e in motions)
    assert motions[-1]["x"] == 640 and motions[-1]["y"] == 360
    assert kinds.count("button_press") == 1 and kinds.count("button_release") == 1


@pytest.mark.parametrize(
    "text",
    [
        "echo hello > out.txt",
        "Mixed CASE: ~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./",
        "café é€ ü ß ñ ✓ 漢字",
        "tab\there\nnew line",
    ],
)
def test_type_arrives_exactly(probe: Probe, text: str) -> None:
    events = probe.act({"kind": "type", "text": text}, until=len(text))
    assert typed(events) == text


def test_type_repeats_unmapped_characters_and_restores_the_keymap(probe: Probe) -> None:
    text = "€€é€"
    assert typed(probe.act({"kind": "type", "text": text}, until=len(text))) == text
    # The temporary bindings are gone: plain ASCII afterwards still types what it should.
    assert typed(probe.act({"kind": "type", "text": "ok"}, until=2)) == "ok"


def test_hotkey_ctrl_a_arrives_with_the_control_modifier(probe: Probe) -> None:
    events = probe.act({"kind": "hotkey", "keys": ["ctrl", "a"]}, until=2)
    keys = [(e["name"], e["modifiers"]) for e in events if e["type"] == "key_press"]
    assert keys == [("Control_L", []), ("a", ["control"])]


def test_hotkey_ctrl_shift_letter_and_named_keys(probe: Probe) -> None:
    events = probe.act({"kind": "hotkey", "keys": ["ctrl", "shift", "t"]}, until=3)
    last = [e for e in events if e["type"] == "key_press"][-1]
    assert last["name"] == "T" and set(last["modifiers"]) >= {"control", "shift"}
    names = ["enter", "esc", "tab", "backspace", "delete", "home", "end", "pageup", "pagedown", "up", "f5", "space"]
    expected = ["Return", "Escape", "Tab", "BackSpace", "Delete", "Home", "End", "Prior", "Next", "Up", "F5", "space"]
    for key, name in zip(names, expected, strict=True):
        events = probe.act({"kind": "hotkey", "keys": [key]}, until=1)
        assert [e["name"] for e in events if e["type"] == "key_press"] == [name], key
