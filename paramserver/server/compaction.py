"""Compaction of the chunk store's segment files: give back the space of deleted and quarantined chunks.

A segment is append-only: a deleted chunk's record (and the tombstone that killed it) stay in
their segment until the segment is rewritten. ``Compactor.step`` picks a sealed segment whose live
fraction fell below ``compact_live_fraction`` (or, emptiest first, any segment with dead bytes while
the store's dead bytes exceed ``compact_dead_ratio`` of its live bytes), copies its live records to
the active segment in small batches (each record checked on the way; a bad one is quarantined, never
copied), swaps each index entry only if it is unchanged, and removes the file once the copies are
durable. Reads and writes go on meanwhile: a read holds the old file open until it ends, a delete of
a chunk being moved kills both copies. The I/O (bytes read + written) is bounded by a token bucket
filled at ``compact_bytes_per_s`` by an injected clock:

    compactor = Compactor(store)
    Periodic("compact", store.config.compact_interval_s, compactor.step).start()

Orphans are not found here: the orphan collector (``paramserver.server.gc``) deletes them, and the
next compaction gives their space back.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from paramserver.server.errors import StoreFullError
from paramserver.server.records import SEG_HEADER_SIZE
from paramserver.server.store import ChunkStore, StoreConfig

log = logging.getLogger(__name__)

_BATCH_BYTES = 4 << 20


@dataclass
class CompactReport:
    segment: int | None = None  # the segment being rewritten, if any
    bytes_read: int = 0
    bytes_written: int = 0
    removed: list[int] = field(default_factory=list)  # segments removed by this step
    sealed: int | None = None  # the active segment, sealed to be rewritten
    skipped_reason: str = ""


class Compactor:
    def __init__(self, store: ChunkStore, config: StoreConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 batch_bytes: int = _BATCH_BYTES) -> None:
        self.store = store
        self.config = (config or store.config).validate()
        self.clock = clock
        self.batch_bytes = batch_bytes
        self._tokens = 0.0
        self._last: float | None = None
        self._job: int | None = None
        self._todo: list[str] = []
        self._full_logged = False
        self.segments_removed = 0

    # ------------------------------------------------------------- policy

    def pick(self) -> int | None:
        """The segment to rewrite next (sealing the active one first when it is the one), or None."""
        usage = self.store.segment_usage()
        live = sum(u[2] for u in usage)
        dead_of = {no: max(0, size - SEG_HEADER_SIZE - live_) for no, size, live_, _sealed in usage}
        data_of = {no: max(1, size - SEG_HEADER_SIZE) for no, size, _live, _sealed in usage}
        dead = sum(dead_of.values())
        over = dead > self.config.compact_dead_ratio * live
        candidates: list[tuple[bool, float, int]] = []  # (is the active one, live fraction, segment)
        for no, _size, live_, sealed in usage:
            if dead_of[no] <= 0:
                continue
            fraction = live_ / data_of[no]
            if fraction < self.config.compact_live_fraction or over:
                candidates.append((not sealed, fraction, no))
        if not candidates:
            return None
        active, _fraction, no = min(candidates)  # sealed ones first, the emptiest first
        if active and self.store.seal_active() != no:
            return None
        return no

    # ------------------------------------------------------------- work

    def step(self) -> CompactReport:
        """One bounded step: spend the I/O budget accrued since the last step on the current rewrite."""
        report = CompactReport()
        now = self.clock()
        rate = float(self.config.compact_bytes_per_s)
        if self._last is None:
            self._last = now - self.config.compact_interval_s
        burst = max(rate * 2 * self.config.compact_interval_s, float(self.batch_bytes))
        self._tokens = min(burst, self._tokens + rate * max(0.0, now - self._last))
        self._last = now
        if self._tokens <= 0:
            report.skipped_reason = "I/O budget spent"
            return report
        try:
            self._work(report)
        except StoreFullError as exc:
            report.skipped_reason = "disk full"
            if not self._full_logged:
                self._full_logged = True
                log.warning("compaction paused: no room to copy live records (%s)", exc)
            return report
        if self._full_logged and (report.bytes_written or report.removed):
            self._full_logged = False
            log.info("compaction resumed (%s)", self.store.data_dir)
        return report

    def _work(self, report: CompactReport) -> None:
        while self._tokens > 0:
            if self._job is None:
                before = self.store.stats().segments
                picked = self.pick()
                if picked is None:
                    return
                if self.store.stats().segments != before:
                    report.sealed = picked
                self._job = picked
                self._todo = self.store.live_records(picked)
            report.segment = self._job
            if self._todo:
                batch: list[str] = []
                nbytes = 0
                sizes = self.store.record_sizes(self._todo[:256])
                for chunk_id, size in zip(self._todo[:256], sizes):
                    if batch and nbytes + size > self.batch_bytes:
                        break
                    batch.append(chunk_id)
                    nbytes += size
                read, written = self.store.move_records(self._job, batch)
                del self._todo[:len(batch)]
                report.bytes_read += read
                report.bytes_written += written
                self._tokens -= read + written
                continue
            left = self.store.live_records(self._job)
            if left:  # a put raced the snapshot (cannot happen to a sealed segment) or a move failed
                self._todo = left
                continue
            job, self._job = self._job, None
            if not self.store.remove_segment(job):
                return  # records still being written into it: try again next step
            report.removed.append(job)
            self.segments_removed += 1
            log.info("compaction removed segment %d of %s", job, self.store.data_dir)

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        """Compact until nothing qualifies (ignoring the I/O budget): segments removed. For tests and tools."""
        removed = 0
        for _ in range(max_steps):
            self._tokens = float("inf")
            report = CompactReport()
            self._work(report)
            removed += len(report.removed)
            if self._job is None and not report.removed and report.segment is None:
                break
        self._tokens = 0.0
        return removed


__all__ = ["Compactor", "CompactReport"]
