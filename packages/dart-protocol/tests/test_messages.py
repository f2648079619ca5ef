"""Schema tests: round trips, strictness, and a decoder that only ever raises its typed error."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from dart.protocol import messages as m
from dart.protocol.errors import MessageValidationError
from dart.runtime.testing import ACTIONS, OBS, TASK, all_messages, step, tiny_png

pytestmark = pytest.mark.unit

MESSAGES = all_messages()
MESSAGE_TYPES = sorted({type(x) for x in MESSAGES}, key=lambda t: t.__name__)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda x: f"{x.kind}")
def test_round_trip_by_type_and_by_union(msg: m.Message) -> None:
    data = m.encode(msg)
    assert m.decode(data, type(msg)) == msg
    assert m.decode(data, m.ANY_MESSAGE) == msg
    assert json.loads(data)["schema_version"] == m.SCHEMA_VERSION


def test_every_top_level_kind_is_covered() -> None:
    union_kinds = {t.model_fields["kind"].default for t in m.AnyMessage.__origin__.__args__}  # type: ignore[attr-defined]
    assert union_kinds == {x.kind for x in MESSAGES}  # type: ignore[attr-defined]


@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: a.kind)
def test_action_round_trip(action: m.Action) -> None:
    assert m.ACTION_ADAPTER.validate_json(m.ACTION_ADAPTER.dump_json(action)) == action


def _mutations(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for key in doc:
        if key == "schema_version":
            continue
        dropped = dict(doc)
        del dropped[key]
        out.append(dropped)
        for bad in (None, "x", 10**30, [], {"a": 1}, -1.5):
            if doc[key] != bad:
                changed = dict(doc)
                changed[key] = bad
                out.append(changed)
    return out


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda x: f"{x.kind}")
def test_structural_mutations_raise_only_typed_error(msg: m.Message) -> None:
    doc = json.loads(m.encode(msg))
    for bad in _mutations(doc):
        try:
            decoded = m.decode(json.dumps(bad), type(msg))
        except MessageValidationError as exc:
            assert exc.expected == type(msg).__name__
            continue
        # A mutation may still be valid (e.g. dropping a field that has a default): then it must
        # round-trip like any valid message.
        assert m.decode(m.encode(decoded), type(msg)) == decoded


@pytest.mark.parametrize(
    ("schema", "doc", "field"),
    [
        (
            m.StepRequest,
            {"kind": "env.step", "lease_id": "l", "step_index": 0, "action": {"kind": "click", "x": 1.5, "y": 0}},
            "action.click.x",
        ),
        (
            m.StepRequest,
            {"kind": "env.step", "lease_id": "l", "step_index": 0, "action": {"kind": "teleport"}},
            "action",
        ),
        (
            m.StepRequest,
            {"kind": "env.step", "lease_id": "l", "step_index": "0", "action": {"kind": "wait"}},
            "step_index",
        ),
        (m.HeartbeatRequest, {"kind": "env.heartbeat", "lease_id": "l", "extra": 1}, "extra"),
        (m.HeartbeatRequest, {"kind": "env.heartbeat", "lease_id": "l", "schema_version": 2}, "schema_version"),
        (m.HeartbeatRequest, {"kind": "env.lease", "lease_id": "l"}, "kind"),
        (m.HeartbeatRequest, {"kind": "env.heartbeat", "lease_id": ""}, "lease_id"),
        (m.ReleaseReply, {"kind": "env.release.reply", "released": "true"}, "released"),
    ],
)
def test_strict_validation_names_the_field(schema: type[BaseModel], doc: dict[str, Any], field: str) -> None:
    with pytest.raises(MessageValidationError) as info:
        m.decode(json.dumps(doc), schema)
    assert any(e["loc"].startswith(field) for e in info.value.errors), info.value.errors


def test_non_png_screenshot_rejected() -> None:
    with pytest.raises(ValueError, match="PNG"):
        m.InlineImage(png=b"GIF89a....", width=1, height=1)
    assert m.InlineImage(png=tiny_png(3, 1), width=3, height=1).png.startswith(m.observation.PNG_SIGNATURE)


def test_inline_png_travels_as_base64() -> None:
    msg = m.ResetReply(observation=OBS, instruction="i", env_latency_s=0.0)
    wire = json.loads(m.encode(msg))
    assert isinstance(wire["observation"]["screenshot"]["png"], str)
    assert m.decode(m.encode(msg), m.ResetReply).observation == OBS


def test_step_record_arrays_must_align() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        m.StepRecord(
            index=0,
            policy_version=0,
            observation=OBS,
            response_token_ids=[1, 2],
            response_logprobs=[-1.0],
            response_entropy=[0.1, 0.2],
            action=m.Wait(),
        )


def test_step_record_needs_action_or_parse_error_not_both() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        m.StepRecord(index=0, policy_version=0, observation=OBS)
    with pytest.raises(ValueError, match="exactly one"):
        m.StepRecord(index=0, policy_version=0, observation=OBS, action=m.Wait(), parse_error="x")
    assert m.StepRecord(index=0, policy_version=0, observation=OBS, parse_error="no Action: line").action is None


def test_trajectory_version_range_must_match_steps() -> None:
    base = dict(
        trajectory_id="t",
        work_id="w",
        task=TASK,
        group_id="g",
        rollout_index=0,
        group_size=1,
        status=m.TrajectoryStatus.OK,
        started_at=1.0,
        finished_at=2.0,
    )
    with pytest.raises(ValueError, match="policy version range"):
        m.Trajectory(**base, steps=[step(0, 2), step(1, 5)], min_policy_version=2, max_policy_version=4)
    with pytest.raises(ValueError, match="step indices"):
        m.Trajectory(**base, steps=[step(1, 2)], min_policy_version=2, max_policy_version=2)
    with pytest.raises(ValueError, match="finished_at"):
        m.Trajectory(**{**base, "finished_at": 0.5}, min_policy_version=0, max_policy_version=0)
    ok = m.Trajectory(**base, steps=[step(0, 2), step(1, 5)], min_policy_version=2, max_policy_version=5)
    assert ok.trainable
    assert not m.Trajectory(
        **{**base, "status": m.TrajectoryStatus.ENV_FAILED}, min_policy_version=0, max_policy_version=0
    ).trainable


def test_work_item_index_within_group() -> None:
    with pytest.raises(ValueError, match="rollout_index"):
        m.WorkItem(work_id="w", task=TASK, group_id="g", rollout_index=4, group_size=4, max_steps=3, created_at=0.0)


def test_status_enum_values_are_distinct_outcomes() -> None:
    assert {s.value for s in m.TrajectoryStatus} == {"ok", "truncated", "aborted", "env_failed", "failed"}
    assert m.TRAINABLE_STATUSES == {m.TrajectoryStatus.OK, m.TrajectoryStatus.TRUNCATED}


def test_messages_are_frozen() -> None:
    msg = m.HeartbeatRequest(lease_id="l")
    with pytest.raises(ValueError):
        msg.lease_id = "other"  # type: ignore[misc]


# --- the compressed wire form ---------------------------------------------------------------------


def _long_trajectory(steps: int, image_tokens: int) -> m.Trajectory:
    """A trajectory shaped like a real-size episode: every step's prompt repeats the last one's and adds to it,
    with runs of image-pad ids, as a 1920x1080 screen gives."""
    sample = next(x for x in MESSAGES if isinstance(x, m.Trajectory))
    base = sample.steps[0]
    records, prompt = [], [151644, 8948, 198]
    for i in range(steps):
        prompt = [*prompt, 151652, *([151655] * image_tokens), 151653, *range(1000 + 40 * i, 1040 + 40 * i)]
        records.append(base.model_copy(update={"index": i, "prompt_token_ids": list(prompt)}))
    version = base.policy_version
    return sample.model_copy(update={"steps": records, "min_policy_version": version, "max_policy_version": version})


def test_a_small_message_stays_plain_json() -> None:
    msg = MESSAGES[0]
    data = m.encode(msg)
    assert len(msg.model_dump_json()) <= m.codec.COMPRESS_ABOVE_BYTES
    assert data == msg.model_dump_json().encode()


def test_a_large_message_travels_compressed_and_decodes_to_the_same() -> None:
    traj = _long_trajectory(steps=20, image_tokens=2691)
    plain = traj.model_dump_json().encode()
    data = m.encode(traj)
    assert data.startswith(m.codec.XZ_MAGIC)
    assert len(plain) > 20 * len(data)  # repeated prompts and image-pad runs are what compresses
    assert m.decode(data, m.Trajectory) == traj
    assert m.decode(data, m.ANY_MESSAGE) == traj
    assert m.codec.wire_json(data) == plain
    assert m.decode(plain, m.Trajectory) == traj  # plain JSON of any size still reads


def test_a_damaged_compressed_message_is_a_typed_error() -> None:
    data = m.encode(_long_trajectory(steps=4, image_tokens=2691))
    assert data.startswith(m.codec.XZ_MAGIC)
    middle = len(data) // 2
    flipped = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
    for bad, why in ((data[:-10], "truncated"), (flipped, "corrupt"), (data + b"{}", "bytes after")):
        with pytest.raises(MessageValidationError, match=why):
            m.decode(bad, m.Trajectory)


def test_a_compressed_message_that_expands_beyond_the_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    traj = _long_trajectory(steps=4, image_tokens=2691)
    data = m.encode(traj)
    monkeypatch.setattr(m.codec, "MAX_DECODED_BYTES", len(traj.model_dump_json()) - 1)
    with pytest.raises(MessageValidationError, match="expands beyond"):
        m.decode(data, m.Trajectory)


# --- fuzzing: whatever arrives, the decoder raises only MessageValidationError --------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
kinds = st.sampled_from(sorted({x.kind for x in MESSAGES} | {"click", "", "nope"}))  # type: ignore[attr-defined]
message_like = st.builds(
    lambda kind, body, version: {**body, "kind": kind, "schema_version": version},
    kinds,
    st.dictionaries(st.sampled_from(["lease_id", "action", "task", "steps", "reward", "x", "png"]), json_values),
    st.sampled_from([1, 2, "1", None]),
)
schemas: list[Any] = [m.ANY_MESSAGE, *MESSAGE_TYPES]


def _decode_only_typed_error(data: bytes | str) -> None:
    for schema in schemas:
        try:
            m.decode(data, schema)
        except MessageValidationError:
            pass


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_only_typed_error(data)


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_after_the_compressed_magic(data: bytes) -> None:
    _decode_only_typed_error(m.codec.XZ_MAGIC + data)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(json_values)
def test_fuzz_random_json(value: Any) -> None:
    _decode_only_typed_error(json.dumps(value))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(message_like)
def test_fuzz_message_shaped_json(doc: dict[str, Any]) -> None:
    _decode_only_typed_error(json.dumps(doc))


def test_deeply_nested_json_is_a_typed_error() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(MessageValidationError):
        m.decode(deep, m.ANY_MESSAGE)


def _oversized(msg: m.Message, path: tuple[str | int, ...], length: int, fill: Any) -> str:
    """``msg`` as JSON with the list at ``path`` made ``length`` long (copies of ``fill``)."""
    doc = json.loads(m.encode(msg))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = [fill] * length
    return json.dumps(doc)


def _sample_of(messages: list[m.Message], kind: str) -> m.Message:
    return next(x for x in messages if x.kind == kind)


@pytest.mark.parametrize(
    ("kind", "path", "limit", "fill", "field"),
    [
        ("trajectory", ("steps",), m.MAX_STEPS, None, "steps"),
        ("trajectory", ("steps", 0, "prompt_token_ids"), m.MAX_PROMPT_TOKENS, 1, "steps.0.prompt_token_ids"),
        ("trajectory", ("steps", 0, "response_token_ids"), m.MAX_RESPONSE_TOKENS, 1, "steps.0.response_token_ids"),
        ("training_batch", ("samples",), m.MAX_BATCH_SAMPLES, None, "samples"),
        ("training_batch", ("group_ids",), m.MAX_BATCH_GROUPS, "g", "group_ids"),
        ("training_batch", ("samples", 0, "prompt_token_ids"), m.MAX_PROMPT_TOKENS, 1, "samples.0.prompt_token_ids"),
    ],
)
def test_oversized_lists_are_a_typed_error_naming_the_field(
    kind: str, path: tuple[str | int, ...], limit: int, fill: Any, field: str
) -> None:
    msg = _sample_of(MESSAGES, kind)
    doc = json.loads(m.encode(msg))
    node: Any = doc
    for key in path:
        node = node[key]
    item = fill if fill is not None else node[0]
    with pytest.raises(MessageValidationError) as info:
        m.decode(_oversized(msg, path, limit + 1, item), type(msg))
    assert any(e["loc"] == field and e["type"] == "too_long" for e in info.value.errors), info.value.errors


def test_token_ids_must_be_vocabulary_indices() -> None:
    msg = _sample_of(MESSAGES, "trajectory")
    doc = json.loads(m.encode(msg))
    doc["steps"][0]["prompt_token_ids"] = [5, -1]
    with pytest.raises(MessageValidationError) as info:
        m.decode(json.dumps(doc), m.Trajectory)
    assert [e["loc"] for e in info.value.errors] == ["steps.0.prompt_token_ids.1"]
