"""Fixtures and guards shared by every test in the repository: real servers, never fakes.

- ``nats_server``: one embedded nats-server with JetStream per test session.
- ``s3_server``: one embedded S3 server (SeaweedFS) per test session.
- ``postgres_server``: one embedded PostgreSQL server per test session (Debian's ``postgresql``
  package); ``postgres_url`` is a fresh database on it per test. Skipped, with the reason, only
  where the server binaries are absent; ``DART_REQUIRE_POSTGRES=1`` (set by ``.ci/run``) turns
  that skip into a failure.
- ``browser``: headless Chromium driven by selenium (Debian's chromium and chromedriver), its console log
  kept; ``no_js_errors(browser, page)`` fails a test on any console error.
- ``built_images``: the compose stack's images (``scripts/build-images.sh``), built in the background from
  the moment ``tests/test_stack.py`` or a test using the fixture (the docker VM provider's) is collected;
  such tests run last.
- Warm starts prepared ahead: the warm starts that tests marked ``warm_start(config, env=...)`` want are
  computed from collection on, at the lowest CPU priority, into the cache
  ``dart_run`` gives its runs.
- Checks run ahead: the commands of tests marked ``run_ahead(*argv)`` (strict typing over every package) start
  with the first end-to-end run, at the lowest CPU priority; the test checks the result (``ran_ahead``).
- Guards: no connection beyond loopback; no callback may block an event loop for longer than
  ``BLOCKING_LIMIT_S`` (time spent waiting for a CPU on a busy machine excluded, CPU time counted at a
  reference machine's speed; see the guard).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from dart.embedded.nats import EmbeddedNats


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL checkpoint (seed 0), written once per session for every package's tests; tests
    must not modify it."""
    from dart.policy.tiny import write_tiny_checkpoint

    os.environ["HF_HUB_OFFLINE"] = "1"
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(path, seed=0)
    return path


@pytest.fixture(scope="session")
def shot_store(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A local artifact store (``LocalStore``) for the screenshots of samples made in tests."""
    from dart.runtime.store import LocalStore

    return LocalStore(tmp_path_factory.mktemp("store"), fsync=False)


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

E2E_TIMEOUT_S = 1800.0
"""Limit of one end-to-end run (and of an e2e test, its fixture included). A smoke run takes about 3
minutes on a quiet 2-core machine and was seen taking over 5 with a CPU load of 5-7 beside it: the limit
catches a hung run, not a slow one."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """End-to-end tests get :data:`E2E_TIMEOUT_S` unless they set their own timeout. Tests that use the
    built images go last (in their order), so the build started at collection runs beside the others
    instead of being waited for; the stack test goes after them, since it removes the images when it ends."""
    for item in items:
        if item.get_closest_marker("e2e") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
    items.sort(key=lambda item: 2 if item.nodeid.startswith(STACK_TEST) else int(_uses_built_images(item)))


def _uses_built_images(item: pytest.Item) -> bool:
    return "built_images" in getattr(item, "fixturenames", ())


ROOT = Path(__file__).resolve().parent
STACK_TEST = "tests/test_stack.py"
BUILD_IMAGES = ["bash", str(ROOT / "scripts" / "build-images.sh"), "--local-base", "--offline-infra"]
BUILD_TIMEOUT_S = 2400.0
SMOKE_CONFIG = ROOT / "examples" / "smoke-1080p.yaml"
"""The session's smoke run (:func:`smoke_run`)."""
_image_build: dict[str, Any] = {}
"""The background build of the stack's images: ``proc`` and ``log``, once started."""


def _can_build_images() -> bool:
    """Root, docker, docker-compose, mmdebstrap and a daemon that answers (else the stack test says why)."""
    if os.geteuid() != 0 or any(shutil.which(t) is None for t in ("docker", "docker-compose", "mmdebstrap")):
        return False
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


_VLLM_CACHE = Path(tempfile.mkdtemp(prefix="dart-vllm-cache-"))
"""vLLM's cache for every server the session starts (in tests and in the runs they make): shared, as the
servers of one host share theirs, and empty at the start, as on a fresh machine (never the user's
``~/.cache/vllm``). Removed at the session's end."""
os.environ["VLLM_CACHE_ROOT"] = str(_VLLM_CACHE)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start preparing the end-to-end runs' warm starts (see :class:`_WarmStartsAhead`), and building the compose
    stack's images as soon as its test is collected: the build (about 4 minutes) mostly waits on the disk and
    the network, so it runs beside the tests that come first."""
    warm_starts = _wanted_warm_starts(session.items)
    _checks_ahead.want(session.items)
    if warm_starts:
        _warm_starts.start(warm_starts)
    wanted = any(item.nodeid.startswith(STACK_TEST) or _uses_built_images(item) for item in session.items)
    if not wanted or not _can_build_images():
        return
    log = Path(tempfile.mkdtemp(prefix="dart-build-images-")) / "build-images.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(BUILD_IMAGES, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    _image_build.update(proc=proc, log=log)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A build the session no longer waits for (the stack test deselected or never reached) is stopped, and so
    is a warm start being prepared; the prepared warm starts are removed."""
    proc = _image_build.get("proc")
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _warm_starts.stop()
    _checks_ahead.stop()
    shutil.rmtree(_VLLM_CACHE, ignore_errors=True)


class _WarmStartsAhead:
    """The warm starts of the session's end-to-end runs, prepared from collection on (``dart warm-start``, one
    config at a time, in the order the tests want them) into the cache directory ``dart_run`` gives its runs.

    A warm start is most of a smoke run's CPU time (about 50 s each at 2 cores, 110 s for Qwen3-VL), and the
    unit and integration tests before the end-to-end ones, and the runs themselves, leave part of the machine
    idle: the preparation runs at the lowest CPU priority (SCHED_IDLE: only on a CPU nothing else wants) in that
    time. A run that starts takes its warm start over (:meth:`claim`): ready, it is copied; being prepared, the
    preparation stops and the run computes it; not started, it is never prepared. A run whose warm start is
    not ready computes its own, as does one whose preparation failed (the log is named in the terminal
    summary)."""

    def __init__(self) -> None:
        self.cache_dir: Path | None = None
        self.log: Path | None = None
        self.failed: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._current: str | None = None
        """The warm-start key being prepared."""
        self._claimed: set[str] = set()
        """Keys a run computes or took: never prepared (again) from here on."""

    def start(self, wanted: list[tuple[Path, dict[str, str]]]) -> None:
        self.cache_dir = Path(tempfile.mkdtemp(prefix="dart-warm-starts-"))
        self.log = self.cache_dir.with_name(self.cache_dir.name + ".log")
        self._thread = threading.Thread(target=self._prepare, args=(wanted,), name="warm-starts-ahead", daemon=True)
        self._thread.start()

    def _prepare(self, wanted: list[tuple[Path, dict[str, str]]]) -> None:
        assert self.cache_dir is not None and self.log is not None
        prepared: set[str] = set()  # configs that share a warm start (smoke's is smoke-lora's, -ray's, ...) run once
        for config, env in wanted:
            key = _warm_start_key(config, env)
            with self.log.open("ab") as out, self._lock:  # started under the lock: a claim sees it and stops it
                if self._stopping.is_set():
                    return
                if key is None or key in self._claimed or key in prepared:
                    continue
                prepared.add(key)
                out.write(f"--- dart warm-start {config} {env}\n".encode())
                out.flush()
                self._current = key
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "dart.cli", "warm-start", str(config)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={
                        **os.environ,
                        "DART_WARM_START__CACHE_DIR": str(self.cache_dir),
                        # Idle time only: it may take many times its 2-core duration (never a reason to cut it).
                        "DART_WARM_START__MAX_SECONDS": "7200",
                        **env,
                    },
                    preexec_fn=_idle_priority,
                    start_new_session=True,
                )
            code = self._proc.wait()
            with self._lock:
                stopped = self._stopping.is_set() or key in self._claimed
                self._current = None
            if code != 0 and not stopped:
                self.failed.append(f"{config.name} (exit {code})")

    def claim(self, config: Path | None, env: Mapping[str, str]) -> None:
        """An end-to-end run of ``config`` (with ``env``) is starting: its warm start is the run's from here on. If
        it is the one being prepared, that preparation is stopped (its lock goes with it) and the run computes it
        itself, at normal priority: a run must never wait on an idle-priority process, which a CPU-bound program
        beside it would starve (a preparation lifted to normal priority instead ran many times slower than the
        run's own). The other warm starts go on being prepared in the idle time the runs leave. A run whose key
        is unknown (no config: a resume) stops the preparation altogether only if it cannot tell."""
        key = _warm_start_key(config, env) if config is not None else None
        with self._lock:
            if key is not None:
                self._claimed.add(key)
                if self._current != key:
                    return
            elif config is None:
                return  # a resumed run warm-starts nothing
            else:
                self._stopping.set()
            proc = self._proc
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
        if self.log is not None and not self.failed:
            self.log.unlink(missing_ok=True)


_warm_starts = _WarmStartsAhead()


class _ChecksAhead:
    """The commands of tests marked ``run_ahead(*argv)``, started when the first end-to-end run starts (:meth:`start`)
    at the lowest CPU priority. Strict typing over every package is about a minute of one core and 2.3 GB; the
    end-to-end runs leave part of the machine idle (the warm starts prepared ahead take the idle time before
    them), and the test that checks the result comes after them. Its test waits for the command
    (:meth:`result`), lifted to normal priority where the system allows; a test whose command never started
    (no end-to-end run in the session) runs it itself."""

    def __init__(self) -> None:
        self._wanted: dict[str, tuple[str, ...]] = {}
        self._running: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}

    def want(self, items: list[pytest.Item]) -> None:
        for item in items:
            marker = item.get_closest_marker("run_ahead")
            if marker is not None:
                self._wanted[item.nodeid] = tuple(str(a) for a in marker.args)

    def start(self) -> None:
        for nodeid, argv in self._wanted.items():
            if nodeid in self._running:
                continue
            fd, name = tempfile.mkstemp(prefix="dart-check-ahead-", suffix=".log")
            with os.fdopen(fd, "wb") as out:
                proc = subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_idle_priority,
                    start_new_session=True,
                )
            self._running[nodeid] = (proc, Path(name))
        self._wanted.clear()

    def result(self, nodeid: str, argv: tuple[str, ...], timeout_s: float) -> subprocess.CompletedProcess[str]:
        """The command's exit code and output (stdout and stderr together)."""
        entry = self._running.pop(nodeid, None)
        self._wanted.pop(nodeid, None)
        if entry is None:
            done = subprocess.run(
                argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
            )
            return done
        proc, log = entry
        with contextlib.suppress(OSError):  # waited for now: no longer only on idle CPUs
            os.sched_setscheduler(proc.pid, os.SCHED_OTHER, os.sched_param(0))
        try:
            code = proc.wait(timeout=timeout_s)
            return subprocess.CompletedProcess(list(argv), code, log.read_text(errors="replace"), "")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.unlink(missing_ok=True)

    def stop(self) -> None:
        for proc, log in self._running.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.unlink(missing_ok=True)
        self._running.clear()


_checks_ahead = _ChecksAhead()


@pytest.fixture
def ran_ahead(request: pytest.FixtureRequest) -> subprocess.CompletedProcess[str]:
    """The result of the test's ``run_ahead(*argv)`` command (see :class:`_ChecksAhead`)."""
    marker = request.node.get_closest_marker("run_ahead")
    assert marker is not None, "ran_ahead needs the test marked run_ahead(*argv)"
    return _checks_ahead.result(request.node.nodeid, tuple(str(a) for a in marker.args), timeout_s=600)


def _idle_priority() -> None:
    """In the child before exec: run only on a CPU nothing else wants (SCHED_IDLE), where Linux has it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _warm_start_key(config: Path, env: Mapping[str, str]) -> str | None:
    """The warm-start cache key of ``dart run CONFIG`` with ``env`` (see dart.cli.stack.warmstart_cache), or None
    when it cannot be told (the run finds out)."""
    try:
        from dart.cli.stack.config import RunConfig, load_tasks
        from dart.cli.stack.warmstart_cache import warm_start_key
        from dart.protocol.config import load_config

        loaded = load_config(RunConfig, config, environ={**os.environ, **env})
        return warm_start_key(loaded, load_tasks(loaded))
    except Exception:  # an invalid config fails in its own run, with the run's message
        return None


def _wanted_warm_starts(items: list[pytest.Item]) -> list[tuple[Path, dict[str, str]]]:
    """The ``warm_start(config, env=...)`` marks of ``items`` (and the smoke run's, for those that use it), each
    once, in the tests' order."""
    wanted: list[tuple[Path, dict[str, str]]] = []
    for item in items:
        entries = [(Path(m.args[0]), dict(m.kwargs.get("env", {}))) for m in item.iter_markers("warm_start")]
        if "smoke_run" in getattr(item, "fixturenames", ()):
            entries.append((SMOKE_CONFIG, {}))
        wanted.extend(e for e in entries if e not in wanted)
    return wanted


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _warm_starts.failed:
        failed = ", ".join(_warm_starts.failed)
        terminalreporter.write_line(
            f"warm starts prepared ahead that failed (their runs computed their own): {failed}; log: {_warm_starts.log}"
        )


BROWSER_WINDOW = (1280, 800)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium (selenium); its console messages are kept for :func:`no_js_errors`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as ChromeService

    from dart.env.miniwob.browser import CHROME_FLAGS

    chrome, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    assert chrome and driver, "Chromium and chromedriver are needed (apt-get install chromium chromium-driver)"
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={BROWSER_WINDOW[0]},{BROWSER_WINDOW[1]}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Both paths given: Selenium Manager never runs (it would try to download a driver).
    session = webdriver.Chrome(service=ChromeService(executable_path=driver), options=options)
    try:
        yield session
    finally:
        session.quit()


@pytest.fixture
def no_js_errors() -> Callable[[Any, str], None]:
    """``check(browser, page)``: fails when the browser's console has logged an error since the last check."""

    def check(browser: Any, page: str) -> None:
        severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert severe == [], f"{page}: {severe}"

    return check


@pytest.fixture(scope="session")
def built_images(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """``scripts/build-images.sh --local-base --offline-infra`` done: its exit code and log. Started at
    collection (see :func:`pytest_collection_finish`), else here."""
    proc = _image_build.get("proc")
    if proc is not None:
        return proc.wait(timeout=BUILD_TIMEOUT_S), _image_build["log"]
    log = tmp_path_factory.mktemp("build-images") / "build-images.log"
    with log.open("wb") as out:
        done = subprocess.run(BUILD_IMAGES, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=BUILD_TIMEOUT_S)
    return done.returncode, log


@pytest.fixture(scope="session")
def dart_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[dict[str, Any], Path]]:
    """Runs ``dart run CONFIG`` in a subprocess (run directory under a temp dir, warm starts cached for
    the session); returns its JSON summary (the last stdout line) and run directory. A non-zero exit
    fails with the output's tail."""

    # Runs whose warm start has the same inputs (a smoke run and its FSDP, megatron and vLLM variants)
    # share one warm-started policy: the first run stores it (or the session prepared it ahead, for tests
    # marked warm_start), the others copy it.
    warm_start_cache = _warm_starts.cache_dir or tmp_path_factory.mktemp("warm-start-cache")

    def run(
        config: Path | None,
        *,
        env: dict[str, str] | None = None,
        timeout_s: float = E2E_TIMEOUT_S,
        during: Callable[[subprocess.Popen[str], Path], None] | None = None,
        args: Sequence[str] = (),
        prefix: Sequence[str] = (),
        killed: bool = False,
    ) -> tuple[dict[str, Any], Path]:
        """``during(process, runs_root)``, when given, runs on a thread while the run goes on (fault
        injection); an exception it raises fails the test once the run ended. ``args`` follow the config (if
        any) on the command line; ``prefix`` runs the command inside another (e.g. a network namespace).
        ``killed``: ``during`` kills the run, which then has no summary: ``({}, runs_root)`` is returned."""
        _warm_starts.claim(config, env or {})
        _checks_ahead.start()
        runs = tmp_path_factory.mktemp("runs")
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "dart.cli", "run", *([str(config)] if config else []), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "DART_RUN__RUNS_ROOT": str(runs),
                "DART_WARM_START__CACHE_DIR": str(warm_start_cache),
                **(env or {}),
            },
        )
        errors: list[BaseException] = []

        def inject() -> None:
            assert during is not None
            try:
                during(proc, runs)
            except BaseException as exc:  # reported after the run, with its output
                errors.append(exc)
                proc.kill()  # a run waiting for the test to end it would otherwise go on to its limit

        injector = threading.Thread(target=inject, daemon=True) if during is not None else None
        if injector is not None:
            injector.start()
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            raise AssertionError(f"dart run exceeded {timeout_s:g}s: " + stdout[-3000:] + stderr[-5000:]) from None
        if injector is not None:
            injector.join(timeout=60)
        assert not errors, f"fault injection failed: {errors[0]!r}\n" + stdout[-3000:] + stderr[-5000:]
        if killed:
            return {}, runs
        assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
        summary = json.loads(stdout.strip().splitlines()[-1])
        run_dir = Path(summary["run_dir"])
        for service, code in summary.get("service_exit_codes", {}).items():
            if code != 0:  # shown with the test that fails on it: a killed service's stacks end its log
                log = run_dir / "logs" / f"{service}.log"
                tail = log.read_text(errors="replace")[-12000:] if log.is_file() else "(no log)"
                print(f"--- {service} exited {code}; the end of {log}:\n{tail}")
        return summary, run_dir

    return run


@pytest.fixture(scope="session")
def smoke_run(dart_run: Callable[..., tuple[dict[str, Any], Path]]) -> tuple[dict[str, Any], Path]:
    """`dart run examples/smoke-1080p.yaml` with `run.artifacts: embedded_s3`: the smoke pipeline at
    1920x1080, screenshots by reference through an S3 store. One run serves tests/test_e2e_run.py (the
    decoupled services at work) and tests/test_e2e_1080p.py (the 1080p and S3 paths)."""
    return dart_run(SMOKE_CONFIG, env={"DART_RUN__ARTIFACTS": "embedded_s3"})


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


# The guard times every event-loop callback itself (asyncio's debug mode, on through asyncio_debug in
# pyproject, would time them in wall-clock only), and charges a callback only with what is the code's fault
# on any machine:
# - Waiting for a CPU is not charged. On a starved machine a callback that takes 50 ms of CPU can take
#   seconds of wall time while its thread waits for a core. Linux reports per thread the time spent
#   runnable but waiting on a run queue (/proc/thread-self/schedstat, field 2).
# - CPU work is charged at a reference machine's speed: the callback's CPU time (field 1 of the same file)
#   divided by this machine's slowness, measured once per session on a fixed workload. A callback that
#   computes for 0.6 s here takes 1.2 s on a machine twice as slow, and is no more at fault there.
# - The rest (sleeps, blocking I/O, lock waits) is charged in full: it does not depend on the CPU.
BLOCKING_LIMIT_S = float(os.environ.get("DART_TEST_BLOCKING_LIMIT_S", "1.0"))
REFERENCE_WORKLOAD_CPU_S = 0.015
"""CPU seconds of :func:`_reference_workload` on the reference machine (the 2-core AMD EPYC development and CI
machine, 2026-11-28; the least of five runs)."""
_thread_state = threading.local()
_slow_callbacks: list[str] = []


def _cpu_and_wait_s() -> tuple[float, float]:
    """Seconds this thread has spent on a CPU, and runnable but waiting for one, from one read of
    /proc/thread-self/schedstat (where the kernel does not say: the thread's CPU clock, and no wait)."""
    fd = getattr(_thread_state, "schedstat_fd", None)
    if fd is None:
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            weakref.finalize(threading.current_thread(), os.close, fd)
        except OSError:
            fd = -1
        _thread_state.schedstat_fd = fd
    if fd >= 0:
        try:
            on_cpu, waiting = os.pread(fd, 128, 0).split()[:2]
            return int(on_cpu) / 1e9, int(waiting) / 1e9
        except (OSError, ValueError):
            pass
    return time.thread_time(), 0.0


def _reference_workload() -> float:
    """CPU seconds this thread spends on a fixed piece of interpreted arithmetic."""
    started, total = time.thread_time(), 0
    for i in range(300_000):
        total += i * i % 7
    return time.thread_time() - started


def _machine_slowness() -> float:
    """How many times slower than the reference machine this one computes (1.0 at least: a faster machine
    is held to the same limit). The least of five runs: one that a page fault or a cache miss stretched
    does not count."""
    return max(1.0, min(_reference_workload() for _ in range(5)) / REFERENCE_WORKLOAD_CPU_S)


MACHINE_SLOWNESS = _machine_slowness()


def charged_blocking_s(wall: float, run_queue_wait: float, cpu: float, slowness: float) -> float:
    """What a callback's time is charged with: its CPU time at the reference machine's speed, plus the time
    it was off a CPU for a reason of its own (sleeping, waiting on I/O or a lock)."""
    cpu = min(cpu, max(0.0, wall - run_queue_wait))
    return (wall - run_queue_wait - cpu) + cpu / slowness


_original_handle_run = asyncio.events.Handle._run


def _guarded_handle_run(self: asyncio.events.Handle) -> None:
    started, (cpu_before, waited_before) = time.perf_counter(), _cpu_and_wait_s()
    try:
        _original_handle_run(self)
    finally:
        wall = time.perf_counter() - started
        if wall > BLOCKING_LIMIT_S:
            cpu_after, waited_after = _cpu_and_wait_s()
            cpu, waited = cpu_after - cpu_before, waited_after - waited_before
            charged = charged_blocking_s(wall, waited, cpu, MACHINE_SLOWNESS)
            if charged > BLOCKING_LIMIT_S:
                _slow_callbacks.append(
                    f"{self!r:.200} blocked {charged:.2f}s (wall {wall:.2f}s, CPU {cpu:.2f}s on a machine "
                    f"{MACHINE_SLOWNESS:.2f}x the reference's time, waiting for a CPU {waited:.2f}s)"
                )


asyncio.events.Handle._run = _guarded_handle_run  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _no_blocking_the_event_loop() -> Iterator[None]:
    """Guard: a coroutine that blocks its loop (sync I/O, sleep, heavy CPU) fails the test."""
    _slow_callbacks.clear()
    yield
    slow = list(_slow_callbacks)
    assert not slow, (
        f"event loop blocked for more than {BLOCKING_LIMIT_S}s (CPU time at the reference machine's speed, "
        f"run-queue waits excluded): {slow}"
    )
