"""Weight sync: engines update one at a time while the others keep serving; weights are verified."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from dart.policy.prompt import ChatPrompt
from dart.protocol.messages import ModelVersion
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import EngineState, GenerationRequest
from dart.rollout.errors import NoEngineAtVersionError, WeightFetchError
from dart.rollout.service.config import SyncConfig
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.scripted import ScriptedEngine
from dart.rollout.service.sync import EngineUpdate, WeightSyncController, max_concurrent_updates
from dart.runtime.bus import Bus
from dart.runtime.telemetry import TelemetryConfig, read_jsonl, setup_telemetry
from dart.runtime.testing import wait_until
from dart.runtime.topology import ensure_topology

REQUEST = GenerationRequest(ChatPrompt("hi"), max_new_tokens=4)


def _model_version(path: Path, version: int, sha256: str | None = None) -> ModelVersion:
    digest = sha256 or hashlib.sha256(path.read_bytes()).hexdigest()
    return ModelVersion(version=version, uri=path.as_uri(), sha256=digest, created_at=time.time())


def _assert_disjoint(updates: list[EngineUpdate]) -> None:
    ordered = sorted(updates, key=lambda u: u.started_at)
    for before, after in zip(ordered, ordered[1:], strict=False):
        assert before.finished_at <= after.started_at, f"{before} overlaps {after}"


@pytest.mark.unit
def test_max_concurrent_updates_never_takes_all_engines_down_when_decoupled() -> None:
    decoupled = SyncConfig()
    assert [max_concurrent_updates(n, decoupled) for n in (1, 2, 3, 4, 8)] == [1, 1, 1, 2, 4]
    assert max_concurrent_updates(4, SyncConfig(max_updating_fraction=1.0)) == 3
    assert max_concurrent_updates(4, SyncConfig(mode="coupled")) == 4


@pytest.mark.unit
async def test_one_engine_updates_while_the_other_serves(tmp_path: Path) -> None:
    weights = tmp_path / "v1.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights))
    a = ScriptedEngine(["Action: wait()"], generate_s=0.01, update_s=0.3)
    b = ScriptedEngine(["Action: wait()"], generate_s=0.01, update_s=0.3)
    router = EngineRouter({"a": a, "b": b}, poll_interval_s=0.002)
    telemetry = setup_telemetry("dart-rollout", version="t", run_id="t", config=TelemetryConfig(run_dir=tmp_path))
    sync = WeightSyncController({"a": a, "b": b}, SyncConfig(), telemetry=telemetry)
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            engine = await router.pick()
            await engine.generate(REQUEST)

    clients = [asyncio.create_task(client()) for _ in range(4)]
    try:
        updates = await sync.apply(_model_version(weights, 1))
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert {u.engine_id for u in updates} == {"a", "b"} and all(u.ok for u in updates)
    assert a.version == b.version == 1 and a.loaded == [weights] == b.loaded
    _assert_disjoint(updates)
    # While each engine updated, the other answered requests.
    loop_offset = time.time() - asyncio.get_running_loop().time()
    for update in updates:
        other = b if update.engine_id == "a" else a
        served = [c for c in other.calls if update.started_at <= c.finished + loop_offset <= update.finished_at]
        assert len(served) >= 5, f"{other} served {len(served)} requests during {update}"
    # The update intervals are in the telemetry events a run report reads.
    telemetry.flush()
    records = read_jsonl(telemetry.jsonl_path)
    events = [r for r in records if r.get("type") == "event" and r["name"].startswith("engine.update")]
    telemetry.shutdown()
    names = [(e["name"], e["attributes"]["engine_id"], e["attributes"]["version"]) for e in events]
    assert sorted(names) == sorted(
        [(n, e, 1) for n in ("engine.update.start", "engine.update.end") for e in ("a", "b")]
    )
    # Already at version 1: nothing to do.
    assert await sync.apply(_model_version(weights, 1)) == []


@pytest.mark.unit
async def test_bad_sha256_or_missing_file_changes_no_engine(tmp_path: Path) -> None:
    weights = tmp_path / "v1.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights))
    engine = ScriptedEngine(["x"])
    sync = WeightSyncController({"e": engine}, SyncConfig())
    with pytest.raises(WeightFetchError, match="sha256"):
        await sync.apply(_model_version(weights, 1, sha256="0" * 64))
    with pytest.raises(WeightFetchError, match="not a file"):
        await sync.apply(_model_version(tmp_path / "gone.safetensors", 2, sha256="0" * 64))
    assert engine.version == 0 and sync.failed_fetches == 2 and sync.updates == []


@pytest.mark.integration
async def test_hf_engines_follow_the_state_bucket(bus: Bus, checkpoint: Path, tmp_path: Path) -> None:
    state = await ensure_topology(bus)
    config = HFEngineConfig(model_path=str(checkpoint), num_threads=1, batch_wait_s=0.0)
    engines = {"e0": await HFEngine.start(config), "e1": await HFEngine.start(config)}
    # New weights: the model's own, shifted, saved as the trainer would publish them.
    shifted = {k: (v + 0.01).contiguous() for k, v in engines["e0"].model.state_dict().items()}
    weights = tmp_path / "v1.safetensors"
    await asyncio.to_thread(save_file, shifted, str(weights))
    sync = WeightSyncController(engines, SyncConfig())  # type: ignore[arg-type]
    try:
        await sync.start(state)
        await state.put(LATEST_MODEL_KEY, await asyncio.to_thread(_model_version, weights, 1))
        async with asyncio.timeout(30):
            while len(sync.updates) < 2:  # noqa: ASYNC110  (the controller's record is the signal)
                await asyncio.sleep(0.02)
        assert all(u.ok for u in sync.updates) and {e.version for e in engines.values()} == {1}
        _assert_disjoint(sync.updates)
        for engine in engines.values():
            name, loaded = next(iter(engine.model.state_dict().items()))
            assert torch.equal(loaded, shifted[name])
        result = await engines["e1"].generate(REQUEST)
        assert result.policy_version == 1
    finally:
        await sync.stop()
        for engine in engines.values():
            await engine.close()


@pytest.mark.integration
async def test_weights_that_cannot_be_fetched_yet_are_retried_without_a_new_version(bus: Bus, tmp_path: Path) -> None:
    """A version announced before its weights are readable (a shared filesystem lagging behind): the sync
    fails the fetch, then tries the same version again after a backoff and the engine reaches it."""
    state = await ensure_topology(bus)
    weights = tmp_path / "v1.safetensors"
    data = save({"w": torch.ones(2)})
    engine = ScriptedEngine(["x"])
    sync = WeightSyncController({"e": engine}, SyncConfig(retry_backoff_s=0.05, retry_backoff_max_s=0.2))
    try:
        await sync.start(state)
        digest = hashlib.sha256(data).hexdigest()
        await state.put(LATEST_MODEL_KEY, ModelVersion(version=1, uri=weights.as_uri(), sha256=digest, created_at=0.0))
        async with asyncio.timeout(30):
            while sync.failed_fetches < 1:  # noqa: ASYNC110  (the controller's counter is the signal)
                await asyncio.sleep(0.01)
        weights.write_bytes(data)
        async with asyncio.timeout(30):  # a bound for a failing run; a passing one ends at the retry
            while engine.version < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert engine.loaded == [weights] and sync.retries >= 1
    finally:
        await sync.stop()


@pytest.mark.unit
async def test_an_evaluation_holds_one_engine_at_its_version_and_the_sync_catches_it_up_after(tmp_path: Path) -> None:
    v1, v2 = tmp_path / "v1.safetensors", tmp_path / "v2.safetensors"
    save_file({"w": torch.ones(2)}, str(v1))
    save_file({"w": torch.full((2,), 2.0)}, str(v2))
    a = ScriptedEngine(["Action: wait()"], update_s=0.05)
    b = ScriptedEngine(["Action: wait()"], update_s=0.05)
    sync = WeightSyncController({"a": a, "b": b}, SyncConfig())
    await sync.apply(_model_version(v1, 1))
    assert a.version == b.version == 1

    # Held at version 1: a newer version reaches the other engine only.
    async with sync.hold(_model_version(v1, 1), timeout_s=5.0) as (held_id, held):
        assert held.version == 1
        updates = await sync.apply(_model_version(v2, 2))
        assert [u.engine_id for u in updates] == ["b" if held_id == "a" else "a"]
        assert held.version == 1
        # The other engine cannot be held at version 1 any more: it is loaded back for a second evaluation.
        async with sync.hold(_model_version(v1, 1), timeout_s=5.0) as (second_id, second):
            assert second_id != held_id and second.version == 1
            # Every engine held: nothing is left for a third, and a newer version waits for the holds.
            with pytest.raises(NoEngineAtVersionError, match="every engine is held"):
                async with sync.hold(_model_version(v2, 2), timeout_s=5.0):
                    pass
            assert await sync.apply(_model_version(v2, 2)) == []
    # Released: both go to the newest version.
    assert {u.engine_id for u in await sync.apply(_model_version(v2, 2))} == {"a", "b"}
    assert a.version == b.version == 2

    # The start checkpoint is never loaded back: with every engine past version 0 the hold is refused.
    with pytest.raises(NoEngineAtVersionError, match="version 0"):
        async with sync.hold(None, timeout_s=5.0):
            pass


@pytest.mark.unit
async def test_an_engine_lent_to_an_evaluation_takes_no_training_until_it_is_back_at_the_rollout_version(
    tmp_path: Path,
) -> None:
    v1, v2, v3 = (tmp_path / f"v{v}.safetensors" for v in (1, 2, 3))
    for version, path in enumerate((v1, v2, v3), 1):
        save_file({"w": torch.full((2,), float(version))}, str(path))
    engines = {n: ScriptedEngine(["Action: wait()"], update_s=0.05) for n in ("a", "b")}
    sync = WeightSyncController(dict(engines), SyncConfig())
    router = EngineRouter(dict(engines), admits=sync.serves_training)
    await sync.apply(_model_version(v2, 2))
    assert sync.rollout_version == 2

    def routed() -> set[str]:
        return {router.engine_id(engine) for _ in range(8) if (engine := router.try_pick()) is not None}

    async with sync.hold(_model_version(v1, 1), timeout_s=5.0) as (held_id, held):
        other = "b" if held_id == "a" else "a"
        assert held.version == 1 and not sync.serves_training(held_id)
        assert routed() == {other}
    # Released at version 1 and serving, yet no training reaches it before it is back at version 2.
    assert held.state is EngineState.SERVING and held.version == 1
    assert not sync.serves_training(held_id) and routed() == {other}
    [update] = await sync.apply(_model_version(v2, 2))
    assert update.engine_id == held_id and update.ok and held.version == 2
    assert sync.serves_training(held_id) and routed() == {"a", "b"}
    # Held at the rollout version itself, it serves training beside the evaluation until a newer version.
    async with sync.hold(_model_version(v2, 2), timeout_s=5.0) as (held_id, held):
        other = "b" if held_id == "a" else "a"
        assert held.version == 2 and routed() == {"a", "b"}
        [update] = await sync.apply(_model_version(v3, 3))
        assert update.engine_id == other and held.version == 2 and routed() == {other}
    assert not sync.serves_training(held_id) and routed() == {other}
    [update] = await sync.apply(_model_version(v3, 3))
    assert update.engine_id == held_id and routed() == {"a", "b"}


@pytest.mark.integration
async def test_an_engine_released_by_an_evaluation_is_brought_back_by_the_watching_sync(
    bus: Bus, tmp_path: Path
) -> None:
    state = await ensure_topology(bus)
    v1, v2 = tmp_path / "v1.safetensors", tmp_path / "v2.safetensors"
    save_file({"w": torch.ones(2)}, str(v1))
    save_file({"w": torch.full((2,), 2.0)}, str(v2))
    engines = {n: ScriptedEngine(["Action: wait()"], update_s=0.05) for n in ("a", "b")}
    sync = WeightSyncController(dict(engines), SyncConfig())
    try:
        await sync.start(state)
        await state.put(LATEST_MODEL_KEY, _model_version(v2, 2))
        await wait_until(lambda: all(e.version == 2 for e in engines.values()))
        async with sync.hold(_model_version(v1, 1), timeout_s=5.0) as (held_id, held):
            assert held.version == 1
        assert not sync.serves_training(held_id)
        await wait_until(lambda: sync.serves_training(held_id))
        assert held.version == 2 and held.loaded[-1] == v2
    finally:
        await sync.stop()
