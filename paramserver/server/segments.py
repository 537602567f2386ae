"""Segment files of the chunk store: scanning them, resolving which records are live, and tools.

See ``paramserver.server.records`` for the byte formats. This module reads segments; the store
(``paramserver.server.store``) appends to them. It is also what tests and drills use to find a
chunk's bytes on disk from outside the server process (``locate_on_disk``) and to damage them in
place (``corrupt_stored``, ``replace_stored``): the store's own view is its in-memory index.

Which records are live: every chunk record not killed by a tombstone (a tombstone names the exact
segment and offset it kills). When one chunk has several live records (a compaction that had
copied it, or a put after a crash, before the older copy's segment was removed), the latest one
(highest segment, then offset) is the chunk's copy and the others are *shadows*: never served,
killed too by a delete, gone when their segment is removed.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from chunking.hashing import crc32c

from paramserver.server.records import (
    HEADER_SIZE,
    MAGIC,
    SEG_HEADER_SIZE,
    TOMB_MAGIC,
    TOMB_SIZE,
    PutRecord,
    TombRecord,
    encode_header,
    parse_header,
    parse_index,
    parse_segment_header,
    parse_tombstone,
)

SEGMENTS_DIR = "segments"
SEG_SUFFIX, IDX_SUFFIX = ".seg", ".idx"
_SEG_NAME = re.compile(r"^(\d{16})\.seg$")
_RESYNC_WINDOW = 4 << 20

# A chunk record found after a damaged region is accepted only once its content is proven:
# (chunk_id, stored bytes, codec, raw_size) -> raises when the bytes are not that chunk.
Prover = Callable[[str, bytes, str, int], None]


def segment_file(folder: str | Path, segno: int) -> str:
    return f"{folder}/{segno:016d}{SEG_SUFFIX}"


def index_file(folder: str | Path, segno: int) -> str:
    return f"{folder}/{segno:016d}{IDX_SUFFIX}"


def list_segments(folder: str | Path) -> list[int]:
    """Segment numbers present in ``folder``, ascending."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_SEG_NAME.match, names) if m)


@dataclass
class SegmentScan:
    """What one segment file holds, as read on open."""

    segno: int
    path: str
    file_size: int
    end: int  # where the valid records end: file_size unless the file has a torn tail
    puts: list[PutRecord] = field(default_factory=list)
    tombs: list[TombRecord] = field(default_factory=list)
    corrupt: list[tuple[PutRecord, str]] = field(default_factory=list)  # a chunk record whose bytes are bad
    damaged: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, reason): skipped, unreadable
    from_index: bool = False  # loaded from its .idx (a sealed segment) rather than by a scan
    header_error: str = ""  # the segment header itself is bad

    @property
    def torn(self) -> int:
        return self.file_size - self.end


def _read_record(fd: int, pos: int, size: int, check_data: bool) -> tuple[PutRecord | TombRecord | None, str, PutRecord | None]:
    """The record at ``pos``: (record, "", None), or (None, why not, the chunk record whose header is
    valid but whose bytes are not)."""
    head = os.pread(fd, HEADER_SIZE, pos)
    if head[:4] == MAGIC:
        try:
            h = parse_header(head)
        except ValueError as exc:
            return None, str(exc), None
        if h.chunk_id is None:
            return None, "format-1 header inside a segment", None
        rec = PutRecord(pos, h.chunk_id, h.codec, h.raw_size, h.stored_size, h.crc32c)
        if pos + HEADER_SIZE + h.stored_size > size:
            return None, f"record of {h.stored_size} stored bytes runs past the end of the file", None
        if check_data:
            data = os.pread(fd, h.stored_size, pos + HEADER_SIZE)
            if len(data) != h.stored_size or crc32c(data) != h.crc32c:
                return None, "CRC32C mismatch", rec
        return rec, "", None
    if head[:4] == TOMB_MAGIC:
        if pos + TOMB_SIZE > size:
            return None, "tombstone runs past the end of the file", None
        try:
            t = parse_tombstone(head)
        except ValueError as exc:
            return None, str(exc), None
        return TombRecord(pos, t.target_seg, t.target_off, t.chunk_id), "", None
    return None, "no record starts here (bad magic)" if any(head) else "zero bytes where a record should start", None


def _resync(fd: int, pos: int, size: int, prove: Prover | None) -> int | None:
    """The offset of the next valid record at or after ``pos`` (data CRC checked; a chunk record also
    content-proven when ``prove`` is given), or None when nothing valid follows."""
    while pos < size:
        window = os.pread(fd, min(_RESYNC_WINDOW + 3, size - pos), pos)
        start = 0
        while True:
            hits = [i for i in (window.find(MAGIC, start), window.find(TOMB_MAGIC, start)) if i >= 0]
            if not hits:
                break
            at = pos + min(hits)
            rec, _why, _bad = _read_record(fd, at, size, True)
            if rec is not None:
                if prove is None or isinstance(rec, TombRecord):
                    return at
                try:
                    prove(rec.chunk_id, os.pread(fd, rec.stored_size, at + HEADER_SIZE), rec.codec, rec.raw_size)
                    return at
                except ValueError:  # InvalidChunkError is a ValueError: bytes that only look like a record
                    pass
            start = min(hits) + 1
        if len(window) <= 3:
            break
        pos += len(window) - 3
    return None


def scan_segment(fd: int, segno: int, path: str, *, check_data: bool, prove: Prover | None = None) -> SegmentScan:
    """Every record of a segment, read record header by record header from the start.

    A record that does not parse (or, with ``check_data``, whose bytes fail their CRC) ends the valid
    records when nothing valid follows it (a torn tail: ``end`` stops there); otherwise the bytes up to
    the next valid record are reported as damaged and the scan goes on after them.
    """
    size = os.fstat(fd).st_size
    scan = SegmentScan(segno, path, size, size)
    try:
        number, _created = parse_segment_header(os.pread(fd, SEG_HEADER_SIZE, 0))
        if number != segno:
            scan.header_error = f"segment header says segment {number}"
    except ValueError as exc:
        scan.header_error = str(exc)
        if size <= SEG_HEADER_SIZE:
            scan.end = 0
            return scan
    pos = SEG_HEADER_SIZE
    while pos < size:
        rec, why, bad = _read_record(fd, pos, size, check_data)
        if isinstance(rec, PutRecord):
            scan.puts.append(rec)
            pos += rec.length
            continue
        if isinstance(rec, TombRecord):
            scan.tombs.append(rec)
            pos += TOMB_SIZE
            continue
        nxt = _resync(fd, pos + 1, size, prove)
        if nxt is None:
            scan.end = pos
            break
        scan.damaged.append((pos, nxt, why))
        if bad is not None and bad.off + bad.length <= nxt:
            scan.corrupt.append((bad, why))
        pos = nxt
    return scan


def load_index_file(fd: int, segno: int, path: str, idx_path: str, *, verify: bool) -> SegmentScan | None:
    """A sealed segment from its index file, each entry checked against its record header when
    ``verify``; None when the index is missing, damaged or does not fit the segment (then scan it)."""
    try:
        with open(idx_path, "rb") as f:
            buf = f.read()
        seg_size, puts, tombs = parse_index(buf, segno)
    except (OSError, ValueError):
        return None
    size = os.fstat(fd).st_size
    if seg_size != size:
        return None
    scan = SegmentScan(segno, path, size, size, from_index=True)
    for t in tombs:
        if t.off + TOMB_SIZE > size:
            return None
    scan.tombs = tombs
    for p in puts:
        if p.off + p.length > size or p.off < SEG_HEADER_SIZE:
            return None
        if verify:
            head = os.pread(fd, HEADER_SIZE, p.off)
            expected = encode_header(p.codec, p.raw_size, p.stored_size, p.crc, p.chunk_id)
            if head != expected:
                try:
                    h = parse_header(head)
                    why = (f"record header names chunk {h.chunk_id} ({h.stored_size} bytes), the segment index "
                           f"{p.chunk_id} ({p.stored_size} bytes)")
                except ValueError as exc:
                    why = f"record header unreadable ({exc})"
                scan.corrupt.append((p, why))
                continue
        scan.puts.append(p)
    return scan


@dataclass
class Resolved:
    """The live view of a set of scanned segments."""

    index: dict[str, tuple[int, PutRecord]]  # chunk id -> (segment, record): the copy served
    shadows: dict[str, list[tuple[int, int]]]  # chunk id -> older live copies (segment, offset)
    killed: set[tuple[int, int]]  # chunk records a tombstone kills


def resolve(scans: dict[int, SegmentScan]) -> Resolved:
    killed = {(t.target_seg, t.target_off) for s in scans.values() for t in s.tombs if t.target_seg in scans}
    index: dict[str, tuple[int, PutRecord]] = {}
    shadows: dict[str, list[tuple[int, int]]] = {}
    for segno in sorted(scans):  # ascending: a later record replaces an earlier one
        for rec in scans[segno].puts:
            if (segno, rec.off) in killed:
                continue
            old = index.get(rec.chunk_id)
            if old is not None:
                shadows.setdefault(rec.chunk_id, []).append((old[0], old[1].off))
            index[rec.chunk_id] = (segno, rec)
    return Resolved(index, shadows, killed)


def read_view(data_dir: str | Path, *, verify: bool = False) -> tuple[dict[int, SegmentScan], Resolved]:
    """The segments of a data dir and their live view, read only (safe while a server runs)."""
    folder = Path(data_dir) / SEGMENTS_DIR
    scans: dict[int, SegmentScan] = {}
    for segno in list_segments(folder):
        path = segment_file(folder, segno)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # compacted away meanwhile
        try:
            scan = load_index_file(fd, segno, path, index_file(folder, segno), verify=verify)
            if scan is None:
                scan = scan_segment(fd, segno, path, check_data=verify)
        finally:
            os.close(fd)
        scans[segno] = scan
    return scans, resolve(scans)


# ------------------------------------------------------------------ tools: a chunk's bytes on disk


@dataclass(frozen=True)
class ChunkLocation:
    """Where a chunk's record lies: ``path`` (its segment file), ``record_offset`` (its 80-byte header),
    ``offset`` and ``length`` (its stored bytes)."""

    chunk_id: str
    path: Path
    record_offset: int
    offset: int
    length: int

    @property
    def record_length(self) -> int:
        return HEADER_SIZE + self.length

    def read_record(self) -> bytes:
        """The record's bytes (header + stored bytes) as they are on disk now."""
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), self.record_length, self.record_offset)

    def read_stored(self) -> bytes:
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), self.length, self.offset)


def locate_on_disk(data_dir: str | Path, chunk_id: str) -> ChunkLocation | None:
    """The live record of ``chunk_id`` in a data dir, found from its segment files alone (works from
    outside the server process); None when no live record holds it."""
    scans, view = read_view(data_dir)
    hit = view.index.get(chunk_id)
    if hit is None:
        return None
    segno, rec = hit
    return ChunkLocation(chunk_id, Path(scans[segno].path), rec.off, rec.off + HEADER_SIZE, rec.stored_size)


def chunks_on_disk(data_dir: str | Path) -> dict[str, ChunkLocation]:
    """Every live chunk record of a data dir (read only)."""
    scans, view = read_view(data_dir)
    return {cid: ChunkLocation(cid, Path(scans[s].path), r.off, r.off + HEADER_SIZE, r.stored_size)
            for cid, (s, r) in view.index.items()}


def write_in_place(path: str | Path, offset: int, data: bytes) -> None:
    """Overwrite bytes of a file in place (fsynced), as a disk fault or a forger would."""
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.pwrite(fd, view, offset + len(data) - len(view)):]
        os.fsync(fd)
    finally:
        os.close(fd)


def corrupt_stored(location: ChunkLocation, *, at: int = 0, count: int = 1, xor: int = 0x40, fix_crc: bool = False) -> bytes:
    """Flip ``count`` bytes of a chunk's stored bytes in place (from ``at``, spread over the record),
    leaving its header alone, or rewriting the header's CRC32C to match (``fix_crc``: only a content
    check can catch it then). Returns the record's original bytes."""
    original = location.read_record()
    if location.length == 0:
        raise ValueError(f"chunk {location.chunk_id} has no stored bytes to corrupt")
    data = bytearray(original[HEADER_SIZE:])
    for k in range(count):
        data[(at + k * 997) % len(data)] ^= xor
    replace_stored(location, bytes(data), fix_crc=fix_crc)
    return original


def replace_stored(location: ChunkLocation, data: bytes, *, fix_crc: bool = False) -> None:
    """Overwrite a chunk's stored bytes in place with ``data`` (same length); with ``fix_crc`` its
    header's CRC32C is rewritten to match."""
    if len(data) != location.length:
        raise ValueError(f"chunk {location.chunk_id} stores {location.length} bytes, not {len(data)}")
    if fix_crc:
        h = parse_header(location.read_record()[:HEADER_SIZE])
        header = encode_header(h.codec, h.raw_size, h.stored_size, crc32c(data), location.chunk_id)
        write_in_place(location.path, location.record_offset, header + data)
    else:
        write_in_place(location.path, location.offset, data)


def restore_record(location: ChunkLocation, record: bytes) -> None:
    """Put a record's original bytes (from ``read_record``/``corrupt_stored``) back in place."""
    if len(record) != location.record_length:
        raise ValueError(f"a record of {len(record)} bytes does not fit the {location.record_length}-byte slot")
    write_in_place(location.path, location.record_offset, record)


__all__ = [
    "SEGMENTS_DIR", "SegmentScan", "Resolved", "ChunkLocation", "segment_file", "index_file", "list_segments", "scan_segment",
    "load_index_file", "resolve", "read_view", "locate_on_disk", "chunks_on_disk", "write_in_place", "corrupt_stored",
    "replace_stored", "restore_record",
]
