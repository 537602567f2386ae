"""Claims, deletes and tombstones.

``claim`` and writes record a last-claim time in memory (after a restart every chunk counts as
claimed at open: an orphan is collected one grace period later at most). ``delete`` and
``delete_if_unclaimed`` drop the chunk from the index and append a durable tombstone, which kills
its record and every older copy: a deleted chunk never comes back after a restart.
"""
from __future__ import annotations

from collections.abc import Iterable

from paramserver.server.records import HEADER_SIZE, TOMB_SIZE, TombRecord, encode_tombstone
from paramserver.server.store.segment_log import SegmentLog
from paramserver.server.store.state import Entry


class Tombstones(SegmentLog):
    """Claims, deletes, and the tombstones that make a delete outlive a restart."""

    def claim(self, chunk_ids: Iterable[str]) -> list[bool]:
        """Which chunks are here; the ones that are get a fresh claim time.

        A push that finds a chunk here does not send it again: from then on the chunk must
        outlive the orphan grace period even if no committed version names it yet (an orphan
        of an old failed push, about to be collected). ``delete_if_unclaimed`` decides under the
        same lock, so a claim and a collection of one chunk never interleave.
        """
        now = self._clock()
        out: list[bool] = []
        with self._lock:
            index, claimed = self._index, self._claimed
            for chunk_id in chunk_ids:
                if chunk_id in index:
                    claimed[chunk_id] = now
                    out.append(True)
                else:
                    out.append(False)
        return out

    def claimed_at(self, chunk_id: str) -> float | None:
        """When the chunk was last written or claimed (the open time for chunks untouched since); None when absent."""
        with self._lock:
            if chunk_id not in self._index:
                return None
            return self._claimed.get(chunk_id, self._opened_at)

    def delete(self, chunk_id: str) -> bool:
        self.check_id(chunk_id)
        return self._delete([chunk_id], None) == [chunk_id]

    def delete_if_unclaimed(self, chunk_id: str, older_than: float) -> bool:
        """Delete ``chunk_id`` when it was last written or claimed before ``older_than``."""
        self.check_id(chunk_id)
        return self._delete([chunk_id], older_than) == [chunk_id]

    def delete_unclaimed(self, chunk_ids: Iterable[str], older_than: float) -> list[str]:
        """``delete_if_unclaimed`` for several chunks, with one durable batch of tombstones: the ids deleted."""
        ids = list(chunk_ids)
        for chunk_id in ids:
            self.check_id(chunk_id)
        return self._delete(ids, older_than)

    def _delete(self, chunk_ids: list[str], older_than: float | None) -> list[str]:
        deleted: list[str] = []
        with self._wcond:
            self._check_writable()
            kills: list[tuple[int, int, str]] = []
            with self._lock:
                for chunk_id in chunk_ids:
                    e = self._index.get(chunk_id)
                    if e is None:
                        continue
                    if older_than is not None and self._claimed.get(chunk_id, self._opened_at) >= older_than:
                        continue  # written or claimed within the grace period
                    kills.extend((s, o, chunk_id) for s, o in self._unindex_locked(chunk_id, e))
                    deleted.append(chunk_id)
                if deleted:
                    self._generation += 1
                    self._losses += 1
            for chunk_id in deleted:
                self.cache.discard(chunk_id)
            end, epoch = self._append_tombstones_locked(kills)
        self._wait_durable(end, epoch)
        return deleted

    def _unindex_locked(self, chunk_id: str, e: Entry) -> list[tuple[int, int]]:
        """Drop ``chunk_id`` from the index (under ``_lock``): the locations a tombstone must kill."""
        del self._index[chunk_id]
        seg = self._segs[e.seg]
        seg.ids.discard(chunk_id)
        seg.live -= HEADER_SIZE + e.size
        self._live_bytes -= HEADER_SIZE + e.size
        self._claimed.pop(chunk_id, None)
        locs = [(e.seg, e.off), *self._shadows.pop(chunk_id, [])]
        moving = self._moving.pop(chunk_id, None)
        if moving is not None:
            locs.append(moving)
        return locs

    def _append_tombstones_locked(self, kills: list[tuple[int, int, str]]) -> tuple[tuple[int, int], int]:
        """Append a tombstone per (segment, offset, id) whose segment still exists; under ``_wcond``.
        The (segment, offset) to wait for and the epoch."""
        kills = [k for k in kills if k[0] in self._segs]
        if not kills:
            return (0, 0), self._epoch
        locs = self._write_locked([(encode_tombstone(s, o, cid), None, TombRecord(0, s, o, cid)) for s, o, cid in kills],
                                  f"{len(kills)} tombstones")
        last = locs[-1]
        return (last[0], last[1] + TOMB_SIZE), self._epoch

    def _kill(self, kills: list[tuple[int, int, str]]) -> None:
        with self._wcond:
            self._check_writable()
            end, epoch = self._append_tombstones_locked(kills)
        self._wait_durable(end, epoch)
