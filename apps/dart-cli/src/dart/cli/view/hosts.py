"""The viewer answers only requests addressed to a host name it serves under (no DNS rebinding).

A page in a browser could otherwise point a name it controls at 127.0.0.1 and read the viewer's pages
(trajectories, screenshots) as its own origin. Requests whose ``Host`` header names another host get a
400 and nothing else.
"""

from __future__ import annotations

from collections.abc import Collection
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""The names of this machine's loopback interface, which ``dart view`` answers to by default."""


def is_loopback(host: str) -> bool:
    """Whether ``dart view --host`` keeps the viewer on this machine."""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


class HostCheck:
    """ASGI middleware: pass a request on only when its ``Host`` names one of ``hosts``.

    Args:
        app: The application behind it.
        hosts: Host names (no port) accepted, e.g. :data:`LOOPBACK_HOSTS`.
    """

    def __init__(self, app: ASGIApp, hosts: Collection[str]) -> None:
        self.app = app
        self.hosts = frozenset(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = Headers(scope=scope).get("host", "")
            try:
                name = urlsplit("//" + header).hostname or ""
            except ValueError:
                name = ""
            if name not in self.hosts:
                shown = header[:100]
                response = PlainTextResponse(f"this viewer does not serve host {shown!r}\n", status_code=400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
