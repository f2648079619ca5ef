"""A local X desktop: Xvfb + window manager + the VM server, behind OSWorld's HTTP protocol.

Lifecycle of :class:`XDesktop`::

    created --start()--> running --close()--> closed
                            |  Xvfb or server dies (alive() turns False)
                            v
                          dead --close()--> closed

``start()`` raises :class:`DesktopError` (and cleans up) when any part fails; ``revert()`` resets
an episode (kills what the server started, restores HOME) without restarting Xvfb; ``close()`` is
idempotent and safe in every state. All calls block: async callers run them in threads.

The server answers anyone on its port who holds the token (``start()`` draws a new one and hands it to
the server on its stdin): every route but ``GET /dart/health`` requires ``headers``.

Example:
    >>> with XDesktop(DesktopConfig(width=1280, height=720)) as desk:  # doctest: +SKIP
    ...     requests.get(desk.url + "/screenshot", headers=desk.headers).content
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Literal

import requests
from pydantic import Field

from dart.env.desktop.display import XvfbDisplay, kill_group
from dart.env.desktop.errors import DesktopError
from dart.env.desktop.interpreter import install_python
from dart.env.desktop.processes import MARKER_VAR, kill_marked
from dart.env.desktop.sandbox import desktop_environment, resolve_desktop_user
from dart.protocol.config import ConfigModel


class DesktopConfig(ConfigModel):
    """Settings of one local X desktop."""

    width: int = Field(default=1280, ge=64, le=8192)
    """Screen width, pixels."""
    height: int = Field(default=720, ge=64, le=8192)
    """Screen height, pixels."""
    window_manager: str = "openbox"
    """Window manager executable, or ``none``."""
    host: str = "127.0.0.1"
    """Address the VM server listens on."""
    start_timeout_s: float = Field(default=20.0, gt=0)
    """Limit for each part (Xvfb, window manager, server) to come up, seconds."""
    request_timeout_s: float = Field(default=30.0, gt=0)
    """Limit of the desktop's own HTTP calls (health, revert), seconds."""
    home_template: Path | None = None
    """Directory copied into the fresh HOME at start and on every revert; None: an empty HOME."""
    server_log: Literal["file", "inherit"] = "file"
    """Where the server's stderr goes: a log file in the temp dir (its tail is in errors), or this process's."""
    desktop_user: str = "nobody"
    """Account that Xvfb, the window manager, apps and every command run as when this process is root
    (it must exist; a dedicated one keeps desktops apart); ignored otherwise. See :mod:`dart.env.desktop.sandbox`."""


class XDesktop:
    """One local desktop; see the module docstring for its lifecycle.

    Args:
        config: Its settings.
    """

    def __init__(self, config: DesktopConfig | None = None) -> None:
        self.config = config or DesktopConfig()
        self._tmp: Path | None = None
        self._display: XvfbDisplay | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._port = 0
        self._token = ""
        self._http = requests.Session()
        self._closed = False

    # -- properties ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the VM server (``http://127.0.0.1:PORT``)."""
        self._require_started()
        return f"http://{self.config.host}:{self._port}"

    @property
    def token(self) -> str:
        """The server's token, new at each start: every route but ``GET /dart/health`` requires it."""
        self._require_started()
        return self._token

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header a request to the server must carry."""
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def display(self) -> str:
        """The X display (``:N``)."""
        self._require_started()
        assert self._display is not None
        return self._display.display

    @property
    def home(self) -> Path:
        """The desktop's HOME: a temp dir of this desktop, removed on close."""
        self._require_started()
        assert self._tmp is not None
        return self._tmp / "home"

    @property
    def pids(self) -> dict[str, int | None]:
        """``{"xvfb": pid, "wm": pid or None, "server": pid}``."""
        self._require_started()
        assert self._display is not None and self._server is not None
        return {**self._display.pids, "server": self._server.pid}

    def _require_started(self) -> None:
        if self._server is None:
            raise DesktopError("request", "the desktop is not started; call start() first")

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start Xvfb, the window manager and the VM server; return once ``/dart/health`` answers.

        Raises:
            DesktopError: A part failed to start (the message names it and quotes its log).
        """
        if self._closed:
            raise DesktopError("request", "this desktop was closed; create a new XDesktop")
        if self._server is not None:
            return
        cfg = self.config
        self._tmp = Path(tempfile.mkdtemp(prefix="dart-desktop-")).resolve()
        home = self._tmp / "home"
        try:
            user = resolve_desktop_user(cfg.desktop_user)
            if user is not None:
                # The temp dir stays root's (logs, the window manager's rc); the user may only pass through it.
                self._tmp.chmod(0o711)
            python_bin = install_python(self._tmp / "python", user)
            path = f"{python_bin}{os.pathsep}{os.environ.get('PATH', os.defpath)}"
            env = desktop_environment(home, user, extra={"PATH": path})
            home.mkdir()
            if cfg.home_template is not None:
                try:
                    shutil.copytree(cfg.home_template, home, symlinks=True, dirs_exist_ok=True)
                except OSError as exc:
                    raise DesktopError("home", f"cannot copy the home template {cfg.home_template}: {exc}") from exc
            if user is not None:
                user.give(home)
            self._display = XvfbDisplay(
                cfg.width,
                cfg.height,
                window_manager=cfg.window_manager,
                log_dir=self._tmp,
                env=env,
                user=user,
                start_timeout_s=cfg.start_timeout_s,
                # Carrying the server's marker, so a revert closes terminals opened by the shortcut too.
                terminal_command=["env", f"{MARKER_VAR}={home}", "xterm"],
            )
            display = self._display.start()
            self._start_server(display, home, env, python_bin / "python3")
            self._wait_healthy()
        except BaseException:
            # A failed start is final: the object stays closed and a new XDesktop is needed.
            self._closed = True
            self._teardown()
            raise

    def _start_server(self, display: str, home: Path, env: dict[str, str], python: Path) -> None:
        cfg = self.config
        assert self._tmp is not None
        cmd = [
            sys.executable,
            "-m",
            "dart.env.desktop.server",
            "--display",
            display,
            "--port",
            "0",
            "--host",
            cfg.host,
            "--home",
            str(home),
            "--parent-pid",
            str(os.getpid()),
        ]
        if cfg.home_template is not None:
            cmd += ["--home-template", str(cfg.home_template)]
        cmd += ["--desktop-user", cfg.desktop_user, "--python", str(python)]
        assert self._display is not None
        for pid in self._display.pids.values():
            if pid is not None:
                cmd += ["--reap-group", str(pid)]
        cmd += ["--reap-dir", str(self._tmp)]
        log_path = self._tmp / "server.log"
        self._token = secrets.token_urlsafe(32)
        self._http.headers["Authorization"] = f"Bearer {self._token}"
        with log_path.open("wb") as log:
            self._server = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,  # the token, on a pipe: not in argv or environ, which the desktop user reads
                stdout=subprocess.PIPE,
                stderr=log if cfg.server_log == "file" else None,
                env=dict(env, DISPLAY=display, **_own_imports()),
                start_new_session=True,
            )
        assert self._server.stdout is not None and self._server.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # a server that died at once is reported below
            self._server.stdin.write(self._token.encode() + b"\n")
            self._server.stdin.close()
        fd = self._server.stdout.fileno()
        deadline = time.monotonic() + cfg.start_timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise DesktopError(
                    "server", f"no port announced within {cfg.start_timeout_s:g} s: {self._server_log()}"
                )
            ready, _, _ = select.select([fd], [], [], min(left, 0.2))
            if not ready:
                continue
            chunk = os.read(fd, 256)
            if not chunk:
                self._server.wait(timeout=5)
                raise DesktopError("server", f"exited with {self._server.returncode}: {self._server_log()}")
            line += chunk
        try:
            self._port = int(json.loads(line)["port"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DesktopError("server", f"unreadable port announcement {line!r}") from exc

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                resp = self._http.get(self.url + "/dart/health", timeout=2.0)
                if resp.status_code == 200:
                    return
                last = resp.text[:300]
            except requests.RequestException as exc:
                last = str(exc)
            if self._server is not None and self._server.poll() is not None:
                raise DesktopError("server", f"exited with {self._server.returncode}: {self._server_log()}")
            time.sleep(0.05)
        raise DesktopError("server", f"not healthy within {self.config.start_timeout_s:g} s: {last}")

    def _server_log(self) -> str:
        if self._tmp is None:
            return ""
        try:
            return (self._tmp / "server.log").read_text(errors="replace")[-2000:].strip()
        except OSError:
            return ""

    def alive(self) -> bool:
        """True while Xvfb and the server both run."""
        return (
            self._display is not None
            and self._display.alive()
            and self._server is not None
            and self._server.poll() is None
        )

    def revert(self) -> None:
        """Reset the episode: kill every process the server started, restore HOME.

        Raises:
            DesktopError: The server did not answer or failed.
        """
        self._require_started()
        if not self.alive():
            raise DesktopError("request", "the desktop died (Xvfb or server exited); close it and start a new one")
        try:
            resp = self._http.post(self.url + "/dart/revert", timeout=self.config.request_timeout_s)
        except requests.RequestException as exc:
            raise DesktopError("request", f"revert failed: {exc}") from exc
        if resp.status_code != 200:
            raise DesktopError("request", f"revert answered {resp.status_code}: {resp.text[:500]}")

    def close(self) -> None:
        """Stop the server, the window manager and Xvfb, remove the temp dirs. Idempotent."""
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        if self._server is not None:
            if self._server.stdout is not None:
                self._server.stdout.close()
            kill_group(self._server)
            if self._tmp is not None:
                # Apps the server started outlive it when it was killed (-9) rather than stopped.
                kill_marked(str(self._tmp / "home"))
        if self._display is not None:
            self._display.stop()
        self._http.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> XDesktop:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _own_imports() -> dict[str, str]:
    """The server is this service's own code and must import what it imports: ``PYTHONPATH`` where DART runs
    from source (a machine without it installed). The commands the server runs get the desktop's environment
    (:func:`~dart.env.desktop.sandbox.desktop_environment`), which drops it."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": path} if path else {}
