"""The env pool ``dart serve env`` starts runs the suite its run config names (``dart run``'s config always names
one), unless ``env.suites`` names the pool's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from dart.cli.stack.config import RunConfig, load_run_config
from dart.cli.stack.services import served
from dart.env.serve import EnvServeConfig
from dart.env.service import EnvServiceConfig
from dart.protocol.config import dump_config

pytestmark = pytest.mark.unit


def pool(config: RunConfig) -> EnvServiceConfig:
    serve_config, _ = served(config, "env")
    assert isinstance(serve_config, EnvServeConfig)
    return serve_config.pool()


def test_the_env_pool_runs_the_suite_its_run_config_names(tmp_path: Path) -> None:
    run = {"run_dir": str(tmp_path)}
    assert pool(RunConfig(suite="builtin:train", run=run)).suites == ("builtin:train",)
    assert pool(RunConfig(suite="builtin:train", env={"suites": ["mine.yaml"]}, run=run)).suites == ("mine.yaml",)
    # A config that names no suite: the pool runs the tasks its backend generates from their ids.
    assert pool(RunConfig(run=run)).suites == ()
    # What dart run writes for its services names the suite, the default one included.
    written = tmp_path / "config.yaml"
    written.write_text(dump_config(RunConfig(run=run)))
    assert pool(load_run_config(written)).suites == ("builtin:smoke",)
