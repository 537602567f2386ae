"""TLS server credentials plus the token sent as call credentials (self-signed cert via openssl)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from chunking.hashing import content_id
from paramserver.client.rpc import ClientConfig, ParamServerClient, make_chunk
from paramserver.server.config import ServerConfig
from paramserver.server.service import start_server

ADMIN = "tls-admin-token"


@pytest.fixture
def certs(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: it is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_tls_with_token(tmp_path: Path, certs: tuple[Path, Path]) -> None:
    cert, key = certs
    cfg = ServerConfig(server_id="ps1", data_dir=tmp_path / "d", listen="127.0.0.1:0", tls_cert=cert, tls_key=key, admin_token=ADMIN,
                       fsync=False, workers=2)
    server = start_server(cfg)
    try:
        address = f"localhost:{server.port}"
        chunk = make_chunk("f" * 64, b"")
        with ParamServerClient(ClientConfig(address, token=ADMIN, tls_ca=cert)) as client:
            assert client.has_chunks([chunk.id]) == [False]
            data = b"secret weights"
            assert client.put_chunks([make_chunk(content_id(data), data)]).chunks_stored == 1
        with ParamServerClient(ClientConfig(address, token="wrong-token-1", tls_ca=cert)) as bad:
            with pytest.raises(grpc.RpcError) as info:
                bad.put_chunks([make_chunk(content_id(data), data)])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with ParamServerClient(ClientConfig(address, timeout_s=3)) as plaintext:
            with pytest.raises(grpc.RpcError) as info:
                plaintext.has_chunks([chunk.id])
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
