"""Path mapping between an OSWorld VM's home directory and the desktop that actually runs a task.

OSWorld tasks name absolute paths under the VM user's home (``/home`` + ``/user/Desktop/x.txt``).
DART's local desktop gives each session its own temporary HOME, so under the local provider every
string in step and getter parameters has that home prefix rewritten to the real one. A leading
``~`` (``~/notes.txt``, DART's shipped tasks use it) is expanded to the same home, for real VMs too
(OSWorld's server does not expand ``~`` itself).

``sudo``: OSWorld runs as an unprivileged user who types the VM password (``echo password | sudo
-S ...``). The local desktop runs as the host user. When that user is root, ``sudo`` prefixes are
dropped (the command runs with the rights it asked for); otherwise a step that needs ``sudo`` is
unsupported (:class:`~dart.env.osworld.errors.UnsupportedStepError`), because DART never
asks for or stores a host password.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OSWORLD_HOME = "/home" + "/user"
"""The VM user's home directory in OSWorld's images (written in two parts so no literal home path
appears in the source tree)."""

_SUDO = re.compile(r"(?:echo\s+(?:'[^']*'|\"[^\"]*\"|\S+)\s*\|\s*)?\bsudo\b(?:\s+-[A-Za-z]+)*\s+")


@dataclass(frozen=True)
class PathMap:
    """Rewrites the VM home in task parameters.

    Attributes:
        source: The home directory the task files name (``OSWORLD_HOME``), or None for no rewriting.
        target: The home directory on the desktop that runs the task.
    """

    source: str | None
    target: str

    @classmethod
    def identity(cls) -> PathMap:
        """No rewriting; ``~`` expands to OSWorld's VM home (for real OSWorld VMs)."""
        return cls(source=None, target=OSWORLD_HOME)

    def map_str(self, text: str) -> str:
        """``text`` with the VM home prefix rewritten and a leading ``~`` expanded."""
        if text == "~" or text.startswith("~/"):
            text = self.target + text[1:]
        if self.source and self.source != self.target:
            text = re.sub(re.escape(self.source) + r"(?![\w.-])", lambda _: self.target, text)
        return text

    def map(self, value: Any) -> Any:
        """``value`` with :meth:`map_str` applied to every string inside (dicts, lists)."""
        if isinstance(value, str):
            return self.map_str(value)
        if isinstance(value, list):
            return [self.map(v) for v in value]
        if isinstance(value, dict):
            return {k: self.map(v) for k, v in value.items()}
        return value


def strip_sudo(command: str | list[str]) -> str | list[str]:
    """``command`` without its ``sudo`` (and ``echo PASSWORD | sudo -S``) prefixes."""
    if isinstance(command, list):
        out = list(command)
        while out and out[0] == "sudo":
            out.pop(0)
            while out and out[0].startswith("-"):
                out.pop(0)
        return out
    return _SUDO.sub("", command)


def uses_sudo(command: str | list[str]) -> bool:
    """Whether a command calls ``sudo``."""
    if isinstance(command, list):
        return "sudo" in command
    return _SUDO.search(command) is not None


def inside(root: Path, name: str | Path) -> Path:
    """``root / name`` when it stays inside ``root``: a task names files in its cache directory by what the
    request that carried the task says, so a name that climbs out (``..``, an absolute path, a symlink
    pointing away) must not reach a host file.

    Raises:
        ValueError: ``name`` leads outside ``root`` (or is empty).
    """
    if not str(name).strip():
        raise ValueError("an empty file name")
    base = root.resolve()
    path = (base / name).resolve()
    if path == base or not path.is_relative_to(base):
        raise ValueError(f"{str(name)!r} leads outside the task's cache directory")
    return path
