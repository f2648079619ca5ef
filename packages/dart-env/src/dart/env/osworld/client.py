"""A blocking client of OSWorld's VM-server HTTP API (``desktop_env/server/main.py``).

The same client talks to a real OSWorld VM and to DART's local desktop, which serves the same API
plus DART extensions under ``/dart/`` (health, typed actions, revert). Every call has a timeout, so a
dead server raises :class:`~dart.env.osworld.errors.OSWorldVMError` instead of hanging.
Only idempotent reads (screenshot, screen size, file, accessibility tree, health) are retried.

Usage::

    client = VMServerClient("http://127.0.0.1:5000", timeout=30)
    png = client.screenshot()
    out = client.execute(["ls", "-la"])          # {"status", "output", "error", "returncode"}
"""

from __future__ import annotations

import json
import time
from pathlib import PurePosixPath
from typing import Any

import requests

from dart.env.osworld.errors import OSWorldVMError

JSONDict = dict[str, Any]

OPEN_FILE_TIMEOUT_S = 60.0
"""Request timeout of ``/setup/open_file``, which waits for the opened application's window."""


class VMServerClient:
    """One OSWorld VM server at ``url``.

    Attributes:
        url: The server's base URL (``http://host:port``), without a trailing slash.
        timeout: Seconds each request may take (connect and read).
        retries: Extra attempts for idempotent reads.

    Args:
        token: Sent as ``Authorization: Bearer <token>`` on every request (a local desktop requires it);
            None for servers that check none.
    """

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 2, *, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self._session = requests.Session()
        if token:
            self._session.headers["Authorization"] = f"Bearer {token}"
        self._dart: bool | None = None

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._session.close()

    # --- transport ---------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        endpoint: str,
        *,
        retry: bool = False,
        timeout: float | None = None,
        ok: tuple[int, ...] = (200,),
        **kwargs: Any,
    ) -> requests.Response:
        attempts = 1 + (self.retries if retry else 0)
        last: OSWorldVMError | None = None
        for attempt in range(attempts):
            try:
                response = self._session.request(method, self.url + endpoint, timeout=timeout or self.timeout, **kwargs)
            except requests.Timeout:
                last = OSWorldVMError(endpoint, None, f"no answer within {timeout or self.timeout:.0f} s")
            except requests.RequestException as exc:
                last = OSWorldVMError(endpoint, None, f"cannot reach {self.url}: {type(exc).__name__}")
            else:
                if response.status_code in ok:
                    return response
                last = OSWorldVMError(endpoint, response.status_code, _error_text(response))
                if response.status_code < 500:
                    break  # the request is wrong; asking again will not help
            if attempt + 1 < attempts:
                time.sleep(0.2 * (attempt + 1))
        assert last is not None
        raise last

    def _json(self, response: requests.Response, endpoint: str) -> JSONDict:
        try:
            data = response.json()
        except ValueError:
            raise OSWorldVMError(endpoint, response.status_code, "answer is not JSON") from None
        if not isinstance(data, dict):
            raise OSWorldVMError(
                endpoint, response.status_code, f"answer is a JSON {type(data).__name__}, not an object"
            )
        return data

    # --- observation -------------------------------------------------------------------------

    def screenshot(self) -> bytes:
        """The screen as PNG bytes (``GET /screenshot``)."""
        response = self._request("GET", "/screenshot", retry=True)
        if not response.content.startswith(b"\x89PNG"):
            raise OSWorldVMError("/screenshot", response.status_code, "answer is not a PNG image")
        return response.content

    def screen_size(self) -> tuple[int, int]:
        """The screen size ``(width, height)`` in pixels (``POST /screen_size``)."""
        data = self._json(self._request("POST", "/screen_size", retry=True), "/screen_size")
        try:
            return int(data["width"]), int(data["height"])
        except (KeyError, TypeError, ValueError):
            raise OSWorldVMError("/screen_size", 200, f"answer lacks width/height: {data}") from None

    def accessibility(self) -> str:
        """The accessibility tree as XML (``GET /accessibility``)."""
        data = self._json(self._request("GET", "/accessibility", retry=True), "/accessibility")
        return str(data.get("AT") or "")

    # --- commands ------------------------------------------------------------------------------

    def execute(self, command: str | list[str], *, shell: bool = False, timeout: float | None = None) -> JSONDict:
        """Run a command on the VM and wait for it (``POST /execute``).

        Returns:
            The server's answer: ``status``, ``output`` (stdout), ``error`` (stderr), ``returncode``.
            A command that fails is an answer, not an exception.
        """
        return self._command("/execute", command, shell, timeout)

    def setup_execute(self, command: str | list[str], *, shell: bool = False, timeout: float | None = None) -> JSONDict:
        """Like :meth:`execute`, through the setup endpoint (``POST /setup/execute``)."""
        return self._command("/setup/execute", command, shell, timeout)

    def _command(self, endpoint: str, command: str | list[str], shell: bool, timeout: float | None) -> JSONDict:
        # OSWorld's server answers 500 with a JSON body when the command cannot start at all.
        response = self._request(
            "POST", endpoint, json={"command": command, "shell": shell}, timeout=timeout, ok=(200, 500)
        )
        data = self._json(response, endpoint)
        if response.status_code != 200 and "returncode" not in data:
            raise OSWorldVMError(endpoint, response.status_code, str(data.get("message") or data))
        return data

    def launch(self, command: str | list[str], *, shell: bool = False) -> None:
        """Start a program without waiting for it (``POST /setup/launch``)."""
        self._request("POST", "/setup/launch", json={"command": command, "shell": shell})

    def open_file(self, path: str) -> None:
        """Open a file (or directory) with its default application (``POST /setup/open_file``).

        The server waits for the application's window (30 s on DART's desktop), so this call may
        take up to ``OPEN_FILE_TIMEOUT_S`` whatever the client's timeout.
        """
        self._request("POST", "/setup/open_file", json={"path": path}, timeout=max(self.timeout, OPEN_FILE_TIMEOUT_S))

    def activate_window(self, window_name: str, *, strict: bool = False, by_class: bool = False) -> None:
        """Raise a window by title (``POST /setup/activate_window``)."""
        body = {"window_name": window_name, "strict": strict, "by_class": by_class}
        self._request("POST", "/setup/activate_window", json=body)

    def close_window(self, window_name: str, *, strict: bool = False, by_class: bool = False) -> None:
        """Close a window by title (``POST /setup/close_window``)."""
        body = {"window_name": window_name, "strict": strict, "by_class": by_class}
        self._request("POST", "/setup/close_window", json=body)

    def run_python(self, code: str) -> JSONDict:
        """Run Python code on the VM (``POST /run_python``)."""
        return self._json(self._request("POST", "/run_python", json={"code": code}, ok=(200, 500)), "/run_python")

    def run_bash_script(self, script: str, *, timeout: float = 30.0, working_dir: str | None = None) -> JSONDict:
        """Run a bash script on the VM (``POST /run_bash_script``)."""
        body: JSONDict = {"script": script, "timeout": timeout}
        if working_dir is not None:
            body["working_dir"] = working_dir
        response = self._request("POST", "/run_bash_script", json=body, timeout=timeout + self.timeout, ok=(200, 500))
        return self._json(response, "/run_bash_script")

    # --- files ---------------------------------------------------------------------------------

    def upload(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` on the VM (``POST /setup/upload``, multipart)."""
        name = PurePosixPath(path).name or "file"
        self._request("POST", "/setup/upload", data={"file_path": path}, files={"file_data": (name, data)})

    def get_file(self, path: str) -> bytes | None:
        """The bytes of a file on the VM (``POST /file``), or None when it does not exist."""
        try:
            return self._request("POST", "/file", data={"file_path": path}, retry=True).content
        except OSWorldVMError as exc:
            if exc.status == 404:
                return None
            raise

    def directory_tree(self, path: str) -> JSONDict | None:
        """The tree ``{"name", "type", "children": [...]}`` under ``path``, or None if it is not a
        directory (``POST /list_directory``; a server without that route gets Python run instead)."""
        response = self._request("POST", "/list_directory", json={"path": path}, ok=(200, 400, 404, 405))
        if response.status_code == 200:
            tree = self._json(response, "/list_directory").get("directory_tree")
            return tree if isinstance(tree, dict) else None
        if response.status_code == 400:
            return None
        result = self._python_json(_TREE_CODE.replace("__PATH__", json.dumps(path)))
        return result if isinstance(result, dict) else None

    def desktop_path(self) -> str:
        """The VM user's desktop directory (``POST /desktop_path``; ``~/Desktop`` when it has none)."""
        response = self._request("POST", "/desktop_path", ok=(200, 404, 405))
        if response.status_code == 200:
            return str(self._json(response, "/desktop_path").get("desktop_path") or "~/Desktop")
        return "~/Desktop"

    def window_size(self, app_class_name: str) -> JSONDict | None:
        """``{"width", "height"}`` of the first window of a class, or None (``POST /window_size``)."""
        response = self._request("POST", "/window_size", data={"app_class_name": app_class_name}, ok=(200, 404))
        return self._json(response, "/window_size") if response.status_code == 200 else None

    def _python_json(self, code: str) -> Any:
        out = self.execute(["python3", "-c", code])
        text = str(out.get("output", "")).strip()
        if out.get("returncode") not in (0, None) or not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return None

    # --- DART extensions -----------------------------------------------------------------------

    def has_dart_extensions(self) -> bool:
        """Whether the server is DART's local desktop (``GET /dart/health`` answers); cached."""
        if self._dart is None:
            try:
                self._request("GET", "/dart/health", retry=True)
                self._dart = True
            except OSWorldVMError as exc:
                if exc.status is None:
                    raise
                self._dart = False
        return self._dart

    def health(self) -> JSONDict:
        """The DART health answer (``GET /dart/health``)."""
        return self._json(self._request("GET", "/dart/health", retry=True), "/dart/health")

    def dart_action(self, action: JSONDict) -> JSONDict:
        """Execute a DART typed action (``POST /dart/action``, DART extension)."""
        return self._json(self._request("POST", "/dart/action", json=action), "/dart/action")


_TREE_CODE = """
import json, os
def tree(p):
    node = {"name": os.path.basename(p.rstrip("/")) or p, "type": "directory" if os.path.isdir(p) else "file"}
    if os.path.isdir(p):
        node["children"] = [tree(os.path.join(p, c)) for c in sorted(os.listdir(p))]
    return node
p = os.path.expanduser(__PATH__)
print(json.dumps(tree(p)) if os.path.exists(p) else "")
"""


def _error_text(response: requests.Response) -> str:
    """The server's error message, short (OSWorld answers JSON ``message``/``error`` or text)."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason or "error"
    if isinstance(data, dict):
        return str(data.get("message") or data.get("error") or data)[:300]
    return str(data)[:300]
