"""load_config: YAML file < environment < overrides, validated, errors that name file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field, SecretStr

from dart.protocol.config import ConfigModel, dump_config, load_config, parse_yaml
from dart.protocol.errors import ConfigError, ConfigValidationError

pytestmark = pytest.mark.unit


class BusSection(ConfigModel):
    url: str = "nats://127.0.0.1:4222"
    request_timeout_s: float = Field(default=5.0, gt=0)
    retries: int = 3
    tls: bool = False
    secret: SecretStr | None = None
    name: str | None = None


class EnvSection(ConfigModel):
    backend: Literal["sim", "miniwob"] = "sim"
    pool_size: int = Field(default=4, ge=1)
    tags: list[str] = []


class RunConfig(ConfigModel):
    run_id: str = "run"
    bus: BusSection = BusSection()
    env: EnvSection = EnvSection()
    store_dir: Path | None = None


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_good_file(tmp_path: Path) -> None:
    path = write(tmp_path, "run_id: r7\nbus:\n  url: nats://bus:4222\n  retries: 5\nenv:\n  tags: [a, b]\n")
    cfg = load_config(RunConfig, path, environ={})
    assert cfg.run_id == "r7"
    assert cfg.bus.url == "nats://bus:4222" and cfg.bus.retries == 5
    assert cfg.bus.request_timeout_s == 5.0  # default kept
    assert cfg.env.tags == ["a", "b"]


def test_path_as_str_and_empty_file(tmp_path: Path) -> None:
    assert load_config(RunConfig, str(write(tmp_path, "")), environ={}) == RunConfig()
    assert load_config(RunConfig, None, environ={}) == RunConfig()


def test_env_overrides_nested_fields_with_yaml_scalars(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  retries: 1\n")
    env = {
        "DART_BUS__RETRIES": "9",
        "DART_BUS__REQUEST_TIMEOUT_S": "0.25",
        "DART_BUS__TLS": "true",
        "DART_ENV__TAGS": "[x, y]",
        "DART_RUN_ID": "0123",  # a string field takes the value verbatim, not as the number 123
        "DART_BUS__SECRET": "007",
        "DART_BUS__NAME": "null",
        "DART_STORE_DIR": "/data/store",
    }
    cfg = load_config(RunConfig, path, environ=env)
    assert (cfg.bus.retries, cfg.bus.request_timeout_s, cfg.bus.tls) == (9, 0.25, True)
    assert cfg.env.tags == ["x", "y"]
    assert cfg.run_id == "0123"
    assert cfg.bus.secret is not None and cfg.bus.secret.get_secret_value() == "007"
    assert cfg.bus.name is None
    assert cfg.store_dir == Path("/data/store")


def test_env_is_read_from_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DART_BUS__URL", "nats://from-env:4222")
    assert load_config(RunConfig, None).bus.url == "nats://from-env:4222"
    assert load_config(RunConfig, None, env_prefix=None).bus.url == "nats://127.0.0.1:4222"
    assert load_config(RunConfig, None, env_prefix="OTHER_").bus.url == "nats://127.0.0.1:4222"


def test_unrelated_prefixed_variables_are_ignored() -> None:
    # DART_NATS_SERVER and DART_S3_ENDPOINT configure tools, not this model.
    env = {
        "DART_NATS_SERVER": "/usr/bin/nats-server",
        "DART_S3_ENDPOINT": "http://s3",
        "DART_": "x",
        "DART_BUS____X": "1",
    }
    assert load_config(RunConfig, None, environ=env) == RunConfig()


def test_wrong_type_names_file_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  request_timeout_s: -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, path, environ={})
    err = info.value
    assert str(err).startswith(
        f"invalid config in {path} field 'bus.request_timeout_s': Input should be greater than 0"
    )
    assert (err.source, err.field) == (str(path), "bus.request_timeout_s")


def test_every_field_error_is_listed(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  retries: many\n  request_timeout_s: 0\nenv:\n  backend: chrome\n")
    with pytest.raises(ConfigValidationError) as info:
        load_config(RunConfig, path, environ={})
    fields = [field for _, field, _ in info.value.problems]
    assert fields == ["bus.request_timeout_s", "bus.retries", "env.backend"]
    message = str(info.value)
    assert "2 more" in message
    assert "field 'bus.retries': Input should be a valid integer" in message and "(got 'many')" in message
    assert "field 'env.backend': Input should be 'sim' or 'miniwob'" in message


def test_unknown_keys_fail_with_a_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  retires: 2\nextra: 1\n")
    with pytest.raises(ConfigValidationError) as info:
        load_config(RunConfig, path, environ={})
    problems = {field: detail for _, field, detail in info.value.problems}
    assert problems["bus.retires"].startswith("unknown key; did you mean 'retries'?")
    assert "valid keys here: bus, env, run_id, store_dir" in problems["extra"]


def test_unknown_nested_key_from_env_fails_and_blames_the_variable() -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_config(RunConfig, None, environ={"DART_BUS__URLL": "nats://x"})
    (source, field, _), *_ = info.value.problems
    assert (source, field) == ("environment variable DART_BUS__URLL", "bus.urll")


def test_bad_env_value_blames_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  retries: 2\n")
    with pytest.raises(ConfigError, match=r"in environment variable DART_BUS__RETRIES field 'bus.retries'"):
        load_config(RunConfig, path, environ={"DART_BUS__RETRIES": "lots"})


def test_secrets_are_not_echoed_in_errors() -> None:
    class Creds(ConfigModel):
        secret_key: int = 0

    with pytest.raises(ConfigError) as info:
        load_config(Creds, None, overrides={"secret_key": "hunter2"}, environ={})
    assert "hunter2" not in str(info.value) and "<hidden>" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"invalid config in .*nope.yaml: file not found") as info:
        load_config(RunConfig, missing)
    assert info.value.field == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("bus: [1\n", "invalid YAML at line 2"),
        ("a: 1\na: 2\n", "duplicate key 'a'"),
        ("- 1\n- 2\n", "expected a mapping of settings at the top level, got list"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(RunConfig, write(tmp_path, text), environ={})


def test_overrides_win_over_file_and_env(tmp_path: Path) -> None:
    path = write(tmp_path, "run_id: file\nbus:\n  url: nats://file:4222\n  retries: 1\n")
    cfg = load_config(
        RunConfig,
        path,
        environ={"DART_BUS__URL": "nats://env:4222", "DART_RUN_ID": "env"},
        overrides={"bus.url": "nats://override:4222", "env": {"pool_size": 8}},
    )
    assert cfg.bus.url == "nats://override:4222"
    assert cfg.run_id == "env"  # env beats the file
    assert cfg.bus.retries == 1  # untouched file values survive nested overrides
    assert cfg.env.pool_size == 8


def test_bad_override_is_blamed_on_overrides(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"in overrides field 'env.pool_size'"):
        load_config(RunConfig, write(tmp_path, "env:\n  pool_size: 2\n"), overrides={"env.pool_size": 0}, environ={})


def test_yaml_uses_the_core_schema() -> None:
    data = parse_yaml("a: no\nb: on\nc: 010\nd: 0x1F\ne: 1:30\nf: 2024-01-02\ng: ~\nh: TRUE\ni: 1e3\nj: .inf\n")
    assert data == {
        "a": "no",
        "b": "on",
        "c": 10,
        "d": 31,
        "e": "1:30",
        "f": "2024-01-02",
        "g": None,
        "h": True,
        "i": 1000.0,
        "j": float("inf"),
    }


def test_dump_config_roundtrips(tmp_path: Path) -> None:
    cfg = RunConfig(run_id="r1", bus=BusSection(retries=7, tls=True), env=EnvSection(tags=["a"]), store_dir=Path("/s"))
    text = dump_config(cfg)
    assert text.startswith("run_id: r1\n")
    assert load_config(RunConfig, write(tmp_path, text), environ={}) == cfg
    assert dump_config(cfg, exclude_defaults=True).splitlines()[0] == "run_id: r1"
    masked = dump_config(RunConfig(bus=BusSection(secret=SecretStr("s3cr3t"))))
    assert "s3cr3t" not in masked


def test_a_file_extends_another_and_states_only_what_differs(tmp_path: Path) -> None:
    base = "run_id: base\nbus:\n  url: nats://base:4222\n  retries: 5\nenv:\n  tags: [a]\n"
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "variants").mkdir()
    variant = tmp_path / "variants" / "v.yaml"
    variant.write_text("extends: ../base.yaml\nbus:\n  retries: 7\nenv:\n  tags: [b]\n")
    config = load_config(RunConfig, variant, environ={})
    assert (config.run_id, config.bus.url, config.bus.retries) == ("base", "nats://base:4222", 7)
    assert config.env.tags == ["b"]  # lists are replaced, not appended


def test_extends_cycles_and_bad_values_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(RunConfig, tmp_path / "a.yaml", environ={})
    (tmp_path / "c.yaml").write_text("extends: 3\n")
    with pytest.raises(ConfigError, match="c.yaml.*extends"):
        load_config(RunConfig, tmp_path / "c.yaml", environ={})
    (tmp_path / "d.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(ConfigError, match="file not found"):
        load_config(RunConfig, tmp_path / "d.yaml", environ={})
