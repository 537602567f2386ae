"""A manifest's chunks as columns: numpy arrays with one row per chunk, not one object per chunk.

A 140 GB checkpoint has half a million chunks; as Python objects they cost about a gigabyte
and seconds to build on every pull, load and commit check. The table keeps ids as a
``(n, 32)`` byte array and every other field as a fixed-width array, and hands out a
``ChunkRef`` only for the rows a caller asks for. Code that only needs ids, sizes or CRCs
reads the columns (or ``ids``, the hex strings, made once on first use).
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, overload

import numpy as np

from chunking.hashing import hex_ids

DIGEST_BYTES = 32
_BLOCK = 1 << 16  # refs made per pause of the garbage collector
_paused_lock = threading.Lock()
_paused_depth = 0
_paused_was_enabled = False


@contextmanager
def collector_paused(enabled: bool = True) -> Iterator[None]:
    """The cyclic garbage collector off while making many acyclic objects (``enabled=False``: a
    no-op); threads may nest it, and it is back on once the last one leaves.

    Its full passes scan every object the process holds, and they are set off by the growth of
    the heap, so making half a million small objects in a heap of millions costs several passes
    of seconds in all. Cycles made meanwhile (by any thread) are collected once it resumes."""
    if not enabled:
        yield
        return
    global _paused_depth, _paused_was_enabled
    with _paused_lock:
        if _paused_depth == 0:
            _paused_was_enabled = gc.isenabled()
            gc.disable()
        _paused_depth += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused_depth -= 1
            if _paused_depth == 0 and _paused_was_enabled:
                gc.enable()


class ChunkRef(NamedTuple):
    """One row of a manifest's chunk table. A named tuple, not a frozen dataclass: a load makes
    one per distinct chunk, half a million for a checkpoint of 4 KiB chunks, and a dataclass (an
    object and its attribute dict) took three times the memory and the time to make. Manifests
    are encoded from the table's columns, never from refs, so ``created_at`` needs no coercion."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, which no caller of a ref uses
    id: str
    raw_size: int
    stored_size: int
    codec: str
    crc32c: int
    introduced_in: int
    created_at: float


def _shared(column: np.ndarray) -> list[int] | list[float]:
    """``column.tolist()`` with one Python object per distinct value."""
    values, inverse = np.unique(column, return_inverse=True)
    if len(values) == len(column):
        return column.tolist()  # type: ignore[no-any-return]
    objects = values.tolist()
    return [objects[k] for k in inverse.tolist()]


class ChunkTable(Sequence[ChunkRef]):
    """Rows ``0..n-1`` of a manifest's chunks; ``table[i]`` is the ``ChunkRef`` with ``index == i``."""

    def __init__(self, digests: np.ndarray, raw_size: np.ndarray, stored_size: np.ndarray, crc32c: np.ndarray,
                 codec_index: np.ndarray, codecs: tuple[str, ...], introduced_in: np.ndarray, created_at: np.ndarray) -> None:
        n = len(digests)
        if digests.shape != (n, DIGEST_BYTES) or digests.dtype != np.uint8:
            raise ValueError(f"chunk digests must be an (n, {DIGEST_BYTES}) uint8 array, got {digests.shape} {digests.dtype}")
        for name, column in (("raw_size", raw_size), ("stored_size", stored_size), ("crc32c", crc32c),
                             ("codec_index", codec_index), ("introduced_in", introduced_in), ("created_at", created_at)):
            if column.shape != (n,):
                raise ValueError(f"chunk column {name} has shape {column.shape}, expected ({n},)")
        self.digests = digests
        self.raw_size = raw_size.astype(np.int64, copy=False)
        self.stored_size = stored_size.astype(np.int64, copy=False)
        self.crc32c = crc32c.astype(np.uint32, copy=False)
        self.codec_index = codec_index.astype(np.uint8, copy=False)
        self.codecs = codecs
        self.introduced_in = introduced_in.astype(np.int64, copy=False)
        self.created_at = created_at.astype(np.float64, copy=False)

    @classmethod
    def from_refs(cls, refs: Sequence[ChunkRef]) -> ChunkTable:
        """The table of ``refs`` (row ``i`` must be the ref with ``index == i``; ``Manifest.check`` says so)."""
        codecs: dict[str, int] = {}
        codec_index = np.fromiter((codecs.setdefault(r.codec, len(codecs)) for r in refs), np.uint8, len(refs))
        try:
            digests = np.frombuffer(bytes.fromhex("".join(r.id for r in refs)), np.uint8).reshape(-1, DIGEST_BYTES)
        except ValueError:
            raise ValueError("a chunk id is not 64 hex digits") from None
        if len(digests) != len(refs):
            raise ValueError("a chunk id is not 64 hex digits")
        table = cls(
            digests,
            np.fromiter((r.raw_size for r in refs), np.int64, len(refs)),
            np.fromiter((r.stored_size for r in refs), np.int64, len(refs)),
            np.fromiter((r.crc32c for r in refs), np.uint32, len(refs)),
            codec_index,
            tuple(codecs),
            np.fromiter((r.introduced_in for r in refs), np.int64, len(refs)),
            np.fromiter((r.created_at for r in refs), np.float64, len(refs)),
        )
        table.__dict__["ids"] = tuple(r.id for r in refs)  # already at hand: no hex round trip
        return table

    # -- columns as Python values -----------------------------------------
    @cached_property
    def ids(self) -> tuple[str, ...]:
        """Hex content ids in row order (an id repeats when two chunks hold equal bytes)."""
        return tuple(hex_ids(self.digests))

    def codec_names(self) -> list[str]:
        return [self.codecs[i] for i in self.codec_index.tolist()]

    @cached_property
    def first_rows(self) -> np.ndarray:
        """Row of each distinct id's first occurrence, in row order."""
        return np.flatnonzero(self.first_of == np.arange(len(self), dtype=np.int64))

    @cached_property
    def first_of(self) -> np.ndarray:
        """Per row: the row where its id first occurs (itself for an id's first row)."""
        n = len(self)
        first = np.arange(n, dtype=np.int64)
        if n < 2:
            return first
        # Sort by the ids' first 8 bytes (a sort of 32-byte keys is ~40x slower); only rows whose
        # first 8 bytes collide, in practice true repeats, are compared in full.
        head = np.ascontiguousarray(self.digests).view("<u8")[:, 0]
        order = np.argsort(head, kind="stable")
        sorted_head = head[order]
        repeated = sorted_head[1:] == sorted_head[:-1]
        if not repeated.any():
            return first
        seen: dict[bytes, int] = {}
        for row in np.flatnonzero(np.isin(head, np.unique(sorted_head[1:][repeated]))).tolist():
            first[row] = seen.setdefault(self.digests[row].tobytes(), row)
        return first

    @cached_property
    def repeats(self) -> dict[int, tuple[int, ...]]:
        """For each id held by more than one row: its first row -> every row holding it, in row
        order. Empty for most models; a loader of half a million rows needs no per-row entry."""
        first = self.first_of
        again = np.flatnonzero(first != np.arange(len(self), dtype=np.int64))
        if not len(again):
            return {}
        out: dict[int, list[int]] = {}
        for row, head in zip(again.tolist(), first[again].tolist()):
            out.setdefault(head, [head]).append(row)
        return {head: tuple(rows) for head, rows in out.items()}

    def rows_of(self, row: int) -> tuple[int, ...]:
        """Every row holding the id of ``row`` (which must be its first row), in row order."""
        return self.repeats.get(row, (row,))

    @cached_property
    def ring_keys(self) -> np.ndarray:
        """Each row's position on the placement ring (``paramserver.wire.ring.key_point`` of its id:
        the first 8 bytes of the digest, big-endian), as uint64, without a hex string per row."""
        return np.ascontiguousarray(self.digests[:, :8]).view(">u8").reshape(-1).astype(np.uint64)

    @cached_property
    def raw_rows(self) -> np.ndarray:
        """Per row: stored raw (uncompressed), so its stored bytes are its tensor bytes."""
        if "raw" not in self.codecs:
            return np.zeros(len(self), dtype=bool)
        raw: np.ndarray = self.codec_index == self.codecs.index("raw")
        return raw

    @cached_property
    def first_row_of(self) -> dict[str, int]:
        """Chunk id -> the first row holding it; made on first use (a dict entry per distinct id)."""
        ids = self.ids
        first = self.first_rows.tolist()
        return dict(zip([ids[r] for r in first], first))

    def restamped(self, old: int, new: int) -> ChunkTable:
        """A copy in which rows introduced in version ``old`` say ``new``."""
        introduced = np.where(self.introduced_in == old, new, self.introduced_in)
        table = ChunkTable(self.digests, self.raw_size, self.stored_size, self.crc32c, self.codec_index, self.codecs,
                           introduced, self.created_at)
        if "ids" in self.__dict__:
            table.__dict__["ids"] = self.__dict__["ids"]
        return table

    # -- Sequence[ChunkRef] -----------------------------------------------
    def __len__(self) -> int:
        return len(self.digests)

    @overload
    def __getitem__(self, index: int) -> ChunkRef: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[ChunkRef, ...]: ...

    def __getitem__(self, index: int | slice) -> ChunkRef | tuple[ChunkRef, ...]:
        if isinstance(index, slice):
            return tuple(self.rows(range(*index.indices(len(self)))))
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"chunk index {index} is out of range for {n} chunks")
        i = index % n
        return ChunkRef(i, self.ids[i], int(self.raw_size[i]), int(self.stored_size[i]), self.codecs[self.codec_index[i]],
                        int(self.crc32c[i]), int(self.introduced_in[i]), float(self.created_at[i]))

    def rows(self, indices: Sequence[int] | range | np.ndarray) -> Iterator[ChunkRef]:
        """``ChunkRef`` of the given rows, made from the columns in blocks."""
        picked = np.asarray(indices, dtype=np.int64)
        for start in range(0, len(picked), _BLOCK):
            yield from self._refs(picked[start : start + _BLOCK])

    def _refs(self, picked: np.ndarray) -> list[ChunkRef]:
        ids = self.ids
        codecs = self.codecs
        # The collector is paused while a block of refs (acyclic) is made: its passes over the
        # growing heap cost 3x the making. Columns that repeat a few values (sizes, codecs, time
        # stamps) give every ref the same Python objects instead of one int or float each.
        with collector_paused():
            return list(map(ChunkRef._make, zip(
                picked.tolist(), [ids[i] for i in picked.tolist()], _shared(self.raw_size[picked]),
                _shared(self.stored_size[picked]), [codecs[c] for c in self.codec_index[picked].tolist()],
                self.crc32c[picked].tolist(), _shared(self.introduced_in[picked]), _shared(self.created_at[picked]),
            )))

    def __iter__(self) -> Iterator[ChunkRef]:
        return self.rows(range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            return (len(self) == len(other) and self.codec_names() == other.codec_names()
                    and all(np.array_equal(a, b) for a, b in zip(self._columns(), other._columns())))
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash((len(self), self.digests.tobytes()))

    def _columns(self) -> tuple[np.ndarray, ...]:
        return (self.digests, self.raw_size, self.stored_size, self.crc32c, self.introduced_in, self.created_at)

    def __repr__(self) -> str:
        return f"ChunkTable({len(self)} chunks, codecs={list(self.codecs)})"


@dataclass(frozen=True, eq=False)
class ChunkRows:
    """Rows of one chunk table in an order: what one fetch reads (distinct ids, in fetch order).

    A fetch and its sinks name a chunk by its row in ``table`` (a manifest's row, whose first
    occurrence it is), never by a per-chunk object: half a million 4 KiB chunks stay arrays."""

    table: ChunkTable
    rows: np.ndarray  # int64

    @classmethod
    def of(cls, table: ChunkTable, rows: Sequence[int] | np.ndarray | None = None) -> ChunkRows:
        """``rows`` of ``table`` (default: each distinct id once, at its first row)."""
        picked = table.first_rows if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(picked) and (int(picked.min()) < 0 or int(picked.max()) >= len(table)):
            raise IndexError(f"chunk rows out of range for a table of {len(table)} rows")
        return cls(table, picked)

    @classmethod
    def of_refs(cls, refs: Sequence[ChunkRef]) -> ChunkRows:
        """A table of ``refs`` alone (their rows are 0..n-1 in the order given, not their ``index``)."""
        return cls(ChunkTable.from_refs([r._replace(index=i) for i, r in enumerate(refs)]), np.arange(len(refs), dtype=np.int64))

    def __len__(self) -> int:
        return len(self.rows)

    def refs(self) -> Iterator[ChunkRef]:
        return self.table.rows(self.rows)
