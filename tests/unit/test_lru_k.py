from __future__ import annotations

import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.errors import ConfigError
from worker.lru import LRUCache
from worker.lru_k import LRUKCache


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make(capacity: int, clock: Clock, **kw: float) -> LRUKCache:
    kw.setdefault("correlated_reference_period", 1.0)
    kw.setdefault("retained_information_period", 10_000.0)
    return LRUKCache(capacity, k=2, clock=clock, **kw)  # type: ignore[arg-type]


def fetch(cache: LRUKCache | LRUCache, key: object, clock: Clock | None = None, size: int = 1) -> bool:
    """One reference the way a loader does it: get, and put on a miss. True on a hit."""
    if clock is not None:
        clock.advance(5.0)  # well past the correlated period: every reference is uncorrelated
    if cache.get(key) is not None:
        return True
    cache.put(key, b"x" * size)
    return False


def test_one_time_scan_does_not_evict_twice_referenced_entries() -> None:
    clock = Clock()
    cache = make(20, clock)
    hot = [f"hot{i}" for i in range(10)]
    for _ in range(2):
        for key in hot:
            fetch(cache, key, clock)
    for i in range(500):
        fetch(cache, f"scan{i}", clock)
    assert all(cache.contains(k) for k in hot)
    assert all(fetch(cache, k, clock) for k in hot)

    # Plain LRU loses every hot entry to the same scan: the case LRU-K exists for.
    lru = LRUCache(20)
    for _ in range(2):
        for key in hot:
            fetch(lru, key)
    for i in range(500):
        fetch(lru, f"scan{i}")
    assert not any(lru.contains(k) for k in hot)


def test_correlated_references_count_once() -> None:
    clock = Clock(0.0)
    cache = make(100, clock, correlated_reference_period=1.0)
    cache.put("a", b"a")
    for _ in range(5):
        clock.advance(0.1)
        assert cache.get("a") == b"a"
    hist = cache.history("a")
    assert hist is not None and hist[0] == 0.0 and hist[1] == -math.inf  # still one reference
    # The next uncorrelated reference collapses the 0.5 s burst to a point: the old
    # reference time moves forward by the burst length.
    clock.t = 10.0
    cache.get("a")
    assert cache.history("a") == (10.0, 0.5)


def test_burst_page_is_evicted_before_page_with_two_uncorrelated_references() -> None:
    clock = Clock(0.0)
    cache = make(2, clock, correlated_reference_period=1.0)
    cache.put("burst", b"b")
    for _ in range(9):
        clock.advance(0.1)
        cache.get("burst")  # ten references inside one correlated period
    clock.advance(5.0)
    cache.put("twice", b"t")
    clock.advance(5.0)
    cache.get("twice")
    clock.advance(5.0)
    cache.put("new", b"n")
    assert not cache.contains("burst")
    assert cache.contains("twice") and cache.contains("new")


def test_page_inside_its_correlated_period_is_not_the_victim() -> None:
    clock = Clock(0.0)
    cache = make(2, clock, correlated_reference_period=5.0)
    cache.put("a", b"a")
    clock.t = 50.0
    cache.get("a")  # two references: finite K-distance
    clock.t = 55.0
    cache.put("b", b"b")  # one reference: infinite K-distance, but inside its CRP
    clock.t = 58.0
    cache.put("c", b"c")
    assert cache.contains("b") and cache.contains("c") and not cache.contains("a")


def test_all_pages_inside_correlated_period_still_evicts_infinite_distance_first() -> None:
    clock = Clock(0.0)
    cache = make(2, clock, correlated_reference_period=100.0)
    cache.put("a", b"a")
    clock.advance(1)
    cache.put("b", b"b")
    clock.advance(1)
    cache.put("c", b"c")  # everything is within its CRP: oldest infinite-distance page goes
    assert not cache.contains("a") and cache.contains("b") and cache.contains("c")


def test_retained_history_makes_returning_page_count_k_references() -> None:
    def run(max_retained: int) -> LRUKCache:
        clock = Clock()
        cache = LRUKCache(2, clock=clock, correlated_reference_period=1.0, max_retained_history=max_retained)
        fetch(cache, "a", clock)
        fetch(cache, "a", clock)  # two references
        fetch(cache, "big", clock, size=2)  # needs the whole cache: a is evicted
        assert not cache.contains("a")
        fetch(cache, "a", clock)  # comes back
        fetch(cache, "z", clock)  # a brand-new page, more recent than a
        fetch(cache, "w", clock)  # one of a, z must go
        return cache

    kept = run(max_retained=100)
    hist = kept.history("a")
    assert hist is not None and len([t for t in hist if t != -math.inf]) == 2
    assert kept.contains("a") and not kept.contains("z")  # z has infinite K-distance
    # Without retained history a looks new and, being older than z, is the victim.
    forgot = run(max_retained=0)
    assert not forgot.contains("a") and forgot.contains("z")


def test_retained_history_expires_after_rip_and_is_bounded_in_count() -> None:
    clock = Clock()
    cache = make(1, clock, retained_information_period=100.0)
    fetch(cache, "a", clock)
    fetch(cache, "a", clock)
    fetch(cache, "b", clock)  # evicts a, retains its history
    assert cache.history("a") is not None
    clock.advance(1000.0)
    fetch(cache, "a", clock)
    hist = cache.history("a")
    assert hist is not None and hist[1] == -math.inf  # forgotten: treated as new

    bounded = LRUKCache(1, clock=clock, max_retained_history=10)
    for i in range(1000):
        fetch(bounded, i, clock)
    assert bounded.stats().retained_history <= 11


def test_oversized_value_is_not_cached() -> None:
    cache = LRUKCache(10)
    cache.put("small", b"12345")
    assert cache.put("big", b"x" * 11) is False
    assert not cache.contains("big") and cache.contains("small")
    st_ = cache.stats()
    assert st_.rejected == 1 and st_.bytes == 5 and st_.entries == 1


def test_stats_are_right() -> None:
    clock = Clock()
    cache = make(10, clock)
    assert fetch(cache, "a", clock, size=4) is False
    assert fetch(cache, "a", clock, size=4) is True
    assert fetch(cache, "b", clock, size=4) is False
    assert fetch(cache, "c", clock, size=4) is False  # evicts b (one reference)
    s = cache.stats()
    assert (s.hits, s.misses, s.evictions, s.inserts) == (1, 3, 1, 3)
    assert (s.bytes, s.entries, s.capacity_bytes) == (8, 2, 10)
    assert cache.contains("a") and cache.contains("c") and not cache.contains("b")
    assert s.hit_ratio == 0.25
    assert cache.pop("a") == b"xxxx" and cache.stats().bytes == 4


def test_replacing_a_resident_value_updates_bytes() -> None:
    cache = LRUKCache(10)
    cache.put("a", b"1234")
    cache.put("a", b"123456")
    assert cache.stats().bytes == 6 and cache.stats().inserts == 1
    cache.put("b", b"12345")  # 11 > 10: something goes
    assert cache.stats().bytes <= 10


ops = st.lists(
    st.tuples(
        st.sampled_from(["get", "put", "pop", "tick"]),
        st.integers(0, 30),
        st.integers(0, 40),
        st.floats(0, 3),
    ),
    max_size=300,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(0, 100), k=st.integers(1, 3), operations=ops)
def test_byte_budget_and_accounting_hold_under_random_workloads(
    capacity: int, k: int, operations: list[tuple[str, int, int, float]]
) -> None:
    clock = Clock(0.0)
    cache = LRUKCache(capacity, k=k, correlated_reference_period=1.0, retained_information_period=20.0,
                      max_retained_history=8, clock=clock)
    gets = 0
    for op, key, size, dt in operations:
        if op == "get":
            gets += 1
            cache.get(key)
        elif op == "put":
            ok = cache.put(key, bytes(size))
            assert ok == (size <= capacity)
        elif op == "pop":
            cache.pop(key)
        else:
            clock.advance(dt)
        s = cache.stats()
        assert s.bytes <= capacity
        resident = [cache.peek(key) for key in cache.keys()]
        assert s.bytes == sum(len(v) for v in resident) and s.entries == len(resident)
        assert s.retained_history <= 9
    s = cache.stats()
    assert s.hits + s.misses == gets


def test_internal_heaps_stay_bounded_under_many_hits() -> None:
    clock = Clock()
    cache = make(100, clock)
    for i in range(100):
        fetch(cache, i, clock)
    for _ in range(50):
        for i in range(100):
            fetch(cache, i, clock)
    assert len(cache._recent_heap) + len(cache._eligible_heap) <= 4 * 100 + 65
    assert len(cache._recent_fifo) <= 4 * 100 + 65


def test_concurrent_use_keeps_budget() -> None:
    cache = LRUKCache(5000, correlated_reference_period=0.0)

    def worker(seed: int) -> None:
        for i in range(2000):
            key = (seed * 7919 + i * 31) % 300
            if cache.get(key) is None:
                cache.put(key, bytes(key % 97 + 1))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = cache.stats()
    assert s.bytes <= 5000
    assert s.bytes == sum(len(cache.peek(k)) for k in cache.keys())  # type: ignore[arg-type]
    assert s.hits + s.misses == 8000


def test_bad_parameters_are_refused_with_config_error() -> None:
    with pytest.raises(ConfigError, match="k must be"):
        LRUKCache(10, k=0)
    with pytest.raises(ConfigError):
        LRUKCache(-1)
    with pytest.raises(ConfigError):
        LRUCache(-1)
