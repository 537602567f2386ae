"""The segment-file chunk store (issue 12): record formats, group commit, index on open, torn tails,
tombstones, failures while appending, the read-only view and the compatibility helpers."""
from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
from pathlib import Path

import pytest

from chunking.hashing import content_id, crc32c
from paramserver.server.errors import ChunkCorruptError, ChunkNotFoundError, ConfigError, InvalidChunkError, StoreFullError
from paramserver.server.records import (
    HEADER_SIZE,
    SEG_HEADER_SIZE,
    TOMB_SIZE,
    PutRecord,
    TombRecord,
    encode_header,
    encode_index,
    encode_segment_header,
    encode_tombstone,
    parse_header,
    parse_index,
    parse_segment_header,
    parse_tombstone,
)
from paramserver.server.segments import chunks_on_disk, list_segments, locate_on_disk, read_view, write_in_place
from paramserver.server.store import ChunkStore, StoreConfig
from tests.store_checks import records

KiB, MiB = 1 << 10, 1 << 20


def raw_chunk(size: int = 16 * KiB, seed: int | None = None) -> tuple[str, bytes, str, int, int]:
    data = random.Random(seed).randbytes(size) if seed is not None else os.urandom(size)
    return content_id(data), data, "raw", len(data), crc32c(data)


def small(tmp_path: Path, **kw: object) -> ChunkStore:
    config = StoreConfig(segment_bytes=int(kw.pop("segment_bytes", 128 * KiB)))  # type: ignore[call-overload]
    return ChunkStore(tmp_path, cache_bytes=0, config=config, **kw)  # type: ignore[arg-type]


def segment_files(store: ChunkStore) -> list[Path]:
    return sorted(store.segments_dir.glob("*.seg"))


# ------------------------------------------------------------------ formats


def test_record_formats_round_trip_and_reject_damage() -> None:
    cid = "ab" * 32
    t = encode_tombstone(7, 4096, cid)
    assert len(t) == TOMB_SIZE == 64 and parse_tombstone(t).target_seg == 7 and parse_tombstone(t).chunk_id == cid
    with pytest.raises(ValueError, match="checksum"):
        parse_tombstone(t[:20] + bytes([t[20] ^ 1]) + t[21:])
    h = encode_segment_header(12, 99)
    assert len(h) == SEG_HEADER_SIZE and parse_segment_header(h) == (12, 99)
    with pytest.raises(ValueError):
        parse_segment_header(h[:8] + b"\x0d" + h[9:])
    puts = [PutRecord(32, cid, "zstd", 1000, 500, 0xDEADBEEF)]
    tombs = [TombRecord(612, 3, 32, "cd" * 32)]
    blob = encode_index(5, 676, puts, tombs)
    assert parse_index(blob, 5) == (676, puts, tombs)
    with pytest.raises(ValueError, match="segment 5, not 6"):
        parse_index(blob, 6)
    with pytest.raises(ValueError, match="checksum"):
        parse_index(blob[:-5] + b"\x00" + blob[-4:], 5)


def test_records_lie_back_to_back_and_a_chunk_record_is_an_old_chunk_file(tmp_path: Path) -> None:
    store = small(tmp_path)
    chunks = [raw_chunk(1000 + i, seed=i) for i in range(5)]
    store.put_many(records(chunks))
    [seg] = segment_files(store)
    blob = seg.read_bytes()
    assert parse_segment_header(blob[:SEG_HEADER_SIZE])[0] == 1
    pos = SEG_HEADER_SIZE
    for cid, data, *_ in chunks:
        h = parse_header(blob[pos:pos + HEADER_SIZE])
        assert h.chunk_id == cid and blob[pos + HEADER_SIZE:pos + HEADER_SIZE + h.stored_size] == data
        loc = store.locate(cid)
        assert loc is not None and (loc.record_offset, loc.length) == (pos, len(data))
        pos += HEADER_SIZE + h.stored_size
    assert pos == len(blob)


# ------------------------------------------------------------------ group commit


def test_concurrent_batches_share_fsyncs_and_return_only_once_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0)
    synced: list[int] = []  # the file size each fdatasync covered
    real = os.fdatasync

    def slow_sync(fd: int) -> None:
        size = os.fstat(fd).st_size
        time.sleep(0.02)
        real(fd)
        synced.append(size)

    monkeypatch.setattr(os, "fdatasync", slow_sync)
    errors: list[BaseException] = []
    acked: list[tuple[str, int]] = []
    lock = threading.Lock()

    def writer(k: int) -> None:
        try:
            for b in range(4):
                batch = [raw_chunk(8 * KiB, seed=1000 * k + 10 * b + i) for i in range(4)]
                assert store.put_many(records(batch)) == [True] * 4
                for cid, *_ in batch:
                    loc = store.locate(cid)
                    assert loc is not None
                    end = loc.offset + loc.length
                    # acknowledged only after an fsync that covered its record
                    assert any(s >= end for s in synced), "acknowledged before it was durable"
                    with lock:
                        acked.append((cid, end))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(acked) == 8 * 4 * 4
    assert len(synced) < 8 * 4, f"{len(synced)} fsyncs for 32 batches: no group commit"


def test_without_fsync_nothing_is_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append(fd))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd))
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False, config=StoreConfig(segment_bytes=64 * KiB))
    chunks = [raw_chunk(20 * KiB, seed=i) for i in range(10)]
    store.put_many(records(chunks))
    assert store.delete(chunks[0][0])
    assert calls == [] and len(segment_files(store)) > 2
    assert all(store.get(c[0]).data == c[1] for c in chunks[1:])


def test_a_chunk_is_visible_only_once_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0)
    c = raw_chunk(seed=5)
    seen: list[tuple[bool, list[bool]]] = []
    real = os.fdatasync

    def sync(fd: int) -> None:
        seen.append((store.has(c[0]), store.claim([c[0]])))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", sync)
    assert store.put(*c) is True
    assert seen == [(False, [False])]  # a push deduplicating against it would not trust a non-durable copy
    assert store.has(c[0])


def test_the_same_chunk_put_concurrently_is_written_once(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False)
    c = raw_chunk(64 * KiB, seed=8)
    results: list[bool] = []
    barrier = threading.Barrier(6)

    def put() -> None:
        barrier.wait()
        results.append(store.put(*c))

    threads = [threading.Thread(target=put) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [False] * 5 + [True]
    assert len(chunks_on_disk(tmp_path)) == 1 and store.stats().live_bytes == HEADER_SIZE + len(c[1])
    assert store.put_many(records([c, c])) == [False, False]


# ------------------------------------------------------------------ segments, indexes, reopen


def test_segments_roll_over_are_sealed_with_an_index_and_reopen_from_it(tmp_path: Path) -> None:
    store = small(tmp_path)
    chunks = [raw_chunk(30 * KiB, seed=i) for i in range(20)]
    for i in range(0, 20, 5):
        store.put_many(records(chunks[i:i + 5]))
    segs = segment_files(store)
    assert len(segs) >= 5 and all(p.stat().st_size <= 128 * KiB for p in segs)
    idx = sorted(store.segments_dir.glob("*.idx"))
    assert [p.stem for p in idx] == [p.stem for p in segs[:-1]]  # every sealed one has its index; the active none
    store.close()
    reopened = small(tmp_path)
    assert len(reopened) == 20 and all(reopened.get(c[0]).data == c[1] for c in chunks)
    # the active segment goes on taking appends after a reopen
    more = raw_chunk(1 * KiB, seed=99)
    reopened.put(*more)
    assert len(segment_files(reopened)) == len(segs)


def test_a_damaged_index_falls_back_to_a_scan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = small(tmp_path)
    chunks = [raw_chunk(30 * KiB, seed=i) for i in range(10)]
    store.put_many(records(chunks))
    store.close()
    idx = sorted(tmp_path.glob("segments/*.idx"))
    idx[0].write_bytes(idx[0].read_bytes()[:-1] + b"\x00")  # its CRC no longer matches
    idx[1].unlink()
    with caplog.at_level(logging.WARNING, logger="paramserver.server.store"):
        reopened = small(tmp_path)
    assert len(reopened) == 10 and all(reopened.verify(c[0]).data == c[1] for c in chunks)
    # The damaged one is said (a missing one is an unsealed segment's normal state).
    damaged = [r.getMessage() for r in caplog.records if "is damaged or does not fit" in r.getMessage()]
    assert len(damaged) == 1 and str(idx[0]) in damaged[0], damaged


def test_an_index_entry_whose_record_header_was_damaged_is_quarantined_by_its_id(tmp_path: Path,
                                                                                 caplog: pytest.LogCaptureFixture) -> None:
    lost: list[str] = []
    store = small(tmp_path)
    chunks = [raw_chunk(30 * KiB, seed=i) for i in range(10)]
    store.put_many(records(chunks))
    victim = chunks[1][0]
    loc = store.locate(victim)
    assert loc is not None and (tmp_path / "segments" / f"{loc.path.stem}.idx").exists()
    store.close()
    write_in_place(loc.path, loc.record_offset + 5, b"\xff")  # the header's codec length: no header parses
    caplog.set_level(logging.WARNING, logger="paramserver.server.store")
    reopened = small(tmp_path, on_corrupt=lambda cid, why: lost.append(cid))
    assert lost == [victim] and not reopened.has(victim) and len(reopened) == 9
    with pytest.raises(ChunkCorruptError, match="awaiting repair"):
        reopened.get(victim)
    assert any(f"id={victim}" in r.getMessage() for r in caplog.records)
    assert all(reopened.get(c[0]).data == c[1] for c in chunks if c[0] != victim)
    reopened.close()
    again = small(tmp_path, on_corrupt=lambda cid, why: lost.append(cid))
    assert lost == [victim] and len(again) == 9  # its tombstone keeps it out: not reported twice


@pytest.mark.parametrize("cut", ["header", "data", "garbage", "zeros"])
def test_a_torn_tail_is_truncated_logged_and_never_served(tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: str) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0)
    kept = [raw_chunk(8 * KiB, seed=i) for i in range(3)]
    store.put_many(records(kept))
    [seg] = segment_files(store)
    good_size = seg.stat().st_size
    torn = raw_chunk(8 * KiB, seed=50)
    from paramserver.server.store import encode_header

    full = encode_header("raw", torn[3], len(torn[1]), torn[4], torn[0]) + torn[1]
    tail = {"header": full[:50], "data": full[:HEADER_SIZE + 3000], "garbage": os.urandom(777), "zeros": bytes(4096)}[cut]
    store.close()
    with open(seg, "ab") as f:
        f.write(tail)
    caplog.set_level(logging.WARNING, logger="paramserver.server.store")
    reopened = ChunkStore(tmp_path, cache_bytes=0)
    assert seg.stat().st_size == good_size
    lines = [r.getMessage() for r in caplog.records if "torn tail truncated" in r.getMessage()]
    assert len(lines) == 1 and str(seg) in lines[0] and "records_kept=3" in lines[0] and f"bytes={len(tail)}" in lines[0]
    assert len(reopened) == 3 and not reopened.has(torn[0])
    with pytest.raises(ChunkNotFoundError):
        reopened.get(torn[0])
    assert reopened.put(*torn) is True  # appends go on right after the last good record
    reopened.close()
    assert len(ChunkStore(tmp_path, cache_bytes=0)) == 4


def test_damage_in_the_middle_of_the_active_segment_loses_only_that_record(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    lost: list[str] = []
    store = ChunkStore(tmp_path, cache_bytes=0)
    chunks = [raw_chunk(8 * KiB, seed=i) for i in range(6)]
    store.put_many(records(chunks))
    bad, hidden = store.locate(chunks[2][0]), store.locate(chunks[4][0])
    assert bad is not None and hidden is not None
    store.close()
    write_in_place(bad.path, bad.offset + 100, b"\x00\x01\x02")  # data: CRC fails, header fine
    write_in_place(hidden.path, hidden.record_offset, b"JUNK")  # header magic gone: resync past it
    caplog.set_level(logging.WARNING, logger="paramserver.server.store")
    reopened = ChunkStore(tmp_path, cache_bytes=0, on_corrupt=lambda cid, why: lost.append(cid))
    assert lost == [chunks[2][0]]  # its header named it: lost, queued for repair
    assert sorted(reopened.iter_ids()) == sorted(c[0] for i, c in enumerate(chunks) if i not in (2, 4))
    assert all(reopened.get(c[0]).data == c[1] for i, c in enumerate(chunks) if i not in (2, 4))
    assert any("damaged bytes" in r.getMessage() for r in caplog.records)
    assert reopened.stats().bytes_on_disk >= bad.path.stat().st_size  # nothing truncated: valid records follow


# ------------------------------------------------------------------ deletes


def test_deletes_survive_a_restart_and_compaction_never_resurrects_them(tmp_path: Path) -> None:
    from paramserver.server.compaction import Compactor

    store = small(tmp_path)
    chunks = [raw_chunk(20 * KiB, seed=i) for i in range(24)]
    for i in range(0, 24, 4):
        store.put_many(records(chunks[i:i + 4]))
    gone = {c[0] for c in chunks[::3]}
    for cid in gone:
        assert store.delete(cid)
    assert Compactor(store).run_until_idle() >= 1
    for cid in list(gone)[:2]:
        assert not store.delete(cid)
    store.close()
    for _ in range(2):
        reopened = small(tmp_path)
        assert set(reopened.iter_ids()) == {c[0] for c in chunks} - gone
        assert set(chunks_on_disk(tmp_path)) == {c[0] for c in chunks} - gone  # what a tool sees, too
        assert all(reopened.verify(c[0]).data == c[1] for c in chunks if c[0] not in gone)
        reopened.close()


def test_a_copy_left_by_compaction_before_its_segment_went_is_a_shadow_a_delete_kills_too(tmp_path: Path) -> None:
    # A crash after compaction copied a record but before it removed the old segment: the chunk has two
    # live records. The later one is served; a delete must kill both, or the older one comes back.
    store = small(tmp_path)
    chunks = [raw_chunk(30 * KiB, seed=i) for i in range(8)]
    store.put_many(records(chunks))
    first = store.locate(chunks[0][0])
    assert first is not None
    old_seg = int(first.path.stem)
    store.move_records(old_seg, [chunks[0][0], chunks[1][0]])  # copied; the old segment stays (the "crash")
    store.close()
    reopened = small(tmp_path)
    moved = reopened.locate(chunks[0][0])
    assert moved is not None and int(moved.path.stem) > old_seg
    assert reopened.delete(chunks[0][0])
    reopened.close()
    again = small(tmp_path)
    assert not again.has(chunks[0][0]) and again.get(chunks[1][0]).data == chunks[1][1]
    assert locate_on_disk(tmp_path, chunks[0][0]) is None


def test_a_delete_racing_a_compaction_move_kills_the_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = small(tmp_path)
    chunks = [raw_chunk(30 * KiB, seed=i) for i in range(8)]
    store.put_many(records(chunks))
    victim = chunks[0][0]
    loc = store.locate(victim)
    assert loc is not None
    real = store._wait_durable
    done: list[bool] = []

    def delete_while_durable(end: tuple[int, int], epoch: int) -> None:
        real(end, epoch)
        if not done:
            done.append(False)
            done[0] = store.delete(victim)  # after the copy is written, before the swap

    monkeypatch.setattr(store, "_wait_durable", delete_while_durable)
    store.move_records(int(loc.path.stem), [victim])
    monkeypatch.undo()
    assert done == [True] and not store.has(victim)
    store.close()
    assert not small(tmp_path).has(victim)


# ------------------------------------------------------------------ failures while appending


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_a_failed_append_truncates_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0)
    kept = raw_chunk(seed=1)
    store.put(*kept)
    [seg] = segment_files(store)
    size = seg.stat().st_size
    real = os.pwritev

    def half_then_fail(fd: int, bufs: list[bytes], offset: int) -> int:
        real(fd, [bytes(bufs[0])[:40]], offset)  # a torn header lands first
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwritev", half_then_fail)
    chunk = raw_chunk(seed=2)
    with pytest.raises((OSError, StoreFullError)) as info:
        store.put(*chunk)
    monkeypatch.undo()
    assert isinstance(info.value, StoreFullError) == (code != errno.EIO)
    assert seg.stat().st_size == size and not store.has(chunk[0])
    assert store.put(*chunk) is True and store.get(chunk[0]).data == chunk[1]
    store.close()
    assert len(ChunkStore(tmp_path, cache_bytes=0)) == 2


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_fsync_drops_every_batch_it_covered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0)
    kept = raw_chunk(seed=1)
    store.put(*kept)
    [seg] = segment_files(store)
    size = seg.stat().st_size

    def fail(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fdatasync", fail)
    chunk = raw_chunk(seed=2)
    with pytest.raises((OSError, StoreFullError)) as info:
        store.put(*chunk)
    monkeypatch.undo()
    assert isinstance(info.value, StoreFullError) == (code == errno.ENOSPC)
    assert seg.stat().st_size == size and not store.has(chunk[0]) and not store.claim([chunk[0]])[0]
    assert store.put(*chunk) is True
    store.close()
    reopened = ChunkStore(tmp_path, cache_bytes=0)
    assert reopened.get(chunk[0]).data == chunk[1] and len(reopened) == 2


def test_no_space_for_a_new_segment_is_a_clean_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = small(tmp_path, segment_bytes=64 * KiB)
    store.put(*raw_chunk(40 * KiB, seed=1))
    real = os.open

    def no_space(path: str, flags: int, *args: int) -> int:
        if str(path).endswith(".seg") and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, flags, *args)

    monkeypatch.setattr(os, "open", no_space)
    chunk = raw_chunk(40 * KiB, seed=2)
    with pytest.raises(StoreFullError, match=str(tmp_path)):
        store.put(*chunk)
    monkeypatch.undo()
    assert store.put(*chunk) is True and len(segment_files(store)) == 2


# ------------------------------------------------------------------ views, options, helpers


def test_a_second_store_on_the_same_dir_opens_read_only(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0)
    c = raw_chunk(seed=3)
    store.put(*c)
    view = ChunkStore(tmp_path, cache_bytes=0)
    assert view.read_only and not store.read_only
    assert view.get(c[0]).data == c[1]
    with pytest.raises(OSError, match="read only"):
        view.put(*raw_chunk(seed=4))
    with pytest.raises(OSError, match="read only"):
        view.delete(c[0])
    assert store.has(c[0])
    del view
    store.close()
    assert not ChunkStore(tmp_path, cache_bytes=0).read_only


def test_tools_find_a_chunk_from_outside_the_process(tmp_path: Path) -> None:
    store = small(tmp_path)
    chunks = [raw_chunk(30 * KiB, seed=i) for i in range(9)]
    store.put_many(records(chunks))
    store.delete(chunks[0][0])
    for c in chunks[1:]:
        loc = locate_on_disk(tmp_path, c[0])
        assert loc is not None and loc == store.locate(c[0]) and loc.read_stored() == c[1]
    assert locate_on_disk(tmp_path, chunks[0][0]) is None
    scans, view = read_view(tmp_path, verify=True)
    assert sorted(scans) == list_segments(tmp_path / "segments") and len(view.index) == 8


def test_stored_headers_come_from_the_index(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0)
    c = raw_chunk(seed=6)
    store.put(*c)
    assert store.stored_headers([c[0], "e" * 64]) == [(c[4], "raw"), None]
    assert store.stored_headers([c[0]], [False]) == [None]
    loc = store.locate(c[0])
    assert loc is not None
    h = parse_header(loc.read_record()[:HEADER_SIZE])
    assert (h.chunk_id, h.crc32c, h.codec) == (c[0], c[4], "raw")  # what the record's header says too


def test_store_config_validates_and_reads_a_config_file() -> None:
    assert StoreConfig().segment_bytes == 256 * MiB
    with pytest.raises(ConfigError, match="segment_bytes"):
        StoreConfig(segment_bytes=10).validate()
    with pytest.raises(ConfigError, match="compact_live_fraction"):
        StoreConfig(compact_live_fraction=0).validate()
    got = StoreConfig.from_extra({"store_segment_bytes": 64 * MiB, "store_compact_bytes_per_s": 1 << 20, "other": 1,
                                  "store_verify_index_on_open": False})
    assert got.segment_bytes == 64 * MiB and got.compact_bytes_per_s == 1 << 20 and not got.verify_index_on_open
    with pytest.raises(ConfigError, match="store_segment_bytes must be an integer"):
        StoreConfig.from_extra({"store_segment_bytes": "big"})


# ------------------------------------------------------------------ batched reads


def count_preads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the preads made from now on, in order."""
    reads: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, n: int, off: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, off)

    monkeypatch.setattr(os, "pread", counting_pread)
    return reads


def test_get_many_reads_adjacent_records_together_and_answers_like_get(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lost: list[str] = []
    store = ChunkStore(tmp_path, cache_bytes=1 << 20, on_corrupt=lambda cid, why: lost.append(cid))
    chunks = [raw_chunk(4 * KiB, seed=i) for i in range(40)] + [raw_chunk(200 * KiB, seed=99)]
    store.put_many(records(chunks))
    bad = store.locate(chunks[7][0])
    assert bad is not None
    write_in_place(bad.path, bad.offset + 10, b"\xff\xfe")  # one record's bytes damaged inside a run
    store.get(chunks[3][0])  # a cache hit among the reads
    reads = count_preads(monkeypatch)
    missing, malformed = "ab" * 32, "not-an-id"
    asked = [c[0] for c in reversed(chunks)] + [missing, malformed, chunks[0][0]]
    got = store.get_many(asked)
    assert len(got) == len(asked)
    for cid, answer in zip(asked, got):
        if cid == chunks[7][0]:
            assert isinstance(answer, ChunkCorruptError)  # read again alone, and quarantined like get()
        elif cid == missing:
            assert isinstance(answer, ChunkNotFoundError)
        elif cid == malformed:
            assert isinstance(answer, InvalidChunkError)
        else:
            assert not isinstance(answer, Exception) and answer.data == next(c[1] for c in chunks if c[0] == cid)
    assert lost == [chunks[7][0]]
    # The 4 KiB records were read in a few runs (asked in reverse order, read in disk order; the
    # cache hit and the id asked twice cut runs), the large one alone (header and bytes apart), the
    # damaged one once more alone: about ten reads where get() of each would make eighty.
    assert len(reads) <= 10, reads
    assert max(reads) >= 30 * (4 * KiB)  # one run held most of the small records
    store.close()


@pytest.mark.parametrize("damage", ["swapped id", "header byte", "stored size"])
def test_get_many_checks_every_header_of_a_run(tmp_path: Path, damage: str) -> None:
    # Records read together are checked as arrays: a header that names another chunk (its own CRC
    # made right), a flipped header byte, a size that disagrees with the index: each is read again
    # alone and refused like get() refuses it, and its neighbours in the run are served.
    lost: list[str] = []
    store = ChunkStore(tmp_path, cache_bytes=0, on_corrupt=lambda cid, why: lost.append(cid))
    chunks = [raw_chunk(4 * KiB, seed=i) for i in range(12)]
    store.put_many(records(chunks))
    bad = store.locate(chunks[5][0])
    assert bad is not None
    if damage == "swapped id":
        other = chunks[6]
        write_in_place(bad.path, bad.record_offset, encode_header("raw", 4 * KiB, 4 * KiB, chunks[5][4], other[0]))
    elif damage == "header byte":
        write_in_place(bad.path, bad.record_offset + 30, b"\x7f")
    else:
        write_in_place(bad.path, bad.record_offset, encode_header("raw", 4 * KiB, 4 * KiB - 1, chunks[5][4], chunks[5][0]))
    got = store.get_many([c[0] for c in chunks])
    assert isinstance(got[5], ChunkCorruptError) and lost == [chunks[5][0]]
    assert [g.data for k, g in enumerate(got) if k != 5] == [c[1] for k, c in enumerate(chunks) if k != 5]  # type: ignore[union-attr]
    store.close()


def test_get_many_reads_every_third_record_in_runs_over_the_gaps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A reader spreading a model over three replicas asks each for every third record.
    store = ChunkStore(tmp_path, cache_bytes=0)
    chunks = [raw_chunk(4 * KiB, seed=i) for i in range(60)]
    store.put_many(records(chunks))
    reads = count_preads(monkeypatch)
    asked = chunks[1::3]
    got = store.get_many([c[0] for c in asked])
    assert [g.data for g in got] == [c[1] for c in asked]  # type: ignore[union-attr]
    assert len(reads) <= 2, reads  # one run over the records between, not two preads per chunk
    store.close()


def test_get_many_releases_every_pin_when_a_read_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0)
    chunks = [raw_chunk(4 * KiB, seed=i) for i in range(8)]
    store.put_many(records(chunks))

    def failing_pread(fd: int, n: int, off: int) -> bytes:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "pread", failing_pread)
    with pytest.raises(OSError):
        store.get_many([c[0] for c in chunks])
    monkeypatch.undo()
    assert all(seg.refs == 0 for seg in store._segs.values())  # nothing left pinned
    assert [c.data for c in store.get_many([c[0] for c in chunks])] == [c[1] for c in chunks]  # type: ignore[union-attr]
    store.close()
