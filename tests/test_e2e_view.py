"""End to end: `dart view` on the session's smoke run (1920x1080 on an embedded S3 store; the root conftest's
``smoke_run``, shared with tests/test_e2e_run.py), looked at in headless Chromium: overview -> trajectories ->
one trajectory, its screenshot shown with the click marker on the pixel the env clicked, a status filter
narrowing the list, keyboard navigation, and no JavaScript error; then `dart report`'s static pages of the
same run, read from file://. Screenshots of the pages go to the test's tmp dir and to docs/img/view-*.png."""

from __future__ import annotations

import json
import selectors
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from dart.cli.view.artifacts import RunArtifacts
from dart.cli.view.source import open_run
from dart.protocol.messages import Click, Trajectory
from dart.runtime.store import open_store

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def _pick(run_dir: Path, among: set[str] | None = None) -> tuple[Trajectory, int]:
    """A stored trajectory of two or more steps with a click whose screenshot is still in the store, whose
    successor in list order is stored too (so moving on to it shows a page, not a 404); and the click's step.
    ``among``: only these trajectories."""
    db = sqlite3.connect(f"{(run_dir / 'data.sqlite3').as_uri()}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT blob_key, pruned_at, trajectory_id FROM trajectories ORDER BY trajectory_id"
        ).fetchall()
    finally:
        db.close()
    with open_run(run_dir) as source:
        artifacts = RunArtifacts(open_store(source.store))
        try:
            for (key, pruned, trajectory_id), following in zip(rows, rows[1:], strict=False):
                if pruned is not None or following[1] is not None or (among is not None and trajectory_id not in among):
                    continue
                traj = artifacts.trajectory({"blob_key": key, "pruned_at": None})
                for step in traj.steps if len(traj.steps) >= 2 else []:
                    shot = artifacts.key_of(step.observation.screenshot)
                    if isinstance(step.action, Click) and shot and artifacts.exists(shot):
                        return traj, step.index
        finally:
            artifacts.close()
    raise AssertionError("the smoke run stored no trajectory with a click whose screenshot is kept")


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise AssertionError(f"dart view printed no URL within {timeout_s} s")
    return proc.stdout.readline().strip()


@pytest.fixture
def picked(smoke_run: tuple[dict[str, Any], Path]) -> tuple[Trajectory, int]:
    """:func:`_pick`'s trajectory, read before the viewer starts (one S3 server at a time on the run's data)."""
    return _pick(smoke_run[1])


@pytest.fixture
def viewer(smoke_run: tuple[dict[str, Any], Path], picked: tuple[Trajectory, int]) -> Iterator[str]:
    """`dart view RUN_DIR --port 0` as a subprocess; its URL."""
    _, run_dir = smoke_run
    proc = subprocess.Popen(
        [sys.executable, "-m", "dart.cli", "view", str(run_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = _first_line(proc, 120)
        assert url.startswith("http://127.0.0.1:"), (url, proc.poll())
        yield url
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
    # Its S3 server stopped with it.
    assert not subprocess.run(["pgrep", "-f", f"weed .*{run_dir}/s3"], capture_output=True).stdout


def _snap(browser: Any, tmp_path: Path, name: str) -> None:
    shot = tmp_path / f"view-{name}.png"
    browser.save_screenshot(str(shot))
    target = ROOT / "docs" / "img" / shot.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, target)


def test_a_run_in_the_browser(
    picked: tuple[Trajectory, int], viewer: str, browser: Any, no_js_errors: Any, tmp_path: Path
) -> None:
    traj, click_step = picked
    wait = WebDriverWait(browser, 30)

    browser.get(viewer)
    assert browser.find_element(By.TAG_NAME, "h1").text == "Overview"
    assert "trajectories stored" in browser.page_source
    no_js_errors(browser, "overview")
    _snap(browser, tmp_path, "overview")

    browser.find_element(By.LINK_TEXT, "Trajectories").click()
    wait.until(lambda b: b.find_element(By.TAG_NAME, "h1").text == "Trajectories")
    every = browser.find_element(By.ID, "count").text
    statuses = {e.text for e in browser.find_elements(By.CSS_SELECTOR, "#trajectories td.status")}
    assert len(statuses) >= 2, statuses  # the smoke run ends episodes both ways (ok and truncated)
    Select(browser.find_element(By.ID, "status")).select_by_value("truncated")
    browser.find_element(By.CSS_SELECTOR, "#filters button").click()
    wait.until(lambda b: "status=truncated" in b.current_url)
    narrowed = browser.find_element(By.ID, "count").text
    assert int(narrowed.split()[0]) < int(every.split()[0])
    assert {e.text for e in browser.find_elements(By.CSS_SELECTOR, "#trajectories td.status")} == {"truncated"}
    no_js_errors(browser, "trajectories")
    _snap(browser, tmp_path, "trajectories")

    browser.get(f"{viewer}trajectories?group={traj.group_id}")
    browser.find_element(By.LINK_TEXT, traj.trajectory_id).click()
    wait.until(lambda b: b.current_url.endswith(f"/trajectories/{traj.trajectory_id}"))
    _check_click_marker(browser, traj, click_step)
    no_js_errors(browser, "trajectory")
    browser.execute_script("window.scrollTo(0, 0)")
    _snap(browser, tmp_path, "trajectory")

    # Keyboard: j moves to the next step, n to the next trajectory.
    body = browser.find_element(By.TAG_NAME, "body")
    body.send_keys("j")
    wait.until(lambda b: b.find_element(By.CSS_SELECTOR, "section.step.current").get_attribute("id") == "step-1")
    assert browser.execute_script("return location.hash") == "#step-1"
    browser.find_element(By.TAG_NAME, "body").send_keys("n")
    wait.until(lambda b: f"/trajectories/{traj.trajectory_id}" not in b.current_url)
    assert "/trajectories/" in browser.current_url
    no_js_errors(browser, "next trajectory")

    browser.get(f"{viewer}groups/{traj.group_id}")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rollouts .rollout")) >= 2
    no_js_errors(browser, "group")
    _snap(browser, tmp_path, "group")


@pytest.fixture
def report(smoke_run: tuple[dict[str, Any], Path], tmp_path: Path) -> Path:
    """`dart report RUN_DIR --out DIR --trajectories 30`; the overview's path."""
    _, run_dir = smoke_run
    argv = [sys.executable, "-m", "dart.cli", "report", str(run_dir), "--out", str(tmp_path / "report")]
    done = subprocess.run([*argv, "--trajectories", "30"], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(done.stdout.strip().splitlines()[-1])
    assert written["pages"] > 30 and written["images"] > 0 and written["plots"] >= 4, written
    return Path(written["report"])


def test_the_static_report_in_the_browser(
    smoke_run: tuple[dict[str, Any], Path], report: Path, browser: Any, no_js_errors: Any, tmp_path: Path
) -> None:
    """The same pages as files: the overview with its plots, the list, a trajectory with its screenshot and
    the click drawn where the env clicked, read from file:// with no server."""
    rendered = {
        unquote(p.name.removeprefix("trajectory-").removesuffix(".html"))
        for p in report.parent.glob("trajectory-*.html")
    }
    traj, click_step = _pick(smoke_run[1], among=rendered)
    wait = WebDriverWait(browser, 30)

    browser.get(report.as_uri())
    assert browser.find_element(By.TAG_NAME, "h1").text == "Overview"
    plots = browser.find_elements(By.CSS_SELECTOR, "#plots img")
    assert len(plots) >= 4
    wait.until(lambda b: all(b.execute_script("return arguments[0].naturalWidth", i) > 0 for i in plots))
    assert browser.find_elements(By.CSS_SELECTOR, "#utilization td.util-env")
    no_js_errors(browser, "report overview")
    _snap(browser, tmp_path, "report")

    browser.find_element(By.LINK_TEXT, "Trajectories").click()
    wait.until(lambda b: b.current_url.endswith("/trajectories.html"))
    assert browser.find_element(By.ID, "static-note")
    browser.find_element(By.LINK_TEXT, traj.trajectory_id).click()
    wait.until(lambda b: b.find_element(By.TAG_NAME, "h1").text == traj.trajectory_id)
    _check_click_marker(browser, traj, click_step)
    no_js_errors(browser, "report trajectory")


def _check_click_marker(browser: Any, traj: Trajectory, index: int) -> None:
    """The observation screenshot is shown, and the marker's centre is at the click's pixel, in the SVG's
    image coordinates and where the browser draws it over the image."""
    step = traj.steps[index]
    action, shot = step.action, step.observation.screenshot
    assert isinstance(action, Click) and shot is not None
    figure = browser.find_element(By.CSS_SELECTOR, f"#step-{index} figure.observation")
    image = figure.find_element(By.TAG_NAME, "img")
    deadline = time.monotonic() + 30
    while not browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image):
        assert time.monotonic() < deadline, "the screenshot did not load"
        time.sleep(0.2)
    assert browser.execute_script("return arguments[0].naturalWidth", image) == shot.width == 1920
    circle = figure.find_element(By.CSS_SELECTOR, "circle.mark")
    cx, cy = float(circle.get_attribute("cx")), float(circle.get_attribute("cy"))
    assert (cx, cy) == pytest.approx((action.x * shot.width, action.y * shot.height), abs=1e-6)
    box = browser.execute_script(
        "const i = arguments[0].getBoundingClientRect(), c = arguments[1].getBoundingClientRect();"
        "return [i.left, i.top, i.width, i.height, c.left + c.width / 2, c.top + c.height / 2];",
        image,
        circle,
    )
    left, top, width, height, x, y = box
    assert width < shot.width  # displayed scaled down: the marker scales with it
    assert x == pytest.approx(left + action.x * width, abs=1.0)
    assert y == pytest.approx(top + action.y * height, abs=1.0)
