"""Factories of realistic trajectories for the dart-data tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from dart.protocol import messages as m
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.testing import SHA, TASK, tiny_png
from dart.runtime.topology import ensure_topology

MakeTraj = Callable[..., m.Trajectory]


def make_step(index: int, version: int, *, shot: int = 0, entropy: float = 0.5, empty: bool = False) -> m.StepRecord:
    """A step whose screenshot differs per ``shot`` (a PNG of width ``shot + 2``), fed to its prompt as is
    (inline, as a runner records it; dart-data stores it at ingestion)."""
    tokens = [] if empty else [4, 5]
    screenshot = m.InlineImage(png=tiny_png(shot + 2, 2), width=shot + 2, height=2)
    return m.StepRecord(
        index=index,
        policy_version=version,
        observation=m.Observation(screenshot=screenshot),
        prompt_token_ids=[1, 2, 3, index],
        prompt_images=[screenshot],
        response_token_ids=tokens,
        response_logprobs=[-0.1 * (index + 1)] * len(tokens),
        response_entropy=[entropy] * len(tokens),
        response_text="Action: click(start_box='(10,20)')",
        action=m.Click(x=0.01, y=0.02),
    )


def make_traj(
    tid: str,
    gid: str = "g",
    idx: int = 0,
    size: int = 2,
    reward: float = 0.0,
    version: int = 3,
    steps: int = 2,
    task: m.TaskSpec = TASK,
    status: m.TrajectoryStatus = m.TrajectoryStatus.OK,
    entropies: list[float] | None = None,
    work_id: str | None = None,
) -> m.Trajectory:
    """A trajectory of ``steps`` steps with distinct screenshots; ``success`` is ``reward > 0``; its work
    id is ``w-<tid>`` unless given (an emitting data manager accepts only work it emitted)."""
    ents = entropies or [0.5] * steps
    return m.Trajectory(
        trajectory_id=tid,
        work_id=work_id or f"w-{tid}",
        task=task,
        group_id=gid,
        rollout_index=idx,
        group_size=size,
        steps=[make_step(i, version, shot=i, entropy=ents[i]) for i in range(steps)],
        status=status,
        reward=reward,
        success=reward > 0,
        min_policy_version=version,
        max_policy_version=version,
        started_at=10.0,
        finished_at=12.0 + idx,
        runner_id="runner-1",
        env_instance_id="sim-0",
    )


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    """A bus on a run of its own, its topology made and version 3 announced (what the trajectories here carry)."""
    async with await Bus.connect(BusConfig(url=nats_url, run=f"data{uuid.uuid4().hex[:8]}")) as bus:
        state = await ensure_topology(bus)
        model = m.ModelVersion(version=3, uri="file:///w/v3.safetensors", sha256=SHA, created_at=1.0)
        await state.put(LATEST_MODEL_KEY, model)
        yield bus


@pytest.fixture
def traj_factory() -> MakeTraj:
    return make_traj


@pytest.fixture
def step_factory() -> Callable[..., m.StepRecord]:
    return make_step


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """SQLAlchemy URL of an empty index database: a SQLite file, or a fresh database on the
    session's embedded PostgreSQL server (skipped, with the reason, only where it is not installed)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'data.sqlite3'}"
    return str(request.getfixturevalue("postgres_url"))
