"""What every part of the chunk store shares: index entries, open segments, the locks.

``StoreState`` declares the attributes the parts of the store (the classes of this package that
``ChunkStore`` combines) read and write, and the few helpers they all use; the facade
(``chunk_store.ChunkStore``) sets them. Lock order: ``_wcond`` (the write lock: appends, segment
roll-over, group commit, and every change that writes a record: deletes, quarantines, compaction
moves), then ``_lock`` (the index and the counters).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from chunking.hashing import is_content_id

from paramserver.server.cache import ByteLRU, CacheStats
from paramserver.server.direct_io import DirectAppender
from paramserver.server.errors import InvalidChunkError
from paramserver.server.records import PutRecord, TombRecord
from paramserver.server.store.config import StoreConfig

# One logger for the whole store, under the name it had before the store became a package.
log = logging.getLogger("paramserver.server.store")


class StoredChunk(NamedTuple):
    """A chunk as stored, checked. A named tuple: a bulk read of 4 KiB chunks makes one per chunk."""

    id: str
    data: bytes  # stored (encoded) bytes
    codec: str
    raw_size: int
    crc32c: int

    @property
    def stored_size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class StoreStats:
    chunk_count: int
    bytes_on_disk: int  # what the store's files take: segments and their indexes
    quarantined: int
    cache: CacheStats
    live_bytes: int = 0  # the chunk records the index points at (headers + stored bytes)
    segments: int = 0
    compacted_segments: int = 0  # segments rewritten and removed since open


CorruptListener = Callable[[str, str], None]  # (chunk_id, reason)


class Entry(NamedTuple):
    """Where a chunk's record lies and what its header declares (the in-memory index's value)."""

    seg: int
    off: int  # of the record's header
    size: int  # stored bytes
    crc: int
    codec: str
    raw: int


def _untracker() -> Callable[[object], None]:
    try:
        fn = ctypes.pythonapi.PyObject_GC_UnTrack
    except AttributeError:  # not CPython: entries stay tracked, which costs time, never correctness
        return lambda _obj: None
    fn.argtypes, fn.restype = [ctypes.py_object], None
    return fn


_untrack = _untracker()


def new_entry(seg: int, off: int, size: int, crc: int, codec: str, raw: int) -> Entry:
    """An index entry the cyclic garbage collector never visits.

    CPython stops tracking a plain tuple of ints and strings, but not a NamedTuple: with one
    entry per chunk, every full collection walked the whole index (0.15 s for half a million
    chunks on an idle core, holding the GIL, longer than a Raft election timeout on a loaded
    one). An entry holds only ints and a str, so it can never be part of a reference cycle;
    reference counting still frees it.
    """
    e = Entry(seg, off, size, crc, codec, raw)
    _untrack(e)
    return e


class Segment:
    """One open segment file and its bookkeeping (changed under the store's locks)."""

    __slots__ = ("no", "path", "fd", "size", "live", "pending", "ids", "tombs", "records", "sealed", "refs", "retired",
                 "idx_size")

    def __init__(self, no: int, path: str, fd: int, size: int) -> None:
        self.no, self.path, self.fd, self.size = no, path, fd, size
        self.live = 0  # bytes of the chunk records the index points at
        self.pending = 0  # bytes of records written here, not yet indexed (puts, compaction copies): keep it
        self.ids: set[str] = set()  # chunks whose indexed copy is here
        self.tombs: list[TombRecord] = []
        self.records: list[PutRecord | TombRecord] | None = None  # every record, while unsealed (for its .idx)
        self.sealed = False
        self.refs = 0  # reads in progress (the fd stays open until they end)
        self.retired = False
        self.idx_size = 0


Rec = tuple[bytes, bytes | None, "PutRecord | TombRecord"]  # header, body, the record (offset 0)


class Pending(NamedTuple):
    entry: Entry
    end: tuple[int, int]  # (segment, offset) that must be durable for it


def close_all(segs: dict[int, Segment], retired: list[Segment], lock_fd: list[int]) -> None:
    """Close every file of a store that was never closed (its finalizer: it holds no reference to the store)."""
    for seg in [*segs.values(), *retired]:
        if seg.fd >= 0:
            try:
                os.close(seg.fd)
            except OSError:
                pass
            seg.fd = -1
    segs.clear()
    retired.clear()
    if lock_fd and lock_fd[0] >= 0:
        try:
            os.close(lock_fd[0])
        except OSError:
            pass
        lock_fd[0] = -1


class StoreState:
    """The store's shared state (set by ``ChunkStore.__init__``) and the helpers every part uses."""

    config: StoreConfig
    data_dir: Path
    segments_dir: Path
    chunks_dir: Path  # the one-file-per-chunk layout, migrated on open
    quarantine_dir: Path
    fsync: bool
    hash_algorithms: tuple[str, ...]
    on_corrupt: CorruptListener | None
    max_raw_bytes: int
    reserve_bytes: int
    server_id: str
    cache: ByteLRU[str, StoredChunk]
    # Calls of get, get_many and put_many (the reads and writes of clients, peers and repair; not
    # the scrubber's): it only ever grows, and the scrubber slows down while it does.
    traffic: int
    _clock: Callable[[], float]  # what claims and writes are stamped with
    _opened_at: float
    _seg_dir: str
    _wcond: threading.Condition
    _lock: threading.Lock
    _index: dict[str, Entry]
    _segs: dict[int, Segment]
    _retired: list[Segment]  # removed segments whose fd a read still uses
    _pending: dict[str, Pending]  # written, not yet durable: not indexed yet
    _moving: dict[str, tuple[int, int]]  # compaction copies written, not yet swapped in
    _shadows: dict[str, list[tuple[int, int]]]  # older live copies (see paramserver.server.segments)
    _claimed: dict[str, float]
    _lost: dict[str, str]  # chunk id -> why its copy was quarantined (reads as DATA_LOSS)
    _active: Segment | None
    _next_no: int
    _durable: tuple[int, int]  # (segment, offset): everything before is durable
    _syncing: bool  # a group commit's fsync is running
    _epoch: int  # bumped when an fsync fails: batches of an older epoch were truncated
    _sync_error: BaseException | None
    _live_bytes: int
    _quarantined: int
    _compacted: int
    _generation: int  # bumped whenever the set of stored chunks changes
    _losses: int  # bumped whenever chunks leave the store (deleted, quarantined)
    _full: bool  # the last write found the disk full (logged once per episode)
    _closed: bool
    _lock_fd: list[int]  # segments/LOCK's fd, -1 when another store holds it
    _appender: DirectAppender

    @property
    def direct_writes(self) -> bool:
        """Whether appends go around the page cache (O_DIRECT), as configured or by fsync (auto)."""
        return self._appender.enabled

    @property
    def _where(self) -> str:
        return f"server={self.server_id} data_dir={self.data_dir}" if self.server_id else f"data_dir={self.data_dir}"

    @property
    def read_only(self) -> bool:
        """True when another store holds this data dir's lock: this one reads, never writes."""
        return self._lock_fd[0] < 0

    @staticmethod
    def check_id(chunk_id: str) -> None:
        if not is_content_id(chunk_id):
            shown = chunk_id[:80] if isinstance(chunk_id, str) else type(chunk_id).__name__
            raise InvalidChunkError(str(chunk_id)[:80], f"chunk id {shown!r} is not a content id (64 lowercase hex digits)")

    def _pin(self, chunk_id: str) -> tuple[Entry, Segment] | None:
        with self._lock:
            e = self._index.get(chunk_id)
            if e is None:
                return None
            seg = self._segs[e.seg]
            seg.refs += 1
            return e, seg

    def _unpin(self, seg: Segment) -> None:
        with self._lock:
            seg.refs -= 1
            self._close_retired(seg)

    def _close_retired(self, seg: Segment) -> None:
        """Close a segment compaction retired once nothing reads it (called with the lock held)."""
        if seg.retired and seg.refs == 0 and seg.fd >= 0:
            os.close(seg.fd)
            seg.fd = -1
            if seg in self._retired:
                self._retired.remove(seg)

    def _check_writable(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, f"chunk store {self.data_dir} is closed")
        if self.read_only:
            raise OSError(errno.EROFS, f"chunk store {self.data_dir} is open read only: another store holds {self._seg_dir}/LOCK")
