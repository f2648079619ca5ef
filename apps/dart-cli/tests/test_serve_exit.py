"""`dart serve` ends with exit code 1 and one line naming the service and the error when it cannot go on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration


def test_a_fatal_error_exits_1_with_one_clear_line(nats_url: str, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    unopenable = tmp_path / "not-a-dir"
    unopenable.write_text("a file where the database's directory should be")
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "fatal", "run_dir": str(tmp_path / "run")},
                "bus": {"url": nats_url},
                "data": {"database_url": f"sqlite:///{unopenable / 'data.sqlite3'}"},
                "telemetry": {"jsonl_path": str(tmp_path / "telemetry.jsonl")},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "dart.cli", "serve", "data", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: dart serve data failed: OperationalError:"), last
    assert "Traceback" in proc.stderr  # the log keeps the traceback for whoever debugs it


@pytest.mark.unit
def test_the_packages_know_every_section_of_a_run_config() -> None:
    """A service package's command accepts a whole run config and refuses other top-level keys: its list
    of the run config's sections is this one."""
    from dart.cli.stack.config import RunConfig
    from dart.protocol.serving import RUN_CONFIG_SECTIONS

    assert set(RunConfig.model_fields) == RUN_CONFIG_SECTIONS
