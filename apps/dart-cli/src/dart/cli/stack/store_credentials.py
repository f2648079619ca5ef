"""Per-run store credentials of ``dart run``: one key pair per store role, in files only their owner reads.

Lifecycle: created under ``<run_dir>/secrets/`` (0700; files ``s3-<role>.access`` / ``s3-<role>.secret``,
0600) before the embedded S3 server starts; the server admits each pair with its role's policy
(:mod:`dart.runtime.store.grants`), each ``dart serve`` child gets the paths of its own pair
(``DART_STORE__ACCESS_KEY_FILE`` / ``DART_STORE__SECRET_KEY_FILE`` in its environment), the supervisor
and ``dart view`` read theirs. No key is in ``config.yaml``, a command line or an environment variable.
They stay with the run directory, so ``dart view`` restarts the server on the run's data with the same
pairs.
"""

from __future__ import annotations

import os
import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dart.embedded.s3 import S3Identity
from dart.runtime.store import StoreConfig
from dart.runtime.store.grants import StorePrefixes, StoreRole, s3_policy
from dart.runtime.store.uri import parse_store_uri

_KEY_ALPHABET = string.ascii_uppercase + string.digits


@dataclass(frozen=True)
class StoreKeyFiles:
    """Where one role's key pair lies."""

    access: Path
    secret: Path


def write_store_keys(run_dir: Path, roles: Iterable[StoreRole]) -> dict[StoreRole, StoreKeyFiles]:
    """A key pair per role in ``<run_dir>/secrets/`` (mode 0600), keeping pairs already there."""
    folder = run_dir / "secrets"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    files: dict[StoreRole, StoreKeyFiles] = {}
    for role in roles:
        pair = StoreKeyFiles(folder / f"s3-{role}.access", folder / f"s3-{role}.secret")
        files[role] = pair
        if pair.access.is_file() and pair.secret.is_file():
            continue
        _write_secret(pair.access, "".join(secrets.choice(_KEY_ALPHABET) for _ in range(20)))
        _write_secret(pair.secret, secrets.token_urlsafe(30))
    return files


def _write_secret(path: Path, value: str) -> None:
    path.unlink(missing_ok=True)  # half a pair from an interrupted start
    # O_EXCL with 0600 from the first byte: no window in which another user could read it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(value + "\n")


def store_identities(keys: dict[StoreRole, StoreKeyFiles], store_uri: str, prefixes: StorePrefixes) -> list[S3Identity]:
    """The server-side identities of ``keys``: each pair bounded by its role's policy in ``store_uri``."""
    location = parse_store_uri(store_uri)
    return [
        S3Identity(
            name=role,
            access_key=files.access.read_text().strip(),
            secret_key=files.secret.read_text().strip(),
            policy=s3_policy(role, location.root, location.prefix, prefixes),
        )
        for role, files in keys.items()
    ]


def store_environment(files: StoreKeyFiles) -> dict[str, str]:
    """Environment overrides that make a ``dart serve`` process open the store with ``files``' pair."""
    return {"DART_STORE__ACCESS_KEY_FILE": str(files.access), "DART_STORE__SECRET_KEY_FILE": str(files.secret)}


def as_store_role(store: StoreConfig, files: StoreKeyFiles) -> StoreConfig:
    """``store`` opened with the key pair in ``files``."""
    return store.model_copy(update={"access_key_file": files.access, "secret_key_file": files.secret})
