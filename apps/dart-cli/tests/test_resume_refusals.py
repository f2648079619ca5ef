"""`dart run --resume RUN_DIR` refuses, in one line with exit code 2, what it cannot continue: a directory that
is not a run, a run that finished, a run another DART version made (or one with no record to resume from).
The resume itself runs end to end in tests/test_e2e_recovery.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dart.cli import __version__
from dart.cli.main import app
from dart.cli.stack.run_record import RUN_STATE_FILE, RunState, write_json


def resume(run_dir: Path) -> tuple[int, str]:
    """``dart run --resume run_dir`` in this process (it refuses before anything starts): exit code, stderr."""
    result = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    return result.exit_code, result.stderr


def a_run(tmp_path: Path, *, version: str | None = __version__, finished: bool = False) -> Path:
    run_dir = tmp_path / "run-1"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run: {name: run}\n")
    if version is not None:
        write_json(run_dir / RUN_STATE_FILE, RunState(dart_version=version, policy=str(run_dir / "model")))
    if finished:
        (run_dir / "summary.json").write_text("{}\n")
    return run_dir


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "nowhere", "is not a run directory (no config.yaml)"),
        (lambda tmp: a_run(tmp, finished=True), "finished (its summary.json is written): there is nothing to resume"),
        (lambda tmp: a_run(tmp, version="0.0.1"), f"run-1; this is DART {__version__}"),
        (lambda tmp: a_run(tmp, version=None), f"has no {RUN_STATE_FILE}"),
    ],
    ids=["missing", "finished", "other-version", "no-record"],
)
def test_what_cannot_be_resumed_is_refused_in_one_line(make: object, message: str, tmp_path: Path) -> None:
    assert callable(make)
    run_dir = make(tmp_path)
    before = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else None

    code, stderr = resume(run_dir)

    assert code == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], stderr[-2000:]
    assert (sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else None) == before  # nothing written
