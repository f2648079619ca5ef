"""Least privilege in the store, against the real embedded S3 server (SeaweedFS) as ``dart run`` starts it:
each role's key pair works inside its prefixes and is refused (``AccessDenied``) outside them, the pairs lie
in 0600 files, and every port of the server listens on loopback only."""

from __future__ import annotations

import io
import json
import os
import stat
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dart.cli.stack.embedded_store import embedded_s3_server, embedded_s3_store
from dart.cli.stack.store_credentials import StoreKeyFiles, as_store_role
from dart.embedded.s3 import EmbeddedS3
from dart.protocol.errors import ArtifactNotFoundError, StoreAuthError
from dart.runtime.store import ArtifactStore, open_store
from dart.runtime.store.grants import STORE_ROLES, StoreRole

pytestmark = pytest.mark.integration

PREFIXES = ("screenshots", "trajectories", "weights")
ALLOWED: dict[StoreRole, dict[str, set[str]]] = {
    # role: access -> the prefixes where it is allowed (everywhere else it must be refused)
    "env": {"read": {"screenshots"}, "write": {"screenshots"}, "delete": set()},
    "rollout": {"read": {"screenshots", "weights"}, "write": {"screenshots"}, "delete": set()},
    "train": {"read": set(PREFIXES), "write": {"weights"}, "delete": {"weights"}},
    "data": {"read": set(PREFIXES), "write": {"trajectories"}, "delete": {"screenshots", "trajectories"}},
    "view": {"read": set(PREFIXES), "write": set(), "delete": set()},
    "run": {"read": set(PREFIXES), "write": {"screenshots"}, "delete": set()},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedS3, dict[StoreRole, StoreKeyFiles]]]:
    run_dir = tmp_path_factory.mktemp("run")
    server, keys = embedded_s3_server(run_dir)
    with server:
        yield server, keys


def _store(server: EmbeddedS3, files: StoreKeyFiles) -> ArtifactStore:
    return open_store(as_store_role(embedded_s3_store(server), files))


@pytest.fixture(scope="module")
def admin(
    served: tuple[EmbeddedS3, dict[StoreRole, StoreKeyFiles]], tmp_path_factory: pytest.TempPathFactory
) -> ArtifactStore:
    server, _ = served
    folder = tmp_path_factory.mktemp("admin")
    (folder / "access").write_text(server.access_key)
    (folder / "secret").write_text(server.secret_key)
    return _store(server, StoreKeyFiles(folder / "access", folder / "secret"))


def _refused(call: Callable[..., object], *args: object) -> bool:
    """Whether the store refused ``call(*args)`` for want of permission."""
    try:
        call(*args)
    except StoreAuthError as exc:
        assert exc.code == "AccessDenied", exc
        return True
    return False


@pytest.mark.parametrize("role", STORE_ROLES)
def test_each_role_is_allowed_inside_its_prefixes_and_refused_outside(
    role: StoreRole, served: tuple[EmbeddedS3, dict[StoreRole, StoreKeyFiles]], admin: ArtifactStore
) -> None:
    server, keys = served
    store = _store(server, keys[role])
    for prefix in PREFIXES:
        existing = admin.put(f"{prefix}/{role}-seen.png", b"seen").key
        victim = admin.put(f"{prefix}/{role}-victim.png", b"victim").key
        allowed = {access for access, where in ALLOWED[role].items() if prefix in where}

        read_refused = _refused(store.get, existing)
        assert read_refused == ("read" not in allowed), f"{role} reading {prefix}/"

        write_refused = _refused(store.put, f"{prefix}/{role}-wrote.png", b"new")
        assert write_refused == ("write" not in allowed), f"{role} writing {prefix}/"
        assert admin.exists(f"{prefix}/{role}-wrote.png") == (not write_refused)

        delete_refused = _refused(store.delete, victim)
        assert delete_refused == ("delete" not in allowed), f"{role} deleting {prefix}/"
        assert admin.exists(victim) == delete_refused
    # Nothing outside the run's prefixes, for anyone.
    assert _refused(store.put, "elsewhere/x.png", b"x")
    store.close()


def test_the_trainer_streams_weights_through_staging_and_prunes_them(
    served: tuple[EmbeddedS3, dict[StoreRole, StoreKeyFiles]], admin: ArtifactStore
) -> None:
    """A shard of unknown digest is uploaded in parts to the staging prefix, copied, and the staging removed."""
    server, keys = served
    train = _store(server, keys["train"])
    body = os.urandom(6 * 1024 * 1024)
    info = train.put_stream("weights/v9/model.safetensors", io.BytesIO(body), part_size=5 * 1024 * 1024)
    assert info.size == len(body) and admin.get("weights/v9/model.safetensors") == body
    assert not [i.key for i in admin.list("") if ".dart-staging" in i.key]
    train.delete("weights/v9/model.safetensors")
    with pytest.raises(ArtifactNotFoundError):
        admin.stat("weights/v9/model.safetensors")
    assert _refused(lambda: _store(server, keys["rollout"]).put_stream("weights/v9/x", io.BytesIO(body)))
    train.close()


def test_key_pairs_are_owner_only_files_and_never_in_the_servers_command_line(
    served: tuple[EmbeddedS3, dict[StoreRole, StoreKeyFiles]],
) -> None:
    server, keys = served
    folder = next(iter(keys.values())).access.parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    secrets = [server.secret_key]
    for files in keys.values():
        for path in (files.access, files.secret):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            secrets.append(path.read_text().strip())
    for pid in server.pids:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        assert not [s for s in secrets if s in argv or s in environ]
    assert len(set(secrets)) == len(secrets)  # one pair per role, none shared


def _listening(pids: list[int]) -> list[str]:
    """``address:port`` of every TCP socket the processes listen on (from /proc, no tools needed)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                found.append(f"{_address(address)}:{int(port, 16)}")
    return found


def _address(hex_address: str) -> str:
    if len(hex_address) == 8:
        return ".".join(str(b) for b in reversed(bytes.fromhex(hex_address)))
    return "ipv6:" + hex_address


def test_every_port_of_the_server_listens_on_loopback_only(
    served: tuple[EmbeddedS3, dict[StoreRole, StoreKeyFiles]],
) -> None:
    """The master, volume and filer take no credentials: only this host may reach them."""
    server, _ = served
    listening = _listening(server.pids)
    ports = {int(a.rsplit(":", 1)[1]) for a in listening}
    assert len(ports & set(server.ports)) >= 6, listening  # S3, master, volume, filer and their gRPC
    assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening


def test_the_filer_refuses_whoever_bypasses_the_s3_gateway(
    served: tuple[EmbeddedS3, dict[StoreRole, StoreKeyFiles]], admin: ArtifactStore
) -> None:
    """A process of this host (a local desktop's agent) that finds the filer's port can neither read, list nor
    write the run's objects through it: the filer wants a JWT only the server's own components sign."""
    server, _ = served
    admin.put("weights/v1/manifest.json", b"{}")
    filer = f"http://127.0.0.1:{server.filer_port}/buckets/dart/artifacts"
    for method, path, body in (
        ("GET", "/weights/v1/manifest.json", None),
        ("GET", "/weights/", None),
        ("PUT", "/weights/v1/model.safetensors", b"forged"),
        ("DELETE", "/weights/v1/manifest.json", None),
    ):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(filer + path, data=body, method=method), timeout=5)
        refused.value.close()
        assert refused.value.code == 401, (method, path)
    assert admin.get("weights/v1/manifest.json") == b"{}" and not admin.exists("weights/v1/model.safetensors")
    # The master assigns a blob id to anyone on loopback, but the volume server takes no blob without the JWT.
    with urllib.request.urlopen(f"http://127.0.0.1:{server.master_port}/dir/assign", timeout=5) as answer:
        assigned = json.load(answer)
    blob = f"http://{assigned['url']}/{assigned['fid']}"
    for method, body in (("PUT", b"forged"), ("GET", None)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(blob, data=body, method=method), timeout=5)
        refused.value.close()
        assert refused.value.code == 401, method
