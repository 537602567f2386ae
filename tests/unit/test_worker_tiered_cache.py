from __future__ import annotations

from pathlib import Path

import pytest

from chunking.hashing import content_id
from worker.config import CacheConfig
from worker.errors import ConfigError
from worker.tiered_cache import TieredCache


def chunk(i: int) -> tuple[str, bytes]:
    data = i.to_bytes(4, "little") * 256
    return content_id(data), data


def test_memory_then_disk_then_miss_with_per_tier_counters(tmp_path: Path) -> None:
    cfg = CacheConfig(memory_bytes=2048, disk_dir=str(tmp_path), disk_bytes=1 << 20, disk_fsync=False)
    cache = TieredCache.from_config(cfg)
    a, b, c = chunk(1), chunk(2), chunk(3)
    assert cache.get(a[0]) == (None, None)
    for key, data in (a, b, c):
        cache.put(key, data)  # memory holds two 1 KiB chunks; the disk holds all three
    assert cache.get(c[0]) == (c[1], "memory")
    assert cache.get(a[0]) == (a[1], "disk")  # promoted back into memory
    assert cache.memory.contains(a[0])
    stats = cache.stats()
    assert stats["memory"]["hits"] == 1 and stats["memory"]["evictions"] >= 1
    assert stats["disk"]["hits"] == 1 and stats["disk"]["entries"] == 3
    assert stats["total"] == {"lookups": 3, "hits": 2, "misses": 1}
    assert stats["memory"]["bytes"] <= 2048


def test_restart_serves_from_disk(tmp_path: Path) -> None:
    cfg = CacheConfig(memory_bytes=1 << 20, disk_dir=str(tmp_path), disk_bytes=1 << 20, disk_fsync=False)
    key, data = chunk(5)
    TieredCache.from_config(cfg).put(key, data)
    fresh = TieredCache.from_config(cfg)
    assert fresh.get(key) == (data, "disk")
    assert fresh.get(key) == (data, "memory")


def test_memory_only() -> None:
    cache = TieredCache.from_config(CacheConfig(memory_bytes=1 << 20))
    key, data = chunk(9)
    cache.put(key, data)
    assert cache.get(key).tier == "memory"
    assert set(cache.stats()) == {"memory", "total"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"k": 0},
        {"memory_bytes": -1},
        {"disk_dir": "/tmp/x"},
        {"disk_verify": "md5"},
        {"correlated_reference_period_s": 5.0, "retained_information_period_s": 1.0},
    ],
)
def test_cache_config_validate_refuses_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        CacheConfig(**kwargs).validate()  # type: ignore[arg-type]


def test_contains_many_answers_as_contains_does_in_both_tiers(tmp_path: Path) -> None:
    cfg = CacheConfig(memory_bytes=1 << 20, disk_dir=str(tmp_path), disk_bytes=1 << 20, disk_fsync=False)
    cache = TieredCache.from_config(cfg)
    blobs = [bytes([i]) * 1000 for i in range(4)]
    keys = [content_id(b) for b in blobs]
    for k, b in zip(keys[:2], blobs[:2]):
        cache.put(k, b)
    assert cache.disk is not None
    cache.disk.put(keys[2], blobs[2])
    assert cache.memory.contains_many(keys) == [cache.memory.contains(k) for k in keys] == [True, True, False, False]
    assert cache.disk.contains_many(keys) == [cache.disk.contains(k) for k in keys] == [True, True, True, False]
    assert cache.memory.stats().hits == 0  # a look, not a reference
