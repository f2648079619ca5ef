"""What the agent's desktop runs with: a scrubbed environment and, under root, an unprivileged user.

Everything on the desktop (Xvfb, the window manager, apps, terminals, every command run for a task)
is the agent's to read: a terminal's ``env``, a file it can ``cat``, a page it can type into. So:

- **Environment**: :func:`desktop_environment` builds it from an *allow-list* of the service's
  variables (``PATH``, locale, ``TZ``, ``TERM``) plus what the desktop sets itself (``DISPLAY``,
  ``HOME``, ...). An allow-list rather than the service's environment minus known secrets, because
  a deny-list fails open: the store keys (``DART_S3_*``, ``AWS_*``), the bus password and token
  variables and proxy tokens are known today, the next provider's ``*_CREDENTIALS`` is not. No
  variable of the service named ``DART_*`` or looking like a credential passes, whatever the
  allow-list says; the only ``DART_*`` on the desktop is its own process marker (its HOME).
- **User**: a service running as root starts the desktop's processes as :class:`DesktopUser` (the
  ``desktop_user`` setting, ``nobody`` by default) with no supplementary groups, so they can read
  neither root's files (a run's ``secrets/`` directory, mode 0700) nor the service's own
  ``/proc/<pid>/environ``. A service that is not root cannot switch users: its desktop runs as its
  own user, which keeps secrets out of the environment but not out of that user's files.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dart.env.desktop.errors import DesktopError

ALLOWED_VARS = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "COLORTERM", "USER", "LOGNAME"})
"""Variables of the service's environment the desktop keeps (besides ``LC_*``)."""
ALLOWED_PREFIXES = ("LC_",)
"""Prefixes of the service's variables the desktop keeps (the locale categories)."""
SECRET_LOOKING = re.compile(r"^DART_|^AWS_|^S3_|^NATS_|TOKEN|PASSW|SECRET|KEY|CREDENTIAL|AUTH|PROXY", re.IGNORECASE)
"""Names never taken from the service's environment, even when allowed: a fence behind the allow-list."""
SESSION_SETTINGS = {"NO_AT_BRIDGE": "1", "GSETTINGS_BACKEND": "keyfile"}
"""Set on every desktop process. GSettings without a session bus (dconf) would drop every ``gsettings
set``: the keyfile backend keeps them in HOME/.config, so they last the episode and a revert clears them.
No AT-SPI bridge either (there is no accessibility bus)."""


def desktop_environment(
    home: Path,
    user: DesktopUser | None,
    *,
    display: str | None = None,
    extra: Mapping[str, str] | None = None,
    source: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a desktop process: the allowed part of ``source`` plus the desktop's own settings.

    Args:
        home: The desktop's HOME.
        user: The account the process runs as (sets ``USER`` and ``LOGNAME``); None: this process's.
        display: The X display (``:N``), when there is one yet.
        extra: More of the desktop's own variables (its process marker); they override the rest.
        source: The environment to pick from (default: this process's); not changed.
    """
    base = os.environ if source is None else source
    env = {
        name: value
        for name, value in base.items()
        if (name in ALLOWED_VARS or name.startswith(ALLOWED_PREFIXES)) and not SECRET_LOOKING.search(name)
    }
    env.update(SESSION_SETTINGS, HOME=str(home))
    if user is not None:
        env.update(USER=user.name, LOGNAME=user.name)
    if display is not None:
        env["DISPLAY"] = display
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class DesktopUser:
    """The unprivileged account a root service runs its desktop's processes as."""

    name: str
    """Account name (the ``desktop_user`` setting)."""
    uid: int
    """Its user id (never 0)."""
    gid: int
    """Its primary group id."""

    def popen_kwargs(self) -> dict[str, Any]:
        """Arguments of ``subprocess.Popen`` that start a process as this user, with no supplementary groups."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def give(self, path: Path, *, recursive: bool = True) -> None:
        """Make ``path`` (and what is under it, with ``recursive``) this user's; symlinks are not followed."""
        os.chown(path, self.uid, self.gid, follow_symlinks=False)
        if recursive and path.is_dir() and not path.is_symlink():
            for root, dirs, files in os.walk(path):
                for name in dirs + files:
                    os.chown(os.path.join(root, name), self.uid, self.gid, follow_symlinks=False)


def resolve_desktop_user(name: str) -> DesktopUser | None:
    """The account the desktop's processes run as: ``name`` when this process is root, else None (no switch).

    Raises:
        DesktopError: ``name`` is not an account here, or is root.
    """
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise DesktopError(
            "user",
            f"desktop_user {name!r} is not an account on this machine; create it "
            f"(useradd --system --no-create-home {name}) or set desktop_user to an unprivileged account",
        ) from None
    if entry.pw_uid == 0:
        raise DesktopError("user", f"desktop_user {name!r} is root; set it to an unprivileged account")
    return DesktopUser(name, entry.pw_uid, entry.pw_gid)
