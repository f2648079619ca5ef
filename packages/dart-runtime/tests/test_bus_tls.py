"""TLS between the bus and a real nats-server, with a CA and certificates made here for 127.0.0.1."""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dart.embedded.nats import EmbeddedNats, NatsTls, NatsUser
from dart.protocol.errors import BusAuthError, BusConnectionError, ConfigError
from dart.protocol.messages import LeaseReply, LeaseRequest
from dart.protocol.permissions import service_permissions
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.testing import all_messages

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        builder = builder.add_extension(san, critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A self-signed CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue("dart test CA", ca_key, None, ca_key, ca=True)
    paths = Pki(d / "ca.pem", d / "server.pem", d / "server-key.pem", d / "client.pem", d / "client-key.pem")
    paths.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    for cert_path, key_path, is_server in (
        (paths.server_cert, paths.server_key, True),
        (paths.client_cert, paths.client_key, False),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue("127.0.0.1" if is_server else "dart-client", key, ca_cert.subject, ca_key, server=is_server)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)
    return paths


@pytest.fixture(scope="module")
def tls_nats(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, Path]]:
    """TLS on the client port plus per-role users (auth and TLS together, as a deployment would run)."""
    password = tmp_path_factory.mktemp("pw") / "env.password"
    password.write_text(secrets.token_urlsafe(24))
    users = [
        NatsUser(role, password, service_permissions(role, "dart.v1", "tlsrun"))  # type: ignore[arg-type]
        for role in ("env", "rollout")
    ]
    with EmbeddedNats(users=users, tls=NatsTls(pki.server_cert, pki.server_key)) as server:
        yield server, password


def _config(server: EmbeddedNats, password: Path, role: str, **extra: object) -> BusConfig:
    return BusConfig(url=server.url, run="tlsrun", user=role, password_file=password, **extra)  # type: ignore[arg-type]


async def test_bus_connects_over_tls_with_the_ca_from_config(tls_nats: tuple[EmbeddedNats, Path], pki: Pki) -> None:
    server, password = tls_nats
    assert server.url.startswith("tls://127.0.0.1:")
    reply = next(m for m in all_messages() if m.kind == "env.lease.reply")  # type: ignore[attr-defined]

    async def on_lease(_: LeaseRequest) -> LeaseReply:
        return reply  # type: ignore[no-any-return]

    async with (
        await Bus.connect(_config(server, password, "env", tls_ca_file=pki.ca)) as env,
        await Bus.connect(_config(server, password, "rollout", tls_ca_file=pki.ca)) as rollout,
    ):
        await env.serve(env.subjects.env_lease("p"), LeaseRequest, on_lease)
        request = next(m for m in all_messages() if m.kind == "env.lease")  # type: ignore[attr-defined]
        assert await rollout.request(rollout.subjects.env_lease("p"), request, LeaseReply) == reply


async def test_tls_refuses_an_unknown_ca_and_still_checks_credentials(
    tls_nats: tuple[EmbeddedNats, Path], pki: Pki
) -> None:
    server, password = tls_nats
    # Without the CA the client cannot verify the server (the system CAs did not sign it).
    with pytest.raises(BusConnectionError, match="(?i)certificate"):
        await Bus.connect(_config(server, password, "env", connect_timeout_s=3.0))
    with pytest.raises(BusAuthError):
        await Bus.connect(BusConfig(url=server.url, tls_ca_file=pki.ca, connect_timeout_s=10.0))


async def test_mutual_tls_needs_a_client_certificate(pki: Pki) -> None:
    tls = NatsTls(pki.server_cert, pki.server_key, ca_file=pki.ca, verify=True)
    with EmbeddedNats(tls=tls) as server:
        async with await Bus.connect(
            BusConfig(url=server.url, tls_ca_file=pki.ca, tls_cert_file=pki.client_cert, tls_key_file=pki.client_key)
        ) as bus:
            await bus.flush()
        with pytest.raises(BusConnectionError):
            await Bus.connect(BusConfig(url=server.url, tls_ca_file=pki.ca, connect_timeout_s=3.0))


def test_unreadable_tls_files_are_config_errors(tmp_path: Path) -> None:
    from dart.runtime.bus.auth import tls_context

    with pytest.raises(ConfigError, match="tls_ca_file"):
        tls_context(BusConfig(url="tls://127.0.0.1:4222", tls_ca_file=tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="tls_key_file"):
        BusConfig(tls_cert_file=tmp_path / "c.pem")
