"""The warm-start cache: which configs share a warm-started policy, and entries written whole."""

from __future__ import annotations

import fcntl
import json
import threading
from pathlib import Path

import pytest

from dart.cli.stack.config import RunConfig, load_run_config, load_tasks
from dart.cli.stack.warmstart_cache import WarmStartCache, warm_start_key

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _key(config: RunConfig) -> str:
    return warm_start_key(config, load_tasks(config))


def test_variants_that_change_only_training_share_the_smoke_warm_start() -> None:
    smoke = _key(load_run_config(EXAMPLES / "smoke.yaml"))
    for variant in ("smoke-fsdp.yaml", "smoke-megatron.yaml", "smoke-vllm.yaml"):
        assert _key(load_run_config(EXAMPLES / variant)) == smoke, variant


def test_what_changes_the_policy_changes_the_key() -> None:
    base = load_run_config(EXAMPLES / "smoke.yaml")
    key = _key(base)
    ws, env, runner = base.warm_start, base.env, base.rollout.runner
    changed = [
        base.model_copy(update={"warm_start": ws.model_copy(update={"steps": ws.steps + 1})}),
        base.model_copy(update={"warm_start": ws.model_copy(update={"lr": ws.lr * 2})}),
        base.model_copy(update={"model": base.model.model_copy(update={"tiny_seed": 1})}),
        base.model_copy(update={"env": env.model_copy(update={"sim": env.sim.model_copy(update={"width": 640})})}),
        *(
            base.model_copy(update={"rollout": base.rollout.model_copy(update={"runner": runner.model_copy(update=u)})})
            for u in (
                {"prompt": runner.prompt.model_copy(update={"max_images": 2})},
                {"prompt": runner.prompt.model_copy(update={"coordinates": "pixels"})},
            )
        ),
        base.model_copy(update={"train": base.train.model_copy(update={"micro_batch_size": 2})}),
        base.model_copy(update={"run": base.run.model_copy(update={"seed": 7})}),
        base.model_copy(update={"suite": "builtin:train"}),
    ]
    keys = [_key(c) for c in changed]
    assert key not in keys
    assert len(set(keys)) == len(keys)
    # What cannot change a complete warm start keeps the key.
    limits = {"max_seconds": 5.0, "max_slowdown": 2.0, "guard_floor_s": 1.0, "cache_dir": Path("x")}
    same = base.model_copy(update={"warm_start": ws.model_copy(update=limits)})
    assert _key(same) == key


def test_a_checkpoint_path_is_keyed_by_its_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    config = load_run_config(EXAMPLES / "smoke.yaml")
    config = config.model_copy(update={"model": config.model.model_copy(update={"path": ckpt})})
    before = _key(config)
    (ckpt / "model.safetensors").write_bytes(b"0" * 8)
    assert _key(config) != before


def _policy(root: Path, text: str) -> Path:
    root.mkdir(parents=True)
    (root / "model.safetensors").write_text(text)
    return root


def test_entry_round_trip_and_first_writer_wins(tmp_path: Path) -> None:
    cache = WarmStartCache(tmp_path / "cache")
    out = tmp_path / "run" / "sft"
    assert cache.get("k", out) is None
    assert not out.exists()
    cache.put("k", _policy(tmp_path / "a", "A"), {"warm_start_steps": 3})
    cache.put("k", _policy(tmp_path / "b", "B"), {"warm_start_steps": 9})
    assert cache.get("k", out) == {"warm_start_steps": 3}
    assert (out / "model.safetensors").read_text() == "A"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["k"]  # no staging directory left behind


def test_concurrent_writers_leave_one_whole_entry(tmp_path: Path) -> None:
    writers = 4
    cache = WarmStartCache(tmp_path / "cache")
    policies = [_policy(tmp_path / f"p{i}", str(i) * 1000) for i in range(writers)]
    errors: list[BaseException] = []

    def put(i: int) -> None:
        try:
            cache.put("k", policies[i], {"writer": i})
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    info = json.loads((tmp_path / "cache" / "k" / "info.json").read_text())
    winner = info["writer"]
    assert (tmp_path / "cache" / "k" / "policy" / "model.safetensors").read_text() == str(winner) * 1000
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["k"]


def test_runs_wanting_the_same_key_fill_it_one_at_a_time(tmp_path: Path) -> None:
    """The second run waits on the key's lock while the first fills the entry, then finds the entry."""
    cache = WarmStartCache(tmp_path / "cache")
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"weights")
    order: list[str] = []
    first_inside, second_waiting = threading.Event(), threading.Event()

    def second() -> None:
        first_inside.wait()
        second_waiting.set()
        with cache.filling("k"):
            order.append("second in")
            found = cache.get("k", tmp_path / "second")
            order.append("second found" if found == {"steps": 3} else f"second found {found}")

    waiter = threading.Thread(target=second)
    waiter.start()
    with cache.filling("k"):
        order.append("first in")
        first_inside.set()
        second_waiting.wait()
        assert cache.get("k", tmp_path / "first") is None
        with open(cache.root / ".k.lock", "wb") as probe, pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: the second run cannot be in
        cache.put("k", policy, {"steps": 3})
        order.append("first stored")
    waiter.join()
    assert order == ["first in", "first stored", "second in", "second found"]
    # Another key is not held up by this one's lock.
    with cache.filling("k"), cache.filling("other"):
        pass
