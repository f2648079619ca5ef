"""Each package builds alone; its wheel, in a fresh venv with only its declared dependencies, imports every
one of its modules, and each service package's command (``dart-env serve`` ...) serves against a real
nats-server until SIGTERM."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dart.runtime.telemetry import read_jsonl

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dart-protocol", "dart-runtime", "dart-policy", "dart-env", "dart-rollout", "dart-data", "dart-train")
FOUNDATION = {
    "dart-protocol": set(),
    "dart-runtime": {"dart-protocol"},
    "dart-policy": {"dart-protocol"},
    "dart-env": {"dart-protocol", "dart-runtime"},
    "dart-data": {"dart-protocol", "dart-runtime"},
    "dart-rollout": {"dart-protocol", "dart-runtime", "dart-policy"},
    "dart-train": {"dart-protocol", "dart-runtime", "dart-policy"},
}
"""The DART packages each one stands on: the contract, the runtime, what the model sees and says."""
SERVICE_PACKAGES = ("dart-env", "dart-data", "dart-rollout", "dart-train")

READY_TIMEOUT_S = 600.0
"""Longest wait for a served service's ``service.ready`` (the rollout service loads its engine first)."""


def _uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    return found


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    for name in PACKAGES:
        subprocess.run([_uv(), "build", "-q", "--package", name, "--wheel", "-o", str(out)], cwd=ROOT, check=True)
    return out


def _wheel(wheels: Path, name: str) -> Path:
    return next(wheels.glob(name.replace("-", "_") + "-*.whl"))


@pytest.fixture(scope="module")
def installed(wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """A fresh venv per package (made once per module) with that package's wheel installed."""
    venvs: dict[str, Path] = {}

    def venv_of(name: str) -> Path:
        if name not in venvs:
            venv = tmp_path_factory.mktemp(f"venv-{name}")
            subprocess.run([_uv(), "venv", "-q", "-p", sys.executable, str(venv)], check=True)
            # Sibling DART wheels are offered through --find-links so a package gets its declared DART
            # dependencies (the contract and the runtime) from the same build, and nothing else of the workspace.
            python = str(venv / "bin" / "python")
            # The DART wheels are rebuilt every run under the same version: --refresh-package keeps uv from
            # installing an older build of them from its cache.
            fresh = [arg for pkg in PACKAGES for arg in ("--refresh-package", pkg)]
            install = [_uv(), "pip", "install", "-q", "--python", python, "--find-links", str(wheels), *fresh]
            subprocess.run([*install, str(_wheel(wheels, name))], check=True, cwd=venv)
            venvs[name] = venv
        return venvs[name]

    yield venv_of
    # A venv with torch is ~5 GB: gone with the module, not at the end of the session (later tests, the
    # image build among them, need the disk).
    for venv in venvs.values():
        shutil.rmtree(venv, ignore_errors=True)


def _modules(wheel: Path) -> list[str]:
    """Every module the wheel ships (``dart/x/y.py`` -> ``dart.x.y``, packages by their ``__init__``)."""
    names = []
    for member in zipfile.ZipFile(wheel).namelist():
        if member.startswith("dart/") and member.endswith(".py"):
            module = member.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            if not module.endswith("__main__"):
                names.append(module)
    return sorted(names)


@pytest.mark.parametrize("name", PACKAGES)
def test_wheel_installs_and_imports_every_module_alone(
    name: str, wheels: Path, installed: Callable[[str], Path], tmp_path: Path
) -> None:
    venv = installed(name)
    modules = _modules(_wheel(wheels, name))  # optional extras are imported lazily, where used
    assert len(modules) > 5, modules
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; print('ok')"
    res = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, *modules], capture_output=True, text=True, cwd=tmp_path
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
    listed = subprocess.run(
        [_uv(), "pip", "list", "--python", str(venv / "bin" / "python")], capture_output=True, text=True, check=True
    ).stdout
    dart = {p for p in PACKAGES if p in listed.split()}
    assert dart == FOUNDATION[name] | {name}, f"{name} pulled in {sorted(dart - FOUNDATION[name] - {name})}: {listed}"
    if name in ("dart-protocol", "dart-policy"):  # no bus, store or telemetry client
        assert not {"nats-py", "minio", "opentelemetry-sdk"} & set(listed.split()), listed
    if name in ("dart-env", "dart-data"):
        assert "torch" not in listed.split(), f"{name} installs torch: {listed}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dart.policy.tiny import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny") / "model"
    write_tiny_checkpoint(path, seed=0)
    return path


def _service_sections(service: str, tmp_path: Path, tiny_model: Path) -> dict[str, Any]:
    pool = f"p{uuid.uuid4().hex[:8]}"
    if service == "env":
        return {"env": {"pool": pool, "instances": 1}}
    if service == "data":
        suite = tmp_path / "suite.yaml"
        suite.write_text(
            "name: two\nbackend: sim\nmax_steps: 4\ntasks:\n"
            "- {task_id: a, instruction: Click OK, params: {family: click-button, difficulty: easy, seed: 0}}\n"
            "- {task_id: b, instruction: Click OK, params: {family: click-button, difficulty: easy, seed: 1}}\n"
        )
        return {"suite": str(suite), "data": {"database_url": f"sqlite:///{tmp_path / 'data.sqlite3'}"}}
    if service == "rollout":
        engine = {"kind": "hf", "model_path": str(tiny_model), "device": "cpu", "dtype": "float32", "num_threads": 1}
        return {"rollout": {"engine": engine, "num_engines": 1, "runners": 1, "runner": {"pool": pool}}}
    return {"train": {"model_path": str(tiny_model)}}


def _serve(venv: Path, service: str, config: dict[str, Any], tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    path = tmp_path / f"{service}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / f"{service}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / f"dart-{service}"), "serve", "--config", str(path)],
            stdout=out,
            stderr=out,
            cwd=tmp_path,
        )
    return proc, log


@pytest.mark.parametrize("name", SERVICE_PACKAGES)
def test_the_service_command_serves_with_only_its_package(
    name: str, installed: Callable[[str], Path], nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    """``dart-<service> serve --config FILE`` from the package's own venv: ready (its ``service.ready``
    event), then SIGTERM ends it with exit code 0."""
    service = name.removeprefix("dart-")
    run_dir = tmp_path / "run"
    config = {
        "run": {"name": f"pkg-{service}", "run_dir": str(run_dir)},
        "bus": {"url": nats_url},
        **_service_sections(service, tmp_path, tiny_model),
    }
    proc, log = _serve(installed(name), service, config, tmp_path)
    try:
        events = run_dir / "telemetry" / f"{service}.jsonl"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (events.is_file() and any(r["name"] == "service.ready" for r in read_jsonl(events, types={"event"}))):
            assert proc.poll() is None, f"dart-{service} exited {proc.returncode}:\n" + log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"dart-{service} not ready:\n" + log.read_text()[-4000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
        assert any(r["name"] == "service.stop" for r in read_jsonl(events, types={"event"}))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_data_host_without_dart_env_names_what_it_lacks(
    installed: Callable[[str], Path], nats_url: str, tmp_path: Path
) -> None:
    """Shipped suites come with dart-env: a data-only host asked for one says so (exit 1, one line)."""
    config = {"run": {"name": "pkg-data-nosuite", "run_dir": str(tmp_path / "run")}, "bus": {"url": nats_url}}
    proc, log = _serve(installed("dart-data"), "data", {**config, "suite": "builtin:smoke"}, tmp_path)
    assert proc.wait(timeout=300) == 1, log.read_text()[-4000:]
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("error: dart serve data failed: ConfigError:"), last
    assert "no suite source 'builtin' is registered (the built-in suites ship with dart-env" in last, last


def test_a_key_outside_the_run_config_sections_is_refused(installed: Callable[[str], Path], tmp_path: Path) -> None:
    proc, log = _serve(installed("dart-env"), "env", {"env": {"instances": 1}, "trian": {"lr": 1}}, tmp_path)
    assert proc.wait(timeout=300) == 2, log.read_text()[-4000:]
    assert "trian" in log.read_text().strip().splitlines()[-1]
