"""Served bytes (paramserver.server.served_bytes): GetChunks and the bulk port's reads count the
chunk bytes they send, ServerStatus reports the sum, and the metrics export both paths and the
peer-entry gauge. In-process servers on loopback."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from chunking.hashing import content_id, crc32c
from paramserver.client.bulk_transport import BulkClient
from paramserver.client.rpc import ParamServerClient
from paramserver.server.auth import AuthConfig
from paramserver.server.bulk_port import BulkServer, BulkServerConfig
from paramserver.server.config import ServerConfig
from paramserver.server.metrics import ServerCollector
from paramserver.server.peer_service import PeerService
from paramserver.server.repair import RepairQueue
from paramserver.server.served_bytes import ServedBytes
from paramserver.server.service import RunningServer, start_server
from paramserver.wire.bulk_frames import OK
from paramserver.wire.proto import pb

M1 = "d" * 64


@pytest.fixture
def served() -> ServedBytes:
    return ServedBytes()


@pytest.fixture
def server(tmp_path: Path, served: ServedBytes) -> Iterator[RunningServer]:
    running = start_server(ServerConfig(server_id="ps1", data_dir=tmp_path / "ps1", listen="127.0.0.1:0", fsync=False,
                                        workers=4, cache_bytes=0), served=served)
    yield running
    running.stop(0)


def stored(server: RunningServer, n: int) -> list[tuple[str, bytes]]:
    chunks = []
    for i in range(n):
        data = os.urandom(10_000 + 997 * i)
        cid = content_id(data)
        server.servicer.chunks.store.put(cid, data, "raw", len(data), crc32c(data))
        chunks.append((cid, data))
    return chunks


def test_getchunks_counts_the_chunk_bytes_it_sends_and_status_reports_them(server: RunningServer, served: ServedBytes) -> None:
    chunks = stored(server, 6)
    missing = content_id(b"not stored here")
    with ParamServerClient(server.address) as client:
        assert client.server_status().served_bytes == 0
        # small messages: several replies, each counted; a missing chunk's error counts nothing
        got = list(client.get_chunks_partial([c for c, _ in chunks] + [missing], max_message_bytes=20_000))
        assert sum(len(g.data) for g in got if not isinstance(g, pb.ChunkAck)) == sum(len(d) for _, d in chunks)
        total = sum(len(d) for _, d in chunks)
        assert served.by_path() == {"bulk": 0, "grpc": total}
        assert client.server_status().served_bytes == total
        with pytest.raises(grpc.RpcError):  # NOT_FOUND without allow_partial: what was sent before still counts
            list(client.get_chunks([chunks[0][0], missing]))
        assert served.by_path()["grpc"] == total + len(chunks[0][1])


def test_the_bulk_port_counts_the_chunk_bytes_it_sends(server: RunningServer, served: ServedBytes) -> None:
    chunks = stored(server, 5)
    bulk = BulkServer(server.servicer.chunks.store, AuthConfig(), "127.0.0.1:0", BulkServerConfig(), served=served).start()
    try:
        client = BulkClient(bulk.address)
        items = list(client.fetch([c for c, _ in chunks] + [content_id(b"missing")]))
        client.close()
        assert sum(1 for i in items if i.status == OK) == 5
        want = {"bulk": sum(len(d) for _, d in chunks), "grpc": 0}
        deadline = time.monotonic() + 5.0  # counted once send_all returns on the server's thread: a moment after
        while served.by_path() != want and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.by_path() == want
        with ParamServerClient(server.address) as c:  # one count for both paths
            assert c.server_status().served_bytes == served.total()
    finally:
        bulk.stop()


def test_status_reports_peer_entries(server: RunningServer) -> None:
    with ParamServerClient(server.address) as client:
        client.announce_peer(pb.AnnouncePeerRequest(worker_id="w1", address="127.0.0.1:7001", lease_s=30.0,
                                                    versions=[pb.PeerVersion(manifest_id=M1)]))
        assert client.server_status().peer_entries == 1
        assert [p.worker_id for p in client.find_peers(M1).peers] == ["w1"]


class _Metadata:
    def is_leader(self) -> bool:
        return True

    def term(self) -> int:
        return 1

    def commit_index(self) -> int:
        return 1

    def status(self) -> dict[str, object]:
        return {"has_quorum": True}


def test_metrics_export_served_bytes_by_path_and_the_peer_entries(server: RunningServer, served: ServedBytes) -> None:
    served.add("bulk", 7)
    served.add("grpc", 5)
    peers = PeerService("ps1")
    peers.announce(pb.AnnouncePeerRequest(worker_id="w1", address="127.0.0.1:7001",
                                          versions=[pb.PeerVersion(manifest_id=M1), pb.PeerVersion(manifest_id="e" * 64)]))
    collector = ServerCollector("ps1", server.servicer.chunks.store, _Metadata(), RepairQueue(), lambda: 1,  # type: ignore[arg-type]
                                served=served, peers=peers)
    families = {f.name: f for f in collector.collect()}
    samples = {(s.name, s.labels.get("path")): s.value for s in families["paramserver_served_bytes"].samples}
    assert samples == {("paramserver_served_bytes_total", "bulk"): 7.0, ("paramserver_served_bytes_total", "grpc"): 5.0}
    assert families["paramserver_peer_entries"].samples[0].value == 2
