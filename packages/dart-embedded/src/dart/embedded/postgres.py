"""An embedded PostgreSQL server (Debian's ``postgresql`` package) for development and tests.

Example:
    >>> with EmbeddedPostgres() as pg:                    # doctest: +SKIP
    ...     url = pg.create_database("runs")              # postgresql+psycopg://dart@127.0.0.1:41234/runs

``start`` runs ``initdb`` into a temporary directory (superuser ``dart``, ``trust`` authentication:
it listens only on loopback and on a Unix socket inside that directory), then ``postgres`` on a
free loopback port, and returns once ``pg_isready`` reports it accepting connections. PostgreSQL
refuses to run as root, so when we are root both run as the ``postgres`` account the Debian
package creates (``user=``), and the directory is handed to that account.

The cluster is disposable by design, like the other embedded servers: ``fsync`` and
``synchronous_commit`` are off (a crash of the machine may lose the last transactions; a crash of
the server does not), and ``stop`` removes the directory. Stop sends SIGINT, PostgreSQL's *fast*
shutdown (SIGTERM, *smart* shutdown, would wait for every client to disconnect).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from dart.embedded.process import EmbeddedServerError, ManagedProcess, as_user_kwargs
from dart.runtime.ports import free_port

SUPERUSER = "dart"
"""Role created by ``initdb``; owns every database created here."""
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def find_postgres_bin() -> Path:
    """Directory holding ``initdb``, ``postgres``, ``pg_isready`` and ``createdb``.

    Looks at ``$DART_POSTGRES_BIN`` first, then the newest ``/usr/lib/postgresql/<major>/bin``
    (Debian keeps the server binaries there, off ``PATH``), then ``PATH``.

    Raises:
        EmbeddedServerError: Not found; the message names the package to install.
    """
    override = os.environ.get("DART_POSTGRES_BIN")
    if override:
        if not (Path(override) / "initdb").is_file():
            raise EmbeddedServerError(f"DART_POSTGRES_BIN={override} holds no initdb")
        return Path(override)
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name), reverse=True
    )
    if debian:
        return debian[0].parent
    found = shutil.which("initdb")
    if found and (Path(found).parent / "postgres").is_file():
        return Path(found).parent
    raise EmbeddedServerError(
        "PostgreSQL server binaries (initdb, postgres) not found: install the Debian package 'postgresql' "
        "or set DART_POSTGRES_BIN to the directory holding them"
    )


def postgres_available() -> bool:
    """Whether :func:`find_postgres_bin` finds the server binaries."""
    try:
        find_postgres_bin()
    except EmbeddedServerError:
        return False
    return True


class EmbeddedPostgres:
    """A PostgreSQL server on loopback with its cluster in a temporary directory.

    Lifecycle: ``created -> running`` (:meth:`start`) ``-> stopped`` (:meth:`stop`, idempotent;
    an ``atexit`` hook stops a server a crashed test run left behind).

    Args:
        host: Loopback address to listen on.
        port: TCP port; a free one when None.
        user: Account the server runs as when we are root (PostgreSQL refuses root).
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, user: str = "postgres") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.user = user
        self.dir = Path(tempfile.mkdtemp(prefix="dart-pg-"))
        self._bin: Path | None = None
        self._proc: ManagedProcess | None = None

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory."""
        return self.dir / "data"

    @property
    def socket_dir(self) -> Path:
        """Directory of the server's Unix socket (``.s.PGSQL.<port>``)."""
        return self.dir

    @property
    def pid(self) -> int | None:
        """PID of the postmaster while running."""
        return self._proc.pid if self._proc else None

    def url(self, database: str = "postgres", driver: str = "psycopg") -> str:
        """SQLAlchemy URL of ``database``, e.g. ``postgresql+psycopg://dart@127.0.0.1:5432/postgres``."""
        return f"postgresql+{driver}://{SUPERUSER}@{self.host}:{self.port}/{database}"

    def start(self, timeout_s: float = 60.0) -> EmbeddedPostgres:
        """Create the cluster, start the server and wait until it accepts connections.

        Raises:
            EmbeddedServerError: The binaries are missing, ``initdb`` failed, or the server exited
                or was not ready within ``timeout_s``.
        """
        if self._proc is not None:
            raise EmbeddedServerError("EmbeddedPostgres is already running; stop() it first")
        self._bin = find_postgres_bin()
        as_user = as_user_kwargs(self.user)
        if as_user:
            os.chown(self.dir, as_user["user"], as_user["group"])
        initdb = [
            str(self._bin / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-locale",  # the C locale: no dependency on the machine's generated locales
            "--no-sync",
        ]
        try:
            done = subprocess.run(
                initdb, cwd=self.dir, capture_output=True, text=True, timeout=timeout_s, check=False, **as_user
            )
        except subprocess.TimeoutExpired:
            raise EmbeddedServerError(f"initdb did not finish within {timeout_s}s") from None
        if done.returncode != 0:
            raise EmbeddedServerError(f"initdb failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        argv = [
            str(self._bin / "postgres"),
            "-D",
            str(self.data_dir),
            "-p",
            str(self.port),
            "-c",
            f"listen_addresses={self.host}",
            "-c",
            f"unix_socket_directories={self.socket_dir}",
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
        ]
        self._proc = ManagedProcess(
            "postgres", argv, self.dir / "postgres.log", cwd=self.dir, user=self.user, stop_signal=signal.SIGINT
        )
        try:
            self._proc.start(self._ready, timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        assert self._bin is not None
        argv = [str(self._bin / "pg_isready"), "-q", "-h", self.host, "-p", str(self.port), "-U", SUPERUSER]
        try:
            return subprocess.run(argv, timeout=5, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def create_database(self, name: str) -> str:
        """Create database ``name`` (lowercase letters, digits, ``_``); returns its SQLAlchemy URL.

        Raises:
            ValueError: ``name`` is not a plain lowercase identifier.
            EmbeddedServerError: The server is not running or refused.
        """
        if not _NAME.match(name):
            raise ValueError(f"database name {name!r}: use lowercase letters, digits and '_' (at most 63)")
        if self._proc is None or self._bin is None:
            raise EmbeddedServerError("EmbeddedPostgres is not running; start() it first")
        argv = [str(self._bin / "createdb"), "-h", str(self.socket_dir), "-p", str(self.port), "-U", SUPERUSER, name]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise EmbeddedServerError(f"createdb {name} failed: {done.stderr.strip()}")
        return self.url(name)

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove the cluster. Idempotent."""
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
