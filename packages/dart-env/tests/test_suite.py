from __future__ import annotations

import json
from pathlib import Path

import pytest

from dart.env.errors import SuiteError
from dart.env.suite import dump_suite, load_suite

pytestmark = pytest.mark.unit

GOOD = """
name: demo
backend: sim
max_steps: 6
tasks:
  - task_id: sim/click/0
    instruction: Click OK
    params: {family: click-button, target: OK}
  - task_id: sim/type/0
    backend: miniwob
    max_steps: 3
"""


def test_load_yaml_with_defaults(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(GOOD)
    suite = load_suite(path)
    assert suite.name == "demo"
    assert [(t.task_id, t.backend, t.max_steps) for t in suite.tasks] == [
        ("sim/click/0", "sim", 6),
        ("sim/type/0", "miniwob", 3),
    ]
    assert suite.by_id("sim/click/0").params == {"family": "click-button", "target": "OK"}
    with pytest.raises(KeyError, match="nope"):
        suite.by_id("nope")


def test_json_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "s.yaml"
    src.write_text(GOOD)
    out = tmp_path / "s.json"
    out.write_text(json.dumps(dump_suite(load_suite(src))))
    assert load_suite(out) == load_suite(src)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\ntasks: []\n", "tasks"),
        ("name: x\ntasks:\n  - {task_id: a, backend: sim}\n  - {task_id: a, backend: sim}\n", "duplicate task_id 'a'"),
        ("name: x\ntasks:\n  - {task_id: a}\n", "tasks.0.backend"),
        ("name: x\ntasks:\n  - {task_id: a, backend: sim, max_steps: 0}\n", "tasks.0.max_steps"),
        ("- just a list\n", "top level"),
        ("name: [unclosed\n", "not valid YAML"),
    ],
)
def test_invalid_suites_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SuiteError, match=message) as info:
        load_suite(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match="cannot read"):
        load_suite(tmp_path / "none.yaml")
