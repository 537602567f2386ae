"""Memory tier (LRU-K) over an optional disk tier, with per-tier counters."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from worker.config import CacheConfig
from worker.disk_cache import DiskCache
from worker.lru_k import LRUKCache

Tier = Literal["memory", "disk"]


class Lookup(NamedTuple):
    """A cache answer: the raw chunk bytes and the tier that served them (both None on a miss)."""

    value: Any | None
    tier: Tier | None


class TieredCache:
    """``get`` looks in memory, then on disk (promoting a disk hit into memory); ``put`` writes both.

    The disk tier is write-through so a chunk survives a worker restart as soon as it was fetched.
    """

    def __init__(self, memory: LRUKCache, disk: DiskCache | None = None) -> None:
        self.memory = memory
        self.disk = disk
        memory.on_evict = self._evicted
        self._lock = threading.Lock()
        # Held groups (worker.prefetch.HeldGroup) by manifest id: the memory tier's views of one
        # load's host arena, which a later load of that manifest may be given (``adopt``).
        self._groups: dict[str, Any] = {}
        self._adopt_lock = threading.Lock()
        self._lookups = 0
        self._full_misses = 0

    @classmethod
    def from_config(
        cls,
        config: CacheConfig,
        clock: Callable[[], float] = time.monotonic,
        on_corrupt: Callable[[str, str], None] | None = None,
    ) -> TieredCache:
        config.validate()
        memory = LRUKCache(
            config.memory_bytes,
            k=config.k,
            correlated_reference_period=config.correlated_reference_period_s,
            retained_information_period=config.retained_information_period_s,
            max_retained_history=config.max_retained_history,
            clock=clock,
        )
        disk = None
        if config.disk_dir is not None:
            disk = DiskCache(config.disk_dir, config.disk_bytes, verify=config.disk_verify,
                             fsync=config.disk_fsync, on_corrupt=on_corrupt)
        return cls(memory, disk)

    def get(self, key: str) -> Lookup:
        value = self.memory.get(key)
        if value is not None:
            self._count(miss=False)
            return Lookup(value, "memory")
        if self.disk is not None:
            value = self.disk.get(key)
            if value is not None:
                self.memory.put(key, value)
                self._count(miss=False)
                return Lookup(value, "disk")
        self._count(miss=True)
        return Lookup(None, None)

    def put(self, key: str, value: Any) -> None:
        """Cache verified raw chunk bytes under their content id in every tier."""
        self.memory.put(key, value)
        if self.disk is not None:
            self.disk.put(key, value)

    def hold_group(self, manifest_id: str, group: Any) -> None:
        """Remember a completed load's held group (its entries are in the memory tier already)."""
        with self._lock:
            self._groups[manifest_id] = group

    def adopt(self, manifest_id: str, take: Callable[[Any], Any | None]) -> Any | None:
        """``take(group)`` for the held group of ``manifest_id``, one caller at a time: it returns
        what it made of the group's memory (new tensors on it), or None when that memory is still
        in use. Returns None when no group is held, or when ``take`` declined."""
        with self._adopt_lock:
            with self._lock:
                group = self._groups.get(manifest_id)
            if group is None or not group.keys:
                return None
            return take(group)

    def _evicted(self, key: object, value: Any) -> None:
        # Entries that view one load's tensors keep all of that memory alive: they live and die
        # together, so the budget they are charged is what they really hold.
        group: Any = getattr(value, "group", None)
        if group is None:
            return
        manifest_id: str = group.manifest_id
        with self._lock:
            if self._groups.get(manifest_id) is group:
                del self._groups[manifest_id]
        keys = group.keys
        for other in list(keys):
            held = self.memory.peek(other)
            if getattr(held, "group", None) is group:
                self.memory.pop(other)
        keys.clear()

    def contains(self, key: str) -> bool:
        return self.memory.contains(key) or (self.disk is not None and self.disk.contains(key))

    __contains__ = contains

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of each key, one lock acquisition per tier (a manifest's every chunk)."""
        held = self.memory.contains_many(keys)
        if self.disk is not None and not all(held):
            on_disk = self.disk.contains_many(keys)
            held = [m or d for m, d in zip(held, on_disk)]
        return held

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per tier, e.g. ``{"memory": {"hits": ..}, "disk": {..}, "total": {..}}``."""
        out = {"memory": self.memory.stats().as_dict()}
        if self.disk is not None:
            out["disk"] = self.disk.stats().as_dict()
        with self._lock:
            out["total"] = {"lookups": self._lookups, "hits": self._lookups - self._full_misses,
                            "misses": self._full_misses}
        return out

    def _count(self, miss: bool) -> None:
        with self._lock:
            self._lookups += 1
            self._full_misses += miss
