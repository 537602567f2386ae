"""Where each tensor's bytes sit in the model's logical byte stream, and how
that stream is cut into chunks.

Rules (they are part of the manifest format, version 1):
- tensors are laid out in manifest order (``pack`` sorts them by name);
- a tensor of at least ``chunk_size`` bytes starts on a chunk boundary and the
  next tensor starts on the following boundary, so its chunks hold only its
  own bytes and keep their ids when neighbours change;
- a smaller tensor is packed right after the previous one, aligned to its
  element size so a byte shuffle by element width lines up inside a chunk;
- chunk ``i`` covers ``[i * chunk_size, i * chunk_size + raw_size)``; its
  trailing alignment gap is trimmed and gaps inside it are zero bytes.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np


@dataclass(frozen=True)
class Segment:
    """A run of bytes shared by one chunk and one tensor."""

    tensor: int
    chunk_offset: int
    tensor_offset: int
    length: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def place_tensors(sizes: Sequence[tuple[int, int]], chunk_size: int) -> list[int]:
    """Byte offsets of tensors given as ``(nbytes, element_size)`` in order."""
    offsets: list[int] = []
    cursor = 0
    for nbytes, elem in sizes:
        if nbytes >= chunk_size:
            cursor = _round_up(cursor, chunk_size)
            offsets.append(cursor)
            cursor = _round_up(cursor + nbytes, chunk_size)
        else:
            cursor = _round_up(cursor, max(1, elem))
            offsets.append(cursor)
            cursor += nbytes
    return offsets


def chunk_raw_sizes(ranges: Sequence[tuple[int, int]], chunk_size: int) -> np.ndarray:
    """Raw size of every chunk (``ChunkPlan.raw_sizes``) as an array.

    One pass over tensors, not chunks: checking a half-million-chunk manifest costs what its
    few thousand tensors cost. Raises ValueError when ranges overlap or leave a chunk without
    data, which only a malformed manifest can produce.
    """
    end = _span(ranges)
    count = _round_up(end, chunk_size) // chunk_size
    raw_ends = np.zeros(count, np.int64)
    for offset, nbytes in ranges:
        if nbytes == 0:
            continue
        first, last = offset // chunk_size, (offset + nbytes - 1) // chunk_size
        raw_ends[first:last] = chunk_size
        tail = offset + nbytes - last * chunk_size
        if raw_ends[last] < tail:
            raw_ends[last] = tail
    if count and int(raw_ends.min()) == 0:
        raise ValueError("a chunk holds no tensor bytes; the tensor offsets leave a gap of a whole chunk")
    return raw_ends


def _span(ranges: Sequence[tuple[int, int]]) -> int:
    end = 0
    for offset, nbytes in ranges:
        if nbytes > 0:
            if offset < end:
                raise ValueError(f"tensor byte range at offset {offset} overlaps the previous tensor")
            end = offset + nbytes
    return end


class ChunkSegments(Sequence[tuple[Segment, ...]]):
    """``segments[i]``: the tensor segments of chunk ``i``, worked out when asked for.

    Building them all up front cost seconds and hundreds of MB for a half-million-chunk
    checkpoint; one chunk's are a binary search over the tensors away.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]], chunk_size: int, count: int) -> None:
        held = [(offset, offset + nbytes, t) for t, (offset, nbytes) in enumerate(ranges) if nbytes > 0]
        self._starts = [a for a, _, _ in held]
        self._ends = [b for _, b, _ in held]
        self._tensors = [t for _, _, t in held]
        self._chunk_size = chunk_size
        self._count = count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> tuple[Segment, ...]: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[tuple[Segment, ...], ...]: ...

    def __getitem__(self, index: int | slice) -> tuple[Segment, ...] | tuple[tuple[Segment, ...], ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._count)))
        if not -self._count <= index < self._count:
            raise IndexError(f"chunk index {index} is out of range for {self._count} chunks")
        base = (index % self._count) * self._chunk_size
        top = base + self._chunk_size
        out = []
        k = bisect_right(self._ends, base)  # the first tensor ending after this chunk's start
        while k < len(self._starts) and self._starts[k] < top:
            start, end = self._starts[k], self._ends[k]
            lo, hi = max(start, base), min(end, top)
            out.append(Segment(self._tensors[k], lo - base, lo - start, hi - lo))
            k += 1
        return tuple(out)


@dataclass(frozen=True, eq=False)
class ChunkPlan:
    """Chunk raw sizes, the tensor segments of every chunk, and the chunks of every tensor.

    ``whole[i]``: the tensor whose bytes chunk ``i`` is exactly (its one segment, from the chunk's
    start to its end), or -1; ``whole_at[i]``: where in that tensor's bytes (a chunk that is one
    whole region can be received straight into it)."""

    raw_sizes: tuple[int, ...]
    segments: Sequence[tuple[Segment, ...]]
    tensor_chunks: tuple[tuple[int, ...], ...]
    whole: np.ndarray
    whole_at: np.ndarray

    @property
    def count(self) -> int:
        return len(self.raw_sizes)


def plan_chunks(ranges: Sequence[tuple[int, int]], chunk_size: int) -> ChunkPlan:
    """Cut tensors given as ``(offset, nbytes)`` into chunks of ``chunk_size``.

    Raises ValueError when ranges overlap or leave a chunk without data, which
    only a malformed manifest can produce.
    """
    raw_sizes = chunk_raw_sizes(ranges, chunk_size)
    tensor_chunks = tuple(
        tuple(range(offset // chunk_size, (offset + nbytes - 1) // chunk_size + 1)) if nbytes else ()
        for offset, nbytes in ranges
    )
    whole, whole_at = _whole_chunks(ranges, chunk_size, raw_sizes)
    return ChunkPlan(tuple(raw_sizes.tolist()), ChunkSegments(ranges, chunk_size, len(raw_sizes)), tensor_chunks,
                     whole, whole_at)


def _whole_chunks(ranges: Sequence[tuple[int, int]], chunk_size: int, raw_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ChunkPlan.whole`` and ``whole_at``, worked out per tensor, not per chunk."""
    count = len(raw_sizes)
    owners = np.zeros(count, np.int32)  # tensors with bytes in each chunk
    whole = np.full(count, -1, np.int32)
    for t, (offset, nbytes) in enumerate(ranges):
        if nbytes == 0:
            continue
        first, last = offset // chunk_size, (offset + nbytes - 1) // chunk_size
        owners[first : last + 1] += 1
        # Chunks that start inside the tensor (a tensor starting mid-chunk shares its first chunk)
        # and end inside it (the chunk's raw size trims the trailing gap).
        lo = first if offset == first * chunk_size else first + 1
        whole[lo : last + 1] = t
    starts = np.arange(count, dtype=np.int64) * chunk_size
    stops = np.array([offset + nbytes if nbytes else 0 for offset, nbytes in ranges] or [0], dtype=np.int64)
    offsets = np.array([offset if nbytes else 0 for offset, nbytes in ranges] or [0], dtype=np.int64)
    held = whole >= 0
    inside = np.ones(count, dtype=bool)
    inside[held] = starts[held] + np.asarray(raw_sizes, dtype=np.int64)[held] <= stops[whole[held]]
    whole[(owners != 1) | ~inside] = -1
    at = np.where(whole >= 0, starts - offsets[np.maximum(whole, 0)], -1)
    return whole, at
