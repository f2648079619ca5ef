"""``dart env osworld-audit``: on the real OSWorld task files, human table and JSON summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from dart.cli import env_command

pytestmark = pytest.mark.unit

SHARED_OSWORLD = Path(__file__).resolve().parents[3].parent / "shared" / "osworld"


@pytest.fixture(scope="module")
def corpus() -> Path:
    if not (SHARED_OSWORLD / "examples").is_dir():
        pytest.fail(f"the OSWorld task corpus is missing: expected {SHARED_OSWORLD}/examples beside the repository")
    return SHARED_OSWORLD


def cli() -> typer.Typer:
    # A root app of its own, so the test does not depend on main.py listing the module.
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """Test root."""

    env_command.register(app)
    return app


def test_audit_prints_tables_and_json_totals(corpus: Path) -> None:
    result = CliRunner().invoke(cli(), ["env", "osworld-audit", str(corpus), "--json"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    n_files = len(list((corpus / "examples").glob("*/*.json")))
    totals = summary["totals"]
    assert totals["tasks"] == n_files and 0 < totals["runnable"] < n_files
    assert sum(d["tasks"] for d in summary["domains"].values()) == n_files
    assert sum(len(ids) for ids in summary["runnable"].values()) == totals["runnable"]
    assert summary["steps"]["download"]["supported"] is False  # no network by default
    assert summary["metrics"]["check_include_exclude"]["supported"] is True
    for section in ("steps", "getters", "metrics", "apps"):
        assert all(set(v) == {"tasks", "uses", "supported", "reason"} for v in summary[section].values())
    assert "Setup steps" in result.stdout and "Tasks by domain" in result.stdout
    assert f"parsed {n_files} task(s)" in result.stdout


def test_network_flag_supports_downloads(corpus: Path) -> None:
    result = CliRunner().invoke(cli(), ["env", "osworld-audit", str(corpus), "--json", "--network"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["network"] is True and summary["steps"]["download"]["supported"] is True


def test_provider_docker_audits_against_the_osworld_vm_image(corpus: Path) -> None:
    def audit(*extra: str) -> dict[str, Any]:
        result = CliRunner().invoke(cli(), ["env", "osworld-audit", str(corpus), "--json", *extra])
        assert result.exit_code == 0, result.output
        return dict(json.loads(result.stdout.strip().splitlines()[-1]))

    local, docker, remote = audit("--provider", "local"), audit("--provider", "docker"), audit("--provider", "remote")
    assert local["platform"] == "local" and docker["platform"] == remote["platform"] == "vm"
    assert docker["totals"] == remote["totals"]
    # The VM image has the applications: office, browser and image-editor tasks are no longer dropped for them.
    for app in ("libreoffice", "chrome", "gimp"):
        assert docker["apps"][app]["supported"] is True
    assert docker["totals"]["runnable"] > local["totals"]["runnable"]
    bad = CliRunner().invoke(cli(), ["env", "osworld-audit", str(corpus), "--provider", "kvm"])
    assert bad.exit_code == 2 and "kvm" in bad.output


def test_bad_task_file_exits_1_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "examples" / "os" / "abc.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(json.dumps({"id": "abc", "evaluator": {"func": "exact_match"}}))
    result = CliRunner().invoke(cli(), ["env", "osworld-audit", str(tmp_path)], env={"COLUMNS": "400"})
    assert result.exit_code == 1
    assert "abc.json" in result.stdout and "instruction" in result.stdout
