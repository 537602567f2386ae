"""Manifest format 2: a canonical JSON header, then the chunk columns as little-endian arrays.

Layout::

    MAGIC (8 bytes) | u32 header length H | header: H bytes of canonical JSON | zeros to a multiple of 8
    digests          n x 32 bytes
    crc32c           n x u32
    stored_size      n x u32
    codec runs       k0 x u32 run lengths, k0 x u8 indices into the header's "codecs"
    introduced_in    k1 x u32 run lengths, k1 x u64
    created_at       k2 x u32 run lengths, k2 x f64

Every column is padded with zeros to a multiple of 8 so the arrays can be read in place. Raw
sizes are not stored: the tensor layout gives them (``chunking.layout.chunk_raw_sizes``). Codec,
version and time stamp come in long runs (a push stamps all its new chunks alike), so they are
run-length coded; runs are maximal, which with the canonical header makes the encoding of a
manifest unique, so its content id is stable (``Manifest.from_bytes`` re-encodes to prove it).
The header holds ``chunk_count``, ``runs`` ([k0, k1, k2]) and everything that is not per chunk.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunking.chunk_table import DIGEST_BYTES

MAGIC = b"\x89PDMF\r\n\x1a"  # like PNG's: not UTF-8, so never mistaken for a JSON manifest, and text-mode mangling shows
_HEAD = struct.Struct("<I")
_PREFIX = len(MAGIC) + _HEAD.size
MAX_CHUNKS = (1 << 32) - 1
MAX_HEADER_BYTES = 256 << 20


@dataclass(frozen=True)
class Columns:
    """What the byte form holds per chunk (raw sizes are derived from the layout)."""

    digests: np.ndarray
    crc32c: np.ndarray
    stored_size: np.ndarray
    codec_index: np.ndarray
    introduced_in: np.ndarray
    created_at: np.ndarray


def is_binary(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[: len(MAGIC)]) == MAGIC


def first_use_order(values: np.ndarray) -> np.ndarray:
    """The distinct ``values`` in the order they first appear (a canonical codec table's order)."""
    used, first_row = np.unique(values, return_index=True)
    return used[np.argsort(first_row)]


def pad8(n: int) -> int:
    """Zero bytes that bring ``n`` bytes to a multiple of 8 (every column and header is padded so)."""
    return -n % 8


def canonical_json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def is_canonical_json(doc: dict[str, Any], data: bytes) -> bool:
    """Whether ``data`` is ``doc`` in canonical JSON. Untrusted input: a value nested near the
    recursion limit parses but does not re-encode, and a lone surrogate or NaN does not either."""
    try:
        return canonical_json(doc) == data
    except (ValueError, RecursionError, UnicodeEncodeError):
        return False


def encode_header(magic: bytes, doc: dict[str, Any]) -> bytes:
    """``magic``, the u32 length of ``doc`` in canonical JSON, that JSON, zeros to a multiple of 8."""
    head = canonical_json(doc)
    return b"".join([magic, _HEAD.pack(len(head)), head, bytes(pad8(len(magic) + _HEAD.size + len(head)))])


def read_header(data: bytes, at: int, *, max_bytes: int = MAX_HEADER_BYTES) -> tuple[dict[str, Any], int, int]:
    """The JSON object of a header whose u32 length is at ``at`` (after a magic the caller checked),
    and where its bytes start and end (before their padding); ValueError says what is wrong."""
    (head_len,) = _HEAD.unpack_from(data, at)
    start = at + _HEAD.size
    if head_len > max_bytes:
        raise ValueError(f"its header length {head_len} is over the {max_bytes}-byte limit")
    if head_len > len(data) - start:
        raise ValueError(f"its header length {head_len} runs past the end of the {len(data)} bytes (truncated?)")
    try:
        doc = json.loads(data[start : start + head_len].decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"its header is not UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError("its header is not an object")
    return doc, start, start + head_len


def check_header(data: bytes, doc: dict[str, Any], start: int, end: int) -> None:
    """Refuse a header (``read_header``'s) that is not canonical JSON or whose padding is not zeros."""
    if not is_canonical_json(doc, data[start:end]):
        raise ValueError("its header is not canonical JSON (sorted keys, no spaces)")
    pad = data[end : end + pad8(end)]
    if pad.count(0) != len(pad):
        raise ValueError("its padding is not zeros")


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if not len(values):
        return np.zeros(0, np.uint32), values[:0]
    starts = np.concatenate(([0], np.flatnonzero(values[1:] != values[:-1]) + 1))
    counts = np.diff(np.concatenate((starts, [len(values)])))
    return counts.astype("<u4"), values[starts]


def encode(header: dict[str, Any], columns: Columns) -> bytes:
    """Bytes of a manifest whose non-chunk fields are ``header`` (``chunk_count`` and ``runs`` are added)."""
    n = len(columns.digests)
    if n and (int(columns.stored_size.max()) > 0xFFFFFFFF or int(columns.stored_size.min()) < 1
              or int(columns.introduced_in.min()) < 0):
        raise ValueError("a chunk's stored_size or introduced_in does not fit format 2 (u32 sizes, u64 versions)")
    created = columns.created_at.astype("<f8") + 0.0  # -0.0 and 0.0 compare equal; one run, one spelling
    runs = [_runs(columns.codec_index.astype("u1")), _runs(columns.introduced_in.astype("<u8")), _runs(created)]
    doc = dict(header, chunk_count=n, runs=[len(c) for c, _ in runs])
    parts: list[bytes] = [encode_header(MAGIC, doc)]
    for array in (np.ascontiguousarray(columns.digests, np.uint8), columns.crc32c.astype("<u4"),
                  columns.stored_size.astype("<u4"), *(a for pair in runs for a in pair)):
        data = array.tobytes()
        parts += [data, bytes(pad8(len(data)))]
    return b"".join(parts)


def decode(data: bytes, *, canonical: bool = False) -> tuple[dict[str, Any], Columns]:
    """Header and columns of format-2 bytes; ValueError says what is wrong. Columns are views of ``data``.

    ``canonical``: also refuse bytes that ``encode`` would not have written (a header not in
    canonical JSON, non-zero padding, runs that are not maximal, a codec table not in order of
    first use): the cheap proof for many small blobs that re-encoding each would give it back."""
    if len(data) < _PREFIX or not is_binary(data):
        raise ValueError("it does not start with the format-2 magic bytes")
    doc, start, end = read_header(data, len(MAGIC))
    n, runs, codecs = doc.get("chunk_count"), doc.get("runs"), doc.get("codecs")
    if not isinstance(n, int) or not _count(n) or not isinstance(runs, list) or len(runs) != 3 or not all(_count(k) for k in runs):
        raise ValueError("its header lacks chunk_count or the three run counts")
    if not isinstance(codecs, list) or len(codecs) > 255:
        raise ValueError("its header lacks the codec table")
    k0, k1, k2 = runs
    widths = [(n * DIGEST_BYTES, "u1"), (n * 4, "<u4"), (n * 4, "<u4"), (k0 * 4, "<u4"), (k0, "u1"), (k1 * 4, "<u4"),
              (k1 * 8, "<u8"), (k2 * 4, "<u4"), (k2 * 8, "<f8")]
    pos = end + pad8(end)
    expected = pos + sum(size + pad8(size) for size, _ in widths)
    if expected != len(data):  # checked before any array is made: a forged count cannot make us allocate
        raise ValueError(f"it is {len(data)} bytes but its header describes {expected} ({n} chunks)")
    if canonical:
        check_header(data, doc, start, end)
    arrays = []
    for size, dtype in widths:
        arrays.append(np.frombuffer(data, dtype, size // np.dtype(dtype).itemsize, pos))
        pos += size + pad8(size)
        if canonical and data[pos - pad8(size) : pos].count(0) != pad8(size):
            raise ValueError("its padding is not zeros")
    digests, crc, stored, c_counts, c_vals, i_counts, i_vals, t_counts, t_vals = arrays
    if n and int(stored.min()) < 1:
        raise ValueError("a chunk has stored_size 0")
    if len(c_vals) and int(c_vals.max()) >= len(codecs):
        raise ValueError("a codec run names no entry of the codec table")
    if len(i_vals) and int(i_vals.max()) >= 1 << 63:
        raise ValueError("an introduced_in version is out of range")
    if not np.isfinite(t_vals).all():
        raise ValueError("a created_at time stamp is not finite")
    expanded = []
    for counts, values in ((c_counts, c_vals), (i_counts, i_vals), (t_counts, t_vals)):
        if (len(counts) and int(counts.min()) < 1) or int(counts.sum(dtype=np.int64)) != n:
            raise ValueError(f"its run lengths do not add up to its {n} chunks")
        if canonical and len(values) > 1 and bool((values[1:] == values[:-1]).any()):
            raise ValueError("its runs are not maximal (two neighbouring runs hold the same value)")
        expanded.append(np.repeat(values, counts))
    if canonical:
        if bool(np.signbit(t_vals[t_vals == 0]).any()):
            raise ValueError("a created_at time stamp is -0.0")
        if first_use_order(c_vals).tolist() != list(range(len(codecs))):
            raise ValueError("its codec table is not the codecs used in order of first use")
    columns = Columns(digests.reshape(n, DIGEST_BYTES), crc, stored, expanded[0], expanded[1].astype(np.int64),
                      expanded[2])
    return doc, columns


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_CHUNKS
