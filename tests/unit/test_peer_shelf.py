"""PeerShelf: what a worker serves to its peers, by chunk id (worker.peer_shelf)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from chunking.hashing import content_id, crc32c
from tests.peer_helpers import Arena, chunks, manifest_of
from worker.disk_cache import DiskCache
from worker.lru_k import LRUKCache
from worker.peer_shelf import MAX_VERSIONS, PeerShelf, PeerVersion
from worker.tiered_cache import HeldGroup, TieredCache


def tiers(tmp_path: Path | None = None) -> TieredCache:
    disk = DiskCache(tmp_path / "disk", 1 << 20) if tmp_path is not None else None
    return TieredCache(LRUKCache(1 << 20), disk)


def test_landed_chunks_are_served_in_place_and_unknown_ids_at_once() -> None:
    datas = chunks(4)
    m, arena = manifest_of(datas), Arena(datas)
    shelf = PeerShelf(None)
    entry = shelf.begin_load(m, arena.locate, time.time())
    for row in (0, 2):
        arena.fill(row)
    entry.landed(np.array([0, 2]))
    unknown = content_id(b"nobody has this")
    t0 = time.monotonic()
    found = shelf.find([m.chunks.ids[0], m.chunks.ids[2], unknown], time.monotonic() + 5.0)
    assert time.monotonic() - t0 < 1.0  # nothing asked for is pending: no wait
    assert found[0] is not None and bytes(found[0].view) == datas[0] and found[0].crc == crc32c(datas[0])
    assert found[1] is not None and bytes(found[1].view) == datas[2]
    assert found[2] is None
    # no copy: the view is the arena's memory
    view = shelf.lookup([m.chunks.ids[0]], time.monotonic())[0]
    assert view is not None and view.obj is arena.buf


def test_a_pending_chunk_is_waited_for_until_it_lands() -> None:
    datas = chunks(3)
    m, arena = manifest_of(datas), Arena(datas)
    shelf = PeerShelf(None)
    entry = shelf.begin_load(m, arena.locate, time.time())

    def land_later() -> None:
        time.sleep(0.3)
        arena.fill(1)
        entry.landed(np.array([1]))

    threading.Thread(target=land_later).start()
    t0 = time.monotonic()
    got = shelf.lookup([m.chunks.ids[1]], time.monotonic() + 5.0)
    waited = time.monotonic() - t0
    assert got[0] is not None and bytes(got[0]) == datas[1]
    assert 0.2 < waited < 3.0


def test_a_pending_chunk_that_never_lands_is_none_at_the_deadline() -> None:
    datas = chunks(2)
    m, arena = manifest_of(datas), Arena(datas)
    shelf = PeerShelf(None)
    entry = shelf.begin_load(m, arena.locate, time.time())
    arena.fill(0)
    entry.landed(np.array([0]))
    t0 = time.monotonic()
    got = shelf.lookup([m.chunks.ids[0], m.chunks.ids[1]], time.monotonic() + 0.4)
    waited = time.monotonic() - t0
    assert got[0] is not None and bytes(got[0]) == datas[0]
    assert got[1] is None
    assert 0.3 < waited < 2.0


def test_a_load_that_ends_wakes_its_waiters_and_kept_bytes_are_served() -> None:
    datas = chunks(3)
    m = manifest_of(datas)
    shelf = PeerShelf(None)
    entry = shelf.begin_load(m, lambda row: None, time.time())  # nothing lands in place
    entry.keep(0, datas[0])
    assert bytes(shelf.lookup([m.chunks.ids[0]], time.monotonic())[0] or b"") == datas[0]
    threading.Timer(0.2, entry.end, args=(False,)).start()
    t0 = time.monotonic()
    assert shelf.lookup([m.chunks.ids[2]], time.monotonic() + 5.0) == [None]
    assert time.monotonic() - t0 < 2.0  # ended: not waited for until the deadline
    assert shelf.lookup([m.chunks.ids[0]], time.monotonic()) == [None]  # an ended load serves nothing itself


def test_served_from_the_tiers_by_id_of_any_version(tmp_path: Path) -> None:
    datas = chunks(6)
    cache = tiers(tmp_path)
    m = manifest_of(datas[:3], "v1")
    arena = Arena(datas[:3])
    for row in range(3):
        arena.fill(row)
    group = HeldGroup(m.id, None, table=m.chunks, locate=arena.locate, crcs=m.chunks.crc32c)
    group.mark(np.arange(3))
    assert cache.hold_group(group, len(arena.buf))
    cache.memory.put(content_id(datas[3]), datas[3])
    assert cache.disk is not None
    cache.disk.put(content_id(datas[4]), datas[4])
    shelf = PeerShelf(cache)
    ids = [content_id(d) for d in datas]
    found = shelf.find(ids, time.monotonic() + 5.0)
    for k in range(5):
        f = found[k]
        assert f is not None and bytes(f.view) == datas[k] and f.crc == crc32c(datas[k])
    assert found[5] is None
    assert found[0] is not None and found[0].view.obj is arena.buf  # a held load's bytes: no copy
    # a peer's read is not a use of this worker's tiers: no hit counted, nothing promoted
    assert cache.stats()["total"]["lookups"] == 0
    assert not cache.memory.contains(ids[4])
    # a chunk of an active load that is in a tier is served at once, not waited for
    other = manifest_of([datas[3], datas[5]], "v2")
    shelf.begin_load(other, Arena([datas[3], datas[5]]).locate, time.time())
    t0 = time.monotonic()
    got = shelf.lookup([ids[3], ids[5]], time.monotonic() + 0.5)
    assert got[0] is not None and bytes(got[0]) == datas[3] and got[1] is None
    assert time.monotonic() - t0 >= 0.4  # the one still to come was waited for


def test_a_held_chunk_that_is_no_longer_intact_is_not_served() -> None:
    datas = chunks(2)
    cache = tiers()
    m, arena = manifest_of(datas), Arena(datas)
    for row in range(2):
        arena.fill(row)
    group = HeldGroup(m.id, None, table=m.chunks, locate=arena.locate, crcs=m.chunks.crc32c)
    group.mark(np.arange(2))
    assert cache.hold_group(group, len(arena.buf))
    arena.buf[5] ^= 0xFF  # the process changed a tensor it was given
    shelf = PeerShelf(cache)
    got = shelf.lookup([m.chunks.ids[0], m.chunks.ids[1]], time.monotonic() + 1.0)
    assert got[0] is None
    assert got[1] is not None and bytes(got[1]) == datas[1]


def test_versions_lists_active_and_whole_held_loads_newest_first_bounded() -> None:
    cache = tiers()
    shelf = PeerShelf(cache)
    datas = chunks(2)
    done = manifest_of(datas, "done")
    arena = Arena(datas)
    entry = shelf.begin_load(done, arena.locate, 100.0)

    class ArenaStub:  # only a group on an arena can be adopted, and only those count as held whole
        pass

    group = HeldGroup(done.id, ArenaStub(), table=done.chunks, locate=arena.locate,  # type: ignore[arg-type]
                      crcs=done.chunks.crc32c)
    group.mark(np.arange(2))
    assert cache.hold_group(group, len(arena.buf))
    assert shelf.versions() == [PeerVersion(done.id, False, 100.0)]
    entry.end(True)
    assert shelf.versions() == [PeerVersion(done.id, True, 100.0)]
    failed = manifest_of(datas, "failed")
    shelf.begin_load(failed, arena.locate, 200.0).end(False)
    loading = [manifest_of(datas, f"loading{k}") for k in range(MAX_VERSIONS + 2)]
    for k, m in enumerate(loading):
        shelf.begin_load(m, arena.locate, 300.0 + k)
    listed = shelf.versions()
    assert len(listed) == MAX_VERSIONS
    assert [v.manifest_id for v in listed] == [m.id for m in reversed(loading)][:MAX_VERSIONS]
    assert all(not v.complete for v in listed)
    # evicted from the memory tier: no longer announced as complete
    small = PeerShelf(cache)
    small.begin_load(done, arena.locate, 50.0).end(True)
    assert small.versions() == [PeerVersion(done.id, True, 50.0)]
    cache.memory.pop(group.tier_key)
    cache._drop_group(group)
    assert small.versions() == []
    assert failed.id not in {v.manifest_id for v in shelf.versions()}


def test_many_threads_looking_up_while_a_load_lands() -> None:
    datas = chunks(200, size=64, seed=3)
    m, arena = manifest_of(datas), Arena(datas)
    shelf = PeerShelf(None)
    entry = shelf.begin_load(m, arena.locate, time.time())
    results: list[list[memoryview | None]] = []
    lock = threading.Lock()

    def reader(k: int) -> None:
        got = shelf.lookup(list(m.chunks.ids[k::4]), time.monotonic() + 10.0)
        with lock:
            results.append(got)

    readers = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in readers:
        t.start()
    order = np.random.default_rng(1).permutation(200)
    for block in np.array_split(order, 20):
        for row in block.tolist():
            arena.fill(row)
        entry.landed(block)
        time.sleep(0.005)
    for t in readers:
        t.join(10.0)
    assert len(results) == 4
    assert all(v is not None for got in results for v in got)
