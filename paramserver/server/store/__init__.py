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

**Modules**, one job each; ``ChunkStore`` (``chunk_store.py``) combines their classes, each of which
builds only on those below it: ``state.py`` (index entries, segments, locks), ``segment_log.py``
(appends, roll-over, group commit), ``tombstones.py`` (claims, deletes), ``quarantine.py``,
``proofs.py`` (is it the chunk its id says), ``reads.py``, ``writes.py`` (``put_many``),
``compaction.py`` (moving records, removing segments), ``migration.py`` (the one-file layout),
``recovery.py`` (open: the index rebuilt); ``config.py`` (StoreConfig), ``files.py`` (OS helpers).
"""
from __future__ import annotations

from paramserver.server.records import (
    FORMAT,
    FORMAT_V1,
    HEADER_SIZE,
    HEADER_SIZE_V1,
    ChunkHeader,
    decode_header,
    encode_header,
    parse_header,
)
from paramserver.server.segments import ChunkLocation
from paramserver.server.store.chunk_store import ChunkStore
from paramserver.server.store.config import CONFIG_KEYS, DEFAULT_MAX_RAW_BYTES, StoreConfig
from paramserver.server.store.migration import TMP_PREFIX
from paramserver.server.store.state import CorruptListener, StoredChunk, StoreStats

__all__ = [
    "CONFIG_KEYS",
    "ChunkStore", "StoreConfig", "StoredChunk", "StoreStats", "ChunkHeader", "ChunkLocation", "HEADER_SIZE", "HEADER_SIZE_V1",
    "FORMAT", "FORMAT_V1", "DEFAULT_MAX_RAW_BYTES", "TMP_PREFIX", "encode_header", "decode_header", "parse_header",
    "CorruptListener",
]
