"""Migration of the one-file-per-chunk layout (``DATA_DIR/chunks/ab/cd/<id>``) into segments.

Done on the first open: each file is verified (CRC32C; the header's id, or for format 1 the content
id), appended, and the old files are removed once the segment is durable; a file that fails is
quarantined. Counts are logged.
"""
from __future__ import annotations

import os
import time

from chunking.hashing import crc32c, is_content_id

from paramserver.server.errors import InvalidChunkError, UnknownCodecError
from paramserver.server.records import FORMAT_V1, parse_header
from paramserver.server.store.config import MiB
from paramserver.server.store.files import fsync_dir_quietly, unlink_quietly
from paramserver.server.store.state import log
from paramserver.server.store.writes import Writes
from paramserver.wire.chunk_record import ChunkRecord

TMP_PREFIX = ".tmp-"  # temp files of the one-file layout (removed by the migration)
LEGACY_DIR = "chunks"
_MIGRATE_BATCH_BYTES = 32 * MiB


class Migration(Writes):
    """Moves the one-file-per-chunk layout into segments (on open)."""

    def _migrate(self) -> None:
        """Move a one-file-per-chunk data dir (DATA_DIR/chunks/ab/cd/<id>) into segments."""
        root = str(self.chunks_dir)
        started = time.monotonic()
        files: list[str] = []
        for dirpath, _dirs, entries in os.walk(root):
            for name in entries:
                full = os.path.join(dirpath, name)
                if name.startswith(TMP_PREFIX):
                    unlink_quietly(full)  # an interrupted write of the old store
                else:
                    files.append(full)
        files.sort()
        migrated = present = bad = unproven = 0
        nbytes = 0
        batch: list[ChunkRecord] = []
        names: set[str] = set()
        done: list[str] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch_bytes
            if batch:
                self._store_batch(batch, dedup=False)  # durable (group commit) before its old files go
            for full in done:
                unlink_quietly(full)
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
            batch_bytes += len(chunk.data)
            nbytes += len(chunk.data)
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
            fsync_dir_quietly(str(self.data_dir))
        left = os.path.isdir(root)
        log.info("chunk store migrated the one-file-per-chunk layout to segments: %s migrated=%d bytes=%d already_present=%d "
                 "quarantined=%d unproven_codec=%d seconds=%.2f%s", self._where, migrated, nbytes, present, bad, unproven,
                 time.monotonic() - started, f"; {root} still holds files it could not read" if left else "")

    def _check_legacy(self, name: str, blob: bytes) -> tuple[str, ChunkRecord | None]:
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
        chunk = ChunkRecord(name, h.codec, h.raw_size, h.crc32c, data)
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
