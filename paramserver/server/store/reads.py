"""Reads: ``pread`` of a record's header and bytes, checked, and what the index says without a read.

The header must name the requested id and the stored bytes must match the header's CRC32C; a
record that fails is quarantined (``quarantine.py``) and the read raises ChunkCorruptError. Wrong
bytes are never returned. ``get_many`` reads records that lie next to each other with one pread.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from chunking.hashing import crc32c

from paramserver.server.errors import ChunkCorruptError, ChunkError, InvalidChunkError, UnknownCodecError
from paramserver.server.records import FORMAT, HEADER_SIZE, MAGIC, ChunkHeader, parse_header
from paramserver.server.segments import ChunkLocation
from paramserver.server.store.config import MiB
from paramserver.server.store.proofs import ContentProofs
from paramserver.server.store.quarantine import Quarantine
from paramserver.server.store.state import Entry, Segment, StoredChunk
from paramserver.wire.limits import MAX_CODEC_LEN


# A format-2 record header as a numpy record (paramserver.server.records has the layout): a run of small records is
# checked as arrays.
_HEADER_DTYPE = np.dtype([("magic", "S4"), ("format", "u1"), ("codec_len", "u1"), ("codec", f"S{MAX_CODEC_LEN}"),
                          ("raw", "<u8"), ("stored", "<u8"), ("crc", "<u4"), ("id", "V32"), ("head_crc", "<u4")])
_CODECS: dict[bytes, str] = {}

_MAX_READ_RUN = 8 * MiB  # get_many reads adjacent records with one pread up to about this many bytes ...
_COALESCE_MAX = 64 * 1024  # ... of chunks up to this size (larger ones are read alone, without a copy),
# skipping over up to this many bytes of other records between two: a reader that spreads a model
# over its replicas asks each for every second or third record, and two preads per small chunk
# cost more than copying the records between them out of the page cache.
_COALESCE_GAP = 32 * 1024


class Reads(Quarantine, ContentProofs):
    """Checked reads of stored chunks, and what the index says without a read."""

    def has(self, chunk_id: str) -> bool:
        return chunk_id in self.cache or chunk_id in self._index

    def has_many(self, chunk_ids: Sequence[str]) -> list[bool]:
        """``has`` of each id, one lock of the cache for all (a HasChunks call of thousands)."""
        index = self._index
        return [c or cid in index for cid, c in zip(chunk_ids, self.cache.contains_many(chunk_ids))]

    def get(self, chunk_id: str, *, use_cache: bool = True) -> StoredChunk:
        """The stored chunk, its id and CRC32C checked. Raises ChunkNotFoundError or ChunkCorruptError."""
        self.traffic += 1
        if use_cache:
            hit = self.cache.get(chunk_id)
            if hit is not None:
                return hit
        self.check_id(chunk_id)
        chunk, entry = self._read(chunk_id)
        if use_cache and self._index.get(chunk_id) is entry:
            self.cache.put(chunk_id, chunk, len(chunk.data))
        return chunk

    def get_many(self, chunk_ids: Sequence[str]) -> list[StoredChunk | ChunkError]:
        """``get`` of each id, in order, with what it would raise returned in its place.

        Records that lie next to each other in a segment (chunks pushed together) are read with
        one ``pread``: a batch of small chunks costs a few system calls instead of two per chunk.
        Anything that does not check out is read again alone, as ``get`` does, which retries a
        record that moved and quarantines a corrupt one.
        """
        self.traffic += 1
        cache = self.cache
        out: list[StoredChunk | ChunkError | None] = list(cache.get_many(chunk_ids))
        todo = [k for k, hit in enumerate(out) if hit is None]
        pinned: list[tuple[int, Entry, Segment]] = []
        alone: list[int] = []
        with self._lock:
            index, segs = self._index, self._segs
            for k in todo:
                e = index.get(chunk_ids[k])
                if e is None:
                    alone.append(k)  # absent or malformed: get() raises what it should
                    continue
                seg = segs[e.seg]
                seg.refs += 1
                pinned.append((k, e, seg))
        pinned.sort(key=lambda p: (p[1].seg, p[1].off))
        admit: list[tuple[str, StoredChunk, Entry]] = []
        i = unread = 0  # pinned[unread:] are still pinned (a read unpins its run whatever happens)
        try:
            while i < len(pinned):
                _k, first, seg = pinned[i]
                end = first.off + HEADER_SIZE + first.size
                j = i + 1
                if first.size <= _COALESCE_MAX:
                    while (j < len(pinned) and pinned[j][1].seg == first.seg
                           and end <= pinned[j][1].off <= end + _COALESCE_GAP
                           and pinned[j][1].size <= _COALESCE_MAX and end - first.off < _MAX_READ_RUN):
                        end = pinned[j][1].off + HEADER_SIZE + pinned[j][1].size
                        j += 1
                run = pinned[i:j]
                unread = j
                if j == i + 1:
                    # One record (a large chunk, or one alone): header and bytes read apart, so the
                    # bytes are not copied out of a combined buffer.
                    k = run[0][0]
                    head, data = self._read_record(chunk_ids[k], first, seg)
                    h, _why = self._check_record(chunk_ids[k], first, head, data)
                    if h is None:
                        alone.append(k)
                    else:
                        out[k] = chunk = StoredChunk(chunk_ids[k], data, h.codec, h.raw_size, h.crc32c)
                        admit.append((chunk_ids[k], chunk, first))
                else:
                    try:
                        buf = os.pread(seg.fd, end - first.off, first.off)
                    finally:
                        with self._lock:
                            seg.refs -= len(run)
                            self._close_retired(seg)
                    self._take_run(chunk_ids, run, first.off, buf, out, alone, admit)
                i = j
        except BaseException:
            # A failed read (an I/O error) must not leave the records not yet read pinned.
            with self._lock:
                for _k, _e, seg in pinned[unread:]:
                    seg.refs -= 1
                    self._close_retired(seg)
            raise
        if admit:
            # Only what the index still names (not moved or replaced meanwhile); a batch read is a
            # load or pull walking a model: a scan.
            with self._lock:
                fresh = [(cid, chunk, e.size) for cid, chunk, e in admit if index.get(cid) is e]
            cache.put_many(fresh, scan=True)
        for k in alone:
            try:
                out[k] = self.get(chunk_ids[k])
            except ChunkError as exc:
                out[k] = exc
        return out  # type: ignore[return-value]  # every slot is filled above

    @staticmethod
    def _take_run(chunk_ids: Sequence[str], run: list[tuple[int, Entry, Segment]], base: int, buf: bytes,
                  out: list[StoredChunk | ChunkError | None], alone: list[int],
                  admit: list[tuple[str, StoredChunk, Entry]]) -> None:
        """Check the records of one coalesced read (``buf``, from offset ``base``) as arrays: each
        header's magic, format, checksum, id and size, and each record's CRC32C; what passes goes
        to ``out`` (and ``admit``, for the cache), what does not to ``alone`` (read again alone)."""
        ks = [k for k, _e, _s in run]
        entries = [e for _k, e, _s in run]
        rel = np.fromiter((e.off - base for _k, e, _s in run), dtype=np.int64, count=len(run))
        sizes = np.fromiter((e.size for _k, e, _s in run), dtype=np.int64, count=len(run))
        heads = np.frombuffer(buf, dtype=np.uint8)[rel[:, None] + np.arange(HEADER_SIZE)]
        rec = heads.view(_HEADER_DTYPE).reshape(-1)
        try:
            want = np.frombuffer(bytes.fromhex("".join([chunk_ids[k] for k in ks])), dtype=np.uint8).reshape(-1, 32)
        except ValueError:
            alone.extend(ks)
            return
        if want.shape != (len(ks), 32):
            alone.extend(ks)
            return
        good = ((rec["magic"] == MAGIC) & (rec["format"] == FORMAT) & (rec["codec_len"] <= MAX_CODEC_LEN)
                & (rec["stored"] == sizes) & (heads[:, 44:76] == want).all(axis=1))
        head_bytes = heads.tobytes()
        view = memoryview(buf)
        head_crcs = rec["head_crc"].tolist()
        crcs = rec["crc"].tolist()
        codecs = rec["codec"].tolist()
        raws = rec["raw"].tolist()
        starts = (rel + HEADER_SIZE).tolist()
        ends = (rel + HEADER_SIZE + sizes).tolist()
        for n, (k, ok) in enumerate(zip(ks, good.tolist())):
            data = view[starts[n] : ends[n]]
            if not (ok and crc32c(head_bytes[n * HEADER_SIZE : (n + 1) * HEADER_SIZE - 4]) == head_crcs[n]
                    and crc32c(data) == crcs[n]):
                alone.append(k)
                continue
            name = _CODECS.get(codecs[n])
            if name is None:
                try:
                    name = codecs[n].decode("ascii")
                except UnicodeDecodeError:
                    alone.append(k)
                    continue
                if len(_CODECS) < 64:
                    _CODECS[codecs[n]] = name
            out[k] = chunk = StoredChunk(chunk_ids[k], bytes(data), name, raws[n], crcs[n])
            admit.append((chunk_ids[k], chunk, entries[n]))

    def _read_record(self, chunk_id: str, e: Entry, seg: Segment) -> tuple[bytes, bytes]:
        try:
            head = os.pread(seg.fd, HEADER_SIZE, e.off)
            data = os.pread(seg.fd, e.size, e.off + HEADER_SIZE)
        finally:
            self._unpin(seg)
        return head, data

    @staticmethod
    def _check_record(chunk_id: str, e: Entry, head: bytes, data: bytes) -> tuple[ChunkHeader | None, str]:
        try:
            h = parse_header(head)
        except ValueError as exc:
            return None, str(exc)
        if h.chunk_id != chunk_id:
            return None, f"the record holds chunk {h.chunk_id}, not {chunk_id} (a swapped or misplaced record)"
        if h.stored_size != e.size:
            return None, f"the record header says {h.stored_size} stored bytes, the index {e.size}"
        if len(data) != e.size:
            return None, f"short read: {len(data)} of {e.size} bytes"
        if crc32c(data) != h.crc32c:
            return None, "CRC32C mismatch"
        return h, ""

    def _read(self, chunk_id: str) -> tuple[StoredChunk, Entry]:
        """The chunk from disk, checked: its header names it and its bytes match the header's CRC32C."""
        for _attempt in range(8):
            pinned = self._pin(chunk_id)
            if pinned is None:
                self._missing(chunk_id)
            e, seg = pinned
            head, data = self._read_record(chunk_id, e, seg)
            h, why = self._check_record(chunk_id, e, head, data)
            if h is not None:
                return StoredChunk(chunk_id, data, h.codec, h.raw_size, h.crc32c), e
            if self._index.get(chunk_id) is not e:
                continue  # moved by compaction or replaced meanwhile: read the current copy
            self._corrupt(chunk_id, why, e)
        raise ChunkCorruptError(chunk_id, f"chunk {chunk_id}: its record kept moving while being read; try again")

    def verify(self, chunk_id: str) -> StoredChunk:
        """Full check from disk (id, CRC32C, decode, content id), bypassing the cache.

        Used by the scrubber and before trusting an existing copy for repair.
        """
        self.check_id(chunk_id)
        for _attempt in range(8):
            chunk, e = self._read(chunk_id)
            try:
                self._prove_content(chunk_id, chunk.data, chunk.codec, chunk.raw_size)
            except UnknownCodecError:
                raise
            except InvalidChunkError as exc:
                if self._index.get(chunk_id) is e:
                    self._corrupt(chunk_id, str(exc), e)
                continue  # moved meanwhile: prove the current copy
            return chunk
        raise ChunkCorruptError(chunk_id, f"chunk {chunk_id}: its record kept moving while being verified; try again")

    def locate(self, chunk_id: str) -> ChunkLocation | None:
        """Where the chunk's record lies on disk (segment file, record offset, stored bytes' offset and
        length), for tools and tests; None when it is not stored here."""
        with self._lock:
            e = self._index.get(chunk_id)
            if e is None:
                return None
            seg = self._segs[e.seg]
            return ChunkLocation(chunk_id, Path(seg.path), e.off, e.off + HEADER_SIZE, e.size)

    def stored_size(self, chunk_id: str) -> int | None:
        """The stored (encoded) size of a chunk from the index, no disk read; None when absent."""
        e = self._index.get(chunk_id)
        return None if e is None else e.size

    def held(self, chunk_ids: Sequence[str], *, claim: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per id, from the index in one pass (no disk read): present, the CRC32C its stored copy
        declares (0 when absent) and whether that copy is raw. ``claim``: the present ones get a
        fresh claim time, as ``claim`` gives them. The commit check asks this about every chunk
        of a version, half a million for a big checkpoint at small chunks."""
        n = len(chunk_ids)
        with self._lock:
            entries = list(map(self._index.get, chunk_ids))
            if claim:
                now = self._clock()
                claimed = self._claimed
                for chunk_id, e in zip(chunk_ids, entries):
                    if e is not None:
                        claimed[chunk_id] = now
        present = np.fromiter((e is not None for e in entries), bool, n)
        crc = np.fromiter((0 if e is None else e.crc for e in entries), np.uint32, n)
        raw = np.fromiter((e is not None and e.codec == "raw" for e in entries), bool, n)
        return present, crc, raw

    def stored_headers(self, ids: Iterable[str], present: Iterable[bool] | None = None) -> list[tuple[int, str] | None]:
        """(CRC32C, codec) the stored copy of each chunk declares (from the index, no disk read); None
        when absent (or not ``present``)."""
        out: list[tuple[int, str] | None] = []
        index = self._index
        flags: Iterable[bool] = present if present is not None else iter(lambda: True, False)
        for chunk_id, here in zip(ids, flags):
            e = index.get(chunk_id) if here else None
            out.append(None if e is None else (e.crc, e.codec))
        return out
