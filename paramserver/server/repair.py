"""Repair and scrub cores, driven by explicit calls so tests control time.

The server wires them to background threads: every ``repair_interval_s`` it
calls ``Repairer.step()``, and every second ``Scrubber.step(scrub_bytes_per_s)``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from paramserver.server.errors import ChunkCorruptError, ChunkNotFoundError, ParamServerError
from paramserver.server.store import ChunkStore, StoredChunk


@dataclass
class RepairItem:
    chunk_id: str
    reason: str
    first_seen: float
    attempts: int = 0
    next_try: float = 0.0


class RepairQueue:
    """Chunks this server should (re)obtain from a healthy replica. Idempotent adds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_backoff_s: float = 60.0) -> None:
        self._items: dict[str, RepairItem] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self.max_backoff_s = max_backoff_s

    def add(self, chunk_id: str, reason: str) -> None:
        with self._lock:
            if chunk_id not in self._items:
                self._items[chunk_id] = RepairItem(chunk_id, reason, self._clock())

    def due(self, limit: int = 256) -> list[RepairItem]:
        now = self._clock()
        with self._lock:
            return [item for item in self._items.values() if item.next_try <= now][:limit]

    def done(self, chunk_id: str) -> None:
        with self._lock:
            self._items.pop(chunk_id, None)

    def retry_later(self, chunk_id: str) -> None:
        with self._lock:
            item = self._items.get(chunk_id)
            if item is not None:
                item.attempts += 1
                item.next_try = self._clock() + min(self.max_backoff_s, 0.5 * 2 ** item.attempts)

    def __contains__(self, chunk_id: object) -> bool:
        with self._lock:
            return chunk_id in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


# Fetch a verified copy of a chunk from some other replica; None when none has it.
Fetcher = Callable[[str], StoredChunk | None]


@dataclass(frozen=True)
class RepairReport:
    repaired: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class Repairer:
    def __init__(self, store: ChunkStore, queue: RepairQueue, fetch: Fetcher) -> None:
        self.store = store
        self.queue = queue
        self.fetch = fetch

    def step(self, limit: int = 64) -> RepairReport:
        report = RepairReport()
        for item in self.queue.due(limit):
            try:
                chunk = self.fetch(item.chunk_id)
                if chunk is None:
                    raise ChunkNotFoundError(item.chunk_id, "no replica has an intact copy")
                self.store.put(chunk.id, chunk.data, chunk.codec, chunk.raw_size, chunk.crc32c)
            except (ParamServerError, OSError):
                self.queue.retry_later(item.chunk_id)
                report.failed.append(item.chunk_id)
            else:
                self.queue.done(item.chunk_id)
                report.repaired.append(item.chunk_id)
        return report


@dataclass(frozen=True)
class ScrubReport:
    checked: int
    bytes_checked: int
    corrupt: list[str]
    finished_pass: bool  # the walk reached the end of the store (next step starts over)


class Scrubber:
    """Walks the store verifying CRC32C and content id, a bounded number of bytes per step.

    Corrupt chunks are quarantined by the store and added to the repair queue.
    """

    def __init__(self, store: ChunkStore, queue: RepairQueue) -> None:
        self.store = store
        self.queue = queue
        self._walk: Iterator[str] | None = None
        self.passes = 0

    def step(self, budget_bytes: int) -> ScrubReport:
        checked = nbytes = 0
        corrupt: list[str] = []
        finished = False
        if self._walk is None:
            self._walk = self.store.iter_ids()
        while nbytes < budget_bytes:
            chunk_id = next(self._walk, None)
            if chunk_id is None:
                self._walk = None
                self.passes += 1
                finished = True
                break
            try:
                chunk = self.store.verify(chunk_id)
                nbytes += chunk.stored_size
            except ChunkNotFoundError:
                continue  # deleted since the walk listed it
            except ChunkCorruptError:
                corrupt.append(chunk_id)
                self.queue.add(chunk_id, "scrub found corruption")
            except ParamServerError:
                continue  # unknown codec: cannot prove, do not condemn
            checked += 1
        return ScrubReport(checked, nbytes, corrupt, finished)


__all__ = ["RepairQueue", "RepairItem", "Repairer", "RepairReport", "Scrubber", "ScrubReport", "Fetcher"]
