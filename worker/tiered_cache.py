"""Memory tier (LRU-K) over an optional disk tier, with per-tier counters.

Besides copies of chunks, the memory tier holds whole loads: a :class:`HeldGroup` is the bytes
of one completed load's tensors (views of them, not copies), and it is *one* entry of the LRU-K
tier, charged every byte it keeps alive, referenced by every hit on one of its chunks, and
evicted whole. One entry per load rather than one per chunk: a load of half a million 4 KiB
chunks would otherwise pay an LRU-K insertion and an object per chunk on its critical path.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from chunking.hashing import crc32c
from worker.config import CacheConfig
from worker.disk_cache import DiskCache
from worker.lru_k import LRUKCache

if TYPE_CHECKING:
    from chunking.chunk_table import ChunkTable
    from paramserver.client.hostmem import ArenaView

Tier = Literal["memory", "disk"]

Locate = Callable[[int], "memoryview | None"]  # manifest row -> the tensor bytes that chunk fills


class HeldGroup:
    """The chunks of one load that lie in its tensors: the memory tier keeps them as one entry.

    ``table``: the load's manifest chunks; which of its rows are held (a hit re-verifies them
    first) is one flag per row, set a batch at a time as the load lands them; ``locate(row)``:
    those bytes, as a slice of the host arena when there is one (``arena``: then a later load of
    ``manifest_id`` may be given that memory once nothing else uses it, ``TieredCache.adopt``) --
    never through the tensors, which the tier must not keep alive; ``crcs``: each row's CRC32C
    of its raw bytes (the manifest's, for raw chunks), with ``crc_of`` (by row) for the others.
    ``private``: no tensor on the arena was ever handed to a caller (a load onto a device staged
    it on the host), so only loads wrote its bytes and a load given it back skips re-verifying."""

    __slots__ = ("arena", "crc_of", "crcs", "held", "locate", "manifest_id", "private", "table")

    def __init__(self, manifest_id: str = "", arena: ArenaView | None = None, *, table: ChunkTable | None = None,
                 locate: Locate | None = None, crcs: Sequence[int] | np.ndarray | None = None) -> None:
        self.manifest_id = manifest_id
        self.arena = arena
        self.table = table
        self.held = np.zeros(len(table) if table is not None else 0, dtype=bool)
        self.locate = locate
        self.crcs = crcs
        self.crc_of: dict[int, int] = {}  # row of a compressed chunk -> CRC32C of its raw bytes
        self.private = False

    @property
    def tier_key(self) -> tuple[str, str, int]:
        return ("held", self.manifest_id, id(self))

    def mark(self, rows: np.ndarray) -> None:
        """The chunks of ``rows`` (their ids' first rows) now lie in place."""
        self.held[rows] = True

    def row(self, key: str) -> int | None:
        """The first row of chunk ``key`` when this group holds it."""
        if self.table is None or not len(self.held):
            return None
        row = self.table.first_row_of.get(key)
        return row if row is not None and self.held[row] else None

    def has(self, key: str) -> bool:
        return self.row(key) is not None

    def discard(self, key: str) -> None:
        row = self.row(key)
        if row is not None:
            self.held[row] = False

    def count(self) -> int:
        return int(np.count_nonzero(self.held))

    def clear(self) -> None:
        self.held[:] = False

    def chunk(self, key: str) -> HeldChunk | None:
        """The held bytes of chunk ``key`` (not yet re-verified), or None when this group lacks it."""
        row = self.row(key)
        if row is None or self.locate is None:
            return None
        view = self.locate(row)
        if view is None:
            return None
        crc = self.crc_of.get(row)
        if crc is None:
            assert self.crcs is not None
            crc = int(self.crcs[row])
        return HeldChunk(view, crc, self)


class HeldChunk:
    """A chunk of a held group: a view of a loaded tensor's bytes, with their CRC32C."""

    __slots__ = ("crc", "group", "view")

    def __init__(self, view: memoryview, crc: int, group: HeldGroup) -> None:
        self.view = view
        self.crc = crc
        self.group = group

    def intact(self) -> bool:
        return crc32c(self.view) == self.crc


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
        # Held groups in the memory tier, newest first; and those on a host arena by manifest id,
        # which a later load of that manifest may be given (``adopt``).
        self._held: tuple[HeldGroup, ...] = ()
        self._groups: dict[str, HeldGroup] = {}
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
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[Lookup]:
        """``get`` of each key; a held group is referenced once for all of its hits among them."""
        found: list[Lookup | None] = [None] * len(keys)
        with self._lock:
            groups = self._held
        for group in groups:
            n = 0
            for i, key in enumerate(keys):
                if found[i] is None and (chunk := group.chunk(key)) is not None:
                    found[i] = Lookup(chunk, "memory")
                    n += 1
            self.touch_group(group, n)
        return [hit if hit is not None else self._get_copy(key) for key, hit in zip(keys, found)]

    def _get_copy(self, key: str) -> Lookup:
        """A copy of chunk ``key`` in memory, else on disk (promoted into memory)."""
        value = self.memory.get(key)
        if value is not None:
            self._count(1, 0)
            return Lookup(value, "memory")
        if self.disk is not None:
            value = self.disk.get(key)
            if value is not None:
                self.memory.put(key, value)
                self._count(1, 0)
                return Lookup(value, "disk")
        self._count(1, 1)
        return Lookup(None, None)

    def put(self, key: str, value: Any) -> None:
        """Cache verified raw chunk bytes under their content id in every tier."""
        self.memory.put(key, value)
        if self.disk is not None:
            self.disk.put(key, value)

    def held(self, key: str) -> HeldChunk | None:
        """Chunk ``key`` of a held group (not re-verified), without counting a reference; or None."""
        with self._lock:
            groups = self._held
        for group in groups:
            chunk = group.chunk(key)
            if chunk is not None:
                return chunk
        return None

    def hold_group(self, group: HeldGroup, nbytes: int) -> bool:
        """Keep a completed load's chunks (``group``) as one memory-tier entry charged ``nbytes``
        (what it keeps alive); a group held already stays as it is. False when it does not fit."""
        with self._lock:
            if any(g is group for g in self._held):
                return True
            self._held = (group, *self._held)  # newest first; replaced, never changed: lookups take it unlocked
            if group.arena is not None:
                self._groups[group.manifest_id] = group
        # Outside the lock: making room evicts other entries, and _evicted takes it.
        if self.memory.put(group.tier_key, group, nbytes):
            return True
        self._drop_group(group)
        return False

    def forget(self, key: str, value: Any) -> None:
        """Drop ``key``: a held chunk that failed its re-verification, or a stale copy."""
        if isinstance(value, HeldChunk):
            with self._lock:
                value.group.discard(key)
        else:
            self.memory.pop(key)

    def _drop_group(self, group: HeldGroup) -> None:
        with self._lock:
            self._held = tuple(g for g in self._held if g is not group)
            if self._groups.get(group.manifest_id) is group:
                del self._groups[group.manifest_id]
            group.clear()

    def adopt(self, manifest_id: str, take: Callable[[HeldGroup], Any | None]) -> Any | None:
        """``take(group)`` for the held group of ``manifest_id``, one caller at a time: it returns
        what it made of the group's memory (new tensors on it), or None when that memory is still
        in use. Returns None when no group is held, or when ``take`` declined."""
        with self._adopt_lock:
            with self._lock:
                group = self._groups.get(manifest_id)
            if group is None or not group.count():
                return None
            return take(group)

    def holds_whole(self, manifest_id: str) -> bool:
        """Whether a held group of ``manifest_id`` has every one of its chunks (a load of it then
        asks the network for nothing, unless that memory is still in use)."""
        with self._lock:
            group = self._groups.get(manifest_id)
        if group is None or group.table is None:
            return False
        return bool(group.held[group.table.first_rows].all())

    def holds_most(self, manifest_id: str) -> bool:
        """Whether a held group of ``manifest_id`` has every chunk that lies whole in its tensors, and the
        memory tier every other one (a completed load of it, nothing of it evicted): what a worker
        announces to its peers as a version it holds whole."""
        with self._lock:
            group = self._groups.get(manifest_id)
        if group is None or group.table is None:
            return False
        rows = group.table.first_rows
        missing = rows[~group.held[rows]]
        if not len(missing):
            return True
        ids = group.table.ids
        return all(self.in_memory_many([ids[r] for r in missing.tolist()]))

    def touch_group(self, group: HeldGroup, hits: int) -> None:
        """Count ``hits`` chunks of ``group`` served at once: one reference of its tier entry."""
        if hits:
            self.memory.get(group.tier_key, hits=hits)
            self._count(hits, 0)

    def _evicted(self, key: object, value: Any) -> None:
        if isinstance(value, HeldGroup):
            self._drop_group(value)

    def in_memory(self, key: str) -> bool:
        with self._lock:
            groups = self._held
        return any(g.has(key) for g in groups) or self.memory.contains(key)

    def contains(self, key: str) -> bool:
        return self.in_memory(key) or (self.disk is not None and self.disk.contains(key))

    __contains__ = contains

    def in_memory_many(self, keys: Sequence[str]) -> list[bool]:
        """``in_memory`` of each key (held groups, then copies) under one acquisition of each lock."""
        held = self.memory.contains_many(keys)
        with self._lock:
            groups = self._held
        for group in groups:
            has = group.has
            held = [h or has(k) for k, h in zip(keys, held)]
        return held

    def empty(self) -> bool:
        """Nothing in any tier: a load can skip asking for each of its chunks."""
        with self._lock:
            groups = self._held
        return not groups and not len(self.memory) and (self.disk is None or not len(self.disk))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of each key, one lock acquisition per tier (a manifest's every chunk)."""
        held = self.in_memory_many(keys)
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
            out["memory"]["held_chunks"] = sum(g.count() for g in self._held)
        return out

    def _count(self, lookups: int, misses: int) -> None:
        with self._lock:
            self._lookups += lookups
            self._full_misses += misses
