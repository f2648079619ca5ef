"""Authentication and per-service permissions against a real nats-server with one user per role."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from dart.embedded.nats import EmbeddedNats, NatsUser
from dart.protocol.errors import (
    BusAuthError,
    JetStreamError,
    PermissionDeniedError,
)
from dart.protocol.messages import LeaseReply, LeaseRequest
from dart.protocol.permissions import ENV_OP_TIMEOUT_MAX_S, ENV_REPLY_WINDOW_S, service_permissions
from dart.protocol.subjects import Subjects, inbox_prefix
from dart.protocol.topology import LATEST_MODEL_KEY, ROLES, STREAMS, Role
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.testing import all_messages
from dart.runtime.topology import announced_version, durable_name, ensure_topology, open_topology

pytestmark = pytest.mark.integration

PREFIX = "dart.v1"
RUN = "authrun"


@pytest.fixture(scope="module")
def secure_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, dict[str, Path]]]:
    """A nats-server with one password-protected user per role, permissions from service_permissions."""
    secrets_dir = tmp_path_factory.mktemp("secrets")
    files: dict[str, Path] = {}
    for role in ROLES:
        files[role] = secrets_dir / f"{role}.password"
        files[role].write_text(secrets.token_urlsafe(24))
    users = [NatsUser(role, files[role], service_permissions(role, PREFIX, RUN)) for role in ROLES]
    with EmbeddedNats(users=users) as server:
        yield server, files


def config_for(server: EmbeddedNats, files: dict[str, Path], role: Role, **extra: Any) -> BusConfig:
    return BusConfig(
        url=server.url,
        prefix=PREFIX,
        run=RUN,
        user=role,
        password_file=files[role],
        request_timeout_s=3.0,
        **extra,
    )


@pytest.fixture
async def buses(secure_nats: tuple[EmbeddedNats, dict[str, Path]]) -> AsyncIterator[dict[Role, Bus]]:
    server, files = secure_nats
    connected = {role: await Bus.connect(config_for(server, files, role)) for role in ROLES}
    try:
        yield connected
    finally:
        for bus in connected.values():
            await bus.close()


def message(kind: str) -> Any:
    return next(msg for msg in all_messages() if msg.kind == kind)


async def test_client_without_credentials_is_refused_at_once(secure_nats: tuple[EmbeddedNats, dict[str, Path]]) -> None:
    server, _ = secure_nats
    started = time.monotonic()
    with pytest.raises(BusAuthError) as info:
        await Bus.connect(BusConfig(url=server.url, connect_timeout_s=20.0))
    assert info.value.user is None
    assert "without credentials" in str(info.value)
    # Refused on the server's answer, not after the 20 s connect deadline.
    assert time.monotonic() - started < 10.0


async def test_wrong_password_and_unknown_user_are_refused(
    secure_nats: tuple[EmbeddedNats, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = secure_nats
    monkeypatch.setenv("DART_TEST_NATS_PASSWORD", "not-the-password")
    for user in ("rollout", "mallory"):
        with pytest.raises(BusAuthError) as info:
            await Bus.connect(BusConfig(url=server.url, user=user, password_env="DART_TEST_NATS_PASSWORD"))
        assert info.value.user == user
        assert repr(user) in str(info.value)
        assert "not-the-password" not in str(info.value)


async def test_each_role_can_do_its_work(buses: dict[Role, Bus]) -> None:
    env, rollout, data, train, run = (buses[r] for r in ("env", "rollout", "data", "train", "run"))
    states = {"run": await ensure_topology(run)}  # the run role creates; the services bind
    states |= {role: await open_topology(buses[role]) for role in ("rollout", "data", "train", "eval")}

    # env serves a lease pool (a reply needs allow_responses); rollout and eval call it.
    lease_reply = message("env.lease.reply")

    async def on_lease(_: LeaseRequest) -> LeaseReply:
        return lease_reply  # type: ignore[no-any-return]

    await env.serve(env.subjects.env_lease("pool-a"), LeaseRequest, on_lease, queue="dart-env")
    for caller in ("rollout", "eval"):
        bus = buses[caller]
        assert await bus.request(bus.subjects.env_lease("pool-a"), message("env.lease"), LeaseReply) == lease_reply

    # data -> work -> rollout -> traj -> data -> batch -> train -> model + state KV
    chain: list[tuple[Bus, Bus, str, str]] = [
        (data, rollout, "work", "work_item"),
        (rollout, data, "traj", "trajectory"),
        (data, train, "batch", "training_batch"),
    ]
    for producer, consumer_bus, kind, msg_kind in chain:
        msg = message(msg_kind)
        await producer.js_publish(producer.subjects.stream_subject(kind), msg, msg_id=f"{kind}-1")  # type: ignore[arg-type]
        consumer = await consumer_bus.pull_consumer(kind, durable_name(consumer_bus, kind), type(msg))  # type: ignore[arg-type]
        [delivery] = await consumer.fetch(1, timeout=5)
        assert delivery.message == msg
        await delivery.in_progress()
        await delivery.ack()
        await consumer.close()
    model = message("model_version")
    await train.js_publish(train.subjects.stream_subject("model"), model, msg_id="model-v1")
    await states["train"].put(LATEST_MODEL_KEY, model)
    for role in ("rollout", "data", "run", "eval"):
        assert await states[role].get(LATEST_MODEL_KEY, type(model)) == model
    # The rollout service reads a version an evaluation asks for from the trainer's announcements.
    assert await announced_version(rollout, model.version) == model

    # Watchers (engines' sync controllers, the data manager) see the current value.
    async def first_watched(role: str) -> Any:
        async for entry in states[role].watch(type(model), LATEST_MODEL_KEY):
            return entry.value
        return None

    for role in ("rollout", "data"):
        assert await asyncio.wait_for(first_watched(role), timeout=10) == model

    # The supervisor reads the backlog.
    assert (await run.stream_state("traj")).messages >= 1
    assert (await run.consumer_state("traj", durable_name(run, "traj"))).num_pending == 0
    await asyncio.gather(*(bus.flush() for bus in buses.values()))
    assert {role: bus.denials.count for role, bus in buses.items()} == dict.fromkeys(ROLES, 0)


async def test_publishing_outside_permissions_is_refused(buses: dict[Role, Bus]) -> None:
    env, rollout, data = buses["env"], buses["rollout"], buses["data"]
    await ensure_topology(buses["run"])
    before = {kind: (await data.stream_state(kind)).messages for kind in ("traj", "batch")}
    started = time.monotonic()
    # The env service may not publish trajectories, nor rollout training batches.
    with pytest.raises(PermissionDeniedError) as info:
        await env.js_publish(env.subjects.stream_subject("traj"), message("trajectory"), msg_id="forged-traj")
    assert (info.value.user, info.value.operation) == ("env", "publish")
    assert info.value.subject == env.subjects.stream_subject("traj")
    with pytest.raises(PermissionDeniedError) as info:
        await rollout.js_publish(rollout.subjects.stream_subject("batch"), message("training_batch"), msg_id="forged")
    assert info.value.user == "rollout"
    assert time.monotonic() - started < 3.0  # refused on the server's answer, not the 3 s ack timeout
    # Nothing reached the streams.
    assert {kind: (await data.stream_state(kind)).messages for kind in ("traj", "batch")} == before
    # rollout may not serve env subjects, nor call env ops it is not the env service for.
    with pytest.raises(PermissionDeniedError) as info:
        await rollout.serve(rollout.subjects.env_lease("pool-a"), LeaseRequest, lambda _: None)  # type: ignore[arg-type, return-value]
    assert info.value.operation == "subscribe"
    # Only the trainer writes the model version.
    state = await open_topology(rollout)
    with pytest.raises(JetStreamError):
        await state.put(LATEST_MODEL_KEY, message("model_version"))
    assert rollout.denials.denied("publish", f"$KV.{rollout.subjects.kv_bucket('state')}.{LATEST_MODEL_KEY}")


async def test_a_service_binds_to_the_topology_the_run_role_made(tmp_path: Path) -> None:
    """A service role cannot make the run's streams: it waits for the run role's, then binds to them."""
    run = "fresh"
    files = {role: tmp_path / f"{role}.password" for role in ("rollout", "run")}
    for path in files.values():
        path.write_text(secrets.token_urlsafe(24))
    users = [NatsUser(role, files[role], service_permissions(role, PREFIX, run)) for role in files]  # type: ignore[arg-type]

    def config(role: str) -> BusConfig:
        return BusConfig(url=server.url, prefix=PREFIX, run=run, user=role, password_file=files[role])

    with EmbeddedNats(users=users) as server:
        async with await Bus.connect(config("rollout")) as rollout, await Bus.connect(config("run")) as admin:
            with pytest.raises(JetStreamError, match="await_topology"):
                await open_topology(rollout, wait_s=0.5)  # nothing made yet, and it may not make it
            waiting = asyncio.create_task(open_topology(rollout, wait_s=60))
            await ensure_topology(admin)
            state = await waiting
            assert state.bucket == rollout.subjects.kv_bucket("state")
            await rollout.flush()
            assert rollout.denials.count == 0  # it only looked


async def test_no_service_role_can_reconfigure_the_runs_streams_or_consumers(
    secure_nats: tuple[EmbeddedNats, dict[str, Path]], buses: dict[Role, Bus]
) -> None:
    """The forgery a live run once allowed: the rollout role added a subject it may publish on to the batch
    stream, whose consumer feeds the trainer. No service role may change a stream or make a consumer now,
    and each durable consumer reads its own stream's subject only."""
    server, files = secure_nats
    await ensure_topology(buses["run"])
    batch = buses["run"].subjects.stream_subject("batch")
    extra = f"{PREFIX}.forged.{RUN}"
    rollout = buses["rollout"]  # the other service roles hold the same grants (test_permissions_follow_the_topology)
    with pytest.raises(JetStreamError):
        await rollout.ensure_stream("batch", [batch, extra])
    with pytest.raises(JetStreamError):
        await rollout.ensure_consumer("batch", "stolen")
    await rollout.flush()
    name = rollout.subjects.stream_name("batch")
    assert rollout.denials.denied("publish", f"$JS.API.STREAM.UPDATE.{name}")
    # As the run role (it may read the configs): the batch stream is as made, each consumer filters.
    nc = await nats.connect(
        server.url, user="run", password=files["run"].read_text().strip(), inbox_prefix=inbox_prefix("run")
    )
    try:
        js = nc.jetstream()
        subjects = buses["run"].subjects
        assert (await js.stream_info(subjects.stream_name("batch"))).config.subjects == [batch]
        for kind, spec in STREAMS.items():
            if spec.consumer is not None:
                info = await js.consumer_info(subjects.stream_name(kind), durable_name(buses["run"], kind))
                assert info.config.filter_subject == subjects.stream_subject(kind)
    finally:
        await nc.close()


async def test_permissions_follow_the_topology() -> None:
    for kind, spec in STREAMS.items():
        subject = f"{PREFIX}.{kind}.{RUN}"
        for role in ROLES:
            assert (subject in service_permissions(role, PREFIX, RUN).publish) == (role in spec.publishers)
    env = service_permissions("env", PREFIX, RUN)
    assert env.allow_responses and not any(s.startswith("$JS") for s in env.publish)
    assert not any(
        s == ">" or s.startswith("$JS.API.>") for r in ROLES for s in service_permissions(r, PREFIX, RUN).publish
    )
    # The rollout service answers evaluation requests on its engines; only the eval role asks.
    rollout = service_permissions("rollout", PREFIX, RUN)
    assert rollout.subscribe == ("_INBOX.rollout.>", f"{PREFIX}.eval.{RUN}") and rollout.allow_responses
    # An evaluation takes minutes: its reply may come long after nats-server's default 2-minute window.
    assert rollout.response_window_s is not None and rollout.response_window_s >= 3600
    # An env call may run for env.op_timeout_s (up to an hour), then restart its backend: answered once.
    assert env.response_window_s == ENV_REPLY_WINDOW_S >= 2 * ENV_OP_TIMEOUT_MAX_S
    # Only the run role creates or changes streams and consumers (the services find them and bind).
    admin = [
        r
        for r in ROLES
        if any(
            f".{op}." in s
            for s in service_permissions(r, PREFIX, RUN).publish
            for op in ("CREATE", "UPDATE")
            if not s.startswith("$JS.API.CONSUMER.CREATE.KV_")  # a bucket reader's watcher (ephemeral)
        )
    ]
    assert admin == ["run"]
    askers = [r for r in ROLES if f"{PREFIX}.eval.{RUN}" in service_permissions(r, PREFIX, RUN).publish]
    assert askers == ["eval"]
    # Only the rollout service reads the announced versions back (the trainer alone writes them).
    model_reads = f"$JS.API.STREAM.MSG.GET.{Subjects(prefix=PREFIX, run=RUN).stream_name('model')}"
    assert [r for r in ROLES if model_reads in service_permissions(r, PREFIX, RUN).publish] == ["rollout"]
    with pytest.raises(ValueError, match="unknown role"):
        service_permissions("admin", PREFIX, RUN)  # type: ignore[arg-type]


def test_password_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DART_TEST_PW", "  s3cret \n")
    assert BusConfig(user="data", password_env="DART_TEST_PW").password() == "s3cret"
    with pytest.raises(ValueError, match="needs bus.user"):
        BusConfig(password_env="DART_TEST_PW")
