"""The shared exit-code table and the TLS diagnosis behind "cluster unavailable"."""
from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from chunking.errors import ChunkCorrupt, InvalidInput, ManifestError
from deploy.certs import ClusterCerts, issue, make_ca, make_cluster_certs
from paramserver.client import exit_codes
from paramserver.client.channel import diagnose_tls, open_channel
from paramserver.client.config import ClientSettings
from paramserver.client.errors import (
    AuthFailed, ChunkDataLoss, ChunkUnavailable, ClientError, ClusterUnreachable, ConfigError, NotFound, PushConflict,
    TransferError,
)  # fmt: skip
from paramserver.client.exit_codes import describe_failure, exit_code_for
from worker.cli import worker_exit_code
from worker.errors import ConfigError as WorkerConfigError
from worker.errors import TensorFailed, WorkerError


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("exc, code", [
    (ConfigError("bad option"), 2),
    (NotFound("no such tag"), 3),
    (PushConflict("concurrent", model="m", parent=1, head=2), 4),
    (AuthFailed("bad token"), 5),
    (TransferError("refused", grpc.StatusCode.PERMISSION_DENIED), 5),
    (ClusterUnreachable("nobody answered"), 6),
    (ChunkUnavailable("ab" * 32, {"ps1": "unavailable"}), 6),
    (TransferError("short of quorum", grpc.StatusCode.FAILED_PRECONDITION), 7),
    (ChunkDataLoss("ab" * 32, {"ps1": "CORRUPT"}), 8),
    (ClientError("something else"), 1),
    (FakeRpcError(grpc.StatusCode.NOT_FOUND), 3),
    (FakeRpcError(grpc.StatusCode.ABORTED), 4),
    (FakeRpcError(grpc.StatusCode.UNAUTHENTICATED), 5),
    (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED), 6),
    (FakeRpcError(grpc.StatusCode.DATA_LOSS), 8),
    (FakeRpcError(grpc.StatusCode.INTERNAL), 1),
    (InvalidInput("not a weights file"), 2),
    (ChunkCorrupt("ab" * 32, "crc mismatch"), 8),
    (ManifestError("id mismatch"), 8),
    (ValueError("a bug"), 1),
])  # fmt: skip
def test_exit_code_table(exc: BaseException, code: int) -> None:
    assert exit_code_for(exc) == code
    assert worker_exit_code(exc) == code  # paramworker maps the same failures the same way


def test_worker_errors() -> None:
    assert worker_exit_code(WorkerConfigError("cache_mb must be >= 0")) == 2
    assert worker_exit_code(WorkerError("staging stalled")) == 1
    assert worker_exit_code(TensorFailed("w", ChunkDataLoss("ab" * 32, {"ps1": "CORRUPT"}))) == 8
    assert worker_exit_code(TensorFailed("w", ClusterUnreachable("down"))) == 6
    # A worker error raised while handling a failed call keeps that call's code.
    try:
        try:
            raise FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "wrong token")
        except grpc.RpcError:
            raise WorkerError("resolving m:prod: wrong token; pass --token") from None
    except WorkerError as exc:
        assert worker_exit_code(exc) == 5
        assert describe_failure(exc).message.startswith("UNAUTHENTICATED: ")


def test_messages_are_one_line_with_the_status_name() -> None:
    f = describe_failure(NotFound("m:prod: tag\nprod does not exist"))
    assert f == exit_codes.Failure(3, "NOT_FOUND: m:prod: tag prod does not exist")
    assert describe_failure(FakeRpcError(grpc.StatusCode.ABORTED, "version 2 was committed first")).message.startswith("ABORTED: ")
    assert describe_failure(ConfigError("--streams must be 1..16")).message == "--streams must be 1..16"
    assert describe_failure(WorkerError("cluster down"), code=6).message == "UNAVAILABLE: cluster down"
    for word in ("2 bad arguments", "3 not found", "4 conflict", "5 wrong or missing token", "6 cluster unavailable", "8 data loss"):
        assert word in " ".join(exit_codes.EXIT_CODES_HELP.split())


# ---------------------------------------------------------------- TLS diagnosis against a real gRPC server


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_cluster_certs(tmp_path_factory.mktemp("tls"), {"ps1": []}, clients=("client",))


@pytest.fixture(scope="module")
def servers(certs: ClusterCerts) -> Iterator[dict[str, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    ps1 = certs.servers["ps1"]
    pair = [(ps1.key.read_bytes(), ps1.cert.read_bytes())]
    mtls = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(pair, certs.ca.cert.read_bytes(), require_client_auth=True))
    plain = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield {"mtls": f"127.0.0.1:{mtls}", "plain": f"127.0.0.1:{plain}"}
    finally:
        server.stop(0)


def test_diagnose_tls(certs: ClusterCerts, servers: dict[str, str], tmp_path: Path) -> None:
    ca, client = certs.ca.cert, certs.clients["client"]
    rogue_ca = make_ca(tmp_path, name="rogue CA")
    rogue = issue(tmp_path, rogue_ca, "rogue", hosts=[], server=False, client=True)
    mtls, plain = servers["mtls"], servers["plain"]
    assert diagnose_tls(mtls, tls=True, tls_ca=ca, tls_cert=client.cert, tls_key=client.key) is None
    assert diagnose_tls(plain, tls=False) is None
    assert diagnose_tls("127.0.0.1:1", tls=True, tls_ca=ca) is None  # refused: not a TLS problem
    assert "requires a client certificate" in (diagnose_tls(mtls, tls=True, tls_ca=ca) or "")
    assert "refused the client certificate" in (diagnose_tls(mtls, tls=True, tls_ca=ca, tls_cert=rogue.cert, tls_key=rogue.key) or "")
    assert "serves TLS but this client connects in plaintext" in (diagnose_tls(mtls, tls=False) or "")
    assert "does not accept" in (diagnose_tls(mtls, tls=True, tls_ca=rogue_ca.cert, tls_cert=client.cert, tls_key=client.key) or "")
    assert "does not speak TLS" in (diagnose_tls(plain, tls=True, tls_ca=ca, tls_cert=client.cert, tls_key=client.key) or "")


def test_unavailable_that_is_really_tls_exits_5(certs: ClusterCerts, servers: dict[str, str]) -> None:
    no_cert = ClientSettings(cluster=(servers["mtls"],), tls_ca=certs.ca.cert)
    f = describe_failure(ClusterUnreachable("no cluster member answered"), no_cert)
    assert f.code == 5 and f.message.startswith("UNAUTHENTICATED: ") and "client certificate" in f.message
    really_down = ClientSettings(cluster=("127.0.0.1:1",), tls_ca=certs.ca.cert)
    assert describe_failure(ClusterUnreachable("no cluster member answered"), really_down).code == 6


def test_open_channel_is_the_one_factory(certs: ClusterCerts, servers: dict[str, str]) -> None:
    from grpc_health.v1 import health_pb2

    client = certs.clients["client"]
    with open_channel(servers["mtls"], tls_ca=certs.ca.cert, tls_cert=client.cert, tls_key=client.key, token="t-1234567") as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with open_channel(servers["plain"], token="t-1234567") as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(ConfigError, match="together"):
        open_channel(servers["mtls"], tls_ca=certs.ca.cert, tls_cert=client.cert)
