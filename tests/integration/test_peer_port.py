"""A worker's peer port read by the cluster's own client transports (worker.peer_port).

A real PeerPort in this process, over a real PeerShelf holding a load in progress and cache tiers;
read with paramserver.client.bulk_transport (BulkPool, unchanged) and ClusterTransport, and under
mutual TLS with certificates from deploy.certs, through gRPC GetChunks (get_chunks_raw).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from chunking.hashing import content_id, crc32c
from deploy.certs import CertPaths, issue, make_ca
from paramserver.client.arrivals import ReadIds
from paramserver.client.bulk_transport import BulkPool
from paramserver.client.getchunks_transport import get_chunks_raw, open_channel
from paramserver.client.transport import ClusterTransport
from paramserver.wire import bulk_frames
from paramserver.wire.proto import SERVICE_NAME, pb
from tests.peer_helpers import chunks, loading
from worker.disk_cache import DiskCache
from worker.lru_k import LRUKCache
from worker.peer_port import PeerPort, PeerPortConfig
from worker.peer_common import PEER_NICE
from worker.peer_shelf import Found, PeerShelf
from worker.tiered_cache import TieredCache

TOKEN = "peer-test-token"
MiB = 1 << 20


@pytest.fixture
def shelf(tmp_path: Path) -> PeerShelf:
    return PeerShelf(TieredCache(LRUKCache(64 * MiB), DiskCache(tmp_path / "disk", 64 * MiB)))


@pytest.fixture
def port(shelf: PeerShelf) -> Iterator[PeerPort]:
    with PeerPort(shelf, PeerPortConfig(peer_wait_s=2.0), TOKEN) as p:
        yield p


def test_bulk_reads_are_bit_exact_in_batches_and_missing_is_answered(shelf: PeerShelf, port: PeerPort) -> None:
    # Small chunks past one batch's item cap (512) and large ones past its byte cap (2 MiB).
    small, large = chunks(700, size=4096, seed=1), chunks(6, size=MiB + 17, seed=2)
    m, _, _ = loading(shelf, small + large, list(range(706)))
    copy, on_disk = chunks(2, size=3000, seed=3)
    assert shelf.cache is not None and shelf.cache.disk is not None
    shelf.cache.memory.put(content_id(copy), copy)
    shelf.cache.disk.put(content_id(on_disk), on_disk)
    nobody = content_id(b"held by no one")
    ids = [*m.chunks.ids, content_id(copy), content_id(on_disk), nobody]
    want = [*small, *large, copy, on_disk]
    client = BulkPool(TOKEN).client(port.address)
    assert client is not None
    items = []
    sizes = []
    for b in client.fetch_batches(ids):  # a batch's bytes are in a scratch buffer the next one reuses
        sizes.append((len(b.data), sum(len(d) for d in b.data)))
        items += [(b.ids[k], int(b.headers.status[k]), b.headers.codecs[k], int(b.headers.raw_size[k]),
                   int(b.headers.crc32c[k]), bytes(b.data[k])) for k in range(len(b.data))]
    assert len(sizes) >= 4
    assert all(n <= bulk_frames.MAX_BATCH_ITEMS and nbytes <= bulk_frames.SEND_BATCH_BYTES + MiB + 17 for n, nbytes in sizes)
    assert [i[0] for i in items] == ids
    for (cid, status, codec, raw_size, crc, data), expected in zip(items, want):
        assert (status, codec, raw_size, crc) == (bulk_frames.OK, "raw", len(expected), crc32c(expected))
        assert data == expected and content_id(data) == cid
    assert items[-1][1] == bulk_frames.MISSING and "not on this peer" in items[-1][5].decode()
    # counted once a batch is sent: the reader may have it a moment before the count
    deadline = time.monotonic() + 5.0
    while port.served_chunks < len(want) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert port.served_chunks == len(want) and port.served_bytes == sum(map(len, want))
    # the client's transport, as the swarm fetch uses it (peer:ID -> the address it announced)
    transport = ClusterTransport(lambda: {}, token=TOKEN, tls=False, max_message_bytes=64 * MiB)
    transport.peer_addresses["peer:w1"] = port.address
    try:
        got: dict[int, bytes] = {}
        for arrivals in transport.read("peer:w1", ReadIds.of_hex(ids[:3] + [nobody]), None, 10.0):
            for k, pos in enumerate(arrivals.positions.tolist()):
                got[pos] = bytes(arrivals.data[k]) if arrivals.ok[k] else b"!" + arrivals.messages[k].encode()
        assert [got[k] for k in range(3)] == want[:3]
        assert got[3].startswith(b"!MISSING")
        assert transport.stats.bulk_fallbacks == 0
    finally:
        transport.close()


def test_serving_threads_run_below_the_workers_own(shelf: PeerShelf, port: PeerPort) -> None:
    niceness: list[int] = []
    find = shelf.find

    def recording(ids: list[str], deadline: float) -> list[Found | None]:
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return find(ids, deadline)

    shelf.find = recording  # type: ignore[method-assign]
    m = loading(shelf, chunks(1, seed=9), [0], "other")[0]
    client = BulkPool(TOKEN).client(port.address)
    assert client is not None
    assert [i.status for i in client.fetch(list(m.chunks.ids))] == [bulk_frames.OK]
    assert niceness and min(niceness) >= PEER_NICE  # this thread (the worker's own) is untouched:
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < PEER_NICE or os.nice(0) >= PEER_NICE


def test_a_chunk_still_loading_arrives_once_it_lands(shelf: PeerShelf, port: PeerPort) -> None:
    datas = chunks(4, size=50_000, seed=4)
    m, arena, entry = loading(shelf, datas, [0])
    threading.Timer(0.5, arena.land, args=(entry, [2, 3])).start()
    client = BulkPool(TOKEN).client(port.address)
    assert client is not None
    t0 = time.monotonic()
    items = [(i.status, bytes(i.data)) for i in client.fetch([m.chunks.ids[k] for k in (0, 2, 3)])]
    waited = time.monotonic() - t0
    assert items == [(bulk_frames.OK, datas[k]) for k in (0, 2, 3)]
    assert 0.4 < waited < 2.0
    # row 1 never lands: MISSING once the peer's wait (2 s here) is over, not the client's 30 s
    t0 = time.monotonic()
    (item,) = list(client.fetch([m.chunks.ids[1]]))
    assert item.status == bulk_frames.MISSING
    assert 1.8 < time.monotonic() - t0 < 4.0


def worker_certs(tmp_path: Path) -> tuple[CertPaths, CertPaths, CertPaths]:
    """The cluster CA, a worker's certificate (server AND client: it serves peers and reads the cluster)
    for its loopback address, and a reading client's certificate."""
    ca = make_ca(tmp_path)
    worker = issue(tmp_path, ca, "worker1", hosts=["127.0.0.1", "localhost"], server=True, client=True)
    reader = issue(tmp_path, ca, "worker2", hosts=["127.0.0.1"], server=True, client=True)
    return ca, worker, reader


def test_tls_get_chunks_with_mutual_tls(tmp_path: Path, shelf: PeerShelf) -> None:
    ca, mine, theirs = worker_certs(tmp_path)
    datas = chunks(5, size=700_000, seed=5)
    m, arena, entry = loading(shelf, datas, [0, 1, 2])
    nobody = content_id(b"nobody")
    with PeerPort(shelf, PeerPortConfig(peer_wait_s=2.0), TOKEN, tls=(ca.cert, mine.cert, mine.key)) as port:
        def channel(token: str | None, cert: CertPaths | None = theirs) -> grpc.Channel:
            return open_channel(port.address, token=token, max_message_bytes=64 * MiB, tls=True, tls_ca=ca.cert,
                                tls_cert=cert.cert if cert else None, tls_key=cert.key if cert else None)

        threading.Timer(0.4, arena.land, args=(entry, [3])).start()
        ch = channel(TOKEN)
        got: dict[str, bytes] = {}
        errors: dict[str, int] = {}
        messages = 0
        for found, acks in get_chunks_raw(ch, [*m.chunks.ids[:4], nobody], max_message_bytes=MiB, timeout=10.0):
            messages += 1
            for c in found:
                assert c.codec == "raw" and c.raw_size == len(c.data) and c.crc32c == crc32c(c.data)
                got[c.id] = bytes(c.data)
            errors.update({a.id: a.status for a in acks})
        assert got == {m.chunks.ids[k]: datas[k] for k in range(4)}
        assert errors == {nobody: pb.MISSING}
        assert messages >= 4  # about max_message_bytes per message: 700 kB chunks one or two a message
        # the transport the swarm uses, under TLS: GetChunks at the address the peer announced
        transport = ClusterTransport(lambda: {}, token=TOKEN, tls=True, tls_ca=ca.cert, tls_cert=theirs.cert,
                                     tls_key=theirs.key, max_message_bytes=64 * MiB)
        transport.peer_addresses["peer:w1"] = port.address
        arrived = {}
        for arrivals in transport.read("peer:w1", ReadIds.of_hex(list(m.chunks.ids[:2])), None, 10.0):
            arrived.update({p: bytes(d) for p, d, ok in zip(arrivals.positions.tolist(), arrivals.data, arrivals.ok) if ok})
        assert arrived == {0: datas[0], 1: datas[1]}
        # a wrong token: UNAUTHENTICATED with the one-line message
        with pytest.raises(grpc.RpcError) as refused:
            list(get_chunks_raw(channel("wrong"), [m.chunks.ids[0]], max_message_bytes=MiB, timeout=5.0))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "read token" in (refused.value.details() or "") and "\n" not in (refused.value.details() or "")
        # no client certificate: the handshake fails
        with pytest.raises(grpc.RpcError) as no_cert:
            list(get_chunks_raw(channel(TOKEN, None), [m.chunks.ids[0]], max_message_bytes=MiB, timeout=5.0))
        assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
        # any other method of the service: UNIMPLEMENTED
        other = ch.unary_unary(f"/{SERVICE_NAME}/HasChunks", request_serializer=pb.HasChunksRequest.SerializeToString,
                               response_deserializer=pb.HasChunksReply.FromString)
        with pytest.raises(grpc.RpcError) as unimplemented:
            other(pb.HasChunksRequest(ids=[m.chunks.ids[0]]), timeout=5.0)
        assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert port.served_chunks >= 6 and port.refused.get("unauthenticated") == 1
        ch.close()
        assert np.all(np.frombuffer(arena.buf, np.uint8)[: arena.offsets[4]] == np.frombuffer(b"".join(datas[:4]), np.uint8))
