"""deploy.certs: a private CA and mutual-TLS certificates, checked with cryptography and a real gRPC server."""
from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import deploy.certs as certs_mod
from deploy.certs import CertError, CertPaths, ClusterCerts, issue, load_ca, make_ca, make_cluster_certs


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _fingerprint(path: Path) -> bytes:
    return _cert(path).fingerprint(hashes.SHA256())


def _ekus(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    folder = tmp_path_factory.mktemp("tls")
    return make_cluster_certs(folder, {"ps1": ["10.77.0.2"], "ps2": ["10.77.0.3", "ps2.internal"]}, clients=("client", "ops"))


def test_ca_is_a_self_signed_ca(cluster: ClusterCerts) -> None:
    ca = _cert(cluster.ca.cert)
    ca.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    assert ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "pdparams local CA"
    assert cluster.ca == CertPaths(cluster.ca.cert.parent / "ca.pem", cluster.ca.cert.parent / "ca.key")


def test_ca_verifies_every_issued_cert(cluster: ClusterCerts, tmp_path: Path) -> None:
    ca = _cert(cluster.ca.cert)
    for paths in [*cluster.servers.values(), *cluster.clients.values()]:
        cert = _cert(paths.cert)
        cert.verify_directly_issued_by(ca)  # raises InvalidSignature otherwise
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
        assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    other = make_ca(tmp_path)  # same name, different key: the signature check must fail
    with pytest.raises(InvalidSignature):
        _cert(cluster.servers["ps1"].cert).verify_directly_issued_by(_cert(other.cert))


def test_server_sans_and_ekus(cluster: ClusterCerts) -> None:
    assert set(cluster.servers) == {"ps1", "ps2"} and set(cluster.clients) == {"client", "ops"}
    ps2 = _cert(cluster.servers["ps2"].cert)
    assert ps2.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "ps2"
    san = ps2.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address("10.77.0.3"), ipaddress.ip_address("127.0.0.1")}
    assert set(san.get_values_for_type(x509.DNSName)) == {"ps2.internal", "localhost"}
    assert _ekus(ps2) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    ps1 = _cert(cluster.servers["ps1"].cert)
    san = ps1.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.77.0.2") in san.get_values_for_type(x509.IPAddress)


def test_client_cert_is_client_only(cluster: ClusterCerts) -> None:
    client = _cert(cluster.clients["client"].cert)
    assert _ekus(client) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "client"
    assert cluster.clients["ops"].cert.name == "ops.pem" and cluster.clients["ops"].key.name == "ops.key"


def test_issue_usages_and_ipv6(tmp_path: Path) -> None:
    ca = make_ca(tmp_path, name="test CA", days=2)
    paths = issue(tmp_path, ca, "edge", hosts=["::1", "Edge.Example"], server=True, client=False, days=30)
    cert = _cert(paths.cert)
    assert _ekus(cert) == {ExtendedKeyUsageOID.SERVER_AUTH}
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("::1")]
    assert san.get_values_for_type(x509.DNSName) == ["edge.example"]
    assert cert.not_valid_after_utc <= _cert(ca.cert).not_valid_after_utc  # never outlives the CA
    with pytest.raises(ValueError):
        issue(tmp_path, ca, "none", hosts=[], server=False, client=False)
    with pytest.raises(ValueError):
        issue(tmp_path, ca, "../escape", hosts=[], server=False, client=True)
    with pytest.raises(ValueError):
        issue(tmp_path, ca, "bad", hosts=["not a host"], server=True, client=False)


def test_key_files_are_0600(cluster: ClusterCerts) -> None:
    keys = [cluster.ca.key, *(p.key for p in cluster.servers.values()), *(p.key for p in cluster.clients.values())]
    for key in keys:
        assert _mode(key) == 0o600, key
    assert _mode(cluster.ca.cert) == 0o644
    assert not [p for p in cluster.ca.cert.parent.iterdir() if p.name.endswith(".tmp")]


def test_keys_never_world_readable_even_before_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}
    real_replace = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen[Path(dst).name] = _mode(Path(src))
        real_replace(src, dst)

    monkeypatch.setattr(certs_mod.os, "replace", spy)
    old = os.umask(0)  # the most permissive umask must not matter
    try:
        make_cluster_certs(tmp_path, {"ps1": []}, clients=())
    finally:
        os.umask(old)
    assert seen["ca.key"] == 0o600 and seen["ps1.key"] == 0o600
    assert _mode(tmp_path / "ca.key") == 0o600 and _mode(tmp_path / "ps1.key") == 0o600


def test_idempotent_reuses_ca_and_issues_missing(tmp_path: Path) -> None:
    first = make_cluster_certs(tmp_path, {"ps1": ["10.77.0.2"], "ps2": ["10.77.0.3"]})
    ca_fp = _fingerprint(first.ca.cert)
    ps1_fp = _fingerprint(first.servers["ps1"].cert)
    first.servers["ps2"].cert.unlink()
    first.servers["ps2"].key.unlink()
    second = make_cluster_certs(tmp_path, {"ps1": ["10.77.0.2"], "ps2": ["10.77.0.3"], "ps3": ["10.77.0.4"]})
    assert _fingerprint(second.ca.cert) == ca_fp
    assert _fingerprint(second.servers["ps1"].cert) == ps1_fp  # kept as is
    ca = _cert(second.ca.cert)
    for sid in ("ps2", "ps3"):
        assert second.servers[sid].cert.exists() and _mode(second.servers[sid].key) == 0o600
        _cert(second.servers[sid].cert).verify_directly_issued_by(ca)
    third = make_cluster_certs(tmp_path, {"ps1": ["10.77.0.9"]})  # a new host: reissued by the same CA
    assert _fingerprint(third.ca.cert) == ca_fp
    assert _fingerprint(third.servers["ps1"].cert) != ps1_fp
    assert load_ca(tmp_path) == first.ca


def test_damaged_ca_pem_names_the_file(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    ca.cert.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    with pytest.raises(CertError) as info:
        make_cluster_certs(tmp_path, {"ps1": []})
    message = str(info.value)
    assert str(ca.cert) in message and "\n" not in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(CertError, match="ca.pem"):
        issue(tmp_path, ca, "x", hosts=[], server=False, client=True)


def test_damaged_or_missing_ca_key_names_the_file(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    ca.key.write_bytes(b"garbage")
    with pytest.raises(CertError) as info:
        load_ca(tmp_path)
    assert str(ca.key) in str(info.value) and "\n" not in str(info.value)
    ca.key.unlink()
    with pytest.raises(CertError, match="ca.key"):
        make_cluster_certs(tmp_path, {"ps1": []})


# ---------------------------------------------------------------- real gRPC mutual TLS


@pytest.fixture
def mtls_server(cluster: ClusterCerts) -> Iterator[int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    ps1 = cluster.servers["ps1"]
    creds = grpc.ssl_server_credentials(
        [(ps1.key.read_bytes(), ps1.cert.read_bytes())],
        root_certificates=cluster.ca.cert.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    assert port
    server.start()
    try:
        yield port
    finally:
        server.stop(0)


def _check(port: int, creds: grpc.ChannelCredentials) -> health_pb2.HealthCheckResponse:
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_grpc_accepts_client_cert(cluster: ClusterCerts, mtls_server: int) -> None:
    ca = cluster.ca.cert.read_bytes()
    for paths in (cluster.clients["client"], cluster.servers["ps2"]):  # a client, and a peer server
        creds = grpc.ssl_channel_credentials(ca, paths.key.read_bytes(), paths.cert.read_bytes())
        assert _check(mtls_server, creds).status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_refuses_client_without_cert(cluster: ClusterCerts, mtls_server: int) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=cluster.ca.cert.read_bytes())
    with pytest.raises(grpc.RpcError) as info:
        _check(mtls_server, creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_refuses_cert_from_another_ca(cluster: ClusterCerts, mtls_server: int, tmp_path: Path) -> None:
    rogue_ca = make_ca(tmp_path, name="rogue CA")
    rogue = issue(tmp_path, rogue_ca, "client", hosts=[], server=False, client=True)
    creds = grpc.ssl_channel_credentials(cluster.ca.cert.read_bytes(), rogue.key.read_bytes(), rogue.cert.read_bytes())
    with pytest.raises(grpc.RpcError) as info:
        _check(mtls_server, creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
