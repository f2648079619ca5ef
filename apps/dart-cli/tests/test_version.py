"""``dart --version``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dart.cli.main import app
from dart.cli.versions import DART_PACKAGES, package_version

pytestmark = pytest.mark.unit


def test_version_lists_dart_and_its_packages() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"DART {package_version('dart-cli')}"
    listed = {line.split()[0]: line.split()[1] for line in lines[1:]}
    for dist in DART_PACKAGES:
        assert listed[dist] == package_version(dist)
    assert listed["python"] == sys.version.split()[0]


def test_installed_dart_script_runs() -> None:
    script = Path(sys.executable).parent / "dart"
    if not script.exists():
        pytest.skip("the dart console script is not installed next to this interpreter")
    proc = subprocess.run([str(script), "-V"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("DART ")


def test_no_arguments_shows_help() -> None:
    result = CliRunner().invoke(app, [])
    assert "doctor" in result.output and "nats" in result.output
