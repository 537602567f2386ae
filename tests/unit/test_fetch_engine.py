"""The fetch planner and engine without sockets: failover, corruption, slowness, verification cost."""
from __future__ import annotations

import torch
import pytest

import chunking.codec
import paramserver.client.verify as verify_mod
from chunking.config import ChunkingConfig
from chunking.pack import pack
from chunking.synthetic import synthetic_state_dict
from paramserver.client.errors import ChunkDataLoss, ChunkUnavailable
from paramserver.client.fetch import FetchEngine
from chunking.chunk_table import ChunkRows
from paramserver.client.fetch_plan import FetchPlanner, GiveUp, Landed, Read, ReadFailed, Refused, ReportCorrupt, Want, Wants
from paramserver.client.hostmem import allocate_targets
from paramserver.client.sinks import TensorSink
from paramserver.client.transport import MemoryTransport
from paramserver.client.verify import Verifier

SERVERS = ["ps1", "ps2", "ps3"]


def model(codec: str = "off"):  # type: ignore[no-untyped-def]
    state = synthetic_state_dict(3 << 20, tensor_bytes=512 << 10, seed=7)
    state["odd"] = torch.arange(1001, dtype=torch.int16)
    state["scalar"] = torch.tensor(1.5, dtype=torch.bfloat16)
    state["empty"] = torch.empty(0, 3)
    return state, pack(state, model="m", config=ChunkingConfig(codec=codec))


def held(packed):  # type: ignore[no-untyped-def]
    stored = packed.source()
    refs = {r.id: r for r in packed.manifest.unique_chunks()}
    return {cid: (refs[cid].codec, refs[cid].crc32c, stored[cid]) for cid in refs}


def ring(cid: str) -> list[str]:
    start = int(cid[:2], 16) % 3
    return [SERVERS[(start + i) % 3] for i in range(3)]


def placed(chunks: ChunkRows) -> Wants:
    """The fetch's wants, each chunk on ``ring``."""
    return Wants.of([Want(r.id, r.stored_size, tuple(ring(r.id))) for r in chunks.refs()])


def fetch(packed, transport, mode: str = "crc"):  # type: ignore[no-untyped-def]
    targets = allocate_targets(packed.manifest).tensors
    sink = TensorSink(packed.manifest, targets)
    reports: list[tuple[str, tuple[str, ...]]] = []
    engine = FetchEngine(transport, Verifier(mode), report=lambda s, ids, _r: reports.append((s, ids)))
    chunks = ChunkRows.of(packed.manifest.chunks)
    stats = engine.fetch(chunks, placed(chunks), SERVERS, sink, tensors_of=packed.manifest.tensors_of_chunk)
    sink.assembler.raise_if_incomplete()
    return targets, stats, reports


def same(got, want) -> None:  # type: ignore[no-untyped-def]
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


# ------------------------------------------------------------------ the pure planner


def wants(n: int = 6) -> list[Want]:
    return [Want(f"c{i}", 100, tuple(SERVERS[(i + k) % 3] for k in range(3))) for i in range(n)]


def test_planner_spreads_chunks_and_finishes_when_all_land() -> None:
    p = FetchPlanner(wants(), SERVERS)
    reads = [d for d in p.start() if isinstance(d, Read)]
    assert sorted({r.server for r in reads}) == SERVERS
    assert sorted(s for r in reads for s in r.slots.tolist()) == list(range(6))  # each chunk asked once
    for r in reads:
        for slot in r.slots.tolist():
            assert p.step(Landed(r.read, (slot,))) == []
    assert p.done and p.landed_all


def test_planner_runs_of_neighbours_stay_on_one_replica_and_the_load_balances() -> None:
    # 3,000 chunks of 1 KiB, each on all three servers with a rotating primary: the plan asks each
    # server for long runs of neighbours (one pread on the server), and for about a third of the bytes.
    many = [Want(f"c{i}", 1024, tuple(SERVERS[(i + k) % 3] for k in range(3))) for i in range(3000)]
    reads = [d for d in FetchPlanner(many, SERVERS).start() if isinstance(d, Read)]
    per_server = {s: sum(r.nbytes for r in reads if r.server == s) for s in SERVERS}
    assert max(per_server.values()) - min(per_server.values()) <= 3 * 2 * 64 * 1024  # within a few blocks
    assert sorted(s for r in reads for s in r.slots.tolist()) == list(range(3000))
    owner = {s: r.server for r in reads for s in r.slots.tolist()}
    switches = sum(1 for i in range(1, 3000) if owner[i] != owner[i - 1])
    assert switches < 3000 // 32  # runs, not a chunk at a time


def test_planner_a_block_goes_only_where_all_its_chunks_live() -> None:
    # Five servers, each chunk on three of them: every chunk is read from one of its own replicas.
    five = [f"ps{i}" for i in range(1, 6)]
    many = [Want(f"c{i}", 100 + i % 7, tuple(five[(i * 7 + k) % 5] for k in range(3))) for i in range(500)]
    reads = [d for d in FetchPlanner(many, five).start() if isinstance(d, Read)]
    for r in reads:
        for slot in r.slots.tolist():
            assert r.server in many[slot].replicas


def test_planner_replica_dying_mid_stream_moves_the_rest_once() -> None:
    p = FetchPlanner(wants(9), SERVERS)
    reads = {r.server: r for r in p.start() if isinstance(r, Read)}
    dying = reads["ps1"]
    p.step(Landed(dying.read, dying.slots[:1]))
    again = [d for d in p.step(ReadFailed(dying.read, "connection reset")) if isinstance(d, Read)]
    moved = [slot for r in again for slot in r.slots.tolist()]
    assert sorted(moved) == sorted(dying.slots[1:].tolist())  # the landed one is not asked again
    assert all(r.server != "ps1" for r in again) and "ps1" in p.down()
    assert p.step(Landed(dying.read, dying.slots[1:2])) == []  # a late event from the dead read is ignored
    for r in [*again, *(reads[s] for s in ("ps2", "ps3"))]:
        for slot in r.slots.tolist():
            p.step(Landed(r.read, (slot,)))
    assert p.done and p.landed_all


def test_planner_corrupt_copy_is_reported_and_read_elsewhere_then_data_loss() -> None:
    p = FetchPlanner([Want("x", 10, ("ps1", "ps2"))], SERVERS)
    (r1,) = p.start()
    assert isinstance(r1, Read) and r1.server == "ps1"
    out = p.step(Refused(r1.read, 0, "crc mismatch", corrupt=True, report=True))
    assert ReportCorrupt("ps1", (0,), "crc mismatch") in out
    (r2,) = [d for d in out if isinstance(d, Read)]
    assert r2.server == "ps2"
    (r3,) = [d for d in p.step(Refused(r2.read, 0, "CORRUPT", corrupt=True)) if isinstance(d, Read)]
    assert r3.server == "ps3"  # every ring replica failed: any other member may hold a copy
    (give_up,) = p.step(Refused(r3.read, 0, "CORRUPT", corrupt=True))
    assert isinstance(give_up, GiveUp) and give_up.slot == 0 and give_up.data_loss
    assert set(give_up.attempts) == set(SERVERS) and p.done and not p.landed_all


def test_planner_slow_replica_is_left_for_the_rest_of_the_fetch() -> None:
    p = FetchPlanner(wants(6), SERVERS, max_read_bytes=100)  # one chunk per read
    reads = [d for d in p.start() if isinstance(d, Read)]
    slow = [r for r in reads if r.server == "ps2"]
    again = [d for d in p.step(ReadFailed(slow[0].read, "DEADLINE_EXCEEDED")) if isinstance(d, Read)]
    assert again and all(r.server != "ps2" for r in again)


# ------------------------------------------------------------------ the engine over memory


def test_engine_bit_exact_and_received_in_place() -> None:
    state, packed = model()
    chunks = held(packed)
    targets, stats, reports = fetch(packed, MemoryTransport({s: chunks for s in SERVERS}))
    same(targets, state)
    assert stats.chunks == len(chunks) and stats.in_place > 0 and not reports


@pytest.mark.parametrize("codec", ["off", "on"])
def test_engine_survives_dead_dying_corrupt_and_slow_replicas(codec: str) -> None:
    state, packed = model(codec)
    chunks = held(packed)
    ids = sorted(chunks)
    transport = MemoryTransport({s: dict(chunks) for s in SERVERS}, dead={"ps3"}, die_after={"ps1": 2},
                                corrupt={"ps2": set(ids[::2])})
    targets, stats, reports = fetch(packed, transport)
    same(targets, state)
    # Every chunk landed exactly once, and never from a copy that was bad.
    assert stats.chunks == len(chunks)
    assert all(server == "ps2" for server, _ in reports)
    assert stats.failovers > 0


def test_engine_slow_replica_is_abandoned() -> None:
    state, packed = model()
    chunks = held(packed)
    transport = MemoryTransport({s: chunks for s in SERVERS}, slow={"ps1"})
    targets, stats, _ = fetch(packed, transport)
    same(targets, state)
    assert sum(1 for server, _ in transport.calls if server == "ps1") >= 1
    assert "ps1" not in stats.by_server


def test_engine_names_the_chunk_when_no_good_copy_exists() -> None:
    _, packed = model()
    chunks = held(packed)
    victim = packed.manifest.chunks[2].id
    transport = MemoryTransport({s: chunks for s in SERVERS}, corrupt={s: {victim} for s in SERVERS})
    with pytest.raises(ChunkDataLoss, match=victim) as err:
        fetch(packed, transport)
    assert err.value.tensors
    missing = {s: {k: v for k, v in chunks.items() if k != victim} for s in SERVERS}
    with pytest.raises(ChunkUnavailable, match=victim):
        fetch(packed, MemoryTransport(missing))


# ------------------------------------------------------------------ hashes the verify mode needs


class Counter:
    def __init__(self, real):  # type: ignore[no-untyped-def]
        self.real = real
        self.calls = 0

    def __call__(self, *a, **kw):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.real(*a, **kw)


@pytest.mark.parametrize("codec", ["off", "on"])
def test_crc_mode_hashes_nothing_and_content_mode_hashes_each_chunk_once(codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    state, packed = model(codec)
    chunks = held(packed)
    counts = {}
    for mode in ("crc", "content"):
        c1, c2 = Counter(chunking.codec.content_id), Counter(verify_mod.content_id)
        monkeypatch.setattr(chunking.codec, "content_id", c1)
        monkeypatch.setattr(verify_mod, "content_id", c2)
        targets, stats, _ = fetch(packed, MemoryTransport({s: chunks for s in SERVERS}), mode)
        same(targets, state)
        counts[mode] = c1.calls + c2.calls
    assert counts["crc"] == 0
    assert counts["content"] == len(chunks)


# ------------------------------------------------------------------ batches and the collector


def test_batches_of_every_size_land_each_chunk_once_bit_exact() -> None:
    state, packed = model()
    for batch in (1, 2, 64):
        transport = MemoryTransport({s: held(packed) for s in SERVERS}, batch=batch)
        got, stats, _ = fetch(packed, transport)
        same(got, state)
        assert stats.chunks == len(packed.manifest.chunks.first_rows)


def test_a_fetch_pauses_the_collector_and_restores_it() -> None:
    import gc
    import threading

    from chunking.chunk_table import collector_paused
    from paramserver.client.fetch import EngineOptions

    _state, packed = model()
    seen: list[bool] = []

    class Watching(TensorSink):
        def write(self, row, raw, source="network"):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            super().write(row, raw)

        def regions(self, rows):  # type: ignore[no-untyped-def]
            return None  # every chunk through write()

    assert gc.isenabled()
    for pause in (True, False):
        seen.clear()
        engine = FetchEngine(MemoryTransport({s: held(packed) for s in SERVERS}), Verifier("crc"),
                             options=EngineOptions(pause_collector=pause))
        sink = Watching(packed.manifest, allocate_targets(packed.manifest).tensors)
        chunks = ChunkRows.of(packed.manifest.chunks)
        engine.fetch(chunks, placed(chunks), SERVERS, sink)
        assert seen and set(seen) == {not pause}
        assert gc.isenabled()
    # Nested from several threads: back on only when the last one leaves; a fetch that fails too.
    inside = threading.Barrier(3)
    leave = threading.Event()

    def hold() -> None:
        with collector_paused():
            inside.wait()
            leave.wait()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert not gc.isenabled()
    leave.set()
    for t in threads:
        t.join()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_wants_on_the_ring_are_each_chunks_replicas_and_hot_holders() -> None:
    from paramserver.client.fetch_plan import wants_on_ring
    from paramserver.wire.ring import Ring

    _, packed = model()
    chunks = ChunkRows.of(packed.manifest.chunks)
    ids = [r.id for r in chunks.refs()]
    ring = Ring(["ps1", "ps2", "ps3", "ps4"])
    hot = {ids[3]: ("ps4",), "ab" * 32: ("ps2",)}  # one of this fetch's chunks, and one that is not
    w = wants_on_ring(chunks, ring, 2, hot)
    assert [list(w.replica_sets[k]) for k in w.set_of.tolist()] == [ring.replicas(cid, 2) for cid in ids]
    assert w.sizes.tolist() == [r.stored_size for r in chunks.refs()]
    assert dict(w.extras) == {3: ("ps4",)}
