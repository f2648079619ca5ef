"""`dart serve` ends with exit code 1 and one line naming the service and the error when it cannot go on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration


def test_a_fatal_error_exits_1_with_one_clear_line(nats_url: str, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    unopenable = tmp_path / "not-a-dir"
    unopenable.write_text("a file where the database's directory should be")
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "fatal", "run_dir": str(tmp_path / "run")},
                "bus": {"url": nats_url},
                "data": {"database_url": f"sqlite:///{unopenable / 'data.sqlite3'}"},
                "telemetry": {"jsonl_path": str(tmp_path / "telemetry.jsonl")},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "dart.cli", "serve", "data", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: dart serve data failed: OperationalError:"), last
    assert "Traceback" in proc.stderr  # the log keeps the traceback for whoever debugs it


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (/proc's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_a_service_stopped_while_it_starts_exits_0(nats_url: str, tmp_path: Path) -> None:
    """SIGTERM in the first second of `dart serve` (still importing) is a graceful stop, not a -15 crash: a
    supervisor stopping a service it has just restarted sees it stop cleanly."""
    config = tmp_path / "run.yaml"
    telemetry = tmp_path / "telemetry.jsonl"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "early", "run_dir": str(tmp_path / "run")},
                "bus": {"url": nats_url},
                "data": {"database_url": f"sqlite:///{tmp_path / 'data.sqlite3'}"},
                "telemetry": {"jsonl_path": str(telemetry)},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "dart.cli", "serve", "data", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not _catches(proc.pid, signal.SIGTERM):  # the handler is the first thing it installs
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # It left before serving: nothing started, nothing recorded.
    assert not telemetry.exists(), telemetry.read_text()[-2000:]


@pytest.mark.unit
def test_the_packages_know_every_section_of_a_run_config() -> None:
    """A service package's command accepts a whole run config and refuses other top-level keys: its list
    of the run config's sections is this one."""
    from dart.cli.stack.config import RunConfig
    from dart.runtime.serving import RUN_CONFIG_SECTIONS

    assert set(RunConfig.model_fields) == RUN_CONFIG_SECTIONS


STUCK_SERVICE = """
import asyncio, logging, sys, threading
from dart.runtime.bus import BusConfig
from dart.runtime.serving import ServeConfig, ServeRunSection, serve

logging.basicConfig(level=logging.INFO, stream=sys.stderr)


def blocked_worker(forever):
    forever.wait()


async def never_ends():
    await asyncio.Event().wait()


async def body(config, bus, telemetry, stop):
    threading.Thread(target=blocked_worker, args=(threading.Event(),), name="blocked", daemon=True).start()
    print("serving", file=sys.stderr, flush=True)
    await stop.wait()
    await never_ends()  # its stop hangs


config = ServeConfig(run=ServeRunSection(name="stuck", run_dir=sys.argv[2]), bus=BusConfig(url=sys.argv[1]))
asyncio.run(serve("stuck", config, body, version="0"))
"""


def test_a_service_that_does_not_stop_writes_its_stacks_before_it_is_killed(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`dart run` stops a service with SIGTERM and kills it after its timeout; before the kill the service
    writes where each thread and each asyncio task waits to its log, so a hang can be read afterwards."""
    from dart.cli.cluster.launch import stop_process

    script, log_path = tmp_path / "stuck.py", tmp_path / "stuck.log"
    script.write_text(STUCK_SERVICE)
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(script), nats_url, str(tmp_path / "run")],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while "serving" not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and "serving" in log_path.read_text(), log_path.read_text()
        assert stop_process(proc, timeout_s=1.0) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert "Thread 0x" in log and "in blocked_worker" in log  # every thread, from faulthandler
    assert "asyncio tasks:" in log and "in never_ends" in log  # every task, from the event loop
    assert "did not stop within 1 s: killed" in caplog.text
