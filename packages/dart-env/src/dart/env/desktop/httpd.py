"""The desktop server's HTTP layer: requests, replies, a routing table, and errors answered as JSON.

Routes are plain functions ``(Request) -> Reply`` registered on a :class:`Router`; :func:`serve` runs
them on the standard library's threading HTTP/1.1 server (keep-alive, one thread per connection).
The layer knows nothing of desktops: what a route does lives in :mod:`dart.env.desktop.routes`.

Every request must carry ``Authorization: Bearer <token>`` (the server's token, compared in constant
time) except those to the router's open paths (the health route); others are answered 401 before their
body is read.

Answers the layer gives by itself, each ``{"status": "error", "message": ...}``:

- 401: no token, or a wrong one;
- 400: a bad or too large ``Content-Length``; a route raised :class:`BadRequest` (its status and
  extra JSON keys win);
- 404: no route has that path; 405: a route has the path but not the method;
- 503: a route raised one of the router's ``unavailable`` errors (the display died);
- 500: any other exception in a route (its traceback goes to stderr; the server keeps serving).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import traceback
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from email.parser import BytesParser
from email.policy import HTTP
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 1 << 30
"""Largest request body accepted (uploads)."""
REFUSED_BODY_BYTES = 1 << 16
"""Largest body still read from a request refused for its token (larger ones: the connection is closed)."""


class BadRequest(Exception):
    """The request is malformed; answered ``status`` (400) with ``message`` (and ``extra`` JSON keys)."""

    def __init__(self, message: str, status: int = 400, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.extra = extra


class Reply:
    """An HTTP response: status, content type, body bytes, extra headers."""

    def __init__(
        self, body: bytes, status: int = 200, ctype: str = "application/json", headers: dict[str, str] | None = None
    ) -> None:
        self.body = body
        self.status = status
        self.ctype = ctype
        self.headers = headers or {}

    @classmethod
    def json(cls, data: Any, status: int = 200) -> Reply:
        """A JSON reply."""
        return cls(json.dumps(data).encode(), status)

    @classmethod
    def text(cls, text: str, status: int = 200) -> Reply:
        """A plain text reply (OSWorld answers several routes with bare strings)."""
        return cls(text.encode(), status, "text/html; charset=utf-8")

    @classmethod
    def error(cls, message: str, status: int, extra: Mapping[str, Any] | None = None) -> Reply:
        """``{"status": "error", "message": message, **extra}`` with ``status``."""
        return cls.json({"status": "error", "message": message, **(extra or {})}, status)


class Request:
    """The parts of an HTTP request a route reads.

    Attributes:
        method: ``GET``, ``POST`` or ``HEAD``.
        path: The request target, query included.
        headers: The request headers (a mapping with ``get``).
        body: The body bytes (empty when none).
    """

    def __init__(self, method: str, path: str, headers: Any, body: bytes) -> None:
        self.method = method
        self.path = path
        self.headers = headers or {}
        self.body = body

    def query(self) -> dict[str, list[str]]:
        """The query parameters, each name with its values in order."""
        return urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)

    def json(self) -> dict[str, Any]:
        """The body as a JSON object (an empty body reads as ``{}``).

        Raises:
            BadRequest: The body is not JSON, or not an object.
        """
        if not self.body.strip():
            return {}
        try:
            data = json.loads(self.body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}")
        return data

    def form(self) -> tuple[dict[str, str], dict[str, bytes]]:
        """Form fields and uploaded files (``application/x-www-form-urlencoded`` or ``multipart/form-data``).

        Raises:
            BadRequest: A malformed multipart body, or a form body that is not UTF-8.
        """
        ctype = self.headers.get("Content-Type", "")
        if ctype.startswith("multipart/form-data"):
            return self._multipart(ctype)
        try:
            parsed = urllib.parse.parse_qs(self.body.decode(), keep_blank_values=True)
        except UnicodeDecodeError:
            raise BadRequest("the form body is not UTF-8") from None
        return {k: v[0] for k, v in parsed.items()}, {}

    def _multipart(self, ctype: str) -> tuple[dict[str, str], dict[str, bytes]]:
        msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + self.body)
        if not msg.is_multipart():
            raise BadRequest("malformed multipart/form-data body")
        fields: dict[str, str] = {}
        files: dict[str, bytes] = {}
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if not isinstance(name, str):
                continue
            payload = part.get_payload(decode=True)
            data = payload if isinstance(payload, bytes) else b""
            if part.get_filename() is not None:
                files[name] = data
            else:
                fields[name] = data.decode(errors="replace")
        return fields, files


def json_field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ..., **extra: Any) -> Any:
    """``data[key]`` checked against ``kind`` (a bool is no int here); ``default`` when missing or null.

    Raises:
        BadRequest: The key is missing and has no default, or its value is not a ``kind``; ``extra``
            goes into the reply's JSON keys.
    """
    if key not in data or data[key] is None:
        if default is ...:
            raise BadRequest(f"missing key {key!r}", **extra)
        return default
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"key {key!r} must be {names}, got {type(value).__name__}", **extra)
    return value


Route = Callable[[Request], Reply]
"""A route handler."""


class Router:
    """The routing table: ``(method, path)`` -> route, and the errors every route may raise.

    Args:
        unavailable: Exception types that mean the server cannot do anything now (answered 503).
    """

    def __init__(self, unavailable: tuple[type[Exception], ...] = ()) -> None:
        self._routes: dict[tuple[str, str], Route] = {}
        self._unavailable = unavailable

    def add(self, methods: Iterable[str], path: str, route: Route) -> None:
        """Serve ``path`` with ``route`` for each of ``methods``."""
        for method in methods:
            self._routes[(method, path)] = route

    def dispatch(self, request: Request) -> Reply:
        """The reply to ``request``: its route's, or the error reply that says why there is none."""
        path = _route_path(request.path)
        route = self._routes.get((request.method, path))
        if route is None:
            allowed = sorted(m for m, p in self._routes if p == path)
            if allowed:
                message = f"{request.method} is not allowed on {path}; use {', '.join(allowed)}"
                return Reply.error(message, HTTPStatus.METHOD_NOT_ALLOWED)
            return Reply.error(f"no route {path}", HTTPStatus.NOT_FOUND)
        try:
            return route(request)
        except BadRequest as exc:
            return Reply.error(exc.message, exc.status, exc.extra)
        except self._unavailable as exc:
            return Reply.error(str(exc), HTTPStatus.SERVICE_UNAVAILABLE)
        except Exception as exc:  # a failing route must not take the server down
            traceback.print_exc()
            return Reply.error(f"{type(exc).__name__}: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR)


class BearerToken:
    """The token every request must carry, kept as a digest (equal lengths: the compare leaks no length).

    Args:
        token: The secret (non-empty).
        open_paths: Paths answered without it (a health route).
    """

    def __init__(self, token: str, open_paths: Iterable[str] = ()) -> None:
        if not token:
            raise ValueError("the server's token must not be empty")
        self._digest = hashlib.sha256(token.encode()).digest()
        self.open_paths = frozenset(open_paths)

    def admits(self, path: str, authorization: str | None) -> bool:
        """Whether a request to ``path`` with this ``Authorization`` header value may be served."""
        if _route_path(path) in self.open_paths:
            return True
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(presented.strip().encode()).digest(), self._digest)


def _route_path(target: str) -> str:
    return urllib.parse.urlsplit(target).path.rstrip("/") or "/"


def serve(router: Router, host: str, port: int, *, token: BearerToken, verbose: bool = False) -> ThreadingHTTPServer:
    """An HTTP/1.1 server for ``router`` bound to ``(host, port)`` (0 picks a free port), admitting requests
    that carry ``token``; not yet serving.

    Call ``serve_forever()`` on it; its connection threads are daemons.
    """
    httpd = ThreadingHTTPServer((host, port), _handler(router, token, verbose))
    httpd.daemon_threads = True
    return httpd


def _handler(router: Router, token: BearerToken, verbose: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes; with Nagle on, keep-alive clients wait ~40 ms per reply.
        disable_nagle_algorithm = True
        server_version = "DartDesktop/1"

        def log_message(self, format: str, *args: Any) -> None:
            if verbose:
                super().log_message(format, *args)

        def _send(self, reply: Reply) -> None:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.ctype)
            self.send_header("Content-Length", str(len(reply.body)))
            for key, value in reply.headers.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(reply.body)

        def _handle(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not token.admits(self.path, self.headers.get("Authorization")):
                self._refuse(length)
                return
            if length < 0 or length > MAX_BODY_BYTES:
                self.close_connection = True
                self._send(Reply.error("bad or too large Content-Length", HTTPStatus.BAD_REQUEST))
                return
            body = self.rfile.read(length) if length else b""
            reply = router.dispatch(Request(self.command, self.path, self.headers, body))
            try:
                self._send(reply)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away; nothing to tell it

        def _refuse(self, length: int) -> None:
            # A small body is read, so that closing the connection does not reset it before the client reads
            # the answer; a large one is not worth reading for a stranger.
            if 0 < length <= REFUSED_BODY_BYTES:
                self.rfile.read(length)
            self.close_connection = True
            refusal = Reply.error("send Authorization: Bearer <the desktop's token>", HTTPStatus.UNAUTHORIZED)
            refusal.headers["WWW-Authenticate"] = "Bearer"
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._send(refusal)

        do_GET = _handle
        do_POST = _handle
        do_HEAD = _handle

    return Handler
