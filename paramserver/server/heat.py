"""Aggregation of workers' heat reports: which chunks of a version are read, how
often, and in what order they are first needed. Kept in memory on each server
(advisory data: losing it costs prefetch quality, never correctness)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class HeatEntry:
    chunk_index: int
    count: int
    first_access_order: int


class HeatAggregator:
    def __init__(self, max_versions: int = 1024) -> None:
        # (model, version) -> chunk index -> [total count, sum of first-access ranks, reports]
        self._data: dict[tuple[str, int], dict[int, list[int]]] = {}
        self._reports: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self.max_versions = max_versions

    def report(self, model: str, version: int, entries: Iterable[HeatEntry]) -> None:
        key = (model, version)
        with self._lock:
            if key not in self._data and len(self._data) >= self.max_versions:
                oldest = next(iter(self._data))
                del self._data[oldest]
                self._reports.pop(oldest, None)
            table = self._data.setdefault(key, {})
            for e in entries:
                row = table.setdefault(e.chunk_index, [0, 0, 0])
                row[0] += e.count
                row[1] += e.first_access_order
                row[2] += 1
            self._reports[key] = self._reports.get(key, 0) + 1

    def get(self, model: str, version: int) -> tuple[list[HeatEntry], int]:
        """Entries ordered by mean first-access rank (the prefetch order), and the report count."""
        with self._lock:
            table = dict(self._data.get((model, version), {}))
            reports = self._reports.get((model, version), 0)
        ranked = sorted(table.items(), key=lambda kv: (kv[1][1] / kv[1][2], kv[0]))
        return [HeatEntry(idx, row[0], order) for order, (idx, row) in enumerate(ranked)], reports


__all__ = ["HeatAggregator", "HeatEntry"]
