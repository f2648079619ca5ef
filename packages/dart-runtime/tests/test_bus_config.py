"""BusConfig: validation that names the field, secrets kept out of config values."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dart.protocol.errors import ConfigError
from dart.protocol.subjects import Subjects
from dart.runtime.bus import Bus, BusConfig

pytestmark = pytest.mark.unit


def test_defaults_point_at_a_local_server_and_the_default_namespace() -> None:
    config = BusConfig()
    assert config.servers == ["nats://127.0.0.1:4222"]
    assert config.subjects() == Subjects()
    assert config.max_reconnect_attempts == -1


def test_url_may_be_a_cluster_list() -> None:
    config = BusConfig(url=["nats://a:4222", "tls://b:4222"], prefix="dart.v2", run="exp-1")
    assert config.servers == ["nats://a:4222", "tls://b:4222"]
    assert config.subjects() == Subjects(prefix="dart.v2", run="exp-1")


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("url", "http://host:4222", "not a NATS URL"),
        ("url", [], "at least one"),
        ("url", "nats://user:secret@host:4222", "embeds credentials"),
        ("prefix", "dart..v1", "prefix"),
        ("run", "exp.1", "run id"),
        ("connect_timeout_s", 0, "greater than 0"),
        ("max_reconnect_attempts", -2, "greater than or equal to -1"),
        ("serve_concurrency", 0, "greater than or equal to 1"),
        ("replicas", 0, "greater than or equal to 1"),
        ("replicas", 6, "less than or equal to 5"),
        ("password", "x", "Extra inputs"),
    ],
)
def test_invalid_values_fail_naming_the_field(field: str, value: object, reason: str) -> None:
    with pytest.raises(ValidationError) as err:
        BusConfig.model_validate({field: value})
    assert err.value.errors()[0]["loc"][0] == field
    assert reason in str(err.value)


def test_token_is_read_from_the_named_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    config = BusConfig(token_env="DART_TEST_NATS_TOKEN")
    monkeypatch.delenv("DART_TEST_NATS_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="DART_TEST_NATS_TOKEN"):
        config.token()
    monkeypatch.setenv("DART_TEST_NATS_TOKEN", "s3cret")
    assert config.token() == "s3cret"
    assert "s3cret" not in config.model_dump_json()
    assert BusConfig().token() is None


async def test_missing_creds_file_fails_before_connecting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        await Bus.connect(BusConfig(creds_file=tmp_path / "absent.creds"))
    assert err.value.field == "bus.creds_file"
