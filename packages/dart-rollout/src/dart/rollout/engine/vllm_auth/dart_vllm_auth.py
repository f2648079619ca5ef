"""Bearer-token check for a vLLM server DART talks to, loaded by ``vllm serve --middleware``.

vLLM's own ``--api-key`` guards only paths under ``/v1`` (and a few more prefixes); the dev-mode routes
DART needs (``/pause``, ``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``, adapter loading) stay
open to anyone who reaches the port. This middleware refuses every request, on every path but
``/health``, that lacks ``Authorization: Bearer <token>``: 401 for HTTP, close code 1008 for websockets.

The token is read once from the environment variable :data:`TOKEN_ENV` (never from argv, which
``/proc/<pid>/cmdline`` shows to every user); a server started without it fails at its first request
(the lifespan startup) instead of serving unguarded.

Standalone on purpose: the vLLM environment does not have DART installed, so the launcher puts this
file's directory on the server's ``PYTHONPATH``. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

TOKEN_ENV = "DART_VLLM_TOKEN"
"""Environment variable holding the token the server requires."""

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without a token: liveness only, it reveals nothing and changes nothing."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_REFUSAL = b'{"error": "Unauthorized: send Authorization: Bearer <token>"}'


class BearerTokenMiddleware:
    """Pure ASGI middleware: ``vllm serve --middleware dart_vllm_auth.BearerTokenMiddleware``.

    Raises:
        RuntimeError: :data:`TOKEN_ENV` is unset or empty (the server then does not start).
    """

    def __init__(self, app: ASGIApp) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"dart_vllm_auth: set {TOKEN_ENV} to the token clients must send")
        self.app = app
        # Digests of equal length, so the constant-time compare does not leak the token's length either.
        self._digest = hashlib.sha256(token.encode()).digest()

    def authorized(self, scope: Scope) -> bool:
        """Whether the request carries the bearer token (compared in constant time)."""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, presented = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                return hmac.compare_digest(hashlib.sha256(presented.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan: startup and shutdown pass
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(_REFUSAL)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": _REFUSAL})
