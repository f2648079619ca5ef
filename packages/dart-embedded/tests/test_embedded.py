"""The embedded servers start, serve, and leave nothing behind when stopped."""

from __future__ import annotations

import io
import os
import socket
from pathlib import Path

import pytest
from minio import Minio
from minio.error import S3Error

from dart.embedded.nats import EmbeddedNats
from dart.embedded.process import port_open
from dart.embedded.s3 import EmbeddedS3

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    """Whether a process with this PID exists (stop() reaps its children, so no zombies count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text``: catches grandchildren a PID check would miss."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def test_nats_starts_serves_and_stops_cleanly() -> None:
    server = EmbeddedNats(jetstream=True)
    with server:
        pid = server.pid
        assert pid is not None and _alive(pid)
        assert server.url == f"nats://127.0.0.1:{server.port}"
        with socket.create_connection((server.host, server.port), timeout=2) as sock:
            greeting = sock.recv(4096)
        # The NATS protocol opens with the server's INFO line.
        assert greeting.startswith(b"INFO {")
        store_dir = server.store_dir
    assert not _alive(pid)
    assert not port_open(server.host, server.port)
    assert not store_dir.exists()
    server.stop()  # idempotent


def test_s3_starts_serves_and_stops_cleanly() -> None:
    server = EmbeddedS3()
    with server:
        pids = server.pids
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        assert server.pid == pids[0]
        assert server.url == f"http://{server.endpoint}" and server.endpoint == f"127.0.0.1:{server.port}"
        client = Minio(server.endpoint, access_key=server.access_key, secret_key=server.secret_key, secure=False)
        client.make_bucket("embedded-test")
        client.put_object("embedded-test", "a/b.txt", io.BytesIO(b"hello"), 5)
        assert client.get_object("embedded-test", "a/b.txt").read() == b"hello"
        assert [b.name for b in client.list_buckets()] == ["embedded-test"]
        data_dir = server.data_dir
        ports = server.ports
        assert _processes_mentioning(str(data_dir))
    assert not any(_alive(p) for p in pids)
    assert _processes_mentioning(str(data_dir)) == []
    assert not any(port_open(server.host, p) for p in ports)
    assert not data_dir.exists()
    assert not any(Path(f"/tmp/seaweedfs-{s}-grpc-{p}.sock").exists() for s in ("master", "s3") for p in ports)
    server.stop()  # idempotent


def test_s3_credentials_are_random_and_enforced() -> None:
    a, b = EmbeddedS3(), EmbeddedS3()
    try:
        assert a.access_key != b.access_key and a.secret_key != b.secret_key
        assert len(a.access_key) == 20 and len(a.secret_key) == 40
        assert len(set(a.ports)) == len(a.ports)
    finally:
        a.stop()
        b.stop()


def test_s3_rejects_wrong_secret(s3_server: EmbeddedS3) -> None:
    client = Minio(s3_server.endpoint, access_key=s3_server.access_key, secret_key="not-the-secret", secure=False)
    with pytest.raises(S3Error) as info:
        client.list_buckets()
    assert info.value.code == "SignatureDoesNotMatch"


def test_postgres_starts_serves_and_stops_cleanly(postgres_server: object) -> None:
    import psycopg

    from dart.embedded.postgres import EmbeddedPostgres

    server = EmbeddedPostgres()
    with server:
        pid = server.pid
        assert pid is not None and _alive(pid)
        status = Path(f"/proc/{pid}/status").read_text()
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        assert uid != 0  # PostgreSQL refuses root; as root the server runs as the postgres account
        url = server.create_database("app")
        assert url == f"postgresql+psycopg://dart@127.0.0.1:{server.port}/app"
        with psycopg.connect(host=server.host, port=server.port, user="dart", dbname="app") as conn:
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (41)")
            assert conn.execute("SELECT x + 1 FROM t").fetchone() == (42,)
        with pytest.raises(ValueError, match="lowercase"):
            server.create_database("Bad-Name")
        directory = server.dir
    assert not _alive(pid)
    assert not port_open(server.host, server.port)
    assert not directory.exists()
    assert _processes_mentioning(str(directory)) == []
    server.stop()  # idempotent
