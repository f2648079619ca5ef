"""The desktop's ``python`` and ``python3``: the service's Python with its packages, runnable by the desktop user.

OSWorld tasks and agents run ``python -c "import pyautogui; ..."`` on the VM, and DART's own apps (the
probe) are Python modules; on a local desktop that Python is the env service's, found first on the
desktop's ``PATH`` through a ``bin`` directory of the desktop's own (:func:`install_python`):

- where the desktop user can run the service's interpreter (always, when the service is not root; in
  DART's images), ``python`` and ``python3`` there are scripts that exec it;
- where it cannot (a root service whose virtualenv's base interpreter lies in root's home), they are a
  virtualenv over the system's ``python3`` whose path holds the service's site-packages, when both are
  the same ``major.minor`` (the packages' compiled parts need it); else the system's Python alone.
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

from dart.env.desktop.sandbox import DesktopUser, desktop_environment

_PROBE_TIMEOUT_S = 10.0
"""Limit of the one-off check that the desktop user can run an interpreter, seconds."""
NAMES = ("python", "python3")
"""The commands the desktop's ``bin`` directory provides."""


def install_python(root: Path, user: DesktopUser | None) -> Path:
    """Write the desktop's ``python`` and ``python3`` under ``root`` (created); returns their ``bin`` directory.

    The files stay this process's (read-only for the desktop user). ``root`` must not exist yet.
    """
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, mode=0o755)
    root.chmod(0o755)
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if user is None or _runs_as(user, sys.executable) or system is None:
        for name in NAMES:
            script = bin_dir / name
            script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n', encoding="utf-8")
            script.chmod(0o755)
        return bin_dir
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    (root / "pyvenv.cfg").write_text(
        f"home = {Path(system).parent}\ninclude-system-site-packages = false\n", encoding="utf-8"
    )
    for name in NAMES:
        (bin_dir / name).symlink_to(system)
    if _runs_as(user, system, f"import sys; sys.exit(sys.version_info[:2] != ({version.replace('.', ', ')}))"):
        packages = root / "lib" / f"python{version}" / "site-packages"
        packages.mkdir(parents=True)
        # An `import` line of a .pth file runs: addsitedir also reads the .pth files there (editable installs).
        lines = [f"import site; site.addsitedir({path!r})\n" for path in site.getsitepackages()]
        (packages / "dart-service.pth").write_text("".join(lines), encoding="utf-8")
        for folder in (root / "lib", packages.parent, packages):
            folder.chmod(0o755)
    return bin_dir


def _runs_as(user: DesktopUser, python: str, code: str = "") -> bool:
    try:
        done = subprocess.run(
            [python, "-c", code],
            env=desktop_environment(Path("/"), user),
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
            **user.popen_kwargs(),
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0
