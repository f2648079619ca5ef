"""OSWorld task files: parsing the real corpus, the support matrix, the audit, TaskSpec conversion.

The corpus is test data in ``<repo>/../shared/osworld`` (never copied into the repository); its
absence is a failure, not a skip.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.env.osworld import (
    LocalDesktop,
    OSWorldTaskError,
    audit,
    audit_dir,
    load_osworld_suite,
    load_task_dir,
    load_task_file,
    to_task_spec,
)
from dart.env.osworld.support import (
    OSWORLD_VM_APPS,
    Platform,
    VMImage,
    getter_support,
    metric_support,
    platform_features,
    required_apps,
    step_support,
    task_requirements,
)
from dart.protocol.errors import NoRunnableTaskError
from dart.protocol.messages import EnvCapabilities
from dart.runtime.capabilities import runnable_tasks

pytestmark = pytest.mark.unit

SHARED_OSWORLD = Path(__file__).resolve().parents[3].parent / "shared" / "osworld"
TERMINAL_SIZE_TASK = "13584542-872b-42d8-b299-866967b5c3ef"  # os: set the terminal size permanently
TWO_METRIC_TASK = "3ce045a0-877b-42aa-8d2c-b4a863336ab8"  # os: func is a list of two metrics
INFEASIBLE_TASK = "b3d4a89c-53f2-4d6b-8b6a-541fb5d205fa"  # os: no config, func "infeasible"


@pytest.fixture(scope="module")
def corpus() -> Path:
    if not (SHARED_OSWORLD / "examples").is_dir():
        pytest.fail(f"the OSWorld task corpus is missing: expected {SHARED_OSWORLD}/examples beside the repository")
    return SHARED_OSWORLD


def nothing_installed(name: str) -> str | None:
    return None


def everything_installed(name: str) -> str | None:
    return f"/usr/bin/{name}"


def test_every_shared_task_parses(corpus: Path) -> None:
    files = load_task_dir(corpus)
    on_disk = sorted((corpus / "examples").glob("*/*.json"))
    assert len(files) == len(on_disk) >= 369
    assert {f.domain for f in files} >= {"os", "chrome", "libreoffice_calc", "multi_apps", "vs_code"}
    listed = json.loads((corpus / "test_all.json").read_text())
    assert {(d, i) for d, ids in listed.items() for i in ids} <= {(f.domain, f.task.id) for f in files}


def test_known_os_task_fields(corpus: Path) -> None:
    file = load_task_file(corpus / "examples" / "os" / f"{TERMINAL_SIZE_TASK}.json")
    task = file.task
    assert file.domain == "os" and task.id == TERMINAL_SIZE_TASK and task.snapshot == "os"
    assert task.instruction.startswith("I click in terminal: terminal->132x43 to change terminal size")
    assert [s.type for s in task.config] == ["execute"]
    assert task.config[0].parameters["command"][0] == "python"
    assert task.related_apps == ["os"]
    ev = task.evaluator
    assert ev.func == "check_include_exclude" and ev.funcs == ("check_include_exclude",)
    assert [s.type for s in ev.postconfig] == ["sleep", "execute"]
    assert [g.type for g in ev.getters] == ["vm_terminal_output", "rule"]
    assert ev.getters[1].params == {"rules": {"include": ["43 132"], "exclude": []}}
    assert task.proxy is False and task.possibility_of_env_change == "low"
    assert task.all_unknown_keys == ()


def test_list_of_metrics_and_infeasible(corpus: Path) -> None:
    two = load_task_file(corpus / "examples" / "os" / f"{TWO_METRIC_TASK}.json").task
    assert two.evaluator.funcs == ("check_include_exclude", "check_include_exclude")
    assert [g.type for g in two.evaluator.getters] == ["vm_command_line"] * 2 + ["rule"] * 2
    infeasible = load_task_file(corpus / "examples" / "os" / f"{INFEASIBLE_TASK}.json").task
    assert infeasible.infeasible and infeasible.config == [] and infeasible.evaluator.getters == ()


def test_unknown_keys_are_kept_and_listed(corpus: Path) -> None:
    files = load_task_dir(corpus)
    with_hint = [f for f in files if "hint" in f.task.all_unknown_keys]
    assert with_hint, "the corpus has tasks with a top-level 'hint'"
    assert with_hint[0].task.model_extra is not None and with_hint[0].task.model_extra["hint"]


def write_task(tmp_path: Path, doc: object, name: str = "abc", domain: str = "os") -> Path:
    path = tmp_path / "examples" / domain / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


GOOD = {
    "id": "abc",
    "snapshot": "os",
    "instruction": "Do it",
    "config": [{"type": "execute", "parameters": {"command": "true"}, "future_flag": 1}],
    "related_apps": ["os"],
    "evaluator": {
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": "echo 1"},
        "expected": {"type": "rule", "rules": {"expected": "1"}},
    },
    "new_top_level": True,
}


def test_synthetic_task_with_unknown_keys(tmp_path: Path) -> None:
    file = load_task_file(write_task(tmp_path, GOOD))
    assert file.task.all_unknown_keys == ("new_top_level", "config[0].future_flag")
    assert file.raw == GOOD


@pytest.mark.parametrize(
    ("mutate", "field", "text"),
    [
        (lambda d: d.pop("instruction"), "instruction", "Field required"),
        (lambda d: d["evaluator"].update(func=3), "evaluator.func", ""),
        (lambda d: d["config"][0].pop("type"), "config.0.type", "Field required"),
        (lambda d: d["evaluator"].update(conj="xor"), "evaluator.conj", "'and' or 'or'"),
        (lambda d: d.update(id="other"), "id", "does not match the file name"),
    ],
)
def test_bad_file_names_file_and_field(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], object], field: str, text: str
) -> None:
    doc = json.loads(json.dumps(GOOD))
    mutate(doc)
    path = write_task(tmp_path, doc)
    with pytest.raises(OSWorldTaskError) as info:
        load_task_file(path)
    assert info.value.path == str(path) and info.value.field == field
    assert str(path) in str(info.value) and field in str(info.value) and text in str(info.value)


def test_bad_json_and_bad_dir(tmp_path: Path) -> None:
    path = write_task(tmp_path, "{not json")
    with pytest.raises(OSWorldTaskError, match="not valid JSON") as info:
        load_task_dir(tmp_path)
    assert info.value.path == str(path)
    with pytest.raises(OSWorldTaskError, match="not a directory"):
        load_task_dir(tmp_path / "missing")
    with pytest.raises(OSWorldTaskError, match="holds no"):
        load_task_dir(tmp_path / "examples" / "os")


def test_support_matrix_decisions() -> None:
    bare = LocalDesktop(which=nothing_installed)
    full = LocalDesktop(network=True, which=everything_installed)
    for name in ("execute", "command", "launch", "sleep", "open"):
        assert step_support(name, bare).supported, name
    assert not step_support("download", bare).supported and "network" in step_support("download", bare).reason
    assert step_support("download", full).supported
    assert not step_support("activate_window", bare).supported and step_support("activate_window", full).supported
    assert not step_support("chrome_open_tabs", full).supported
    assert step_support("teleport", full) == step_support("teleport", bare)
    assert "not in DART's support matrix" in step_support("teleport", full).reason
    for name in ("vm_file", "vm_command_line", "rule", "cache_file"):
        assert getter_support(name, bare).supported, name
    assert not getter_support("cloud_file", bare).supported and getter_support("cloud_file", full).supported
    assert not getter_support("active_tab_info", full).supported
    assert not getter_support("vm_terminal_output", full).supported
    for name in ("check_include_exclude", "exact_match", "compare_text_file", "infeasible"):
        assert metric_support(name).supported, name
    for name in ("compare_table", "compare_pptx_files", "is_expected_tabs", "no_such_metric"):
        assert not metric_support(name).supported, name


def test_required_apps(corpus: Path) -> None:
    files = {f.task.id: f for f in load_task_dir(corpus)}
    assert required_apps(files[TERMINAL_SIZE_TASK].task) == {"terminal"}
    calc = next(f for f in files.values() if f.domain == "libreoffice_calc")
    assert "libreoffice" in required_apps(calc.task)


def test_audit_of_shared_corpus(corpus: Path) -> None:
    files = load_task_dir(corpus)
    bare = audit(files, LocalDesktop(which=nothing_installed), root=str(corpus))
    assert bare.total == len(files)
    assert bare.usage("step", "download").tasks > 200 and not bare.usage("step", "download").supported
    assert bare.usage("step", "execute").supported and bare.usage("metric", "check_include_exclude").supported
    assert not bare.usage("metric", "compare_table").supported and not bare.usage("app", "libreoffice").supported
    assert bare.usage("app", "terminal").supported
    by_id = {t.id: t for t in bare.tasks}
    assert by_id[INFEASIBLE_TASK].runnable
    assert any("getter vm_terminal_output" in b for b in by_id[TERMINAL_SIZE_TASK].blockers)
    assert 0 < len(bare.runnable) < bare.total
    assert all(t.domain in ("os", "multi_apps") for t in bare.runnable)  # no browser, office or media app
    full = audit(files, LocalDesktop(network=True, which=everything_installed))
    assert len(full.runnable) > len(bare.runnable)
    doc = json.loads(json.dumps(bare.to_json()))
    assert doc["totals"]["tasks"] == len(files) and doc["totals"]["runnable"] == len(bare.runnable)
    assert sum(len(ids) for ids in doc["runnable"].values()) == len(bare.runnable)
    assert doc["steps"]["download"]["supported"] is False and doc["metrics"]["exact_match"]["supported"] is True
    assert doc["unknown_keys"]["hint"] >= 1


def test_task_spec_and_suites(corpus: Path) -> None:
    file = load_task_file(corpus / "examples" / "os" / f"{TERMINAL_SIZE_TASK}.json")
    spec = to_task_spec(file)
    assert spec.task_id == f"osworld/os/{TERMINAL_SIZE_TASK}" and spec.backend == "osworld"
    assert spec.instruction == file.task.instruction and spec.params == file.raw and spec.tags == ("os",)
    suite = load_osworld_suite(corpus)
    assert suite.name == "osworld" and len(suite.tasks) == len(load_task_dir(corpus))
    loaded = suite.by_id(spec.task_id)
    assert loaded.model_copy(update={"requires": ()}) == spec
    # Every task carries what it needs; the env pool's features decide, not this host.
    assert loaded.requires == task_requirements(file.task)
    assert "getter:vm_terminal_output" in loaded.requires and "app:terminal" in loaded.requires
    bare = LocalDesktop(which=nothing_installed)
    local = load_osworld_suite(corpus, platform=bare)
    runnable = audit_dir(corpus, bare).runnable
    assert local.name == "osworld" and len(local.tasks) == len(runnable)
    assert {t.task_id for t in local.tasks} == {f"osworld/{t.domain}/{t.id}" for t in runnable}


@pytest.mark.parametrize(
    "platform",
    [
        LocalDesktop(which=nothing_installed),
        LocalDesktop(network=True, which=everything_installed),
        VMImage(),
        VMImage(network=True),
        VMImage(apps=frozenset({"terminal", "text_editor", "libreoffice"})),
    ],
    ids=["bare-local", "full-local", "osworld-vm", "osworld-vm-network", "vm-without-chrome"],
)
def test_pool_features_keep_exactly_the_tasks_the_audit_finds_runnable(corpus: Path, platform: Platform) -> None:
    """What the data manager keeps (task requirements against the pool's features) is the audit's verdict."""
    suite = load_osworld_suite(corpus)
    caps = EnvCapabilities(pool="p", backend="osworld", features=tuple(sorted(platform_features(platform))))
    kept = runnable_tasks(suite.tasks, caps)
    report = audit_dir(corpus, platform)
    assert {t.task_id for t in kept.tasks} == {f"osworld/{t.domain}/{t.id}" for t in report.runnable}
    assert kept.excluded == report.total - len(report.runnable)
    if kept.excluded:
        assert kept.excluded_by and max(kept.excluded_by.values()) <= kept.excluded


def test_the_osworld_vm_runs_the_apps_the_local_desktop_lacks(corpus: Path) -> None:
    files = load_task_dir(corpus)
    local = audit(files, LocalDesktop(which=nothing_installed))
    vm = audit(files, VMImage())
    assert vm.platform == "vm" and local.platform == "local"
    assert {t.id for t in local.runnable} < {t.id for t in vm.runnable}
    assert vm.usage("app", "libreoffice").supported and vm.usage("app", "chrome").supported
    assert not local.usage("app", "libreoffice").supported
    # DART's own limits stay: a metric it does not implement blocks a task on any VM.
    assert not vm.usage("metric", "compare_table").supported
    no_chrome = VMImage(apps=OSWORLD_VM_APPS - {"chrome"})
    assert not audit(files, no_chrome).usage("app", "chrome").supported


def test_platform_filter_with_nothing_runnable(tmp_path: Path) -> None:
    doc = {**GOOD, "config": [{"type": "download", "parameters": {"files": []}}]}
    write_task(tmp_path, doc)
    with pytest.raises(OSWorldTaskError, match="no task is runnable"):
        load_osworld_suite(tmp_path, platform=LocalDesktop(which=nothing_installed))
    caps = EnvCapabilities(pool="p", backend="osworld", provider="local", features=("app:terminal",))
    with pytest.raises(NoRunnableTaskError, match="step:download"):
        runnable_tasks(load_osworld_suite(tmp_path).tasks, caps)
