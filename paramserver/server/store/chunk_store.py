"""The ``ChunkStore`` facade: one object over the store's parts (see the package's docstring)."""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

from paramserver.server.cache import ByteLRU
from paramserver.server.direct_io import DirectAppender
from paramserver.server.segments import SEGMENTS_DIR
from paramserver.server.store.compaction import CompactionSteps
from paramserver.server.store.config import DEFAULT_MAX_RAW_BYTES, StoreConfig
from paramserver.server.store.migration import LEGACY_DIR
from paramserver.server.store.recovery import Recovery
from paramserver.server.store.state import CorruptListener, StoreStats, close_all


class ChunkStore(Recovery, CompactionSteps):
    """A content-addressed chunk store on local disk. Its jobs live in the classes it combines:
    ``Recovery`` (open, index rebuild) over ``Migration`` over ``Writes`` (put_many) over ``Reads``
    over ``Quarantine`` over ``Tombstones`` (claims, deletes) over ``SegmentLog`` (appends, group
    commit), and ``CompactionSteps``; each builds only on the ones below it."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        cache_bytes: int = 256 << 20,
        fsync: bool = True,
        hash_algorithms: tuple[str, ...] = ("blake3", "sha256"),
        on_corrupt: CorruptListener | None = None,
        max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES,
        reserve_bytes: int = 0,
        server_id: str = "",
        config: StoreConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``max_raw_bytes``: the largest raw size a chunk may declare (default 64 MiB, chunking's
        largest chunk); larger ones are refused on ingest and nothing is decoded beyond it.
        ``reserve_bytes``: refuse a write (StoreFullError) that would leave less free space than
        this on the data dir's file system, e.g. to keep room for the Raft journal beside it.
        ``server_id``: named in log lines (the service names the server in error messages).
        ``config``: segment size, compaction and reserve options (StoreConfig). ``clock``: the time
        claims and writes are stamped with (what ``delete_if_unclaimed`` compares with)."""
        if max_raw_bytes < 1:
            raise ValueError(f"max_raw_bytes must be >= 1, got {max_raw_bytes}")
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        self.config = (config or StoreConfig()).validate()
        self.data_dir = Path(data_dir)
        self.segments_dir = self.data_dir / SEGMENTS_DIR
        self.chunks_dir = self.data_dir / LEGACY_DIR
        self.quarantine_dir = self.data_dir / "quarantine"
        self.fsync = fsync
        self.hash_algorithms = hash_algorithms
        self.on_corrupt = on_corrupt
        self.max_raw_bytes = max_raw_bytes
        self.reserve_bytes = reserve_bytes
        self.server_id = server_id
        self.cache = ByteLRU(cache_bytes)
        self._clock = clock
        self._seg_dir = str(self.segments_dir)
        self._wcond = threading.Condition(threading.Lock())  # lock order: _wcond, then _lock (state.py)
        self._lock = threading.Lock()
        self._index, self._segs, self._retired = {}, {}, []
        self._pending, self._moving, self._shadows = {}, {}, {}
        self._claimed, self._lost = {}, {}
        self._active = None
        self._next_no = 1
        self._durable = (0, 0)
        self._syncing = False
        self._epoch = 0
        self._sync_error = None
        self._live_bytes = self._quarantined = self._compacted = 0
        self.traffic = self._generation = self._losses = 0
        self._full = self._closed = False
        self._lock_fd = [-1]
        direct = self.config.direct_writes
        self._appender = DirectAppender(fsync if direct is None else direct, self._where)
        self._finalizer = weakref.finalize(self, close_all, self._segs, self._retired, self._lock_fd)
        self._opened_at = clock()
        self._open()

    @property
    def generation(self) -> int:
        """Changes whenever a chunk is stored, deleted or quarantined (not on reads, claims or compaction)."""
        return self._generation

    @property
    def loss_generation(self) -> int:
        """Changes whenever a chunk leaves the store (deleted or quarantined), not when one arrives."""
        return self._losses

    def iter_ids(self) -> Iterator[str]:
        """Every stored chunk id, in a stable (sorted) order: a snapshot taken on the first next()."""
        with self._lock:
            ids = sorted(self._index)
        yield from ids

    def stats(self) -> StoreStats:
        with self._lock:
            disk = sum(s.size + s.idx_size for s in self._segs.values())
            return StoreStats(len(self._index), disk, self._quarantined, self.cache.stats(), self._live_bytes, len(self._segs),
                              self._compacted)

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        """Close the store's files and release the data dir's lock (the active segment stays as it is:
        the next open goes on appending to it). Later writes raise."""
        with self._wcond:
            while self._syncing:
                self._wcond.wait()
            if self._closed:
                return
            self._closed = True
            self._active = None
            self._appender.close()
            with self._lock:
                self._index.clear()
                for seg in list(self._segs.values()):
                    seg.retired = True
                    if seg.refs:
                        self._retired.append(seg)
                    elif seg.fd >= 0:
                        os.close(seg.fd)
                        seg.fd = -1
                self._segs.clear()
                if self._lock_fd[0] >= 0:
                    os.close(self._lock_fd[0])
                    self._lock_fd[0] = -1
        self.cache = ByteLRU(self.cache.capacity_bytes)
