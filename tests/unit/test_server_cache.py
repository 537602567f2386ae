"""The server's hot tier (paramserver.server.cache.ByteLRU): byte budget, LRU order, and scans
that do not evict what is in use. Injected clock, no sleeps."""
from __future__ import annotations

import pytest

from paramserver.server.cache import ByteLRU


def test_lru_evicts_least_recently_used_within_the_byte_budget() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(40)
    for key in "abcd":
        assert cache.put(key, key.encode(), 10)
    assert cache.get("a") == b"a"  # a is now the most recent
    assert cache.put("e", b"e", 10)
    assert "b" not in cache and all(k in cache for k in "acde")
    assert not cache.put("big", b"x", 11)  # over a quarter of the budget: never cached
    stats = cache.stats()
    assert (stats.used_bytes, stats.entries, stats.evictions, stats.hits) == (40, 4, 1, 1)


def test_a_scan_does_not_evict_entries_used_recently_and_takes_over_idle_ones() -> None:
    now = [0.0]
    cache: ByteLRU[int, int] = ByteLRU(40, scan_protect_s=30.0, clock=lambda: now[0])
    # A model of 8 chunks walked in order through a cache of 4: the first 4 stay.
    for load in range(3):
        hits = 0
        for chunk in range(8):
            if cache.get(chunk) is not None:
                hits += 1
            else:
                cache.put(chunk, chunk, 10, scan=True)
            now[0] += 1.0
        assert hits == (0 if load == 0 else 4)  # plain LRU would hit none, load after load
    assert sorted(k for k in range(8) if k in cache) == [0, 1, 2, 3]
    assert cache.stats().scan_skips == 12 and cache.stats().evictions == 0
    # A put that is not a scan (a single read) still evicts the least recently used.
    assert cache.put(100, 100, 10) and 0 not in cache
    # Nothing used for scan_protect_s: a scan of another model takes the room again.
    now[0] += 31.0
    for chunk in range(200, 204):
        assert cache.put(chunk, chunk, 10, scan=True)
    assert len(cache) == 4 and all(k in cache for k in range(200, 204))


def test_scan_protect_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="scan_protect_s"):
        ByteLRU(10, scan_protect_s=-1.0)
