"""Aggregation of workers' heat reports: which chunks of a version are read, how
often, and in what order they are first needed. Kept in memory on each server and
saved to ``DATA_DIR/heat.npz`` every few seconds while it changes and at shutdown
(``HeatSnapshots``), so a restarted server still orders the first loads after it.
Advisory data: a missing or damaged file costs prefetch quality, never correctness,
so it is written without fsync and a file that cannot be read is logged and ignored.

Bounded (issue 11): a server keeps heat for at most ``max_versions`` versions and
``max_entries`` chunk slots over all of them (``BYTES_PER_ENTRY`` bytes each, so
about 40 MiB at the defaults), dropping the least recently reported version first;
a version's table has one slot per chunk of the version and never grows past it.
One report's work is a few vectorised passes over its bytes (numpy), a few
milliseconds per MiB, never a Python step per entry (the entries' codec is
``paramserver.wire.heat_entries``, shared with the workers that send reports).
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
from numpy.typing import NDArray

from paramserver.wire.heat_entries import U64, HeatArrays, HeatEntry, encode_entries
from paramserver.wire.proto import pb

# Per chunk slot of a version's table: count (8) + sum of first-access ranks (8) + reports (4).
BYTES_PER_ENTRY = 20
DEFAULT_MAX_ENTRIES = 2 << 20  # chunk slots over all versions (~40 MiB)
DEFAULT_MAX_VERSIONS = 1024
COUNT_CAP = 1 << 32  # one entry's count is clamped here; sums saturate at SUM_CAP
SUM_CAP = 1 << 62
HEAT_FILE = "heat.npz"  # in the data dir
SAVE_INTERVAL_S = 10.0

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ the aggregator


@dataclass
class _Table:
    size: int
    count: NDArray[np.int64]
    order_sum: NDArray[np.int64]
    hits: NDArray[np.uint32]
    reports: int = 0
    reply: bytes | None = field(default=None)  # the encoded GetHeatReply, until the next report

    @classmethod
    def empty(cls, size: int) -> _Table:
        return cls(size, np.zeros(size, np.int64), np.zeros(size, np.int64), np.zeros(size, np.uint32))

    def grow(self, size: int) -> None:
        pad = size - self.size
        self.count = np.concatenate((self.count, np.zeros(pad, np.int64)))
        self.order_sum = np.concatenate((self.order_sum, np.zeros(pad, np.int64)))
        self.hits = np.concatenate((self.hits, np.zeros(pad, np.uint32)))
        self.size = size


class HeatAggregator:
    """Heat per (model, version), bounded in versions and in chunk slots (see the module doc)."""

    def __init__(self, max_versions: int = DEFAULT_MAX_VERSIONS, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_versions < 1 or max_entries < 1:
            raise ValueError("max_versions and max_entries must be >= 1")
        self._tables: OrderedDict[tuple[str, int], _Table] = OrderedDict()  # least recently reported first
        self._entries = 0  # chunk slots over all tables
        self._lock = threading.Lock()
        self.max_versions = max_versions
        self.max_entries = max_entries
        self._changes = 0  # reports taken; save() writes only when this moved since the last save
        self._saved = 0
        # ReportHeat calls whose entries were parsed, and those refused before any parse (too large,
        # unknown model or version, no header): exported as metrics, so a flood is visible.
        self.parsed_reports = 0
        self.refused_unparsed = 0

    def count_call(self, parsed: bool) -> None:
        with self._lock:
            if parsed:
                self.parsed_reports += 1
            else:
                self.refused_unparsed += 1

    @property
    def entries(self) -> int:
        """Chunk slots held over all versions (``BYTES_PER_ENTRY`` bytes each)."""
        return self._entries

    @property
    def versions(self) -> int:
        return len(self._tables)

    def memory_bytes(self) -> int:
        return self._entries * BYTES_PER_ENTRY

    def _evict_for(self, key: tuple[str, int], slots: int) -> None:
        """Drop the least recently reported versions (never ``key``) until ``slots`` more chunk
        slots fit, and for a new ``key`` one more version."""
        while (self._entries + slots > self.max_entries
               or (key not in self._tables and len(self._tables) >= self.max_versions)):
            victim = next((k for k in self._tables if k != key), None)
            if victim is None:
                return
            self._entries -= self._tables.pop(victim).size

    def report(self, model: str, version: int, entries: Iterable[HeatEntry] | HeatArrays, *, size: int | None = None) -> None:
        """Add one report. ``size``: the version's chunk count (indexes must be below it); None
        sizes the table by the largest index seen (a server without a metadata plane)."""
        arrays = HeatArrays.of(entries)
        n = len(arrays)
        needed = int(arrays.index.max()) + 1 if n else 0
        if size is not None and needed > size:
            raise ValueError(f"chunk_index {needed - 1} is out of range: the version has {size} chunks")
        want = size if size is not None else needed
        if want > self.max_entries:
            raise ValueError(f"heat for {want} chunks is more than this server keeps ({self.max_entries})")
        key = (model, version)
        idx = arrays.index.astype(np.intp)
        counts = np.minimum(arrays.count, np.uint64(COUNT_CAP)).astype(np.int64)
        ranks = np.minimum(arrays.order, np.uint64(COUNT_CAP)).astype(np.int64)
        with self._lock:
            table = self._tables.get(key)
            grow = want - (table.size if table is not None else 0)
            if grow > 0:
                self._evict_for(key, grow)
                table = self._tables.get(key)  # still there: eviction never drops ``key``
                if table is None:
                    table = self._tables[key] = _Table.empty(want)
                else:
                    table.grow(want)
                self._entries += grow
            assert table is not None
            if n:
                np.add.at(table.count, idx, counts)
                np.add.at(table.order_sum, idx, ranks)
                np.add.at(table.hits, idx, np.uint32(1))
                np.minimum(table.count, SUM_CAP, out=table.count)
                np.minimum(table.order_sum, SUM_CAP, out=table.order_sum)
            table.reports = min(table.reports + 1, 0xFFFFFFFF)
            table.reply = None
            self._tables.move_to_end(key)
            self._changes += 1

    def save(self, path: Path) -> bool:
        """Write every version's table to ``path`` (a temporary file, then a rename) if a report
        arrived since the last save; True when it wrote."""
        with self._lock:
            if self._changes == self._saved:
                return False
            changes = self._changes
            tables = list(self._tables.items())  # least recently reported first, as load() rebuilds them
            meta = [{"model": m, "version": v, "size": t.size, "reports": t.reports} for (m, v), t in tables]
            count = np.concatenate([t.count for _k, t in tables]) if tables else np.zeros(0, np.int64)
            order_sum = np.concatenate([t.order_sum for _k, t in tables]) if tables else np.zeros(0, np.int64)
            hits = np.concatenate([t.hits for _k, t in tables]) if tables else np.zeros(0, np.uint32)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), count=count, order_sum=order_sum, hits=hits)
        os.replace(tmp, path)
        with self._lock:
            self._saved = max(self._saved, changes)
        return True

    def load(self, path: Path) -> int:
        """Add the tables save() wrote to ``path``, within this aggregator's bounds (the most
        recently reported kept); returns how many versions it holds after. Raises ValueError
        for a file that is not such a snapshot, OSError when it cannot be read."""
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]))
                count, order_sum, hits = z["count"], z["order_sum"], z["hits"]
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - zip, npy and JSON errors alike: not a heat snapshot
            raise ValueError(f"not a heat snapshot ({type(exc).__name__}: {exc})") from None
        if (count.dtype != np.int64 or order_sum.dtype != np.int64 or hits.dtype != np.uint32
                or not count.ndim == order_sum.ndim == hits.ndim == 1 or not len(count) == len(order_sum) == len(hits)):
            raise ValueError("its arrays do not have the snapshot's types and lengths")
        if not isinstance(meta, list) or not all(
                isinstance(m, dict) and isinstance(m.get("model"), str) and type(m.get("version")) is int
                and type(m.get("size")) is int and m["size"] >= 0 and type(m.get("reports")) is int for m in meta):
            raise ValueError("its table list is damaged")
        if sum(m["size"] for m in meta) != len(count):
            raise ValueError(f"its tables name {sum(m['size'] for m in meta)} chunk slots, its arrays hold {len(count)}")
        offset = 0
        with self._lock:
            for m in meta:
                size, start = m["size"], offset
                offset += size
                if size > self.max_entries:
                    continue
                key = (m["model"], m["version"])
                old = self._tables.pop(key, None)
                if old is not None:
                    self._entries -= old.size
                self._evict_for(key, size)
                end = start + size
                self._tables[key] = _Table(size, count[start:end].copy(), order_sum[start:end].copy(), hits[start:end].copy(),
                                           min(max(m["reports"], 0), 0xFFFFFFFF))
                self._entries += size
            self._saved = self._changes
            return len(self._tables)

    def _ranked(self, table: _Table) -> tuple[U64, U64, U64]:
        seen = np.flatnonzero(table.hits)
        mean = table.order_sum[seen] / table.hits[seen]
        ranked = seen[np.lexsort((seen, mean))]  # by mean first-access rank, then index
        return ranked.astype(np.uint64), table.count[ranked].astype(np.uint64), np.arange(ranked.size, dtype=np.uint64)

    def get(self, model: str, version: int) -> tuple[list[HeatEntry], int]:
        """Entries ordered by mean first-access rank (the prefetch order), and the report count."""
        reply = pb.GetHeatReply.FromString(self.get_reply(model, version))
        return [HeatEntry(e.chunk_index, e.count, e.first_access_order) for e in reply.entries], reply.reports

    def get_reply(self, model: str, version: int) -> bytes:
        """The encoded GetHeatReply of a version: built once per change (vectorised), then reused."""
        with self._lock:
            table = self._tables.get((model, version))
            if table is None:
                return pb.GetHeatReply(model=model, version=version).SerializeToString()
            if table.reply is None:
                head = pb.GetHeatReply(model=model, version=version, reports=table.reports).SerializeToString()
                table.reply = head + encode_entries(*self._ranked(table))
            return table.reply


class HeatSnapshots:
    """Saves an aggregator to the data dir: ``step()`` from a periodic task and once at shutdown,
    a failed write logged once per episode (a full disk must not log every few seconds)."""

    def __init__(self, heat: HeatAggregator, data_dir: Path) -> None:
        self.heat = heat
        self.path = Path(data_dir) / HEAT_FILE
        self._failing = False

    def restore(self) -> None:
        if not self.path.exists():
            return
        try:
            n = self.heat.load(self.path)
        except (OSError, ValueError) as exc:
            log.warning("heat: cannot read %s (%s); prefetch order starts over from new reports", self.path, exc)
            return
        log.info("heat: restored %d versions (%d chunk slots) from %s", n, self.heat.entries, self.path)

    def step(self) -> bool:
        try:
            wrote = self.heat.save(self.path)
        except OSError as exc:
            if not self._failing:
                log.warning("heat: cannot write %s (%s); heat stays in memory, retried every %.0f s",
                            self.path, exc, SAVE_INTERVAL_S)
            self._failing = True
            return False
        if self._failing:
            log.info("heat: %s written again", self.path)
            self._failing = False
        return wrote


__all__ = ["BYTES_PER_ENTRY", "HEAT_FILE", "HeatAggregator", "HeatSnapshots"]
