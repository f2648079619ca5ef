"""The agent's desktop holds no secret: its terminal and its commands see no credential of the service.

A real desktop is started the way the env service starts one, with credentials in the service's
environment and a run's ``secrets/`` directory beside it (files 0600 in a 0700 directory, as
``dart run`` writes them). Then, as the agent would, a terminal opened with Ctrl+Alt+T runs ``env``
and ``cat`` on every secret file, and so does a task command through ``/execute``. Under root the
desktop runs as its unprivileged ``desktop_user``, so the files and the service's own
``/proc/<pid>/environ`` must be refused too.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import sys
import tempfile
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from dart.env.desktop import DesktopConfig, DesktopError, XDesktop
from dart.env.desktop.sandbox import desktop_environment
from dart.env.desktop.windows import NS
from dart.runtime.testing import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("Xvfb") is None or shutil.which("openbox") is None or shutil.which("xterm") is None,
        reason="Xvfb, openbox and xterm are not installed (apt-get install xvfb openbox xterm; .ci/run does)",
    ),
]

MARK = f"dart-secret-{uuid.uuid4().hex}"
"""Part of every secret value planted for the test: it must not show anywhere on the desktop."""
SECRET_VARS = [
    "DART_TEST_SECRET",
    "DART_S3_SECRET_KEY",
    "DART_S3_ACCESS_KEY",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "NATS_PASSWORD",
    "HF_TOKEN",
    "HTTPS_PROXY",
]
"""Variables the service holds secrets in (the store keys, bus and hub credentials, a proxy with a token)."""
SECRET_FILES = ["nats-rollout.password", "nats-env.password", "nats-trainer.password"]
"""A run's bus password files (``<run_dir>/secrets/nats-<role>.password``)."""
SOURCE_MARK = f"/nonexistent/dart-source-{uuid.uuid4().hex}"
"""A directory the service's PYTHONPATH names: the server keeps it, the desktop's commands must not see it."""
DONE = "probe-done"
"""The probe's last line."""
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only a root service runs its desktop as another user")


@pytest.fixture(scope="module")
def secret_files() -> Iterator[list[Path]]:
    """A run directory others may enter, holding ``secrets/`` (0700) with password files (0600)."""
    run_dir = Path(tempfile.mkdtemp(prefix="dart-run-"))
    run_dir.chmod(0o755)  # only the secrets directory's own mode stands between the desktop and the files
    folder = run_dir / "secrets"
    folder.mkdir(mode=0o700)
    paths = []
    for name in SECRET_FILES:
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"{MARK}-{name}\n")
        paths.append(folder / name)
    yield paths
    shutil.rmtree(run_dir)


@pytest.fixture(scope="module")
def desk() -> Iterator[XDesktop]:
    """A desktop started by a service whose environment holds every secret of :data:`SECRET_VARS`."""
    with pytest.MonkeyPatch.context() as mp:
        for name in SECRET_VARS:
            mp.setenv(name, f"http://user:{MARK}@proxy:3128" if name.endswith("PROXY") else f"{MARK}-{name}")
        # DART run from source: the desktop's server imports through the service's PYTHONPATH.
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), SOURCE_MARK])))
        desktop = XDesktop(DesktopConfig(width=1024, height=600))
        desktop.start()
        yield desktop  # the secrets stay in the environment while the desktop runs, as in a service
        desktop.close()


def probe_script(files: list[Path]) -> str:
    """The shell line the agent runs: who it is, its environment and, where the desktop runs as another
    user (a root service), every secret file and the service's own environment."""
    # A service that is not root shares its account with its desktop: there these reads succeed by design.
    targets = [*files, Path(f"/proc/{os.getpid()}/environ")] if os.geteuid() == 0 else []
    reads = "".join(f"cat {shlex.quote(str(t))}; " for t in targets)
    return f"id -un; env; {reads}echo {DONE}"


def xterm_shown(desk: XDesktop) -> bool:
    """True once an xterm window is on the screen (in ``/accessibility``'s window tree)."""
    resp = requests.get(desk.url + "/accessibility", headers=desk.headers, timeout=10)
    root = ET.fromstring(resp.json()["AT"])
    return any(w.get(f"{{{NS['attr']}}}class") == "xterm.XTerm" for w in root)


def action(desk: XDesktop, body: dict[str, Any]) -> None:
    resp = requests.post(desk.url + "/dart/action", headers=desk.headers, json=body, timeout=30)
    assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module")
def terminal_output(desk: XDesktop, secret_files: list[Path]) -> str:
    """What the probe printed in a terminal the agent opened (Ctrl+Alt+T) and typed into."""
    action(desk, {"kind": "hotkey", "keys": ["ctrl", "alt", "t"]})
    wait_for(lambda: xterm_shown(desk), "the terminal the shortcut opens")
    action(desk, {"kind": "type", "text": f"{{ {probe_script(secret_files)}; }} > ~/probe.txt 2>&1\n"})
    out = desk.home / "probe.txt"
    return str(wait_for(lambda: out.is_file() and DONE in (text := out.read_text()) and text, "the probe's output"))


def test_terminal_environment_holds_no_secret(terminal_output: str) -> None:
    assert "\nDISPLAY=:" in terminal_output and "\nHOME=" in terminal_output  # the probe did run `env`
    assert MARK not in terminal_output
    for name in SECRET_VARS:
        assert f"\n{name}=" not in terminal_output


@as_root
def test_terminal_runs_as_the_desktop_user_and_cannot_read_the_run_secrets(
    terminal_output: str, secret_files: list[Path]
) -> None:
    lines = terminal_output.splitlines()
    assert lines[0] == "nobody"
    assert MARK not in terminal_output
    for path in secret_files:
        assert f"cat: {path}: Permission denied" in lines
    assert any(line.endswith(f"/proc/{os.getpid()}/environ: Permission denied") for line in lines)


def test_task_commands_see_no_secret(desk: XDesktop, secret_files: list[Path]) -> None:
    for route, body in [
        ("/execute", {"command": probe_script(secret_files), "shell": True}),
        ("/run_bash_script", {"script": probe_script(secret_files)}),
        ("/run_python", {"code": "import os\nprint(sorted(os.environ.items()))"}),
    ]:
        answer = requests.post(desk.url + route, headers=desk.headers, json=body, timeout=60).json()
        shown = f"{answer.get('output')} {answer.get('error')} {answer.get('message')}"
        assert "HOME" in shown, (route, answer)
        assert MARK not in shown, route
        assert SOURCE_MARK not in shown, route
        if os.geteuid() == 0 and route != "/run_python":
            assert all(f"cat: {path}: Permission denied" in shown for path in secret_files), route


def test_the_server_imports_through_the_services_python_path(desk: XDesktop) -> None:
    assert desk._server is not None
    environ = Path(f"/proc/{desk._server.pid}/environ").read_bytes().decode().split("\0")
    paths = next(e for e in environ if e.startswith("PYTHONPATH=")).removeprefix("PYTHONPATH=")
    assert SOURCE_MARK in paths.split(os.pathsep)


def test_the_desktop_python_is_the_services_with_its_packages(desk: XDesktop) -> None:
    for python in ("python", "python3"):
        code = "import sys, Xlib, dart.env.desktop.probe; print(sys.version_info[:2])"
        answer = requests.post(
            desk.url + "/execute", headers=desk.headers, json={"command": [python, "-c", code]}, timeout=30
        ).json()
        assert answer["returncode"] == 0, answer
        assert answer["output"].strip() == str(tuple(sys.version_info[:2]))


def test_desktop_environment_keeps_only_the_allow_list() -> None:
    service = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "DART_BUS__PASSWORD_FILE": "/run/secrets/nats",
        "AWS_ACCESS_KEY_ID": "x",
        "GITHUB_TOKEN": "x",
        "http_proxy": "http://u:p@proxy",
        "LC_API_KEY": "x",  # allowed prefix, credential-looking name
        "PYTHONPATH": "/srv",
        "XDG_RUNTIME_DIR": "/run/user/0",
    }
    env = desktop_environment(Path("/tmp/home"), None, display=":7", source=service)
    assert env == {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "HOME": "/tmp/home",
        "DISPLAY": ":7",
        "NO_AT_BRIDGE": "1",
        "GSETTINGS_BACKEND": "keyfile",
    }


@as_root
def test_a_missing_desktop_user_fails_naming_the_setting() -> None:
    name = f"dart-no-such-{uuid.uuid4().hex[:8]}"
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
    desktop = XDesktop(DesktopConfig(desktop_user=name))
    with pytest.raises(DesktopError, match=f"desktop_user '{name}' is not an account") as caught:
        desktop.start()
    assert caught.value.part == "user"
    desktop.close()
