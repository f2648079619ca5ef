"""OSWorld's evaluator metrics that need only the standard library, written for DART.

Each function has the name, signature and semantics of the metric of the same name in OSWorld's
``desktop_env/evaluators/metrics`` (same score on the same inputs); file arguments are host paths
that the getters downloaded (None when the file was missing: the score is 0). Where OSWorld would
raise on malformed input (an unparsable gsettings list, a timedatectl output with too few lines) these
return 0.0, which is what a crashed evaluation scores in OSWorld's runners.

:func:`lookup` resolves a metric name: OSWorld's own function when the ``desktop_env`` package is
importable, else the built-in one here (:data:`BUILTIN_METRICS`, which is also what the support
matrix reports as supported).
"""

from __future__ import annotations

import ast
import builtins
import csv
import difflib
import functools
import importlib
import importlib.util
import json
import operator
import os
import re
import resource
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

Metric = Callable[..., Any]


# --- rule helpers (OSWorld's metrics/utils.py) ----------------------------------------------------


def _match_record(pattern: dict[str, Any], item: dict[str, Any]) -> bool:
    return all(k in item and item[k] == v for k, v in pattern.items())


def _match_value_to_rule(value: Any, rule: dict[str, Any]) -> bool:
    """``rule = {"method": eq|ne|lt|le|gt|ge|re[.FLAG...]|approx:T|range.XY|str_list_eq|str_set_eq, "ref": ...}``."""
    method = str(rule["method"])
    if method.startswith("re"):
        flags = functools.reduce(operator.or_, (getattr(re, f) for f in method.split(".")[1:]), re.RegexFlag(0))
        return re.search(rule["ref"], value, flags) is not None
    if method in {"eq", "ne", "le", "lt", "ge", "gt"}:
        return bool(getattr(operator, method)(value, rule["ref"]))
    if method.startswith("approx"):
        threshold = float(method.split(":")[1])
        try:
            number = float(value)
        except (TypeError, ValueError):
            return False
        return bool(abs(number - float(rule["ref"])) <= threshold)
    if method.startswith("range."):  # range.te [0, 2] -> 0 < x <= 2
        left, right = method[6], method[7]
        return bool(getattr(operator, "l" + left)(rule["ref"][0], value)) and bool(
            getattr(operator, "l" + right)(value, rule["ref"][1])
        )
    if method in {"str_list_eq", "str_set_eq"}:
        container = getattr(builtins, method[4:-3])
        return bool(container(value.strip("\"'").split(",")) == container(rule["ref"]))
    raise NotImplementedError(f"rule method {method!r}")


# --- strings, lists and literals ----------------------------------------------------------------


def check_include_exclude(result: str | None, rules: dict[str, list[str]]) -> float:
    """1 when every ``include`` string is in ``result`` and no ``exclude`` string is."""
    if result is None:
        return 0.0
    include, exclude = rules.get("include", []), rules.get("exclude", [])
    return float(all(r in result for r in include) and all(r not in result for r in exclude))


def exact_match(result: Any, rules: dict[str, Any]) -> float:
    """1 when ``result == rules["expected"]``."""
    return float(result == rules["expected"])


def match_in_list(result: Any, rules: dict[str, Any]) -> float:
    """1 when ``result`` is one of ``rules["expected"]``."""
    return float(result in rules["expected"])


def is_in_list(result: Any, rules: dict[str, Any]) -> float:
    """1 when ``rules["expected"]`` is in ``result``."""
    return float(rules["expected"] in result)


def literal_match(result: Any, expected: Any, **options: Any) -> float:
    """String (``type: str``) or list (``type: list``) equality, optionally ignoring case."""
    kind = options.get("type", "str")
    ignore_case = options.get("ignore_case", False)
    if kind == "str":
        a, b = str(result), str(expected)
        return float(a.lower() == b.lower() if ignore_case else a == b)
    if kind == "list":
        if (
            not isinstance(result, list | tuple)
            or not isinstance(expected, list | tuple)
            or len(result) != len(expected)
        ):
            return 0.0
        norm: Callable[[Any], str] = (lambda s: str(s).lower()) if ignore_case else str
        return float([norm(s) for s in result] == [norm(s) for s in expected])
    raise NotImplementedError(f"literal_match type {kind!r}")


def check_direct_json_object(result: Any, rules: dict[str, Any]) -> float:
    """Compare a JSON object (or its text, single quotes allowed) with ``rules["expected"]``.

    With ``expect_in_result``, a list expectation passes when any of its values is in (or equals) the
    result's value, a string expectation when it is a substring of it.
    """
    if isinstance(result, str):
        try:
            result = json.loads(result.strip().replace("'", '"'))
        except ValueError:
            return 0.0
    if result is None:
        return 0.0
    try:
        expected = rules.get("expected", {})
        if expected and any(v == "__EVALUATION_FAILED__" for v in expected.values()):
            return 0.0
        if not rules.get("expect_in_result", False):
            expected = rules["expected"]
            for key in expected:
                if expected.get("ignore_list_order", False):
                    if sorted(expected.get(key)) != sorted(result.get(key)):
                        return 0.0
                elif expected.get(key) != result.get(key):
                    return 0.0
            return 1.0
        expected = rules["expected"]
        for key in expected:
            want, got = expected.get(key), result.get(key)
            if isinstance(want, list):
                if not any((isinstance(got, list) and w in got) or (isinstance(got, str) and w == got) for w in want):
                    return 0.0
            elif isinstance(want, str):
                if want not in got:
                    return 0.0
            else:
                return 0.0
        return 1.0
    except Exception:  # (OSWorld scores any malformed result 0)
        return 0.0


def check_gnome_favorite_apps(apps_str: str, rule: dict[str, Any]) -> float:
    """1 when gsettings' favorite-apps list (``"['a.desktop', ...]"``) holds exactly the expected apps."""
    try:
        apps = ast.literal_eval(apps_str.strip())
    except (ValueError, SyntaxError, AttributeError):
        return 0.0
    expected = rule["expected"]
    if not isinstance(apps, list | tuple) or len(apps) != len(expected):
        return 0.0
    return float(set(apps) == set(expected))


def is_utc_0(timedatectl_output: str) -> float:
    """1 when the fourth line of ``timedatectl status`` (the time zone) ends with ``+0000)``."""
    lines = (timedatectl_output or "").split("\n")
    return float(len(lines) > 3 and lines[3].endswith("+0000)"))


def check_moved_jpgs(directory_list: dict[str, Any] | None, rule: dict[str, Any]) -> float:
    """1 when a directory tree's children are exactly the expected file names."""
    if not directory_list:
        return 0.0
    moved = [node["name"] for node in directory_list.get("children", [])]
    expected = rule["expected"]
    return float(len(moved) == len(expected) and set(moved) == set(expected))


# --- text files ---------------------------------------------------------------------------------


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def diff_text_file(result: str | None, expect: str) -> float:
    """The line-level similarity ratio (difflib) of two text files."""
    if result is None:
        return 0.0
    return difflib.SequenceMatcher(a=_read(result).splitlines(), b=_read(expect).splitlines()).ratio()


def compare_text_file(actual: str | None, expected: str, **options: Any) -> float:
    """1 when two text files are equal (options ``ignore_blanks``, ``ignore_case``)."""
    if not actual:
        return 0.0
    try:
        a, b = _read(actual), _read(expected)
    except OSError:
        return 0.0
    if options.get("ignore_blanks", False):
        a = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", a).strip())
        b = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", b).strip())
    if options.get("ignore_case", False):
        a, b = a.lower(), b.lower()
    return float(a == b)


def compare_config(actual: str | None, rules: dict[str, Any], **options: Any) -> float:
    """1 when a file's text equals ``rules["expected"]``."""
    if not actual:
        return 0.0
    try:
        return float(_read(actual) == rules["expected"])
    except OSError:
        return 0.0


def compare_result_files(src_path: str | None, tgt_path: str | None) -> float:
    """1 when two files hold the same text; numbers match within 1e-4 or when the target's number
    appears in the source."""
    if not src_path or not tgt_path:
        return 0.0
    try:
        src, tgt = _read(src_path).strip(), _read(tgt_path).strip()
    except OSError:
        return 0.0
    try:
        tgt_num = float(tgt)
        if tgt in src:
            return 1.0
        return float(abs(float(src) - tgt_num) < 1e-4)
    except ValueError:
        return float(src == tgt)


def file_contains(file_path: str | None, config: dict[str, Any]) -> float:
    """1 when a file contains every string of ``config["expected"]``."""
    if not file_path:
        return 0.0
    try:
        text = _read(file_path)
    except (OSError, UnicodeDecodeError):
        return 0.0
    return float(all(t in text for t in config["expected"]))


_TIME = re.compile(r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)")


def check_line_number(file_path: str | None, line_number: dict[str, Any]) -> float:
    """1 when the number of lines holding an ``HH:MM:SS`` time equals ``line_number["expected"]``."""
    if file_path is None or not os.path.isfile(file_path):
        return 0.0
    try:
        with open(file_path) as f:
            count = sum(1 for line in f if _TIME.search(line))
        return float(count == int(line_number["expected"]))
    except (OSError, ValueError, UnicodeDecodeError):
        return 0.0


def compare_python_pure_text(py_file_path: str | None, gold_file_path: str | None) -> float:
    """1 when two Python files are equal after dropping a leading shebang/coding line, blank lines,
    trailing spaces, and expanding tabs."""
    if not py_file_path or not gold_file_path:
        return 0.0

    def normalize(text: str) -> str:
        lines = text.splitlines()
        i = 0
        while i < len(lines) and i < 3:
            head = lines[i].strip()
            if head.startswith(("#!", "# -*- coding:", "# coding:", "# coding=")):
                i += 1
                continue
            break
        return "\n".join(line.expandtabs(4).rstrip() for line in lines[i:] if line.strip())

    try:
        with open(py_file_path, encoding="utf-8") as a, open(gold_file_path, encoding="utf-8") as b:
            return float(normalize(a.read()) == normalize(b.read()))
    except (OSError, UnicodeDecodeError):
        return 0.0


def check_list(result: str | None, rules: dict[str, list[str]]) -> float:
    """1 when every ``expect`` regex matches some line of a file and no ``unexpect`` regex matches any."""
    if result is None:
        return 0.0
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    found = [False] * len(expect)
    clean = True
    with open(result) as f:
        for line in f:
            found = [hit or (p.search(line) is not None) for hit, p in zip(found, expect, strict=True)]
            clean = clean and all(p.search(line) is None for p in unexpect)
    return float(all(found) and clean)


# --- structured files ----------------------------------------------------------------------------


def compare_csv(result: str | None, expected: str, **options: Any) -> float:
    """1 when two CSV files have the same lines (``strict: false`` strips them, ``ignore_case``)."""
    if result is None:
        return 0.0
    a: Iterable[str] = _read(result).splitlines()
    b: Iterable[str] = _read(expected).splitlines()
    if not options.get("strict", True):
        a, b = map(str.strip, a), map(str.strip, b)
    if options.get("ignore_case", False):
        a, b = map(str.lower, a), map(str.lower, b)
    return float(list(a) == list(b))


def check_csv(result: str | None, rules: dict[str, list[dict[str, str]]]) -> float:
    """1 when every ``expect`` record matches some CSV row and no ``unexpect`` record matches any."""
    if result is None:
        return 0.0
    expect, unexpect = rules.get("expect", []), rules.get("unexpect", [])
    found = [False] * len(expect)
    clean = True
    with open(result) as f:
        for row in csv.DictReader(f):
            found = [hit or _match_record(r, row) for hit, r in zip(found, expect, strict=True)]
            clean = clean and not any(_match_record(r, row) for r in unexpect)
    return float(all(found) and clean)


def check_json(result: str | None, rules: dict[str, Any], is_yaml: bool = False) -> float:
    """Check values at key paths of a JSON (or YAML) file against ``expect``/``unexpect`` rules."""
    if result is None or not os.path.exists(result):
        return 0.0
    try:
        with open(result, encoding="utf-8") as f:
            data = yaml.safe_load(f) if is_yaml else json.load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return 0.0
    if is_yaml and data is None:
        return 0.0
    metric = True
    try:
        for rule in rules.get("expect", {}):
            value = data
            for key in rule["key"]:
                try:
                    value = value[key]
                except (KeyError, TypeError, IndexError):
                    return 0.0
            metric = metric and _match_value_to_rule(value, rule)
        for rule in rules.get("unexpect", {}):
            value = data
            for key in rule["key"]:
                try:
                    value = value[key]
                except (KeyError, TypeError, IndexError):
                    value = None
                    break
            metric = metric and not _match_value_to_rule(value, rule)
    except Exception:  # (a rule that does not apply to the value scores 0, as in OSWorld)
        return 0.0
    return float(metric)


def check_json_settings(actual: str | None, expected: dict[str, Any], **options: Any) -> float:
    """1 when a JSON settings file has every key/value of ``expected["expected"]``."""
    if not actual:
        return 0.0
    try:
        with open(actual) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return 0.0
    want = expected["expected"]
    return float(isinstance(data, dict) and all(k in data and data[k] == v for k, v in want.items()))


def check_json_keybindings(actual: str | None, expected: dict[str, Any], **options: Any) -> float:
    """1 when a keybindings JSON list (the first line may be a comment) holds ``expected["expected"]``."""
    if not actual:
        return 0.0
    data: Any = None
    for skip in (0, 1):
        try:
            with open(actual) as f:
                for _ in range(skip):
                    f.readline()
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        if isinstance(data, list):
            break
    else:
        return 0.0
    return float(expected["expected"] in data)


def run_sqlite3(result: str, rules: dict[str, Any]) -> float:
    """The first column of the first row of ``rules["sql"]`` run on an SQLite file (0 if NULL)."""
    connection = sqlite3.connect(result)
    try:
        row = connection.execute(rules["sql"]).fetchone()
    finally:
        connection.close()
    return float((row[0] if row else None) or 0)


TEST_SUITE_TIMEOUT_S = 60.0
"""Wall-clock and CPU limit of one test-suite check, seconds."""
TEST_SUITE_MEMORY_BYTES = 2 << 30
"""Address-space limit of the process running a test-suite check."""
_RUN_TEST_SUITE = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("dart_osworld_test_suite", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.exit(0 if getattr(module, sys.argv[2])() else 1)
"""


def _test_suite_limits() -> None:  # runs in the child between fork and exec: no locks, no imports
    resource.setrlimit(resource.RLIMIT_AS, (TEST_SUITE_MEMORY_BYTES, TEST_SUITE_MEMORY_BYTES))
    cpu = int(TEST_SUITE_TIMEOUT_S)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))


def check_python_file_by_test_suite(actual_files: Any, test_file: str, **options: Any) -> float:
    """Run ``test_file``'s test function (option ``test_function_name``, default ``test``); 1 when it
    returns truthy. OSWorld imports the file into its own process; the file comes from the VM, where the
    agent may have written it, so here it runs in a child process: the env service's Python, isolated
    (``-I``), in the desktop's scrubbed environment (no secret of the service), in the file's directory,
    within :data:`TEST_SUITE_TIMEOUT_S` and :data:`TEST_SUITE_MEMORY_BYTES`. A failure, a crash or a limit
    reached scores 0."""
    from dart.env.desktop.sandbox import desktop_environment

    name = str(options.get("test_function_name", "test"))
    folder = Path(test_file).parent
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _RUN_TEST_SUITE, test_file, name],
            cwd=folder,
            env=desktop_environment(folder, None),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=TEST_SUITE_TIMEOUT_S,
            preexec_fn=_test_suite_limits,  # setrlimit only: nothing that takes a lock after fork
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0.0
    return 1.0 if done.returncode == 0 else 0.0


def infeasible(*_: Any, **__: Any) -> float:
    """Placeholder: ``infeasible`` tasks are scored from the agent's last action (FAIL) by the evaluator."""
    return 0.0


BUILTIN_METRICS: dict[str, Metric] = {
    f.__name__: f
    for f in (
        check_include_exclude,
        exact_match,
        literal_match,
        is_in_list,
        match_in_list,
        check_list,
        check_direct_json_object,
        check_json,
        compare_text_file,
        diff_text_file,
        file_contains,
        check_line_number,
        compare_python_pure_text,
        compare_result_files,
        compare_csv,
        check_csv,
        is_utc_0,
        check_moved_jpgs,
        check_gnome_favorite_apps,
        check_json_settings,
        check_json_keybindings,
        compare_config,
        run_sqlite3,
        check_python_file_by_test_suite,
        infeasible,
    )
}
"""Every metric DART implements itself, by OSWorld name."""


@functools.cache
def _desktop_env_metrics() -> Any:
    if importlib.util.find_spec("desktop_env") is None:
        return None
    try:
        return importlib.import_module("desktop_env.evaluators.metrics")
    except Exception:  # (a broken optional install falls back to the built-ins)
        return None


def lookup(name: str, *, prefer_desktop_env: bool = True) -> Metric | None:
    """The metric function named ``name``: OSWorld's (when ``desktop_env`` is importable and
    ``prefer_desktop_env``), else DART's built-in one, else None."""
    if prefer_desktop_env and name != "infeasible":
        module = _desktop_env_metrics()
        func = getattr(module, name, None) if module is not None else None
        if callable(func):
            return func  # type: ignore[no-any-return]
    return BUILTIN_METRICS.get(name)


def score(value: Any) -> float:
    """A metric's return value as a float (OSWorld metrics return a number, a bool, or
    ``(score, reason)``)."""
    if isinstance(value, tuple) and value:
        value = value[0]
    return float(value or 0.0)
