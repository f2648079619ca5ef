"""`dart warm-start CONFIG`: the warm start `dart run CONFIG` would compute, stored ahead in warm_start.cache_dir
under the key the run looks up; a config that cannot keep one is refused with the setting named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dart.cli.main import app
from dart.cli.stack.config import load_run_config
from dart.cli.stack.run import prepare_policy, resolve

ROOT = Path(__file__).resolve().parents[3]
SMOKE = ROOT / "examples" / "smoke.yaml"
SHORT = ["warm_start.steps=2", "warm_start.episodes_per_task=1"]


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ([], "warm_start.cache_dir"),  # computed and thrown away: refused
        (["warm_start.cache_dir=/nonexistent/never-written", "warm_start.enabled=false"], "warm_start.enabled"),
    ],
)
def test_a_warm_start_that_would_not_be_kept_is_refused(
    overrides: list[str], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DART_WARM_START__CACHE_DIR", raising=False)
    code, out, err = invoke("warm-start", str(SMOKE), *overrides)
    assert code == 2, out + err
    assert err.startswith("error:") and named in err, err
    assert not Path("/nonexistent/never-written").exists()


@pytest.mark.integration
def test_the_run_finds_the_warm_start_prepared_for_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    overrides = [*SHORT, f"warm_start.cache_dir={cache}", f"run.runs_root={tmp_path / 'runs'}"]
    code, out, err = invoke("warm-start", str(SMOKE), *overrides)
    assert code == 0, out + err
    prepared = json.loads(out.strip().splitlines()[-1])
    assert prepared["stored"] is True and prepared["warm_start_cached"] is False
    assert prepared["warm_start_steps"] == 2 and prepared["warm_start_demos"] > 0
    assert (cache / prepared["key"] / "policy" / "config.json").is_file()
    assert not (tmp_path / "runs").exists()  # no run directory: the scratch one is gone

    code, out, err = invoke("warm-start", str(SMOKE), *overrides)  # there already: nothing computed
    assert code == 0, out + err
    again = json.loads(out.strip().splitlines()[-1])
    assert again["key"] == prepared["key"] and again["warm_start_cached"] is True

    # dart run of the same config, with settings that only act after the warm start changed, starts from it.
    run_overrides = [*overrides, "run.rl_duration_s=5", "train.backend.kind=fsdp", "run.name=other"]
    config = resolve(load_run_config(SMOKE, run_overrides), SMOKE)
    policy, info = prepare_policy(config)
    assert info["warm_start_cached"] is True and info["warm_start_steps"] == 2
    assert (policy / "config.json").is_file()


@pytest.mark.integration
def test_a_cut_warm_start_says_so_with_the_steps_done_and_is_not_kept(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # A cap no SFT step fits in: the warm start stops after its first step.
    overrides = ["warm_start.steps=3", "warm_start.episodes_per_task=1", "warm_start.max_seconds=0.000001"]
    code, out, err = invoke("warm-start", str(SMOKE), *overrides, f"warm_start.cache_dir={cache}")
    assert code == 1, out + err
    cut = json.loads(out.strip().splitlines()[-1])
    assert cut["stored"] is False and not any(cache.glob("*/policy"))
    assert cut["warm_start_cut"] is True and cut["warm_start_cut_by"] == "max_seconds"
    assert cut["warm_start_steps"] == 1 and cut["warm_start_planned_steps"] == 3
    assert "cut the warm start short at step 1 of 3" in err and "warm_start.max_seconds" in err
