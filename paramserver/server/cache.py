"""A thread-safe LRU of verified chunks with a byte budget (the server's hot tier).

Entries are put here only after passing verification, so a hit is served
without re-reading the disk. Chunks larger than a quarter of the budget are
not cached: one huge chunk must not flush the whole hot set.

Scans (``put(..., scan=True)``: the store's batch reads, a load or pull walking a
model in order) do not evict what was used within ``scan_protect_s``: a model
larger than the cache would otherwise evict each chunk before its next load
reached it, so every read missed and also paid an insertion and an eviction.
Instead the part that fits stays and is hit on every load; once nothing in the
cache has been used for ``scan_protect_s``, scans take it over again.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Iterable, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class CacheStats:
    capacity_bytes: int
    used_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    scan_skips: int = 0  # scan puts not admitted: they would have evicted entries in use


class ByteLRU(Generic[K, V]):
    def __init__(self, capacity_bytes: int, *, scan_protect_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if scan_protect_s < 0:
            raise ValueError(f"scan_protect_s must be >= 0, got {scan_protect_s}")
        self.capacity_bytes = capacity_bytes
        self.scan_protect_s = scan_protect_s
        self.clock = clock
        self._items: OrderedDict[K, tuple[V, int, float]] = OrderedDict()  # value, bytes, last use
        self._used = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._scan_skips = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._misses += 1
                return None
            self._items[key] = (item[0], item[1], self.clock())
            self._items.move_to_end(key)
            self._hits += 1
            return item[0]

    def get_many(self, keys: Sequence[K]) -> list[V | None]:
        """``get`` of each key under one acquisition of the lock."""
        out: list[V | None] = []
        with self._lock:
            items = self._items
            if not items:
                self._misses += len(keys)
                return [None] * len(keys)
            now = self.clock()
            hits = 0
            for key in keys:
                item = items.get(key)
                if item is None:
                    out.append(None)
                    continue
                items[key] = (item[0], item[1], now)
                items.move_to_end(key)
                hits += 1
                out.append(item[0])
            self._hits += hits
            self._misses += len(keys) - hits
        return out

    def put_many(self, entries: Iterable[tuple[K, V, int]], *, scan: bool = False) -> None:
        """``put`` of each ``(key, value, nbytes)``."""
        for key, value, nbytes in entries:
            self.put(key, value, nbytes, scan=scan)

    def put(self, key: K, value: V, nbytes: int, *, scan: bool = False) -> bool:
        """Insert (or refresh) ``key``; False when it is too large to cache, or (``scan``) when room
        for it would evict an entry used within ``scan_protect_s``."""
        if nbytes > self.capacity_bytes // 4:
            return False
        with self._lock:
            now = self.clock()
            items = self._items
            old = items.pop(key, None)
            if old is not None:
                self._used -= old[1]
            elif scan and self._used + nbytes > self.capacity_bytes:
                if self._evicts_recent(nbytes, now):
                    self._scan_skips += 1
                    return False
            items[key] = (value, nbytes, now)
            self._used += nbytes
            while self._used > self.capacity_bytes:
                _, (_, size, _last) = items.popitem(last=False)
                self._used -= size
                self._evictions += 1
            return True

    def _evicts_recent(self, nbytes: int, now: float) -> bool:
        """Whether room for ``nbytes`` would evict an entry used within scan_protect_s."""
        need = self._used + nbytes - self.capacity_bytes
        for _value, size, last in self._items.values():  # least recently used first
            if need <= 0:
                return False
            if now - last < self.scan_protect_s:
                return True
            need -= size
        return False

    def discard(self, key: K) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._used -= old[1]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def contains_many(self, keys: Iterable[object]) -> list[bool]:
        with self._lock:
            items = self._items
            return [key in items for key in keys]

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.capacity_bytes, self._used, len(self._items), self._hits, self._misses, self._evictions,
                              self._scan_skips)


__all__ = ["ByteLRU", "CacheStats"]
