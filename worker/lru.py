"""Plain LRU over a byte budget: the baseline the cache simulator compares LRU-K against."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from worker.errors import ConfigError
from worker.lru_k import CacheCounters, CacheStats, value_size


class LRUCache:
    """Thread-safe least-recently-used cache of bytes-like values; same API as ``LRUKCache``."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._data: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._count = CacheCounters()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                self._count.misses += 1
                return None
            self._count.hits += 1
            self._data.move_to_end(key)
            return item[0]

    def contains(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._data

    __contains__ = contains

    def put(self, key: Hashable, value: Any, size: int | None = None) -> bool:
        nbytes = value_size(value) if size is None else size
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if nbytes > self.capacity_bytes:
                self._count.rejected += 1
                return False
            while self._data and self._bytes + nbytes > self.capacity_bytes:
                _k, (_v, size_out) = self._data.popitem(last=False)
                self._bytes -= size_out
                self._count.evictions += 1
            self._data[key] = (value, nbytes)
            self._bytes += nbytes
            if old is None:
                self._count.inserts += 1
            return True

    def pop(self, key: Hashable) -> Any | None:
        with self._lock:
            item = self._data.pop(key, None)
            if item is None:
                return None
            self._bytes -= item[1]
            return item[0]

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                **self._count.snapshot(),
                bytes=self._bytes,
                entries=len(self._data),
                capacity_bytes=self.capacity_bytes,
            )

    def __len__(self) -> int:
        return len(self._data)
