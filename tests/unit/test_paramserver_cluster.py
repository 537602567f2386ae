"""Quorum check before commit and replica fetch, over three in-process data-plane servers."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from chunking import ChunkingConfig, pack
from chunking.hashing import content_id
from consensus.records import MemberRecord
from paramserver.client.rpc import ParamServerClient, make_chunk
from paramserver.server.cluster import PeerSet, QuorumVersionCheck, ReplicaFetcher, cluster_blob_fetcher
from paramserver.server.config import ServerConfig
from paramserver.server.errors import InvalidChunkError
from paramserver.server.rpc_errors import PreconditionFailed
from paramserver.server.service import RunningServer, start_server
from paramserver.server.segments import corrupt_stored


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[RunningServer]]:
    servers = [
        start_server(ServerConfig(server_id=f"ps{i}", data_dir=tmp_path / f"ps{i}", listen="127.0.0.1:0", fsync=False, workers=4,
                                  cache_bytes=0))
        for i in range(3)
    ]
    yield servers
    for s in servers:
        s.stop(0)


def members_of(servers: list[RunningServer]) -> list[MemberRecord]:
    return [MemberRecord(f"ps{i}", s.address, f"127.0.0.1:{7100 + i}") for i, s in enumerate(servers)]


@pytest.fixture
def model() -> tuple[str, bytes, dict[str, bytes], object]:
    state = {"a.weight": torch.arange(200_000, dtype=torch.float32), "b.bias": torch.ones(1000)}
    packed = pack(state, model="m", config=ChunkingConfig(chunk_size=64 * 1024))
    body = packed.manifest.to_bytes()
    return content_id(body), body, packed.source(), packed.manifest


def push(servers: list[RunningServer], peers: PeerSet, blobs: dict[str, bytes], copies: int) -> None:
    ring = peers.ring()
    for cid, data in blobs.items():
        for server_id in ring.replicas(cid, 3)[:copies]:
            idx = int(server_id[2:])
            with ParamServerClient(servers[idx].address) as c:
                c.put_chunks([make_chunk(cid, data)])


def test_quorum_check_counts_replicas(cluster: list[RunningServer], model: tuple) -> None:  # type: ignore[type-arg]
    mid, body, chunks, manifest = model
    peers = PeerSet("ps0", lambda: members_of(cluster))
    check = QuorumVersionCheck(peers, cluster[0].servicer.chunks.store)
    push(cluster, peers, {**chunks, mid: body}, copies=1)
    with pytest.raises(PreconditionFailed, match=r"write quorum \(W=2 of R=3\)"):
        check(mid, body)
    push(cluster, peers, {**chunks, mid: body}, copies=2)
    facts = check(mid, body)
    assert facts.chunk_count == len(manifest.chunks) and facts.nbytes == manifest.raw_bytes  # type: ignore[attr-defined]
    # An unreachable replica counts as holding nothing: chunks whose second copy
    # is on the stopped server fall below W=2 again.
    cluster[2].stop(0)
    members = members_of(cluster)
    assert any("ps2" in peers.ring().replicas(cid, 3)[:2] for cid in [mid, *chunks])
    with pytest.raises(PreconditionFailed, match="have not reached"):
        QuorumVersionCheck(PeerSet("ps0", lambda: members), cluster[0].servicer.chunks.store)(mid, body)
    with pytest.raises(InvalidChunkError, match="cannot be committed"):
        check(mid, body[:-1] + b" ")
    peers.close()


def test_quorum_check_counts_a_replica_as_soon_as_it_is_back(cluster: list[RunningServer], model: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    # A peer channel that failed to connect while its server was down sits in gRPC's reconnect
    # back-off (1 s, growing) and failed every call at once with the old "connection refused":
    # a commit right after a replica restarted was refused although its chunks were on W servers
    # (found by tests/integration/test_push_crash.py). The check asks again on a fresh channel.
    mid, body, chunks, manifest = model
    members = members_of(cluster)  # the addresses stay: ps2 comes back on its port
    peers = PeerSet("ps0", lambda: members)
    check = QuorumVersionCheck(peers, cluster[0].servicer.chunks.store)
    for cid, data in {**chunks, mid: body}.items():  # on ps0 and ps2 only: W=2 needs ps2
        for server in (cluster[0], cluster[2]):
            with ParamServerClient(server.address) as c:
                c.put_chunks([make_chunk(cid, data)])
    check(mid, body)
    cluster[2].stop(0)
    with pytest.raises(PreconditionFailed, match="have not reached"):
        check(mid, body)  # the peer channel to ps2 fails to connect: back-off starts
    cluster[2] = start_server(ServerConfig(server_id="ps2", data_dir=tmp_path / "ps2", listen=members[2].grpc_address,
                                           fsync=False, workers=4, cache_bytes=0))
    facts = check(mid, body)  # at once, not after the back-off
    assert facts.nbytes == manifest.raw_bytes  # type: ignore[attr-defined]
    peers.close()


def test_replica_fetcher_repairs_from_a_healthy_copy(cluster: list[RunningServer]) -> None:
    data = b"x" * 50_000
    cid = content_id(data)
    for s in cluster[1:]:
        with ParamServerClient(s.address) as c:
            c.put_chunks([make_chunk(cid, data)])
    # ps1's copy is corrupt: the fetcher must skip it and use ps2's.
    store1 = cluster[1].servicer.chunks.store
    location = store1.locate(cid)
    assert location is not None
    corrupt_stored(location, at=0, xor=1)
    local = cluster[0].servicer.chunks.store
    peers = PeerSet("ps0", lambda: members_of(cluster))
    found = ReplicaFetcher(peers, local)(cid)
    assert found is not None and found.data == data
    assert cluster_blob_fetcher(local, ReplicaFetcher(peers, local))(cid) == data
    assert ReplicaFetcher(peers, local)("e" * 64) is None
    peers.close()


def test_quorum_check_asks_w_replicas_first_and_the_others_only_for_chunks_still_short(
        cluster: list[RunningServer], model: tuple) -> None:  # type: ignore[type-arg]
    mid, body, chunks, manifest = model
    peers = PeerSet("ps0", lambda: members_of(cluster))
    check = QuorumVersionCheck(peers, cluster[0].servicer.chunks.store)
    ring = peers.ring()
    ids = [mid, *chunks]
    points = np.frombuffer(bytes.fromhex("".join(ids)), np.uint8).reshape(-1, 32)[:, :8].copy().view(">u8").reshape(-1)
    groups = ring.placement_groups_by_point(points, 3)
    wave1, wave2 = check._waves(groups, 2)
    asked1 = np.zeros(len(ids), int)
    for rows in wave1.values():
        asked1[rows] += 1
    assert (asked1 == 2).all()  # W of R per chunk
    assert len(wave1["ps0"]) == len(ids)  # this server's own store first, for every chunk it holds
    for placed, group in groups.items():  # the rest of every replica set, and nothing else
        for server in placed:
            rows = set(group.tolist())
            assert rows <= set(wave1.get(server, np.zeros(0, int)).tolist()) | set(wave2.get(server, np.zeros(0, int)).tolist())
    assert not set(wave1.get("ps1", [])) & set(wave2.get("ps1", []))
    # With every replica holding every chunk, a stopped one is made up for by the other.
    push(cluster, peers, {**chunks, mid: body}, copies=3)
    assert check(mid, body).chunk_count == len(manifest.chunks)  # type: ignore[attr-defined]
    cluster[1].stop(0)
    assert check(mid, body).chunk_count == len(manifest.chunks)  # type: ignore[attr-defined]
    peers.close()
