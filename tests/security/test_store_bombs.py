"""Decompression bombs against the chunk store (issue 11, item 2).

A tiny zstd frame that inflates far beyond any real chunk, declared with a matching raw_size,
used to be decoded (the only bound was raw_size <= 2^40): gigabytes of RSS per push, and the
scrubber, budgeted by stored bytes, re-inflated it every second. Now ingest refuses any
raw_size over the largest chunk size (64 MiB) before decoding anything, no codec allocates
beyond it, and the scrubber pays for what it inflates.
"""
from __future__ import annotations

import os
import tracemalloc
from pathlib import Path
from typing import Callable

import pytest
import zstandard

from chunking.hashing import content_id, crc32c
from paramserver.server import codecs
from paramserver.server.errors import ChunkCorruptError, InvalidChunkError
from paramserver.server.repair import RepairQueue, Scrubber
from paramserver.server.store import DEFAULT_MAX_RAW_BYTES, ChunkStore, StoredChunk, encode_header

KiB, MiB = 1 << 10, 1 << 20
LIMIT = 64 * MiB


def zeros_frame(n: int, *, declared: bool = True) -> bytes:
    """A zstd frame of ``n`` zero bytes, built in pieces (a few KiB whatever ``n``)."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declared)
    piece = bytes(4 * MiB)
    chunker = cctx.chunker(size=n if declared else -1, chunk_size=1 << 17)
    out: list[bytes] = []
    left = n
    while left:
        step = min(left, len(piece))
        out.extend(chunker.compress(piece[:step]))
        left -= step
    out.extend(chunker.finish())
    return b"".join(out)


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak Python-heap bytes allocated while ``fn`` runs (zstandard's output buffers are Python bytes)."""
    tracemalloc.start()
    try:
        try:
            fn()
        except Exception:  # noqa: BLE001 - the refusal is what the caller expects; only the memory is measured here
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_default_limit_is_the_largest_chunk_size() -> None:
    from chunking.config import MAX_CHUNK_SIZE

    assert DEFAULT_MAX_RAW_BYTES == MAX_CHUNK_SIZE == LIMIT == codecs.DEFAULT_MAX_RAW_BYTES


def test_a_frame_declaring_more_than_the_largest_chunk_is_refused_before_decoding(tmp_path: Path) -> None:
    # The bomb is "honest": its raw_size matches what it inflates to and its id is the id of those
    # bytes, so only the cap stops it. Before the fix it was decoded (96 MiB allocated) and stored.
    n = 96 * MiB
    bomb = zeros_frame(n)
    assert len(bomb) < 64 * KiB
    cid = content_id(bytes(n))
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False)
    caught: list[BaseException] = []

    def put() -> None:
        try:
            store.put(cid, bomb, "zstd", n, crc32c(bomb))
        except InvalidChunkError as exc:
            caught.append(exc)
            raise

    peak = peak_bytes(put)
    assert caught, "a 96 MiB raw_size was accepted"
    message = str(caught[0])
    assert cid in message and str(LIMIT) in message and "64.0 MiB" in message and "raw_size" in message
    assert peak < 8 * MiB, f"refusing the bomb allocated {peak} bytes"
    assert not store.has(cid) and len(store) == 0


def test_the_cap_follows_max_raw_bytes(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False, max_raw_bytes=1 * MiB)
    ok = os.urandom(1 * MiB)
    assert store.put(content_id(ok), ok, "raw", len(ok), crc32c(ok))
    big = os.urandom(1 * MiB + 1)
    with pytest.raises(InvalidChunkError, match=f"over this server's limit of {1 * MiB} bytes"):
        store.put(content_id(big), big, "raw", len(big), crc32c(big))
    frame = zeros_frame(2 * MiB)
    with pytest.raises(InvalidChunkError, match=str(1 * MiB)):
        store.put(content_id(bytes(2 * MiB)), frame, "zstd", 2 * MiB, crc32c(frame))
    with pytest.raises(ValueError):
        ChunkStore(tmp_path, max_raw_bytes=0)


@pytest.mark.parametrize("codec", ["zstd", "zstd+shuffle4"])
@pytest.mark.parametrize("declared", [True, False], ids=["declared-size", "undeclared-size"])
def test_no_codec_allocates_beyond_the_limit(codec: str, declared: bool) -> None:
    # raw_size over the limit: refused before any decoder allocates its output (before the fix a
    # frame without a declared size got a raw_size buffer: 128 MiB here, twice for the shuffle codec).
    frame = zeros_frame(128 * MiB, declared=declared)
    errors: list[BaseException] = []

    def decode() -> None:
        try:
            codecs.decode(codec, frame, 128 * MiB)
        except codecs.DecodeError as exc:
            errors.append(exc)
            raise

    peak = peak_bytes(decode)
    assert errors and "bomb" in str(errors[0]) and str(LIMIT) in str(errors[0])
    assert peak < 4 * MiB, f"{codec} allocated {peak} bytes for a refused raw_size"


@pytest.mark.parametrize("codec", ["zstd", "zstd+shuffle4"])
def test_an_undeclared_frame_inflating_past_raw_size_stops_at_raw_size(codec: str) -> None:
    # Within the limit, a frame without a declared size that inflates to 64 MiB while claiming 1 MiB
    # is cut off at 1 MiB of output: the decoder never holds more than raw_size.
    frame = zeros_frame(64 * MiB, declared=False)
    errors: list[BaseException] = []

    def decode() -> None:
        try:
            codecs.decode(codec, frame, 1 * MiB)
        except codecs.DecodeError as exc:
            errors.append(exc)
            raise

    peak = peak_bytes(decode)
    assert errors and "raw_size" in str(errors[0])
    assert peak < 4 * MiB, f"{codec} allocated {peak} bytes decoding a frame capped at 1 MiB"


def test_a_declared_bomb_within_raw_size_checks_is_refused_for_the_shuffle_codec_too() -> None:
    frame = zeros_frame(32 * MiB)  # declares 32 MiB, claims 1 MiB
    with pytest.raises(codecs.DecodeError, match="decompression bomb"):
        codecs.decode("zstd+shuffle4", frame, 1 * MiB)
    with pytest.raises(codecs.DecodeError, match="outside"):
        codecs.decode("raw", b"", -1)


def test_a_bomb_already_on_disk_in_format_1_is_quarantined_not_inflated(tmp_path: Path) -> None:
    # A file stored by an older server (format 1, no id in its header, one file per chunk) that declares
    # 4 GiB: the migration into segments proves its content, and refuses the raw_size instead of inflating it.
    corrupt: list[str] = []
    n = 4 << 30
    bomb = zeros_frame(256 * MiB)  # the frame's own size field is smaller; the header is what lies
    cid = "ab" * 32
    path = tmp_path / "chunks" / cid[:2] / cid[2:4] / cid
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_header("zstd", n, len(bomb), crc32c(bomb)) + bomb)
    stores: list[ChunkStore] = []

    def open_store() -> None:
        stores.append(ChunkStore(tmp_path, cache_bytes=0, fsync=False, on_corrupt=lambda cid, why: corrupt.append(cid)))

    peak = peak_bytes(open_store)
    assert stores and peak < 8 * MiB and corrupt == [cid] and not path.exists()
    with pytest.raises(ChunkCorruptError, match="awaiting repair"):
        stores[0].get(cid)


def test_scrubber_budgets_by_raw_bytes(tmp_path: Path) -> None:
    # One small stored chunk that inflates to 8 MiB, scrubbed at 1 MiB per step: it costs 8 steps
    # of budget. Before the fix it cost its ~1 KiB of stored bytes and was re-inflated every step.
    queue = RepairQueue(clock=lambda: 0.0)
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False, on_corrupt=queue.add)
    n = 8 * MiB
    frame = zeros_frame(n)
    cid = content_id(bytes(n))
    assert store.put(cid, frame, "zstd", n, crc32c(frame))
    assert len(frame) < 4 * KiB
    verified: list[str] = []
    real_verify = store.verify

    def counting_verify(chunk_id: str) -> StoredChunk:
        verified.append(chunk_id)
        return real_verify(chunk_id)

    store.verify = counting_verify  # type: ignore[method-assign]
    scrubber = Scrubber(store, queue)
    reports = [scrubber.step(budget_bytes=1 * MiB) for _ in range(16)]
    assert reports[0].bytes_checked == n and reports[0].checked == 1
    assert len(verified) == 2, f"an 8 MiB-raw chunk was inflated {len(verified)} times in 16 steps of a 1 MiB budget"
    assert sum(r.bytes_checked for r in reports) <= 16 * MiB + n
    assert all(r.checked == 0 for r in reports[1:8])
    assert not queue and store.verify(cid).raw_size == n
