"""End to end: `dart run examples/smoke-1080p.yaml` (the smoke pipeline at 1920x1080 on an S3 store; the
run is shared with tests/test_e2e_1080p.py, see the root conftest's ``smoke_run``) runs the four services
as separate `dart serve` processes against one nats-server, and its own records show the decoupled system
working."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dart.runtime.telemetry import read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_support  # the end-to-end tests' shared helpers, beside them

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def test_summary_shows_training_and_no_loss(smoke_run: tuple[dict[str, Any], Path]) -> None:
    summary, run_dir = smoke_run
    assert summary["error"] is None
    assert summary["versions_published"] >= 2
    assert summary["version_kind"] == "weights" and summary["version_bytes"] > 1_000_000  # the tiny policy
    assert summary["trajectories_produced"] > 0
    assert summary["trajectories_produced"] == summary["trajectories_stored"]
    assert summary["trajectories_lost"] == 0
    assert summary["trajectories_duplicated"] == 0  # no trajectory id was stored twice on the stream
    assert summary["service_exit_codes"] == {"rollout": 0, "data": 0, "train": 0, "env": 0}
    assert (run_dir / "summary.json").is_file()
    # Phases count work: every warm-start step was taken, and RL ended on its own terms, saying which.
    assert summary["warm_start_cut"] is False
    assert summary["warm_start_steps"] == summary["warm_start_planned_steps"]
    assert summary["rl_ended_by"] in ("duration", "versions")
    # The staleness bound holds for what was trained on, not only for what was batched.
    bound = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["grouping"]["max_staleness"]
    assert summary["max_trained_policy_lag"] is not None and summary["max_trained_policy_lag"] <= bound


def test_held_out_validation_evaluated_the_first_and_the_final_version(
    smoke_run: tuple[dict[str, Any], Path],
) -> None:
    summary, run_dir = smoke_run
    heldout = summary["heldout"]
    final = summary["versions_published"]
    assert [h["version"] for h in heldout] == ([0, final] if final else [0])
    for entry in heldout:
        # Every one of the 32 held-out tasks ran to an outcome, once, greedily, on the run's own engine.
        assert (entry["n"], entry["errors"]) == (32, 0)
        assert entry["served_by"] == "run engines"
        assert re.fullmatch(r"engine-[01], hf on cpu \(float32\)", entry["engine"]), entry["engine"]
        assert entry["ci95"][0] <= entry["success"] <= entry["ci95"][1]
    assert summary["heldout_served_by"] == sorted({f"run engines: {h['engine']}" for h in heldout})
    assert summary["heldout_success_first"] == heldout[0]["success"]
    assert summary["heldout_success_final"] == heldout[-1]["success"]
    lines = [json.loads(line) for line in (run_dir / "heldout.jsonl").read_text().splitlines()]
    assert [(x["version"], x["n"], x["temperature"]) for x in lines] == [(h["version"], 32, 0.0) for h in heldout]
    events = [
        r
        for r in read_jsonl(run_dir / "telemetry" / "validation.jsonl", types={"event"})
        if r["name"] == "validation.heldout"
    ]
    assert [e["attributes"]["version"] for e in events] == [h["version"] for h in heldout]


def test_the_training_suite_was_evaluated_greedily_at_the_first_and_the_final_version(
    smoke_run: tuple[dict[str, Any], Path],
) -> None:
    """validation.train_split: the smoke suite's 8 tasks, greedy, at version 0 and at the final version, on the
    run's engines and the validation pool, with the difference between the two and its interval."""
    summary, run_dir = smoke_run
    train = summary["train_greedy"]
    final = summary["versions_published"]
    assert [t["version"] for t in train] == [0, final]
    for entry in train:
        assert (entry["n"], entry["errors"]) == (8, 0)
        assert entry["served_by"] == "run engines"
        assert entry["ci95"][0] <= entry["success"] <= entry["ci95"][1]
    gain = summary["train_greedy_gain"]
    assert (gain["from_version"], gain["to_version"]) == (0, final)
    assert gain["difference"] == pytest.approx(train[1]["success"] - train[0]["success"])
    assert gain["ci95"][0] <= gain["difference"] <= gain["ci95"][1]
    lines = [json.loads(line) for line in (run_dir / "train_greedy.jsonl").read_text().splitlines()]
    assert [(x["version"], x["n"], x["temperature"]) for x in lines] == [(0, 8, 0.0), (final, 8, 0.0)]
    # Each ran with the held-out suite in one evaluation (version 0 is never loaded back into an engine).
    assert [(x["label"], x["evaluated_with"]) for x in lines] == [
        ("train-v0", ["heldout"]),
        (f"train-v{final}", ["heldout"]),
    ]
    assert sorted(x["task_id"] for x in lines[0]["tasks"]) == sorted(x["task_id"] for x in lines[1]["tasks"])
    events = [
        r["attributes"]["version"]
        for r in read_jsonl(run_dir / "telemetry" / "validation.jsonl", types={"event"})
        if r["name"] == "validation.train"
    ]
    assert events == [0, final]


def test_services_ran_as_separate_processes(smoke_run: tuple[dict[str, Any], Path]) -> None:
    _, run_dir = smoke_run
    starts = read_jsonl(run_dir / "telemetry", types={"event"})
    services = {r["service"]: r["service_instance"] for r in starts if r["name"] == "service.start"}
    assert set(services) == {"dart-env", "dart-rollout", "dart-data", "dart-train"}
    assert len(set(services.values())) == 4
    for name in ("env", "rollout", "data", "train"):
        assert (run_dir / "logs" / f"{name}.log").is_file()


def test_an_engine_updated_while_another_served(smoke_run: tuple[dict[str, Any], Path]) -> None:
    _, run_dir = smoke_run
    records = list(read_jsonl(run_dir / "telemetry" / "rollout.jsonl"))
    e2e_support.assert_an_engine_updated_while_another_served(records)


def test_one_trajectory_is_one_trace_across_services(smoke_run: tuple[dict[str, Any], Path]) -> None:
    _, run_dir = smoke_run
    spans = list(read_jsonl(run_dir / "telemetry", types={"span"}))
    by_trace: dict[str, set[str]] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], set()).add(s["service"])
    roots = [s for s in spans if s["name"] == "trajectory"]
    assert roots
    crossing = [r for r in roots if {"dart-rollout", "dart-env"} <= by_trace[r["trace_id"]]]
    assert crossing, "no trajectory trace reached the env service"


def test_report_renders(smoke_run: tuple[dict[str, Any], Path]) -> None:
    _, run_dir = smoke_run
    proc = subprocess.run(
        [sys.executable, "-m", "dart.cli", "report", str(run_dir)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["report"]).is_file() and out["plots"] >= 4


def test_training_curves_reach_tensorboard(smoke_run: tuple[dict[str, Any], Path]) -> None:
    """The smoke config's TensorBoard tracker: event files tensorboard's own reader loads, with the trainer's
    and the data manager's curves, one loss point per optimizer step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary, run_dir = smoke_run
    train = EventAccumulator(str(run_dir / "tensorboard" / "dart-train"))
    train.Reload()
    assert {"trainer.step/loss", "trainer.step/clip_fraction", "trainer.published/version"} <= set(
        train.Tags()["scalars"]
    )
    steps = [e.step for e in train.Scalars("trainer.step/loss")]
    assert steps == sorted(steps) and len(steps) >= summary["versions_published"]
    data = EventAccumulator(str(run_dir / "tensorboard" / "dart-data"))
    data.Reload()
    assert "data.stats/stored" in data.Tags()["scalars"]


def test_services_authenticated_and_no_secret_leaked(smoke_run: tuple[dict[str, Any], Path]) -> None:
    """Auth is on by default: one bus user and one store key pair per role, secrets only in 0600 files,
    nowhere else in the run."""
    import stat

    _, run_dir = smoke_run
    secrets_dir = run_dir / "secrets"
    assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
    password_files = sorted(secrets_dir.glob("nats-*.password"))
    assert [p.name for p in password_files] == [
        f"nats-{r}.password" for r in sorted(("env", "rollout", "data", "train", "run", "eval"))
    ]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in password_files)
    passwords = [p.read_text().strip().encode() for p in password_files]
    assert all(len(pw) >= 32 for pw in passwords)
    server_config = json.loads((run_dir / "nats" / "nats.conf").read_text())
    users = {u["user"]: u for u in server_config["authorization"]["users"]}
    assert set(users) == {"env", "rollout", "data", "train", "run", "eval"}
    assert all(u["password"].startswith("$2a$") and "permissions" in u for u in users.values())
    # The env user serves the run's pools only: env.pool and validation.pool.
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    pools = {config["env"]["pool"], config["validation"]["pool"]}
    served = [s for s in users["env"]["permissions"]["subscribe"]["allow"] if not s.startswith("_INBOX.")]
    env_root = f"{config['bus']['prefix']}.env."
    assert served and all(s.startswith(env_root) and s[len(env_root) :].split(".")[0] in pools for s in served)
    # Every service connected as its own user and stayed within its permissions.
    server_log = (run_dir / "nats" / "nats-server.log").read_text()
    assert "Violation" not in server_log and "authentication error" not in server_log.lower()
    # The config every service reads names no bus user (each service's comes from its environment).
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["bus"].get("user") is None
    # One store key pair per role, in 0600 files; the config names none (each service's comes from its
    # environment) and no service was refused by the store: each stayed within its role's prefixes.
    key_files = sorted(secrets_dir.glob("s3-*"))
    roles = sorted(("env", "rollout", "data", "train", "view", "run"))
    assert [p.name for p in key_files] == [f"s3-{r}.{kind}" for r in roles for kind in ("access", "secret")]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in key_files)
    store = yaml.safe_load((run_dir / "config.yaml").read_text())["store"]
    assert store.get("access_key_file") is None and store.get("secret_key_file") is None
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert "AccessDenied" not in logs
    # The store server's own config (0600) is the one other place its keys are.
    server_config = run_dir / "s3" / "s3.json"
    assert stat.S_IMODE(server_config.stat().st_mode) == 0o600
    passwords += [p.read_text().strip().encode() for p in key_files]
    # No password or key in logs, telemetry, configs, the summary, the server config or any other file.
    leaks = [
        str(path.relative_to(run_dir))
        for path in run_dir.rglob("*")
        if path.is_file()
        and secrets_dir not in path.parents
        and path != server_config
        and any(pw in path.read_bytes() for pw in passwords)
    ]
    assert leaks == []
