"""Chunk access heatmaps: which chunks a model version reads, how often, and in what order.

A worker records each chunk index as it is read (``HeatmapRecorder.record``), sends
``snapshot()`` to the servers periodically, the servers ``merge`` reports from many workers, and a
new worker prefetches in ``prefetch_order``. A report keeps, per chunk index, the read count, the
sum of its first-access ranks and how many sources saw it; that makes ``merge`` exact,
commutative and associative (merging merged reports equals merging the originals), and the
mean first-access rank is what orders the prefetch.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from paramserver.wire.heat_entries import HeatArrays
from worker.errors import HeatmapMismatch

FORMAT = 1


@dataclass(frozen=True)
class HeatReport:
    """Per chunk index: read count, summed first-access rank and number of sources that saw it.

    Entries are sorted by mean first-access rank (ties: more reads first, then lower index), so
    ``indices`` is already the observed access order.
    """

    model: str
    version: int
    sources: int
    indices: tuple[int, ...]
    counts: tuple[int, ...]
    rank_sums: tuple[int, ...]
    seen: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "version": self.version,
            "sources": self.sources,
            "indices": list(self.indices),
            "counts": list(self.counts),
            "rank_sums": list(self.rank_sums),
            "seen": list(self.seen),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeatReport:
        if data.get("format") != FORMAT:
            raise HeatmapMismatch(f"heat report format {data.get('format')!r} is not {FORMAT}; upgrade the worker")
        cols = [tuple(int(x) for x in data[name]) for name in ("indices", "counts", "rank_sums", "seen")]
        if len({len(c) for c in cols}) != 1:
            raise HeatmapMismatch("heat report columns have different lengths; the report is damaged")
        return _build(str(data["model"]), int(data["version"]), int(data["sources"]),
                      {i: (c, r, s) for i, c, r, s in zip(*cols)})

    @classmethod
    def from_json(cls, text: str | bytes) -> HeatReport:
        return cls.from_dict(json.loads(text))

    def entries(self) -> list[tuple[int, int, int]]:
        """``(chunk_index, count, first_access_order)`` rows in access order: the shape of the
        wire's ``HeatEntry`` (``ReportHeat``). The order is the rank in this report, so a merged
        report is sent as one source."""
        return [(index, count, rank) for rank, (index, count) in enumerate(zip(self.indices, self.counts))]

    @classmethod
    def from_entries(
        cls, model: str, version: int, entries: Iterable[tuple[int, int, int]], sources: int = 1
    ) -> HeatReport:
        """A report from ``(chunk_index, count, first_access_order)`` rows, e.g. a ``GetHeat``
        reply, whose order is already the servers' aggregate rank."""
        rows = np.asarray(entries if isinstance(entries, (list, tuple)) else list(entries), dtype=np.int64).reshape(-1, 3)
        index, count, rank = rows[:, 0], rows[:, 1], rows[:, 2]
        if len(np.unique(index)) != len(index):  # an index sent twice: the last row counts, as in a dict
            return _build(model, int(version), max(1, int(sources)), {int(i): (int(c), int(r), 1) for i, c, r in rows.tolist()})
        # Every row seen once: ordered by (rank, -count, index) with one lexsort, as _build's
        # plain_key orders them (a GetHeat reply of a 4 KiB-chunk model has 10^5+ rows).
        order = np.lexsort((index, -count, rank))
        return HeatReport(model, int(version), max(1, int(sources)), tuple(index[order].tolist()),
                          tuple(count[order].tolist()), tuple(rank[order].tolist()), (1,) * len(order))

    def count(self, index: int) -> int:
        try:
            return self.counts[self.indices.index(index)]
        except ValueError:
            return 0


def _build(model: str, version: int, sources: int, rows: dict[int, tuple[int, int, int]]) -> HeatReport:
    def key(item: tuple[int, tuple[int, int, int]]) -> tuple[Fraction, int, int]:
        index, (count, rank_sum, seen) = item
        return (Fraction(rank_sum, seen), -count, index)

    def plain_key(item: tuple[int, tuple[int, int, int]]) -> tuple[int, int, int]:
        index, (count, rank_sum, _seen) = item
        return (rank_sum, -count, index)

    # Every row seen once (a GetHeat reply: the servers' aggregate rank): the mean rank is the
    # rank itself, and integers sort ~50x faster than Fractions (a large model has 10^5+ rows).
    once = all(r[2] == 1 for r in rows.values())
    ordered = sorted(rows.items(), key=plain_key if once else key)
    return HeatReport(
        model=model,
        version=version,
        sources=sources,
        indices=tuple(i for i, _ in ordered),
        counts=tuple(r[0] for _, r in ordered),
        rank_sums=tuple(r[1] for _, r in ordered),
        seen=tuple(r[2] for _, r in ordered),
    )


class HeatmapRecorder:
    """Thread-safe recorder for one model version: per chunk index its read count and the rank of
    its first access, as arrays (a load of half a million chunks records them a batch at a time).

    ``rank_as(rank_of)``: first accesses are ranked by ``rank_of[index]`` rather than by when they
    were recorded. A load uses it: the order in which its chunks *arrive* is only the network's
    interleaving of the replicas' streams, and reported as heat it would scramble the next load's
    fetch order (neighbouring chunks no longer read together from one replica); the order the
    load *asked* for them in is the heat it was given, or manifest order, and stays put.
    """

    def __init__(self, model: str, version: int) -> None:
        self.model = model
        self.version = version
        self._lock = threading.Lock()
        self._counts = np.zeros(0, dtype=np.int64)
        self._first = np.zeros(0, dtype=np.int64)  # rank of the first access; -1: not read yet
        self._seen = 0
        self._rank_of: np.ndarray | None = None
        self._late_base = 0  # the first rank after every one in rank_of
        self._late = 0  # indices past rank_of read so far: ranked after all of it, by arrival

    def rank_as(self, rank_of: np.ndarray) -> None:
        """Rank each index's first access by ``rank_of[index]`` (ties: lower index first); an index
        past ``rank_of`` after every ranked one, in the order it was read."""
        ranks = np.asarray(rank_of, dtype=np.int64)
        if len(ranks) and int(ranks.min()) < 0:
            raise ValueError("ranks are >= 0")
        with self._lock:
            self._rank_of = ranks
            self._late_base = int(ranks.max()) + 1 if len(ranks) else 0

    def record(self, index: int) -> None:
        self.record_many(np.array([index], dtype=np.int64))

    def record_many(self, indices: Iterable[int] | np.ndarray) -> None:
        rows = indices if isinstance(indices, np.ndarray) else np.fromiter(indices, dtype=np.int64)
        if not len(rows):
            return
        if int(rows.min()) < 0:
            raise ValueError("chunk indices are >= 0")
        with self._lock:
            top = int(rows.max()) + 1
            if top > len(self._counts):
                size = max(top, 2 * len(self._counts))
                self._counts = np.concatenate([self._counts, np.zeros(size - len(self._counts), dtype=np.int64)])
                self._first = np.concatenate([self._first, np.full(size - len(self._first), -1, dtype=np.int64)])
            new = rows[self._first[rows] < 0]
            if len(new) > 1:
                _, at = np.unique(new, return_index=True)
                new = new[np.sort(at)]  # each once, in the order first read
            if self._rank_of is not None:
                ranked = new < len(self._rank_of)
                self._first[new[ranked]] = self._rank_of[new[ranked]]
                late = new[~ranked]
                base = self._late_base + self._late
                self._first[late] = np.arange(base, base + len(late), dtype=np.int64)
                self._late += len(late)
            else:
                self._first[new] = np.arange(self._seen, self._seen + len(new), dtype=np.int64)
            self._seen += len(new)
            np.add.at(self._counts, rows, 1)

    def _ordered(self) -> tuple[np.ndarray, np.ndarray]:
        """The indices read so far in first-access order, and their counts. Lock held."""
        seen = np.flatnonzero(self._first >= 0)
        order = seen[np.argsort(self._first[seen], kind="stable")]  # ties (rank_as): lower index first
        return order, self._counts[order]

    def snapshot(self) -> HeatReport:
        # The rank of an index is its place in first-access order: ranks are distinct and rising.
        with self._lock:
            order, counts = self._ordered()
        n = len(order)
        return HeatReport(self.model, self.version, 1, tuple(order.tolist()), tuple(counts.tolist()), tuple(range(n)), (1,) * n)

    def wire_entries(self, *, reset: bool = False) -> HeatArrays:
        """What ``snapshot().entries()`` holds, as the arrays a report is sent as (no Python object
        per entry: a model of half a million chunks is reported in milliseconds). ``reset``: start a
        new period in the same step, so no record falls between the two."""
        with self._lock:
            order, counts = self._ordered()
            if reset:
                self._reset()
        return HeatArrays(order.astype(np.uint64), counts.astype(np.uint64), np.arange(len(order), dtype=np.uint64))

    def reset(self) -> None:
        """Start a new reporting period (after a report was sent)."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._counts[:] = 0
        self._first[:] = -1
        self._seen = 0
        self._late = 0


def merge(reports: Sequence[HeatReport]) -> HeatReport:
    """Aggregate reports of one model version; the result does not depend on their order."""
    if not reports:
        raise HeatmapMismatch("merge needs at least one heat report")
    model, version = reports[0].model, reports[0].version
    rows: dict[int, tuple[int, int, int]] = {}
    for report in reports:
        if (report.model, report.version) != (model, version):
            raise HeatmapMismatch(
                f"cannot merge heat reports of {model} v{version} and {report.model} v{report.version}; "
                "aggregate per model version"
            )
        for index, count, rank_sum, seen in zip(report.indices, report.counts, report.rank_sums, report.seen):
            c, r, s = rows.get(index, (0, 0, 0))
            rows[index] = (c + count, r + rank_sum, s + seen)
    return _build(model, version, sum(r.sources for r in reports), rows)


def prefetch_order(report: HeatReport | None, all_indices: Iterable[int], by: str = "rank") -> list[int]:
    """Chunk indices to fetch: those the report saw first (``by="rank"``: earliest first;
    ``by="count"``: hottest first), then every other index in manifest order."""
    if report is None:
        return list(all_indices)
    if by == "rank" and isinstance(all_indices, range) and all_indices.step == 1:
        # A whole manifest's rows (half a million of 4 KiB chunks): the same rule on arrays.
        seen_rows = np.fromiter(report.indices, dtype=np.int64, count=len(report.indices))
        seen_rows = seen_rows[(seen_rows >= all_indices.start) & (seen_rows < all_indices.stop)]
        rest = np.ones(len(all_indices), dtype=bool)
        rest[seen_rows - all_indices.start] = False
        order: list[int] = np.concatenate([seen_rows, np.flatnonzero(rest) + all_indices.start]).tolist()
        return order
    all_list = list(all_indices)
    wanted = set(all_list)
    if by == "rank":
        seen = [i for i in report.indices if i in wanted]
    elif by == "count":
        pos = {i: n for n, i in enumerate(report.indices)}
        seen = sorted((i for i in report.indices if i in wanted),
                      key=lambda i: (-report.counts[pos[i]], pos[i]))
    else:
        raise ValueError(f"by must be 'rank' or 'count', got {by!r}")
    first = set(seen)
    return seen + [i for i in all_list if i not in first]
