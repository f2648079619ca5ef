"""`dart run --resume RUN_DIR` refuses, in one line with exit code 2, what it cannot continue: a directory that
is not a run, a run that finished, a run another DART version made (or one with no record to resume from).
The resume itself runs end to end in tests/test_e2e_recovery.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dart.cli import __version__
from dart.cli.stack.run_record import RUN_STATE_FILE, RunState, write_json


def resume(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dart.cli", "run", "--resume", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=os.environ,
    )


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

    done = resume(run_dir)

    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert (sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else None) == before  # nothing written
