"""No secret in a run directory: a real service runs with a NATS password and S3 keys from files,
then every file it left (config.yaml, logs, telemetry JSONL, summary) is searched for them."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dart.cli.stack.config import load_run_config, store_config
from dart.cli.stack.secrets import service_environment, write_bus_credentials
from dart.cli.stack.services import serve
from dart.embedded.nats import EmbeddedNats, NatsUser
from dart.embedded.s3 import EmbeddedS3
from dart.protocol.config import dump_config
from dart.protocol.errors import BusAuthError, StoreError
from dart.protocol.permissions import service_permissions
from dart.protocol.topology import ROLES
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.store import open_store
from dart.runtime.topology import ensure_topology

pytestmark = pytest.mark.integration

RUN = "secretrun"


@pytest.fixture
def debug_log(tmp_path: Path) -> Iterator[Path]:
    """Everything logged at DEBUG, by any library, into the run's log file (as `dart serve` would)."""
    path = tmp_path / "run" / "logs" / "data.log"
    path.parent.mkdir(parents=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        handler.close()


async def test_a_served_service_leaves_no_secret_in_the_run_directory(
    tmp_path: Path, s3_server: EmbeddedS3, debug_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = debug_log.parents[1]
    credentials = write_bus_credentials(run_dir, ROLES)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in credentials.values())
    key_dir = tmp_path / "s3-keys"
    key_dir.mkdir(mode=0o700)
    (key_dir / "access").write_text(s3_server.access_key)
    (key_dir / "secret").write_text(s3_server.secret_key)
    users = [NatsUser(r, f, service_permissions(r, "dart.v1", RUN)) for r, f in credentials.items()]
    with EmbeddedNats(users=users, store_dir=run_dir / "nats") as nats:
        source = run_dir / "source.yaml"
        source.write_text(
            json.dumps(
                {
                    "run": {"name": RUN, "run_dir": str(run_dir)},
                    "bus": {"url": nats.url},
                    "store": {
                        "uri": "s3://dart-secret-test/run",
                        "endpoint": s3_server.url,
                        "region": s3_server.region,
                        "access_key_file": str(key_dir / "access"),
                        "secret_key_file": str(key_dir / "secret"),
                    },
                    "data": {"database_url": f"sqlite:///{run_dir / 'data.sqlite3'}"},
                }
            )
        )
        for name, value in service_environment("data", credentials["data"]).items():
            monkeypatch.setenv(name, value)
        config = load_run_config(source)
        assert config.bus.user == "data" and config.bus.password_file == credentials["data"]
        (run_dir / "config.yaml").write_text(dump_config(config))

        # The data service, as `dart serve data` runs it, until it has started and stored something.
        stop = asyncio.Event()
        task = asyncio.create_task(serve(config, "data", stop))
        # Store calls are blocking HTTP: off the event loop, which the service task shares.
        await asyncio.to_thread(lambda: open_store(store_config(config)).put("probe", b"artifact"))
        async with await Bus.connect(
            BusConfig(url=nats.url, run=RUN, user="run", password_file=credentials["run"])
        ) as bus:
            await ensure_topology(bus)
            for _ in range(600):
                if (run_dir / "telemetry" / "data.jsonl").exists() and (await bus.stream_state("work")).messages:
                    break
                await asyncio.sleep(0.1)
            assert (await bus.stream_state("work")).messages > 0  # it connected and published as `data`
        stop.set()
        await asyncio.wait_for(task, timeout=60)

        # Refusals are logged with what went wrong, never with the secret tried.
        wrong = secrets.token_urlsafe(24)
        monkeypatch.setenv("DART_TEST_WRONG", wrong)
        with pytest.raises(BusAuthError) as refused:
            await Bus.connect(BusConfig(url=nats.url, user="data", password_env="DART_TEST_WRONG"))
        logging.getLogger("test").error("bus refused: %s", refused.value)
        (key_dir / "secret").write_text(wrong)
        with pytest.raises(StoreError) as denied:
            await asyncio.to_thread(lambda: open_store(store_config(config)).put("probe2", b"x"))
        logging.getLogger("test").error("store refused: %s", denied.value)
    (run_dir / "summary.json").write_text(json.dumps({"ok": True}))

    secrets_used = [s3_server.secret_key, s3_server.access_key, wrong]
    assert_no_secret_in(run_dir, secrets_used + [p.read_text().strip() for p in credentials.values()])


def assert_no_secret_in(run_dir: Path, secret_values: list[str]) -> None:
    """No file of ``run_dir`` outside ``secrets/`` contains any of ``secret_values``."""
    debug_log = run_dir / "logs" / "data.log"
    assert "DEBUG" in debug_log.read_text()  # the search below covers a real, verbose log
    assert (run_dir / "telemetry" / "data.jsonl").stat().st_size > 0
    leaks = [
        str(path.relative_to(run_dir))
        for path in run_dir.rglob("*")
        if path.is_file()
        and path.parent != run_dir / "secrets"
        and any(s.encode() in path.read_bytes() for s in secret_values)
    ]
    assert leaks == []
