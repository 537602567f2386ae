from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import zstandard

from chunking.hashing import content_id, crc32c
from paramserver.server.errors import (
    ChunkCorruptError,
    ChunkNotFoundError,
    ChunkTransferCorruptError,
    InvalidChunkError,
    UnknownCodecError,
)
from paramserver.server.repair import SCRUB_CHUNK_OVERHEAD_BYTES, RepairQueue, Repairer, Scrubber, TrafficWatch
from paramserver.server.segments import write_in_place
from paramserver.server.store import HEADER_SIZE, ChunkStore, StoredChunk, decode_header
from tests.store_checks import records

KiB = 1024


def raw_chunk(size: int = 64 * KiB, seed: int | None = None) -> tuple[str, bytes, str, int, int]:
    data = random.Random(seed).randbytes(size) if seed is not None else os.urandom(size)
    return content_id(data), data, "raw", len(data), crc32c(data)


def zstd_chunk(raw: bytes, **kw: object) -> tuple[str, bytes, str, int, int]:
    stored = zstandard.ZstdCompressor(**kw).compress(raw)  # type: ignore[arg-type]
    return content_id(raw), stored, "zstd", len(raw), crc32c(stored)


@pytest.fixture
def corrupt_log() -> list[tuple[str, str]]:
    return []


@pytest.fixture
def store(tmp_path: Path, corrupt_log: list[tuple[str, str]]) -> ChunkStore:
    return ChunkStore(tmp_path / "data", cache_bytes=0, on_corrupt=lambda cid, why: corrupt_log.append((cid, why)))


def flip_byte(store: ChunkStore, chunk_id: str, offset: int) -> None:
    """Flip one byte of a chunk's record in its segment, ``offset`` counted from the record's header."""
    loc = store.locate(chunk_id)
    assert loc is not None
    record = loc.read_record()
    write_in_place(loc.path, loc.record_offset + offset, bytes([record[offset] ^ 0x40]))


def test_put_get_round_trip_layout_and_header(store: ChunkStore) -> None:
    cid, data, codec, raw_size, crc = raw_chunk()
    assert store.put(cid, data, codec, raw_size, crc) is True
    loc = store.locate(cid)
    assert loc is not None and loc.path.parent == store.data_dir / "segments" and loc.path.suffix == ".seg"
    record = loc.read_record()
    assert len(record) == HEADER_SIZE + len(data) and loc.offset == loc.record_offset + HEADER_SIZE
    assert decode_header(record[:HEADER_SIZE]) == ("raw", raw_size, len(data), crc) and record[HEADER_SIZE:] == data
    got = store.get(cid)
    assert got == StoredChunk(cid, data, "raw", raw_size, crc)
    assert store.has(cid) and not store.has("f" * 64) and not store.has("nothex")
    assert not (store.data_dir / "chunks").exists()  # the one-file layout is gone


def test_dedup_and_counts(store: ChunkStore) -> None:
    chunks = [raw_chunk(8 * KiB, seed=i) for i in range(10)]
    assert store.put_many(records(chunks)) == [True] * 10
    assert store.put_many(records(chunks[:3])) == [False] * 3
    stats = store.stats()
    assert stats.chunk_count == 10 == len(store)
    assert stats.live_bytes == 10 * (HEADER_SIZE + 8 * KiB) <= stats.bytes_on_disk
    assert stats.bytes_on_disk == sum(p.stat().st_size for p in (store.data_dir / "segments").glob("*.seg"))
    assert sorted(store.iter_ids()) == sorted(c[0] for c in chunks)
    assert store.delete(chunks[0][0]) and not store.delete(chunks[0][0])
    assert store.stats().chunk_count == 9
    with pytest.raises(ChunkNotFoundError, match="not stored on this server"):
        store.get(chunks[0][0])


def test_counts_survive_restart_and_stale_temp_files_are_removed(tmp_path: Path) -> None:
    s1 = ChunkStore(tmp_path, cache_bytes=0)
    cid, *rest = raw_chunk(4 * KiB, seed=1)
    s1.put(cid, *rest)
    # A crash while a segment index was being written leaves its temp file.
    stale = tmp_path / "segments" / "0000000000000001.idx.tmp"
    stale.write_bytes(b"partial")
    s1.close()
    s2 = ChunkStore(tmp_path, cache_bytes=0)
    assert not stale.exists()
    assert s2.stats().chunk_count == 1 and s2.get(cid).data == rest[0]


def test_ingest_rejects_bytes_that_do_not_match_the_id(store: ChunkStore) -> None:
    cid, data, codec, raw_size, _ = raw_chunk()
    other = os.urandom(len(data))
    with pytest.raises(InvalidChunkError, match=cid) as info:
        store.put(cid, other, codec, raw_size, crc32c(other))
    assert "not to its id" in str(info.value)
    assert not store.has(cid) and store.stats().chunk_count == 0


def test_ingest_rejects_crc_mismatch_truncation_and_bad_ids(store: ChunkStore) -> None:
    cid, data, codec, raw_size, crc = raw_chunk()
    with pytest.raises(ChunkTransferCorruptError, match="CRC32C"):
        store.put(cid, data[:-1], codec, raw_size, crc)  # truncated in transit
    with pytest.raises(InvalidChunkError, match="raw_size"):
        store.put(cid, data[:-1], codec, raw_size, crc32c(data[:-1]))
    with pytest.raises(InvalidChunkError, match="not a content id"):
        store.put("../../etc/passwd", data, codec, raw_size, crc)
    with pytest.raises(InvalidChunkError, match="not a content id"):
        store.put(cid.upper(), data, codec, raw_size, crc)
    with pytest.raises(UnknownCodecError, match="unknown codec"):
        store.put(cid, data, "lz77", raw_size, crc)
    assert store.stats().chunk_count == 0


def test_zstd_chunk_verified_and_bomb_refused(store: ChunkStore) -> None:
    raw = bytes(200 * KiB)
    cid, stored, codec, raw_size, crc = zstd_chunk(raw)
    assert store.put(cid, stored, codec, raw_size, crc)
    assert store.verify(cid).codec == "zstd"
    # A frame declaring (and expanding to) far more than raw_size is refused before allocation.
    bomb_raw = bytes(64 << 20)
    bomb = zstandard.ZstdCompressor().compress(bomb_raw)
    with pytest.raises(InvalidChunkError, match="bomb"):
        store.put(content_id(bytes(1024)), bomb, "zstd", 1024, crc32c(bomb))
    # Same without a declared content size: decoding stops at raw_size.
    bomb2 = zstandard.ZstdCompressor(write_content_size=False).compress(bomb_raw)
    with pytest.raises(InvalidChunkError, match="raw_size"):
        store.put(content_id(bytes(1024)), bomb2, "zstd", 1024, crc32c(bomb2))


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_is_detected_quarantined_and_never_returned(
    store: ChunkStore, corrupt_log: list[tuple[str, str]], where: str
) -> None:
    cid, data, *rest = raw_chunk(32 * KiB)
    store.put(cid, data, *rest)
    record = store.locate(cid)
    assert record is not None
    flip_byte(store, cid, HEADER_SIZE + 1000 if where == "data" else 30)
    with pytest.raises(ChunkCorruptError, match=cid) as info:
        store.get(cid)
    assert "quarantined" in str(info.value)
    assert store.locate(cid) is None and len(list(store.quarantine_dir.iterdir())) == 1
    kept = next(store.quarantine_dir.iterdir()).read_bytes()  # the bad record's bytes, set aside
    assert kept == record.read_record()  # the record, corrupt as it was found (the segment still holds it)
    assert [c for c, _ in corrupt_log] == [cid]
    assert store.stats().quarantined == 1 and store.stats().chunk_count == 0
    # Until repaired, the id reads as lost here (DATA_LOSS at the RPC boundary), not as never pushed,
    # also after a restart.
    with pytest.raises(ChunkCorruptError, match="awaiting repair"):
        store.get(cid)
    assert not store.has(cid)
    with pytest.raises(ChunkCorruptError, match="awaiting repair"):
        ChunkStore(store.data_dir, cache_bytes=0).get(cid)  # a read-only view: the writer holds the lock
    # A fresh good copy can be stored again (repair).
    assert store.put(cid, data, *rest) is True
    assert store.get(cid).data == data
    assert ChunkStore(store.data_dir, cache_bytes=0).get(cid).data == data
    store.close()
    reopened = ChunkStore(store.data_dir, cache_bytes=0)  # the tombstone keeps the bad record out
    assert reopened.get(cid).data == data and reopened.stats().chunk_count == 1 and not reopened.read_only


def test_random_flips_never_return_wrong_bytes(tmp_path: Path) -> None:
    rng = random.Random(7)
    store = ChunkStore(tmp_path, cache_bytes=0)
    cid, data, *rest = raw_chunk(4 * KiB, seed=3)
    for _ in range(50):
        store.put(cid, data, *rest)
        flip_byte(store, cid, rng.randrange(HEADER_SIZE + len(data)))
        with pytest.raises(ChunkCorruptError):
            store.get(cid)
    store.close()
    reopened = ChunkStore(tmp_path, cache_bytes=0)
    assert len(reopened) == 0 and cid not in list(reopened.iter_ids())  # every bad copy stays dead


def test_put_over_a_corrupt_copy_replaces_it(store: ChunkStore) -> None:
    cid, data, *rest = raw_chunk(16 * KiB)
    store.put(cid, data, *rest)
    flip_byte(store, cid, HEADER_SIZE + 5)
    assert store.put(cid, data, *rest) is True  # not deduplicated against the bad copy
    assert store.get(cid).data == data


def test_hot_cache_respects_budget_and_serves_hits(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, cache_bytes=256 * KiB)
    chunks = [raw_chunk(32 * KiB, seed=i) for i in range(20)]
    store.put_many(records(chunks))
    for c in chunks:
        store.get(c[0])
    stats = store.cache.stats()
    assert stats.used_bytes <= 256 * KiB and stats.entries == 8 and stats.evictions == 12
    flip_byte(store, chunks[-1][0], HEADER_SIZE + 1)  # a hit does not touch the disk
    assert store.get(chunks[-1][0]).data == chunks[-1][1]
    assert store.cache.stats().hits == 1
    big = raw_chunk(128 * KiB)  # over a quarter of the budget: not cached
    store.put(*big)
    store.get(big[0])
    assert big[0] not in store.cache


def test_scrubber_charges_each_chunk_so_small_chunks_do_not_multiply_its_work(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "a", cache_bytes=0, fsync=False)
    store.put_many(records([raw_chunk(4 * KiB, seed=i) for i in range(64)]))
    scrubber = Scrubber(store, RepairQueue(clock=lambda: 0.0))
    # A 1 MiB budget would cover 256 chunks of 4 KiB by bytes alone; with the per-chunk charge, 15.
    report = scrubber.step(budget_bytes=1 << 20)
    assert report.checked == -(-(1 << 20) // (4 * KiB + SCRUB_CHUNK_OVERHEAD_BYTES))
    assert report.bytes_checked == report.checked * 4 * KiB


def test_scrubber_slows_to_its_busy_fraction_while_the_store_serves_traffic(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "a", cache_bytes=0, fsync=False)
    chunks = [raw_chunk(4 * KiB, seed=i) for i in range(64)]
    store.put_many(records(chunks))
    now = [100.0]
    watch = TrafficWatch(lambda: store.traffic, quiet_s=2.0, clock=lambda: now[0])
    scrubber = Scrubber(store, RepairQueue(clock=lambda: 0.0), traffic=watch, busy_fraction=0.25)
    per_chunk = 4 * KiB + SCRUB_CHUNK_OVERHEAD_BYTES
    budget = 8 * per_chunk
    idle = scrubber.step(budget_bytes=budget)  # nothing served since the watch began: the full rate
    assert not idle.busy and idle.checked == 8
    store.get(chunks[0][0])  # a client read
    busy = scrubber.step(budget_bytes=budget)
    assert busy.busy and busy.checked == 2 and scrubber.busy_steps == 1
    now[0] += 1.5  # still within the quiet time: busy, though nothing new was served
    assert scrubber.step(budget_bytes=budget).checked == 2
    now[0] += 0.6  # 2.1 s after the read: quiet again
    assert scrubber.step(budget_bytes=budget).checked == 8
    before = store.traffic
    scrubber.step(budget_bytes=budget)  # the scrubber's own reads are not traffic
    assert store.traffic == before
    store.put_many(records([raw_chunk(4 * KiB, seed=99)]))  # a write counts too
    assert scrubber.step(budget_bytes=budget).busy
    frozen = Scrubber(store, RepairQueue(clock=lambda: 0.0), traffic=watch, busy_fraction=0.0)
    assert frozen.step(budget_bytes=budget).checked == 0  # fraction 0: nothing while busy
    with pytest.raises(ValueError, match="busy_fraction"):
        Scrubber(store, RepairQueue(), busy_fraction=1.5)


def test_scrubber_finds_untouched_corruption_and_repairer_restores(tmp_path: Path) -> None:
    queue = RepairQueue(clock=lambda: 0.0)
    store = ChunkStore(tmp_path / "a", cache_bytes=0, on_corrupt=queue.add)
    healthy = ChunkStore(tmp_path / "b", cache_bytes=0)
    chunks = [raw_chunk(16 * KiB, seed=i) for i in range(12)]
    store.put_many(records(chunks))
    healthy.put_many(records(chunks))
    victim = chunks[5][0]
    flip_byte(store, victim, HEADER_SIZE + 7)
    scrubber = Scrubber(store, queue)
    budget = 4 * (16 * KiB + SCRUB_CHUNK_OVERHEAD_BYTES)
    first = scrubber.step(budget_bytes=budget)
    assert 4 <= first.checked <= 5 and first.bytes_checked >= 3 * 16 * KiB and not first.finished_pass  # a corrupt one checks no bytes
    total_corrupt = list(first.corrupt)
    while True:
        report = scrubber.step(budget_bytes=budget)
        total_corrupt += report.corrupt
        if report.finished_pass:
            break
    assert total_corrupt == [victim] and victim in queue
    # what /metrics exports (paramserver_scrub_*_total)
    assert scrubber.corrupt_total == 1 and scrubber.checked_total == 12 and scrubber.passes == 1
    assert scrubber.bytes_total >= 11 * 16 * KiB
    missing = [chunks[0][0]]
    store.delete(missing[0])
    queue.add(missing[0], "under-replicated")

    def fetch(cid: str) -> StoredChunk | None:
        return healthy.get(cid) if healthy.has(cid) else None

    result = Repairer(store, queue, fetch).step()
    assert sorted(result.repaired) == sorted([victim, missing[0]]) and len(queue) == 0
    assert store.verify(victim).data == chunks[5][1]


def test_repair_backs_off_when_no_replica_has_it(tmp_path: Path) -> None:
    now = [0.0]
    queue = RepairQueue(clock=lambda: now[0])
    store = ChunkStore(tmp_path, cache_bytes=0)
    queue.add("a" * 64, "lost")
    assert Repairer(store, queue, lambda cid: None).step().failed == ["a" * 64]
    assert queue.due() == []
    now[0] = 100.0
    assert [i.chunk_id for i in queue.due()] == ["a" * 64]


def test_chunking_codecs_are_verified_on_ingest(store: ChunkStore) -> None:
    np = pytest.importorskip("numpy")
    from chunking.codec import encode_chunk
    from chunking.config import ChunkingConfig

    raw = np.random.default_rng(0).standard_normal(16 * KiB).astype(np.float32).tobytes()
    for elem in (1, 4):
        codec, stored = encode_chunk(raw, ChunkingConfig(codec="on"), elem_size=elem)
        stored = bytes(stored)
        assert codec == ("zstd+shuffle4" if elem == 4 else "zstd")
        cid = content_id(raw)
        store.delete(cid)
        assert store.put(cid, stored, codec, len(raw), crc32c(stored))
        assert store.verify(cid).codec == codec
    with pytest.raises(InvalidChunkError, match="not to its id"):
        other = bytes(len(raw))
        codec, stored = encode_chunk(other, ChunkingConfig(codec="on"), elem_size=4)
        store.put(content_id(raw), bytes(stored), codec, len(raw), crc32c(bytes(stored)))


def test_periodic_runs_survives_errors_and_stops() -> None:
    import threading

    from paramserver.server.background import Periodic

    calls: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def step() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        if len(calls) >= 4:
            done.set()

    task = Periodic("t", 0.01, step, on_error=errors.append).start()
    assert done.wait(5)
    task.stop()
    n = len(calls)
    assert n >= 4 and len(errors) == 1 and "boom" in str(errors[0])
    assert len(calls) == n  # no run after stop


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_claimed_old_orphan_survives_collection_and_an_unclaimed_one_does_not(tmp_path: Path) -> None:
    # An orphan of a failed push, hours old, that a new push finds by dedup (HasChunks claims it)
    # must not be collected before that push commits; an untouched one is.
    from paramserver.server.gc import OrphanCollector

    clock = Clock()
    store = ChunkStore(tmp_path, cache_bytes=0, clock=clock)
    reused, forgotten = raw_chunk(seed=11), raw_chunk(seed=12)
    for c in (reused, forgotten):
        store.put(*c)
    assert store.claimed_at(reused[0]) == clock.now and store.claimed_at("ab" * 32) is None
    clock.now += 7200
    assert store.claim([reused[0], "ab" * 32, "not-an-id"]) == [True, False, False]
    unsynced = OrphanCollector(lambda: set(), store, grace_s=3600, clock=clock, in_sync=lambda: False).step()
    assert unsynced.deleted == 0 and unsynced.skipped_reason and store.has(forgotten[0])  # no leader: nothing is known
    report = OrphanCollector(lambda: set(), store, grace_s=3600, clock=clock).step()
    assert report.deleted == 1
    assert store.has(reused[0]) and not store.has(forgotten[0])
    # sending an already stored chunk again claims it too
    clock.now += 7200
    assert store.put(*reused) is False
    assert not store.delete_if_unclaimed(reused[0], clock.now - 3600)
    assert store.delete_if_unclaimed(reused[0], clock.now + 1)
    assert not store.has(reused[0])
    # Deletes survive a restart; after one, every chunk counts as claimed at the restart (safe).
    kept = raw_chunk(seed=13)
    store.put(*kept)
    store.close()
    clock.now += 7200
    reopened = ChunkStore(tmp_path, cache_bytes=0, clock=clock)
    assert not reopened.has(reused[0]) and not reopened.has(forgotten[0]) and reopened.has(kept[0])
    assert reopened.claimed_at(kept[0]) == clock.now
    assert OrphanCollector(lambda: set(), reopened, grace_s=3600, clock=clock).step().deleted == 0
    clock.now += 3601
    assert OrphanCollector(lambda: set(), reopened, grace_s=3600, clock=clock).step().deleted == 1


def test_generation_changes_when_the_set_of_chunks_does(store: ChunkStore) -> None:
    c = raw_chunk(seed=21)
    g0, l0 = store.generation, store.loss_generation
    store.put(*c)
    g1 = store.generation
    assert g1 != g0 and store.loss_generation == l0  # an arrival is no loss
    store.put(*c)  # already there
    store.get(c[0])
    store.claim([c[0]])
    assert store.generation == g1
    store.delete(c[0])
    assert store.generation != g1 and store.loss_generation != l0


def test_anti_entropy_gate_skips_only_after_a_clean_pass_of_the_same_state() -> None:
    from paramserver.server.replication import PassGate

    gate = PassGate(full_pass_every=3)
    assert gate.due("s1")  # never ran
    gate.record("s1", clean=False)  # a peer was unreachable or missing chunks
    assert gate.due("s1")
    gate.record("s1", clean=True)
    assert not gate.due("s1") and not gate.due("s1")
    assert gate.due("s1")  # the third step: a full pass anyway
    gate.record("s1", clean=True)
    assert not gate.due("s1")
    assert gate.due("s2")  # members, R, the store or the committed set changed
    with pytest.raises(ValueError):
        PassGate(0)


def test_resending_a_stored_orphan_claims_it_before_trusting_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Orphan collection running between "an intact copy is here" and "answer ALREADY_PRESENT"
    # must not delete the copy the push is about to count.
    from paramserver.server.gc import OrphanCollector

    clock = Clock()
    store = ChunkStore(tmp_path, cache_bytes=0, clock=clock)
    c = raw_chunk(seed=31)
    store.put(*c)
    clock.now += 7200
    collector = OrphanCollector(lambda: set(), store, grace_s=3600, clock=clock)
    check = store._intact_copy_exists

    def collect_then_check(chunk_id: str) -> bool:
        collector.step()
        return check(chunk_id)

    monkeypatch.setattr(store, "_intact_copy_exists", collect_then_check)
    assert store.put(*c) is False  # already here, and still here
    assert store.has(c[0])


def test_held_answers_presence_crc_and_raw_in_one_pass_and_claims(tmp_path: Path) -> None:
    now = [100.0]
    store = ChunkStore(tmp_path / "a", cache_bytes=0, fsync=False, clock=lambda: now[0])
    raw = raw_chunk(8 * KiB, seed=1)
    packed = zstd_chunk(bytes(8 * KiB))
    store.put_many(records([raw, packed]))
    absent = raw_chunk(8 * KiB, seed=2)[0]
    now[0] = 200.0
    present, crc, is_raw = store.held([raw[0], absent, packed[0]], claim=True)
    assert present.tolist() == [True, False, True]
    assert crc.tolist() == [raw[4], 0, packed[4]] and is_raw.tolist() == [True, False, False]
    assert store.claimed_at(raw[0]) == 200.0 and store.claimed_at(packed[0]) == 200.0
    now[0] = 300.0
    store.held([raw[0]], claim=False)
    assert store.claimed_at(raw[0]) == 200.0


def test_index_entries_are_not_walked_by_the_garbage_collector(tmp_path: Path) -> None:
    import gc

    store = ChunkStore(tmp_path / "a", cache_bytes=0, fsync=False)
    chunks = [raw_chunk(4 * KiB, seed=i) for i in range(50)]
    store.put_many(records(chunks))
    assert not any(gc.is_tracked(store._index[c[0]]) for c in chunks)  # written
    store.close()
    again = ChunkStore(tmp_path / "a", cache_bytes=0, fsync=False)
    assert not any(gc.is_tracked(again._index[c[0]]) for c in chunks)  # loaded at start
    assert all(again.get(c[0]).data == c[1] for c in chunks)
    again.close()
