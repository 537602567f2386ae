"""Opening a data dir: its lock, and the index rebuilt from the segments.

A sealed segment is read from its ``.idx`` (each entry checked against the record header it points
at, and the file's size against the index's), the others by a scan of their record headers with
every record's CRC32C checked. A torn tail (a crash in the middle of an append) is truncated and
logged (WARNING naming the file and the records kept); a damaged region in the middle is skipped
and logged, and a chunk record whose bytes fail their CRC is quarantined. Nothing half-written is
ever indexed, so never served. Only one store may write a data dir: the first to open it holds
``segments/LOCK``; another instance (a tool, a test) opens it read only.
"""
from __future__ import annotations

import fcntl
import os

from chunking.hashing import is_content_id

from paramserver.server.records import PutRecord
from paramserver.server.segments import SegmentScan, index_file, list_segments, load_index_file, resolve, scan_segment, segment_file
from paramserver.server.store.files import fsync_dir_quietly, raise_fd_limit, size_of, unlink_quietly
from paramserver.server.store.migration import Migration
from paramserver.server.store.state import Segment, log, new_entry


class Recovery(Migration):
    """Opens a data dir: takes its lock, rebuilds the index from the segments, migrates the old layout."""

    def _open(self) -> None:
        for folder in (self.data_dir, self.quarantine_dir, self.segments_dir):
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                if self.fsync:
                    fsync_dir_quietly(str(folder.parent))
        raise_fd_limit()
        fd = os.open(f"{self._seg_dir}/LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._lock_fd[0] = fd
        except OSError:
            os.close(fd)
            log.warning("chunk store opened read only: %s is in use by another store (it holds %s/LOCK)", self._where, self._seg_dir)
        self._load()
        if not self.read_only and self.chunks_dir.is_dir():
            self._migrate()
        for name in os.listdir(self.quarantine_dir):
            chunk_id = name.split(".", 1)[0]
            if is_content_id(chunk_id) and chunk_id not in self._index:
                self._lost.setdefault(chunk_id, "found corrupt before the last restart")

    def _load(self) -> None:
        writable = not self.read_only
        numbers = list_segments(self._seg_dir)
        if writable:
            self._drop_stray_files(numbers)
        scans: dict[int, SegmentScan] = {}
        last = numbers[-1] if numbers else 0
        self._next_no = last + 1
        for segno in numbers:
            path = segment_file(self._seg_dir, segno)
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
            idx_path = index_file(self._seg_dir, segno)
            scan = load_index_file(fd, segno, path, idx_path, verify=self.config.verify_index_on_open)
            if scan is None:
                if os.path.exists(idx_path):
                    log.warning("chunk store: index %s is damaged or does not fit its segment; the segment is scanned "
                                "instead (every record checked) %s", idx_path, self._where)
                # Unsealed (the active one, or a crash before its index was written): scan it, every
                # record's bytes checked. A read-only view of a live writer's segment skips the data.
                scan = scan_segment(fd, segno, path, check_data=writable, prove=self._prove_content if writable else None)
            if scan.header_error and scan.end == 0:  # created, never written: a crash at creation
                os.close(fd)
                if writable:
                    log.warning("chunk store: removed empty segment %s (%s) %s", path, scan.header_error, self._where)
                    unlink_quietly(path)
                continue
            if scan.header_error:
                log.warning("chunk store: segment %s has a bad header (%s); its records are read anyway %s",
                            path, scan.header_error, self._where)
            for start, end, why in scan.damaged:
                log.warning("chunk store: segment %s: %d damaged bytes at offset %d skipped (%s) %s",
                            path, end - start, start, why, self._where)
            if scan.torn and writable:
                kept = len(scan.puts) + len(scan.tombs)
                os.ftruncate(fd, scan.end)
                if self.fsync:
                    os.fsync(fd)
                log.warning("chunk store: torn tail truncated: file=%s offset=%d bytes=%d records_kept=%d %s",
                            path, scan.end, scan.torn, kept, self._where)
            seg = Segment(segno, path, fd, scan.end if writable else scan.file_size)
            seg.sealed = scan.from_index
            seg.tombs = list(scan.tombs)
            if seg.sealed:
                seg.idx_size = size_of(index_file(self._seg_dir, segno))
            else:
                seg.records = sorted([*scan.puts, *scan.tombs], key=lambda r: r.off)
            self._segs[segno] = seg
            scans[segno] = scan
        view = resolve(scans)
        for cid, (segno, rec) in view.index.items():
            e = new_entry(segno, rec.off, rec.stored_size, rec.crc, rec.codec, rec.raw_size)
            self._index[cid] = e
            seg = self._segs[segno]
            seg.ids.add(cid)
            seg.live += rec.length
            self._live_bytes += rec.length
        self._shadows = view.shadows
        if writable:
            # the last unsealed segment goes on taking appends; any other unsealed one is sealed now
            for seg in list(self._segs.values()):
                if seg.sealed:
                    continue
                if seg.no == last and seg.size < self.config.segment_bytes:
                    self._active = seg
                else:
                    self._seal(seg)
        if self._segs:
            top = max(self._segs)
            self._durable = (top, self._segs[top].size)  # what is on disk now counts as durable
        self._handle_corrupt_on_open([(s.segno, rec, why) for s in scans.values() for rec, why in s.corrupt
                                      if (s.segno, rec.off) not in view.killed])
        if scans:
            log.info("chunk store opened: %s segments=%d chunks=%d live_bytes=%d shadows=%d%s", self._where, len(self._segs),
                     len(self._index), self._live_bytes, len(self._shadows), " (read only)" if not writable else "")

    def _drop_stray_files(self, numbers: list[int]) -> None:
        present = set(numbers)
        for name in os.listdir(self._seg_dir):
            full = f"{self._seg_dir}/{name}"
            if name.endswith(".tmp"):
                unlink_quietly(full)
            elif name.endswith(".idx") and name[:-4].isdigit() and int(name[:-4]) not in present:
                unlink_quietly(full)  # the index of a segment compaction removed

    def _handle_corrupt_on_open(self, found: list[tuple[int, PutRecord, str]]) -> None:
        kills: list[tuple[int, int, str]] = []
        for segno, rec, why in found:
            reason = f"record at offset {rec.off} of {segment_file(self._seg_dir, segno)}: {why}"
            kills.append((segno, rec.off, rec.chunk_id))
            if rec.chunk_id in self._index:
                continue  # another good copy is live: just kill this one
            self._lost[rec.chunk_id] = reason
            self._quarantined += 1
            target = ""
            if not self.read_only:
                target = self._copy_to_quarantine(rec.chunk_id, self._segs[segno], rec.off, rec.length)
            log.warning("chunk quarantined: id=%s reason=%r %s file=%s", rec.chunk_id, reason, self._where, target or "-")
            if self.on_corrupt is not None:
                self.on_corrupt(rec.chunk_id, reason)
        if kills and not self.read_only:
            try:
                self._kill(kills)
            except OSError as exc:
                log.warning("chunk store: could not write tombstones for %d corrupt records (%s); they are found again "
                            "on the next open %s", len(kills), exc, self._where)
