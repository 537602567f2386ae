"""Repair and scrub cores, driven by explicit calls so tests control time.

The server wires them to background threads: every ``repair_interval_s`` it
calls ``Repairer.step()``, and every second ``Scrubber.step(scrub_bytes_per_s)``.

Repairs are logged one line each (INFO when done, WARNING when a chunk's repair fails, on
its 1st, 2nd, 4th, 8th ... attempt). A full local disk (StoreFullError) pauses repair: it
is logged once at WARNING, nothing more is fetched until a back-off (30 s, doubling to 5 min)
has passed, and then one repair tries again; the first one that stores logs the disk as
writable again.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from paramserver.server.errors import ChunkCorruptError, ChunkNotFoundError, ParamServerError, StoreFullError
from paramserver.server.store import ChunkStore, StoredChunk

log = logging.getLogger(__name__)


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

    def retry_later(self, chunk_id: str) -> float:
        """Count a failed attempt and schedule the next; returns the delay (0 when not queued)."""
        with self._lock:
            item = self._items.get(chunk_id)
            if item is None:
                return 0.0
            item.attempts += 1
            delay = min(self.max_backoff_s, 0.5 * 2.0 ** item.attempts)
            item.next_try = self._clock() + delay
            return delay

    def defer(self, chunk_id: str, delay_s: float) -> None:
        """Try ``chunk_id`` again after ``delay_s`` without counting an attempt (the fault was ours)."""
        with self._lock:
            item = self._items.get(chunk_id)
            if item is not None:
                item.next_try = self._clock() + delay_s

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
    store_full: bool = False  # the local disk is full: repair is paused (nothing fetched) until the back-off ends


class Repairer:
    def __init__(
        self,
        store: ChunkStore,
        queue: RepairQueue,
        fetch: Fetcher,
        *,
        clock: Callable[[], float] = time.monotonic,
        full_backoff_s: float = 30.0,
        max_full_backoff_s: float = 300.0,
    ) -> None:
        self.store = store
        self.queue = queue
        self.fetch = fetch
        self.clock = clock
        self.full_backoff_s = full_backoff_s
        self.max_full_backoff_s = max_full_backoff_s
        self._full_until: float | None = None  # set while the local disk is full
        self._full_delay = full_backoff_s

    def step(self, limit: int = 64) -> RepairReport:
        if self._full_until is not None and self.clock() < self._full_until:
            return RepairReport(store_full=True)  # do not fetch what cannot be stored
        report = RepairReport()
        for item in self.queue.due(limit):
            try:
                chunk = self.fetch(item.chunk_id)
                if chunk is None:
                    raise ChunkNotFoundError(item.chunk_id, "no replica has an intact copy")
                self.store.put(chunk.id, chunk.data, chunk.codec, chunk.raw_size, chunk.crc32c)
            except StoreFullError as exc:
                self._disk_full(item, exc)
                report.failed.append(item.chunk_id)
                return RepairReport(report.repaired, report.failed, store_full=True)
            except (ParamServerError, OSError) as exc:
                delay = self.queue.retry_later(item.chunk_id)
                report.failed.append(item.chunk_id)
                attempts = item.attempts  # the queue's own item, counted by retry_later
                if attempts & (attempts - 1) == 0:  # 1st, 2nd, 4th, 8th ... failure: bounded log volume
                    log.warning("chunk repair failed: id=%s reason=%r attempts=%d error=%s; next try in %.0f s",
                                item.chunk_id, item.reason, attempts, exc, delay)
            else:
                self.queue.done(item.chunk_id)
                report.repaired.append(item.chunk_id)
                log.info("chunk repaired: id=%s reason=%r attempts=%d", item.chunk_id, item.reason, item.attempts + 1)
                if self._full_until is not None:
                    self._full_until, self._full_delay = None, self.full_backoff_s
                    log.info("repair resumed: the local chunk store accepts writes again (%s)", self.store.data_dir)
        return report

    def _disk_full(self, item: RepairItem, exc: StoreFullError) -> None:
        first = self._full_until is None
        if not first:
            self._full_delay = min(self.max_full_backoff_s, self._full_delay * 2)
        self._full_until = self.clock() + self._full_delay
        self.queue.defer(item.chunk_id, self._full_delay)
        if first:
            log.warning("repair paused: the local chunk store is full (%s); %d chunks wait, retrying every %.0f-%.0f s",
                        exc, len(self.queue), self.full_backoff_s, self.max_full_backoff_s)


@dataclass(frozen=True)
class ScrubReport:
    checked: int
    bytes_checked: int
    corrupt: list[str]
    finished_pass: bool  # the walk reached the end of the store (next step starts over)
    busy: bool = False  # the step ran at the busy rate (the store served traffic within the quiet time)


# What one chunk's check costs besides its bytes (index lookup, read call, header checks, the
# hash's set-up), counted as bytes: about what a check of that many more bytes costs here. Without
# it a store of 4 KiB chunks is checked at 16,000 chunks a second for the same byte budget, most of
# a core, and a loaded server starves its own Raft ticks.
SCRUB_CHUNK_OVERHEAD_BYTES = 64 << 10


class TrafficWatch:
    """Whether a store is serving traffic: its ``traffic`` count grew within the last ``quiet_s``.

    Asked once per scrub step. ``count`` is only read, never reset: the read and write paths pay
    one integer increment a call and take no lock for it (a lost increment under threads only
    delays "busy" by a step)."""

    def __init__(self, count: Callable[[], int], quiet_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.count = count
        self.quiet_s = quiet_s
        self.clock = clock
        self._seen = count()
        self._busy_until = float("-inf")

    def busy(self) -> bool:
        now, seen = self.clock(), self.count()
        if seen != self._seen:
            self._seen = seen
            self._busy_until = now + self.quiet_s
        return now < self._busy_until


class Scrubber:
    """Walks the store verifying id, CRC32C and content id, a bounded amount of work per step.

    The budget counts *raw* (decoded) bytes, the work a check really costs: a small stored
    chunk that inflates to 64 MiB costs 64 MiB; and each chunk costs SCRUB_CHUNK_OVERHEAD_BYTES
    more, so small chunks do not multiply the CPU the scrubber takes. A chunk that overruns a
    step's budget is paid for by the next steps (they check nothing until the debt is paid), so
    the long-run rate stays at ``budget_bytes`` per step. Corrupt chunks are quarantined by the
    store and added to the repair queue. Reports and metrics count the bytes checked, not the charge.

    With ``traffic`` (a TrafficWatch of the store), a step while the store serves reads or writes
    gets ``busy_fraction`` of its budget: the scrubber re-reads and re-hashes every byte it checks,
    and on a server whose cores also receive a push or serve a load that work is taken from them.
    The fraction is not zero, so a server that is never idle is still scrubbed, more slowly.
    """

    def __init__(self, store: ChunkStore, queue: RepairQueue, *, traffic: TrafficWatch | None = None,
                 busy_fraction: float = 1.0) -> None:
        if not 0.0 <= busy_fraction <= 1.0:
            raise ValueError(f"busy_fraction must be within [0, 1], got {busy_fraction}")
        self.store = store
        self.queue = queue
        self.traffic = traffic
        self.busy_fraction = busy_fraction
        self.busy_steps = 0  # steps run at the busy rate, for /metrics
        self._walk: Iterator[str] | None = None
        self._debt = 0  # raw bytes checked beyond earlier steps' budgets
        self.passes = 0
        # Since start, for /metrics: chunks and raw bytes proven, chunks found corrupt.
        self.checked_total = 0
        self.bytes_total = 0
        self.corrupt_total = 0

    def step(self, budget_bytes: int) -> ScrubReport:
        checked = nbytes = charged = 0
        corrupt: list[str] = []
        finished = False
        busy = self.traffic is not None and self.traffic.busy()
        if busy:
            self.busy_steps += 1
            budget_bytes = int(budget_bytes * self.busy_fraction)
        if self._debt >= budget_bytes:
            self._debt -= budget_bytes
            return ScrubReport(0, 0, corrupt, False, busy)
        budget, self._debt = budget_bytes - self._debt, 0
        if self._walk is None:
            self._walk = self.store.iter_ids()
        while charged < budget:
            chunk_id = next(self._walk, None)
            if chunk_id is None:
                self._walk = None
                self.passes += 1
                finished = True
                break
            charged += SCRUB_CHUNK_OVERHEAD_BYTES
            try:
                chunk = self.store.verify(chunk_id)
                size = max(chunk.raw_size, chunk.stored_size)
                nbytes += size
                charged += size
            except ChunkNotFoundError:
                continue  # deleted since the walk listed it
            except ChunkCorruptError:
                corrupt.append(chunk_id)
                self.queue.add(chunk_id, "scrub found corruption")
            except ParamServerError:
                continue  # unknown codec: cannot prove, do not condemn
            checked += 1
        self._debt = max(0, charged - budget)
        self.checked_total += checked
        self.bytes_total += nbytes
        self.corrupt_total += len(corrupt)
        return ScrubReport(checked, nbytes, corrupt, finished, busy)


__all__ = ["RepairQueue", "RepairItem", "Repairer", "RepairReport", "SCRUB_CHUNK_OVERHEAD_BYTES", "Scrubber", "ScrubReport", "Fetcher",
           "TrafficWatch"]
