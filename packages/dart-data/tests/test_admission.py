"""Ingestion checks meaning: a live data service (real nats-server with one user per role, a local store,
SQLite) refuses each kind of meaningless trajectory the rollout role can publish, records and counts it,
and trains on the real work as if it were not there; the record of emitted work survives a restart."""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dart.data.config import BatchingConfig, CurationConfig, DataConfig, DecoupledConfig, EmissionConfig, GroupingConfig
from dart.data.service import DataService
from dart.embedded.nats import EmbeddedNats, NatsUser
from dart.protocol import messages as m
from dart.protocol.permissions import service_permissions
from dart.protocol.topology import ROLES, Role
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.store import LocalStore
from dart.runtime.telemetry import TelemetryConfig, read_jsonl, setup_telemetry
from dart.runtime.testing import TASK, wait_until
from dart.runtime.topology import durable_name, ensure_topology

pytestmark = pytest.mark.integration

PREFIX, RUN = "dart.v1", "admission"
SHA0 = "0" * 64


@pytest.fixture(scope="module")
def secure_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, dict[str, Path]]]:
    """A nats-server with one password-protected user per role, as ``dart run`` starts it."""
    secrets_dir = tmp_path_factory.mktemp("secrets")
    files = {role: secrets_dir / f"{role}.password" for role in ROLES}
    for path in files.values():
        path.write_text(secrets.token_urlsafe(24))
    users = [NatsUser(role, files[role], service_permissions(role, PREFIX, RUN)) for role in ROLES]
    with EmbeddedNats(users=users) as server:
        yield server, files


async def connect(secure: tuple[EmbeddedNats, dict[str, Path]], role: Role) -> Bus:
    server, files = secure
    return await Bus.connect(BusConfig(url=server.url, prefix=PREFIX, run=RUN, user=role, password_file=files[role]))


def data_config(tmp_path: Path) -> DataConfig:
    return DataConfig(
        database_url=f"sqlite:///{tmp_path / 'data.sqlite3'}",
        grouping=GroupingConfig(timeout_s=60, poll_interval_s=0.05),
        curation=CurationConfig(default_rollouts=2, min_rollouts=2, max_rollouts=2),
        emission=EmissionConfig(max_groups=3, decoupled=DecoupledConfig(max_outstanding=6, poll_interval_s=0.05)),
        batching=BatchingConfig(min_samples=8, max_groups=8),
    )


def unchecked(model: type[Any], base: Any, **changes: Any) -> Any:
    """A copy of a message that skips validation: what a faulty publisher can put on the wire."""
    return model.model_construct(**{**dict(base), **changes})


async def test_meaningless_trajectories_are_rejected_counted_and_kept_out(  # type: ignore[no-untyped-def]
    secure_nats: tuple[EmbeddedNats, dict[str, Path]], tmp_path: Path, traj_factory
) -> None:
    store = LocalStore(tmp_path / "store")
    telemetry = setup_telemetry("dart-data", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    data, rollout = await connect(secure_nats, "data"), await connect(secure_nats, "rollout")
    async with await connect(secure_nats, "run") as run:  # the run's topology: the services only bind to it
        await ensure_topology(run)
    subject = rollout.subjects.stream_subject("traj")

    async def publish(traj: m.Trajectory) -> None:
        await rollout.js_publish(subject, traj, msg_id=f"{traj.trajectory_id}-{traj.work_id}-{traj.reward}")

    service = DataService(data_config(tmp_path), data, store, [TASK], telemetry)
    await service.start()
    runner = await rollout.pull_consumer("work", durable_name(rollout, "work"), m.WorkItem)
    work: list[m.WorkItem] = []
    while len(work) < 6:
        for delivery in await runner.fetch(6 - len(work), timeout=5):
            work.append(delivery.message)
            await delivery.ack()
    work.sort(key=lambda w: (w.group_id, w.rollout_index))
    answered = work[:4]  # two whole groups; the third stays open for after the restart

    def good(w: m.WorkItem, reward: float) -> m.Trajectory:
        return traj_factory(f"t-{w.work_id}", gid=w.group_id, idx=w.rollout_index, reward=reward, work_id=w.work_id)

    # Each real work item is first answered by a meaningless trajectory (refused, so the real one after it is
    # the item's only answer).
    base = good(answered[0], 1.0)
    missing = m.ImageRef(uri=store.uri("nowhere/none.png"), sha256=SHA0, width=2, height=2)
    foreign = m.ImageRef(uri="file:///etc/hostname", sha256=SHA0, width=2, height=2)
    climbing = m.ImageRef(uri=store.uri("x")[:-1] + "../../etc/hostname", sha256=SHA0, width=2, height=2)
    bad_step = base.steps[0]
    bad = {
        "reward_out_of_range": good(answered[0], 1.0).model_copy(update={"reward": 2.0}),
        "success_contradicts": good(answered[1], 0.0).model_copy(update={"success": True}),
        "logprob_positive": good(answered[2], 1.0).model_copy(
            update={"steps": [bad_step.model_copy(update={"response_logprobs": [0.5, -0.1]}), *base.steps[1:]]}
        ),
        "missing_image": good(answered[3], 0.0).model_copy(
            update={"steps": [bad_step.model_copy(update={"prompt_images": [missing]}), *base.steps[1:]]}
        ),
        # A reference to a host file (it exists, but not in the run's store), and one that climbs out of it.
        "foreign_image": good(answered[0], 1.0).model_copy(
            update={"steps": [bad_step.model_copy(update={"prompt_images": [foreign]}), *base.steps[1:]]}
        ),
        "climbing_image": good(answered[1], 1.0).model_copy(
            update={"steps": [bad_step.model_copy(update={"prompt_images": [climbing]}), *base.steps[1:]]}
        ),
    }
    for kind, traj in bad.items():
        await publish(traj.model_copy(update={"trajectory_id": f"bad-{kind}"}))
    for i, w in enumerate(answered):
        await publish(good(w, float(i % 2 == 0)))
    # A second answer to an answered work item; work this run never emitted; a work item's id on another
    # group; and messages no schema accepts (a NaN log-prob, more log-probs than tokens).
    await wait_until(lambda: service.stats.stored == 4)
    await publish(good(answered[0], 0.0).model_copy(update={"trajectory_id": "second-answer"}))
    await publish(good(answered[1], 1.0).model_copy(update={"trajectory_id": "foreign", "work_id": "g-other-run-0"}))
    await publish(good(answered[2], 1.0).model_copy(update={"trajectory_id": "moved", "group_id": work[4].group_id}))
    nan_step = unchecked(m.StepRecord, bad_step, response_logprobs=[float("nan"), -0.1])
    long_step = unchecked(m.StepRecord, bad_step, response_logprobs=[-0.1, -0.1, -0.1])
    for tid, step in (("nan", nan_step), ("misaligned", long_step)):
        await publish(unchecked(m.Trajectory, base, trajectory_id=tid, steps=[step]))

    expected = Counter(
        {
            "reward_out_of_range": 1,
            "success_contradicts": 1,
            "logprob_positive": 1,
            "missing_image": 1,
            "foreign_image": 2,
            "duplicate_work": 1,
            "unknown_work": 1,
            "work_mismatch": 1,
            "logprob_not_finite": 1,
            "misaligned_arrays": 1,
        }
    )
    await wait_until(lambda: service.stats.rejected == expected and service.stats.batches == 1)
    stats = service.stats
    # The real work trained as if nothing else came: 2 groups x 2 trajectories x 2 steps, one batch.
    assert (stats.stored, stats.samples, stats.groups_emitted) == (4, 8, 2)
    assert stats.task_success == {TASK.task_id: 0.5} and service.state.task_stats[TASK.task_id].attempts == 4
    state = service.state
    for tid in ["second-answer", "foreign", "moved", *(f"bad-{kind}" for kind in bad)]:
        assert await state.db(state.index.trajectory, tid) is None
    # Every message on the stream is either stored or recorded as rejected: nothing is lost.
    produced = (await data.stream_state("traj")).messages
    assert produced - stats.stored - sum(stats.rejected.values()) == 0
    assert await state.db(state.index.rejections) == expected
    await service.stop()

    # After a restart the record of emitted work still decides: the open group's items are this run's,
    # made-up work is not, and the counts carry over.
    again = DataService(data_config(tmp_path), data, store, [TASK], telemetry)
    await again.start()
    assert again.stats.rejected == expected
    for i, w in enumerate(work[4:]):
        await publish(good(w, float(i)))
    await publish(good(work[4], 1.0).model_copy(update={"trajectory_id": "foreign-2", "work_id": "g-made-up-1"}))
    await wait_until(
        lambda: again.stats.stored == 2 and sum(again.stats.rejected.values()) == sum(expected.values()) + 1
    )
    assert again.stats.rejected["unknown_work"] == 2
    await again.stop()
    await runner.close()
    telemetry.shutdown()
    events = [
        r["attributes"] for r in read_jsonl(telemetry.jsonl_path, types={"event"}) if r["name"] == "data.rejected"
    ]
    assert sorted(e["reason"] for e in events) == sorted([*expected.elements(), "unknown_work"])
    await rollout.close()
    await data.close()
