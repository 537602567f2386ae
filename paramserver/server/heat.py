"""Aggregation of workers' heat reports: which chunks of a version are read, how
often, and in what order they are first needed. Kept in memory on each server
(advisory data: losing it costs prefetch quality, never correctness).

Bounded (issue 11): a server keeps heat for at most ``max_versions`` versions and
``max_entries`` chunk slots over all of them (``BYTES_PER_ENTRY`` bytes each, so
about 40 MiB at the defaults), dropping the least recently reported version first;
a version's table has one slot per chunk of the version and never grows past it.
One report's work is a few vectorised passes over its bytes (numpy), a few
milliseconds per MiB, never a Python step per entry: ``decode_entries`` reads the
entries of a ``ReportHeatRequest`` straight from their protobuf encoding and
``encode_entries`` writes a ``GetHeatReply``'s the same way.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
from numpy.typing import NDArray

from paramserver.wire.proto import pb

U64 = NDArray[np.uint64]

# Per chunk slot of a version's table: count (8) + sum of first-access ranks (8) + reports (4).
BYTES_PER_ENTRY = 20
DEFAULT_MAX_ENTRIES = 2 << 20  # chunk slots over all versions (~40 MiB)
DEFAULT_MAX_VERSIONS = 1024
COUNT_CAP = 1 << 32  # one entry's count is clamped here; sums saturate at SUM_CAP
SUM_CAP = 1 << 62

_KEY_INDEX, _KEY_COUNT, _KEY_ORDER, _KEY_ENTRY = 0x08, 0x10, 0x18, 0x22  # HeatEntry fields 1-3, ReportHeatRequest.entries = 4
_DECODE_BLOCK = 1 << 20  # bytes tokenised per numpy pass: bounds the temporaries (~30 bytes per byte)
_FULL_ENTRY = np.array([_KEY_ENTRY, _KEY_INDEX, _KEY_COUNT, _KEY_ORDER], np.uint64)


@dataclass(frozen=True)
class HeatEntry:
    chunk_index: int
    count: int
    first_access_order: int


@dataclass(frozen=True)
class HeatArrays:
    """A report's entries as arrays (aligned): chunk index, count, first-access order."""

    index: U64
    count: U64
    order: U64

    def __len__(self) -> int:
        return int(self.index.size)

    @classmethod
    def of(cls, entries: Iterable[HeatEntry | tuple[int, int, int]]) -> HeatArrays:
        rows = [(e.chunk_index, e.count, e.first_access_order) if isinstance(e, HeatEntry) else tuple(e) for e in entries]
        if not rows:
            empty = np.zeros(0, np.uint64)
            return cls(empty, empty.copy(), empty.copy())
        a = np.array([[min(max(int(v), 0), (1 << 64) - 1) for v in row] for row in rows], dtype=np.uint64)
        return cls(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy())


# ------------------------------------------------------------------ protobuf varints, vectorised


def _varints(seg: NDArray[np.uint8], ends: NDArray[np.intp]) -> U64:
    """The values of the varints in ``seg`` (which ends with the last one; ``ends``: their last bytes)."""
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > 10:
        raise ValueError("a varint is longer than 10 bytes")
    values = (seg[starts] & 0x7F).astype(np.uint64)
    for k in range(1, int(lengths.max())):
        longer = np.flatnonzero(lengths > k)
        values[longer] |= (seg[starts[longer] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return values


def decode_entries(buf: bytes, count: int) -> HeatArrays:
    """The ``count`` entries of a serialised ``ReportHeatRequest`` that holds nothing but them.

    The caller clears the other fields and unknown fields and re-serialises (protobuf's C
    code), so ``buf`` is a stream of (key, varint) pairs: an entry's key 0x22 and length,
    then its fields 0x08/0x10/0x18 with their values (proto3 leaves out zeros). Decoded a
    block of whole entries at a time; ValueError for anything else.
    """
    index = np.zeros(count, np.uint64)
    counts = np.zeros(count, np.uint64)
    order = np.zeros(count, np.uint64)
    data = np.frombuffer(buf, dtype=np.uint8)
    done = 0  # entries decoded
    pos = 0  # always the start of an entry
    while pos < data.size:
        seg = data[pos : pos + _DECODE_BLOCK]
        last = pos + seg.size == data.size
        ends = np.flatnonzero(seg < 0x80)
        if ends.size < 2 or (last and int(ends[-1]) != seg.size - 1):
            raise ValueError("the entries end inside a varint")
        tokens = _varints(seg[: int(ends[-1]) + 1], ends)
        if last:
            if tokens.size % 2:
                raise ValueError("a key without a value")
            step = data.size - pos
        else:  # the block's last entry may run past it: leave it to the next block
            starts = np.flatnonzero(tokens[0 : tokens.size - 1 : 2] == _KEY_ENTRY)
            if starts.size < 2:
                raise ValueError("no whole entry in a block")
            cut = 2 * int(starts[-1])
            tokens, step = tokens[:cut], int(ends[cut - 1]) + 1
        keys, values = tokens[0::2], tokens[1::2]
        if keys.size % 4 == 0 and bool((keys.reshape(-1, 4) == _FULL_ENTRY).all()):
            rows = values.reshape(-1, 4)  # every field set: no scatter needed
            n = rows.shape[0]
            if done + n > count:
                raise ValueError(f"more than the {count} entries parsed")
            index[done : done + n], counts[done : done + n], order[done : done + n] = rows[:, 1], rows[:, 2], rows[:, 3]
            done += n
        else:
            is_start = keys == _KEY_ENTRY
            if keys.size and not bool(is_start[0]):
                raise ValueError("a field before the first entry")
            owner = np.cumsum(is_start, dtype=np.int64) + (done - 1)
            n = int(is_start.sum())
            if done + n > count:
                raise ValueError(f"more than the {count} entries parsed")
            known = is_start.copy()
            for key, out in ((_KEY_INDEX, index), (_KEY_COUNT, counts), (_KEY_ORDER, order)):
                mask = keys == key
                known |= mask
                out[owner[mask]] = values[mask]
            if not bool(known.all()):
                raise ValueError("a field that is not part of a HeatEntry")
            done += n
        pos += step
    if done != count:
        raise ValueError(f"{done} entries decoded, {count} parsed")
    return HeatArrays(index, counts, order)


def request_arrays(request: pb.ReportHeatRequest) -> HeatArrays:
    """The entries of ``request`` as arrays. Clears the request's other fields (read them first)."""
    n = len(request.entries)
    if n == 0:
        return HeatArrays.of(())
    for name in ("model", "version", "worker"):
        request.ClearField(name)
    try:
        return decode_entries(request.SerializeToString(), n)
    except ValueError:
        pass
    request.DiscardUnknownFields()  # a sender's unknown fields (costly: only when there are some)
    try:
        return decode_entries(request.SerializeToString(), n)
    except ValueError:  # never seen: protobuf writes exactly the shape decode_entries reads
        return HeatArrays.of((e.chunk_index, e.count, e.first_access_order) for e in request.entries)


_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], np.uint64)


def _varint_sizes(values: U64) -> NDArray[np.int64]:
    return np.searchsorted(_VARINT_LIMITS, values, side="right").astype(np.int64) + 1


def _put_varints(out: NDArray[np.uint8], at: NDArray[np.int64], values: U64, sizes: NDArray[np.int64]) -> None:
    for k in range(int(sizes.max()) if sizes.size else 0):
        rows = np.flatnonzero(sizes > k)
        byte = (values[rows] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (sizes[rows] > k + 1).astype(np.uint64) << np.uint64(7)
        out[at[rows] + k] = (byte | more).astype(np.uint8)


def encode_entries(index: U64, count: U64, order: U64) -> bytes:
    """``repeated HeatEntry entries = 3`` of a GetHeatReply (every field written, zeros too)."""
    if index.size == 0:
        return b""
    si, sc, so = _varint_sizes(index), _varint_sizes(count), _varint_sizes(order)
    body = 3 + si + sc + so  # three keys + values: at most 3 + 5 + 10 + 5 < 128, a one-byte length
    total = 2 + body
    start = np.zeros(index.size, np.int64)
    np.cumsum(total[:-1], out=start[1:])
    out = np.empty(int(total.sum()), np.uint8)
    out[start] = 0x1A  # GetHeatReply.entries = 3, length-delimited
    out[start + 1] = body.astype(np.uint8)
    out[start + 2] = _KEY_INDEX
    _put_varints(out, start + 3, index, si)
    at = start + 3 + si
    out[at] = _KEY_COUNT
    _put_varints(out, at + 1, count, sc)
    at = at + 1 + sc
    out[at] = _KEY_ORDER
    _put_varints(out, at + 1, order, so)
    return out.tobytes()


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
        arrays = entries if isinstance(entries, HeatArrays) else HeatArrays.of(entries)
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


__all__ = ["BYTES_PER_ENTRY", "HeatAggregator", "HeatArrays", "HeatEntry", "decode_entries", "encode_entries", "request_arrays"]
