"""Quarantine of a record found corrupt, and the answer for a chunk that is missing or lost.

A record that fails a check is copied to ``DATA_DIR/quarantine/``, killed with a tombstone and
dropped from the index, logged and reported through ``on_corrupt``; until a good copy is stored
again the id reads as lost (DATA_LOSS), also after a restart.
"""
from __future__ import annotations

import os
import time
from typing import NoReturn

from paramserver.server.direct_io import pwrite_all
from paramserver.server.errors import ChunkCorruptError, ChunkNotFoundError
from paramserver.server.records import HEADER_SIZE
from paramserver.server.store.files import unlink_quietly
from paramserver.server.store.state import Entry, Segment, log
from paramserver.server.store.tombstones import Tombstones


class Quarantine(Tombstones):
    """Takes a corrupt record out of service; says why a chunk that is not here is missing."""

    def _missing(self, chunk_id: str) -> NoReturn:
        lost = self._lost.get(chunk_id)
        if lost is not None:
            raise ChunkCorruptError(
                chunk_id,
                f"chunk {chunk_id}: this server's copy was corrupt ({lost}) and is awaiting repair; read it from another replica",
            )
        raise ChunkNotFoundError(chunk_id, f"chunk {chunk_id} is not stored on this server; read it from another replica")

    def _corrupt(self, chunk_id: str, reason: str, entry: Entry) -> NoReturn:
        """Quarantine the record, log it and raise; never returns."""
        self.cache.discard(chunk_id)
        removed = False
        target = ""
        if self.read_only:
            with self._lock:
                if self._index.get(chunk_id) is entry:
                    del self._index[chunk_id]
                    removed = True
                self._lost[chunk_id] = reason
        else:
            with self._wcond:
                kills: list[tuple[int, int, str]] = []
                with self._lock:
                    if self._index.get(chunk_id) is entry:
                        kills = [(s, o, chunk_id) for s, o in self._unindex_locked(chunk_id, entry)]
                        self._quarantined += 1
                        self._generation += 1
                        self._losses += 1
                        removed = True
                    self._lost[chunk_id] = reason
                if removed:
                    seg = self._segs.get(entry.seg)
                    if seg is not None:
                        target = self._copy_to_quarantine(chunk_id, seg, entry.off, HEADER_SIZE + entry.size)
                    try:
                        end, epoch = self._append_tombstones_locked(kills)
                    except OSError as exc:
                        end, epoch = (0, 0), self._epoch
                        log.warning("chunk store: no tombstone for quarantined chunk %s (%s); it is found corrupt again "
                                    "after a restart %s", chunk_id, exc, self._where)
            if removed:
                try:
                    self._wait_durable(end, epoch)
                except OSError as exc:
                    log.warning("chunk store: tombstone for quarantined chunk %s not durable (%s) %s", chunk_id, exc, self._where)
        if removed:
            log.warning("chunk quarantined: id=%s reason=%r %s file=%s", chunk_id, reason, self._where, target or "-")
        self.cache.discard(chunk_id)
        if self.on_corrupt is not None:
            self.on_corrupt(chunk_id, reason)
        raise ChunkCorruptError(
            chunk_id,
            f"chunk {chunk_id}: this server's copy is corrupt ({reason}); it was quarantined and queued for repair, "
            "read it from another replica",
        )

    def _copy_to_quarantine(self, chunk_id: str, seg: Segment, off: int, length: int) -> str:
        """Copy a record's bytes to DATA_DIR/quarantine/<id>.<ns> (best effort); the file, or ""."""
        target = f"{self.quarantine_dir}/{chunk_id}.{time.time_ns()}"
        try:
            blob = os.pread(seg.fd, length, off)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                pwrite_all(fd, [blob], 0)
            finally:
                os.close(fd)
            return target
        except OSError as exc:
            unlink_quietly(target)
            log.warning("chunk store: could not copy corrupt chunk %s to the quarantine (%s) %s", chunk_id, exc, self._where)
            return ""
