"""On-disk formats of the chunk store: chunk record headers, tombstones, segment headers, segment indexes.

A segment file (``DATA_DIR/segments/<16-digit number>.seg``) is a 32-byte segment header followed by
records, back to back, in the order they were appended:

* **segment header** (32 bytes): magic ``PDSG`` | version u8 | 3 zero bytes | segment number u64
  | created (ns since the epoch) u64 | crc32c of the preceding 24 bytes u32 | 4 zero bytes.
* **chunk record**: the format-2 chunk header (80 bytes, below) followed by the stored (encoded) bytes,
  exactly as they travel on the wire. A chunk record is byte for byte what a chunk file of the
  one-file-per-chunk layout held.
* **tombstone** (64 bytes): magic ``PDT1`` | version u8 | 3 zero bytes | target segment u64 | target
  offset u64 | chunk id (32 bytes) | 4 zero bytes | crc32c of the preceding 60 bytes u32. It kills the
  one chunk record at (target segment, target offset), which must name the same chunk; a later copy of
  the chunk elsewhere is not affected. Deletes, quarantines and compaction write them.

The format-2 chunk header (little endian):

    magic "PDC1" | format u8 (2) | codec length u8 | codec (18 bytes, ascii, padded)
    | raw_size u64 | stored_size u64 | crc32c of the stored bytes u32
    | chunk id (32 bytes: the binary digest the hex id spells)
    | crc32c of the preceding 76 header bytes u32

Format 1 (the one-file layout before the id was added) is the same without the id: a 48-byte header
whose CRC covers its first 44 bytes. Only the migration of an old data dir reads it; segments hold
format 2 only.

A **segment index** (``<number>.idx``, written when a segment is sealed) lists the segment's records so
that a restart need not scan it: a 32-byte header (magic ``PDSX`` | version u8 | 3 zero bytes | segment
number u64 | segment size u64 | record count u32 | 4 zero bytes), then one 80-byte entry per record
(kind u8: 1 chunk, 2 tombstone | codec length u8 | codec 18 bytes | crc32c u32 | offset u64 | stored
size or target segment u64 | raw size or target offset u64 | chunk id 32 bytes), then the crc32c of all
the preceding bytes (u32). On open each entry is checked against the record header it points at.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from chunking.hashing import crc32c

from paramserver.wire.limits import MAX_CODEC_LEN

# ------------------------------------------------------------------ chunk headers

MAGIC = b"PDC1"
FORMAT = 2  # what the store writes
FORMAT_V1 = 1  # read only (migration): no chunk id in the header
_HEAD_V1 = struct.Struct("<4sBB18sQQI")  # 44 bytes
_HEADER_V1 = struct.Struct("<44sI")
_HEAD_V2 = struct.Struct("<4sBB18sQQI32s")  # 76 bytes
_HEADER_V2 = struct.Struct("<76sI")
HEADER_SIZE_V1 = _HEADER_V1.size  # 48
HEADER_SIZE = _HEADER_V2.size  # 80: the header of every chunk record the store writes


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    format: int
    codec: str
    raw_size: int
    stored_size: int
    crc32c: int
    chunk_id: str | None  # the id the record says it holds; None in format 1

    @property
    def size(self) -> int:
        return HEADER_SIZE if self.format == FORMAT else HEADER_SIZE_V1


def encode_header(codec: str, raw_size: int, stored_size: int, crc: int, chunk_id: str | None = None) -> bytes:
    """The chunk header: format 2 (80 bytes) naming ``chunk_id``; format 1 (48 bytes, legacy) without one."""
    name = codec.encode("ascii")
    if chunk_id is None:
        head = _HEAD_V1.pack(MAGIC, FORMAT_V1, len(name), name, raw_size, stored_size, crc)
        return _HEADER_V1.pack(head, crc32c(head))
    head = _HEAD_V2.pack(MAGIC, FORMAT, len(name), name, raw_size, stored_size, crc, bytes.fromhex(chunk_id))
    return _HEADER_V2.pack(head, crc32c(head))


def parse_header(buf: bytes | bytearray | memoryview) -> ChunkHeader:
    """The chunk header at the start of ``buf`` (format 1 or 2), or ValueError naming what is wrong."""
    if len(buf) < HEADER_SIZE_V1:
        raise ValueError(f"record shorter than its {HEADER_SIZE_V1}-byte header")
    if bytes(buf[:4]) != MAGIC:
        raise ValueError("not a chunk record (bad magic)")
    fmt = buf[4]
    chunk_id: str | None = None
    if fmt == FORMAT:
        if len(buf) < HEADER_SIZE:
            raise ValueError(f"record shorter than its {HEADER_SIZE}-byte header")
        head, head_crc = _HEADER_V2.unpack_from(buf)
        if crc32c(head) != head_crc:
            raise ValueError("header checksum mismatch")
        _magic, _fmt, codec_len, codec, raw_size, stored_size, crc, raw_id = _HEAD_V2.unpack(head)
        chunk_id = raw_id.hex()
    elif fmt == FORMAT_V1:
        head, head_crc = _HEADER_V1.unpack_from(buf)
        if crc32c(head) != head_crc:
            raise ValueError("header checksum mismatch")
        _magic, _fmt, codec_len, codec, raw_size, stored_size, crc = _HEAD_V1.unpack(head)
    else:
        raise ValueError(f"chunk record of unknown format {fmt} (this server reads formats {FORMAT_V1} and {FORMAT})")
    if codec_len > MAX_CODEC_LEN:
        raise ValueError(f"header names a codec of {codec_len} bytes, over {MAX_CODEC_LEN}")
    try:
        name = codec[:codec_len].decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("header codec is not ascii") from None
    return ChunkHeader(fmt, name, raw_size, stored_size, crc, chunk_id)


def decode_header(header: bytes) -> tuple[str, int, int, int]:
    """(codec, raw_size, stored_size, crc32c) of a format-1 or -2 header, or ValueError naming what is wrong."""
    h = parse_header(header)
    return h.codec, h.raw_size, h.stored_size, h.crc32c


# ------------------------------------------------------------------ tombstones

TOMB_MAGIC = b"PDT1"
_TOMB_HEAD = struct.Struct("<4sB3xQQ32s4x")  # 60 bytes
_TOMB = struct.Struct("<60sI")
TOMB_SIZE = _TOMB.size  # 64


@dataclass(frozen=True, slots=True)
class Tombstone:
    target_seg: int
    target_off: int
    chunk_id: str


def encode_tombstone(target_seg: int, target_off: int, chunk_id: str) -> bytes:
    head = _TOMB_HEAD.pack(TOMB_MAGIC, 1, target_seg, target_off, bytes.fromhex(chunk_id))
    return _TOMB.pack(head, crc32c(head))


def parse_tombstone(buf: bytes | bytearray | memoryview) -> Tombstone:
    if len(buf) < TOMB_SIZE:
        raise ValueError(f"record shorter than a {TOMB_SIZE}-byte tombstone")
    head, head_crc = _TOMB.unpack_from(buf)
    if crc32c(head) != head_crc:
        raise ValueError("tombstone checksum mismatch")
    magic, version, target_seg, target_off, raw_id = _TOMB_HEAD.unpack(head)
    if magic != TOMB_MAGIC or version != 1:
        raise ValueError("not a tombstone")
    return Tombstone(target_seg, target_off, raw_id.hex())


# ------------------------------------------------------------------ segment headers

SEG_MAGIC = b"PDSG"
_SEG_HEAD = struct.Struct("<4sB3xQQ")  # 24 bytes
_SEG = struct.Struct("<24sI4x")
SEG_HEADER_SIZE = _SEG.size  # 32


def encode_segment_header(segno: int, created_ns: int) -> bytes:
    head = _SEG_HEAD.pack(SEG_MAGIC, 1, segno, created_ns)
    return _SEG.pack(head, crc32c(head))


def parse_segment_header(buf: bytes) -> tuple[int, int]:
    """(segment number, created ns) of a segment header, or ValueError."""
    if len(buf) < SEG_HEADER_SIZE:
        raise ValueError(f"file shorter than its {SEG_HEADER_SIZE}-byte segment header")
    head, head_crc = _SEG.unpack_from(buf)
    if crc32c(head) != head_crc:
        raise ValueError("segment header checksum mismatch")
    magic, version, segno, created = _SEG_HEAD.unpack(head)
    if magic != SEG_MAGIC or version != 1:
        raise ValueError("not a segment file (bad magic or version)")
    return segno, created


# ------------------------------------------------------------------ segment indexes

IDX_MAGIC = b"PDSX"
_IDX_HEAD = struct.Struct("<4sB3xQQI4x")  # 32 bytes
_IDX_ENTRY = struct.Struct("<BB18sIQQQ32s")  # 80 bytes
KIND_CHUNK, KIND_TOMB = 1, 2


@dataclass(frozen=True, slots=True)
class PutRecord:
    """A chunk record of a segment: its header's offset and what the header says."""

    off: int
    chunk_id: str
    codec: str
    raw_size: int
    stored_size: int
    crc: int

    @property
    def length(self) -> int:
        return HEADER_SIZE + self.stored_size


@dataclass(frozen=True, slots=True)
class TombRecord:
    off: int
    target_seg: int
    target_off: int
    chunk_id: str


def encode_index(segno: int, seg_size: int, puts: list[PutRecord], tombs: list[TombRecord]) -> bytes:
    parts = [_IDX_HEAD.pack(IDX_MAGIC, 1, segno, seg_size, len(puts) + len(tombs))]
    for p in puts:
        name = p.codec.encode("ascii")
        parts.append(_IDX_ENTRY.pack(KIND_CHUNK, len(name), name, p.crc, p.off, p.stored_size, p.raw_size, bytes.fromhex(p.chunk_id)))
    for t in tombs:
        parts.append(_IDX_ENTRY.pack(KIND_TOMB, 0, b"", 0, t.off, t.target_seg, t.target_off, bytes.fromhex(t.chunk_id)))
    body = b"".join(parts)
    return body + struct.pack("<I", crc32c(body))


def parse_index(buf: bytes, segno: int) -> tuple[int, list[PutRecord], list[TombRecord]]:
    """(segment size, chunk records, tombstones) of a segment index, or ValueError."""
    if len(buf) < _IDX_HEAD.size + 4:
        raise ValueError("index shorter than its header")
    body, (crc,) = buf[:-4], struct.unpack("<I", buf[-4:])
    if crc32c(body) != crc:
        raise ValueError("index checksum mismatch")
    magic, version, number, seg_size, count = _IDX_HEAD.unpack_from(body)
    if magic != IDX_MAGIC or version != 1:
        raise ValueError("not a segment index")
    if number != segno:
        raise ValueError(f"index of segment {number}, not {segno}")
    if len(body) != _IDX_HEAD.size + count * _IDX_ENTRY.size:
        raise ValueError(f"index says {count} entries, holds {(len(body) - _IDX_HEAD.size) / _IDX_ENTRY.size:g}")
    puts: list[PutRecord] = []
    tombs: list[TombRecord] = []
    for kind, codec_len, codec, crc_, off, a, b, raw_id in _IDX_ENTRY.iter_unpack(body[_IDX_HEAD.size:]):
        if kind == KIND_CHUNK:
            if codec_len > MAX_CODEC_LEN:
                raise ValueError("index entry with an overlong codec")
            puts.append(PutRecord(off, raw_id.hex(), codec[:codec_len].decode("ascii"), b, a, crc_))
        elif kind == KIND_TOMB:
            tombs.append(TombRecord(off, a, b, raw_id.hex()))
        else:
            raise ValueError(f"index entry of unknown kind {kind}")
    return seg_size, puts, tombs


__all__ = [
    "MAGIC", "FORMAT", "FORMAT_V1", "HEADER_SIZE", "HEADER_SIZE_V1", "ChunkHeader", "encode_header", "parse_header",
    "decode_header", "TOMB_MAGIC", "TOMB_SIZE", "Tombstone", "encode_tombstone", "parse_tombstone", "SEG_MAGIC",
    "SEG_HEADER_SIZE", "encode_segment_header", "parse_segment_header", "PutRecord", "TombRecord", "encode_index",
    "parse_index", "KIND_CHUNK", "KIND_TOMB",
]
