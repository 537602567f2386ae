from __future__ import annotations

import os
from pathlib import Path

import pytest

from chunking.hashing import content_id
from worker.disk_cache import HEADER_BYTES, DiskCache
from worker.errors import CacheError


def chunk(i: int, size: int = 1000) -> tuple[str, bytes]:
    data = bytes([i % 251]) * size + i.to_bytes(4, "little")
    return content_id(data), data


def test_put_get_roundtrip_and_counters(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20, fsync=False)
    key, data = chunk(1)
    assert cache.get(key) is None
    assert cache.put(key, data)
    assert cache.get(key) == data
    s = cache.stats()
    assert (s.hits, s.misses, s.inserts, s.entries) == (1, 1, 1, 1)
    assert s.bytes == len(data) + HEADER_BYTES
    assert list((tmp_path / "tmp").iterdir()) == []  # no debris from the atomic write


def test_survives_restart_and_keeps_lru_order(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 10 * (1004 + HEADER_BYTES), fsync=False)
    chunks = [chunk(i) for i in range(3)]
    for n, (key, data) in enumerate(chunks):
        cache.put(key, data)
        os.utime(cache._path(key), (1000 + n, 1000 + n))
    os.utime(cache._path(chunks[0][0]), (2000, 2000))  # chunk 0 was read last
    (tmp_path / "tmp" / "half-written").write_bytes(b"junk")

    reopened = DiskCache(tmp_path, 2 * (1004 + HEADER_BYTES), fsync=False)  # smaller budget
    assert list((tmp_path / "tmp").iterdir()) == []
    assert len(reopened) == 2
    assert not reopened.contains(chunks[1][0])  # least recently used goes first
    assert reopened.get(chunks[0][0]) == chunks[0][1]
    assert reopened.get(chunks[2][0]) == chunks[2][1]


@pytest.mark.parametrize("verify", ["crc32c", "content_id"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_corrupt_file_is_deleted_and_reported_as_miss(tmp_path: Path, verify: str, damage: str) -> None:
    reported: list[tuple[str, str]] = []
    cache = DiskCache(tmp_path, 1 << 20, verify=verify, fsync=False, on_corrupt=lambda k, r: reported.append((k, r)))
    key, data = chunk(7)
    cache.put(key, data)
    path = cache._path(key)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[HEADER_BYTES + 500] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-10]
    else:
        raw[0:4] = b"XXXX"
    path.write_bytes(bytes(raw))
    assert cache.get(key) is None
    assert not path.exists()
    assert not cache.contains(key)
    s = cache.stats()
    assert s.corrupt == 1 and s.misses == 1 and s.bytes == 0
    assert reported and reported[0][0] == key


def test_a_file_under_another_chunks_name_is_a_miss_not_that_chunk(tmp_path: Path) -> None:
    """Each file's CRC covered its payload alone: a file copied over another chunk's (a restore, an
    operator's cp, two caches merged) passed the check and was served as that chunk."""
    reported: list[tuple[str, str]] = []
    cache = DiskCache(tmp_path, 1 << 20, fsync=False, on_corrupt=lambda k, r: reported.append((k, r)))
    (a, data_a), (b, data_b) = chunk(1), chunk(2)
    cache.put(a, data_a)
    cache.put(b, data_b)
    cache._path(b).write_bytes(cache._path(a).read_bytes())
    assert cache.get(b) is None and cache.get(a) == data_a
    assert reported == [(b, "CRC32C mismatch (damaged, or another chunk's file)")]


def test_files_of_the_first_format_are_read_when_their_content_id_matches(tmp_path: Path) -> None:
    import struct

    from chunking.hashing import crc32c

    (a, data_a), (b, _) = chunk(1), chunk(2)
    for key, payload in ((a, data_a), (b, data_a)):  # b's file holds a's bytes
        path = tmp_path / key[:2] / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(struct.pack("<4sIQ", b"PDC1", crc32c(payload), len(payload)) + payload)
    cache = DiskCache(tmp_path, 1 << 20, fsync=False)
    assert cache.get(a) == data_a
    assert cache.get(b) is None and cache.stats().corrupt == 1


def test_budget_holds_and_lru_eviction(tmp_path: Path) -> None:
    per = 1004 + HEADER_BYTES
    cache = DiskCache(tmp_path, 3 * per, fsync=False)
    keys = []
    for i in range(3):
        key, data = chunk(i)
        cache.put(key, data)
        keys.append(key)
    cache.get(keys[0])  # 0 becomes most recent; 1 is the LRU victim
    key3, data3 = chunk(3)
    cache.put(key3, data3)
    assert cache.stats().bytes <= 3 * per
    assert not cache.contains(keys[1]) and not cache._path(keys[1]).exists()
    assert cache.contains(keys[0]) and cache.contains(key3)
    assert cache.stats().evictions == 1
    assert cache.put(*chunk(9, size=10 * per)) is False
    assert cache.stats().rejected == 1


def test_rejects_non_content_id_keys_and_bad_budget(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20, fsync=False)
    with pytest.raises(CacheError, match="content ids"):
        cache.put("../../etc/passwd", b"x")
    with pytest.raises(CacheError, match="> 0"):
        DiskCache(tmp_path, 0)
