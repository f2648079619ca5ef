"""Harnesses (one running backend each) and the runner that takes every case through them."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dart.env.conformance.cases import CASES, PROBE_FILE
from dart.env.conformance.model import BACKENDS, Case, CaseResult, NotApplicable, Plan, Status, Verdict
from dart.env.conformance.xevents import ProbeLog
from dart.env.interface import EnvBackend
from dart.protocol.messages import Action

# -- harnesses: one running backend each -----------------------------------------------------


class Harness(ABC):
    """One backend, started once and run through every case.

    Lifecycle: :meth:`start` -> :meth:`run` per case -> :meth:`close` (idempotent).
    """

    backend: str

    @abstractmethod
    async def start(self) -> None:
        """Bring the backend up."""

    @abstractmethod
    async def run(self, case: Case, plan: Plan, *, act: bool = True) -> Verdict:
        """Set the case up, execute its actions (unless ``act`` is False), check the outcome.

        The check always compares with the outcome of the case's declared actions, so a run with
        ``act=False`` is a negative control: it must fail.
        """

    @abstractmethod
    async def close(self) -> None:
        """Shut the backend down."""


class EnvHarness(Harness):
    """A backend behind :class:`EnvBackend`, built through the env service's registry."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.env: EnvBackend | None = None

    @property
    def handle(self) -> Any:
        """What the plans' locate and check functions receive: the env itself."""
        return self.env

    async def start(self) -> None:
        from dart.env.interface import ENV_BACKENDS
        from dart.env.service.config import EnvServiceConfig

        # Default configs: the sim without simulated latency, the browser headless.
        self.env = ENV_BACKENDS.get(self.backend)(EnvServiceConfig(backend=self.backend, pool="conformance"), 0)
        await self.env.start()

    async def run(self, case: Case, plan: Plan, *, act: bool = True) -> Verdict:
        env = self.env
        assert env is not None, "start the harness first"
        assert plan.task is not None, f"{case.name} has no task for {self.backend}"
        await env.reset(plan.task)
        located = await plan.locate(self.handle)
        actions = case.actions(located.points)
        for action in actions if act else ():
            await env.step(action)
        return await plan.check(self.handle, located, actions)

    async def close(self) -> None:
        if self.env is not None:
            await self.env.close()


def unavailable_reason(backend: str) -> str | None:
    """Why ``backend`` cannot run on this machine, or None when it can."""
    if backend == "miniwob":
        from dart.env.miniwob.browser import find_binary

        if find_binary("MINIWOB_CHROME_BINARY", "chromium", "chromium-browser") is None:
            return "Chromium is not installed (apt-get install chromium chromium-driver)"
        if find_binary("MINIWOB_CHROMEDRIVER", "chromedriver") is None:
            return "chromedriver is not installed (apt-get install chromium-driver)"
    if backend in ("desktop", "osworld"):
        if shutil.which("Xvfb") is None:
            return "Xvfb is not installed (apt-get install xvfb openbox)"
        try:
            import dart.env.desktop.probe

            if backend == "osworld":
                import dart.env.osworld.env  # noqa: F401
        except ImportError as exc:
            return f"the {backend} backend is not available: {exc}"
    return None


class DesktopHarness(Harness):
    """The local X desktop (Xvfb + openbox + VM server) with the probe app as the ground truth.

    Each case gets a fresh probe window (full screen, focused); actions go to the desktop's
    ``POST /dart/action`` (XTest); the check compares the probe's recorded X events with
    :func:`expected_x_events` of the case's actions, exactly (pixels, buttons, keys, order).
    """

    backend = "desktop"

    def __init__(self, width: int = 1280, height: int = 720) -> None:
        self.width, self.height = width, height
        self.desk: Any = None
        self._dir = Path(tempfile.mkdtemp(prefix="dart-conformance-"))
        self._probe: subprocess.Popen[bytes] | None = None
        self.log = ProbeLog(self._dir / "events.jsonl")
        self._http: Any = None

    async def start(self) -> None:
        import requests

        from dart.env.desktop import DesktopConfig, XDesktop

        self.desk = XDesktop(DesktopConfig(width=self.width, height=self.height))
        self._http = requests.Session()
        await asyncio.to_thread(self.desk.start)
        self._http.headers.update(self.desk.headers)

    def _start_probe(self) -> None:
        self._stop_probe()
        self.log.path.unlink(missing_ok=True)
        env = dict(os.environ, DISPLAY=self.desk.display)
        cmd = [sys.executable, "-m", "dart.env.desktop.probe", "--out", str(self.log.path)]
        self._probe = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _stop_probe(self) -> None:
        if self._probe is not None:
            self._probe.kill()
            self._probe.wait()
            self._probe = None

    def _act(self, action: Action) -> None:
        reply = self._http.post(f"{self.desk.url}/dart/action", data=action.model_dump_json(), timeout=30)
        if reply.status_code != 200:
            raise RuntimeError(f"POST /dart/action {action.kind}: HTTP {reply.status_code} {reply.text[:200]}")

    async def probe_ready(self) -> None:
        """Wait until this case's probe window is up."""
        probe = self._probe
        assert probe is not None
        await asyncio.to_thread(self.log.wait_ready, lambda: probe.poll() is None)

    async def check_events(self, actions: Sequence[Action]) -> Verdict:
        """Compare the probe's events with those ``actions`` must produce."""
        result: Verdict = await asyncio.to_thread(self.log.check, actions)
        return result

    async def run(self, case: Case, plan: Plan, *, act: bool = True) -> Verdict:
        await asyncio.to_thread(self._start_probe)
        located = await plan.locate(self)
        actions = case.actions(located.points)
        for action in actions if act else ():
            await asyncio.to_thread(self._act, action)
        return await plan.check(self, located, actions)

    async def close(self) -> None:
        self._stop_probe()
        if self.desk is not None:
            await asyncio.to_thread(self.desk.close)
        await asyncio.to_thread(shutil.rmtree, self._dir, True)


class OSWorldHarness(EnvHarness):
    """The ``osworld`` backend on its local desktop: each case is an OSWorld-format task whose
    setup launches the probe app; actions go through :meth:`OSWorldEnv.step`; the probe's log
    (in the desktop's HOME) is the ground truth, as for :class:`DesktopHarness`."""

    def __init__(self) -> None:
        super().__init__("osworld")

    @property
    def handle(self) -> Any:
        """The plans receive this harness (they need the probe log, not only the env)."""
        return self

    def _log(self) -> ProbeLog:
        provider = getattr(self.env, "provider", None)
        home = getattr(provider, "home", None)
        if home is None:
            raise RuntimeError("the osworld backend has no local desktop HOME (provider must be local)")
        return ProbeLog(Path(home) / PROBE_FILE)

    async def probe_ready(self) -> None:
        """Wait until the probe the task's setup launched is up."""
        await asyncio.to_thread(self._log().wait_ready)

    async def check_events(self, actions: Sequence[Action]) -> Verdict:
        """Compare the probe's events with those ``actions`` must produce."""
        result: Verdict = await asyncio.to_thread(self._log().check, actions)
        return result


def make_harness(backend: str) -> Harness:
    """The harness of a backend name of :data:`BACKENDS`.

    Raises:
        ValueError: Not a backend of :data:`BACKENDS`.
    """
    if backend in ("sim", "miniwob"):
        return EnvHarness(backend)
    if backend == "desktop":
        return DesktopHarness()
    if backend == "osworld":
        return OSWorldHarness()
    raise ValueError(f"no conformance harness for backend {backend!r}; choose from {', '.join(BACKENDS)}")


async def run_backend(backend: str, cases: Sequence[Case] = CASES, *, act: bool = True) -> list[CaseResult]:
    """Run every case on one backend; never raises for a failing case (it is a ``fail`` result).

    Args:
        backend: A name of :data:`BACKENDS`.
        cases: The cases to run.
        act: False skips executing the actions (a negative control: every check must fail).
    """
    results: list[CaseResult] = []
    runnable: list[tuple[Case, Plan]] = []
    for case in cases:
        plan = case.plans.get(backend)
        if plan is None:
            results.append(CaseResult(case.name, backend, Status.FAIL, "the case declares no plan for this backend"))
        elif isinstance(plan, NotApplicable):
            results.append(CaseResult(case.name, backend, Status.NOT_APPLICABLE, plan.reason))
        else:
            runnable.append((case, plan))
    if not runnable:
        return results
    reason = await asyncio.to_thread(unavailable_reason, backend)
    if reason is not None:
        return results + [CaseResult(c.name, backend, Status.UNAVAILABLE, reason) for c, _ in runnable]
    harness = make_harness(backend)
    try:
        await harness.start()
        for case, plan in runnable:
            try:
                outcome = await harness.run(case, plan, act=act)
            except Exception as exc:  # a broken case is a failed case, with the error as the detail
                outcome = Verdict(False, f"{type(exc).__name__}: {exc}")
            status = Status.PASS if outcome.ok else Status.FAIL
            results.append(CaseResult(case.name, backend, status, f"{plan.setup}: {outcome.detail}"))
    finally:
        await harness.close()
    order = {c.name: i for i, c in enumerate(cases)}
    return sorted(results, key=lambda r: order[r.case])


async def run_conformance(backends: Sequence[str] = BACKENDS, cases: Sequence[Case] = CASES) -> list[CaseResult]:
    """Run every case on every backend, one backend at a time."""
    results: list[CaseResult] = []
    for backend in backends:
        results.extend(await run_backend(backend, cases))
    return results


def format_table(results: Sequence[CaseResult]) -> str:
    """A compact case x backend table of statuses, followed by the reasons of every non-pass."""
    backends = list(dict.fromkeys(r.backend for r in results))
    cases = list(dict.fromkeys(r.case for r in results))
    cell = {(r.case, r.backend): r.status.value for r in results}
    width = max([len("case"), *map(len, cases)])
    cols = [max(len(b), 11) for b in backends]
    lines = ["case".ljust(width) + "  " + "  ".join(b.ljust(w) for b, w in zip(backends, cols, strict=True))]
    for case in cases:
        row = "  ".join(cell.get((case, b), "-").ljust(w) for b, w in zip(backends, cols, strict=True))
        lines.append(case.ljust(width) + "  " + row)
    notes = [f"  {r.case} @ {r.backend}: {r.status.value}: {r.detail}" for r in results if r.status != Status.PASS]
    return "\n".join(lines + (["", "not passing:", *notes] if notes else []))
