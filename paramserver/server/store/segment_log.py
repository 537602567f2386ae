"""Appends to the segment log and group commit.

Records go to the active segment with one ``pwritev`` under the write lock (``_write_locked``);
durability is waited for with group commit (``_wait_durable``): the first waiter fsyncs the
segment up to its current tail (covering the batches of every thread that appended meanwhile),
the others wait and skip when it covered their records. An append that fails (ENOSPC, EDQUOT:
StoreFullError naming the data dir and its free space) truncates the segment back so no torn record
stays; an fsync that fails truncates back to the last durable offset and fails every batch it
covered. Segments roll over at ``segment_bytes``: the full one is fsynced and sealed (its ``.idx``
written), the new file and the folder are fsynced when created.
"""
from __future__ import annotations

import errno
import os
import time

from paramserver.server.direct_io import pwrite_all
from paramserver.server.errors import StoreFullError
from paramserver.server.records import SEG_HEADER_SIZE, PutRecord, TombRecord, encode_index, encode_segment_header
from paramserver.server.segments import index_file, segment_file
from paramserver.server.store.files import fsync_dir, human_size, unlink_quietly
from paramserver.server.store.state import Rec, Segment, StoreState, log

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class SegmentLog(StoreState):
    """Appends records to the active segment and waits until they are durable (group commit)."""

    def _check_space(self, nbytes: int, what: str, reserve: int) -> None:
        if not reserve:
            return
        free = self.free_bytes()
        if free - nbytes < reserve:
            if self.reserve_bytes and free - nbytes < self.reserve_bytes:
                why = f"it would leave less than the {self.reserve_bytes}-byte reserve"
            else:
                why = f"it would leave less than the {reserve}-byte reserve the store keeps for its own records"
            raise self._full_error(what, why, free)

    def _write_locked(self, records: list[Rec], what: str) -> list[tuple[int, int]]:
        """Append ``records`` (header, body, what it is with offset 0) to the active segment(s), under
        ``_wcond``, and note them in their segment (for its index). Their (segment, offset) locations;
        on an error the segment is truncated back and nothing stays."""
        locs: list[tuple[int, int]] = []
        limit = self.config.segment_bytes
        i = 0
        while i < len(records):
            head, body, _r = records[i]
            seg = self._active_for(len(head) + (len(body) if body is not None else 0), what)
            start = pos = seg.size
            bufs: list[bytes] = []
            group: list[tuple[int, int]] = []
            first = i
            while i < len(records):
                head, body, _r = records[i]
                n = len(head) + (len(body) if body is not None else 0)
                if bufs and pos + n > limit:
                    break
                bufs.append(head)
                if body:
                    bufs.append(body)
                group.append((seg.no, pos))
                pos += n
                i += 1
            try:
                self._appender.write(seg.fd, seg.path, bufs, start)
            except OSError as exc:
                try:
                    os.ftruncate(seg.fd, start)
                except OSError:
                    pass  # the next append overwrites it; a reopen truncates it as a torn tail
                if exc.errno in _FULL_ERRNOS:
                    raise self._full_error(what, os.strerror(exc.errno or 0)) from exc
                raise
            seg.size = pos
            locs.extend(group)
            for (_h, _b, t), (_s, off) in zip(records[first:i], group):
                rec: PutRecord | TombRecord
                if isinstance(t, PutRecord):
                    rec = PutRecord(off, t.chunk_id, t.codec, t.raw_size, t.stored_size, t.crc)
                else:
                    rec = TombRecord(off, t.target_seg, t.target_off, t.chunk_id)
                    seg.tombs.append(rec)
                if seg.records is not None:
                    seg.records.append(rec)
        return locs

    def _active_for(self, n: int, what: str) -> Segment:
        """The active segment, rolled over first when a record of ``n`` bytes does not fit; under ``_wcond``."""
        while True:
            seg = self._active
            if seg is not None and (seg.size <= SEG_HEADER_SIZE or seg.size + n <= self.config.segment_bytes):
                return seg
            if seg is not None and self._syncing:
                self._wcond.wait()  # a group commit is fsyncing the active segment: seal it after
                continue
            if seg is not None:
                self._sync_active_locked(seg, what)
                self._seal(seg)
                self._active = None
            self._active = self._create_segment(what)

    def _create_segment(self, what: str) -> Segment:
        while True:
            no = self._next_no
            self._next_no += 1
            path = segment_file(self._seg_dir, no)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue  # another (read-only) instance cannot create; a stray file: skip its number
            except OSError as exc:
                if exc.errno in _FULL_ERRNOS:
                    raise self._full_error(what, os.strerror(exc.errno or 0)) from exc
                raise
            try:
                pwrite_all(fd, [encode_segment_header(no, time.time_ns())], 0)
                if self.fsync:
                    os.fsync(fd)
                    fsync_dir(self._seg_dir)
            except OSError as exc:
                os.close(fd)
                unlink_quietly(path)
                if exc.errno in _FULL_ERRNOS:
                    raise self._full_error(what, os.strerror(exc.errno or 0)) from exc
                raise
            seg = Segment(no, path, fd, SEG_HEADER_SIZE)
            seg.records = []
            with self._lock:
                self._segs[no] = seg
            self._durable = max(self._durable, (no, SEG_HEADER_SIZE))
            return seg

    def _sync_active_locked(self, seg: Segment, what: str = "the records just appended") -> None:
        """fsync the active segment before it is sealed; under ``_wcond`` with no group commit running."""
        if not self.fsync or self._durable >= (seg.no, seg.size):
            return
        try:
            os.fdatasync(seg.fd)
        except OSError as exc:
            self._sync_failed(seg, exc)
            raise self._convert(exc, what) from exc
        self._durable = max(self._durable, (seg.no, seg.size))
        self._wcond.notify_all()

    def _seal(self, seg: Segment) -> None:
        """Write the segment's index (best effort: without one, the next open scans the segment)."""
        self._appender.forget(seg.path)
        records = seg.records or []
        puts = [r for r in records if isinstance(r, PutRecord)]
        tombs = [r for r in records if isinstance(r, TombRecord)]
        path = index_file(self._seg_dir, seg.no)
        tmp = f"{path}.tmp"
        try:
            blob = encode_index(seg.no, seg.size, puts, tombs)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                pwrite_all(fd, [blob], 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self.fsync:
                fsync_dir(self._seg_dir)
            seg.idx_size = len(blob)
        except OSError as exc:
            unlink_quietly(tmp)
            log.warning("chunk store: segment %s sealed without its index (%s); the next open scans it %s", seg.path, exc, self._where)
        seg.sealed = True
        seg.records = None

    def _wait_durable(self, end: tuple[int, int], epoch: int, what: str = "the records just appended") -> None:
        """Return once everything up to ``end`` is durable (group commit: one fsync covers every
        batch appended before it starts). Raises when an fsync failed and truncated this batch."""
        if not self.fsync:
            return
        cond = self._wcond
        with cond:
            while True:
                if self._epoch != epoch:
                    assert self._sync_error is not None
                    raise self._convert(self._sync_error, what)
                if self._durable >= end:
                    return
                if self._syncing:
                    cond.wait()
                    continue
                seg = self._active
                assert seg is not None and seg.no == end[0], "an unsealed segment must be the active one"
                target = (seg.no, seg.size)
                self._syncing = True
                cond.release()
                error: OSError | None = None
                try:
                    os.fdatasync(seg.fd)
                except OSError as exc:
                    error = exc
                finally:
                    cond.acquire()
                    self._syncing = False
                if error is not None:
                    self._sync_failed(seg, error)
                    raise self._convert(error, what) from error
                self._durable = max(self._durable, target)
                cond.notify_all()

    def _sync_failed(self, seg: Segment, error: OSError) -> None:
        """An fsync failed: what it covered may not be on disk. Truncate back to the last durable
        offset and fail every batch appended since (under ``_wcond``)."""
        keep = self._durable[1] if self._durable[0] == seg.no else SEG_HEADER_SIZE
        try:
            os.ftruncate(seg.fd, keep)
        except OSError:
            pass
        seg.size = keep
        if seg.records is not None:
            seg.records = [r for r in seg.records if r.off < keep]
        seg.tombs = [t for t in seg.tombs if t.off < keep]
        self._epoch += 1
        self._sync_error = error
        self._wcond.notify_all()
        log.warning("chunk store: fsync of %s failed (%s): records after offset %d dropped, their writes refused %s",
                    seg.path, error, keep, self._where)

    def _convert(self, exc: BaseException, what: str) -> BaseException:
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return self._full_error(what, os.strerror(exc.errno or 0))
        return exc

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may still use on the data dir's file system (0 when unknown)."""
        try:
            st = os.statvfs(self.data_dir)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _full_error(self, what: str, why: str, free: int | None = None) -> StoreFullError:
        free = self.free_bytes() if free is None else free
        first = not self._full
        self._full = True
        if first:
            log.warning("chunk store full: %s free_bytes=%d error=%r; refusing writes until space returns, reads go on",
                        self._where, free, why)
        return StoreFullError(  # the service names the server in front of this
            f"chunk store {self.data_dir} is full ({why}): {free} bytes free ({human_size(free)}); "
            f"{what} was not stored. Free space there or add a server; reads go on",
            free,
        )
