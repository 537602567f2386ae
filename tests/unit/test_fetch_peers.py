"""Worker peers in the fetch planner and engine (no sockets): a chunk goes to its first-choice peer,
and to the servers whenever that peer cannot give it -- refused, broken, dead, or bad bytes, which
are caught by content id even when the peer forges the CRC, and never reach a tensor."""
from __future__ import annotations

import numpy as np

from chunking.chunk_table import ChunkRows
from chunking.hashing import crc32c
from paramserver.client.fetch import FetchEngine
from paramserver.client.fetch_plan import FetchPlanner, Read, ReadFailed, Refused, Want, Wants
from paramserver.client.hostmem import allocate_targets
from paramserver.client.sinks import TensorSink
from paramserver.client.transport import MemoryTransport
from paramserver.client.verify import Verifier

from tests.unit.test_fetch_engine import SERVERS, held, model, placed, same

PEERS = ("peer:a", "peer:b")


def peer_wants(n: int, peer_of: list[int]) -> Wants:
    base = Wants.of([Want(f"c{i}", 100, tuple(SERVERS[(i + k) % 3] for k in range(3))) for i in range(n)])
    return Wants(base.sizes, base.replica_sets, base.set_of, base.extras, base.keys, PEERS, np.array(peer_of))


def test_planner_asks_each_chunks_peer_first_and_the_servers_after_it_fails() -> None:
    p = FetchPlanner(peer_wants(6, [0, 0, 1, 1, -1, -1]), SERVERS)
    reads = {r.server: r for r in p.start() if isinstance(r, Read)}
    assert sorted(reads["peer:a"].slots.tolist()) == [0, 1] and sorted(reads["peer:b"].slots.tolist()) == [2, 3]
    assert not any(s in (0, 1, 2, 3) for srv in SERVERS if srv in reads for s in reads[srv].slots.tolist())
    # peer a refuses chunk 0 (it does not have it): chunk 0 goes to a server, never to peer b
    again = p.step(Refused(reads["peer:a"].read, 0, "MISSING"))
    assert [r.server for r in again if isinstance(r, Read)] in ([s] for s in SERVERS)
    # peer b dies: both its chunks go to the servers
    after = p.step(ReadFailed(reads["peer:b"].read, "connection reset"))
    assert {r.server for r in after if isinstance(r, Read)} <= set(SERVERS)
    assert sorted(s for r in after if isinstance(r, Read) for s in r.slots.tolist()) == [2, 3]
    assert "peer:b" in p.down()


def test_a_peer_is_never_a_last_resort() -> None:
    p = FetchPlanner(peer_wants(1, [0]), SERVERS)
    (read,) = [r for r in p.start() if isinstance(r, Read)]
    asked = [read.server]
    while True:
        reads = [r for r in p.step(Refused(read.read, 0, "MISSING")) if isinstance(r, Read)]
        if not reads:
            break
        (read,) = reads
        asked.append(read.server)
    assert asked[0] == "peer:a" and sorted(asked[1:]) == sorted(SERVERS)  # each server once, the peer never again
    assert p.given_up and set(p.given_up[0].attempts) == {"peer:a", *SERVERS}


def run(transport: MemoryTransport, peer_of: str, mode: str = "crc"):  # type: ignore[no-untyped-def]
    state, packed = model()
    targets = allocate_targets(packed.manifest).tensors
    sink = TensorSink(packed.manifest, targets)
    bad: list[str] = []
    engine = FetchEngine(transport, Verifier(mode), report=lambda *_a: None,
                         peer_report=lambda peer, _ids, _r: bad.append(peer))
    chunks = ChunkRows.of(packed.manifest.chunks)
    base = placed(chunks)
    first = np.full(len(chunks), -1 if peer_of == "none" else 0, dtype=np.int64)
    stats = engine.fetch(chunks, Wants(base.sizes, base.replica_sets, base.set_of, base.extras, base.keys,
                                       ("peer:a",), first), SERVERS, sink)
    sink.assembler.raise_if_incomplete()
    return state, targets, stats, bad


def store(packed_chunks: dict, servers: list[str], peer: dict | None = None) -> dict:  # type: ignore[type-arg]
    chunks = {s: dict(packed_chunks) for s in servers}
    if peer is not None:
        chunks["peer:a"] = peer
    return chunks


def test_engine_reads_from_the_peer_and_counts_it() -> None:
    state, packed = model()
    chunks = held(packed)
    state, targets, stats, bad = run(MemoryTransport(store(chunks, SERVERS, chunks)), "a")
    same(targets, state)
    assert stats.peer_bytes == stats.stored_bytes and stats.by_server == {"peer:a": stats.stored_bytes}
    assert bad == []


def test_forged_peer_bytes_never_land_and_the_peer_is_reported() -> None:
    state, packed = model()
    chunks = held(packed)
    # The peer flips a byte in every chunk AND sends the CRC of its flipped bytes: only the content id catches it.
    forged = {}
    for cid, (_codec, _crc, data) in chunks.items():
        bad_bytes = bytes([data[0] ^ 0xFF]) + data[1:] if data else data
        forged[cid] = ("raw", crc32c(bad_bytes), bad_bytes)
    state, targets, stats, bad = run(MemoryTransport(store(chunks, SERVERS, forged)), "a")
    same(targets, state)  # bit-exact: every chunk came again from the servers
    assert stats.peer_bytes == 0 and set(bad) == {"peer:a"}


def test_dead_peer_costs_nothing_but_a_failover() -> None:
    state, packed = model()
    chunks = held(packed)
    transport = MemoryTransport(store(chunks, SERVERS, chunks), dead={"peer:a"})
    state, targets, stats, bad = run(transport, "a")
    same(targets, state)
    assert stats.peer_bytes == 0 and stats.failovers > 0
