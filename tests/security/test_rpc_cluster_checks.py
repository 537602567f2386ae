"""AddMember and CommitVersion check what they are told (issue 11, weaker points).

- AddMember put an unreachable member onto the ring. Now the new member must answer
  ServerStatus, as the server id it is added under, and run this cluster's id (derived from the
  cluster secret and the ring); otherwise FAILED_PRECONDITION naming the address, logged at
  WARNING. Servers still register themselves at start-up (not through this RPC).
- CommitVersion accepted a manifest naming another model, or carrying a wrong CRC for a real
  chunk. Now both are INVALID_ARGUMENT, naming the model or the chunk.

A real two-server cluster and a one-server cluster with another secret (deploy.local); the
replica-side CRC answer is also checked over in-process servers.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import torch

from chunking import ChunkingConfig
from chunking.hashing import content_id
from chunking.manifest import Manifest
from consensus.records import MemberRecord
from deploy.local import LocalCluster, free_port
from tests.conftest import local_cluster
from paramserver.client.push import push
from paramserver.client.rpc import ParamServerClient, make_chunk
from paramserver.server.cluster import MemberCheck, PeerSet, QuorumVersionCheck
from paramserver.server.config import ServerConfig
from paramserver.server.errors import InvalidChunkError
from paramserver.server.metaservice import CLUSTER_ID_KEY, cluster_id
from paramserver.server.rpc_errors import PreconditionFailed
from paramserver.server.service import RunningServer, start_server
from paramserver.wire.proto import pb

ADMIN, READ = "admin-token-checks", "read-token-checks"
SECRET, OTHER_SECRET = "cluster-secret-checks-0123456789", "another-cluster-secret-987654321"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("rpc-checks")
    with local_cluster(root, servers=2, admin_token=ADMIN, read_token=READ, secret=SECRET, extra_args=("--no-fsync",)) as c:
        yield c


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Another cluster: same tokens, another cluster secret."""
    root = tmp_path_factory.mktemp("rpc-checks-foreign")
    with local_cluster(root, servers=1, admin_token=ADMIN, read_token=READ, secret=OTHER_SECRET, extra_args=("--no-fsync",)) as c:
        yield c


def leader_address(cluster: LocalCluster) -> str:
    leader = cluster.wait_ready(30)
    return cluster.slot(leader).grpc


def add_member(address: str, member: pb.Member) -> pb.MembershipReply:
    with ParamServerClient(address, token=ADMIN) as c:
        return c.stub.AddMember(pb.AddMemberRequest(member=member), timeout=30)


def member_ids(address: str) -> list[str]:
    with ParamServerClient(address, token=READ) as c:
        return sorted(m.server_id for m in c.cluster_info().members)


def refusal(address: str, member: pb.Member) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        add_member(address, member)
    return info.value.code(), info.value.details() or "", time.monotonic() - t0


def test_status_carries_the_cluster_id(cluster: LocalCluster, foreign: LocalCluster) -> None:
    def cluster_id_of(address: str) -> str:
        with ParamServerClient(address, token=READ) as c:
            return c.server_status().extra[CLUSTER_ID_KEY]

    ours = {cluster_id_of(a) for a in cluster.addresses}
    theirs = cluster_id_of(foreign.addresses[0])
    assert ours == {cluster_id(SECRET, 128)} and theirs == cluster_id(OTHER_SECRET, 128) != cluster_id(SECRET, 128)
    assert SECRET not in str(ours)


def test_an_unreachable_member_is_refused_naming_its_address(cluster: LocalCluster) -> None:
    address = leader_address(cluster)
    nowhere = f"127.0.0.1:{free_port()}"
    code, details, took = refusal(address, pb.Member(server_id="ps9", grpc_address=nowhere, raft_address=f"127.0.0.1:{free_port()}"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and nowhere in details and "ServerStatus" in details
    assert took < 10
    assert member_ids(address) == ["ps1", "ps2"]
    leader = cluster.leader_id()
    assert leader is not None
    log = Path(cluster.slot(leader).log_file).read_text()
    assert f"member refused: server_id=ps9 grpc_address={nowhere}" in log


def test_a_member_of_another_cluster_is_refused(cluster: LocalCluster, foreign: LocalCluster) -> None:
    address = leader_address(cluster)
    stranger = foreign.slots[0]
    # Under its own id (which happens to be one of ours, at other addresses): the cluster id differs.
    code, details, _ = refusal(address, pb.Member(server_id="ps1", grpc_address=stranger.grpc, raft_address=stranger.raft))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and stranger.grpc in details and "cluster id" in details
    # Under another id: it answers as ps1, not ps3.
    code, details, _ = refusal(address, pb.Member(server_id="ps3", grpc_address=stranger.grpc, raft_address=stranger.raft))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "'ps1', not 'ps3'" in details
    with ParamServerClient(address, token=READ) as c:
        assert {m.server_id: m.grpc_address for m in c.cluster_info().members} == {s.server_id: s.grpc for s in cluster.slots}


def test_a_real_member_is_still_accepted(cluster: LocalCluster) -> None:
    address = leader_address(cluster)
    with ParamServerClient(address, token=READ) as c:
        ps2 = next(m for m in c.cluster_info().members if m.server_id == "ps2")
    reply = add_member(address, ps2)
    assert sorted(m.server_id for m in reply.members) == ["ps1", "ps2"]


# ------------------------------------------------------------------ CommitVersion


@pytest.fixture(scope="module")
def pushed(cluster: LocalCluster) -> tuple[int, Manifest]:
    state = {"w": torch.arange(60_000, dtype=torch.float32), "b": torch.ones(7)}
    report = push(cluster.seed, state, model="checked", token=ADMIN, config=ChunkingConfig(chunk_size=64 * 1024))
    with ParamServerClient(cluster.addresses[0], token=READ) as c:
        reply = c.get_manifest(model="checked", version=report.version)
    return report.version, Manifest.from_bytes(reply.data, expected_id=reply.manifest_id)


def store_manifest(cluster: LocalCluster, manifest: Manifest) -> str:
    body = manifest.to_bytes()
    for address in cluster.addresses:
        with ParamServerClient(address, token=ADMIN) as c:
            c.put_chunks([make_chunk(content_id(body), body)])
    return content_id(body)


def commit_error(cluster: LocalCluster, model: str, manifest_id: str, parent: int) -> tuple[grpc.StatusCode, str]:
    with ParamServerClient(leader_address(cluster), token=ADMIN) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.commit_version(model, manifest_id, parent=parent, publisher="mallory")
    return info.value.code(), info.value.details() or ""


def test_a_manifest_of_another_model_is_refused(cluster: LocalCluster, pushed: tuple[int, Manifest]) -> None:
    number, manifest = pushed
    other = store_manifest(cluster, dataclasses.replace(manifest, model="someone-else"))
    code, details = commit_error(cluster, "checked", other, number)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'someone-else'" in details and "'checked'" in details


def test_a_wrong_chunk_crc_is_refused_naming_the_chunk(cluster: LocalCluster, pushed: tuple[int, Manifest]) -> None:
    number, manifest = pushed
    victim = manifest.chunks[1].id
    chunks = tuple(c._replace(crc32c=c.crc32c ^ 0x5A5A) if c.id == victim else c for c in manifest.chunks)
    forged = store_manifest(cluster, dataclasses.replace(manifest, chunks=chunks))
    code, details = commit_error(cluster, "checked", forged, number)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and victim in details and "CRC32C" in details
    with ParamServerClient(cluster.addresses[0], token=READ) as c:
        assert [v.number for v in c.list_versions("checked").versions] == [number]  # nothing committed


# ------------------------------------------------------------------ in-process: the replicas' answers


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[RunningServer]]:
    out = [start_server(ServerConfig(server_id=f"ps{i}", data_dir=tmp_path / f"ps{i}", listen="127.0.0.1:0", fsync=False,
                                     workers=4, cache_bytes=0)) for i in range(3)]
    yield out
    for s in out:
        s.stop(0)


def test_replicas_answer_stored_crcs_and_the_check_compares_them(servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch) -> None:
    from chunking import pack

    packed = pack({"a": torch.arange(50_000, dtype=torch.float32)}, model="m", config=ChunkingConfig(chunk_size=64 * 1024))
    blobs = packed.source()
    good = packed.manifest
    victim = good.chunks[0].id
    bad = dataclasses.replace(good, chunks=tuple(c._replace(crc32c=c.crc32c ^ 1) if c.id == victim else c
                                                 for c in good.chunks))
    first = good.chunks[0]
    recoded = dataclasses.replace(good, chunks=tuple(
        c._replace(codec="zstd", stored_size=c.stored_size // 3, crc32c=c.crc32c ^ 7) if c.id == first.id else c
        for c in good.chunks))
    for manifest in (good, bad, recoded):
        blobs[content_id(manifest.to_bytes())] = manifest.to_bytes()
    for s in servers:
        with ParamServerClient(s.address) as c:
            c.put_chunks([make_chunk(cid, data) for cid, data in blobs.items()])
            reply = c.stub.HasChunks(pb.HasChunksRequest(ids=[victim, "e" * 64], with_crc=True))
            assert list(reply.present) == [True, False] and list(reply.crc32c) == [good.chunks[0].crc32c, 0]
            assert list(reply.codec) == ["raw", ""]
            # The packed form (what the commit check sends): the same answers, one entry per id.
            reply = c.stub.HasChunks(pb.HasChunksRequest(packed_ids=bytes.fromhex(victim + "e" * 64), with_crc=True))
            assert not reply.present and reply.present_count == 1 and reply.packed_present == b"\x01\x00"
            assert reply.packed_crc32c == good.chunks[0].crc32c.to_bytes(4, "little") + bytes(4)
            assert reply.packed_raw == b"\x01\x00"
            for malformed in (pb.HasChunksRequest(packed_ids=b"x" * 33), pb.HasChunksRequest(ids=[victim], packed_ids=b"x" * 32)):
                with pytest.raises(grpc.RpcError) as info:
                    c.stub.HasChunks(malformed)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "packed_ids" in (info.value.details() or "")
    members = [MemberRecord(f"ps{i}", s.address, f"127.0.0.1:{7100 + i}") for i, s in enumerate(servers)]
    peers = PeerSet("outsider", lambda: members)  # every copy is counted over the wire
    try:
        check = QuorumVersionCheck(peers, servers[0].servicer.chunks.store)
        facts = check(content_id(good.to_bytes()), good.to_bytes())
        assert facts.model == "m" and facts.chunk_count == len(good.chunks)
        with pytest.raises(InvalidChunkError, match=f"chunk {victim} .*CRC32C .* server ps[012] stores"):
            check(content_id(bad.to_bytes()), bad.to_bytes())
        # Another encoding of the same raw bytes (a later push with compression) has its own
        # CRC legitimately: readers prove that copy by its content id.
        assert check(content_id(recoded.to_bytes()), recoded.to_bytes()).model == "m"
        # In many small calls (as a big manifest is asked), answered out of order: the same verdicts.
        import paramserver.server.cluster as cluster_module
        monkeypatch.setattr(cluster_module, "HAS_BATCH", 2)
        assert len(good.chunks) >= 4  # with the manifest: 3 calls to each replica
        assert check(content_id(good.to_bytes()), good.to_bytes()).chunk_count == len(good.chunks)
        with pytest.raises(InvalidChunkError, match=f"chunk {victim} .*CRC32C .* server ps[012] stores"):
            check(content_id(bad.to_bytes()), bad.to_bytes())
        monkeypatch.undo()
        # The probe AddMember uses: a live server answers with its id and cluster id.
        probe = MemberCheck(peers, cluster_id(None, 128))
        probe(members[1])
        with pytest.raises(PreconditionFailed, match="cluster id"):
            MemberCheck(peers, cluster_id("a-secret-of-another-cluster", 128))(members[1])
        dead = MemberRecord("ps8", f"127.0.0.1:{free_port()}", "127.0.0.1:1")
        with pytest.raises(PreconditionFailed, match=dead.grpc_address):
            probe(dead)
    finally:
        peers.close()
    assert servers[0].servicer.chunks.store.has(victim)
