"""The VM-server client against a real (tiny, stdlib) HTTP server: errors, retries, timeouts."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dart.env.errors import EnvError
from dart.env.osworld.client import VMServerClient
from dart.env.osworld.errors import OSWorldVMError
from dart.runtime.ports import free_port

pytestmark = pytest.mark.unit

PNG = b"\x89PNG\r\n\x1a\n" + b"0" * 16


class PlainOSWorldServer(ThreadingHTTPServer):
    """Answers like an OSWorld VM server without DART extensions, with scripted failures."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hits: Counter[str] = Counter()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: PlainOSWorldServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        try:
            self.send_response(status)
        except (BrokenPipeError, ConnectionResetError):
            return
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out and left, which is what the timeout test wants

    def _json(self, status: int, data: object) -> None:
        self._reply(status, json.dumps(data).encode())

    def do_GET(self) -> None:
        self.server.hits[self.path] += 1
        if self.path == "/screenshot":
            if self.server.hits[self.path] == 1:  # a transient failure first
                self._json(503, {"message": "busy"})
            else:
                self._reply(200, PNG, "image/png")
        else:
            self._reply(404, b"<h1>Not Found</h1>", "text/html")

    def do_POST(self) -> None:
        self.server.hits[self.path] += 1
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.path == "/screen_size":
            time.sleep(1.5)
            self._json(200, {"width": 800, "height": 600})
        elif self.path == "/execute":
            command = json.loads(body)["command"]
            if command == "boom":
                self._json(500, {"status": "error", "message": "cannot run boom"})
            else:
                self._json(200, {"status": "success", "output": "hi\n", "error": "", "returncode": 0})
        elif self.path == "/file":
            self._json(404, {"error": "File not found"})
        elif self.path == "/setup/launch":
            self._json(400, {"status": "error", "message": "command is required"})
        else:
            self._reply(404, b"<h1>Not Found</h1>", "text/html")


@pytest.fixture
def server() -> Iterator[PlainOSWorldServer]:
    srv = PlainOSWorldServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_command_answers_and_server_errors(server: PlainOSWorldServer) -> None:
    client = VMServerClient(server.url, timeout=5)
    assert client.execute(["echo", "hi"])["output"] == "hi\n"
    with pytest.raises(OSWorldVMError) as err:
        client.execute("boom", shell=True)
    assert err.value.endpoint == "/execute" and err.value.status == 500
    assert "cannot run boom" in str(err.value)
    assert server.hits["/execute"] == 2  # commands are never retried


def test_client_errors_are_not_retried(server: PlainOSWorldServer) -> None:
    client = VMServerClient(server.url, timeout=5, retries=3)
    with pytest.raises(OSWorldVMError) as err:
        client.launch([])
    assert err.value.status == 400 and "command is required" in str(err.value)
    assert isinstance(err.value, EnvError)
    assert server.hits["/setup/launch"] == 1


def test_idempotent_reads_are_retried(server: PlainOSWorldServer) -> None:
    client = VMServerClient(server.url, timeout=5, retries=2)
    assert client.screenshot() == PNG
    assert server.hits["/screenshot"] == 2


def test_missing_file_is_none(server: PlainOSWorldServer) -> None:
    assert VMServerClient(server.url, timeout=5).get_file("/nope") is None


def test_plain_osworld_server_has_no_dart_extensions(server: PlainOSWorldServer) -> None:
    assert VMServerClient(server.url, timeout=5).has_dart_extensions() is False


def test_timeout_raises_instead_of_hanging(server: PlainOSWorldServer) -> None:
    client = VMServerClient(server.url, timeout=0.3, retries=0)
    with pytest.raises(OSWorldVMError) as err:
        client.screen_size()
    assert err.value.status is None and "no answer within" in str(err.value)


def test_unreachable_server() -> None:
    client = VMServerClient(f"http://127.0.0.1:{free_port()}", timeout=2, retries=1)
    with pytest.raises(OSWorldVMError) as err:
        client.screenshot()
    assert err.value.status is None and "cannot reach" in str(err.value)
    with pytest.raises(OSWorldVMError):
        client.has_dart_extensions()  # no answer at all is an error, not "no extensions"
