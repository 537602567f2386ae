"""LRU-K page replacement (O'Neil, O'Neil and Weikum, SIGMOD 1993) over a byte budget.

Each resident key keeps HIST, the times of its last K *uncorrelated* references, and LAST, the
time of its most recent reference. References closer than the correlated reference period (CRP)
to LAST are one burst: they move LAST but do not shift HIST. When a burst ends and a new
uncorrelated reference arrives, the older HIST entries are shifted forward by the burst's length,
so the burst is collapsed to a point (the paper's ``correl_period_of_refd_page``).

The victim is the key with the largest backward K-distance, i.e. the oldest HIST[K]; keys with
fewer than K references have infinite distance and go first, oldest LAST first. Keys still inside
their CRP are not evicted while any other key can be. After eviction the history is retained for
the retained information period (RIP), bounded in count, so a key that comes back soon keeps its
earlier references.

Values are bytes-like; their size is ``memoryview(value).nbytes`` unless given. A value larger
than the whole capacity is not cached: ``put`` returns False and counts it as ``rejected``.

Cost: O(log n) amortised per operation. Two heaps hold resident keys by priority (those still
inside their CRP and those past it) with lazy invalidation by a per-key sequence number; a FIFO
by LAST moves keys from the first heap to the second as their CRP expires.
"""
from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from worker.errors import ConfigError

NEVER = -math.inf


def value_size(value: Any) -> int:
    """Bytes a bytes-like value occupies (bytes, bytearray, memoryview, numpy array)."""
    return memoryview(value).nbytes


@dataclass
class CacheCounters:
    """What every byte-budget cache (``LRUKCache``, ``LRUCache``, ``DiskCache``) counts, under the
    cache's own lock; ``snapshot`` gives them to its stats."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    rejected: int = 0

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class CacheStats:
    """A consistent snapshot of one cache's counters."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    rejected: int = 0
    bytes: int = 0
    entries: int = 0
    capacity_bytes: int = 0
    retained_history: int = 0

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Entry:
    __slots__ = ("value", "size", "hist", "last", "seq", "eligible")

    def __init__(self, value: Any, size: int, hist: list[float], last: float, seq: int) -> None:
        self.value = value
        self.size = size
        self.hist = hist  # hist[0] is the most recent uncorrelated reference, hist[K-1] the K-th
        self.last = last
        self.seq = seq
        self.eligible = False  # True once now - last > CRP


class LRUKCache:
    """Thread-safe LRU-K cache of bytes-like values under a byte budget."""

    def __init__(
        self,
        capacity_bytes: int,
        k: int = 2,
        correlated_reference_period: float = 0.5,
        retained_information_period: float = 3600.0,
        max_retained_history: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[Hashable, Any], None] | None = None,
    ) -> None:
        """``on_evict(key, value)`` runs (under the cache's lock, which is re-entrant) after an
        entry is evicted to make room; it may ``pop`` other keys."""
        if capacity_bytes < 0:
            raise ConfigError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        if correlated_reference_period < 0 or retained_information_period < 0 or max_retained_history < 0:
            raise ConfigError("correlated/retained periods and max_retained_history must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.k = k
        self.crp = correlated_reference_period
        self.rip = retained_information_period
        self.max_retained = max_retained_history
        self._clock = clock
        self.on_evict = on_evict
        self._lock = threading.RLock()
        self._entries: dict[Hashable, _Entry] = {}
        self._bytes = 0
        self._seq = 0
        # Priority (hist[K-1], last): smallest first = largest backward K-distance, ties LRU.
        self._recent_heap: list[tuple[float, float, int, Hashable]] = []
        self._eligible_heap: list[tuple[float, float, int, Hashable]] = []
        self._recent_fifo: deque[tuple[float, int, Hashable]] = deque()
        # Evicted keys' (hist, last), with a heap by last for RIP and count-bounded expiry.
        self._retained: dict[Hashable, tuple[list[float], float]] = {}
        self._retained_heap: list[tuple[float, int, Hashable]] = []
        self._count = CacheCounters()

    # -- public API ---------------------------------------------------------------------------

    def get(self, key: Hashable, hits: int = 1) -> Any | None:
        """The cached value (a reference to it), or None on a miss (not a reference). ``hits``: the
        lookups this one reference answers (a batch of hits on one entry, e.g. a held load)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._count.misses += hits
                return None
            self._count.hits += hits
            self._reference(key, entry, self._clock())
            return entry.value

    def peek(self, key: Hashable) -> Any | None:
        """The cached value without counting a reference, a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.value

    def contains(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    __contains__ = contains

    def contains_many(self, keys: Iterable[Hashable]) -> list[bool]:
        """``contains`` of each key, under one acquisition of the lock (a manifest's every chunk)."""
        with self._lock:
            entries = self._entries
            return [key in entries for key in keys]

    def put(self, key: Hashable, value: Any, size: int | None = None) -> bool:
        """Cache ``value`` under ``key``; True when it is resident afterwards.

        Putting a key that is not resident is a reference (the miss that fetched it). Putting a
        resident key replaces its value without counting another reference, so get-miss-then-put
        and get-hit-then-put both count once. A value larger than the capacity is not cached
        (False, counted as ``rejected``; an older value under that key is dropped).
        """
        nbytes = value_size(value) if size is None else size
        with self._lock:
            return self._put(key, value, nbytes, self._clock())

    def put_many(self, items: Iterable[tuple[Hashable, Any, int]]) -> None:
        """``put(key, value, size)`` of each item under one acquisition of the lock (a batch of
        chunks that landed together)."""
        with self._lock:
            now = self._clock()
            for key, value, nbytes in items:
                self._put(key, value, nbytes, now)

    def pop(self, key: Hashable) -> Any | None:
        """Remove ``key`` and return its value (its history is retained as for an eviction)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._remove(key, entry, retain=True)
            return entry.value

    def clear(self) -> None:
        """Drop every value and all retained history; counters are kept."""
        with self._lock:
            self._entries.clear()
            self._retained.clear()
            self._recent_heap.clear()
            self._eligible_heap.clear()
            self._recent_fifo.clear()
            self._retained_heap.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                **self._count.snapshot(),
                bytes=self._bytes,
                entries=len(self._entries),
                capacity_bytes=self.capacity_bytes,
                retained_history=len(self._retained),
            )

    def history(self, key: Hashable) -> tuple[float, ...] | None:
        """HIST of a resident or retained key, most recent first (for tests and debugging)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return tuple(entry.hist)
            kept = self._retained.get(key)
            return None if kept is None else tuple(kept[0])

    def keys(self) -> Iterator[Hashable]:
        with self._lock:
            return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    # -- internals (called with the lock held) ------------------------------------------------

    def _put(self, key: Hashable, value: Any, nbytes: int, now: float) -> bool:
        entry = self._entries.get(key)
        if nbytes > self.capacity_bytes:
            self._count.rejected += 1
            if entry is not None:
                self._remove(key, entry, retain=True)
            return False
        if entry is not None:
            self._bytes += nbytes - entry.size
            entry.value, entry.size = value, nbytes
            self._make_room(0, now, protect=key)
            return True
        self._make_room(nbytes, now, protect=None)
        hist, last = self._retained.pop(key, (None, NEVER))
        if hist is None or now - last > self.rip:
            hist = [NEVER] * self.k
        else:
            # A miss is always an uncorrelated reference: shift the history by one.
            hist = [now] + hist[: self.k - 1]
        hist[0] = now
        self._seq += 1
        entry = _Entry(value, nbytes, hist, now, self._seq)
        self._entries[key] = entry
        self._bytes += nbytes
        self._count.inserts += 1
        self._index(key, entry)
        return True

    def _reference(self, key: Hashable, entry: _Entry, now: float) -> None:
        if now - entry.last > self.crp:
            # A new uncorrelated reference closes the previous burst; collapse it to a point.
            correlated = entry.last - entry.hist[0]
            hist = entry.hist
            for i in range(self.k - 1, 0, -1):
                hist[i] = hist[i - 1] + correlated
            hist[0] = now
        entry.last = now
        self._seq += 1
        entry.seq = self._seq
        entry.eligible = False
        self._index(key, entry)

    def _index(self, key: Hashable, entry: _Entry) -> None:
        heapq.heappush(self._recent_heap, (entry.hist[-1], entry.last, entry.seq, key))
        self._recent_fifo.append((entry.last, entry.seq, key))
        # Lazy invalidation leaves stale tuples behind; rebuild before they dominate.
        if len(self._recent_heap) + len(self._eligible_heap) > 4 * len(self._entries) + 64:
            self._rebuild_heaps()

    def _rebuild_heaps(self) -> None:
        recent: list[tuple[float, float, int, Hashable]] = []
        eligible: list[tuple[float, float, int, Hashable]] = []
        for key, e in self._entries.items():
            (eligible if e.eligible else recent).append((e.hist[-1], e.last, e.seq, key))
        heapq.heapify(recent)
        heapq.heapify(eligible)
        self._recent_heap, self._eligible_heap = recent, eligible
        self._recent_fifo = deque(
            (last, seq, key)
            for last, seq, key in self._recent_fifo
            if (entry := self._entries.get(key)) is not None and entry.seq == seq and not entry.eligible
        )

    def _age(self, now: float) -> None:
        """Move keys whose correlated period has ended into the eligible heap."""
        fifo = self._recent_fifo
        while fifo and now - fifo[0][0] > self.crp:
            _last, seq, key = fifo.popleft()
            e = self._entries.get(key)
            if e is not None and e.seq == seq and not e.eligible:
                e.eligible = True
                heapq.heappush(self._eligible_heap, (e.hist[-1], e.last, e.seq, key))

    def _pop_valid(self, heap: list[tuple[float, float, int, Hashable]], eligible: bool, protect: Hashable | None) -> Hashable | None:
        skipped = None
        while heap:
            _p, _l, seq, key = heap[0]
            e = self._entries.get(key)
            if e is None or e.seq != seq or e.eligible != eligible:
                heapq.heappop(heap)
                continue
            if key == protect:
                skipped = heapq.heappop(heap)
                continue
            if skipped is not None:
                heapq.heappush(heap, skipped)
            return key
        if skipped is not None:
            heapq.heappush(heap, skipped)
        return None

    def _make_room(self, nbytes: int, now: float, protect: Hashable | None) -> None:
        if self._bytes + nbytes <= self.capacity_bytes:
            return
        self._age(now)
        while self._bytes + nbytes > self.capacity_bytes:
            key = self._pop_valid(self._eligible_heap, True, protect)
            if key is None:
                # Every candidate is inside its correlated period: evict the best of those.
                key = self._pop_valid(self._recent_heap, False, protect)
            if key is None:
                break  # only the protected key is left and it fits by construction
            entry = self._entries[key]
            self._remove(key, entry, retain=True)
            self._count.evictions += 1
            if self.on_evict is not None:
                self.on_evict(key, entry.value)

    def _remove(self, key: Hashable, entry: _Entry, retain: bool) -> None:
        del self._entries[key]
        self._bytes -= entry.size
        if retain and self.max_retained > 0:
            self._retained[key] = (entry.hist, entry.last)
            heapq.heappush(self._retained_heap, (entry.last, entry.seq, key))
            self._expire_retained(self._clock())

    def _expire_retained(self, now: float) -> None:
        heap, kept = self._retained_heap, self._retained
        while heap:
            last, _seq, key = heap[0]
            record = kept.get(key)
            if record is None or record[1] != last:
                heapq.heappop(heap)  # stale: key came back or was replaced
                continue
            if now - last > self.rip or len(kept) > self.max_retained:
                heapq.heappop(heap)
                del kept[key]
                continue
            break
        if len(heap) > 4 * len(kept) + 64:
            # Fresh tie-breakers so keys themselves are never compared.
            self._retained_heap = [(last, i, key) for i, (key, (_h, last)) in enumerate(kept.items())]
            heapq.heapify(self._retained_heap)
