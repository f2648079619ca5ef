"""DART's built-in OSWorld metrics: OSWorld's semantics on small inputs, edge cases included."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest

from dart.env.osworld import metrics as m
from dart.env.osworld.getters import apply_time_format, get_rule_relativeTime, resolve_relative_day
from dart.env.osworld.support import metric_support

pytestmark = pytest.mark.unit


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_check_include_exclude() -> None:
    rules = {"include": ["spotify"], "exclude": ["not found"]}
    assert m.check_include_exclude("/usr/bin/spotify\n", rules) == 1.0
    assert m.check_include_exclude("spotify not found", rules) == 0.0
    assert m.check_include_exclude("", rules) == 0.0
    assert m.check_include_exclude(None, rules) == 0.0
    assert m.check_include_exclude("anything", {}) == 1.0  # no rules: vacuously true, as in OSWorld


def test_exact_match_match_in_list_is_in_list() -> None:
    assert m.exact_match("true\n", {"expected": "true\n"}) == 1.0
    assert m.exact_match("true", {"expected": "true\n"}) == 0.0  # no stripping
    assert m.exact_match(None, {"expected": "x"}) == 0.0
    assert m.match_in_list("b", {"expected": ["a", "b"]}) == 1.0
    assert m.match_in_list("c", {"expected": ["a", "b"]}) == 0.0
    assert m.is_in_list(["a", "b"], {"expected": "a"}) == 1.0
    assert m.is_in_list("abc", {"expected": "bc"}) == 1.0  # substring of a string result
    assert m.is_in_list(["a"], {"expected": "z"}) == 0.0


def test_literal_match() -> None:
    assert m.literal_match("Hi", "hi") == 0.0
    assert m.literal_match("Hi", "hi", ignore_case=True) == 1.0
    assert m.literal_match(3, "3") == 1.0  # compared as strings
    assert m.literal_match(["A", 1], ("a", "1"), type="list", ignore_case=True) == 1.0
    assert m.literal_match(["a"], ["a", "b"], type="list") == 0.0
    assert m.literal_match("a", ["a"], type="list") == 0.0
    with pytest.raises(NotImplementedError):
        m.literal_match("a", "a", type="dict")


def test_check_direct_json_object() -> None:
    assert m.check_direct_json_object("{'a': 1, 'b': 'x'}", {"expected": {"a": 1}}) == 1.0
    assert m.check_direct_json_object({"a": 2}, {"expected": {"a": 1}}) == 0.0
    assert m.check_direct_json_object("not json", {"expected": {"a": 1}}) == 0.0
    assert m.check_direct_json_object(None, {"expected": {"a": 1}}) == 0.0
    assert m.check_direct_json_object({"a": 1}, {"expected": {"a": "__EVALUATION_FAILED__"}}) == 0.0
    contains = {"expect_in_result": True, "expected": {"city": ["Paris", "Lyon"], "name": "Ann"}}
    assert m.check_direct_json_object({"city": "Lyon", "name": "Anna"}, contains) == 1.0
    assert m.check_direct_json_object({"city": ["Nice", "Paris"], "name": "Ann"}, contains) == 1.0
    assert m.check_direct_json_object({"city": "Nice", "name": "Ann"}, contains) == 0.0
    assert m.check_direct_json_object({"n": 1}, {"expect_in_result": True, "expected": {"n": 1}}) == 0.0


def test_check_gnome_favorite_apps() -> None:
    rule = {"expected": ["google-chrome.desktop", "thunderbird.desktop"]}
    assert m.check_gnome_favorite_apps("['thunderbird.desktop', 'google-chrome.desktop']\n", rule) == 1.0
    assert m.check_gnome_favorite_apps("['thunderbird.desktop', 'vim.desktop', 'google-chrome.desktop']", rule) == 0.0
    assert m.check_gnome_favorite_apps("@as []", rule) == 0.0  # gsettings' empty list does not parse
    assert m.check_gnome_favorite_apps("__import__('os')", rule) == 0.0  # never evaluated


def test_is_utc_0() -> None:
    utc = (
        "               Local time: Thu 2024-01-25 12:56:06 WET\n"
        "           Universal time: Thu 2024-01-25 12:56:06 UTC\n"
        "                 RTC time: Thu 2024-01-25 12:56:05\n"
        "                Time zone: Atlantic/Faroe (WET, +0000)\n"
        "System clock synchronized: yes"
    )
    assert m.is_utc_0(utc) == 1.0
    assert m.is_utc_0(utc.replace("+0000", "+0100")) == 0.0
    assert m.is_utc_0("Failed to connect to bus") == 0.0
    assert m.is_utc_0("") == 0.0


def test_check_moved_jpgs() -> None:
    tree = {"name": "photos", "type": "directory", "children": [{"name": "b.jpg"}, {"name": "a.jpg"}]}
    assert m.check_moved_jpgs(tree, {"expected": ["a.jpg", "b.jpg"]}) == 1.0
    assert m.check_moved_jpgs(tree, {"expected": ["a.jpg"]}) == 0.0
    assert m.check_moved_jpgs(None, {"expected": []}) == 0.0


def test_text_file_metrics(tmp_path: Path) -> None:
    a = write(tmp_path, "a.txt", "Hello  World\n")
    b = write(tmp_path, "b.txt", "hello world")
    assert m.compare_text_file(a, a) == 1.0
    assert m.compare_text_file(a, b) == 0.0
    assert m.compare_text_file(a, b, ignore_blanks=True, ignore_case=True) == 1.0
    assert m.compare_text_file(None, b) == 0.0
    assert m.compare_text_file(str(tmp_path / "missing"), b) == 0.0
    assert m.compare_config(b, {"expected": "hello world"}) == 1.0
    assert m.compare_config(a, {"expected": "hello world"}) == 0.0
    assert m.compare_config(None, {"expected": ""}) == 0.0
    x = write(tmp_path, "x.txt", "1\n2\n3\n4\n")
    y = write(tmp_path, "y.txt", "1\n2\n3\n5\n")
    assert m.diff_text_file(x, y) == pytest.approx(0.75)
    assert m.diff_text_file(None, y) == 0.0
    assert m.file_contains(x, {"expected": ["2\n3", "4"]}) == 1.0
    assert m.file_contains(x, {"expected": ["9"]}) == 0.0
    assert m.file_contains(None, {"expected": []}) == 0.0
    log = write(tmp_path, "log.txt", "at 12:00:01 start\nno time\n23:59:60 leap\n24:00:00 invalid\n")
    assert m.check_line_number(log, {"expected": "2"}) == 1.0
    assert m.check_line_number(log, {"expected": 3}) == 0.0
    assert m.check_line_number(str(tmp_path / "nope"), {"expected": 0}) == 0.0


def test_compare_result_files(tmp_path: Path) -> None:
    seven = write(tmp_path, "seven.txt", "7\n")
    assert m.compare_result_files(write(tmp_path, "r1", "The answer is 7"), seven) == 1.0  # target inside source
    assert m.compare_result_files(write(tmp_path, "r2", "7.00001"), seven) == 1.0  # within 1e-4
    assert m.compare_result_files(write(tmp_path, "r3", "8"), seven) == 0.0
    assert m.compare_result_files(write(tmp_path, "r4", "abc\n"), write(tmp_path, "t4", "abc")) == 1.0
    assert m.compare_result_files(write(tmp_path, "r5", "abc"), write(tmp_path, "t5", "abd")) == 0.0
    assert m.compare_result_files(None, seven) == 0.0


def test_compare_python_pure_text(tmp_path: Path) -> None:
    gold = write(tmp_path, "gold.py", "def f():\n    return 1\n")
    user = write(tmp_path, "user.py", "#!/usr/bin/env python3\n\ndef f():   \n\treturn 1\n\n")
    assert m.compare_python_pure_text(user, gold) == 1.0  # shebang, blank lines, trailing spaces, a tab
    tabbed = write(tmp_path, "tab.py", "def f():\n\treturn 1\n")
    assert m.compare_python_pure_text(tabbed, write(tmp_path, "g2.py", "def f():\n    return 1\n")) == 1.0
    shebang = write(tmp_path, "s.py", "#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\n\ndef f():\n    return 1  \n")
    assert m.compare_python_pure_text(shebang, gold) == 1.0
    assert m.compare_python_pure_text(write(tmp_path, "md.py", "```python\ndef f():\n    return 1\n"), gold) == 0.0
    assert m.compare_python_pure_text(None, gold) == 0.0


def test_check_list(tmp_path: Path) -> None:
    f = write(tmp_path, "todo.txt", "buy milk\ncall mom\n")
    assert m.check_list(f, {"expect": ["^buy milk$", "^call mom$"]}) == 1.0
    assert m.check_list(f, {"expect": ["^walk dog$"]}) == 0.0
    assert m.check_list(f, {"expect": ["milk"], "unexpect": ["mom"]}) == 0.0
    assert m.check_list(None, {}) == 0.0


def test_csv_metrics(tmp_path: Path) -> None:
    a = write(tmp_path, "a.csv", "name,age\nAnn,30 \n")
    b = write(tmp_path, "b.csv", "NAME,age\nAnn,30\n")
    assert m.compare_csv(a, a) == 1.0
    assert m.compare_csv(a, b) == 0.0
    assert m.compare_csv(a, b, strict=False, ignore_case=True) == 1.0
    assert m.compare_csv(None, b) == 0.0
    c = write(tmp_path, "c.csv", "name,age\nAnn,30\nBob,40\n")
    assert m.check_csv(c, {"expect": [{"name": "Bob", "age": "40"}]}) == 1.0
    assert m.check_csv(c, {"expect": [{"name": "Bob", "age": 40}]}) == 0.0  # CSV values are strings
    assert m.check_csv(c, {"expect": [{"name": "Ann"}], "unexpect": [{"name": "Bob"}]}) == 0.0
    assert m.check_csv(None, {}) == 0.0


def test_check_json(tmp_path: Path) -> None:
    f = write(tmp_path, "s.json", json.dumps({"editor": {"fontSize": 14, "theme": "Dark+"}, "list": "a,b"}))
    expect = {"expect": [{"key": ["editor", "fontSize"], "method": "eq", "ref": 14}]}
    assert m.check_json(f, expect) == 1.0
    assert m.check_json(f, {"expect": [{"key": ["editor", "theme"], "method": "re.I", "ref": "^dark"}]}) == 1.0
    assert m.check_json(f, {"expect": [{"key": ["editor", "fontSize"], "method": "approx:0.5", "ref": 14.4}]}) == 1.0
    assert m.check_json(f, {"expect": [{"key": ["editor", "fontSize"], "method": "range.te", "ref": [10, 14]}]}) == 1.0
    assert m.check_json(f, {"expect": [{"key": ["list"], "method": "str_set_eq", "ref": ["b", "a"]}]}) == 1.0
    assert m.check_json(f, {"expect": [{"key": ["missing"], "method": "eq", "ref": 1}]}) == 0.0
    assert m.check_json(f, {"unexpect": [{"key": ["missing"], "method": "eq", "ref": 1}]}) == 1.0
    assert m.check_json(f, {"unexpect": [{"key": ["editor", "fontSize"], "method": "eq", "ref": 14}]}) == 0.0
    y = write(tmp_path, "c.yaml", "a:\n  b: 3\n")
    assert m.check_json(y, {"expect": [{"key": ["a", "b"], "method": "gt", "ref": 2}]}, is_yaml=True) == 1.0
    assert m.check_json(write(tmp_path, "bad.json", "{"), expect) == 0.0
    assert m.check_json(None, expect) == 0.0


def test_json_settings_and_keybindings(tmp_path: Path) -> None:
    s = write(tmp_path, "settings.json", json.dumps({"theme": "dark", "font_size": 12}))
    assert m.check_json_settings(s, {"expected": {"theme": "dark"}}) == 1.0
    assert m.check_json_settings(s, {"expected": {"theme": "light"}}) == 0.0
    assert m.check_json_settings(s, {"expected": {"zoom": 1}}) == 0.0
    assert m.check_json_settings(None, {"expected": {}}) == 0.0
    binding = {"key": "ctrl+j", "command": "workbench.action.togglePanel"}
    k = write(tmp_path, "kb.json", "// Place your key bindings in this file\n" + json.dumps([binding]))
    assert m.check_json_keybindings(k, {"expected": binding}) == 1.0
    assert m.check_json_keybindings(k, {"expected": {**binding, "key": "ctrl+k"}}) == 0.0
    assert m.check_json_keybindings(write(tmp_path, "obj.json", "{}"), {"expected": binding}) == 0.0


def test_run_sqlite3(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    with sqlite3.connect(db) as conn:
        conn.execute("create table t (v integer)")
        conn.executemany("insert into t values (?)", [(1,), (2,)])
    conn.close()
    assert m.run_sqlite3(str(db), {"sql": "select count(*) = 2 from t"}) == 1.0
    assert m.run_sqlite3(str(db), {"sql": "select max(v) from t where v > 5"}) == 0.0  # NULL


def test_check_python_file_by_test_suite(tmp_path: Path) -> None:
    test = write(tmp_path, "t.py", "def test():\n    return 1 + 1 == 2\n\ndef check():\n    raise RuntimeError('x')\n")
    assert m.check_python_file_by_test_suite([], test) == 1.0
    assert m.check_python_file_by_test_suite([], test, test_function_name="check") == 0.0
    assert m.check_python_file_by_test_suite([], test, test_function_name="absent") == 0.0
    assert m.check_python_file_by_test_suite([], str(tmp_path / "missing.py")) == 0.0


def test_a_test_suite_runs_apart_from_the_env_service_and_within_its_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test file comes from the VM: it must not run in the env service's process, see its secrets, or
    hold the service up."""
    monkeypatch.setenv("DART_S3_SECRET_KEY", "service-secret")
    monkeypatch.setattr(m, "TEST_SUITE_TIMEOUT_S", 2.0)
    out = tmp_path / "seen.txt"
    probe = write(
        tmp_path,
        "probe.py",
        "import os, sys\n"
        "def test():\n"
        f"    open({str(out)!r}, 'w').write(f'{{os.getpid()}} {{os.environ.get(\"DART_S3_SECRET_KEY\")}}')\n"
        "    return True\n",
    )
    assert m.check_python_file_by_test_suite([], probe) == 1.0
    pid, secret = out.read_text().split()
    assert int(pid) != os.getpid() and secret == "None"
    assert "dart_osworld_test_suite" not in sys.modules
    spin = write(tmp_path, "spin.py", "def test():\n    while True:\n        pass\n")
    assert m.check_python_file_by_test_suite([], spin) == 0.0  # stopped at the limit, scored 0
    hog = write(tmp_path, "hog.py", "def test():\n    return len(bytearray(8 << 30)) > 0\n")
    assert m.check_python_file_by_test_suite([], hog) == 0.0  # beyond the memory limit


def test_score_normalizes_return_values() -> None:
    assert m.score(1) == 1.0
    assert m.score(True) == 1.0
    assert m.score((0.5, "half")) == 0.5
    assert m.score(None) == 0.0


def test_registry_and_support_agree() -> None:
    for name in m.BUILTIN_METRICS:
        assert metric_support(name).supported, name
        assert m.lookup(name, prefer_desktop_env=False) is m.BUILTIN_METRICS[name]
    assert not metric_support("compare_table").supported
    assert m.lookup("compare_table", prefer_desktop_env=False) is None
    assert m.lookup("no_such_metric") is None


def test_rule_relative_time() -> None:
    from datetime import datetime
    from zoneinfo import ZoneInfo

    now = datetime(2024, 12, 18, 9, 0, tzinfo=ZoneInfo("UTC"))  # a Wednesday
    assert resolve_relative_day("tomorrow", now).day == 19
    assert resolve_relative_day("next Monday", now).date().isoformat() == "2024-12-23"
    assert resolve_relative_day("10th next month", now).date().isoformat() == "2025-01-10"
    assert resolve_relative_day("first monday four months later", now).date().isoformat() == "2025-04-07"
    assert apply_time_format("{DoW}, {Month} {Day0D}, {Year}", now) == "Wed, Dec 18, 2024"
    rules = {
        "relativeTime": {"from": "next Monday", "to": "next Friday"},
        "expected": {"from": "{Year}-{Month0D}-{Day0D}", "to": "{MonthFull} {DayD}"},
    }
    out = get_rule_relativeTime(None, {"rules": rules}, now=now)  # type: ignore[arg-type]
    assert out["expected"] == {"from": "2024-12-23", "to": "December 27"}
    assert rules["expected"]["from"] == "{Year}-{Month0D}-{Day0D}"  # the task's rules are not modified
