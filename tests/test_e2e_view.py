"""End to end: `dart view` on the session's smoke run (1920x1080 on an embedded S3 store; the root conftest's
``smoke_run``, shared with tests/test_e2e_run.py), looked at in headless Chromium: overview -> trajectories ->
one trajectory, its screenshot shown with the click marker on the pixel the env clicked, a status filter
narrowing the list, keyboard navigation, and no JavaScript error. Screenshots of the pages go to the test's
tmp dir and to docs/img/view-*.png."""

from __future__ import annotations

import selectors
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from dart.cli.view.artifacts import RunArtifacts
from dart.cli.view.source import open_run
from dart.env.miniwob.browser import CHROME_FLAGS
from dart.protocol.messages import Click, Trajectory
from dart.protocol.store import open_store

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
WINDOW = (1280, 800)


def _pick(run_dir: Path) -> tuple[Trajectory, int]:
    """A stored trajectory of two or more steps with a click whose screenshot is still in the store, whose
    successor in list order is stored too (so moving on to it shows a page, not a 404); and the click's step."""
    db = sqlite3.connect(f"{(run_dir / 'data.sqlite3').as_uri()}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT blob_key, pruned_at FROM trajectories ORDER BY trajectory_id").fetchall()
    finally:
        db.close()
    with open_run(run_dir) as source:
        artifacts = RunArtifacts(open_store(source.store))
        try:
            for (key, pruned), following in zip(rows, rows[1:], strict=False):
                if pruned is not None or following[1] is not None:
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


@pytest.fixture
def browser() -> Iterator[Any]:
    chrome, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    assert chrome and driver, "Chromium and chromedriver are needed (apt-get install chromium chromium-driver)"
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Both paths given: Selenium Manager never runs (it would try to download a driver).
    session = webdriver.Chrome(service=ChromeService(executable_path=driver), options=options)
    try:
        yield session
    finally:
        session.quit()


def _no_errors(browser: Any, page: str) -> None:
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], f"{page}: {severe}"


def _snap(browser: Any, tmp_path: Path, name: str) -> None:
    shot = tmp_path / f"view-{name}.png"
    browser.save_screenshot(str(shot))
    target = ROOT / "docs" / "img" / shot.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, target)


def test_a_run_in_the_browser(picked: tuple[Trajectory, int], viewer: str, browser: Any, tmp_path: Path) -> None:
    traj, click_step = picked
    wait = WebDriverWait(browser, 30)

    browser.get(viewer)
    assert browser.find_element(By.TAG_NAME, "h1").text == "Overview"
    assert "trajectories stored" in browser.page_source
    _no_errors(browser, "overview")
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
    _no_errors(browser, "trajectories")
    _snap(browser, tmp_path, "trajectories")

    browser.get(f"{viewer}trajectories?group={traj.group_id}")
    browser.find_element(By.LINK_TEXT, traj.trajectory_id).click()
    wait.until(lambda b: b.current_url.endswith(f"/trajectories/{traj.trajectory_id}"))
    _check_click_marker(browser, traj, click_step)
    _no_errors(browser, "trajectory")
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
    _no_errors(browser, "next trajectory")

    browser.get(f"{viewer}groups/{traj.group_id}")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rollouts .rollout")) >= 2
    _no_errors(browser, "group")
    _snap(browser, tmp_path, "group")


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
