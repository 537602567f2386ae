"""Content-addressed chunk store on local disk: append-only segment files, with a hot in-memory tier.

Layout: ``DATA_DIR/segments/<16-digit number>.seg`` (append-only segment files, 256 MiB by default),
``<number>.idx`` beside each sealed one (its record list), ``DATA_DIR/quarantine/`` (copies of records
found corrupt). Byte formats: ``paramserver.server.records``. Each chunk record is the format-2
80-byte header (codec, sizes, CRC32C of the stored bytes, the chunk id) followed by the stored
(encoded) bytes exactly as they travel on the wire; tombstones kill one record each.

**Index.** In memory: chunk id -> (segment, offset, stored length, CRC32C, codec, raw size). On open
it is rebuilt from the segments: a sealed segment from its ``.idx`` (each entry checked against the
record header it points at, and the file's size against the index's), the others by a scan of their
record headers with every record's CRC32C checked. A torn tail (a crash in the middle of an append)
is truncated and logged (WARNING naming the file and the records kept); a damaged region in the
middle is skipped and logged, and a chunk record whose bytes fail their CRC is quarantined. Nothing
half-written is ever indexed, so never served.

**Writes.** ``put_many`` proves each chunk (CRC32C, decode with the output capped at ``max_raw_bytes``,
BLAKE3) without any lock, then appends the batch with one ``pwritev`` under the write lock, then
waits for durability with group commit: the first waiter fsyncs the segment up to its current tail
(covering the batches of every thread that appended meanwhile); the others wait and skip when it
covered their records. A put returns (is acknowledged) only once its records are durable (with
``fsync=False``: written). A chunk is indexed, so visible to ``has``/``claim``/``get``, only then. An
append that fails (ENOSPC, EDQUOT: StoreFullError naming the data dir and its free space) truncates
the segment back so no torn record stays; an fsync that fails truncates back to the last durable
offset and fails every batch it covered. Segments roll over at ``segment_bytes``: the full one is
fsynced and sealed (its ``.idx`` written), the new file and the folder are fsynced when created.

**Reads.** ``pread`` of the record's header and bytes: the header must name the requested id and the
stored bytes must match the header's CRC32C. A record that fails is quarantined (its bytes copied to
``DATA_DIR/quarantine/``, a tombstone written, dropped from the index), logged, reported through
``on_corrupt`` and the read raises ChunkCorruptError; until a good copy is stored again the id reads
as lost (DATA_LOSS), also after a restart. Wrong bytes are never returned.

**Deletes and orphan collection.** ``delete``/``delete_if_unclaimed`` drop the chunk from the index and
append a durable tombstone: a deleted chunk never comes back after a restart. ``claim`` and writes
record a last-claim time in memory; after a restart every chunk counts as claimed at open (safe:
an orphan is collected one grace period later at most).

**Compaction** (``paramserver.server.compaction``) rewrites a sealed segment whose live fraction fell
below a threshold: live records are appended to the active segment (checked on the way), the index
entry swapped only if unchanged, and the old file removed once the copies are durable, at a bounded
I/O rate, without blocking reads or writes.

**Migration.** A data dir in the one-file-per-chunk layout (``DATA_DIR/chunks/ab/cd/<id>``, format-1
or -2 headers) is migrated on the first open: each file is verified (CRC32C; the header's id, or for
format 1 the content id), appended, and the old files are removed once the segment is durable; a
file that fails is quarantined. Counts are logged.

Only one store may write a data dir: the first to open it holds ``segments/LOCK``; another
instance (a tool, a test) opens it read only.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import resource
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple, NoReturn, Sequence, cast

import numpy as np

from chunking.config import MAX_CHUNK_SIZE
from chunking.hashing import content_id, crc32c, is_content_id

from paramserver.server import codecs
from paramserver.server.cache import ByteLRU, CacheStats
from paramserver.server.direct_io import DirectAppender, pwrite_all
from paramserver.server.errors import (
    ChunkCorruptError,
    ChunkError,
    ChunkNotFoundError,
    ChunkTransferCorruptError,
    ConfigError,
    InvalidChunkError,
    ParamServerError,
    StoreFullError,
    UnknownCodecError,
)
from paramserver.server.records import (
    FORMAT,
    MAGIC,
    FORMAT_V1,
    HEADER_SIZE,
    HEADER_SIZE_V1,
    SEG_HEADER_SIZE,
    TOMB_SIZE,
    ChunkHeader,
    PutRecord,
    TombRecord,
    decode_header,
    encode_header,
    encode_index,
    encode_segment_header,
    encode_tombstone,
    parse_header,
)
from paramserver.server.segments import (
    SEGMENTS_DIR,
    ChunkLocation,
    SegmentScan,
    index_file,
    list_segments,
    load_index_file,
    resolve,
    scan_segment,
    segment_file,
)
from paramserver.wire.chunk_record import ChunkRecord
from paramserver.wire.limits import MAX_CODEC_LEN

log = logging.getLogger(__name__)

# A format-2 record header as a numpy record (records.py has the layout): a run of small records is
# checked as arrays.
_HEADER_DTYPE = np.dtype([("magic", "S4"), ("format", "u1"), ("codec_len", "u1"), ("codec", f"S{MAX_CODEC_LEN}"),
                          ("raw", "<u8"), ("stored", "<u8"), ("crc", "<u4"), ("id", "V32"), ("head_crc", "<u4")])
_CODECS: dict[bytes, str] = {}

KiB, MiB = 1 << 10, 1 << 20
TMP_PREFIX = ".tmp-"  # temp files of the one-file layout (removed by the migration)
LEGACY_DIR = "chunks"
# The largest raw size a chunk may declare: chunking's largest chunk size (64 MiB). Nothing
# bigger is ever decoded, so a small frame that claims to inflate to gigabytes is refused.
DEFAULT_MAX_RAW_BYTES = MAX_CHUNK_SIZE
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_MIGRATE_BATCH_BYTES = 32 * MiB
_MAX_READ_RUN = 8 * MiB  # get_many reads adjacent records with one pread up to about this many bytes ...
_COALESCE_MAX = 64 * 1024  # ... of chunks up to this size (larger ones are read alone, without a copy),
# skipping over up to this many bytes of other records between two: a reader that spreads a model
# over its replicas asks each for every second or third record, and two preads per small chunk
# cost more than copying the records between them out of the page cache.
_COALESCE_GAP = 32 * 1024


_STORE_KEYS: tuple[tuple[str, type], ...] = (
    ("segment_bytes", int), ("compact_live_fraction", float), ("compact_dead_ratio", float), ("compact_bytes_per_s", int),
    ("compact_interval_s", float), ("meta_reserve_bytes", int), ("verify_index_on_open", bool),
)
CONFIG_KEYS = ("store_direct_writes", *(f"store_{name}" for name, _ in _STORE_KEYS))  # a server config's keys for the store


@dataclass(frozen=True)
class StoreConfig:
    """Options of the segment store (defaults are what a server runs with)."""

    segment_bytes: int = 256 * MiB  # a segment is sealed once the next record would pass this
    compact_live_fraction: float = 0.5  # a sealed segment with less live data than this is rewritten
    # ... and, emptiest first, any segment with dead bytes while the store's dead bytes exceed this
    # fraction of its live bytes (bounds the space overhead, e.g. 0.1: disk use <= 1.1 x live + one segment)
    compact_dead_ratio: float = 0.1
    compact_bytes_per_s: int = 64 * MiB  # compaction I/O budget (bytes read + written)
    compact_interval_s: float = 1.0  # how often the background task runs a compaction step
    # chunk writes leave this much free space for the store's own small records (tombstones of deletes
    # and quarantines, segment indexes, compaction copies), so a full disk can still be cleaned up
    meta_reserve_bytes: int = 1 * MiB
    verify_index_on_open: bool = True  # check each .idx entry against its record header on open
    # True: appends' whole blocks go around the page cache (O_DIRECT, paramserver.server.direct_io),
    # falling back to buffered writes, logged once, where the file system refuses it. None (auto):
    # O_DIRECT only with fsync on. Without fsync a write is acknowledged once written, and an
    # O_DIRECT write waits for the device, the very wait --no-fsync is asked to skip; with fsync on,
    # the bytes must reach the device before the ack anyway, and O_DIRECT spares the page cache.
    direct_writes: bool | None = None

    def validate(self) -> StoreConfig:
        if not 4 * KiB <= self.segment_bytes <= 1 << 40:
            raise ConfigError(f"store segment_bytes must be 4 KiB..1 TiB, got {self.segment_bytes}")
        if not 0.0 < self.compact_live_fraction <= 1.0:
            raise ConfigError(f"store compact_live_fraction must be in (0, 1], got {self.compact_live_fraction}")
        if self.compact_dead_ratio < 0:
            raise ConfigError(f"store compact_dead_ratio must be >= 0, got {self.compact_dead_ratio}")
        if self.compact_bytes_per_s < 1:
            raise ConfigError(f"store compact_bytes_per_s must be >= 1, got {self.compact_bytes_per_s}")
        if not self.compact_interval_s > 0:
            raise ConfigError(f"store compact_interval_s must be > 0, got {self.compact_interval_s}")
        if self.meta_reserve_bytes < 0:
            raise ConfigError(f"store meta_reserve_bytes must be >= 0, got {self.meta_reserve_bytes}")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> StoreConfig:
        """From a server config file's extra keys ``store_segment_bytes``, ``store_compact_live_fraction``,
        ``store_compact_dead_ratio``, ``store_compact_bytes_per_s``, ``store_compact_interval_s``,
        ``store_meta_reserve_bytes``, ``store_verify_index_on_open`` and ``store_direct_writes`` (true,
        false or "auto")."""
        values: dict[str, object] = {}
        direct = extra.get("store_direct_writes")
        if direct is not None:
            if not (isinstance(direct, bool) or direct == "auto"):
                raise ConfigError(f'store_direct_writes must be true, false or "auto", got {direct!r}')
            values["direct_writes"] = None if direct == "auto" else direct
        for name, kind in _STORE_KEYS:
            value = extra.get(f"store_{name}")
            if value is None:
                continue
            if kind is bool:
                if not isinstance(value, bool):
                    raise ConfigError(f"store_{name} must be true or false, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
                raise ConfigError(f"store_{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
            values[name] = kind(value)
        return cls(**values).validate()  # type: ignore[arg-type]


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


class _Entry(NamedTuple):
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


def _entry(seg: int, off: int, size: int, crc: int, codec: str, raw: int) -> _Entry:
    """An index entry the cyclic garbage collector never visits.

    CPython stops tracking a plain tuple of ints and strings, but not a NamedTuple: with one
    entry per chunk, every full collection walked the whole index (0.15 s for half a million
    chunks on an idle core, holding the GIL, longer than a Raft election timeout on a loaded
    one). An entry holds only ints and a str, so it can never be part of a reference cycle;
    reference counting still frees it.
    """
    e = _Entry(seg, off, size, crc, codec, raw)
    _untrack(e)
    return e


class _Segment:
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


_Rec = tuple[bytes, bytes | None, "PutRecord | TombRecord"]  # header, body, the record (offset 0)


class _Pending(NamedTuple):
    entry: _Entry
    end: tuple[int, int]  # (segment, offset) that must be durable for it


def _close_all(segs: dict[int, _Segment], retired: list[_Segment], lock_fd: list[int]) -> None:
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


class ChunkStore:
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
        self.chunks_dir = self.data_dir / LEGACY_DIR  # the one-file layout, migrated on open
        self.quarantine_dir = self.data_dir / "quarantine"
        self.fsync = fsync
        self.hash_algorithms = hash_algorithms
        self.on_corrupt = on_corrupt
        self.max_raw_bytes = max_raw_bytes
        self.reserve_bytes = reserve_bytes
        self.server_id = server_id
        self.cache: ByteLRU[str, StoredChunk] = ByteLRU(cache_bytes)
        self._clock = clock
        self._seg_dir = str(self.segments_dir)
        # _wcond (the write lock) orders appends, segment roll-over, group commit, and every change
        # that writes a record (deletes, quarantines, compaction moves); _lock guards the index and
        # the counters. Lock order: _wcond, then _lock.
        self._wcond = threading.Condition(threading.Lock())
        self._lock = threading.Lock()
        self._index: dict[str, _Entry] = {}
        self._segs: dict[int, _Segment] = {}
        self._retired: list[_Segment] = []  # removed segments whose fd a read still uses
        self._pending: dict[str, _Pending] = {}  # written, not yet durable: not indexed yet
        self._moving: dict[str, tuple[int, int]] = {}  # compaction copies written, not yet swapped in
        self._shadows: dict[str, list[tuple[int, int]]] = {}  # older live copies (see segments.py)
        self._claimed: dict[str, float] = {}
        self._lost: dict[str, str] = {}
        self._active: _Segment | None = None
        self._next_no = 1
        self._durable = (0, 0)  # (segment, offset): everything before is durable
        self._syncing = False
        self._epoch = 0  # bumped when an fsync fails: batches of an older epoch were truncated
        self._sync_error: BaseException | None = None
        self._live_bytes = 0
        self._quarantined = 0
        self._compacted = 0
        # Calls of get, get_many and put_many (the reads and writes of clients, peers and repair; not
        # the scrubber's): it only ever grows, and the scrubber slows down while it does.
        self.traffic = 0
        self._generation = 0  # bumped whenever the set of stored chunks changes
        self._losses = 0  # bumped whenever chunks leave the store (deleted, quarantined)
        self._full = False  # the last write found the disk full (logged once per episode)
        self._closed = False
        self._lock_fd = [-1]
        direct = self.config.direct_writes
        self._appender = DirectAppender(fsync if direct is None else direct, self._where)
        self._finalizer = weakref.finalize(self, _close_all, self._segs, self._retired, self._lock_fd)
        self._opened_at = clock()
        self._open()

    @property
    def direct_writes(self) -> bool:
        """Whether appends go around the page cache (O_DIRECT), as configured or by fsync (auto)."""
        return self._appender.enabled

    # ------------------------------------------------------------- open

    @property
    def _where(self) -> str:
        return f"server={self.server_id} data_dir={self.data_dir}" if self.server_id else f"data_dir={self.data_dir}"

    @property
    def read_only(self) -> bool:
        """True when another store holds this data dir's lock: this one reads, never writes."""
        return self._lock_fd[0] < 0

    def _open(self) -> None:
        for folder in (self.data_dir, self.quarantine_dir, self.segments_dir):
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                if self.fsync:
                    _fsync_dir_quietly(str(folder.parent))
        _raise_fd_limit()
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
                    _unlink_quietly(path)
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
            seg = _Segment(segno, path, fd, scan.end if writable else scan.file_size)
            seg.sealed = scan.from_index
            seg.tombs = list(scan.tombs)
            if seg.sealed:
                seg.idx_size = _size_of(index_file(self._seg_dir, segno))
            else:
                seg.records = sorted([*scan.puts, *scan.tombs], key=lambda r: r.off)
            self._segs[segno] = seg
            scans[segno] = scan
        view = resolve(scans)
        for cid, (segno, rec) in view.index.items():
            e = _entry(segno, rec.off, rec.stored_size, rec.crc, rec.codec, rec.raw_size)
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
                _unlink_quietly(full)
            elif name.endswith(".idx") and name[:-4].isdigit() and int(name[:-4]) not in present:
                _unlink_quietly(full)  # the index of a segment compaction removed

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

    # ------------------------------------------------------------- ids

    @staticmethod
    def check_id(chunk_id: str) -> None:
        if not is_content_id(chunk_id):
            shown = chunk_id[:80] if isinstance(chunk_id, str) else type(chunk_id).__name__
            raise InvalidChunkError(str(chunk_id)[:80], f"chunk id {shown!r} is not a content id (64 lowercase hex digits)")

    # ------------------------------------------------------------- reads

    def has(self, chunk_id: str) -> bool:
        return chunk_id in self.cache or chunk_id in self._index

    def has_many(self, chunk_ids: Sequence[str]) -> list[bool]:
        """``has`` of each id, one lock of the cache for all (a HasChunks call of thousands)."""
        index = self._index
        return [c or cid in index for cid, c in zip(chunk_ids, self.cache.contains_many(chunk_ids))]

    @property
    def generation(self) -> int:
        """Changes whenever a chunk is stored, deleted or quarantined (not on reads, claims or compaction)."""
        return self._generation

    @property
    def loss_generation(self) -> int:
        """Changes whenever a chunk leaves the store (deleted or quarantined), not when one arrives."""
        return self._losses

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
        pinned: list[tuple[int, _Entry, _Segment]] = []
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
        admit: list[tuple[str, StoredChunk, _Entry]] = []
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
    def _take_run(chunk_ids: Sequence[str], run: list[tuple[int, _Entry, _Segment]], base: int, buf: bytes,
                  out: list[StoredChunk | ChunkError | None], alone: list[int],
                  admit: list[tuple[str, StoredChunk, _Entry]]) -> None:
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

    def _missing(self, chunk_id: str) -> NoReturn:
        lost = self._lost.get(chunk_id)
        if lost is not None:
            raise ChunkCorruptError(
                chunk_id,
                f"chunk {chunk_id}: this server's copy was corrupt ({lost}) and is awaiting repair; read it from another replica",
            )
        raise ChunkNotFoundError(chunk_id, f"chunk {chunk_id} is not stored on this server; read it from another replica")

    def _pin(self, chunk_id: str) -> tuple[_Entry, _Segment] | None:
        with self._lock:
            e = self._index.get(chunk_id)
            if e is None:
                return None
            seg = self._segs[e.seg]
            seg.refs += 1
            return e, seg

    def _unpin(self, seg: _Segment) -> None:
        with self._lock:
            seg.refs -= 1
            self._close_retired(seg)

    def _close_retired(self, seg: _Segment) -> None:
        """Close a segment compaction retired once nothing reads it (called with the lock held)."""
        if seg.retired and seg.refs == 0 and seg.fd >= 0:
            os.close(seg.fd)
            seg.fd = -1
            if seg in self._retired:
                self._retired.remove(seg)

    def _read_record(self, chunk_id: str, e: _Entry, seg: _Segment) -> tuple[bytes, bytes]:
        try:
            head = os.pread(seg.fd, HEADER_SIZE, e.off)
            data = os.pread(seg.fd, e.size, e.off + HEADER_SIZE)
        finally:
            self._unpin(seg)
        return head, data

    @staticmethod
    def _check_record(chunk_id: str, e: _Entry, head: bytes, data: bytes) -> tuple[ChunkHeader | None, str]:
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

    def _read(self, chunk_id: str) -> tuple[StoredChunk, _Entry]:
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

    # ------------------------------------------------------------- ingest checks

    def validate_incoming(self, chunk_id: str, data: bytes, codec: str, raw_size: int, crc: int) -> None:
        """Prove that ``data`` is chunk ``chunk_id``; raise InvalidChunkError naming why not."""
        self.check_id(chunk_id)
        if not codec or len(codec) > MAX_CODEC_LEN or not codec.isascii():
            raise InvalidChunkError(chunk_id, f"chunk {chunk_id}: codec {codec!r} is not a valid codec name")
        if raw_size < 0:
            raise InvalidChunkError(chunk_id, f"chunk {chunk_id}: raw_size {raw_size} is out of range")
        if raw_size > self.max_raw_bytes:
            raise InvalidChunkError(
                chunk_id,
                f"chunk {chunk_id}: raw_size {raw_size} is over this server's limit of {self.max_raw_bytes} bytes "
                f"({_human(self.max_raw_bytes)}, the largest chunk size); refused without decoding it",
            )
        if crc32c(data) != crc:
            raise ChunkTransferCorruptError(
                chunk_id,
                f"chunk {chunk_id}: CRC32C of the {len(data)} received bytes does not match the declared {crc:#010x}; "
                "it was damaged in transit or truncated, send it again",
            )
        self._prove_content(chunk_id, data, codec, raw_size)

    def _prove_content(self, chunk_id: str, data: bytes, codec: str, raw_size: int) -> None:
        try:
            raw = codecs.decode(codec, data, raw_size, limit=self.max_raw_bytes)
        except UnknownCodecError as exc:
            raise UnknownCodecError(chunk_id, f"chunk {chunk_id}: {exc}") from None
        except codecs.DecodeError as exc:
            raise InvalidChunkError(chunk_id, f"chunk {chunk_id}: {exc}") from None
        for algorithm in self.hash_algorithms:
            if content_id(raw, algorithm) == chunk_id:
                return
        raise InvalidChunkError(
            chunk_id,
            f"chunk {chunk_id}: its {raw_size} decoded bytes hash to {content_id(raw, self.hash_algorithms[0])}, not to its id; "
            "the sender has the wrong bytes for this id",
        )

    # ------------------------------------------------------------- writes

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
        valid: list[tuple[str, bytes, str, int, int]] = []
        error: ParamServerError | None = None
        for c in chunks:
            # the bytes stay a view (of the PUT's buffer, say): validation and the append only read them
            chunk = (c.id, cast(bytes, c.data), c.codec, c.raw_size, c.crc32c)
            try:
                self.validate_incoming(*chunk)
            except ParamServerError as exc:
                error = exc
                break
            valid.append(chunk)
        results = self._store_batch(valid) if valid else []
        if error is not None:
            raise error
        return results

    def _store_batch(self, batch: list[tuple[str, bytes, str, int, int]], *, dedup: bool = True) -> list[bool]:
        results = [False] * len(batch)
        todo: list[int] = []
        seen: set[str] = set()
        # Sent again by a push: claim it *before* trusting the copy here, so that orphan
        # collection cannot delete it between the check and the "already stored" answer.
        here = self.claim(c[0] for c in batch) if dedup else [False] * len(batch)
        for i, (chunk_id, *_rest) in enumerate(batch):
            if chunk_id in seen:
                continue
            seen.add(chunk_id)
            if here[i] and self._intact_copy_exists(chunk_id):
                continue
            todo.append(i)
        if not todo:
            return results
        records: list[_Rec] = [(encode_header(codec, raw_size, len(data), crc, chunk_id), data,
                                PutRecord(0, chunk_id, codec, raw_size, len(data), crc))
                               for chunk_id, data, codec, raw_size, crc in (batch[i] for i in todo)]
        nbytes = sum(HEADER_SIZE + len(batch[i][1]) for i in todo)
        what = f"chunk {batch[todo[0]][0]} ({HEADER_SIZE + len(batch[todo[0]][1])} bytes)" if len(todo) == 1 else \
            f"a batch of {len(todo)} chunks ({nbytes} bytes, first {batch[todo[0]][0]})"
        self._check_space(nbytes, what, self.reserve_bytes + self.config.meta_reserve_bytes)
        mine: list[tuple[int, _Entry]] = []
        with self._wcond:
            self._check_writable()
            deps_end = (0, 0)
            keep: list[int] = []
            for k, i in enumerate(todo):
                chunk_id = batch[i][0]
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
                        chunk_id, data, codec, raw_size, crc = batch[todo[k]]
                        e = _entry(segno, off, len(data), crc, codec, raw_size)
                        self._pending[chunk_id] = _Pending(e, (segno, off + HEADER_SIZE + len(data)))
                        self._segs[segno].pending += HEADER_SIZE + len(data)
                        mine.append((todo[k], e))
            epoch = self._epoch
        try:
            self._wait_durable(end, epoch, what)
        except BaseException:
            with self._lock:
                for i, e in mine:
                    self._pending.pop(batch[i][0], None)
                    self._segs[e.seg].pending -= HEADER_SIZE + e.size
            raise
        now = self._clock()
        with self._lock:
            for i, e in mine:
                chunk_id = batch[i][0]
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

    def _check_writable(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, f"chunk store {self.data_dir} is closed")
        if self.read_only:
            raise OSError(errno.EROFS, f"chunk store {self.data_dir} is open read only: another store holds {self._seg_dir}/LOCK")

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

    def _write_locked(self, records: list[_Rec], what: str) -> list[tuple[int, int]]:
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

    def _active_for(self, n: int, what: str) -> _Segment:
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

    def _create_segment(self, what: str) -> _Segment:
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
                    _fsync_dir(self._seg_dir)
            except OSError as exc:
                os.close(fd)
                _unlink_quietly(path)
                if exc.errno in _FULL_ERRNOS:
                    raise self._full_error(what, os.strerror(exc.errno or 0)) from exc
                raise
            seg = _Segment(no, path, fd, SEG_HEADER_SIZE)
            seg.records = []
            with self._lock:
                self._segs[no] = seg
            self._durable = max(self._durable, (no, SEG_HEADER_SIZE))
            return seg

    def _sync_active_locked(self, seg: _Segment, what: str = "the records just appended") -> None:
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

    def _seal(self, seg: _Segment) -> None:
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
                _fsync_dir(self._seg_dir)
            seg.idx_size = len(blob)
        except OSError as exc:
            _unlink_quietly(tmp)
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

    def _sync_failed(self, seg: _Segment, error: OSError) -> None:
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
            f"chunk store {self.data_dir} is full ({why}): {free} bytes free ({_human(free)}); "
            f"{what} was not stored. Free space there or add a server; reads go on",
            free,
        )

    # ------------------------------------------------------------- deletes

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

    def _unindex_locked(self, chunk_id: str, e: _Entry) -> list[tuple[int, int]]:
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

    # ------------------------------------------------------------- corruption

    def _corrupt(self, chunk_id: str, reason: str, entry: _Entry) -> NoReturn:
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

    def _copy_to_quarantine(self, chunk_id: str, seg: _Segment, off: int, length: int) -> str:
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
            _unlink_quietly(target)
            log.warning("chunk store: could not copy corrupt chunk %s to the quarantine (%s) %s", chunk_id, exc, self._where)
            return ""

    # ------------------------------------------------------------- compaction (see compaction.py)

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
        batch: list[tuple[str, _Entry, bytes, bytes]] = []
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
        movers: list[tuple[str, _Entry, tuple[int, int]]] = []
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
                new = _entry(loc[0], loc[1], e.size, e.crc, e.codec, e.raw)
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
            _unlink_quietly(seg.path)
            _unlink_quietly(index_file(self._seg_dir, segno))
            if self.fsync:
                # durable before any tombstone aimed at it may be dropped by a later compaction
                _fsync_dir(self._seg_dir)
        return True

    # ------------------------------------------------------------- migration

    def _migrate(self) -> None:
        """Move a one-file-per-chunk data dir (DATA_DIR/chunks/ab/cd/<id>) into segments."""
        root = str(self.chunks_dir)
        started = time.monotonic()
        files: list[str] = []
        for dirpath, _dirs, entries in os.walk(root):
            for name in entries:
                full = os.path.join(dirpath, name)
                if name.startswith(TMP_PREFIX):
                    _unlink_quietly(full)  # an interrupted write of the old store
                else:
                    files.append(full)
        files.sort()
        migrated = present = bad = unproven = 0
        nbytes = 0
        batch: list[tuple[str, bytes, str, int, int]] = []
        names: set[str] = set()
        done: list[str] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch_bytes
            if batch:
                self._store_batch(batch, dedup=False)  # durable (group commit) before its old files go
            for full in done:
                _unlink_quietly(full)
            batch.clear()
            names.clear()
            done.clear()
            batch_bytes = 0

        for full in files:
            name = os.path.basename(full)
            try:
                with open(full, "rb") as f:
                    blob = f.read()
            except OSError as exc:
                log.warning("chunk store migration: cannot read %s (%s); left in place", full, exc)
                continue
            why, chunk = self._check_legacy(name, blob)
            if chunk is None:
                bad += 1
                self._quarantine_legacy(full, name, why)
                continue
            if why:
                unproven += 1
            done.append(full)
            if name in self._index or name in names:
                present += 1
                continue
            batch.append(chunk)
            names.add(name)
            batch_bytes += len(chunk[1])
            nbytes += len(chunk[1])
            migrated += 1
            if batch_bytes >= _MIGRATE_BATCH_BYTES:
                flush()
        flush()
        for dirpath, _dirs, _names in sorted(os.walk(root), key=lambda w: -len(w[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
        if self.fsync:
            _fsync_dir_quietly(str(self.data_dir))
        left = os.path.isdir(root)
        log.info("chunk store migrated the one-file-per-chunk layout to segments: %s migrated=%d bytes=%d already_present=%d "
                 "quarantined=%d unproven_codec=%d seconds=%.2f%s", self._where, migrated, nbytes, present, bad, unproven,
                 time.monotonic() - started, f"; {root} still holds files it could not read" if left else "")

    def _check_legacy(self, name: str, blob: bytes) -> tuple[str, tuple[str, bytes, str, int, int] | None]:
        """(why it is unproven or bad, the chunk) of one old chunk file; the chunk is None when bad."""
        if not is_content_id(name):
            return f"file name {name[:80]!r} is not a content id", None
        try:
            h = parse_header(blob)
        except ValueError as exc:
            return str(exc), None
        if len(blob) != h.size + h.stored_size:
            return f"file holds {len(blob) - h.size} stored bytes, header says {h.stored_size}", None
        data = blob[h.size:]
        if crc32c(data) != h.crc32c:
            return "CRC32C mismatch", None
        if h.chunk_id is not None and h.chunk_id != name:
            return f"the file holds chunk {h.chunk_id}, not {name} (a swapped or misplaced file)", None
        if h.raw_size > self.max_raw_bytes:
            return f"raw_size {h.raw_size} is over this server's limit of {self.max_raw_bytes} bytes", None
        chunk = (name, data, h.codec, h.raw_size, h.crc32c)
        if h.format == FORMAT_V1:  # nothing in the file says which chunk it holds: prove it by its content
            try:
                self._prove_content(name, data, h.codec, h.raw_size)
            except UnknownCodecError:
                return "codec unknown to this server: migrated unproven", chunk
            except InvalidChunkError as exc:
                return f"format-1 file does not hold chunk {name}: {exc}", None
        return "", chunk

    def _quarantine_legacy(self, full: str, name: str, reason: str) -> None:
        target = f"{self.quarantine_dir}/{name[:64]}.{time.time_ns()}"
        try:
            os.replace(full, target)
        except OSError as exc:
            log.warning("chunk store migration: cannot move corrupt %s to the quarantine (%s)", full, exc)
            target = "-"
        self._quarantined += 1
        log.warning("chunk quarantined: id=%s reason=%r %s file=%s", name[:64], reason, self._where, target)
        if is_content_id(name) and name not in self._index:
            self._lost[name] = reason
            if self.on_corrupt is not None:
                self.on_corrupt(name, reason)

    # ------------------------------------------------------------- inventory

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


def _size_of(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _raise_fd_limit() -> None:
    """Each segment keeps one file descriptor open: raise the soft limit to the hard one (best effort)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16), hard))
    except (ValueError, OSError):
        pass


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir_quietly(path: str) -> None:
    try:
        _fsync_dir(path)
    except OSError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = [
    "CONFIG_KEYS",
    "ChunkStore", "StoreConfig", "StoredChunk", "StoreStats", "ChunkHeader", "ChunkLocation", "HEADER_SIZE", "HEADER_SIZE_V1",
    "FORMAT", "FORMAT_V1", "DEFAULT_MAX_RAW_BYTES", "TMP_PREFIX", "encode_header", "decode_header", "parse_header",
]
