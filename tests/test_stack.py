"""The compose stack (deploy/docker-compose.yml), built and run for real on this machine.

It builds the images (``scripts/build-images.sh --local-base --offline-infra``: base image made with
mmdebstrap, every locked wheel downloaded on the host; the root conftest's ``built_images`` starts the build
in the background when this test is collected), brings up the parts that run without an image
registry (deploy/docker-compose.offline.yml: NATS with per-service users, an S3 store, PostgreSQL,
Prometheus, the checkpoint writer and the four DART services on the smoke job in deploy/dart/run.yaml),
and checks:

- the job runs: the trainer publishes version 2 and the rollout service produces trajectories with a
  version it fetched from the store;
- the env image carries no torch;
- a service that dies is restarted: the data manager's process is SIGKILLed, its container restarts
  (``restart: on-failure``) and the trainer publishes two more versions;
- the deployment restarts where it was: every service stopped (exit 0), ``down`` (volumes kept) and ``up``;
  the trainer resumes from the checkpoint it wrote at its stop (the `checkpoints` volume) at the newest
  version and publishes the next, and a trajectory made with that next version is stored;
- NATS refuses a client without credentials and one with another role's password;
- the S3 store admits each service (and the viewer) with its own identity only where its role's grants
  allow: every read, write and delete outside them is refused (AccessDenied), and no service was refused
  while the job ran;
- Prometheus scrapes all four services and has DART metrics from each; every expression of the Grafana
  dashboard parses, and those not about held-out validation return data;
- `dart view --config deploy/dart/run.yaml` serves the running job (headless Chromium): its overview
  updates itself, a trajectory's page shows its screenshots;
- nothing is lost: the rollout service stops first (exit 0), the data manager takes every trajectory on
  the bus, the others stop (exit 0), and PostgreSQL's index holds each trajectory on the bus exactly once.

Then it tears everything down (containers, network, volumes). Needs root, a running docker daemon and
docker-compose; skipped with the reason where one is missing, failed instead with ``DART_REQUIRE_DOCKER=1``
(``.ci/run`` installs and starts them as root and sets it). About 5 minutes on 2 cores without any
image present but the base (308 s on 2026-11-29: 185 s building the images and starting the stack, 107 s
of checks).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from minio import Minio
from minio.error import S3Error

from dart.cli.stack.compose_store import COMPOSE_STORE_ROLES, access_key, secret_variable
from dart.protocol.messages import ModelVersion
from dart.protocol.topology import LATEST_MODEL_KEY, ROLES
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.ports import free_ports
from dart.runtime.store.grants import StoreRole
from dart.runtime.topology import durable_name, ensure_topology

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parent.parent
TAG = tomllib.loads((REPO / "packages" / "dart-protocol" / "pyproject.toml").read_text())["project"]["version"]
DEPLOY = REPO / "deploy"
PROJECT = "dartstacktest"
RUN = "dart"  # run.name of deploy/dart/run.yaml
INFRA = ("nats", "s3", "postgres", "prometheus")
SERVICES = ("env", "data", "train", "rollout")
JOB_LIMIT_S = 1500.0
STORE_BUCKET, STORE_PREFIX = "dart", "run"  # store.uri of deploy/dart/run.yaml
STORE_PREFIXES = ("screenshots", "trajectories", "weights")
STORE_ALLOWED: dict[StoreRole, dict[str, set[str]]] = {
    # role: access -> the prefixes where it is allowed (everywhere else it must be refused)
    "env": {"read": {"screenshots"}, "write": {"screenshots"}, "delete": set()},
    "rollout": {"read": {"screenshots", "weights"}, "write": {"screenshots"}, "delete": set()},
    "train": {"read": set(STORE_PREFIXES), "write": {"weights"}, "delete": {"weights"}},
    "data": {"read": set(STORE_PREFIXES), "write": {"trajectories"}, "delete": {"screenshots", "trajectories"}},
    "view": {"read": set(STORE_PREFIXES), "write": set(), "delete": set()},
}


def _docker_missing() -> str | None:
    if os.geteuid() != 0:
        return "it kills a container's process from the host: run it as root"
    for tool in ("docker", "docker-compose", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if info.returncode != 0:
        return f"the docker daemon does not answer: {info.stderr.strip()[-200:]}"
    return None


class Stack:
    """One compose project of the stack: its env file (fresh secrets and ports) and commands."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.passwords = {role: secrets.token_hex(16) for role in ROLES}
        names = ("NATS", "S3", "POSTGRES", "PROMETHEUS")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))  # distinct: each is published
        self.postgres_password = secrets.token_hex(16)
        self.s3_secrets = {role: secrets.token_hex(20) for role in COMPOSE_STORE_ROLES}
        self.s3_admin = (secrets.token_hex(10), secrets.token_hex(20))
        values = {f"DART_NATS_{role.upper()}_PASSWORD": pw for role, pw in self.passwords.items()}
        values |= {secret_variable(role): secret for role, secret in self.s3_secrets.items()}
        values |= {
            "DART_S3_ADMIN_ACCESS_KEY": self.s3_admin[0],
            "DART_S3_ADMIN_SECRET_KEY": self.s3_admin[1],
            "DART_POSTGRES_PASSWORD": self.postgres_password,
            "DART_GRAFANA_PASSWORD": secrets.token_hex(10),
            "DART_OTLP_TRACES_ENDPOINT": "",  # no collector here
        }
        values |= {f"DART_{name}_PORT": str(port) for name, port in self.ports.items()}
        self.env_file = workdir / "stack.env"
        fd = os.open(self.env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in values.items())

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        argv = [
            "docker-compose",
            "--project-name",
            PROJECT,
            "--file",
            str(DEPLOY / "docker-compose.yml"),
            "--file",
            str(DEPLOY / "docker-compose.offline.yml"),
            "--env-file",
            str(self.env_file),
            *args,
        ]
        # docker-compose takes a variable from its own environment before the env file: DART_* values that
        # earlier tests in this process left there (another run's S3 keys) would replace the stack's.
        env = {k: v for k, v in os.environ.items() if not k.startswith("DART_")}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=DEPLOY, env=env)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-3000:]}")
        return done

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def inspect(self, service: str, template: str) -> Any:
        """One field of the service's container (``docker inspect -f``), parsed as JSON when it is."""
        out = subprocess.run(
            ["docker", "inspect", "-f", template, self.container(service)], capture_output=True, text=True, check=True
        ).stdout.strip()
        try:
            return json.loads(out)
        except ValueError:
            return out

    def exit_code(self, service: str) -> int:
        assert self.inspect(service, "{{.State.Running}}") is False, f"{service} is still running"
        return int(self.inspect(service, "{{.State.ExitCode}}"))

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", *services, check=False).stdout

    def bus_config(self, user: str, password: str | None = None) -> BusConfig:
        """A client of the stack's NATS as ``user``, with its password unless another is given."""
        password_file = self.workdir / f"nats-{user}-{secrets.token_hex(4)}.password"
        fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password if password is not None else self.passwords[user])
        url = f"nats://127.0.0.1:{self.ports['NATS']}"
        return BusConfig(url=url, run=RUN, user=user, password_file=password_file, name="stack-test")

    def sql(self, query: str) -> tuple[Any, ...]:
        rows = self.sql_rows(query)
        assert rows, query
        return rows[0]

    def sql_rows(self, query: str) -> list[tuple[Any, ...]]:
        import psycopg

        dsn = f"host=127.0.0.1 port={self.ports['POSTGRES']} dbname=dart user=dart password={self.postgres_password}"
        with psycopg.connect(dsn, connect_timeout=5) as db:
            return [tuple(row) for row in db.execute(query).fetchall()]

    def s3(self, role: StoreRole | None) -> Minio:
        """A client of the stack's S3 store as ``role`` (None: the administrator)."""
        keys = self.s3_admin if role is None else (access_key(role), self.s3_secrets[role])
        return Minio(f"127.0.0.1:{self.ports['S3']}", *keys, secure=False, region="us-east-1")

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['PROMETHEUS']}"

    def prometheus(self, query: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return list(body["data"]["result"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    missing = _docker_missing()
    if missing is not None:
        reason = f"the stack test needs root, docker, docker-compose and mmdebstrap: {missing}"
        if os.environ.get("DART_REQUIRE_DOCKER") == "1":
            pytest.fail(f"{reason}, and DART_REQUIRE_DOCKER=1")
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("stack")
    # The root conftest started the build when this test was collected; it is waited for here.
    code, build_log = request.getfixturevalue("built_images")
    shutil.copyfile(build_log, workdir / "build-images.log")
    # The wheels the images were built from (~4 GB) are not needed again here.
    shutil.rmtree(REPO / "deploy" / "build", ignore_errors=True)
    assert code == 0, build_log.read_text()[-4000:]
    stack = Stack(workdir)
    stack.compose("down", "--volumes", "--remove-orphans", check=False)  # leftovers of an interrupted run
    try:
        stack.compose("up", "--detach", *INFRA, "model", *SERVICES, timeout=1200)
        yield stack
    finally:
        (workdir / "compose.log").write_text(stack.logs())
        # Nothing is checked after this point: the services get 5 s to stop, not the rollout's 30 s finishing window.
        stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "5", check=False)
        # The images this test built (~8 GB) go with it; the local base image stays for the next build.
        images = [f"{name}:{TAG}" for name in ("dart", "dart-env", "dart-postgres", "dart-prometheus")]
        subprocess.run(["docker", "image", "rm", "--force", *images], capture_output=True, check=False)


async def _refused(config: BusConfig) -> str:
    try:
        bus = await Bus.connect(config)
    except Exception as exc:  # the bus wraps nats' errors; any refusal is what this checks
        return f"{type(exc).__name__}: {exc}"
    await bus.close()
    return ""


async def _wait_for_version(stack: Stack, target: int, until: float, *, used: int = -1) -> int:
    """As the ``run`` role: wait for version ``target`` and a stored trajectory made with version ``used``
    or later (a version the rollout service fetched from the store); returns the newest version."""
    async with await Bus.connect(stack.bus_config("run")) as bus:
        state = await ensure_topology(bus)
        while True:
            latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
            version = latest.version if latest else 0
            newest_used = -1
            if version >= target:
                (newest_used,) = stack.sql("SELECT COALESCE(MAX(max_policy_version), -1) FROM trajectories")
                if newest_used >= used:
                    return version
            assert time.monotonic() < until, f"only version {version} (trajectories with {newest_used}) in time"
            await asyncio.sleep(2.0)


async def _drained(stack: Stack, until: float) -> int:
    """Wait until the data manager has acknowledged every trajectory on the bus; how many there are."""
    async with await Bus.connect(stack.bus_config("run")) as bus:
        while True:
            consumer = await bus.consumer_state("traj", durable_name(bus, "traj"))
            if consumer.num_pending == 0 and consumer.num_ack_pending == 0:
                return (await bus.stream_state("traj")).messages
            assert time.monotonic() < until, "the data manager did not take every trajectory"
            await asyncio.sleep(1.0)


def _the_viewer_on_the_running_stack(stack: Stack, browser: Any, no_js_errors: Any) -> None:
    """`dart view --config deploy/dart/run.yaml` from this host (the published ports and the stack's
    credentials in the environment, as the services take them): the overview updates itself while the job
    runs, and a trajectory's page shows its steps and screenshots, read from PostgreSQL and S3."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    # Only what the viewer needs (its own store identity): earlier tests in this process leave other runs'
    # store keys in its environment.
    keys = {}
    for name, value in (("DART_S3_ACCESS_KEY", access_key("view")), ("DART_S3_SECRET_KEY", stack.s3_secrets["view"])):
        keys[name] = stack.workdir / f"{name.lower()}.key"
        fd = os.open(keys[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)
    env = {
        **{k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ},
        "DART_DATA__DATABASE_URL": f"postgresql+psycopg://dart@127.0.0.1:{stack.ports['POSTGRES']}/dart",
        "PGPASSWORD": stack.postgres_password,
        "DART_STORE__ENDPOINT": f"http://127.0.0.1:{stack.ports['S3']}",
        "DART_STORE__ACCESS_KEY_FILE": str(keys["DART_S3_ACCESS_KEY"]),
        "DART_STORE__SECRET_KEY_FILE": str(keys["DART_S3_SECRET_KEY"]),
    }
    argv = [sys.executable, "-m", "dart.cli", "view", "--config", str(DEPLOY / "dart" / "run.yaml"), "--port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(120), "dart view printed no URL in 120 s"
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (url, proc.poll())
        wait = WebDriverWait(browser, 180)
        browser.get(url)
        assert browser.find_element(By.ID, "live")
        stored = int(browser.find_element(By.ID, "stored").text)
        # The page fetches itself again every few seconds: the count grows with no reload.
        wait.until(lambda b: int(b.find_element(By.ID, "stored").text) > stored)
        assert int(browser.execute_script("return document.body.dataset.refreshed")) >= 1
        no_js_errors(browser, "overview of the running stack")
        browser.get(url + "trajectories")
        listed = browser.find_elements(By.CSS_SELECTOR, "#trajectories tr[class^=status-] a.trajectory")
        assert listed, "the trajectory list of the running job is empty"
        # Pages the viewer can serve: stored with steps and not pruned, the newest first (retention deletes
        # the objects of trajectories trained on and older than the kept versions, and on a slow machine the
        # job moves on between the list and the page: the oldest of a list page may go in the meantime).
        newest = stack.sql_rows(
            "SELECT trajectory_id FROM trajectories WHERE num_steps > 0 AND pruned_at IS NULL"
            " ORDER BY max_policy_version DESC, finished_at DESC LIMIT 5"
        )
        links = [f"{url}trajectories/{urllib.parse.quote(tid, safe='')}" for (tid,) in newest]
        assert links, "no stored trajectory of the running job has a step"
        # The first of them whose page shows an observation; what each page said instead otherwise.
        said = {}
        loaded = "return arguments[0].complete && arguments[0].naturalWidth"
        for link in links:
            browser.get(link)
            images = browser.find_elements(By.CSS_SELECTOR, "section.step figure.observation img")
            if images:
                shown = images[0]
                wait.until(lambda b: b.execute_script(loaded, shown))  # noqa: B023  # used before the loop moves on
                break
            notes = browser.find_elements(By.CSS_SELECTOR, "#error, p.missing")
            said[link] = [n.text for n in notes] or browser.find_element(By.TAG_NAME, "main").text[:500]
        else:
            raise AssertionError(f"no trajectory page showed an observation: {said}")
        no_js_errors(browser, "a trajectory of the running stack")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]


def _stop_cleanly(stack: Stack, *, drain: bool = False) -> int:
    """Stop the producer first, then the rest; each service exits 0. With ``drain``, the data manager takes every
    trajectory on the bus before it stops; returns how many there are (0 without)."""
    stack.compose("stop", "--timeout", "300", "rollout", timeout=400)
    assert stack.exit_code("rollout") == 0, stack.logs("rollout")
    produced = asyncio.run(_drained(stack, time.monotonic() + 300.0)) if drain else 0
    stack.compose("stop", "--timeout", "300", "data", "train", "env", timeout=400)
    codes = {service: stack.exit_code(service) for service in SERVICES}
    assert codes == dict.fromkeys(SERVICES, 0), (codes, stack.logs(*SERVICES))
    return produced


def _down_and_up(stack: Stack, until: float) -> int:
    """A deployment restarted as a whole continues where it was: every service stops cleanly (the trainer
    writes a checkpoint to the `checkpoints` volume), ``down`` without ``-v`` removes the containers and the
    network, ``up`` brings them back; the trainer resumes from that checkpoint at the newest published
    version (not from the published weights, not from the base), publishes the next, and a trajectory made
    with that next version is stored (the engines took it). Returns the newest version."""
    _stop_cleanly(stack)
    (stack.workdir / "compose-before-down.log").write_text(stack.logs())
    version = asyncio.run(_wait_for_version(stack, 1, until))  # the newest announced before the stop
    stack.compose("down", "--timeout", "60", timeout=400)
    stack.compose("up", "--detach", *INFRA, "model", *SERVICES, timeout=1200)
    try:
        newest = asyncio.run(_wait_for_version(stack, version + 1, until, used=version + 1))
    except AssertionError as exc:
        raise AssertionError(f"after down and up: {exc}\n{stack.logs(*SERVICES)}") from None
    train_log = stack.compose("logs", "--no-color", "train").stdout
    resumed = re.search(r"resumed from /var/lib/dart/checkpoints/step-\d+ at step \d+, version (\d+)", train_log)
    assert resumed is not None and int(resumed.group(1)) == version, (version, train_log[-3000:])
    return newest


def _store_refused(client: Minio, access: str, key: str) -> bool:
    """Whether ``access`` to ``key`` is refused as the client's identity (not found counts as admitted)."""
    try:
        if access == "read":
            client.get_object(STORE_BUCKET, key).close()
        elif access == "write":
            client.put_object(STORE_BUCKET, key, io.BytesIO(b"probe"), 5)
        else:
            client.remove_object(STORE_BUCKET, key)  # of a missing key: admitted or refused, nothing removed
    except S3Error as exc:
        if exc.code == "AccessDenied":
            return True
        assert exc.code == "NoSuchKey", (access, key, exc)
    return False


def _store_least_privilege(stack: Stack) -> None:
    """Each store identity of the running stack reads, writes and deletes only where its role may."""
    admin = stack.s3(None)
    wrong = []
    for prefix in STORE_PREFIXES:
        found = next(iter(admin.list_objects(STORE_BUCKET, f"{STORE_PREFIX}/{prefix}/", recursive=True)), None)
        existing = found.object_name if found is not None else f"{STORE_PREFIX}/{prefix}/missing"
        for role, allowed in STORE_ALLOWED.items():
            client = stack.s3(role)
            for access, where in allowed.items():
                if access == "write" and prefix in where:
                    continue  # the job's own writes show these; a probe would leave an object behind
                key = existing if access == "read" else f"{STORE_PREFIX}/{prefix}/access-probe-{role}"
                if _store_refused(client, access, key) != (prefix not in where):
                    wrong.append(f"{role} {access} {prefix}: {'refused' if prefix in where else 'admitted'}")
    assert not wrong, wrong
    # A wrong secret is refused too.
    with pytest.raises(S3Error, match="SignatureDoesNotMatch|InvalidAccessKeyId|AccessDenied"):
        Minio(
            f"127.0.0.1:{stack.ports['S3']}", access_key("view"), "wrong", secure=False, region="us-east-1"
        ).get_object(STORE_BUCKET, existing)


def test_the_compose_stack_runs_the_job_with_nothing_lost(stack: Stack, browser: Any, no_js_errors: Any) -> None:
    until = time.monotonic() + JOB_LIMIT_S
    try:
        version = asyncio.run(_wait_for_version(stack, 2, until, used=1))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.logs(*SERVICES)}") from None

    # Least privilege in the store: each service's identity is refused outside its role's prefixes.
    _store_least_privilege(stack)

    # The env image carries no torch (an env host installs no GPU stack).
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    no_torch = subprocess.run(["docker", "run", "--rm", f"dart-env:{TAG}", "python3", "-c", probe], capture_output=True)
    assert no_torch.returncode == 0, no_torch.stderr

    # A service that dies is restarted (restart: on-failure) and the job goes on: SIGKILL the data
    # manager's process from the host (`docker kill` would count as a manual stop, never restarted).
    os.kill(stack.inspect("data", "{{.State.Pid}}"), signal.SIGKILL)
    while not (stack.inspect("data", "{{.RestartCount}}") >= 1 and stack.inspect("data", "{{.State.Running}}")):
        assert time.monotonic() < until, "the killed data manager was not restarted"
        time.sleep(1.0)
    try:
        version = asyncio.run(_wait_for_version(stack, version + 2, until))
    except AssertionError as exc:
        raise AssertionError(f"after the restart: {exc}\n{stack.logs(*SERVICES)}") from None

    version = _down_and_up(stack, until)

    # Credentials are required, and a password is only good for its own role.
    anonymous = BusConfig(url=f"nats://127.0.0.1:{stack.ports['NATS']}", run=RUN, connect_timeout_s=5.0)
    assert "Authorization" in asyncio.run(_refused(anonymous))
    assert "Authorization" in asyncio.run(_refused(stack.bus_config("env", stack.passwords["data"])))

    # Prometheus scrapes every service, and each serves DART metrics (once it has recorded some).
    def with_metrics() -> set[str]:
        found = stack.prometheus('count by (service) ({job="dart", __name__=~"dart_.+"})')
        return {r["metric"].get("service", "") for r in found}

    while with_metrics() != set(SERVICES):
        assert time.monotonic() < until, f"Prometheus has DART metrics only from {with_metrics()}"
        time.sleep(2.0)
    # Every dashboard query parses and (held-out validation aside) has data: rates need two scrapes
    # of a series within their window, so wait for that too.
    check = [sys.executable, str(REPO / "scripts" / "check_dashboards.py"), "--prometheus", stack.prometheus_url]
    while (dashboards := subprocess.run(check, capture_output=True, text=True, timeout=120)).returncode != 0:
        assert time.monotonic() < until, dashboards.stdout[-3000:] + dashboards.stderr[-2000:]
        time.sleep(5.0)

    _the_viewer_on_the_running_stack(stack, browser, no_js_errors)

    produced = _stop_cleanly(stack, drain=True)
    rows, works = stack.sql("SELECT COUNT(*), COUNT(DISTINCT work_id) FROM trajectories")
    assert produced > 0 and rows == produced == works, (produced, rows, works)
    # No service was refused by the store while the job ran: each stayed within its role's prefixes.
    service_logs = stack.compose("logs", "--no-color", *SERVICES).stdout
    assert "AccessDenied" not in service_logs, [line for line in service_logs.splitlines() if "AccessDenied" in line]
