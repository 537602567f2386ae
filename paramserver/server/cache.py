"""A thread-safe LRU of verified chunks with a byte budget (the server's hot tier).

Entries are put here only after passing verification, so a hit is served
without re-reading the disk. Chunks larger than a quarter of the budget are
not cached: one huge chunk must not flush the whole hot set.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Hashable, Iterable, TypeVar

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


class ByteLRU(Generic[K, V]):
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._misses += 1
                return None
            self._items.move_to_end(key)
            self._hits += 1
            return item[0]

    def put(self, key: K, value: V, nbytes: int) -> bool:
        """Insert (or refresh) ``key``; False when it is too large to cache."""
        if nbytes > self.capacity_bytes // 4:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._used -= old[1]
            self._items[key] = (value, nbytes)
            self._used += nbytes
            while self._used > self.capacity_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self._used -= size
                self._evictions += 1
            return True

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
            return CacheStats(self.capacity_bytes, self._used, len(self._items), self._hits, self._misses, self._evictions)


__all__ = ["ByteLRU", "CacheStats"]
