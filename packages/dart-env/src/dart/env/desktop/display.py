"""An Xvfb display with a window manager, each in its own process group.

Lifecycle: ``created`` --start()--> ``running`` --stop()--> ``stopped`` (idempotent). Xvfb picks a
free display number itself (``-displayfd``), so many displays can start at once without races.
If Xvfb dies on its own, :meth:`XvfbDisplay.alive` turns False; stop() still cleans up.
"""

from __future__ import annotations

import os
import select
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape as xml_escape

from dart.env.desktop.errors import DesktopError
from dart.env.desktop.sandbox import DesktopUser, desktop_environment

_KILL_GRACE_S = 2.0
"""Seconds between SIGTERM and SIGKILL when stopping a process group."""


def kill_group(proc: subprocess.Popen[bytes] | None, grace_s: float = _KILL_GRACE_S) -> None:
    """Terminate the process group led by ``proc`` (TERM, then KILL after ``grace_s``) and reap it.

    A process already reaped (``returncode`` set) is left alone.
    """
    if proc is None or proc.returncode is not None:
        # Already reaped: its pid (and group id) may belong to someone else by now.
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=grace_s)
            # The leader is gone; members may linger: one more KILL to the group is harmless.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait(timeout=grace_s)


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""


class XvfbDisplay:
    """One Xvfb server plus an optional window manager.

    Args:
        width: Screen width, pixels.
        height: Screen height, pixels.
        window_manager: Executable of the window manager (``openbox``), or ``none``.
        log_dir: Where ``xvfb.log`` and ``wm.log`` go.
        env: Environment of Xvfb and the window manager (``HOME`` etc.; ``DISPLAY`` is added); default:
            :func:`~dart.env.desktop.sandbox.desktop_environment` with this process's HOME.
        user: Account both run as (a root caller's ``desktop_user``); None: this process's.
        start_timeout_s: How long Xvfb may take to announce its display.
        terminal_command: With openbox: what Ctrl+Alt+T runs (Ubuntu's terminal shortcut, which
            OSWorld-style agents use); None leaves openbox's own key bindings alone.
    """

    def __init__(
        self,
        width: int,
        height: int,
        *,
        window_manager: str = "openbox",
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        user: DesktopUser | None = None,
        start_timeout_s: float = 10.0,
        terminal_command: Sequence[str] | None = None,
    ) -> None:
        self.width = width
        self.height = height
        self.window_manager = window_manager
        self.log_dir = log_dir
        self.env = dict(env) if env is not None else desktop_environment(Path.home(), user)
        self.user = user
        self.start_timeout_s = start_timeout_s
        self.terminal_command = list(terminal_command) if terminal_command is not None else None
        self.display: str = ""
        self.xvfb: subprocess.Popen[bytes] | None = None
        self.wm: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        """Start Xvfb and the window manager; returns the display name (``:N``).

        Raises:
            DesktopError: Xvfb or the window manager is missing or failed to start.
        """
        xvfb_bin = shutil.which("Xvfb")
        if xvfb_bin is None:
            raise DesktopError("xvfb", "Xvfb is not installed (apt-get install xvfb)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        xvfb_log = self.log_dir / "xvfb.log"
        read_fd, write_fd = os.pipe()
        try:
            with xvfb_log.open("wb") as log:
                self.xvfb = subprocess.Popen(
                    [
                        xvfb_bin,
                        "-displayfd",
                        str(write_fd),
                        "-screen",
                        "0",
                        f"{self.width}x{self.height}x24",
                        "-nolisten",
                        "tcp",
                        "-noreset",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_fd,),
                    env=self.env,
                    start_new_session=True,
                    **self._as_user(),
                )
            os.close(write_fd)
            write_fd = -1
            number = self._read_display_number(read_fd, xvfb_log)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        self.display = f":{number}"
        self._start_wm()
        return self.display

    def _read_display_number(self, fd: int, log: Path) -> int:
        deadline = time.monotonic() + self.start_timeout_s
        data = b""
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise DesktopError("xvfb", f"no display announced within {self.start_timeout_s:g} s: {_tail(log)}")
            ready, _, _ = select.select([fd], [], [], min(left, 0.2))
            if not ready:
                continue
            chunk = os.read(fd, 64)
            if not chunk:
                self.stop()
                raise DesktopError("xvfb", f"Xvfb exited before announcing a display: {_tail(log)}")
            data += chunk
        return int(data.strip())

    def _start_wm(self) -> None:
        if self.window_manager in ("", "none"):
            return
        wm_bin = shutil.which(self.window_manager)
        if wm_bin is None:
            self.stop()
            raise DesktopError("wm", f"window manager {self.window_manager!r} is not installed; or use 'none'")
        env = dict(self.env, DISPLAY=self.display)
        argv = [wm_bin]
        if Path(wm_bin).name == "openbox" and self.terminal_command and (rc := self._openbox_rc()) is not None:
            argv += ["--config-file", str(rc)]
        with (self.log_dir / "wm.log").open("wb") as log:
            self.wm = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                **self._as_user(),
            )
        self._wait_wm()

    def _as_user(self) -> dict[str, Any]:
        return self.user.popen_kwargs() if self.user is not None else {}

    def _openbox_rc(self) -> Path | None:
        """openbox's system rc.xml plus a Ctrl+Alt+T binding to the terminal, written to the log dir
        (None, keeping openbox's defaults, when the system file is missing or has no keyboard section)."""
        system_rc = Path("/etc/xdg/openbox/rc.xml")
        try:
            text = system_rc.read_text(encoding="utf-8")
        except OSError:
            return None
        if "</keyboard>" not in text:
            return None
        command = xml_escape(shlex.join(self.terminal_command or []))
        binding = f'<keybind key="C-A-t"><action name="Execute"><command>{command}</command></action></keybind>\n'
        rc = self.log_dir / "openbox-rc.xml"
        rc.write_text(text.replace("</keyboard>", binding + "</keyboard>", 1), encoding="utf-8")
        return rc

    def _wait_wm(self) -> None:
        """Wait until the window manager owns the screen (``_NET_SUPPORTING_WM_CHECK`` on the root)."""
        from Xlib import X, display  # type: ignore[import-untyped]

        deadline = time.monotonic() + self.start_timeout_s
        conn = display.Display(self.display)
        try:
            atom = conn.intern_atom("_NET_SUPPORTING_WM_CHECK")
            root = conn.screen().root
            while time.monotonic() < deadline:
                if self.wm is not None and self.wm.poll() is not None:
                    code = self.wm.returncode
                    self.stop()
                    raise DesktopError("wm", f"exited with {code}: {_tail(self.log_dir / 'wm.log')}")
                if root.get_full_property(atom, X.AnyPropertyType) is not None:
                    return
                time.sleep(0.02)
        finally:
            conn.close()
        self.stop()
        raise DesktopError("wm", f"did not take the screen within {self.start_timeout_s:g} s")

    @property
    def pids(self) -> dict[str, int | None]:
        """Process ids: ``{"xvfb": ..., "wm": ...}`` (None where not running)."""
        return {
            "xvfb": self.xvfb.pid if self.xvfb is not None else None,
            "wm": self.wm.pid if self.wm is not None else None,
        }

    def alive(self) -> bool:
        """True while Xvfb runs."""
        return self.xvfb is not None and self.xvfb.poll() is None

    def stop(self) -> None:
        """Kill the window manager and Xvfb (TERM then KILL, whole process groups). Idempotent."""
        kill_group(self.wm)
        kill_group(self.xvfb)
