"""The local X desktop: lifecycle, OSWorld's VM-server routes, DART's /dart/ routes, failures.

Real Xvfb, openbox, xterm and server processes; one desktop per module where tests allow.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from PIL import Image

from dart.env.desktop import DesktopConfig, DesktopError, XDesktop
from dart.env.desktop.windows import NS
from dart.runtime.testing import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("Xvfb") is None or shutil.which("openbox") is None or shutil.which("xterm") is None,
        reason="Xvfb, openbox and xterm are not installed (apt-get install xvfb openbox xterm; .ci/run does)",
    ),
]

WIDTH, HEIGHT = 1280, 720


def windows(desk: XDesktop) -> list[dict[str, str]]:
    """Top-level windows from ``/accessibility``: name, class, screencoord, size."""
    resp = requests.get(desk.url + "/accessibility", headers=desk.headers, timeout=10)
    assert resp.status_code == 200, resp.text
    root = ET.fromstring(resp.json()["AT"])
    assert root.tag == "desktop-frame"
    return [
        {
            "name": w.get("name", ""),
            "class": w.get(f"{{{NS['attr']}}}class", ""),
            "screencoord": w.get(f"{{{NS['cp']}}}screencoord", ""),
            "size": w.get(f"{{{NS['cp']}}}size", ""),
        }
        for w in root
    ]


def xterm_window(desk: XDesktop) -> dict[str, str] | None:
    return next((w for w in windows(desk) if w["class"] == "xterm.XTerm"), None)


def action(desk: XDesktop, body: dict[str, Any]) -> None:
    resp = requests.post(desk.url + "/dart/action", headers=desk.headers, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"status": "success"}


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie awaiting its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A HOME template: one seed file and one folder."""
    root = tmp_path_factory.mktemp("home-template")
    (root / "seed.txt").write_text("seed\n")
    (root / "docs").mkdir()
    (root / "docs" / "a.md").write_text("# a\n")
    return root


@pytest.fixture(scope="module")
def desk(template: Path) -> Iterator[XDesktop]:
    """One desktop for the module (start takes about a second)."""
    desktop = XDesktop(DesktopConfig(width=WIDTH, height=HEIGHT, home_template=template))
    desktop.start()
    yield desktop
    desktop.close()


@pytest.fixture(autouse=True)
def _fresh_episode(request: pytest.FixtureRequest) -> Iterator[None]:
    """Revert the shared desktop after each test that used it."""
    yield
    if "desk" in request.fixturenames:
        desktop: XDesktop = request.getfixturevalue("desk")
        if desktop.alive():
            desktop.revert()


# -- lifecycle ------------------------------------------------------------------------------------


def test_start_exposes_endpoint_display_home_and_pids(desk: XDesktop, template: Path) -> None:
    assert desk.url.startswith("http://127.0.0.1:")
    assert desk.display.startswith(":")
    assert desk.home.is_dir() and (desk.home / "seed.txt").read_text() == "seed\n"
    pids = desk.pids
    assert set(pids) == {"xvfb", "wm", "server"}
    assert all(isinstance(pids[k], int) and pid_alive(pids[k]) for k in pids)  # type: ignore[arg-type]
    assert desk.alive()
    health = requests.get(desk.url + "/dart/health", headers=desk.headers, timeout=5).json()
    assert health == {"status": "ok", "display": desk.display, "screen": [WIDTH, HEIGHT]}


def test_every_route_but_health_refuses_a_request_without_the_desktops_token(desk: XDesktop) -> None:
    """Anyone on loopback (the agent's own desktop user included) reaches the port: without the token it may
    not run commands, read files or take screenshots. The token is in no argv or environment."""
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("post", "/execute", {"json": {"command": ["touch", str(desk.home / "pwned")]}}),
        ("post", "/run_python", {"json": {"code": "print(1)"}}),
        ("post", "/setup/launch", {"json": {"command": ["xterm"]}}),
        ("post", "/file", {"data": {"file_path": "~/seed.txt"}}),
        ("post", "/dart/action", {"json": {"kind": "click", "x": 0.5, "y": 0.5}}),
        ("post", "/dart/revert", {}),
        ("get", "/screenshot", {}),
        ("get", "/accessibility", {}),
        ("post", "/screen_size", {}),
    ]
    wrong: list[dict[str, str]] = [{}, {"Authorization": "Bearer not-the-token"}, {"Authorization": desk.token}]
    for headers in wrong:
        for method, path, kwargs in calls:
            resp = requests.request(method, desk.url + path, headers=headers, timeout=10, **kwargs)
            assert resp.status_code == 401, (path, headers, resp.text)
    assert not (desk.home / "pwned").exists()
    assert requests.get(desk.url + "/dart/health", timeout=5).status_code == 200
    assert requests.post(desk.url + "/screen_size", headers=desk.headers, timeout=5).status_code == 200
    server = desk.pids["server"]
    assert server is not None
    for what in ("cmdline", "environ"):
        assert desk.token.encode() not in Path(f"/proc/{server}/{what}").read_bytes()
    shown = requests.post(desk.url + "/execute", headers=desk.headers, json={"command": ["env"]}, timeout=30).json()
    assert shown["returncode"] == 0 and "PATH=" in shown["output"] and desk.token not in shown["output"]


def test_close_kills_everything_and_is_idempotent() -> None:
    desktop = XDesktop(DesktopConfig(width=640, height=480, window_manager="none"))
    desktop.start()
    pids, home, url = desktop.pids, desktop.home, desktop.url
    assert pids["wm"] is None
    resp = requests.post(url + "/setup/launch", headers=desktop.headers, json={"command": ["sleep", "1000"]}, timeout=5)
    assert resp.status_code == 200
    desktop.close()
    desktop.close()
    assert not desktop.alive()
    assert not any(pid_alive(p) for p in pids.values() if p is not None)
    assert not home.exists()
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/dart/health", timeout=5)
    with pytest.raises(DesktopError):
        desktop.start()


def test_start_failure_names_the_part() -> None:
    desktop = XDesktop(DesktopConfig(window_manager="no-such-window-manager"))
    with pytest.raises(DesktopError, match="no-such-window-manager") as info:
        desktop.start()
    assert info.value.part == "wm"
    assert not desktop.alive()
    desktop.close()
    missing = XDesktop(DesktopConfig(home_template=Path("/nonexistent/template")))
    with pytest.raises(DesktopError, match="home template") as info:
        missing.start()
    assert info.value.part == "home"


def test_screenshot_has_the_screen_size_and_shows_an_xterm(desk: XDesktop) -> None:
    resp = requests.post(
        desk.url + "/setup/launch", headers=desk.headers, json={"command": "xterm", "shell": False}, timeout=5
    )
    assert resp.status_code == 200 and "launched successfully" in resp.text
    wait_for(lambda: xterm_window(desk), "the xterm window")
    resp = requests.get(desk.url + "/screenshot", headers=desk.headers, timeout=10)
    assert resp.status_code == 200 and resp.headers["Content-Type"] == "image/png"
    image = Image.open(io.BytesIO(resp.content))
    assert image.format == "PNG" and image.size == (WIDTH, HEIGHT)
    pixels = np.asarray(image.convert("RGB"))
    # The xterm's white client area and the black root window are both on screen.
    assert (pixels == 255).all(axis=-1).sum() > 10_000
    assert (pixels == 0).all(axis=-1).sum() > 10_000
    assert requests.post(desk.url + "/screen_size", headers=desk.headers, timeout=5).json() == {
        "width": WIDTH,
        "height": HEIGHT,
    }


# -- the agent loop through HTTP -----------------------------------------------------------------


def test_click_type_enter_in_an_xterm_writes_a_file(desk: XDesktop) -> None:
    resp = requests.post(
        desk.url + "/setup/launch", headers=desk.headers, json={"command": ["xterm"], "shell": False}, timeout=5
    )
    assert resp.status_code == 200
    win = wait_for(lambda: xterm_window(desk), "the xterm window")
    x, y = (int(v) for v in win["screencoord"].strip("()").split(","))
    w, h = (int(v) for v in win["size"].strip("()").split(","))
    action(desk, {"kind": "click", "x": (x + w / 2) / WIDTH, "y": (y + h / 2) / HEIGHT})
    action(desk, {"kind": "type", "text": "echo hello > out.txt"})
    action(desk, {"kind": "hotkey", "keys": ["enter"]})
    out = desk.home / "out.txt"
    wait_for(lambda: out.exists() and out.read_text() == "hello\n", "out.txt with 'hello' in HOME")
    resp = requests.post(desk.url + "/file", headers=desk.headers, data={"file_path": "~/out.txt"}, timeout=5)
    assert resp.status_code == 200 and resp.content == b"hello\n"
    resp = requests.post(desk.url + "/file", headers=desk.headers, data={"file_path": "~/missing.txt"}, timeout=5)
    assert resp.status_code == 404 and resp.json()["error"] == "File not found"


def test_accessibility_lists_top_level_windows(desk: XDesktop) -> None:
    requests.post(
        desk.url + "/setup/launch", headers=desk.headers, json={"command": ["xterm", "-T", "probe-title"]}, timeout=5
    )
    win = wait_for(lambda: xterm_window(desk), "the xterm window")
    assert win["name"] == "probe-title"
    w, h = (int(v) for v in win["size"].strip("()").split(","))
    assert w > 100 and h > 100


def test_terminal_actions_and_wait_finished_fail(desk: XDesktop) -> None:
    for body in ({"kind": "wait", "seconds": 0.01}, {"kind": "finished", "content": "ok"}, {"kind": "fail"}):
        action(desk, body)


def test_concurrent_requests_are_all_served(desk: XDesktop) -> None:
    def call(i: int) -> int:
        if i % 3 == 0:
            return requests.get(desk.url + "/screenshot", headers=desk.headers, timeout=30).status_code
        if i % 3 == 1:
            body = {"kind": "click", "x": (i % 10) / 10, "y": 0.5}
            return requests.post(desk.url + "/dart/action", headers=desk.headers, json=body, timeout=30).status_code
        return requests.post(
            desk.url + "/execute", headers=desk.headers, json={"command": ["true"]}, timeout=30
        ).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(call, range(48)))
    assert codes == [200] * 48


# -- OSWorld's command routes --------------------------------------------------------------------


def test_execute_returns_osworld_shape_with_desktop_env(desk: XDesktop) -> None:
    resp = requests.post(
        desk.url + "/execute",
        headers=desk.headers,
        json={"command": "echo $HOME $DISPLAY; pwd; echo oops >&2", "shell": True},
        timeout=30,
    )
    assert resp.status_code == 200
    body = resp.json()
    assert set(body) == {"status", "output", "error", "returncode"}
    assert body["status"] == "success" and body["returncode"] == 0
    assert body["output"] == f"{desk.home} {desk.display}\n{desk.home}\n"
    assert body["error"] == "oops\n"
    resp = requests.post(
        desk.url + "/setup/execute", headers=desk.headers, json={"command": ["cat", "~/seed.txt"]}, timeout=30
    )
    assert resp.json()["output"] == "seed\n"
    # A list with shell=True keeps Popen's meaning: its first item is the script.
    resp = requests.post(
        desk.url + "/execute", headers=desk.headers, json={"command": ["echo $HOME"], "shell": True}, timeout=30
    )
    assert resp.json()["output"] == f"{desk.home}\n"
    resp = requests.post(desk.url + "/execute", headers=desk.headers, json={"command": "false"}, timeout=30)
    assert resp.json()["returncode"] == 1 and resp.json()["status"] == "success"
    resp = requests.post(
        desk.url + "/execute", headers=desk.headers, json={"command": ["no-such-program-xyz"]}, timeout=30
    )
    assert resp.status_code == 500 and resp.json()["status"] == "error" and resp.json()["message"]


def test_run_bash_script_returns_osworld_shape(desk: XDesktop) -> None:
    (desk.home / "work").mkdir()
    resp = requests.post(
        desk.url + "/run_bash_script",
        headers=desk.headers,
        json={"script": "pwd; echo err >&2; exit 3", "timeout": 10, "working_dir": "~/work"},
        timeout=30,
    )
    assert resp.status_code == 200
    assert resp.json() == {"status": "error", "output": f"{desk.home}/work\nerr\n", "error": "", "returncode": 3}
    resp = requests.post(
        desk.url + "/run_bash_script", headers=desk.headers, json={"script": "sleep 5", "timeout": 0.2}, timeout=30
    )
    assert resp.status_code == 500 and resp.json()["returncode"] == -1
    resp = requests.post(
        desk.url + "/run_bash_script",
        headers=desk.headers,
        json={"script": "true", "working_dir": "~/nope"},
        timeout=30,
    )
    assert resp.status_code == 400 and "does not exist" in resp.json()["output"]


def test_run_python_returns_osworld_shape(desk: XDesktop) -> None:
    resp = requests.post(
        desk.url + "/run_python",
        headers=desk.headers,
        json={"code": "import os\nprint(os.environ['HOME'])"},
        timeout=30,
    )
    assert resp.status_code == 200
    assert resp.json() == {
        "status": "success",
        "message": f"{desk.home}\n",
        "need_more": False,
        "output": f"{desk.home}\n",
        "error": "",
        "return_code": 0,
    }
    body = requests.post(
        desk.url + "/run_python", headers=desk.headers, json={"code": "raise ValueError('boom')"}, timeout=30
    ).json()
    assert body["status"] == "error" and body["return_code"] == 1 and "ValueError: boom" in body["error"]


def test_upload_list_directory_and_platform(desk: XDesktop) -> None:
    resp = requests.post(
        desk.url + "/setup/upload",
        headers=desk.headers,
        data={"file_path": "~/in/data.bin"},
        files={"file_data": ("data.bin", b"\x00\x01payload")},
        timeout=10,
    )
    assert resp.status_code == 200 and resp.text == "File Uploaded: 9 bytes"
    assert (desk.home / "in" / "data.bin").read_bytes() == b"\x00\x01payload"
    tree = requests.post(desk.url + "/list_directory", headers=desk.headers, json={"path": "~/in"}, timeout=10).json()
    assert tree == {
        "directory_tree": {"type": "directory", "name": "in", "children": [{"type": "file", "name": "data.bin"}]}
    }
    assert requests.get(desk.url + "/platform", headers=desk.headers, timeout=5).text == "Linux"
    pos = requests.get(desk.url + "/cursor_position", headers=desk.headers, timeout=5).json()
    assert len(pos) == 2 and 0 <= pos[0] < WIDTH and 0 <= pos[1] < HEIGHT


@pytest.mark.skipif(shutil.which("mousepad") is None, reason="mousepad is not installed")
def test_open_file_activate_and_close_window(desk: XDesktop) -> None:
    (desk.home / "notes.txt").write_text("some notes\n")
    resp = requests.post(desk.url + "/setup/open_file", headers=desk.headers, json={"path": "~/notes.txt"}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert any("notes.txt" in w["name"] and w["class"] == "mousepad.Mousepad" for w in windows(desk))
    resp = requests.post(
        desk.url + "/setup/activate_window", headers=desk.headers, json={"window_name": "notes.txt"}, timeout=10
    )
    assert resp.status_code == 200
    resp = requests.post(
        desk.url + "/setup/activate_window", headers=desk.headers, json={"window_name": "no such window"}, timeout=10
    )
    assert resp.status_code == 404
    resp = requests.post(
        desk.url + "/setup/close_window",
        headers=desk.headers,
        json={"window_name": "Mousepad", "by_class": True},
        timeout=10,
    )
    assert resp.status_code == 200
    wait_for(lambda: not any(w["class"] == "mousepad.Mousepad" for w in windows(desk)), "mousepad to close")
    resp = requests.post(
        desk.url + "/setup/open_file", headers=desk.headers, json={"path": "~/missing.txt"}, timeout=10
    )
    assert resp.status_code == 404


# -- revert -----------------------------------------------------------------------------------------


def test_revert_kills_launched_apps_and_restores_home(desk: XDesktop) -> None:
    requests.post(desk.url + "/setup/launch", headers=desk.headers, json={"command": ["xterm"]}, timeout=5)
    # A shell, its background job, and a process that left the session (setsid).
    script = "echo $$ > ~/pid1; sleep 1000 & echo $! > ~/pid2; setsid sleep 1000 & echo $! > ~/pid3; wait"
    requests.post(desk.url + "/setup/launch", headers=desk.headers, json={"command": script, "shell": True}, timeout=5)
    wait_for(lambda: xterm_window(desk), "the xterm window")
    wait_for(lambda: (desk.home / "pid3").exists() and (desk.home / "pid3").read_text().strip(), "the pid files")
    pids = [int((desk.home / name).read_text()) for name in ("pid1", "pid2", "pid3")]
    assert all(pid_alive(p) for p in pids)
    (desk.home / "seed.txt").write_text("changed")
    (desk.home / "docs" / "b.md").write_text("new")
    (desk.home / "extra").mkdir()

    desk.revert()

    assert not any(pid_alive(p) for p in pids)
    assert xterm_window(desk) is None
    assert sorted(p.relative_to(desk.home).as_posix() for p in desk.home.rglob("*")) == [
        "docs",
        "docs/a.md",
        "seed.txt",
    ]
    assert (desk.home / "seed.txt").read_text() == "seed\n"
    assert desk.alive()


def test_ctrl_alt_t_opens_a_terminal_that_revert_closes(desk: XDesktop) -> None:
    desk.revert()
    assert xterm_window(desk) is None
    action(desk, {"kind": "hotkey", "keys": ["ctrl", "alt", "t"]})  # Ubuntu's terminal shortcut
    wait_for(lambda: xterm_window(desk), "the xterm the shortcut opens")
    action(desk, {"kind": "type", "text": "gsettings set org.gnome.desktop.interface text-scaling-factor 1.25\n"})
    # GSettings keeps the value for the episode (keyfile backend in HOME; there is no session bus).
    out = wait_for(
        lambda: (
            (
                r := requests.post(
                    desk.url + "/execute",
                    headers=desk.headers,
                    json={"command": "gsettings get org.gnome.desktop.screensaver lock-enabled", "shell": True},
                    timeout=10,
                ).json()
            )["output"].strip()
            == "true"
            and r
        ),
        "the setting to stick",
    )
    assert out["returncode"] == 0
    desk.revert()
    assert xterm_window(desk) is None
    after = requests.post(
        desk.url + "/execute",
        headers=desk.headers,
        json={"command": "gsettings get org.gnome.desktop.interface text-scaling-factor", "shell": True},
        timeout=10,
    ).json()
    assert after["output"].strip() == "1.0"  # the revert restored HOME, settings included (schema default)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "needle"),
    [
        ("post", "/execute", {"data": b"{not json", "headers": {"Content-Type": "application/json"}}, 400, "JSON"),
        ("post", "/execute", {"json": [1, 2]}, 400, "JSON object"),
        ("post", "/execute", {"json": {"command": 5}}, 400, "'command'"),
        ("post", "/execute", {"json": {"command": "ls", "shell": "yes"}}, 400, "'shell'"),
        ("post", "/setup/launch", {"json": {}}, 400, "'command'"),
        ("post", "/setup/open_file", {"json": {}}, 400, "'path'"),
        ("post", "/setup/activate_window", {"json": {"strict": True}}, 400, "'window_name'"),
        ("post", "/setup/close_window", {"json": {"window_name": 3}}, 400, "'window_name'"),
        ("post", "/file", {"data": {}}, 400, "file_path"),
        ("post", "/setup/upload", {"data": {"file_path": "~/x"}}, 400, "file_data"),
        ("post", "/run_python", {"json": {}}, 400, "Code not supplied"),
        ("post", "/run_bash_script", {"json": {"script": "ls", "timeout": "soon"}}, 400, "'timeout'"),
        ("post", "/list_directory", {"json": {"path": "~/seed.txt"}}, 400, "not a directory"),
        ("post", "/dart/action", {"json": {"kind": "teleport"}}, 400, "invalid action"),
        ("post", "/dart/action", {"json": {"kind": "click", "x": 1.5, "y": 0.5}}, 400, "click.x"),
        ("post", "/dart/action", {"json": {"kind": "hotkey", "keys": ["ctrl", "nokey"]}}, 400, "unknown key 'nokey'"),
        ("post", "/dart/action", {"data": b"\xff\xfe"}, 400, "invalid action"),
        ("get", "/no/such/route", {}, 404, "no route"),
        ("get", "/execute", {}, 405, "POST"),
    ],
)
def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(
    desk: XDesktop, method: str, path: str, kwargs: dict[str, Any], status: int, needle: str
) -> None:
    kwargs = {**kwargs, "headers": {**desk.headers, **kwargs.get("headers", {})}}
    resp = requests.request(method, desk.url + path, timeout=10, **kwargs)
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["status"] == "error" and needle in body["message"]
    assert requests.get(desk.url + "/dart/health", headers=desk.headers, timeout=5).json()["status"] == "ok"


# -- a dying desktop ------------------------------------------------------------------------------


def test_kill_of_xvfb_is_detected_and_requests_fail_fast() -> None:
    desktop = XDesktop(DesktopConfig(width=640, height=480))
    desktop.start()
    try:
        xvfb = desktop.pids["xvfb"]
        assert xvfb is not None
        os.kill(xvfb, signal.SIGKILL)
        wait_for(lambda: not desktop.alive(), "alive() to turn False", timeout_s=5)
        for path in ("/dart/health", "/screenshot", "/accessibility"):
            resp = requests.get(desktop.url + path, headers=desktop.headers, timeout=10)
            assert resp.status_code == 503 and "display" in resp.json()["message"]
        resp = requests.post(
            desktop.url + "/dart/action",
            headers=desktop.headers,
            json={"kind": "click", "x": 0.5, "y": 0.5},
            timeout=10,
        )
        assert resp.status_code == 503
        with pytest.raises(DesktopError, match="died"):
            desktop.revert()
    finally:
        desktop.close()
    assert not desktop.alive()


def test_kill_of_the_server_is_detected_and_close_still_kills_its_apps() -> None:
    with XDesktop(DesktopConfig(width=640, height=480, window_manager="none")) as desktop:
        script = "setsid sleep 1000 & echo $! > ~/pid; wait"
        requests.post(
            desktop.url + "/setup/launch", headers=desktop.headers, json={"command": script, "shell": True}, timeout=5
        )
        pid_file = desktop.home / "pid"
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), "the pid file")
        orphan = int(pid_file.read_text())
        os.kill(desktop.pids["server"], signal.SIGKILL)  # type: ignore[arg-type]
        wait_for(lambda: not desktop.alive(), "alive() to turn False", timeout_s=5)
        with pytest.raises(requests.ConnectionError):
            requests.get(desktop.url + "/dart/health", headers=desktop.headers, timeout=5)
        assert pid_alive(orphan)
    assert not pid_alive(orphan)


def test_owner_killed_takes_its_desktop_along() -> None:
    script = (
        "import json, time\n"
        "from dart.env.desktop import DesktopConfig, XDesktop\n"
        "desk = XDesktop(DesktopConfig(width=640, height=480))\n"
        "desk.start()\n"
        "print(json.dumps({**desk.pids, 'home': str(desk.home)}), flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None
        started = json.loads(owner.stdout.readline())
        home = Path(started.pop("home"))
        pids = [p for p in started.values() if p is not None]
        assert len(pids) == 3 and all(pid_alive(p) for p in pids) and home.is_dir()
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
    wait_for(lambda: not any(pid_alive(p) for p in pids), "the server, Xvfb and openbox to exit", timeout_s=10)
    wait_for(lambda: not home.parent.exists(), "the desktop's temp dir to be removed", timeout_s=5)
