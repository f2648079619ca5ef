"""Errors raised by the local X desktop backend."""

from __future__ import annotations

from dart.env.errors import EnvError


class DesktopError(EnvError):
    """The local X desktop failed: Xvfb, the window manager or the VM server did not start or died.

    The message says which part failed and carries the tail of its log. If it happens at start,
    check that the Debian packages are installed (``apt-get install xvfb openbox xterm mousepad``)
    or set ``window_manager="none"``.

    Attributes:
        part: ``xvfb``, ``wm``, ``server``, ``home`` (the home template), ``user`` (the ``desktop_user``
            setting) or ``request``.
    """

    def __init__(self, part: str, detail: str) -> None:
        self.part = part
        self.detail = detail
        super().__init__(f"local desktop ({part}): {detail}")
