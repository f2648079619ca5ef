"""Repository rules checked on every test run: formatting, lint, strict typing, and hygiene.

These run the real tools over the real tree, so `uv run pytest` is the whole check.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
STRICT_TYPED = [
    "packages/dart-protocol/src",
    "packages/dart-data/src",
    "packages/dart-env/src",
    "packages/dart-rollout/src",
    "packages/dart-train/src",
    "packages/dart-embedded/src",
    "apps/dart-cli/src",
]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def _tracked_files() -> list[Path]:
    out = _run("git", "ls-files", "-co", "--exclude-standard")
    return [ROOT / line for line in out.stdout.splitlines() if line and (ROOT / line).is_file()]


def test_ruff_format() -> None:
    res = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_lint() -> None:
    res = _run(sys.executable, "-m", "ruff", "check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_strict() -> None:
    # One run over every package: each run analyses torch and transformers again (40 s apiece), and a
    # package's errors are named by file either way.
    res = _run(sys.executable, "-m", "mypy", "--strict", "--no-incremental", *STRICT_TYPED)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr


def test_no_subject_literals_outside_subjects_module() -> None:
    pattern = re.compile(r"""["']dart\.v1\.""")
    offenders = [
        str(p.relative_to(ROOT))
        for p in _tracked_files()
        if p.suffix == ".py" and p.name != "subjects.py" and pattern.search(p.read_text(errors="replace"))
    ]
    assert offenders == []


def test_no_machine_paths_secrets_or_ips_in_tracked_files() -> None:
    # Assembled from parts so this file does not match its own patterns.
    home, root, key = "/" + "home/[a-z]", "/" + "root/", "AKIA" + "[0-9A-Z]{12}"
    bad = re.compile(
        rf"({home}|{root}|{key}|BEGIN (RSA|OPENSSH) PRIVATE" + " KEY"
        r"|\b(10\.\d+\.\d+\.\d+|192\.168\.\d+\.\d+|172\.(1[6-9]|2\d|3[01])\.\d+\.\d+)\b)"
    )
    offenders = []
    for path in _tracked_files():
        if path.suffix in {".lock", ".png"}:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if bad.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert offenders == []


def test_no_namespace_init_files() -> None:
    stray = [str(p.relative_to(ROOT)) for p in ROOT.glob("*/*/src/dart/__init__.py")]
    assert stray == [], "dart is a namespace package: no dart/__init__.py"
