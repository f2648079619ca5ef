"""Valid sample messages of every kind, for tests of the contract and of the services built on it."""

from __future__ import annotations

import asyncio
import io
import struct
import time
import zlib
from typing import TYPE_CHECKING, TypeVar

from dart.protocol import messages as m

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")


def tiny_png(width: int = 2, height: int = 2) -> bytes:
    """A valid grayscale PNG built by hand (no imaging library needed)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(range(width)) for _ in range(height))
    buf = io.BytesIO()
    buf.write(m.observation.PNG_SIGNATURE)
    buf.write(chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)))
    buf.write(chunk(b"IDAT", zlib.compress(raw)))
    buf.write(chunk(b"IEND", b""))
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """The first bytes of a PNG declaring ``width`` x ``height`` and nothing after: what a decompression
    bomb's start looks like to a reader that checks the header before decoding."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        m.observation.PNG_SIGNATURE
        + struct.pack(">I", 13)
        + b"IHDR"
        + ihdr
        + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    )


SHA = "ab" * 32
TASK = m.TaskSpec(task_id="sim/click/1", backend="sim", instruction="Click OK", params={"target": "OK", "n": 3})
OBS = m.Observation(
    screenshot=m.InlineImage(png=tiny_png(), width=2, height=2), text="Click OK", metadata={"step": 0, "title": "w"}
)
OBS_REF = m.Observation(screenshot=m.ImageRef(uri="s3://b/k.png", sha256=SHA, width=640, height=480))

ACTIONS: list[m.Action] = [
    m.Click(x=0.1, y=0.9),
    m.DoubleClick(x=0.0, y=1.0),
    m.RightClick(x=0.5, y=0.5),
    m.Drag(x1=0.1, y1=0.2, x2=0.3, y2=0.4),
    m.Type(text="hello\n"),
    m.Hotkey(keys=("ctrl", "c")),
    m.Scroll(x=0.5, y=0.5, direction=m.ScrollDirection.DOWN, amount=3),
    m.Wait(seconds=0.5),
    m.Finished(content="done"),
    m.Fail(reason="infeasible"),
]


def step(index: int = 0, version: int = 3) -> m.StepRecord:
    return m.StepRecord(
        index=index,
        policy_version=version,
        observation=OBS,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5],
        response_logprobs=[-0.1, -2.5],
        response_entropy=[0.3, 1.2],
        response_text="Action: click(start_box='(10,20)')",
        action=m.Click(x=0.01, y=0.02),
        timings=m.StepTimings(generate_s=0.2, env_s=0.1, total_s=0.31),
    )


def all_messages() -> list[m.Message]:
    """One valid instance of every top-level message kind."""
    return [*_env_messages(), *_pipeline_messages(), *_model_messages()]


def _env_messages() -> list[m.Message]:
    """The env service's requests and replies (and the error reply every service may send)."""
    return [
        m.ErrorReply(code=m.ErrorCode.NOT_FOUND, message="no such lease", details={"lease_id": "x"}),
        m.LeaseRequest(holder="runner-1", ttl_s=30.0, task_id="sim/click/1"),
        m.LeaseReply(
            lease_id="l1",
            instance_id="sim-0",
            backend="sim",
            expires_at=100.0,
            heartbeat_interval_s=5.0,
            screen_width=640,
            screen_height=480,
        ),
        m.HeartbeatRequest(lease_id="l1"),
        m.HeartbeatReply(expires_at=130.0),
        m.ResetRequest(lease_id="l1", task=TASK, seed=7),
        m.ResetReply(observation=OBS, instruction="Click OK", env_latency_s=0.01),
        *[m.StepRequest(lease_id="l1", action=a, step_index=i) for i, a in enumerate(ACTIONS)],
        m.StepReply(observation=OBS_REF, done=False, env_latency_s=0.2, info={"k": 1.5}),
        m.EvaluateRequest(lease_id="l1"),
        m.EvaluateReply(reward=1.0, success=True, env_latency_s=0.0),
        m.ReleaseRequest(lease_id="l1", reason="done"),
        m.ReleaseReply(released=True),
        m.CapabilitiesRequest(),
        m.EnvCapabilities(
            pool="osworld", backend="osworld", provider="docker", features=("app:chrome", "step:execute")
        ),
    ]


def _pipeline_messages() -> list[m.Message]:
    """What flows from work to training: a work item, its trajectory, a batch of its samples."""
    work = m.WorkItem(
        work_id="w1", task=TASK, group_id="g1", rollout_index=1, group_size=4, max_steps=10, created_at=1.5e9
    )
    traj = m.Trajectory(
        trajectory_id="t1",
        work_id="w1",
        task=TASK,
        group_id="g1",
        rollout_index=1,
        group_size=4,
        steps=[step(0, 3), step(1, 4)],
        status=m.TrajectoryStatus.OK,
        reward=1.0,
        success=True,
        min_policy_version=3,
        max_policy_version=4,
        started_at=10.0,
        finished_at=12.0,
    )
    sample = m.TrainingSample(
        trajectory_id="t1",
        step_index=0,
        group_id="g1",
        task_id="sim/click/1",
        advantage=0.7,
        reward=1.0,
        policy_version=3,
        prompt_token_ids=[1, 2],
        response_token_ids=[3],
        rollout_logprobs=[-0.5],
        images=[m.ImageRef(uri="file:///tmp/a.png", sha256=SHA, width=4, height=4)],
    )
    batch = m.TrainingBatch(
        batch_id="b1", samples=[sample], group_ids=["g1"], min_policy_version=3, max_policy_version=3, created_at=1.0
    )
    return [work, traj, batch]


def _model_messages() -> list[m.Message]:
    """A published model version, and an evaluation of it requested and answered."""
    return [
        m.ModelVersion(version=5, uri="s3://w/v5.safetensors", sha256=SHA, created_at=2.0, size_bytes=10),
        m.EvalRequest(
            label="heldout-v5",
            version=5,
            tasks=[TASK],
            pool="heldout",
            episodes_per_task=2,
            sampling=m.Sampling(temperature=0.0),
            concurrency=2,
        ),
        m.EvalResult(
            label="heldout-v5",
            policy_version=5,
            sampling=m.Sampling(temperature=0.0),
            episodes_per_task=2,
            tasks=[m.EvalTaskOutcome(task_id=TASK.task_id, n=2, successes=1, errors=0, mean_steps=2.5)],
            seconds=3.0,
            statuses={"ok": 2},
            engine_id="engine-0",
            engine="hf on cuda (bfloat16)",
        ),
    ]


def wait_for(predicate: Callable[[], T], what: str, timeout_s: float = 30.0) -> T:
    """Poll ``predicate`` every 50 ms until it returns something truthy, and return that (for tests outside
    an event loop; :func:`wait_until` inside one).

    Raises:
        AssertionError: It did not within ``timeout_s``, naming ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)
    return value


async def wait_until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``cond`` every 50 ms until it holds (tests wait on conditions, not on guessed durations).

    Raises:
        AssertionError: It did not hold within ``timeout_s`` (generous: tests run on busy machines).
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.05)


def kill_process_tree(root: int) -> int:
    """Freeze process ``root`` and every descendant, then SIGKILL them all, so none gets to clean up (a machine's
    loss, as end-to-end tests stage it); how many processes were killed. Linux only (reads ``/proc``)."""
    import contextlib
    import os
    import signal
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    return len(tree)
