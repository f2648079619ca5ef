"""Errors raised by the MiniWoB++ backend."""

from __future__ import annotations

from dart.env.errors import EnvError


class BrowserError(EnvError):
    """The browser failed: it did not start, crashed, or a task page did not load.

    The env service treats it like any crash: the call is answered ``env_failed`` and the
    instance is replaced. If it happens at start, check that Chromium and chromedriver are
    installed (``apt-get install chromium chromium-driver``) or point ``MINIWOB_CHROME_BINARY``
    and ``MINIWOB_CHROMEDRIVER`` at them.
    """
