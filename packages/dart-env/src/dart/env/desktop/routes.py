"""The desktop's routes: OSWorld's VM-server operations on a local X display, plus DART's ``/dart/`` ones.

Routes follow OSWorld's ``desktop_env/server/main.py`` (request and response shapes, status
codes, JSON keys) for what its ``PythonController`` and ``SetupController`` use:

- ``GET /screenshot`` (PNG, pointer drawn), ``POST /screen_size``, ``GET /platform``,
  ``GET|POST /cursor_position``, ``GET /accessibility`` (``{"AT": xml}``: an X11 window tree, not
  AT-SPI; see :mod:`dart.env.desktop.windows`), ``POST /list_directory``, ``POST /desktop_path``,
  ``POST /window_size``;
- ``POST /execute`` and ``/setup/execute``, ``/setup/launch``, ``/setup/open_file``,
  ``/setup/upload``, ``/file``, ``/setup/activate_window``, ``/setup/close_window``,
  ``/run_python``, ``/run_bash_script``.

DART extensions: ``GET /dart/health``, ``POST /dart/action`` (one typed action of
:mod:`dart.protocol.messages.actions`, coordinates as screen fractions, run through XTest) and
``POST /dart/revert`` (kill every process started for the episode, restore HOME).

Bad input (bad JSON, missing or mistyped keys) is answered 400 with
``{"status": "error", "message": ...}`` (plus OSWorld's own error keys where it has them); a dead
display 503; unexpected failures 500 (see :mod:`dart.env.desktop.httpd`, which serves these routes).
Commands run with the desktop's ``DISPLAY`` and ``HOME``, with HOME as working directory, in the scrubbed
environment of :mod:`dart.env.desktop.sandbox`, and as its desktop user when the server is root (files the
server writes into HOME are given to that user).
"""

from __future__ import annotations

import mimetypes
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dart.env.desktop import windows
from dart.env.desktop.errors import DesktopError
from dart.env.desktop.httpd import BadRequest, Reply, Request, Router, json_field
from dart.env.desktop.processes import ProcessTracker
from dart.env.desktop.sandbox import DesktopUser, desktop_environment
from dart.env.desktop.xinput import XInput, to_pixel
from dart.protocol.messages.actions import (
    ACTION_ADAPTER,
    Click,
    DoubleClick,
    Drag,
    Fail,
    Finished,
    Hotkey,
    RightClick,
    Scroll,
    Type,
    Wait,
)

EXECUTE_TIMEOUT_S = 120.0
"""Limit of ``/execute`` commands (OSWorld's value)."""
RUN_PYTHON_TIMEOUT_S = 30.0
"""Limit of ``/run_python`` code (OSWorld's value)."""
OPEN_FILE_TIMEOUT_S = 30.0
"""Default wait for the window of ``/setup/open_file`` (OSWorld waits up to 1800 s)."""
TEXT_SUFFIXES = frozenset(
    ".txt .md .csv .tsv .json .yaml .yml .xml .html .htm .py .sh .c .h .cpp .js .ts .css .ini .cfg .conf .log".split()
)
"""File suffixes ``/setup/open_file`` opens in the text editor."""


class DesktopRoutes:
    """Route handlers over one display, its input executor and its process tracker.

    Args:
        display_name: The X display (``:N``).
        home: The desktop's HOME (working directory of every command).
        home_template: Directory whose contents HOME is reset to on revert; None resets to empty.
        user: Account every command runs as (see :func:`~dart.env.desktop.sandbox.resolve_desktop_user`);
            None: the server's own.
        python: Interpreter of ``/run_python`` (the desktop's ``python3``, see :mod:`dart.env.desktop.interpreter`).
    """

    def __init__(
        self,
        display_name: str,
        home: Path,
        home_template: Path | None = None,
        user: DesktopUser | None = None,
        python: str = sys.executable,
    ) -> None:
        self.display_name = display_name
        self.home = home
        self.home_template = home_template
        self.user = user
        self.python = python
        self.xin = XInput(display_name)
        self.procs = ProcessTracker(desktop_environment(home, user, display=display_name), home, user)

    def router(self) -> Router:
        """The routing table of every route; a dead display is answered 503."""
        router = Router(unavailable=(DesktopError,))
        for methods, path, route in [
            (("GET",), "/screenshot", self.screenshot),
            (("GET", "POST"), "/screen_size", self.screen_size),
            (("GET",), "/platform", self.platform),
            (("GET", "POST"), "/cursor_position", self.cursor_position),
            (("GET", "POST"), "/accessibility", self.accessibility),
            (("POST",), "/execute", self.execute),
            (("POST",), "/setup/execute", self.execute),
            (("POST",), "/setup/launch", self.launch),
            (("POST",), "/setup/open_file", self.open_file),
            (("POST",), "/setup/upload", self.upload),
            (("POST",), "/file", self.file),
            (("POST",), "/list_directory", self.list_directory),
            (("POST",), "/desktop_path", self.desktop_path),
            (("POST",), "/window_size", self.window_size),
            (("POST",), "/setup/activate_window", self.activate_window),
            (("POST",), "/setup/close_window", self.close_window),
            (("POST",), "/run_python", self.run_python),
            (("POST",), "/run_bash_script", self.run_bash_script),
            (("GET",), "/dart/health", self.health),
            (("POST",), "/dart/action", self.action),
            (("POST",), "/dart/revert", self.revert),
        ]:
            router.add(methods, path, route)
        return router

    # -- helpers ------------------------------------------------------------------------------

    def _expand(self, path: str) -> Path:
        """A client path with ``~`` and ``$VARS`` expanded against the desktop's HOME."""
        if path == "~" or path.startswith("~/"):
            path = str(self.home) + path[1:]
        return Path(os.path.expandvars(path))

    def _command(self, data: dict[str, Any]) -> tuple[str | list[str], bool]:
        shell = json_field(data, "shell", bool, False)
        command = json_field(data, "command", (str, list), "" if shell else [])
        if isinstance(command, list):
            if not all(isinstance(a, str) for a in command):
                raise BadRequest("key 'command' must be a string or a list of strings")
            # With shell=True a list keeps Popen's meaning (the first item is the script), as in OSWorld.
            command = [str(self._expand(a)) if a.startswith("~/") else a for a in command]
        elif not shell:
            try:
                command = [str(self._expand(a)) if a.startswith("~/") else a for a in shlex.split(command)]
            except ValueError as exc:
                raise BadRequest(f"cannot split the command: {exc}") from None
        if not command:
            raise BadRequest("key 'command' is empty")
        return command, shell

    def _give(self, path: Path) -> None:
        """Hand ``path`` and the folders above it inside HOME, written by this server, to the desktop user."""
        if self.user is None:
            return
        self.user.give(path)
        for parent in path.parents:
            if parent == self.home or not parent.is_relative_to(self.home):
                break
            self.user.give(parent, recursive=False)

    def _script(self, text: str, suffix: str) -> str:
        """A temp file holding ``text`` that the desktop user can read; the caller removes it."""
        with tempfile.NamedTemporaryFile("w", suffix=suffix, prefix="dart_run_", delete=False) as tmp:
            tmp.write(text)
        if self.user is not None:
            self.user.give(Path(tmp.name))
        return tmp.name

    # -- OSWorld routes -----------------------------------------------------------------------

    def screenshot(self, req: Request) -> Reply:
        """``GET /screenshot``: PNG of the screen with the pointer drawn (``?cursor=0`` leaves it out)."""
        cursor = req.query().get("cursor", ["1"])[0] not in ("0", "false")
        return Reply(self.xin.screenshot_png(cursor=cursor), ctype="image/png")

    def screen_size(self, req: Request) -> Reply:
        """``POST /screen_size``: ``{"width", "height"}``."""
        return Reply.json({"width": self.xin.width, "height": self.xin.height})

    def platform(self, req: Request) -> Reply:
        """``GET /platform``: ``Linux``."""
        return Reply.text(platform.system())

    def cursor_position(self, req: Request) -> Reply:
        """``GET /cursor_position``: ``[x, y]``."""
        return Reply.json(list(self.xin.cursor_position()))

    def accessibility(self, req: Request) -> Reply:
        """``GET /accessibility``: ``{"AT": xml}`` with the X11 window tree (no AT-SPI here)."""
        return Reply.json({"AT": windows.window_tree_xml(self.display_name)})

    def execute(self, req: Request) -> Reply:
        """``POST /execute``: run to completion; ``{"status", "output", "error", "returncode"}``."""
        command, shell = self._command(req.json())
        try:
            code, out, err = self.procs.run(command, shell=shell, timeout=EXECUTE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            return Reply.json({"status": "error", "message": str(exc)}, 500)
        return Reply.json({"status": "success", "output": out, "error": err, "returncode": code})

    def launch(self, req: Request) -> Reply:
        """``POST /setup/launch``: start detached; answers ``"<command> launched successfully"``."""
        command, shell = self._command(req.json())
        try:
            self.procs.launch(command, shell=shell)
        except OSError as exc:
            return Reply.json({"status": "error", "message": str(exc)}, 500)
        shown = command if isinstance(command, str) else " ".join(command)
        return Reply.text(f"{shown} launched successfully")

    def open_file(self, req: Request) -> Reply:
        """``POST /setup/open_file``: open a file in its app (text in mousepad) and wait for its window."""
        data = req.json()
        path = json_field(data, "path", str)
        window_name = json_field(data, "window_name", str, "")
        timeout = json_field(data, "timeout_seconds", (int, float, str), OPEN_FILE_TIMEOUT_S)
        try:
            timeout_s = float(timeout)
        except ValueError:
            raise BadRequest(f"invalid timeout_seconds: {timeout!r}") from None
        target = self._expand(path)
        if target.is_dir():
            command: list[str] = ["xterm", "-T", target.name or str(target)]
            names = [target.name or str(target)]
            self.procs.launch(command, shell=False, cwd=target)
        elif target.exists():
            command = self._opener(target)
            names = [target.name, target.stem]
            self.procs.launch(command, shell=False)
        elif shutil.which(path):
            command, names = [path], [path]
            self.procs.launch(command, shell=False)
        else:
            return Reply.json({"status": "error", "message": f"Application/file not found: {path}"}, 404)
        found = windows.wait_window(self.display_name, [window_name] if window_name else names, timeout_s)
        if found is None:
            return Reply.text(f"Failed to find window for {names} within {timeout_s:g} seconds.", 500)
        windows.activate(self.display_name, found.id)
        return Reply.text("File opened and window activated successfully")

    @staticmethod
    def _opener(target: Path) -> list[str]:
        mime, _ = mimetypes.guess_type(target.name)
        if target.suffix.lower() in TEXT_SUFFIXES or (mime or "").startswith("text/") or not target.suffix:
            return ["mousepad", str(target)]
        if shutil.which("xdg-open"):
            return ["xdg-open", str(target)]
        return ["mousepad", str(target)]

    def upload(self, req: Request) -> Reply:
        """``POST /setup/upload``: multipart ``file_path`` + ``file_data``; answers ``"File Uploaded: N bytes"``."""
        fields, files = req.form()
        if "file_path" not in fields or "file_data" not in files:
            msg = "file_path and file_data are required"
            raise BadRequest(msg, error=msg)
        target = self._expand(fields["file_path"])
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files["file_data"])
            self._give(target)
        except OSError as exc:
            return Reply.json({"status": "error", "message": str(exc), "error": f"Failed to upload file: {exc}"}, 500)
        return Reply.text(f"File Uploaded: {target.stat().st_size} bytes")

    def file(self, req: Request) -> Reply:
        """``POST /file``: form ``file_path``; the file's bytes, or 404 ``{"error": "File not found"}``."""
        fields, _ = req.form()
        if "file_path" not in fields:
            raise BadRequest("file_path is required", error="file_path is required")
        target = self._expand(fields["file_path"])
        if not target.is_file():
            return Reply.json(
                {"status": "error", "message": f"File not found: {target}", "error": "File not found"}, 404
            )
        try:
            body = target.read_bytes()
        except OSError as exc:
            return Reply.json({"status": "error", "message": str(exc), "error": f"Failed to serve file: {exc}"}, 500)
        return Reply(
            body,
            ctype="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{urllib.parse.quote(target.name)}"'},
        )

    def list_directory(self, req: Request) -> Reply:
        """``POST /list_directory``: ``{"path"}`` -> ``{"directory_tree": {...}}``."""
        data = req.json()
        path = json_field(data, "path", str, error="Missing 'path' parameter")
        start = self._expand(path)
        if not start.is_dir():
            raise BadRequest("The provided path is not a directory", error="The provided path is not a directory")

        def tree(d: Path) -> dict[str, Any]:
            node: dict[str, Any] = {"type": "directory", "name": d.name, "children": []}
            try:
                for entry in sorted(d.iterdir()):
                    if entry.is_dir() and not entry.is_symlink():
                        node["children"].append(tree(entry))
                    else:
                        node["children"].append({"type": "file", "name": entry.name})
            except OSError as exc:
                return {"error": str(exc)}
            return node

        return Reply.json({"directory_tree": tree(start)})

    def desktop_path(self, req: Request) -> Reply:
        """``POST /desktop_path``: ``{"desktop_path"}`` or 404."""
        desktop = self.home / "Desktop"
        if desktop.is_dir():
            return Reply.json({"desktop_path": str(desktop)})
        return Reply.json({"error": "Unsupported operating system or desktop path not found"}, 404)

    def window_size(self, req: Request) -> Reply:
        """``POST /window_size``: form ``app_class_name`` -> ``{"width", "height"}`` of its window."""
        fields, _ = req.form()
        if "app_class_name" not in fields:
            raise BadRequest("app_class_name is required", error="app_class_name is required")
        info = windows.find_window(self.display_name, fields["app_class_name"], by_class=True)
        if info is None:
            return Reply.json({"status": "error", "message": "no window of that class", "error": "not found"}, 404)
        return Reply.json({"width": info.width, "height": info.height})

    def _window_request(self, req: Request) -> tuple[windows.WindowInfo | None, str]:
        data = req.json()
        name = json_field(data, "window_name", str)
        if not name:
            raise BadRequest("window_name required")
        strict = json_field(data, "strict", bool, False)
        by_class = json_field(data, "by_class", bool, False)
        return windows.find_window(self.display_name, name, strict=strict, by_class=by_class), name

    def activate_window(self, req: Request) -> Reply:
        """``POST /setup/activate_window``: ``{"window_name", "strict", "by_class"}`` (wmctrl -a semantics)."""
        info, name = self._window_request(req)
        if info is None:
            return Reply.text(f"Window {name} not found (empty results)", 404)
        windows.activate(self.display_name, info.id)
        return Reply.text("Window activated successfully")

    def close_window(self, req: Request) -> Reply:
        """``POST /setup/close_window``: ``{"window_name", "strict", "by_class"}`` (wmctrl -c semantics)."""
        info, name = self._window_request(req)
        if info is None:
            return Reply.text(f"Window {name} not found (empty results)", 404)
        windows.close(self.display_name, info.id)
        return Reply.text("Window closed successfully.")

    def run_python(self, req: Request) -> Reply:
        """``POST /run_python``: ``{"code"}`` -> ``{"status","message","need_more","output","error","return_code"}``."""
        data = req.json()
        code = json_field(data, "code", str, "")
        if not code:
            raise BadRequest("Code not supplied!")
        script = self._script(code, ".py")
        try:
            rc, out, err = self.procs.run([self.python, script], shell=False, timeout=RUN_PYTHON_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Reply.json(
                {
                    "status": "error",
                    "message": "Execution timeout: Code took too long to execute",
                    "error": "TimeoutExpired",
                    "need_more": False,
                    "output": None,
                },
                500,
            )
        finally:
            os.unlink(script)
        message = out + (("\n" if out else "") + err if err else "")
        if rc != 0 and not err:
            err = f"Process exited with code {rc}"
            message = f"{message}\n{err}" if message else err
        return Reply.json(
            {
                "status": "success" if rc == 0 else "error",
                "message": message,
                "need_more": False,
                "output": out,
                "error": err,
                "return_code": rc,
            }
        )

    def run_bash_script(self, req: Request) -> Reply:
        """``POST /run_bash_script``: ``{"script", "timeout", "working_dir"}``.

        Answers ``{"status", "output", "error", "returncode"}`` (stderr merged into output).
        """
        data = req.json()
        bad = {"output": "", "error": "", "returncode": -1}
        script = json_field(data, "script", str, "", **bad)
        if not script:
            raise BadRequest("Script not supplied!", output="Script not supplied!", error="", returncode=-1)
        timeout = json_field(data, "timeout", (int, float), 100, **bad)
        working_dir = json_field(data, "working_dir", str, "", **bad)
        cwd = self.home
        if working_dir:
            cwd = self._expand(working_dir)
            if not cwd.is_dir():
                msg = f"Working directory does not exist: {cwd}"
                raise BadRequest(msg, output=msg, error="", returncode=-1)
        if "#!/bin/bash" not in script:
            script = "#!/bin/bash\n\n" + script
        path = self._script(script, ".sh")
        try:
            rc, out, _ = self.procs.run(
                ["/bin/bash", path], shell=False, timeout=float(timeout), cwd=cwd, merge_stderr=True
            )
        except subprocess.TimeoutExpired:
            return Reply.json(
                {
                    "status": "error",
                    "output": f"Script execution timed out after {timeout} seconds",
                    "error": "",
                    "returncode": -1,
                },
                500,
            )
        finally:
            os.unlink(path)
        return Reply.json({"status": "success" if rc == 0 else "error", "output": out, "error": "", "returncode": rc})

    # -- DART routes --------------------------------------------------------------------------

    def health(self, req: Request) -> Reply:
        """``GET /dart/health``: ``{"status": "ok", "display", "screen": [w, h]}``; 503 when X is gone."""
        self.xin.cursor_position()  # a round trip: raises DesktopError when the display died
        return Reply.json({"status": "ok", "display": self.display_name, "screen": [self.xin.width, self.xin.height]})

    def action(self, req: Request) -> Reply:
        """``POST /dart/action``: run one typed DART action; ``{"status": "success"}``."""
        try:
            act = ACTION_ADAPTER.validate_json(req.body or b"{}")
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                for err in exc.errors(include_url=False)
            )
            raise BadRequest(f"invalid action: {problems}") from None
        w, h = self.xin.width, self.xin.height
        try:
            match act:
                case Click(x=x, y=y):
                    self.xin.click(to_pixel(x, w), to_pixel(y, h))
                case DoubleClick(x=x, y=y):
                    self.xin.click(to_pixel(x, w), to_pixel(y, h), clicks=2)
                case RightClick(x=x, y=y):
                    self.xin.click(to_pixel(x, w), to_pixel(y, h), button=3)
                case Drag(x1=x1, y1=y1, x2=x2, y2=y2):
                    self.xin.drag(to_pixel(x1, w), to_pixel(y1, h), to_pixel(x2, w), to_pixel(y2, h))
                case Type(text=text):
                    self.xin.type_text(text)
                case Hotkey(keys=keys):
                    self.xin.hotkey(keys)
                case Scroll(x=x, y=y, direction=direction, amount=amount):
                    self.xin.scroll(to_pixel(x, w), to_pixel(y, h), direction.value, amount)
                case Wait(seconds=seconds):
                    time.sleep(seconds)
                case Finished() | Fail():
                    pass
        except ValueError as exc:
            raise BadRequest(f"invalid action: {exc}") from None
        return Reply.json({"status": "success"})

    def revert(self, req: Request) -> Reply:
        """``POST /dart/revert``: kill the episode's processes, restore HOME; ``{"status", "killed"}``."""
        killed = self.procs.kill_all()
        self._reset_home()
        return Reply.json({"status": "success", "killed": killed})

    def _reset_home(self) -> None:
        for entry in list(self.home.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if self.home_template is not None:
            shutil.copytree(self.home_template, self.home, symlinks=True, dirs_exist_ok=True)
        if self.user is not None:
            self.user.give(self.home)

    def close(self) -> None:
        """Kill the episode's processes and close the X connection."""
        self.procs.kill_all()
        self.xin.close()
