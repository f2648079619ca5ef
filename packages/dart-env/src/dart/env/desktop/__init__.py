"""A local X desktop (Xvfb + window manager + real apps) that speaks OSWorld's VM-server HTTP protocol.

- :mod:`dart.env.desktop.desktop`: :class:`XDesktop`, one desktop's lifecycle (start, revert, close).
- :mod:`dart.env.desktop.server`: the VM server process (OSWorld routes plus ``/dart/``): the routes
  in :mod:`dart.env.desktop.routes`, its HTTP layer in :mod:`dart.env.desktop.httpd`.
- :mod:`dart.env.desktop.xinput`: persistent XTest input and mss screenshots.
- :mod:`dart.env.desktop.display`: Xvfb and the window manager.
- :mod:`dart.env.desktop.windows`: top-level windows and the X11 window-tree XML.
- :mod:`dart.env.desktop.sandbox`: what its processes run with (a scrubbed environment, an unprivileged
  user under root); :mod:`dart.env.desktop.interpreter`: its ``python`` and ``python3``.
- :mod:`dart.env.desktop.probe`: an X client that logs the input it receives (test ground truth).

The public names are imported lazily, so the server and probe processes (which import this
package first) do not pay for ``requests`` and the config models at start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dart.env.desktop.desktop import DesktopConfig, XDesktop
    from dart.env.desktop.errors import DesktopError

__all__ = ["DesktopConfig", "DesktopError", "XDesktop"]

_HOMES = {"DesktopConfig": "desktop", "XDesktop": "desktop", "DesktopError": "errors"}


def __getattr__(name: str) -> Any:
    module = _HOMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
