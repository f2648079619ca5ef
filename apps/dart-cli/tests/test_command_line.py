"""Settings on the command line: `dart run CONFIG KEY=VALUE ...`, `dart serve` and the package commands the
same way; `--print-config`; a config error is one line, exit code 2, and leaves no run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dart.cli.main import app
from dart.data.serve import command as data_command

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
SMOKE = ROOT / "examples" / "smoke.yaml"


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_print_config_shows_the_overrides_and_writes_nothing(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    code, out, _ = invoke(
        "run",
        str(SMOKE),
        "run.rl_duration_s=30",
        f"run.runs_root={runs}",
        "data.retention={keep_versions: 2, interval_s: 5}",
        "run.name=007",
        "--print-config",
    )
    assert code == 0, out
    resolved = yaml.safe_load(out)
    assert resolved["run"]["rl_duration_s"] == 30
    assert resolved["run"]["name"] == "007"  # a string field takes the value verbatim
    assert resolved["data"]["retention"]["keep_versions"] == 2 and resolved["data"]["retention"]["interval_s"] == 5
    file_batching = yaml.safe_load(SMOKE.read_text())["data"]["batching"]  # the rest: the file's
    assert {k: resolved["data"]["batching"][k] for k in file_batching} == file_batching
    assert not runs.exists()


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("run.rl_duraton_s=30", "run.rl_duraton_s"),  # misspelt: named, with the close match
        ("data.batching.min_samples=0", "data.batching.min_samples"),  # out of range
        ("rl_duration_s", "rl_duration_s"),  # no "="
        ("suite=no/such/suite.yaml", "suite"),  # a suite that does not resolve
        ("suite=nosource:basic", "suite"),  # a suite source nobody registered
        ("env.backend=simm", "env.backend"),  # a backend nobody registered: the names that exist are listed
        ("train.backend.kind=megatronn", "train.backend"),
        ("rollout.engine={kind: vlm}", "rollout.engine"),
    ],
)
def test_a_config_error_is_one_line_with_exit_code_2_and_no_run_directory(
    tmp_path: Path, override: str, named: str
) -> None:
    runs = tmp_path / "runs"
    code, out, err = invoke("run", str(SMOKE), f"run.runs_root={runs}", override)
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("error: ") and named in lines[0], err
    assert "Traceback" not in err and not runs.exists()


def test_dart_serve_and_the_package_command_take_the_same_overrides(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"data": {"database_url": f"sqlite:///{tmp_path / 'data.sqlite3'}"}}))
    code, out, _ = invoke("serve", "data", "--config", str(config), "data.batching.min_samples=16", "--print-config")
    assert code == 0 and yaml.safe_load(out)["data"]["batching"]["min_samples"] == 16
    code, _, err = invoke("serve", "data", "--config", str(config), "data.batching.min_sample=16")
    assert code == 2 and "data.batching.min_sample" in err
    # The package command alone refuses it the same way (before connecting to anything).
    assert data_command(["serve", "--config", str(config), "data.batching.min_samples=0"]) == 2


def test_reading_a_run_config_and_serving_env_or_data_import_no_torch() -> None:
    """`dart run` reads its config, and `dart serve env` / `dart serve data` start, without importing torch or
    transformers (seconds of CPU in every such process): only the engines, the trainer and counting the machine's
    GPUs need them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dart.cli.main, dart.cli.stack.run, dart.cli.stack.services, dart.env.serve, dart.data.serve\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
