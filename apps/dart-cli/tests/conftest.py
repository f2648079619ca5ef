"""Run directories for the ``dart view`` tests, written by dart-data itself: its index
(:class:`~dart.data.index.TrajectoryIndex`) and its blobs (:class:`~dart.data.blobs.TrajectoryBlobs`) in a
local store, trajectories built from the real message models."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PIL import Image

from dart.data.blobs import StoredTrajectory, TrajectoryBlobs
from dart.data.index import TrajectoryIndex, trajectory_row
from dart.protocol import messages as m
from dart.runtime.store import LocalStore
from dart.runtime.telemetry import BusyTracker, Telemetry, TelemetryConfig, setup_telemetry

SCREEN = (320, 180)
"""Observation screenshots' size (the screen the env acted on)."""
FED = (64, 36)
"""The images fed to the policy (resized, as a runner records them)."""


def png(width: int, height: int, shade: int) -> bytes:
    """A PNG of one grey level (``shade`` tells steps apart, so each has its own stored image)."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (shade, shade, 255 - shade)).save(out, format="PNG")
    return out.getvalue()


def make_step(index: int, version: int, action: m.Action, *, shade: int) -> m.StepRecord:
    """A step with an observation screenshot at :data:`SCREEN` and its :data:`FED` copy fed to the prompt."""
    shot = m.InlineImage(png=png(*SCREEN, shade), width=SCREEN[0], height=SCREEN[1])
    fed = m.InlineImage(png=png(*FED, shade), width=FED[0], height=FED[1])
    return m.StepRecord(
        index=index,
        policy_version=version,
        observation=m.Observation(screenshot=shot, text="Click OK"),
        prompt_token_ids=[1, 2, 3, index],
        prompt_images=[fed],
        response_token_ids=[40, 41, 42],
        response_logprobs=[-0.01, -1.5, -4.0],
        response_entropy=[0.1, 0.9, 2.0],
        response_text=f"Thought: step {index}.\nAction: {action.kind}",
        action=action,
        timings=m.StepTimings(generate_s=0.25, env_s=0.05, total_s=0.31),
    )


def make_traj(
    tid: str,
    gid: str,
    idx: int,
    *,
    reward: float = 0.0,
    version: int = 1,
    task_id: str = "sim/click/1",
    status: m.TrajectoryStatus = m.TrajectoryStatus.OK,
    actions: tuple[m.Action, ...] = (m.Click(x=0.25, y=0.75),),
    size: int = 4,
) -> m.Trajectory:
    """A trajectory with one step per action; ``success`` is ``reward > 0``."""
    task = m.TaskSpec(task_id=task_id, backend="sim", instruction="Click the OK button.")
    return m.Trajectory(
        trajectory_id=tid,
        work_id=f"w-{tid}",
        task=task,
        group_id=gid,
        rollout_index=idx,
        group_size=size,
        steps=[make_step(i, version, a, shade=(7 * idx + 31 * i) % 256) for i, a in enumerate(actions)],
        status=status,
        reward=reward,
        success=reward > 0,
        min_policy_version=version,
        max_policy_version=version,
        started_at=1_790_000_000.0 + idx,
        finished_at=1_790_000_004.5 + idx,
        runner_id="runner-1",
        env_instance_id="sim-0",
    )


@dataclass
class ViewRun:
    """A run directory being written: its index and store, and what was stored."""

    run_dir: Path
    index: TrajectoryIndex
    blobs: TrajectoryBlobs
    stored: dict[str, StoredTrajectory] = field(default_factory=dict)

    def add(self, traj: m.Trajectory) -> StoredTrajectory:
        """Ingest ``traj`` as the data manager does: blobs first, then the index row."""
        stored = self.blobs.put(traj)
        self.index.store_trajectory(trajectory_row(stored), None, self.blobs.shared_image_keys(stored.trajectory))
        self.stored[traj.trajectory_id] = stored
        return stored

    def path_of(self, key: str) -> Path:
        """The file of a store key."""
        return self.run_dir / "artifacts" / key


def new_run(run_dir: Path, database_url: str | None = None) -> ViewRun:
    """An empty run directory (config.yaml, index, local store); the index at ``database_url`` when given."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("run:\n  name: view-test\n")
    index = TrajectoryIndex(database_url or f"sqlite:///{run_dir / 'data.sqlite3'}")
    index.migrate()
    return ViewRun(run_dir, index, TrajectoryBlobs(LocalStore(run_dir / "artifacts")))


GROUP_REWARDS = (1.0, 0.0, 0.0, 1.0)
"""Rewards of group ``g-a``'s four stored rollouts."""


def fill_standard(run: ViewRun) -> None:
    """Group ``g-a`` (five work items, four rollouts stored, two successes, every action kind in rollout 0),
    group ``g-b`` (one aborted, one failed, one truncated at version 2 of another task), a pooled success,
    a pruned trajectory and two rejections."""
    items = [
        m.WorkItem(
            work_id=f"w-traj-g-a-{i}",
            task=m.TaskSpec(task_id="sim/click/1", backend="sim", instruction="Click the OK button."),
            group_id="g-a",
            rollout_index=i,
            group_size=5,
            max_steps=8,
            created_at=1_790_000_000.0,
        )
        for i in range(5)  # the fifth rollout never arrives
    ]
    run.index.record_work(items)
    all_actions: tuple[m.Action, ...] = (
        m.Click(x=0.25, y=0.75),
        m.Drag(x1=0.1, y1=0.2, x2=0.6, y2=0.8),
        m.Type(text="hello\n"),
        m.Hotkey(keys=("ctrl", "c")),
        m.Scroll(x=0.5, y=0.5, direction=m.ScrollDirection.DOWN, amount=3),
        m.Finished(content="done"),
    )
    for i, reward in enumerate(GROUP_REWARDS):
        actions = all_actions if i == 0 else (m.Click(x=0.25, y=0.75),)
        run.add(make_traj(f"traj-g-a-{i}", "g-a", i, reward=reward, actions=actions, size=5))
    run.add(make_traj("traj-g-b-0", "g-b", 0, status=m.TrajectoryStatus.ABORTED, actions=()))
    run.add(make_traj("traj-g-b-1", "g-b", 1, status=m.TrajectoryStatus.FAILED, actions=()))
    run.add(make_traj("traj-g-b-2", "g-b", 2, status=m.TrajectoryStatus.TRUNCATED, version=2, task_id="sim/type/2"))
    run.index.add_to_pool("traj-g-a-3", "sim/click/1", keep=4)
    run.index.mark_pruned(["traj-g-a-2"])
    run.index.record_rejection("trajectories", 7, "unknown_work", "never emitted", trajectory_id="x")
    run.index.record_rejection("trajectories", 8, "unknown_work", "never emitted", trajectory_id="y")


class FakeClock:
    """Unix ns that only moves when told to, starting now (so it brackets the real events)."""

    def __init__(self) -> None:
        self.now = time.time_ns()

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


def write_telemetry(run_dir: Path, clock: FakeClock) -> None:
    """40 s of a run's telemetry in ``run_dir/telemetry``, written by the services' own writer: 3 env
    instances, an engine and a trainer busy on a fake clock, 10 trainer steps, 5 versions published, two
    held-out evaluations, engine updates and the data manager's stats."""

    def tel(service: str) -> Telemetry:
        config = TelemetryConfig(jsonl_path=run_dir / "telemetry" / f"{service}.jsonl")
        return setup_telemetry(f"dart-{service}", version="0", run_id="r1", config=config)

    env, rollout, data, train = tel("env"), tel("rollout"), tel("data"), tel("train")
    validation = tel("validation")
    # Held-out evaluations at versions 0 and 5, as dart run's validator writes them.
    validation.event("validation.heldout", version=0, success=0.25, ci95_low=0.13, ci95_high=0.42, n=32, errors=0)
    validation.event("validation.heldout", version=5, success=0.5, ci95_low=0.34, ci95_high=0.66, n=32, errors=0)
    envs = [BusyTracker("env", f"env-{i}", env, clock=clock) for i in range(3)]
    engine = BusyTracker("engine", "engine-0", rollout, clock=clock)
    trainer = BusyTracker("trainer", "trainer", train, clock=clock)
    t0 = clock.now / 1e9
    for step in range(1, 11):
        tokens = [e.begin("step") for e in envs[: 1 + step % 3]]
        gen = engine.begin("generate")
        clock.advance(2.0)
        for e, tok in zip(envs, tokens, strict=False):
            e.end(tok)
        engine.end(gen)
        with trainer.busy("train_step"):
            clock.advance(1.0)
        clock.advance(1.0)
        data.event("data.batch", batch_id=f"b{step}", samples=8, groups=2, staleness=step % 3)
        train.event(
            "trainer.step",
            step=step,
            loss=1.0 / step,
            clip_fraction=0.1,
            tis_weight_mean=0.95,
            tis_truncated_fraction=0.01,
            grad_norm=2.0,
            rollout_mismatch=0.02,
            entropy=1.5 - step / 10,
            max_policy_lag=step % 2,
        )
        if step % 2 == 0:
            version = step // 2
            train.event(
                "trainer.published",
                version=version,
                uri=f"file:///w/{version}",
                sha256="0",
                step=step,
                bytes=59_792,
                kind="lora adapter",
                adapter_rank=8,
            )
            at = clock.now / 1e9
            for engine_id in ("engine-0", "engine-1"):
                rollout.event("engine.update.start", engine_id=engine_id, version=version, ts=at)
                rollout.event(
                    "engine.update.end",
                    engine_id=engine_id,
                    version=version,
                    ts=at + 0.5,
                    started_at=at,
                    ok=engine_id == "engine-0" or version < 5,
                    error="",
                )
    # An update the run ended in the middle of: drawn up to the end of the run.
    rollout.event("engine.update.start", engine_id="engine-1", version=6, ts=clock.now / 1e9 - 4.0)
    data.event("data.stats", received=42, stored=40, duplicates=2, drops={"stale": 3}, outstanding=0)
    assert clock.now / 1e9 - t0 == pytest.approx(40.0)
    for t in (env, rollout, data, train):
        t.shutdown()


@pytest.fixture
def view_run(tmp_path: Path) -> Iterator[ViewRun]:
    """A run directory holding :func:`fill_standard`'s trajectories (its writing index closed afterwards)."""
    run = new_run(tmp_path / "run")
    fill_standard(run)
    yield run
    run.index.close()


@dataclass(frozen=True)
class ViewKit:
    """This module's builders and sizes, for the test modules (which cannot import a conftest)."""

    new_run: Callable[..., ViewRun] = new_run
    make_traj: Callable[..., m.Trajectory] = make_traj
    fill_standard: Callable[[ViewRun], None] = fill_standard
    screen: tuple[int, int] = SCREEN
    fed: tuple[int, int] = FED
    group_rewards: tuple[float, ...] = GROUP_REWARDS
    clock: Callable[[], FakeClock] = FakeClock
    write_telemetry: Callable[[Path, FakeClock], None] = write_telemetry


@pytest.fixture
def kit() -> ViewKit:
    return ViewKit()
