"""The multi-host recipe (docs/deployment.md), run here: four hosts that share nothing but NATS and S3.

Each "host" is its own working directory with its own config file (the shared sections plus its service's
own), its own copy of the initial checkpoint where it needs one, its own NATS user (permissions limited
to its subjects), and runs its package's command (``dart-env serve`` ...). Nothing else connects them:
no shared run directory, no ``dart run``. The job runs until the trainer host has published two versions
and the rollout host has produced trajectories with a version it fetched from S3; then every host stops
on SIGTERM with exit code 0, and every trajectory on the bus is in the data host's index exactly once.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from dart.cli.stack.secrets import write_bus_credentials
from dart.embedded.nats import EmbeddedNats, NatsUser
from dart.embedded.s3 import EmbeddedS3
from dart.protocol.messages import ModelVersion
from dart.protocol.permissions import service_permissions
from dart.protocol.topology import LATEST_MODEL_KEY, ROLES, Role
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.topology import durable_name, ensure_topology

pytestmark = pytest.mark.e2e

RUN = "multihost"
ORDER: tuple[Role, ...] = ("env", "data", "train", "rollout")


def _sections(service: str, host: Path, model: Path | None) -> dict[str, Any]:
    if service == "env":
        return {"env": {"pool": "sim", "instances": 4}}
    if service == "data":
        return {
            "suite": "builtin:smoke",
            "data": {
                "database_url": f"sqlite:///{host / 'data.sqlite3'}",
                # A random policy solves nothing: keep its all-zero groups so batches (and versions) flow.
                "grouping": {"timeout_s": 60, "drop_zero_variance": False},
                "curation": {"default_rollouts": 2, "min_rollouts": 2, "max_rollouts": 2},
                "emission": {"decoupled": {"max_outstanding": 8}},
                "batching": {"min_samples": 4, "max_groups": 2},
            },
        }
    assert model is not None
    if service == "train":
        return {"train": {"model_path": str(model), "publish_every": 1, "micro_batch_size": 4}}
    engine = {"kind": "hf", "model_path": str(model), "device": "cpu", "dtype": "float32", "num_threads": 1}
    runner = {"pool": "sim", "max_new_tokens": 24, "prompt": {"max_images": 1}}
    return {"rollout": {"engine": engine, "num_engines": 1, "runners": 4, "runner": runner}}


def _newest_version_used(database: Path) -> int:
    if not database.is_file():
        return -1
    with sqlite3.connect(database) as db:
        (newest,) = db.execute("SELECT COALESCE(MAX(max_policy_version), -1) FROM trajectories").fetchone()
    return int(newest)


def _stored(database: Path) -> tuple[int, int]:
    """(trajectories in the index, distinct work items among them)."""
    with sqlite3.connect(database) as db:
        rows, works = db.execute("SELECT COUNT(*), COUNT(DISTINCT work_id) FROM trajectories").fetchone()
    return int(rows), int(works)


async def _observe(url: str, password_file: Path, until: float, database: Path) -> tuple[int, int]:
    """As the ``run`` role: wait for version 2 and a trajectory made with a fetched version; (newest, produced)."""
    config = BusConfig(url=url, run=RUN, user="run", password_file=password_file, name="observer")
    async with await Bus.connect(config) as bus:
        state = await ensure_topology(bus)
        while True:
            latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
            version = latest.version if latest else 0
            if version >= 2 and _newest_version_used(database) >= 1:
                break
            assert time.monotonic() < until, f"only version {version} published within the limit"
            await asyncio.sleep(1.0)
        return version, (await bus.stream_state("traj")).messages


async def _drained(url: str, password_file: Path, until: float) -> int:
    """Wait until the data host has acknowledged every trajectory on the bus; returns how many there are."""
    config = BusConfig(url=url, run=RUN, user="run", password_file=password_file, name="observer")
    async with await Bus.connect(config) as bus:
        while True:
            consumer = await bus.consumer_state("traj", durable_name(bus, "traj"))
            if consumer.num_pending == 0 and consumer.num_ack_pending == 0:
                return (await bus.stream_state("traj")).messages
            assert time.monotonic() < until, "the data host did not take every trajectory"
            await asyncio.sleep(0.5)


def test_four_hosts_that_share_only_nats_and_s3_run_the_job(tmp_path: Path, s3_server: EmbeddedS3) -> None:
    from dart.policy.tiny import write_tiny_checkpoint

    secrets = tmp_path / "secrets"  # in a deployment each host gets only its own file
    credentials = write_bus_credentials(secrets, ROLES)
    keys = tmp_path / "s3-keys"
    keys.mkdir(mode=0o700)
    (keys / "access").write_text(s3_server.access_key)
    (keys / "secret").write_text(s3_server.secret_key)
    checkpoint = tmp_path / "checkpoint"
    write_tiny_checkpoint(checkpoint, seed=0)

    users = [NatsUser(role, path, service_permissions(role, "dart.v1", RUN)) for role, path in credentials.items()]
    with EmbeddedNats(users=users, store_dir=tmp_path / "nats") as nats:
        procs: dict[str, subprocess.Popen[bytes]] = {}
        hosts: dict[str, Path] = {}
        try:
            # The run's streams, consumers and bucket first, as the run user: the services may only bind to them.
            admin = tmp_path / "host-admin"
            admin.mkdir()
            bus = {"url": nats.url, "user": "run", "password_file": str(credentials["run"])}
            (admin / "run.yaml").write_text(yaml.safe_dump({"run": {"name": RUN}, "bus": bus}))
            dart = str(Path(sys.executable).parent / "dart")
            made = subprocess.run([dart, "topology", "--config", "run.yaml"], cwd=admin, capture_output=True, text=True)
            assert made.returncode == 0, made.stderr[-2000:]
            assert json.loads(made.stdout.strip().splitlines()[-1])["run"] == RUN
            for service in ORDER:
                host = hosts[service] = tmp_path / f"host-{service}"
                host.mkdir()
                model = None
                if service in ("train", "rollout"):  # each GPU host has its own copy of the initial checkpoint
                    model = host / "checkpoint"
                    shutil.copytree(checkpoint, model)
                config = {
                    "run": {"name": RUN, "run_dir": str(host / "run"), "torch_threads": 1},
                    "bus": {"url": nats.url, "user": service, "password_file": str(credentials[service])},
                    "store": {
                        "uri": "s3://dart-multihost/artifacts",
                        "endpoint": s3_server.url,
                        "region": s3_server.region,
                        "access_key_file": str(keys / "access"),
                        "secret_key_file": str(keys / "secret"),
                    },
                    **_sections(service, host, model),
                }
                (host / "run.yaml").write_text(yaml.safe_dump(config))
                with (host / "service.log").open("wb") as log:
                    command = [str(Path(sys.executable).parent / f"dart-{service}"), "serve", "--config", "run.yaml"]
                    procs[service] = subprocess.Popen(command, cwd=host, stdout=log, stderr=log)

            until = time.monotonic() + 1200.0
            database = hosts["data"] / "data.sqlite3"
            try:
                version, _ = asyncio.run(_observe(nats.url, credentials["run"], until, database))
            except AssertionError:
                dead = {s: p.returncode for s, p in procs.items() if p.poll() is not None}
                logs = {s: (hosts[s] / "service.log").read_text()[-2000:] for s in procs}
                raise AssertionError(f"exited: {dead}; logs: {logs}") from None
            assert version >= 2

            # Stop the producer first, let the data host take what is in flight, then the rest.
            codes = {}
            procs["rollout"].send_signal(signal.SIGTERM)
            codes["rollout"] = procs["rollout"].wait(timeout=300)
            produced = asyncio.run(_drained(nats.url, credentials["run"], time.monotonic() + 300.0))
            for service in ("data", "train", "env"):
                procs[service].send_signal(signal.SIGTERM)
                codes[service] = procs[service].wait(timeout=300)
            logs = {s: (hosts[s] / "service.log").read_text()[-2000:] for s in procs if codes[s] != 0}
            assert codes == dict.fromkeys(("rollout", "data", "train", "env"), 0), logs

            stored, works = _stored(database)
            assert produced > 0 and stored == produced == works, (produced, stored, works)
            # Every host wrote only under its own directory: its telemetry, nothing of the others'.
            for name, host in hosts.items():
                assert (host / "run" / "telemetry" / f"{name}.jsonl").is_file()
                others = {p.name for p in (host / "run" / "telemetry").iterdir()} - {f"{name}.jsonl"}
                assert not others, (name, others)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
