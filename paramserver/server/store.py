"""Content-addressed chunk store on local disk, with a hot in-memory tier.

Layout: ``DATA_DIR/chunks/ab/cd/<id>`` where ``ab``/``cd`` are the first two
byte pairs of the id. Each file is a 48-byte header followed by the stored
(encoded) bytes exactly as they travel on the wire:

    magic "PDC1" | format u8 | codec length u8 | codec (18 bytes, ascii, padded)
    | raw_size u64 | stored_size u64 | crc32c of the stored bytes u32
    | crc32c of the preceding 44 header bytes u32          (little endian)

Keeping codec, sizes and CRC in the file's own header (rather than a sidecar)
makes each write a single atomic rename. Writes go to a temp file in the same
folder, are fsynced, renamed into place, and the folder is fsynced. On ingest
the content id is proven (decode per codec with the output capped at raw_size,
then hash); on every disk read the CRC32C is checked. A file that fails is
moved to ``DATA_DIR/quarantine/`` and reported through ``on_corrupt``, and the
read raises ChunkCorruptError: corrupt bytes are never returned.
"""
from __future__ import annotations

import errno
import os
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from chunking.hashing import content_id, crc32c, is_content_id

from paramserver.server import codecs
from paramserver.wire.limits import MAX_CODEC_LEN
from paramserver.server.cache import ByteLRU, CacheStats
from paramserver.server.errors import (
    ChunkCorruptError,
    ChunkNotFoundError,
    ChunkTransferCorruptError,
    InvalidChunkError,
    UnknownCodecError,
)

MAGIC = b"PDC1"
FORMAT = 1
_HEAD = struct.Struct("<4sBB18sQQI")
_HEADER = struct.Struct("<44sI")
HEADER_SIZE = _HEADER.size  # 48
TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class StoredChunk:
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
    bytes_on_disk: int
    quarantined: int
    cache: CacheStats


CorruptListener = Callable[[str, str], None]  # (chunk_id, reason)


def encode_header(codec: str, raw_size: int, stored_size: int, crc: int) -> bytes:
    head = _HEAD.pack(MAGIC, FORMAT, len(codec), codec.encode("ascii"), raw_size, stored_size, crc)
    return _HEADER.pack(head, crc32c(head))


def decode_header(header: bytes) -> tuple[str, int, int, int]:
    """(codec, raw_size, stored_size, crc32c) or ValueError naming what is wrong."""
    if len(header) != HEADER_SIZE:
        raise ValueError(f"file shorter than its {HEADER_SIZE}-byte header")
    head, head_crc = _HEADER.unpack(header)
    if crc32c(head) != head_crc:
        raise ValueError("header checksum mismatch")
    magic, fmt, codec_len, codec, raw_size, stored_size, crc = _HEAD.unpack(head)
    if magic != MAGIC or fmt != FORMAT or codec_len > MAX_CODEC_LEN:
        raise ValueError(f"not a chunk file of format {FORMAT}")
    return codec[:codec_len].decode("ascii"), raw_size, stored_size, crc


class ChunkStore:
    def __init__(
        self,
        data_dir: str | Path,
        *,
        cache_bytes: int = 256 << 20,
        fsync: bool = True,
        hash_algorithms: tuple[str, ...] = ("blake3", "sha256"),
        on_corrupt: CorruptListener | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.chunks_dir = self.data_dir / "chunks"
        self.quarantine_dir = self.data_dir / "quarantine"
        self.chunks_dir.mkdir(parents=True, exist_ok=True)
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.hash_algorithms = hash_algorithms
        self.on_corrupt = on_corrupt
        self.cache: ByteLRU[str, StoredChunk] = ByteLRU(cache_bytes)
        self._lock = threading.Lock()
        self._claims = threading.Lock()  # claim() against delete_if_unclaimed()
        self._known_dirs: set[str] = set()
        self._count = 0
        self._bytes = 0
        self._generation = 0  # bumped whenever the set of stored chunks changes
        self._quarantined = 0
        # Ids whose copy here was found corrupt and set aside, until a good copy is stored again:
        # a read of one answers "corrupt" (DATA_LOSS), not "not found", so a client can tell that
        # the bytes were lost here rather than never pushed.
        self._lost: dict[str, str] = {}
        self._scan()

    # ------------------------------------------------------------- paths

    def path(self, chunk_id: str) -> Path:
        return self.chunks_dir / chunk_id[0:2] / chunk_id[2:4] / chunk_id

    def _path_str(self, chunk_id: str) -> str:
        return f"{self.chunks_dir}/{chunk_id[0:2]}/{chunk_id[2:4]}/{chunk_id}"

    @staticmethod
    def check_id(chunk_id: str) -> None:
        if not is_content_id(chunk_id):
            shown = chunk_id[:80] if isinstance(chunk_id, str) else type(chunk_id).__name__
            raise InvalidChunkError(str(chunk_id)[:80], f"chunk id {shown!r} is not a content id (64 lowercase hex digits)")

    def _scan(self) -> None:
        # Startup: count what is there and drop temp files of interrupted writes.
        count = size = 0
        for dirpath, _dirs, files in os.walk(self.chunks_dir):
            for name in files:
                full = os.path.join(dirpath, name)
                if name.startswith(TMP_PREFIX):
                    try:
                        os.unlink(full)
                    except FileNotFoundError:
                        pass
                    continue
                try:
                    size += os.stat(full).st_size
                    count += 1
                except FileNotFoundError:
                    pass
        self._count, self._bytes = count, size
        for name in os.listdir(self.quarantine_dir):
            chunk_id = name.split(".", 1)[0]
            if is_content_id(chunk_id) and not os.path.exists(self._path_str(chunk_id)):
                self._lost[chunk_id] = "found corrupt before the last restart"

    # ------------------------------------------------------------- reads

    def has(self, chunk_id: str) -> bool:
        if chunk_id in self.cache:
            return True
        return is_content_id(chunk_id) and os.path.exists(self._path_str(chunk_id))

    @property
    def generation(self) -> int:
        """Changes whenever a chunk is stored, deleted or quarantined (not on reads or claims)."""
        return self._generation

    def claim(self, chunk_ids: Iterable[str]) -> list[bool]:
        """Which chunks are here; the ones that are get a fresh mtime.

        A push that finds a chunk here does not send it again: from then on the chunk must
        outlive the orphan grace period even if no committed version names it yet (an orphan
        of an old failed push, about to be collected). ``delete_if_unclaimed`` holds the same
        lock, so a claim and a collection of one chunk never interleave.
        """
        out: list[bool] = []
        with self._claims:
            for chunk_id in chunk_ids:
                if not is_content_id(chunk_id):
                    out.append(False)
                    continue
                path = self._path_str(chunk_id)
                try:
                    os.utime(path)
                    out.append(True)
                except FileNotFoundError:
                    out.append(False)
                except OSError:  # read-only or foreign-owned store: nothing can collect it either
                    out.append(os.path.exists(path))
        return out

    def delete_if_unclaimed(self, chunk_id: str, older_than: float) -> bool:
        """Delete ``chunk_id`` when its mtime (written or last claimed) is before ``older_than``."""
        with self._claims:
            try:
                if os.stat(self._path_str(chunk_id)).st_mtime >= older_than:
                    return False
            except FileNotFoundError:
                return False
            return self.delete(chunk_id)

    def get(self, chunk_id: str, *, use_cache: bool = True) -> StoredChunk:
        """The stored chunk, CRC32C-checked. Raises ChunkNotFoundError or ChunkCorruptError."""
        if use_cache:
            hit = self.cache.get(chunk_id)
            if hit is not None:
                return hit
        self.check_id(chunk_id)
        chunk = self._read(chunk_id)
        if use_cache:
            self.cache.put(chunk_id, chunk, len(chunk.data))
        return chunk

    def _read(self, chunk_id: str) -> StoredChunk:
        try:
            fd = os.open(self._path_str(chunk_id), os.O_RDONLY)
        except FileNotFoundError:
            lost = self._lost.get(chunk_id)
            if lost is not None:
                raise ChunkCorruptError(
                    chunk_id,
                    f"chunk {chunk_id}: this server's copy was corrupt ({lost}) and is awaiting repair; read it from another replica",
                ) from None
            raise ChunkNotFoundError(chunk_id, f"chunk {chunk_id} is not stored on this server; read it from another replica") from None
        try:
            file_size = os.fstat(fd).st_size
            try:
                codec, raw_size, stored_size, crc = decode_header(os.pread(fd, HEADER_SIZE, 0))
            except ValueError as exc:
                self._corrupt(chunk_id, str(exc))
            if file_size != HEADER_SIZE + stored_size:
                self._corrupt(chunk_id, f"file holds {file_size - HEADER_SIZE} stored bytes, header says {stored_size}")
            data = os.pread(fd, stored_size, HEADER_SIZE)
        finally:
            os.close(fd)
        if len(data) != stored_size:
            self._corrupt(chunk_id, f"short read: {len(data)} of {stored_size} bytes")
        if crc32c(data) != crc:
            self._corrupt(chunk_id, "CRC32C mismatch")
        return StoredChunk(chunk_id, data, codec, raw_size, crc)

    def verify(self, chunk_id: str) -> StoredChunk:
        """Full check from disk (CRC32C, decode, content id), bypassing the cache.

        Used by the scrubber and before trusting an existing copy for repair.
        """
        chunk = self.get(chunk_id, use_cache=False)
        try:
            self._prove_content(chunk_id, chunk.data, chunk.codec, chunk.raw_size)
        except UnknownCodecError:
            raise
        except InvalidChunkError as exc:
            self._corrupt(chunk_id, str(exc))
        return chunk

    # ------------------------------------------------------------- writes

    def validate_incoming(self, chunk_id: str, data: bytes, codec: str, raw_size: int, crc: int) -> None:
        """Prove that ``data`` is chunk ``chunk_id``; raise InvalidChunkError naming why not."""
        self.check_id(chunk_id)
        if not codec or len(codec) > MAX_CODEC_LEN or not codec.isascii():
            raise InvalidChunkError(chunk_id, f"chunk {chunk_id}: codec {codec!r} is not a valid codec name")
        if raw_size < 0 or raw_size > (1 << 40):
            raise InvalidChunkError(chunk_id, f"chunk {chunk_id}: raw_size {raw_size} is out of range")
        if crc32c(data) != crc:
            raise ChunkTransferCorruptError(
                chunk_id,
                f"chunk {chunk_id}: CRC32C of the {len(data)} received bytes does not match the declared {crc:#010x}; "
                "it was damaged in transit or truncated, send it again",
            )
        self._prove_content(chunk_id, data, codec, raw_size)

    def _prove_content(self, chunk_id: str, data: bytes, codec: str, raw_size: int) -> None:
        try:
            raw = codecs.decode(codec, data, raw_size)
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

    def put(self, chunk_id: str, data: bytes, codec: str, raw_size: int, crc: int) -> bool:
        """Verify and store one chunk. True when written, False when an intact copy was already here."""
        stored, dirs = self._put(chunk_id, data, codec, raw_size, crc)
        self._sync_dirs(dirs)
        return stored

    def put_many(self, chunks: Iterable[tuple[str, bytes, str, int, int]]) -> list[bool]:
        """Like put() for several chunks; folders are fsynced once at the end.

        Stops at the first invalid chunk (raising); the ones before it are durable.
        """
        results: list[bool] = []
        dirs: set[str] = set()
        try:
            for chunk_id, data, codec, raw_size, crc in chunks:
                stored, d = self._put(chunk_id, data, codec, raw_size, crc)
                dirs |= d
                results.append(stored)
        finally:
            self._sync_dirs(dirs)
        return results

    def _put(self, chunk_id: str, data: bytes, codec: str, raw_size: int, crc: int) -> tuple[bool, set[str]]:
        self.validate_incoming(chunk_id, data, codec, raw_size, crc)
        # Sent again by a push: claim it *before* trusting the copy here, so that orphan
        # collection cannot delete it between the check and the "already stored" answer.
        if self.claim([chunk_id])[0] and self._intact_copy_exists(chunk_id):
            return False, set()
        folder = self._ensure_dir(chunk_id)
        final = f"{folder}/{chunk_id}"
        tmp = f"{folder}/{TMP_PREFIX}{chunk_id[:16]}-{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            header = encode_header(codec, raw_size, len(data), crc)
            written = os.writev(fd, [header, data])
            if written != HEADER_SIZE + len(data):
                view = memoryview(header + data)[written:]
                while view:
                    view = view[os.write(fd, view):]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        with self._lock:  # concurrent writers of one id: the counters must count it once
            existed = os.path.exists(final)
            os.replace(tmp, final)
            self._lost.pop(chunk_id, None)
            self._generation += 1
            if not existed:
                self._count += 1
                self._bytes += HEADER_SIZE + len(data)
        return True, {folder}

    def _intact_copy_exists(self, chunk_id: str) -> bool:
        if not os.path.exists(self._path_str(chunk_id)):
            return False
        try:
            self.get(chunk_id)  # CRC check; a bad copy is quarantined and replaced
            return True
        except (ChunkCorruptError, ChunkNotFoundError):
            return False

    def _ensure_dir(self, chunk_id: str) -> str:
        rel = f"{chunk_id[0:2]}/{chunk_id[2:4]}"
        folder = f"{self.chunks_dir}/{rel}"
        if rel not in self._known_dirs:
            os.makedirs(folder, exist_ok=True)
            if self.fsync:  # make the new folder entries themselves durable
                _fsync_dir(f"{self.chunks_dir}/{chunk_id[0:2]}")
                _fsync_dir(str(self.chunks_dir))
            self._known_dirs.add(rel)
        return folder

    def _sync_dirs(self, dirs: Iterable[str]) -> None:
        if self.fsync:
            for folder in dirs:
                _fsync_dir(folder)

    def delete(self, chunk_id: str) -> bool:
        self.check_id(chunk_id)
        self.cache.discard(chunk_id)
        path = self._path_str(chunk_id)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return False
        with self._lock:
            self._count -= 1
            self._bytes -= size
            self._generation += 1
        return True

    # ------------------------------------------------------------- corruption

    def _corrupt(self, chunk_id: str, reason: str) -> None:
        """Quarantine the file and raise; never returns."""
        self.cache.discard(chunk_id)
        path = self._path_str(chunk_id)
        target = self.quarantine_dir / f"{chunk_id}.{time.time_ns()}"
        try:
            size = os.stat(path).st_size
            os.replace(path, target)
        except FileNotFoundError:
            pass  # another reader quarantined it first
        except OSError as exc:
            if exc.errno not in (errno.EXDEV,):
                raise
        else:
            with self._lock:
                self._count -= 1
                self._bytes -= size
                self._quarantined += 1
                self._generation += 1
        with self._lock:
            self._lost[chunk_id] = reason
        if self.on_corrupt is not None:
            self.on_corrupt(chunk_id, reason)
        raise ChunkCorruptError(
            chunk_id,
            f"chunk {chunk_id}: this server's copy is corrupt ({reason}); it was quarantined and queued for repair, "
            "read it from another replica",
        )

    # ------------------------------------------------------------- inventory

    def iter_ids(self) -> Iterator[str]:
        """Every stored chunk id, in a stable (sorted by folder) order."""
        for top in sorted(os.listdir(self.chunks_dir)):
            top_dir = self.chunks_dir / top
            if not top_dir.is_dir():
                continue
            for sub in sorted(os.listdir(top_dir)):
                sub_dir = top_dir / sub
                try:
                    names = sorted(os.listdir(sub_dir))
                except NotADirectoryError:
                    continue
                for name in names:
                    if not name.startswith(TMP_PREFIX) and is_content_id(name):
                        yield name

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(self._count, self._bytes, self._quarantined, self.cache.stats())

    def __len__(self) -> int:
        return self._count


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["ChunkStore", "StoredChunk", "StoreStats", "HEADER_SIZE", "encode_header", "decode_header"]
