"""Compaction of the segment store (issue 12): after orphans are collected, rewriting segments gives
the space back (disk use within 10% of the live bytes) at a bounded I/O rate, while readers go on
reading every live chunk bit-exact."""
from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from chunking.hashing import content_id, crc32c
from paramserver.server.compaction import Compactor
from paramserver.server.errors import ChunkCorruptError
from paramserver.server.gc import OrphanCollector
from paramserver.server.segments import chunks_on_disk, write_in_place
from paramserver.server.store import ChunkStore, StoreConfig
from tests.store_checks import records

KiB, MiB = 1 << 10, 1 << 20


def raw_chunk(seed: int, size: int = 64 * KiB) -> tuple[str, bytes, str, int, int]:
    data = random.Random(seed).randbytes(size)
    return content_id(data), data, "raw", size, crc32c(data)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def disk_use(store: ChunkStore) -> int:
    return sum(p.stat().st_size for p in store.segments_dir.iterdir() if p.suffix in (".seg", ".idx"))


def test_after_orphans_are_collected_compaction_gives_the_space_back_while_reads_stay_exact(tmp_path: Path) -> None:
    wall = Clock()
    config = StoreConfig(segment_bytes=1 * MiB, compact_bytes_per_s=4 * MiB, compact_interval_s=1.0)
    store = ChunkStore(tmp_path, cache_bytes=0, config=config, clock=wall)
    rng = random.Random(5)
    chunks = [raw_chunk(i) for i in range(256)]  # 16 MiB over ~17 segments
    for i in range(0, len(chunks), 8):
        store.put_many(records(chunks[i:i + 8]))
    live = {c[0]: c[1] for c in chunks if rng.random() < 0.4}  # what committed versions name
    wall.now += 7200
    report = OrphanCollector(lambda: set(live), store, grace_s=3600, clock=wall).step()
    assert report.deleted == len(chunks) - len(live) and len(store) == len(live)
    before = disk_use(store)
    live_bytes = store.stats().live_bytes
    assert before > 2 * live_bytes  # deleting gave nothing back by itself: the records are still there

    stop = threading.Event()
    errors: list[BaseException] = []
    passes = [0]

    def reader() -> None:
        try:
            while not stop.is_set():
                for cid, data in live.items():
                    assert store.get(cid, use_cache=False).data == data
                passes[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    steps = Clock(0.0)
    compactor = Compactor(store, clock=steps)
    spent: list[int] = []
    try:
        for _ in range(400):  # bounded: ~16 MiB of I/O at 4 MiB per simulated second
            steps.now += 1.0
            r = compactor.step()
            spent.append(r.bytes_read + r.bytes_written)
            if r.segment is None and not r.removed and compactor.pick() is None:
                break
        while passes[0] < 2 and not errors:
            stop.wait(0.05)  # at least one full read pass overlapping the last steps
    finally:
        stop.set()
        for t in readers:
            t.join(60)
    assert not errors, errors[0]
    assert compactor.segments_removed >= 8
    # the I/O budget: at most one batch (4 MiB) beyond what accrued (4 MiB per step, up to a 2-step burst)
    assert max(spent) <= 2 * 4 * MiB + 4 * MiB + 256 * KiB
    after = disk_use(store)
    assert after <= 1.10 * store.stats().live_bytes, (before, after, store.stats())
    assert store.stats().bytes_on_disk == after
    assert len(store) == len(live) and all(store.verify(cid).data == data for cid, data in live.items())
    store.close()
    reopened = ChunkStore(tmp_path, cache_bytes=0, config=config)
    assert set(reopened.iter_ids()) == set(live) and set(chunks_on_disk(tmp_path)) == set(live)
    assert all(reopened.verify(cid).data == data for cid, data in live.items())


def test_a_corrupt_record_is_never_copied(tmp_path: Path) -> None:
    lost: list[str] = []
    store = ChunkStore(tmp_path, cache_bytes=0, config=StoreConfig(segment_bytes=512 * KiB),
                       on_corrupt=lambda cid, why: lost.append(cid))
    chunks = [raw_chunk(i) for i in range(20)]
    store.put_many(records(chunks))
    for c in chunks[:6]:
        store.delete(c[0])  # the first segment drops below half live
    victim = chunks[6][0]
    loc = store.locate(victim)
    assert loc is not None and loc.path.name == "0000000000000001.seg"
    write_in_place(loc.path, loc.offset + 10, b"\x00\x00\x00")
    Compactor(store).run_until_idle()
    assert lost == [victim] and not store.has(victim)
    assert not (tmp_path / "segments" / "0000000000000001.seg").exists()
    with pytest.raises(ChunkCorruptError, match="awaiting repair"):
        store.get(victim)
    assert all(store.get(c[0]).data == c[1] for c in chunks[7:])


def test_compaction_pauses_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0, config=StoreConfig(segment_bytes=512 * KiB), reserve_bytes=1)
    chunks = [raw_chunk(i) for i in range(20)]
    store.put_many(records(chunks))
    for c in chunks[:6]:
        store.delete(c[0])
    monkeypatch.setattr(store, "free_bytes", lambda: 0)
    clock = Clock(0.0)
    compactor = Compactor(store, clock=clock)
    clock.now += 1
    assert compactor.step().skipped_reason == "disk full"
    monkeypatch.undo()
    clock.now += 1
    assert compactor.step().bytes_written > 0


def test_segments_without_dead_bytes_are_left_alone(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0, config=StoreConfig(segment_bytes=256 * KiB, compact_dead_ratio=0.0))
    store.put_many(records([raw_chunk(i, 40 * KiB) for i in range(30)]))
    compactor = Compactor(store)
    assert compactor.pick() is None and compactor.run_until_idle() == 0
    assert os.path.exists(tmp_path / "segments" / "0000000000000001.seg")
