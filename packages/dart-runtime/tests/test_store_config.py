"""StoreConfig: validation, credentials from the environment or files (never from config values)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dart.protocol.config import load_config
from dart.protocol.errors import ConfigError, InvalidURIError
from dart.runtime.store import LocalStore, S3Store, StoreConfig, open_store, resolve_uri
from dart.runtime.store.interface import MiB

pytestmark = pytest.mark.unit

_CREDENTIAL_VARS = (
    "DART_S3_ACCESS_KEY",
    "DART_S3_SECRET_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "DART_S3_ENDPOINT",
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)


def test_defaults() -> None:
    config = StoreConfig(uri="s3://bucket/prefix")
    assert config.access_key_env == "DART_S3_ACCESS_KEY" and config.secret_key_env == "DART_S3_SECRET_KEY"
    assert config.create_bucket and config.part_size_mb == 16 and config.secure is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"uri": "gs://bucket"}, "unsupported URI scheme"),
        ({"uri": "file://host/x"}, "only local files"),
        ({"uri": "s3://Bad_Bucket"}, "invalid S3 bucket name"),
        ({"uri": "s3://b-1", "endpoint": "minio:9000/path"}, "not an S3 endpoint"),
        ({"uri": "s3://b-1", "endpoint": "ftp://minio:9000"}, "not an S3 endpoint"),
        ({"uri": "s3://b-1", "endpoint": "http://user:pw@minio:9000"}, "embeds credentials"),
        ({"uri": "s3://b-1", "endpoint": "http://minio:9000/bucket"}, "has a path"),
        ({"uri": "s3://b-1", "access_key_env": "not/a-name+"}, "not an environment variable name"),
        ({"uri": "s3://b-1", "part_size_mb": 1}, "greater than or equal to 5"),
        ({"uri": "s3://b-1", "access_key": "literal"}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_configs_fail_naming_the_problem(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        StoreConfig.model_validate(fields)


def test_loads_from_yaml_with_environment_overrides(tmp_path: Path) -> None:
    from pydantic import BaseModel

    class Run(BaseModel):
        store: StoreConfig

    path = tmp_path / "run.yaml"
    path.write_text("store:\n  uri: s3://dart-artifacts/run-1\n  endpoint: http://minio:9000\n")
    run = load_config(Run, path, environ={"DART_STORE__CREATE_BUCKET": "false"})
    assert run.store.uri == "s3://dart-artifacts/run-1" and run.store.create_bucket is False


def test_credentials_from_named_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAM_KEY", "team-access")
    monkeypatch.setenv("TEAM_SECRET", "team-secret")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "aws-access")
    config = StoreConfig(uri="s3://b-1", access_key_env="TEAM_KEY", secret_key_env="TEAM_SECRET")
    assert config.credentials() == ("team-access", "team-secret")


def test_credentials_fall_back_to_the_aws_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "aws-access")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    assert StoreConfig(uri="s3://b-1").credentials() == ("aws-access", "aws-secret")


def test_credential_files_take_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DART_S3_ACCESS_KEY", "env-access")
    monkeypatch.setenv("DART_S3_SECRET_KEY", "env-secret")
    (tmp_path / "ak").write_text("file-access\n")
    (tmp_path / "sk").write_text("  file-secret  \n")
    config = StoreConfig(uri="s3://b-1", access_key_file=tmp_path / "ak", secret_key_file=tmp_path / "sk")
    assert config.credentials() == ("file-access", "file-secret")


def test_missing_credentials_say_where_to_put_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"set \$DART_S3_ACCESS_KEY \(or \$AWS_ACCESS_KEY_ID\)") as exc:
        StoreConfig(uri="s3://b-1").credentials()
    assert exc.value.field == "store.access_key_env"
    monkeypatch.setenv("DART_S3_ACCESS_KEY", "access")
    with pytest.raises(ConfigError, match="no S3 secret key") as exc:
        StoreConfig(uri="s3://b-1").credentials()
    assert exc.value.field == "store.secret_key_env"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty") as exc:
        StoreConfig(uri="s3://b-1", secret_key_file=tmp_path / "empty").credentials()
    assert exc.value.field == "store.secret_key_file"
    with pytest.raises(ConfigError, match="cannot read the secret key"):
        StoreConfig(uri="s3://b-1", secret_key_file=tmp_path / "missing").credentials()


@pytest.mark.parametrize(
    ("endpoint", "secure", "expected"),
    [
        ("minio:9000", None, ("minio:9000", True)),
        ("minio:9000", False, ("minio:9000", False)),
        ("http://minio:9000", None, ("minio:9000", False)),
        ("https://s3.example.org", None, ("s3.example.org", True)),
        ("http://minio:9000/", False, ("minio:9000", False)),
    ],
)
def test_endpoint_and_secure(endpoint: str, secure: bool | None, expected: tuple[str, bool]) -> None:
    assert StoreConfig(uri="s3://b-1", endpoint=endpoint, secure=secure).s3_settings() == expected


def test_endpoint_contradicting_secure_is_an_error() -> None:
    with pytest.raises(ConfigError, match="contradicts") as exc:
        StoreConfig(uri="s3://b-1", endpoint="http://minio:9000", secure=True).s3_settings()
    assert exc.value.field == "store.secure"


def test_endpoint_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"store.endpoint or \$DART_S3_ENDPOINT"):
        StoreConfig(uri="s3://b-1").s3_settings()
    monkeypatch.setenv("DART_S3_ENDPOINT", "http://127.0.0.1:9000")
    assert StoreConfig(uri="s3://b-1").s3_settings() == ("127.0.0.1:9000", False)


def test_open_store_builds_the_configured_backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DART_S3_ACCESS_KEY", "access")
    monkeypatch.setenv("DART_S3_SECRET_KEY", "secret")
    config = StoreConfig(
        uri="s3://dart-artifacts/runs/42/",
        endpoint="http://127.0.0.1:9000",
        create_bucket=False,
        part_size_mb=8,
    )
    # Opening is lazy: no request is made until the first operation.
    with open_store(config) as store:
        assert isinstance(store, S3Store)
        assert (store.bucket, store.prefix, store.endpoint) == ("dart-artifacts", "runs/42", "127.0.0.1:9000")
        assert store.part_size == 8 * MiB and not store.create_bucket
        assert store.uri("w/v1") == "s3://dart-artifacts/runs/42/w/v1"
    local = open_store(StoreConfig(uri=f"file://{tmp_path}/a", fsync=False))
    assert isinstance(local, LocalStore) and local.root == tmp_path / "a" and not local.fsync


def test_open_store_without_credentials_fails_at_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DART_S3_ENDPOINT", "127.0.0.1:9000")
    with pytest.raises(ConfigError, match="no S3 access key"):
        open_store("s3://dart-artifacts")


def test_resolve_uri_rejects_store_uris_and_bad_schemes() -> None:
    with pytest.raises(InvalidURIError, match="has no key"):
        resolve_uri("s3://bucket")
    with pytest.raises(InvalidURIError, match="unsupported"):
        resolve_uri("https://example.org/x")
