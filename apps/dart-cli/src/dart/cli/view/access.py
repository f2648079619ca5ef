"""The viewer's token: what lets a request in when ``dart view`` serves beyond loopback.

A request is let in when it carries the token as ``Authorization: Bearer <token>`` (scripts) or the
``dart_view_token`` cookie (browsers; it holds a digest of the token). A browser gets the cookie by
opening any page once with ``?token=<token>``: the answer is a redirect to the same page without the
token in its address (so it stays out of history and ``Referer``) that sets the cookie (``HttpOnly``,
``SameSite=Strict``). Anything else gets a 401 and nothing of the run. Tokens are compared in constant
time (SHA-256 digests, so their lengths do not leak either).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

COOKIE = "dart_view_token"
"""Name of the cookie that carries the token after a browser opened a page with ``?token=``."""

MIN_TOKEN_CHARS = 16
"""Shortest token accepted: a guessable one protects nothing."""


def read_token(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace removed).

    Raises:
        ValueError: The file cannot be read, or holds fewer than :data:`MIN_TOKEN_CHARS` characters
            (the message says which).
    """
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the token file {path}: {exc}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the token file {path} holds {len(token)} characters; write at least {MIN_TOKEN_CHARS} "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


class TokenCheck:
    """ASGI middleware: pass a request on only when it carries ``token``; see the module docstring.

    Args:
        app: The application behind it.
        token: The secret.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()
        # The cookie holds a value derived from the token (any characters a token has stay out of it).
        self._cookie_value = hashlib.sha256(b"dart-view-cookie:" + token.encode()).hexdigest()

    def _matches(self, presented: str) -> bool:
        return hmac.compare_digest(hashlib.sha256(presented.encode()).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        cookie = _cookie(headers)
        if (scheme.lower() == "bearer" and self._matches(bearer.strip())) or (
            bool(cookie) and hmac.compare_digest(cookie.encode(), self._cookie_value.encode())
        ):
            await self.app(scope, receive, send)
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        offered = [value for name, value in query if name == "token"]
        if offered and self._matches(offered[-1]):
            rest = urlencode([(name, value) for name, value in query if name != "token"])
            path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")  # as it was asked for
            response: Response = RedirectResponse(path + (f"?{rest}" if rest else ""), status_code=303)
            response.set_cookie(COOKIE, self._cookie_value, httponly=True, samesite="strict", path="/")
        else:
            response = PlainTextResponse(
                "this viewer needs its token: open the page once with ?token=<the token>, "
                "or send Authorization: Bearer <the token>\n",
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        await response(scope, receive, send)


def _cookie(headers: Headers) -> str:
    """The token cookie's value, or an empty string."""
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return ""
