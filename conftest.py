"""Fixtures and guards shared by every test in the repository: real servers, never fakes.

- ``nats_server``: one embedded nats-server with JetStream per test session.
- ``s3_server``: one embedded S3 server (SeaweedFS) per test session.
- ``postgres_server``: one embedded PostgreSQL server per test session (Debian's ``postgresql``
  package); ``postgres_url`` is a fresh database on it per test. Skipped, with the reason, only
  where the server binaries are absent; ``DART_REQUIRE_POSTGRES=1`` (set by ``.ci/run``) turns
  that skip into a failure.
- Guards: no connection beyond loopback; no callback may block an event loop for longer than
  ``BLOCKING_LIMIT_S`` (asyncio debug mode reports slow callbacks, and the test fails).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dart.embedded.nats import EmbeddedNats


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    """A running nats-server with JetStream, shared by the session."""
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    """URL of the session's nats-server."""
    return nats_server.url


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A running S3 server (SeaweedFS), shared by the session."""
    from dart.embedded.s3 import EmbeddedS3

    with EmbeddedS3() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """A running PostgreSQL server, shared by the session."""
    from dart.embedded.postgres import EmbeddedPostgres, postgres_available

    if not postgres_available():
        reason = "PostgreSQL server binaries not found (install Debian's 'postgresql' or set DART_POSTGRES_BIN)"
        if os.environ.get("DART_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"{reason}, and DART_REQUIRE_POSTGRES=1")
        pytest.skip(reason)
    with EmbeddedPostgres() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: Any) -> str:
    """SQLAlchemy URL of a new, empty database on the session's PostgreSQL server."""
    return str(postgres_server.create_database(f"t_{uuid.uuid4().hex[:20]}"))


_real_connect = socket.socket.connect


@pytest.fixture(scope="session")
def dart_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[dict[str, Any], Path]]:
    """Runs ``dart run CONFIG`` in a subprocess (run directory under a temp dir); returns its JSON
    summary (the last stdout line) and run directory. A non-zero exit fails with the output's tail."""

    def run(config: Path, *, env: dict[str, str] | None = None, timeout_s: float = 600) -> tuple[dict[str, Any], Path]:
        runs = tmp_path_factory.mktemp("runs")
        proc = subprocess.run(
            [sys.executable, "-m", "dart.cli", "run", str(config)],
            capture_output=True,
            text=True,
            env={**os.environ, "DART_RUN__RUNS_ROOT": str(runs), **(env or {})},
            timeout=timeout_s,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        return summary, Path(summary["run_dir"])

    return run


def _loopback_only_connect(self: socket.socket, address: Any) -> Any:
    if self.family in (socket.AF_INET, socket.AF_INET6):
        host = address[0]
        if host not in ("localhost", "::1") and not str(host).startswith("127."):
            raise RuntimeError(f"tests may only connect to loopback, not {address!r}")
    return _real_connect(self, address)


@pytest.fixture(autouse=True)
def _no_network_beyond_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guard: a test that reaches beyond loopback fails instead of leaking traffic."""
    monkeypatch.setattr(socket.socket, "connect", _loopback_only_connect)


# pytest-asyncio runs loops in debug mode (asyncio_debug in pyproject), which times every callback.
BLOCKING_LIMIT_S = float(os.environ.get("DART_TEST_BLOCKING_LIMIT_S", "1.0"))
_SLOW = re.compile(r"took (\d+\.\d+) seconds")


class _SlowCallbackRecorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.slow: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = _SLOW.search(record.getMessage())
        if match and float(match.group(1)) > BLOCKING_LIMIT_S:
            self.slow.append(record.getMessage()[:300])


@pytest.fixture(autouse=True)
def _no_blocking_the_event_loop() -> Iterator[None]:
    """Guard: a coroutine that blocks its loop (sync I/O, sleep, heavy CPU) fails the test."""
    recorder = _SlowCallbackRecorder()
    logger = logging.getLogger("asyncio")
    logger.addHandler(recorder)
    try:
        yield
    finally:
        logger.removeHandler(recorder)
    assert not recorder.slow, f"event loop blocked for more than {BLOCKING_LIMIT_S}s: {recorder.slow}"
