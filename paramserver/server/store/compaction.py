"""The store's side of compaction (the policy and its pacing: ``paramserver.server.compaction``).

A sealed segment is rewritten by copying its live records into the active segment (each checked on
the way; a bad one is quarantined, never copied), swapping each index entry only if it is unchanged,
and removing the file once the copies are durable, without blocking reads or writes.
"""
from __future__ import annotations

import os

from paramserver.server.errors import ChunkCorruptError
from paramserver.server.records import HEADER_SIZE, SEG_HEADER_SIZE, TOMB_SIZE, PutRecord
from paramserver.server.segments import index_file
from paramserver.server.store.files import fsync_dir, unlink_quietly
from paramserver.server.store.reads import Reads
from paramserver.server.store.state import Entry, new_entry


class CompactionSteps(Reads):
    """The steps ``paramserver.server.compaction.Compactor`` drives."""

    def segment_usage(self) -> list[tuple[int, int, int, bool]]:
        """(segment, size of its file, live bytes, sealed) of every segment; live counts the indexed chunk
        records and the tombstones still needed (their target segment exists)."""
        with self._lock:
            segs = list(self._segs.values())
            present = set(self._segs)
            return [(s.no, s.size, s.live + s.pending + TOMB_SIZE * sum(1 for t in s.tombs if t.target_seg in present
                                                                             and t.target_seg != s.no), s.sealed)
                    for s in segs]

    def seal_active(self) -> int | None:
        """Seal the active segment now (the next write starts a new one), so compaction can rewrite it.
        Its number, or None when there is none or it is empty."""
        with self._wcond:
            self._check_writable()
            seg = self._active
            if seg is None or seg.size <= SEG_HEADER_SIZE:
                return None
            while self._syncing:
                self._wcond.wait()
            if self._active is not seg:
                return None
            self._sync_active_locked(seg)
            self._seal(seg)
            self._active = None
            return seg.no

    def live_records(self, segno: int) -> list[str]:
        """The chunks whose indexed copy lies in segment ``segno``, in disk order."""
        with self._lock:
            seg = self._segs.get(segno)
            if seg is None:
                return []
            index = self._index
            return sorted(seg.ids, key=lambda cid: index[cid].off)

    def record_sizes(self, chunk_ids: list[str]) -> list[int]:
        """The record length (header + stored bytes) of each chunk, 0 when absent."""
        index = self._index
        return [HEADER_SIZE + e.size if (e := index.get(cid)) is not None else 0 for cid in chunk_ids]

    def move_records(self, segno: int, chunk_ids: list[str]) -> tuple[int, int]:
        """Compaction: copy the given chunks' records out of sealed segment ``segno`` into the active
        segment (each checked on the way; a bad one is quarantined) and swap the index entries of those
        still unchanged. (bytes read, bytes written)."""
        batch: list[tuple[str, Entry, bytes, bytes]] = []
        nread = 0
        for chunk_id in chunk_ids:
            pinned = self._pin(chunk_id)
            if pinned is None or pinned[0].seg != segno:
                if pinned is not None:
                    self._unpin(pinned[1])
                continue
            e, seg = pinned
            head, data = self._read_record(chunk_id, e, seg)
            nread += len(head) + len(data)
            h, why = self._check_record(chunk_id, e, head, data)
            if h is None:
                if self._index.get(chunk_id) is e:
                    try:
                        self._corrupt(chunk_id, why, e)
                    except ChunkCorruptError:
                        pass  # dropped: compaction never copies a bad record
                continue
            batch.append((chunk_id, e, head, data))
        if not batch:
            return nread, 0
        nbytes = sum(len(h) + len(d) for _c, _e, h, d in batch)
        self._check_space(nbytes, f"compaction of segment {segno}", self.reserve_bytes)
        movers: list[tuple[str, Entry, tuple[int, int]]] = []
        with self._wcond:
            self._check_writable()
            with self._lock:
                batch = [b for b in batch if self._index.get(b[0]) is b[1]]
            if not batch:
                return nread, 0
            locs = self._write_locked([(h, d, PutRecord(0, c, e.codec, e.raw, e.size, e.crc)) for c, e, h, d in batch],
                                      f"compaction of segment {segno}")
            active = self._segs[locs[-1][0]]
            end = (active.no, active.size)
            with self._lock:
                for (chunk_id, e, _h, _d), loc in zip(batch, locs):
                    self._moving[chunk_id] = loc  # a delete from now on kills the copy too
                    self._segs[loc[0]].pending += HEADER_SIZE + e.size
                    movers.append((chunk_id, e, loc))
            epoch = self._epoch
        try:
            self._wait_durable(end, epoch)
        except BaseException:
            with self._lock:
                for chunk_id, e, loc in movers:
                    self._segs[loc[0]].pending -= HEADER_SIZE + e.size
                    if self._moving.get(chunk_id) == loc:
                        del self._moving[chunk_id]
            raise
        with self._lock:
            for chunk_id, e, loc in movers:
                self._segs[loc[0]].pending -= HEADER_SIZE + e.size
                if self._moving.get(chunk_id) != loc:
                    continue  # deleted or quarantined meanwhile: that killed the copy as well
                del self._moving[chunk_id]
                if self._index.get(chunk_id) is not e:
                    continue
                new = new_entry(loc[0], loc[1], e.size, e.crc, e.codec, e.raw)
                self._index[chunk_id] = new
                old_seg, new_seg = self._segs[e.seg], self._segs[loc[0]]
                old_seg.ids.discard(chunk_id)
                old_seg.live -= HEADER_SIZE + e.size
                new_seg.ids.add(chunk_id)
                new_seg.live += HEADER_SIZE + e.size
                self._shadows.setdefault(chunk_id, []).append((e.seg, e.off))  # until its segment is removed
        return nread, nbytes

    def remove_segment(self, segno: int) -> bool:
        """Compaction: remove sealed segment ``segno`` once no indexed copy lies in it: its tombstones
        still needed are appended to the active segment (durably) first. False when it still holds live
        records or is the active one."""
        with self._lock:
            seg = self._segs.get(segno)
            if seg is None or seg is self._active or not seg.sealed or seg.ids or seg.pending:
                return False
        with self._wcond:
            self._check_writable()
            carry = [(t.target_seg, t.target_off, t.chunk_id) for t in seg.tombs if t.target_seg != segno]
            end, epoch = self._append_tombstones_locked(carry)
        self._wait_durable(end, epoch)
        with self._wcond:
            with self._lock:
                if seg.ids or seg.pending or self._segs.get(segno) is not seg:
                    return False
                del self._segs[segno]
                for chunk_id in list(self._shadows):
                    kept = [loc for loc in self._shadows[chunk_id] if loc[0] != segno]
                    if kept:
                        self._shadows[chunk_id] = kept
                    else:
                        del self._shadows[chunk_id]
                seg.retired = True
                if seg.refs == 0:
                    os.close(seg.fd)
                    seg.fd = -1
                else:
                    self._retired.append(seg)
                self._compacted += 1
            unlink_quietly(seg.path)
            unlink_quietly(index_file(self._seg_dir, segno))
            if self.fsync:
                # durable before any tombstone aimed at it may be dropped by a later compaction
                fsync_dir(self._seg_dir)
        return True
