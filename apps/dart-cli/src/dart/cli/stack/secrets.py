"""Per-run NATS credentials of ``dart run``: one random password per role, in files only its owner reads.

Lifecycle: created by ``dart run`` before the embedded nats-server starts, under
``<run_dir>/secrets/`` (mode 0700, files 0600); the server gets their bcrypt hashes, each service
process the path of its own file (``DART_BUS__USER`` / ``DART_BUS__PASSWORD_FILE`` in its
environment), so no password is in ``config.yaml``, a command line, an environment variable or a log.
They stay with the run directory (they are useless once its server is gone).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from dart.protocol.topology import Role
from dart.runtime.bus import BusConfig

PASSWORD_BYTES = 32
"""Entropy of each generated password (256 bits, URL-safe base64 encoded)."""


def write_bus_credentials(
    run_dir: Path, roles: Iterable[Role], *, directory: str = "secrets", keep_existing: bool = False
) -> dict[Role, Path]:
    """Generate a password per role into ``<run_dir>/<directory>/nats-<role>.password`` (mode 0600).

    Args:
        run_dir: The run directory (or any directory).
        roles: Roles to create passwords for.
        directory: Subdirectory to use (``""`` for ``run_dir`` itself); created with mode 0700.
        keep_existing: Keep passwords already there (a restarted ``dart nats``) instead of failing.

    Raises:
        FileExistsError: A password file already exists and ``keep_existing`` is False.
    """
    folder = run_dir / directory if directory else run_dir
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    files: dict[Role, Path] = {}
    for role in roles:
        path = folder / f"nats-{role}.password"
        files[role] = path
        if keep_existing and path.is_file():
            continue
        # O_EXCL with 0600 from the first byte: no window in which another user could read it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(secrets.token_urlsafe(PASSWORD_BYTES) + "\n")
    return files


def service_environment(role: Role, password_file: Path) -> dict[str, str]:
    """Environment overrides that make a ``dart serve`` process connect as ``role``."""
    return {"DART_BUS__USER": role, "DART_BUS__PASSWORD_FILE": str(password_file)}


def as_role(bus: BusConfig, role: Role, password_file: Path) -> BusConfig:
    """``bus`` connecting as ``role`` with the password in ``password_file``."""
    return bus.model_copy(update={"user": role, "password_file": password_file, "password_env": None})
