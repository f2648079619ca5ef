"""Each package builds alone, and its wheel imports in a fresh venv with only its declared dependencies."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "dart-protocol": ["dart.protocol.messages", "dart.protocol.bus", "dart.protocol.store", "dart.protocol.telemetry"],
    "dart-env": ["dart.env.sim", "dart.env.service"],
    "dart-rollout": ["dart.rollout.action_grammar", "dart.rollout.engine.hf", "dart.rollout.engine.vllm"],
    "dart-data": ["dart.data.groups"],
    "dart-train": ["dart.train.loss"],
}


def _uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    return found


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    for name in PACKAGES:
        subprocess.run([_uv(), "build", "-q", "--package", name, "--wheel", "-o", str(out)], cwd=ROOT, check=True)
    return out


@pytest.mark.parametrize("name", list(PACKAGES))
def test_wheel_installs_and_imports_alone(name: str, wheels: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([_uv(), "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    # Sibling DART wheels are offered through --find-links so a package gets its declared DART
    # dependencies (always dart-protocol) from the same build, and nothing else of the workspace.
    wheel = next(wheels.glob(name.replace("-", "_") + "-*.whl"))
    subprocess.run(
        [
            _uv(),
            "pip",
            "install",
            "-q",
            "--python",
            str(venv / "bin" / "python"),
            "--find-links",
            str(wheels),
            str(wheel),
        ],
        check=True,
        cwd=tmp_path,
    )
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; print('ok')"
    res = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, *PACKAGES[name]], capture_output=True, text=True, cwd=tmp_path
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
    listed = subprocess.run(
        [_uv(), "pip", "list", "--python", str(venv / "bin" / "python")], capture_output=True, text=True, check=True
    ).stdout
    others = {p for p in PACKAGES if p != name and p != "dart-protocol"}
    assert not [p for p in others if p in listed], f"{name} pulled in another service: {listed}"
