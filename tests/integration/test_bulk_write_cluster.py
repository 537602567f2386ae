"""The bulk write path on real server processes (deploy.local.LocalCluster): SendSession over the
servers' bulk ports, read back bit-exact; tokens; a chunk damaged in transit; a server killed
mid-push; PutChunks as the fallback (no bulk port, or a bulk port that does not answer)."""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from chunking.hashing import content_id, crc32c
from deploy.local import LocalCluster
from paramserver.client import push_sender
from paramserver.client.bulk_transport import BulkClient
from paramserver.client.bulk_writer import BulkWriter
from paramserver.client.cluster_view import ClusterOptions, ClusterView
from paramserver.client.pull import pull_tensors
from paramserver.client.push import push
from paramserver.client.push_plan import AckLedger
from paramserver.client.push_sender import SendOptions, SendSession, SendStats
from paramserver.client.rpc import ChunkData, ParamServerClient
from paramserver.wire import bulk_frames as bf
from paramserver.wire.proto import pb
from tests.integration.test_bulk_cluster import ADMIN, READ, assert_bit_exact, members, start, state_dict

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start(tmp_path_factory.mktemp("bulkw"))
    try:
        members(c)  # every member advertises its bulk address
        yield c
    finally:
        c.down()


def chunks_of(n: int, size: int = 256 << 10, seed: int = 0) -> list[ChunkData]:
    out = []
    for i in range(n):
        data = os.urandom(size) if seed == 0 else bytes([(seed + i) % 251]) * size
        out.append(ChunkData(content_id(data), "raw", len(data), crc32c(data), data))
    return out


def view_of(cluster: LocalCluster, token: str = ADMIN) -> ClusterView:
    return ClusterView.connect(ClusterOptions(tuple(cluster.addresses), token=token))


def send(view: ClusterView, chunks: list[ChunkData], options: SendOptions = SendOptions()) -> tuple[AckLedger, dict, SendStats]:
    ledger = AckLedger({c.id: view.replicas(c.id) for c in chunks}, view.write_quorum)
    with SendSession(view, ledger, options, lambda n: None) as session:
        for c in chunks:
            session.submit(c, view.replicas(c.id))
        failed = session.finish()
    return ledger, failed, session.stats


def held(cluster: LocalCluster, server: str, ids: list[str]) -> list[bool]:
    with ParamServerClient(members(cluster)[server].grpc_address, token=ADMIN) as c:
        return c.has_chunks(ids)


def read_back(address: str, chunks: list[ChunkData]) -> None:
    client = BulkClient(address, READ)
    try:
        want = {c.id: c.data for c in chunks}
        for item in client.fetch(list(want)):
            assert item.status == bf.OK, item.message
            assert bytes(item.data) == want[item.id]
    finally:
        client.close()


def test_session_writes_over_bulk_and_every_replica_reads_back_bit_exact(cluster: LocalCluster) -> None:
    chunks = chunks_of(48)  # 12 MiB: several PUTs per server
    with view_of(cluster) as view:
        ledger, failed, stats = send(view, chunks)
        assert failed == {} and ledger.short() == []
        assert all(ledger.count(c.id) == view.replication == 3 for c in chunks)
    assert stats.bulk_servers == {"ps1", "ps2", "ps3"} and stats.grpc_servers == set() and stats.bulk_fallbacks == 0
    assert stats.bulk_bytes == 3 * sum(len(c.data) for c in chunks)
    for m in members(cluster).values():
        read_back(m.bulk_address, chunks)


def test_push_goes_over_the_bulk_ports_and_pulls_bit_exact(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[SendStats] = []
    finish = SendSession.finish

    def recording(self: SendSession) -> dict:
        out = finish(self)
        seen.append(self.stats)
        return out

    monkeypatch.setattr(push_sender.SendSession, "finish", recording)
    want = state_dict(21, n=4)
    push(cluster.seed, want, model="bulkw-push", tag="prod", token=ADMIN)
    assert seen and seen[0].bulk_servers == {"ps1", "ps2", "ps3"} and not seen[0].grpc_servers
    got, _ = pull_tensors(cluster.seed, "bulkw-push:prod", token=READ)
    assert_bit_exact(got, want)


@pytest.mark.parametrize("token", [READ, "wrong-token-xyz"])
def test_read_or_wrong_token_is_refused_unauthenticated_and_nothing_is_stored(cluster: LocalCluster, token: str) -> None:
    chunks = chunks_of(6)
    with view_of(cluster, token=READ) as view:  # reads (ClusterInfo) work with the read token
        view.options = ClusterOptions(view.options.seeds, token=token)
        _ledger, failed, stats = send(view, chunks)
    assert set(failed) == {"ps1", "ps2", "ps3"}
    assert all(code == grpc.StatusCode.UNAUTHENTICATED and "admin token" in msg for code, msg in failed.values())
    assert stats.bulk_fallbacks == 0
    for server in ("ps1", "ps2", "ps3"):
        assert held(cluster, server, [c.id for c in chunks]) == [False] * len(chunks)


def test_chunk_damaged_in_transit_is_refused_by_name_and_the_rest_of_its_put_is_stored(cluster: LocalCluster) -> None:
    chunks = chunks_of(5, size=100_000)
    bad = chunks[3]
    got: list[list[tuple[int, str, int]]] = []
    address = members(cluster)["ps2"].bulk_address
    w = BulkWriter(address, ADMIN, lambda batch, acks, r: got.append(acks))
    payloads: list[bytes] = [c.data for c in chunks]
    payloads[3] = bad.data[:-1] + bytes([bad.data[-1] ^ 0x40])
    items = [bf.encode_put_item(c.id, c.codec, c.raw_size, len(c.data), c.crc32c) for c in chunks]
    w.put(chunks, items, payloads, sum(len(p) for p in payloads))
    assert w.drain(30)
    w.close(goodbye=True)
    statuses = [a[0] for a in got[0]]
    assert statuses == [bf.STORED, bf.STORED, bf.STORED, bf.CORRUPT_IN_TRANSIT, bf.STORED]
    assert bad.id in got[0][3][1] and "ps2" in got[0][3][1]
    assert held(cluster, "ps2", [c.id for c in chunks]) == [True, True, True, False, True]
    # through a session the same failure is DATA_LOSS for that server, which a push retries
    forged = ChunkData(bad.id, bad.codec, bad.raw_size, bad.crc32c ^ 1, bad.data)
    with view_of(cluster) as view:
        ledger, failed, _stats = send(view, [forged, *chunks_of(3, size=50_000)])
    assert {code for code, _m in failed.values()} == {grpc.StatusCode.DATA_LOSS} and all(bad.id in m for _c, m in failed.values())
    assert ledger.short() == [bad.id]


def test_dead_bulk_port_falls_back_to_putchunks_before_any_ack(cluster: LocalCluster) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there
    chunks = chunks_of(10, seed=7)
    with view_of(cluster) as view:
        broken = pb.Member()
        broken.CopyFrom(view.members["ps1"])
        broken.bulk_address = dead
        view.members["ps1"] = broken
        ledger, failed, stats = send(view, chunks)
    assert failed == {} and all(ledger.count(c.id) == 3 for c in chunks)
    assert stats.bulk_fallbacks == 1 and "ps1" in stats.fallback_reasons and stats.grpc_servers == {"ps1"}
    read_back(members(cluster)["ps1"].bulk_address, chunks)


def test_server_killed_mid_push_is_reported_and_the_others_hold_everything(cluster: LocalCluster) -> None:
    chunks = chunks_of(160)  # 40 MiB
    victim = "ps3"
    try:
        with view_of(cluster) as view:
            ledger = AckLedger({c.id: view.replicas(c.id) for c in chunks}, view.write_quorum)
            killed = threading.Event()
            with SendSession(view, ledger, SendOptions(batch_bytes=1 << 20, window=2), lambda n: None) as session:
                for k, c in enumerate(chunks):
                    if k == 60:
                        deadline = time.monotonic() + 30
                        while not any(victim in ledger.holders(x.id) for x in chunks[:60]):
                            assert time.monotonic() < deadline, "the victim acked nothing"
                            time.sleep(0.02)
                        cluster.kill(victim)  # kill -9 while PUTs are in flight
                        killed.set()
                    session.submit(c, view.replicas(c.id))
                failed = session.finish()
        assert killed.is_set()
        assert set(failed) == {victim} and failed[victim][0] == grpc.StatusCode.UNAVAILABLE, failed
        assert ledger.short() == []  # W=2 through the other two
        for server in ("ps1", "ps2"):
            assert all(held(cluster, server, [c.id for c in chunks]))
    finally:
        cluster.restart(victim)
        cluster.wait_ready(60)


def test_servers_without_a_bulk_port_get_putchunks(tmp_path: Path) -> None:
    c = start(tmp_path / "nobulk", "--no-bulk")
    try:
        chunks = chunks_of(12)
        with view_of(c) as view:
            assert all(not m.bulk_address for m in view.members.values())
            ledger, failed, stats = send(view, chunks)
        assert failed == {} and all(ledger.count(x.id) == 3 for x in chunks)
        assert stats.bulk_servers == set() and stats.grpc_servers == {"ps1", "ps2", "ps3"} and stats.bulk_fallbacks == 0
        with ParamServerClient(c.addresses[0], token=READ) as client:
            got = {x.id: x.data for x in client.get_chunks([x.id for x in chunks])}
        assert got == {x.id: x.data for x in chunks}
    finally:
        c.down()
