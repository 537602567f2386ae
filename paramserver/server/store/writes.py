"""Writes: ``put_many`` proves each chunk, appends the batch and returns once it is durable.

Each chunk is proven (CRC32C, decode with the output capped at ``max_raw_bytes``, BLAKE3) without
any lock, then the batch is appended with one ``pwritev`` and waited for with group commit
(``segment_log.py``). A chunk is indexed, so visible to ``has``/``claim``/``get``, only then.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from paramserver.server.errors import ChunkCorruptError, ChunkNotFoundError, ParamServerError
from paramserver.server.records import HEADER_SIZE, PutRecord, encode_header
from paramserver.server.store.reads import Reads
from paramserver.server.store.state import Entry, Pending, Rec, log, new_entry
from paramserver.wire.chunk_record import ChunkRecord


class Writes(Reads):
    """Proven, durable writes of chunks: ``put`` and ``put_many``."""

    def put(self, chunk_id: str, data: bytes, codec: str, raw_size: int, crc: int) -> bool:
        """Verify and store one chunk. True when written, False when an intact copy was already here.

        Raises InvalidChunkError (the sender's bytes are wrong) or StoreFullError (the disk is full).
        """
        return self.put_many([ChunkRecord(chunk_id, codec, raw_size, crc, data)])[0]

    def put_many(self, chunks: Iterable[ChunkRecord]) -> list[bool]:
        """Like put() for several chunks: one append and one (shared) fsync for the batch.

        Each chunk is proven first; at the first invalid one the chunks before it are stored (durably)
        and its error is raised. A full disk raises StoreFullError and stores none of the batch.
        """
        self.traffic += 1
        valid: list[ChunkRecord] = []
        error: ParamServerError | None = None
        for c in chunks:
            try:
                # the bytes stay a view (of the PUT's buffer, say): validation and the append only read them
                self.validate_incoming(c.id, cast(bytes, c.data), c.codec, c.raw_size, c.crc32c)
            except ParamServerError as exc:
                error = exc
                break
            valid.append(c)
        results = self._store_batch(valid) if valid else []
        if error is not None:
            raise error
        return results

    def _store_batch(self, batch: list[ChunkRecord], *, dedup: bool = True) -> list[bool]:
        """Append the chunks not stored yet (each already proven) and index them once durable: per
        chunk, True when written. ``dedup``: a chunk already here is claimed and checked, not written."""
        results = [False] * len(batch)
        todo: list[int] = []
        seen: set[str] = set()
        # Sent again by a push: claim it *before* trusting the copy here, so that orphan
        # collection cannot delete it between the check and the "already stored" answer.
        here = self.claim(c.id for c in batch) if dedup else [False] * len(batch)
        for i, c in enumerate(batch):
            if c.id in seen:
                continue
            seen.add(c.id)
            if here[i] and self._intact_copy_exists(c.id):
                continue
            todo.append(i)
        if not todo:
            return results
        records: list[Rec] = [(encode_header(c.codec, c.raw_size, len(c.data), c.crc32c, c.id), cast(bytes, c.data),
                               PutRecord(0, c.id, c.codec, c.raw_size, len(c.data), c.crc32c))
                              for c in (batch[i] for i in todo)]
        nbytes = sum(HEADER_SIZE + len(batch[i].data) for i in todo)
        first = batch[todo[0]]
        what = f"chunk {first.id} ({HEADER_SIZE + len(first.data)} bytes)" if len(todo) == 1 else \
            f"a batch of {len(todo)} chunks ({nbytes} bytes, first {first.id})"
        self._check_space(nbytes, what, self.reserve_bytes + self.config.meta_reserve_bytes)
        mine: list[tuple[int, Entry]] = []
        with self._wcond:
            self._check_writable()
            deps_end = (0, 0)
            keep: list[int] = []
            for k, i in enumerate(todo):
                chunk_id = batch[i].id
                if chunk_id in self._index:
                    continue  # stored by another put meanwhile
                p = self._pending.get(chunk_id)
                if p is not None:
                    deps_end = max(deps_end, p.end)  # being stored by another put: answer once it is durable
                    continue
                keep.append(k)
            end = deps_end
            if keep:
                locs = self._write_locked([records[k] for k in keep], what)
                active = self._segs[locs[-1][0]]
                end = max(end, (active.no, active.size))
                with self._lock:
                    for k, (segno, off) in zip(keep, locs):
                        c = batch[todo[k]]
                        e = new_entry(segno, off, len(c.data), c.crc32c, c.codec, c.raw_size)
                        self._pending[c.id] = Pending(e, (segno, off + HEADER_SIZE + len(c.data)))
                        self._segs[segno].pending += HEADER_SIZE + len(c.data)
                        mine.append((todo[k], e))
            epoch = self._epoch
        try:
            self._wait_durable(end, epoch, what)
        except BaseException:
            with self._lock:
                for i, e in mine:
                    self._pending.pop(batch[i].id, None)
                    self._segs[e.seg].pending -= HEADER_SIZE + e.size
            raise
        now = self._clock()
        with self._lock:
            for i, e in mine:
                chunk_id = batch[i].id
                self._index[chunk_id] = e
                self._pending.pop(chunk_id, None)
                seg = self._segs[e.seg]
                seg.pending -= HEADER_SIZE + e.size
                seg.ids.add(chunk_id)
                seg.live += HEADER_SIZE + e.size
                self._live_bytes += HEADER_SIZE + e.size
                self._lost.pop(chunk_id, None)
                self._claimed[chunk_id] = now
                results[i] = True
            if mine:
                self._generation += 1
        if self._full:
            self._full = False
            log.info("chunk store accepts writes again: %s free_bytes=%d", self._where, self.free_bytes())
        return results

    def _intact_copy_exists(self, chunk_id: str) -> bool:
        if chunk_id not in self._index:
            return False
        try:
            self.get(chunk_id)  # id and CRC check; a bad copy is quarantined and replaced
            return True
        except (ChunkCorruptError, ChunkNotFoundError):
            return False
