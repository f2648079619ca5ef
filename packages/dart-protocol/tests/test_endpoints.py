"""The endpoint table: each endpoint's types round-trip, and a real nats-server with the permissions derived
from it lets exactly the serving role serve and the calling roles call, each env user in its own pool."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from dart.embedded.nats import EmbeddedNats, NatsUser
from dart.protocol.endpoints import ENDPOINTS, Endpoint
from dart.protocol.errors import PermissionDeniedError, SubjectError
from dart.protocol.messages import Message
from dart.protocol.messages.codec import decode, encode
from dart.protocol.permissions import service_permissions
from dart.protocol.subjects import ENDPOINT_SUBJECTS, Subjects
from dart.protocol.topology import ROLES, Role
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.testing import all_messages

PREFIX = "dart.v1"
RUN = "endpoints"
POOL = "pool-a"
OTHER_POOL = "pool-b"
FIELDS = {"pool": POOL, "instance": f"{POOL}-0"}


def sample(message_type: type[Message]) -> Message:
    kind = message_type.model_fields["kind"].default
    return next(msg for msg in all_messages() if msg.kind == kind)


def subject(endpoint: Endpoint) -> str:
    template = ENDPOINT_SUBJECTS[endpoint.name]
    return Subjects(PREFIX, RUN).endpoint(endpoint.name, **{k: v for k, v in FIELDS.items() if f"{{{k}}}" in template})


@pytest.mark.unit
def test_every_endpoint_has_a_subject_and_types_that_round_trip() -> None:
    assert set(ENDPOINTS) == set(ENDPOINT_SUBJECTS)
    for endpoint in ENDPOINTS.values():
        for message_type in (endpoint.request, endpoint.reply):
            msg = sample(message_type)
            assert decode(encode(msg), message_type) == msg, endpoint.name
    with pytest.raises(SubjectError, match="pool"):
        Subjects(PREFIX, RUN).endpoint("env.lease")
    assert Subjects(PREFIX, RUN).env_instance(POOL, "i-0", "step") == f"{PREFIX}.env.{POOL}.inst.i-0.step"


@pytest.mark.unit
def test_permissions_follow_the_endpoints() -> None:
    subjects = Subjects(PREFIX, RUN)
    for endpoint in ENDPOINTS.values():
        pattern = subjects.endpoint_pattern(endpoint.name)
        for role in ROLES:
            granted = service_permissions(role, PREFIX, RUN)
            assert (pattern in granted.publish) == (role in endpoint.callers), (endpoint.name, role)
            assert (pattern in granted.subscribe) == (role == endpoint.server), (endpoint.name, role)
            if role == endpoint.server:
                assert granted.allow_responses and (granted.response_window_s or 0) >= (endpoint.reply_window_s or 0)
    # Scoped to a pool, the env user subscribes to that pool's subjects only.
    env = service_permissions("env", PREFIX, RUN, pools=(POOL,))
    assert [s for s in env.subscribe if s.startswith(f"{PREFIX}.env.")] == [
        subjects.endpoint_pattern(e.name, pool=POOL) for e in ENDPOINTS.values() if e.server == "env"
    ]
    assert not any("*" in s.split(".")[3] for s in env.subscribe + env.publish if s.startswith(f"{PREFIX}.env."))
    # Roles that serve nothing answer nothing.
    assert [r for r in ROLES if service_permissions(r, PREFIX, RUN).allow_responses] == ["env", "rollout"]


@pytest.fixture(scope="module")
def scoped_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, dict[str, Path]]]:
    """One user per role, the env user serving ``POOL`` only."""
    directory = tmp_path_factory.mktemp("secrets")
    files = {role: directory / f"{role}.password" for role in ROLES}
    for path in files.values():
        path.write_text(secrets.token_urlsafe(24))
    users = [NatsUser(r, files[r], service_permissions(r, PREFIX, RUN, pools=(POOL,))) for r in ROLES]
    with EmbeddedNats(users=users) as server:
        yield server, files


@pytest.fixture
async def buses(scoped_nats: tuple[EmbeddedNats, dict[str, Path]]) -> AsyncIterator[dict[Role, Bus]]:
    server, files = scoped_nats
    connected: dict[Role, Bus] = {}
    try:
        for role in ROLES:
            config = BusConfig(
                url=server.url, prefix=PREFIX, run=RUN, user=role, password_file=files[role], request_timeout_s=5.0
            )
            connected[role] = await Bus.connect(config)
        yield connected
    finally:
        for bus in connected.values():
            await bus.close()


@pytest.mark.integration
async def test_each_endpoint_answers_its_callers_and_refuses_every_other_role(buses: dict[Role, Bus]) -> None:
    for endpoint in ENDPOINTS.values():
        reply = sample(endpoint.reply)

        async def answer(_: Any, reply: Message = reply) -> Message:
            return reply

        service = await buses[endpoint.server].serve(subject(endpoint), endpoint.request, answer)
        try:
            for role in ROLES:
                bus = buses[role]
                call = bus.request(subject(endpoint), sample(endpoint.request), endpoint.reply)
                if role in endpoint.callers:
                    assert await call == reply, (endpoint.name, role)
                    continue
                with pytest.raises(PermissionDeniedError) as refused:
                    await call
                assert (refused.value.user, refused.value.operation) == (role, "publish"), endpoint.name
                assert bus.denials.refused[("publish", subject(endpoint).lower())] == 1, (endpoint.name, role)
        finally:
            await service.stop()


@pytest.mark.integration
async def test_an_env_user_of_one_pool_cannot_serve_another_pool(buses: dict[Role, Bus]) -> None:
    env = buses["env"]
    lease = ENDPOINTS["env.lease"]

    async def answer(_: Any) -> Message:
        return sample(lease.reply)

    for name in ("env.lease", "env.capabilities", "env.step"):
        other = env.subjects.endpoint(name, pool=OTHER_POOL, instance=f"{OTHER_POOL}-0")  # type: ignore[arg-type]
        with pytest.raises(PermissionDeniedError) as refused:
            await env.serve(other, ENDPOINTS[name].request, answer)  # type: ignore[index]
        assert (refused.value.user, refused.value.operation, refused.value.subject) == ("env", "subscribe", other)
        assert env.denials.refused[("subscribe", other.lower())] == 1
    # Its own pool it serves, and the rollout service leases from it.
    service = await env.serve(env.subjects.env_lease(POOL), lease.request, answer)
    try:
        got = await buses["rollout"].request(env.subjects.env_lease(POOL), sample(lease.request), lease.reply)
        assert got == sample(lease.reply)
    finally:
        await service.stop()
