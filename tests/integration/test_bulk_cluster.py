"""The bulk read port on real server processes (deploy.local.LocalCluster), with gRPC as the fallback.

Servers run with ``--cache-mb 0`` so every read comes from disk and a chunk damaged on disk is
seen at once.
"""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from chunking.chunk_table import ChunkRows
from chunking.hashing import crc32c
from chunking.manifest import Manifest
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.wire.bulk_frames import CORRUPT, MISSING, OK
from paramserver.client.bulk_transport import BulkClient, BulkUnauthenticated
from paramserver.client.rpc import ParamServerClient
from paramserver.wire.proto import pb
from paramserver.client.hostmem import allocate_targets
from paramserver.client.pull import PullOptions, pull_tensors
from paramserver.client.session import ClusterClient
from paramserver.client.sinks import TensorSink
from paramserver.client.push import push
from paramserver.server.segments import corrupt_stored, locate_on_disk

pytestmark = pytest.mark.integration

ADMIN, READ = "admin-token-bulk", "read-token-bulk"


def state_dict(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # ~1.5 MiB per tensor: several 256 KiB chunks each, 36 chunks in all
    return {f"layer{i}.weight": torch.randn(384, 1024, generator=gen) for i in range(n)}


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert as_bytes(got[name]) == as_bytes(t), name


def start(root: Path, *extra: str, servers: int = 3) -> LocalCluster:
    c = LocalCluster(LocalClusterConfig(root=root, servers=servers, admin_token=ADMIN, read_token=READ,
                                        extra_args=("--no-fsync", "--cache-mb", "0", "--scrub-mb-per-s", "0", *extra)))
    try:
        c.up(wait=90)
    except BaseException:
        c.down()
        raise
    return c


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start(tmp_path_factory.mktemp("bulk"))
    try:
        yield c
    finally:
        c.down()


def members(cluster: LocalCluster) -> dict[str, pb.Member]:
    deadline = time.monotonic() + 30
    while True:
        info = ParamServerClient(cluster.addresses[0], token=READ).cluster_info()
        found = {m.server_id: m for m in info.members}
        if all(m.bulk_address for m in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def manifest_of(cluster: LocalCluster, ref: str) -> Manifest:
    with ClusterClient(cluster.addresses, token=READ) as client:
        return client.manifest(client.resolve_ref(ref, linearizable=True).manifest_id)


def test_members_advertise_a_bulk_address_on_the_grpc_host(cluster: LocalCluster) -> None:
    found = members(cluster)
    assert set(found) == {"ps1", "ps2", "ps3"}
    for m in found.values():
        host, _, port = m.bulk_address.rpartition(":")
        assert host == m.grpc_address.rpartition(":")[0] and int(port) > 0 and m.bulk_address != m.grpc_address


def test_member_add_of_a_known_server_keeps_what_it_registered(cluster: LocalCluster) -> None:
    """`paramctl member add ps2 ...` names no bulk port: it used to wipe ps2's, and every client fell
    back to gRPC for ps2's chunks until ps2 restarted."""
    before = members(cluster)["ps2"]
    again = pb.Member(server_id="ps2", grpc_address=before.grpc_address, raft_address=before.raft_address, state="up")
    reply = ParamServerClient(cluster.addresses[0], token=ADMIN).add_member(again)
    assert {m.server_id: m for m in reply.members}["ps2"].bulk_address == before.bulk_address != ""
    assert members(cluster)["ps2"] == before


def test_bulk_round_trip_of_many_chunks_matches_the_manifest(cluster: LocalCluster) -> None:
    want = state_dict(1)
    push(cluster.seed, want, model="bulk-rt", tag="prod", token=ADMIN)
    manifest = manifest_of(cluster, "bulk-rt:prod")
    refs = {r.id: r for r in manifest.unique_chunks()}
    assert len(refs) >= 30
    for m in members(cluster).values():  # R = 3 on 3 servers: each holds every chunk
        client = BulkClient(m.bulk_address, READ)
        seen = []
        for item in client.fetch(list(refs)):
            ref = refs[item.id]
            assert item.status == OK, item.message
            assert len(item.data) == ref.stored_size and crc32c(item.data) == ref.crc32c == item.crc32c
            seen.append(item.id)
        assert seen == list(refs)
        client.close()
    # and the pull goes over the bulk ports, bit-exact
    got, report = pull_tensors(cluster.seed, "bulk-rt:prod", token=READ)
    assert_bit_exact(got, want)
    assert report.bulk_bytes == report.bytes_fetched > 0 and report.bulk_fallbacks == 0


def test_missing_chunk_is_answered_missing(cluster: LocalCluster) -> None:
    address = members(cluster)["ps2"].bulk_address
    items = list(BulkClient(address, READ).fetch(["ab" * 32]))
    assert items[0].status == MISSING and "not stored" in items[0].message


def test_wrong_token_is_refused_naming_the_expected_token(cluster: LocalCluster) -> None:
    address = members(cluster)["ps1"].bulk_address
    with pytest.raises(BulkUnauthenticated, match="read token or the admin token"):
        list(BulkClient(address, "wrong-token-here").fetch(["ab" * 32]))
    assert list(BulkClient(address, ADMIN).fetch(["ab" * 32]))[0].status == MISSING


def test_corrupt_chunk_is_answered_corrupt_quarantined_and_pull_fails_over(cluster: LocalCluster) -> None:
    want = state_dict(2, n=2)
    push(cluster.seed, want, model="bulk-bad", tag="prod", token=ADMIN)
    manifest = manifest_of(cluster, "bulk-bad:prod")
    victim = manifest.chunks[1].id
    slot = cluster.slot("ps1")
    location = locate_on_disk(slot.data_dir, victim)
    assert location is not None
    corrupt_stored(location, at=100, xor=0xFF)
    address = members(cluster)["ps1"].bulk_address
    items = list(BulkClient(address, READ).fetch([victim]))
    assert items[0].status == CORRUPT and "CRC32C" in items[0].message
    assert locate_on_disk(slot.data_dir, victim) is None  # quarantined (a tombstone kills the record)
    assert any((Path(slot.data_dir) / "quarantine").iterdir())
    got, _ = pull_tensors(cluster.seed, "bulk-bad:prod", token=READ)  # other replicas serve it
    assert_bit_exact(got, want)


@pytest.mark.parametrize("verify", ["crc", "content"])
def test_replica_serving_wrong_bytes_with_its_own_crc_is_caught_in_place_and_refetched(cluster: LocalCluster, verify: str) -> None:
    # A replica whose copy was altered *and* re-checksummed (a bug or a forger): the server's own
    # CRC check passes and it sends the bytes. Raw chunks are received straight into the target
    # tensors, so the client must reject them there, fetch a good copy from another replica over
    # the same region, and tell the replica.
    want = state_dict(5 if verify == "crc" else 7, n=4)
    model = f"bulk-forged-{verify}"
    push(cluster.seed, want, model=model, tag="prod", token=ADMIN)
    manifest = manifest_of(cluster, f"{model}:prod")
    victims = [r.id for r in manifest.chunks if r.codec == "raw"][:12]
    assert len(victims) == 12
    for sid in ("ps1", "ps2"):  # ps3 keeps good copies
        for cid in victims:
            location = locate_on_disk(cluster.slot(sid).data_dir, cid)
            assert location is not None
            corrupt_stored(location, at=1000, xor=0x01, fix_crc=True)
    got, report = pull_tensors(cluster.seed, f"{model}:prod", token=READ, options=PullOptions(verify=verify))
    assert_bit_exact(got, want)
    assert report.bulk_fallbacks == 0 and report.bulk_bytes > report.bytes_fetched  # all over bulk (rejected copies too)
    assert report.retried >= 1  # some victims were first asked of ps1 or ps2


def test_repeated_pulls_reuse_released_memory_and_stay_bit_exact(cluster: LocalCluster) -> None:
    from paramserver.client.hostmem import default_pool

    first = state_dict(6, n=3)
    second = {k: v + 1 for k, v in first.items()}  # same shapes, other bytes
    push(cluster.seed, first, model="bulk-reuse", tag="a", token=ADMIN)
    push(cluster.seed, second, model="bulk-reuse", tag="b", token=ADMIN)
    pool = default_pool()
    pool.release_all()  # arenas that earlier tests' pulls released: only this test's can be reused
    got, _ = pull_tensors(cluster.seed, "bulk-reuse:a", token=READ)
    assert_bit_exact(got, first)
    del got
    reused = pool.reused
    got, _ = pull_tensors(cluster.seed, "bulk-reuse:b", token=READ)
    assert pool.reused == reused + 1  # the arena of the first pull, released, served the second
    assert_bit_exact(got, second)
    kept = got["layer0.weight"]
    del got
    got, _ = pull_tensors(cluster.seed, "bulk-reuse:a", token=READ)
    assert pool.reused == reused + 1  # one tensor of the second pull is alive: its arena is not reused
    assert_bit_exact(got, first)
    assert torch.equal(kept, second["layer0.weight"])  # and was not overwritten


def test_unreachable_bulk_port_falls_back_to_grpc(cluster: LocalCluster) -> None:
    want = state_dict(3, n=3)
    push(cluster.seed, want, model="bulk-gone", tag="prod", token=ADMIN)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there
    with ClusterClient(cluster.addresses, token=READ) as client:
        manifest = client.manifest(client.resolve_ref("bulk-gone:prod", linearizable=True).manifest_id)
        view = client.view()
        for sid, m in list(view.members.items()):
            broken = pb.Member()
            broken.CopyFrom(m)
            broken.bulk_address = dead
            view.members[sid] = broken
        targets = allocate_targets(manifest).tensors
        sink = TensorSink(manifest, targets)
        client.fetch(ChunkRows.of(manifest.chunks), sink)
        sink.assembler.raise_if_incomplete()
        stats = client.transport.stats
    assert stats.bulk_bytes == 0 and stats.bulk_fallbacks >= 1
    assert_bit_exact({t.name: targets[t.name] for t in manifest.tensors}, want)


def test_pull_with_bulk_off_uses_grpc(cluster: LocalCluster) -> None:
    want = state_dict(4, n=2)
    push(cluster.seed, want, model="bulk-off", tag="prod", token=ADMIN)
    got, report = pull_tensors(cluster.seed, "bulk-off:prod", token=READ, options=PullOptions(bulk=False))
    assert_bit_exact(got, want)
    assert report.bulk_bytes == 0 and report.bytes_fetched > 0


def test_server_started_with_no_bulk_advertises_none_and_pull_uses_grpc(tmp_path: Path) -> None:
    c = start(tmp_path / "nobulk", "--no-bulk", servers=1)
    try:
        info = ParamServerClient(c.addresses[0], token=READ).cluster_info()
        assert [m.bulk_address for m in info.members] == [""]
        want = state_dict(5, n=2)
        push(c.seed, want, model="m", tag="prod", token=ADMIN)
        got, report = pull_tensors(c.seed, "m:prod", token=READ)
        assert_bit_exact(got, want)
        assert report.bulk_bytes == 0 and report.bulk_fallbacks == 0
    finally:
        c.down()
