"""A data dir in the one-file-per-chunk layout (DATA_DIR/chunks/ab/cd/<id>) is migrated into segments
on the first open (issue 12): every file verified, appended, the old files removed, counts logged."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from chunking.hashing import content_id, crc32c
from paramserver.server.errors import ChunkCorruptError
from paramserver.server.store import ChunkStore, StoreConfig, encode_header

KiB = 1 << 10


def chunk(seed: int, size: int = 20 * KiB) -> tuple[str, bytes, str, int, int]:
    data = bytes((seed * 31 + i * 7) % 251 for i in range(size))
    return content_id(data), data, "raw", size, crc32c(data)


def old_file(data_dir: Path, name: str, blob: bytes) -> Path:
    path = data_dir / "chunks" / name[0:2] / name[2:4] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    return path


def v1(c: tuple[str, bytes, str, int, int]) -> bytes:
    return encode_header(c[2], c[3], len(c[1]), c[4]) + c[1]


def v2(c: tuple[str, bytes, str, int, int]) -> bytes:
    return encode_header(c[2], c[3], len(c[1]), c[4], c[0]) + c[1]


def test_an_old_data_dir_is_migrated_verified_and_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good1 = [chunk(i) for i in range(6)]  # format 1: no id in the header, proven by content
    good2 = [chunk(100 + i) for i in range(6)]  # format 2: the header names the id
    for c in good1:
        old_file(tmp_path, c[0], v1(c))
    for c in good2:
        old_file(tmp_path, c[0], v2(c))
    flipped, swapped, swapped_v1, short = chunk(200), chunk(201), chunk(202), chunk(203)
    bad = bytearray(v2(flipped))
    bad[100] ^= 1
    old_file(tmp_path, flipped[0], bytes(bad))  # CRC fails
    old_file(tmp_path, swapped[0], v2(good2[0]))  # another chunk's file under this name
    old_file(tmp_path, swapped_v1[0], v1(good1[0]))  # format 1: only the content proof can tell
    old_file(tmp_path, short[0], v2(short)[:-10])  # truncated
    tmp = tmp_path / "chunks" / "ab" / ".tmp-abcdef-123"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"half a write")
    reported: list[str] = []
    caplog.set_level(logging.INFO, logger="paramserver.server.store")
    store = ChunkStore(tmp_path, cache_bytes=0, config=StoreConfig(segment_bytes=64 * KiB),
                       on_corrupt=lambda cid, why: reported.append(cid))
    assert not (tmp_path / "chunks").exists()  # every file gone: migrated, quarantined or a temp file
    assert sorted(store.iter_ids()) == sorted(c[0] for c in good1 + good2)
    assert all(store.verify(c[0]).data == c[1] for c in good1 + good2)
    bad_ids = [flipped[0], swapped[0], swapped_v1[0], short[0]]
    assert sorted(reported) == sorted(bad_ids)
    for cid in bad_ids:
        with pytest.raises(ChunkCorruptError, match="awaiting repair"):
            store.get(cid)
    assert sorted(p.name.split(".")[0] for p in store.quarantine_dir.iterdir()) == sorted(bad_ids)
    line = [r.getMessage() for r in caplog.records if "migrated the one-file-per-chunk layout" in r.getMessage()]
    assert len(line) == 1 and "migrated=12" in line[0] and "quarantined=4" in line[0]
    assert store.stats().quarantined == 4 and len(list(store.segments_dir.glob("*.seg"))) >= 2
    store.close()
    again = ChunkStore(tmp_path, cache_bytes=0)  # nothing left to migrate; the losses are remembered
    assert len(again) == 12
    with pytest.raises(ChunkCorruptError, match="awaiting repair"):
        again.get(flipped[0])


def test_an_interrupted_migration_resumes_without_duplicates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [chunk(300 + i, 40 * KiB) for i in range(10)]
    for c in chunks:
        old_file(tmp_path, c[0], v2(c))
    import paramserver.server.store.migration as migration

    monkeypatch.setattr(migration, "_MIGRATE_BATCH_BYTES", 100 * KiB)  # batches of 3
    real = migration.unlink_quietly
    removed: list[str] = []

    def crash_after_first_batch(path: str) -> None:
        if "/chunks/" in path and len(removed) >= 3:
            raise KeyboardInterrupt("the server was killed")
        removed.append(path)
        real(path)

    monkeypatch.setattr(migration, "unlink_quietly", crash_after_first_batch)
    with pytest.raises(KeyboardInterrupt):
        ChunkStore(tmp_path, cache_bytes=0)
    monkeypatch.setattr(migration, "unlink_quietly", real)
    left = list((tmp_path / "chunks").rglob("*"))
    assert any(p.is_file() for p in left)
    store = ChunkStore(tmp_path, cache_bytes=0)  # the lock of the killed open went with its object
    assert sorted(store.iter_ids()) == sorted(c[0] for c in chunks) and not (tmp_path / "chunks").exists()
    assert store.stats().live_bytes == sum(80 + len(c[1]) for c in chunks)  # each chunk once
    assert all(store.verify(c[0]).data == c[1] for c in chunks)


def test_an_unknown_codec_in_a_format_1_file_is_migrated_unproven(tmp_path: Path) -> None:
    data = os.urandom(4 * KiB)
    cid = content_id(data)
    old_file(tmp_path, cid, encode_header("lz99", len(data), len(data), crc32c(data)) + data)
    store = ChunkStore(tmp_path, cache_bytes=0)
    assert store.get(cid).codec == "lz99"  # as the old store served it: CRC checked, content not provable here
