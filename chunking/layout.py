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

from collections.abc import Sequence
from dataclasses import dataclass


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


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk raw sizes and the tensor segments of every chunk."""

    raw_sizes: tuple[int, ...]
    segments: tuple[tuple[Segment, ...], ...]
    tensor_chunks: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.raw_sizes)


def plan_chunks(ranges: Sequence[tuple[int, int]], chunk_size: int) -> ChunkPlan:
    """Cut tensors given as ``(offset, nbytes)`` into chunks of ``chunk_size``.

    Raises ValueError when ranges overlap or leave a chunk without data, which
    only a malformed manifest can produce.
    """
    end = 0
    for offset, nbytes in ranges:
        if nbytes > 0:
            if offset < end:
                raise ValueError(f"tensor byte range at offset {offset} overlaps the previous tensor")
            end = offset + nbytes
    count = _round_up(end, chunk_size) // chunk_size
    raw_ends = [0] * count
    segments: list[list[Segment]] = [[] for _ in range(count)]
    tensor_chunks: list[tuple[int, ...]] = []
    for t, (offset, nbytes) in enumerate(ranges):
        if nbytes == 0:
            tensor_chunks.append(())
            continue
        first, last = offset // chunk_size, (offset + nbytes - 1) // chunk_size
        for c in range(first, last + 1):
            base = c * chunk_size
            lo = max(offset, base)
            hi = min(offset + nbytes, base + chunk_size)
            segments[c].append(Segment(t, lo - base, lo - offset, hi - lo))
            raw_ends[c] = max(raw_ends[c], hi - base)
        tensor_chunks.append(tuple(range(first, last + 1)))
    if any(size == 0 for size in raw_ends):
        raise ValueError("a chunk holds no tensor bytes; the tensor offsets leave a gap of a whole chunk")
    return ChunkPlan(tuple(raw_ends), tuple(tuple(s) for s in segments), tuple(tensor_chunks))
