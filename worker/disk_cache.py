"""Disk tier: content-addressed chunk files under a byte budget that survive a worker restart.

Layout: ``ROOT/ab/<content id>``, each file a 16-byte header (magic, CRC32C of the payload XOR
CRC32C of the file's own content id, payload length) followed by the raw chunk bytes: the key in
the CRC binds a file to its name, so a file moved or copied under another chunk's name is a miss,
not that chunk. Files of the first format (``PDC1``, CRC of the payload alone) are verified by
their content id instead. Writes go to ``ROOT/tmp`` and are renamed into
place, so a crash leaves either the whole file or none. Every read is verified (CRC32C, or the
BLAKE3 content id when ``verify="content_id"``); a bad file is deleted, counted as ``corrupt``
and reported as a miss, so the caller refetches from the cluster. Eviction is LRU by access;
access order survives restarts through the files' mtimes.
"""
from __future__ import annotations

import os
import struct
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from chunking.hashing import content_id, crc32c, is_content_id
from worker.errors import CacheError
from worker.lru_k import CacheCounters

_MAGIC = b"PDC2"
_UNBOUND_MAGIC = b"PDC1"  # written before the key was in the CRC
_HEADER = struct.Struct("<4sIQ")  # magic, crc32c(payload), payload length
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True)
class DiskCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    rejected: int = 0
    corrupt: int = 0
    write_errors: int = 0
    bytes: int = 0
    entries: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class DiskCache:
    """Thread-safe content-addressed file cache. Keys must be content ids (64 lowercase hex)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        verify: str = "crc32c",
        fsync: bool = True,
        on_corrupt: Callable[[str, str], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise CacheError(f"disk cache capacity must be > 0 bytes, got {capacity_bytes}")
        if verify not in ("crc32c", "content_id"):
            raise CacheError(f"verify must be 'crc32c' or 'content_id', got {verify!r}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.verify = verify
        self.fsync = fsync
        self._on_corrupt = on_corrupt
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # id -> file size, LRU first
        self._bytes = 0
        self._count = CacheCounters()
        self._corrupt = self._write_errors = 0
        try:
            (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create disk cache directory {self.root}: {exc}; pick a writable disk_dir") from exc
        self._rebuild()

    # -- public API ---------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The verified raw bytes, or None (missing, or corrupt and now deleted)."""
        with self._lock:
            if key not in self._index:
                self._count.misses += 1
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                # Trust the file size, not the header, for how much to read: a damaged
                # length field must not make us allocate gigabytes.
                payload = os.fstat(f.fileno()).st_size - HEADER_BYTES
                header = f.read(HEADER_BYTES)
                data = _read_exact(f, max(payload, 0))
            problem = self._check(key, header, data)
            if problem is None:
                try:
                    os.utime(path)  # keeps LRU order across restarts
                except OSError:
                    pass
        except FileNotFoundError:
            problem, data = "missing", b""  # evicted by another thread meanwhile
        except (OSError, ValueError) as exc:
            problem, data = f"unreadable ({exc})", b""
        if problem is None:
            with self._lock:
                self._count.hits += 1
            return data
        with self._lock:
            self._count.misses += 1
            if problem != "missing":
                self._corrupt += 1
            self._drop(key)
        if problem != "missing":
            _unlink(path)
            if self._on_corrupt is not None:
                self._on_corrupt(key, problem)
        return None

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    __contains__ = contains

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """``contains`` of each key, under one acquisition of the lock."""
        with self._lock:
            index = self._index
            return [key in index for key in keys]

    def put(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """Store ``data`` (raw chunk bytes) under its content id; True when it is on disk."""
        if not is_content_id(key):
            raise CacheError(f"disk cache keys must be 64-hex content ids, got {key!r}")
        view = memoryview(data).cast("B")
        size = HEADER_BYTES + view.nbytes
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if size > self.capacity_bytes:
                self._count.rejected += 1
                return False
        tmp = self.root / "tmp" / f"{key}.{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(_HEADER.pack(_MAGIC, _bound_crc(key, view), view.nbytes))
                f.write(view)
                if self.fsync:
                    os.fsync(f.fileno())
        except OSError:
            _unlink(tmp)
            with self._lock:
                self._write_errors += 1
            return False
        with self._lock:
            if key in self._index:  # another thread won the race
                _unlink(tmp)
                return True
            victims = self._evict_for(size)
            path = self._path(key)
            try:
                path.parent.mkdir(exist_ok=True)
                os.replace(tmp, path)
            except OSError:
                _unlink(tmp)
                self._write_errors += 1
                return False
            self._index[key] = size
            self._bytes += size
            self._count.inserts += 1
        for victim in victims:
            _unlink(self._path(victim))
        return True

    def pop(self, key: str) -> bool:
        with self._lock:
            present = key in self._index
            self._drop(key)
        _unlink(self._path(key))
        return present

    def stats(self) -> DiskCacheStats:
        with self._lock:
            return DiskCacheStats(
                **self._count.snapshot(),
                corrupt=self._corrupt,
                write_errors=self._write_errors,
                bytes=self._bytes,
                entries=len(self._index),
                capacity_bytes=self.capacity_bytes,
            )

    def __len__(self) -> int:
        return len(self._index)

    # -- internals ----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def _check(self, key: str, header: bytes, data: bytes) -> str | None:
        if len(header) != HEADER_BYTES:
            return "truncated header"
        magic, crc, length = _HEADER.unpack(header)
        if magic not in (_MAGIC, _UNBOUND_MAGIC):
            return "bad header"
        if len(data) != length:
            return f"truncated ({len(data)} of {length} bytes)"
        if self.verify == "content_id" or magic == _UNBOUND_MAGIC:
            return None if key in (content_id(data), content_id(data, "sha256")) else "content id mismatch"
        return None if _bound_crc(key, data) == crc else "CRC32C mismatch (damaged, or another chunk's file)"

    def _drop(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _evict_for(self, size: int) -> list[str]:
        victims = []
        while self._index and self._bytes + size > self.capacity_bytes:
            victim, vsize = self._index.popitem(last=False)
            self._bytes -= vsize
            self._count.evictions += 1
            victims.append(victim)
        return victims

    def _rebuild(self) -> None:
        """Index the files a previous run left, oldest access first; drop debris and excess."""
        for leftover in (self.root / "tmp").iterdir():
            _unlink(leftover)
        found: list[tuple[float, str, int]] = []
        for sub in self.root.iterdir():
            if sub.name == "tmp" or not sub.is_dir():
                continue
            for f in sub.iterdir():
                if not is_content_id(f.name) or f.name[:2] != sub.name:
                    continue
                try:
                    st = f.stat()
                except OSError:
                    continue
                if st.st_size < HEADER_BYTES:
                    _unlink(f)
                    continue
                found.append((st.st_mtime, f.name, st.st_size))
        found.sort()
        for _mtime, key, size in found:
            self._index[key] = size
            self._bytes += size
        for victim in self._evict_for(0):
            _unlink(self._path(victim))


def _bound_crc(key: str, payload: bytes | memoryview) -> int:
    return crc32c(payload) ^ crc32c(key.encode("ascii"))


class _Reader(Protocol):
    def read(self, size: int, /) -> bytes | None: ...


def _read_exact(f: _Reader, n: int) -> bytes:
    data = f.read(n)
    if data is None or len(data) == n:
        return data or b""
    parts = [data]
    got = len(data)
    while got < n:
        more = f.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass
