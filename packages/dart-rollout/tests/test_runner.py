"""The trajectory runner against a real env service (sim backend) and real or scripted engines.

``ScriptedEngine`` is a legitimate deterministic engine (see :mod:`dart.rollout.service.scripted`):
it drives the runner's status logic with oracle-like outputs; bus and env service are real.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.env.sim import LatencyConfig, SimConfig, sim_task
from dart.policy.config import PromptConfig
from dart.policy.prompt import ChatPrompt, encode_prompt
from dart.policy.screen import ResizeRule
from dart.protocol.messages import (
    BranchOrigin,
    BranchSpec,
    Click,
    InlineImage,
    PrefixStep,
    Trajectory,
    TrajectoryStatus,
    WorkItem,
)
from dart.protocol.messages.codec import decode, encode
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import GenerationRequest
from dart.rollout.errors import EngineError
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.runner import TrajectoryRunner
from dart.rollout.service.scripted import ScriptedEngine
from dart.runtime.bus import Bus
from dart.runtime.telemetry import TelemetryConfig, read_jsonl, setup_telemetry

pytestmark = pytest.mark.integration


def runner_for(bus: Bus, pool: str, *engines: Any, **config: Any) -> TrajectoryRunner:
    return TrajectoryRunner("runner-t", bus, EngineRouter(list(engines)), RunnerConfig(pool=pool, **config))


async def test_hf_engine_trajectory_has_aligned_versioned_steps(
    bus: Bus, env_pool: Callable[..., Any], work_item: Callable[..., WorkItem], checkpoint: Path, tmp_path: Path
) -> None:
    pool = await env_pool()
    telemetry = setup_telemetry("dart-rollout", version="t", run_id="t", config=TelemetryConfig(run_dir=tmp_path))
    engine = await HFEngine.start(HFEngineConfig(model_path=str(checkpoint), num_threads=2, batch_wait_s=0.0))
    try:
        runner = runner_for(bus, pool, engine, max_new_tokens=24, prompt=PromptConfig(max_images=2))
        item = work_item(max_steps=3)
        with telemetry.activate():
            trajectory = await runner.run(item)
    finally:
        await engine.close()
    # A random tiny model rarely emits a valid action: most steps are parse errors, and the run
    # ends either by a terminal action (OK) or at max_steps (TRUNCATED); both are evaluated.
    assert trajectory.status in (TrajectoryStatus.OK, TrajectoryStatus.TRUNCATED), trajectory.error
    assert trajectory.work_id == item.work_id and trajectory.runner_id == "runner-t"
    assert 1 <= len(trajectory.steps) <= 3
    for i, step in enumerate(trajectory.steps):
        assert step.index == i and step.policy_version == 0
        assert len(step.prompt_token_ids) > 0 and len(step.response_token_ids) >= 1
        assert len(step.response_token_ids) == len(step.response_logprobs) == len(step.response_entropy) <= 24
        assert (step.action is None) != (step.parse_error is None)
        assert step.observation.screenshot is not None
        assert step.timings.generate_s > 0 and step.timings.total_s >= step.timings.generate_s
    assert trajectory.min_policy_version == trajectory.max_policy_version == 0
    assert trajectory.env_instance_id is not None
    # The published shape round-trips through the wire codec.
    assert decode(encode(trajectory), Trajectory) == trajectory
    # One trace: the trajectory span is the parent of env and engine spans (and the bus's requests).
    telemetry.flush()
    spans = [r for r in read_jsonl(telemetry.jsonl_path) if r.get("type") == "span"]
    telemetry.shutdown()
    (root,) = [s for s in spans if s["name"] == "trajectory"]
    children = {s["name"] for s in spans if s["parent_span_id"] == root["span_id"]}
    assert {"env.lease", "env.reset", "engine.generate", "env.evaluate"} <= children
    assert all(s["trace_id"] == root["trace_id"] for s in spans if s["name"].startswith(("env.", "engine.")))
    # Each generate span says how long the request queued for a batch and how long its batch ran.
    for g in (s for s in spans if s["name"] == "engine.generate"):
        a = g["attributes"]
        assert a["dart.generate_s"] > 0 and a["dart.queued_s"] >= 0 and a["dart.batch_size"] >= 1
        assert a["dart.queued_s"] + a["dart.generate_s"] <= g["duration_s"] + 1e-3


async def test_parse_error_is_a_step_without_env_step_then_finished_is_ok(
    bus: Bus, env_pool: Callable[..., Any], work_item: Callable[..., WorkItem]
) -> None:
    pool = await env_pool()
    engine = ScriptedEngine(["Thought: hmm\nAction: dance()", "Action: finished(content='done')"], version=2)
    trajectory = await runner_for(bus, pool, engine).run(work_item(max_steps=5))
    assert trajectory.status is TrajectoryStatus.OK
    first, second = trajectory.steps
    assert first.action is None and first.parse_error and first.timings.env_s == 0.0
    # The observation stays the same after a parse error.
    assert second.observation == first.observation
    assert second.action is not None and second.action.kind == "finished"
    assert trajectory.min_policy_version == trajectory.max_policy_version == 2


async def test_max_steps_truncates_and_env_failure_ends_as_env_failed(
    bus: Bus, env_pool: Callable[..., Any], work_item: Callable[..., WorkItem]
) -> None:
    pool = await env_pool()
    waiting = ScriptedEngine(["Action: wait()"])
    truncated = await runner_for(bus, pool, waiting).run(work_item(max_steps=2))
    assert truncated.status is TrajectoryStatus.TRUNCATED and len(truncated.steps) == 2
    assert [s.action.kind for s in truncated.steps if s.action] == ["wait", "wait"]

    crash_pool = await env_pool(backend="rollout-crash-on-wait")
    failed = await runner_for(bus, crash_pool, ScriptedEngine(["Action: wait()"])).run(work_item(max_steps=3))
    assert failed.status is TrajectoryStatus.ENV_FAILED and failed.reward == 0.0
    assert failed.error and "env_failed" in failed.error and failed.steps == []


async def test_engine_failure_is_failed_and_cancel_is_aborted_with_env_released(
    bus: Bus, env_pool: Callable[..., Any], work_item: Callable[..., WorkItem]
) -> None:
    pool = await env_pool()  # one instance: the abort below must give it back for the next run
    broken = ScriptedEngine(["x"], fail_with=EngineError("CUDA error: device lost"))
    failed = await runner_for(bus, pool, broken).run(work_item())
    assert failed.status is TrajectoryStatus.FAILED and "device lost" in (failed.error or "")

    slow = ScriptedEngine(["Action: wait()"], generate_s=30.0)
    task = asyncio.create_task(runner_for(bus, pool, slow).run(work_item()))
    while slow.load == 0:  # noqa: ASYNC110  (the engine has no event for "request arrived")
        await asyncio.sleep(0.01)
    task.cancel()
    aborted = await task
    assert aborted.status is TrajectoryStatus.ABORTED and not aborted.trainable

    # The one instance was given back: the next lease gets it (a kept instance would time the lease out).
    done = ScriptedEngine(["Action: finished(content='ok')"])
    after = await runner_for(bus, pool, done, lease_timeout_s=60.0).run(work_item())
    assert after.status is TrajectoryStatus.OK


async def test_waits_briefly_for_min_policy_version(
    bus: Bus, env_pool: Callable[..., Any], work_item: Callable[..., WorkItem]
) -> None:
    pool = await env_pool()
    old = ScriptedEngine(["Action: finished(content='a')"])
    new = ScriptedEngine(["Action: finished(content='b')"], update_s=0.2)
    router = EngineRouter({"old": old, "new": new})
    runner = TrajectoryRunner("runner-v", bus, router, RunnerConfig(pool=pool, min_version_wait_s=5.0))
    update = asyncio.create_task(new.update_weights("w", 1))
    new._update_s = 0.0
    trajectory = await runner.run(work_item(min_policy_version=1))
    await update
    # The idle old engine was available all along; the runner waited for the updating one instead.
    assert trajectory.steps[0].policy_version == 1 and old.calls == []


async def test_runner_time_is_accounted_lease_to_release(
    bus: Bus, env_pool: Callable[..., Any], work_item: Callable[..., WorkItem]
) -> None:
    """The runner's tracker (read by the idle breakdown) covers lease wait, the lease and its parts."""
    pool = await env_pool()
    engine = ScriptedEngine(["Action: wait()", "Action: finished(content='done')"])
    runner = runner_for(bus, pool, engine)
    trajectory = await runner.run(work_item(max_steps=5))
    assert trajectory.status is TrajectoryStatus.OK
    intervals = runner.tracker.intervals()
    assert not runner.tracker.is_busy  # the lease section closed after the release
    activities = [i.activity for i in intervals]
    # lease, reset, two (pick, generate, step) rounds, evaluate; "leased" fills the gaps
    calls = [a for a in activities if a != "leased"]
    assert calls[0] == "lease_wait" and calls[1] == "env_call"
    assert calls[-1] == "env_call"  # evaluate
    assert calls.count("generate") == 2 and calls.count("env_call") == 4  # reset, two steps, evaluate
    assert "leased" in activities and activities[-1] == "leased"  # the release, after evaluate
    # Segments of one runner never overlap: totals add up to its busy span exactly.
    assert all(a.end_ns <= b.start_ns for a, b in zip(intervals, intervals[1:], strict=False))


async def test_a_real_resolution_prompt_keeps_the_aspect_and_pixel_coordinates_land_where_the_model_meant(
    bus: Bus, env_pool: Callable[..., Any], work_item: Callable[..., WorkItem]
) -> None:
    """``image_size: model`` + ``coordinates: pixels``: a 1280x720 screen is shown aspect-kept at the
    processor rule's size, and a click the model writes in those pixels becomes the same screen point."""
    pool = await env_pool(sim=SimConfig(latency=LatencyConfig(scale=0.0), width=1280, height=720))
    rule = ResizeRule(3136, 200_704)
    shown: list[tuple[int, int]] = []
    prompts: list[str] = []

    def answer(request: GenerationRequest) -> str:
        w, h = request.prompt.images[-1].size
        shown.append((w, h))
        prompts.append(request.prompt.text)
        return (
            f"Thought: a point.\nAction: click(start_box='({w // 2},{h // 4})')"
            if len(shown) == 1
            else "Action: wait()"
        )

    runner = runner_for(
        bus,
        pool,
        ScriptedEngine([], answer=answer),
        prompt=PromptConfig(
            image_size="model", min_pixels=3136, max_pixels=200_704, coordinates="pixels", max_images=1
        ),
    )
    trajectory = await runner.run(work_item(max_steps=2))
    w, h = rule.size(1280, 720)
    assert shown[0] == (w, h) and abs(w / h - 16 / 9) < 0.1
    first = trajectory.steps[0]
    record = first.prompt_images[0]
    assert isinstance(record, InlineImage) and (record.width, record.height) == (w, h)
    assert first.action == Click(x=(w // 2) / w, y=(h // 4) / h)
    assert "pixels of the current screenshot" in prompts[0] and "0..1000" not in prompts[0]


async def test_a_policy_answering_in_the_ui_tars_format_clicks_what_it_means(
    bus: Bus, env_pool: Callable[..., Any], work_item: Callable[..., WorkItem]
) -> None:
    """UI-TARS-1.5's prompt, answers in pixels of the 448x448 image the policy was shown of a 1280x720 screen:
    a click on the empty top-left corner, then the oracle's click, which the runner maps back to the screen so
    the task succeeds; the second prompt shows the first answer with its point in box tokens, as UI-TARS-1.5
    was trained to see its history."""
    from dart.env.sim import SimEnv
    from dart.policy.action_grammar import format_output

    screen = SimConfig(latency=LatencyConfig(scale=0.0), width=1280, height=720)
    pool = await env_pool(sim=screen)
    item = work_item(max_steps=3)
    oracle = SimEnv(screen)
    await oracle.reset(item.task)
    step = oracle.oracle_action()
    assert step is not None and isinstance(step[1], Click)
    await oracle.close()
    prompts: list[str] = []

    def answer(request: GenerationRequest) -> str:
        prompts.append(request.prompt.text)
        if len(prompts) == 1:
            return "Thought: the corner first.\nAction: click(start_box='(1,1)')"
        shown = request.prompt.images[-1].size
        assert shown == (448, 448)
        return format_output(step[0], step[1], (float(shown[0]), float(shown[1])))

    prompt = PromptConfig(format="ui-tars-1.5", image_size=448, max_images=2)
    trajectory = await runner_for(bus, pool, ScriptedEngine([], answer=answer), prompt=prompt).run(item)
    assert trajectory.status == TrajectoryStatus.OK and trajectory.success, trajectory.steps[0].response_text
    assert prompts[0].startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert "## User Instruction\n" in prompts[0] and "fail(" not in prompts[0]
    assert len(trajectory.steps) == 2 and trajectory.steps[0].action == Click(x=1 / 448, y=1 / 448)
    assert "click(start_box='<|box_start|>(1,1)<|box_end|>')" in prompts[1]  # the first answer, shown back


def _digest(image: Any) -> str:
    assert isinstance(image, InlineImage)
    return hashlib.sha256(image.png).hexdigest()


def _branch_of(parent: Trajectory, step: int, *, wrong_screen: bool = False) -> BranchSpec:
    """The branch the data manager would ask for (:func:`dart.data.branching.branch_spec`), written out here."""
    prefix = [
        PrefixStep(response_text=s.response_text, action=s.action, screenshot_sha256=_digest(s.observation.screenshot))
        for s in parent.steps[:step]
    ]
    at = _digest(parent.steps[step].observation.screenshot)
    return BranchSpec(
        parent_trajectory_id=parent.trajectory_id,
        parent_work_id=parent.work_id,
        step_index=step,
        prefix=prefix,
        screenshot_sha256=hashlib.sha256(b"another screen").hexdigest() if wrong_screen else at,
    )


async def test_a_branch_forks_its_parent_and_its_first_prompt_is_the_parents_at_that_step(
    bus: Bus, env_pool: Callable[..., Any], work_item: Callable[..., WorkItem], checkpoint: Path
) -> None:
    """A branch work item forks the env (a reset that replays the parent's actions, checked screen by screen) and
    rebuilds the parent's history from its outputs and the replayed screens: the first prompt is the parent's
    prompt at the branch step (same text, same images, same token ids), its steps are numbered from there, and a
    fork the env refuses is answered as a normal rollout that says why."""
    from transformers import AutoProcessor

    pool = await env_pool(instances=2)
    prompts: dict[str, list[ChatPrompt]] = {}
    outputs = [
        "Thought: the first box\nAction: click(start_box='(60,70)')",
        "Thought: hmm\nAction: dance()",  # a parse error: no env step, the screen stays
        "Action: click(start_box='(60,100)')",
        "Action: wait()",
    ]

    def answer(request: GenerationRequest) -> str:
        calls = prompts.setdefault(current, [])
        calls.append(request.prompt)
        return outputs[min(len(calls) - 1, len(outputs) - 1)]

    engine = ScriptedEngine([], answer=answer)
    task = sim_task("tick-boxes", "hard", 1)
    runner = runner_for(bus, pool, engine, prompt=PromptConfig(max_images=2))
    root = work_item(max_steps=5).model_copy(update={"task": task})
    current = root.work_id
    parent = await runner.run(root)
    assert parent.status is TrajectoryStatus.TRUNCATED and len(parent.steps) == 5, parent.error
    assert [s.action is None for s in parent.steps[:3]] == [False, True, False]

    branch_work = root.model_copy(update={"work_id": f"{root.work_id}-b3-0", "branch": _branch_of(parent, 3)})
    current = branch_work.work_id
    branch = await runner.run(branch_work)
    assert branch.status is TrajectoryStatus.TRUNCATED and branch.branch_refused is None, branch.error
    assert branch.branch == BranchOrigin(parent_trajectory_id=parent.trajectory_id, step_index=3)
    assert [s.index for s in branch.steps] == [3, 4]
    first, at_parent = prompts[branch_work.work_id][0], prompts[root.work_id][3]
    assert first.text == at_parent.text and first.records == at_parent.records
    assert [im.tobytes() for im in first.images] == [im.tobytes() for im in at_parent.images]
    assert branch.steps[0].prompt_images == parent.steps[3].prompt_images
    assert branch.steps[0].observation == parent.steps[3].observation
    processor = AutoProcessor.from_pretrained(checkpoint, local_files_only=True)
    assert encode_prompt(processor, first).input_ids == encode_prompt(processor, at_parent).input_ids

    refused_work = root.model_copy(
        update={"work_id": f"{root.work_id}-b3-1", "branch": _branch_of(parent, 3, wrong_screen=True)}
    )
    current = refused_work.work_id
    refused = await runner.run(refused_work)
    assert refused.branch is None and refused.branch_refused == "fork_mismatch"
    assert refused.steps[0].index == 0 and refused.steps[0].observation == parent.steps[0].observation
    assert prompts[refused_work.work_id][0].text == prompts[root.work_id][0].text
