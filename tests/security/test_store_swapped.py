"""A chunk record swapped for another chunk's (issue 11, item 8; segment layout of issue 12).

One chunk's record copied over another's keeps a valid header and CRC, so a CRC-only read
served the other chunk's bytes under the requested id. Format-2 headers carry the chunk id and
every disk read checks it; format-1 files (no id) of the old one-file layout are proven by their
content when they are migrated into segments. A mismatch is corruption: quarantined, logged,
queued for repair, ChunkCorruptError (DATA_LOSS).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from chunking.hashing import content_id, crc32c
from paramserver.client.rpc import ChunkData, ParamServerClient, make_chunk
from paramserver.server.errors import ChunkCorruptError
from paramserver.server.repair import RepairQueue, Repairer, Scrubber
from paramserver.server.segments import ChunkLocation, chunks_on_disk, locate_on_disk, write_in_place
from paramserver.server.store import (
    FORMAT,
    HEADER_SIZE,
    HEADER_SIZE_V1,
    ChunkStore,
    StoredChunk,
    decode_header,
    encode_header,
    parse_header,
)
from paramserver.wire.proto import pb
from tests.conftest import stop_process
from tests.store_checks import records

KiB = 1 << 10


def raw_chunk(size: int = 32 * KiB, seed: int = 0) -> tuple[str, bytes, str, int, int]:
    data = os.urandom(size) if seed == 0 else bytes((seed * 7 + i) % 251 for i in range(size))
    return content_id(data), data, "raw", len(data), crc32c(data)


@pytest.fixture
def queue() -> RepairQueue:
    return RepairQueue(clock=lambda: 0.0)


@pytest.fixture
def store(tmp_path: Path, queue: RepairQueue) -> ChunkStore:
    return ChunkStore(tmp_path / "data", cache_bytes=0, fsync=False, on_corrupt=queue.add, server_id="ps9")


def write_v1(data_dir: Path, path_id: str, chunk: tuple[str, bytes, str, int, int]) -> Path:
    """A format-1 file (as older servers wrote, one file per chunk) holding ``chunk`` at the path of ``path_id``."""
    _cid, data, codec, raw_size, crc = chunk
    path = data_dir / "chunks" / path_id[:2] / path_id[2:4] / path_id
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_header(codec, raw_size, len(data), crc) + data)
    return path


def where(store: ChunkStore, cid: str) -> ChunkLocation:
    loc = store.locate(cid)
    assert loc is not None, f"chunk {cid} is not stored"
    return loc


def swap(src: ChunkLocation, dst: ChunkLocation) -> None:
    """Put the record at ``src`` (header + bytes, CRC intact) in the place of the one at ``dst``."""
    write_in_place(dst.path, dst.record_offset, src.read_record())


def test_format_2_header_names_the_chunk(store: ChunkStore) -> None:
    cid, data, *rest = raw_chunk()
    store.put(cid, data, *rest)
    blob = where(store, cid).read_record()
    assert HEADER_SIZE == 80 and HEADER_SIZE_V1 == 48 and len(blob) == HEADER_SIZE + len(data)
    header = parse_header(blob[:HEADER_SIZE])
    assert header.format == FORMAT == 2 and header.chunk_id == cid and header.size == HEADER_SIZE
    assert blob[4] == 2 and blob[44:76] == bytes.fromhex(cid)
    assert decode_header(blob[:HEADER_SIZE]) == ("raw", len(data), len(data), crc32c(data))
    assert blob[HEADER_SIZE:] == data
    assert encode_header("raw", 1, 1, 0).__len__() == HEADER_SIZE_V1  # legacy writers still exist (tests, tools)
    with pytest.raises(ValueError, match="unknown format"):
        parse_header(blob[:4] + b"\x07" + blob[5:HEADER_SIZE])


def test_a_swapped_file_is_corruption_never_the_other_chunks_bytes(
    store: ChunkStore, queue: RepairQueue, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = raw_chunk(seed=1), raw_chunk(seed=2)
    store.put_many(records([a, b]))
    swap(where(store, a[0]), where(store, b[0]))  # A's record (CRC intact) where B's was
    caplog.set_level(logging.WARNING, logger="paramserver.server.store")
    with pytest.raises(ChunkCorruptError, match=b[0]) as info:
        store.get(b[0])
    assert f"holds chunk {a[0]}" in str(info.value) and "quarantined" in str(info.value)
    assert store.locate(b[0]) is None
    assert [p.name.split(".")[0] for p in store.quarantine_dir.iterdir()] == [b[0]]
    assert b[0] in queue and store.stats().quarantined == 1
    lines = [r for r in caplog.records if "chunk quarantined" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert f"id={b[0]}" in lines[0].getMessage() and "reason=" in lines[0].getMessage()
    assert "server=ps9" in lines[0].getMessage() and f"data_dir={store.data_dir}" in lines[0].getMessage()
    # Until repaired the id reads as lost (DATA_LOSS), A is untouched, and repair restores B.
    with pytest.raises(ChunkCorruptError, match="awaiting repair"):
        store.get(b[0])
    assert store.get(a[0]).data == a[1]
    report = Repairer(store, queue, lambda cid: StoredChunk(b[0], b[1], "raw", len(b[1]), b[4]) if cid == b[0] else None).step()
    assert report.repaired == [b[0]] and store.get(b[0]).data == b[1]


def test_a_swapped_file_is_caught_by_verify_and_the_scrubber_and_through_the_cache(tmp_path: Path) -> None:
    queue = RepairQueue(clock=lambda: 0.0)
    store = ChunkStore(tmp_path, cache_bytes=1 << 20, fsync=False, on_corrupt=queue.add)
    a, b, c = raw_chunk(seed=3), raw_chunk(seed=4), raw_chunk(seed=5)
    store.put_many(records([a, b, c]))
    swap(where(store, a[0]), where(store, c[0]))
    with pytest.raises(ChunkCorruptError):
        store.verify(c[0])
    swap(where(store, a[0]), where(store, b[0]))
    report = Scrubber(store, queue).step(1 << 30)
    assert report.corrupt == [b[0]] and b[0] in queue and c[0] in queue
    assert store.get(a[0]).data == a[1]


def test_format_1_files_are_proven_when_migrated_and_then_read_as_format_2(tmp_path: Path) -> None:
    a = raw_chunk(seed=6)
    write_v1(tmp_path / "data", a[0], a)
    fresh = ChunkStore(tmp_path / "data", cache_bytes=0, fsync=False)
    assert fresh.stats().live_bytes == HEADER_SIZE + len(a[1]) and not (tmp_path / "data" / "chunks").exists()
    record = where(fresh, a[0]).read_record()
    header = parse_header(record[:HEADER_SIZE])
    assert header.format == FORMAT and header.chunk_id == a[0] and record[HEADER_SIZE:] == a[1]
    assert fresh.get(a[0]).data == a[1] and fresh.verify(a[0]).data == a[1]


def test_a_swapped_format_1_file_is_corruption(tmp_path: Path, queue: RepairQueue) -> None:
    a, b = raw_chunk(seed=7), raw_chunk(seed=8)
    write_v1(tmp_path / "data", a[0], a)
    path = write_v1(tmp_path / "data", b[0], a)  # A's bytes, format 1, under B's name
    store = ChunkStore(tmp_path / "data", cache_bytes=0, fsync=False, on_corrupt=queue.add)
    with pytest.raises(ChunkCorruptError, match="awaiting repair") as info:
        store.get(b[0])
    assert f"format-1 file does not hold chunk {b[0]}" in str(info.value)
    assert not path.exists() and b[0] in queue and a[0] not in queue
    assert store.get(a[0]).data == a[1]
    assert [p.name.split(".")[0] for p in store.quarantine_dir.iterdir()] == [b[0]]


def test_a_format_1_file_is_proven_once_at_migration_not_on_every_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = raw_chunk(seed=9)
    write_v1(tmp_path / "data", a[0], a)
    proofs: list[str] = []
    prove = ChunkStore._prove_content

    def counting(self: ChunkStore, chunk_id: str, data: bytes, codec: str, raw_size: int) -> None:
        proofs.append(chunk_id)
        prove(self, chunk_id, data, codec, raw_size)

    monkeypatch.setattr(ChunkStore, "_prove_content", counting)
    store = ChunkStore(tmp_path / "data", cache_bytes=0, fsync=False)
    for _ in range(3):
        assert store.get(a[0]).data == a[1]
    assert proofs == [a[0]]


# ------------------------------------------------------------------ a real server


ADMIN, READ = "admin-token-swap", "read-token-swap"


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], address: str, data_dir: Path) -> None:
        self.proc, self.address, self.data_dir = proc, address, data_dir

    def chunk_at(self, cid: str) -> ChunkLocation:
        loc = locate_on_disk(self.data_dir, cid)  # read from the segment files: the server holds the index
        assert loc is not None, f"chunk {cid} is not on disk"
        return loc

    def peak_rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("swapped")
    port_file = root / "port"
    env = {**os.environ, "PARAMS_ADMIN_TOKEN": ADMIN, "PARAMS_READ_TOKEN": READ}
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramserver.server.dataplane_dev", "--data-dir", str(root / "data"), "--port-file", str(port_file),
         "--listen", "127.0.0.1:0", "--cache-bytes", "0", "--no-fsync"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early: {proc.stdout.read().decode() if proc.stdout else ''}")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start within 30 s")
            time.sleep(0.05)
        yield Server(proc, f"127.0.0.1:{port_file.read_text()}", root / "data")
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def admin(server: Server) -> Iterator[ParamServerClient]:
    with ParamServerClient(server.address, token=ADMIN) as client:
        client.wait_ready(15)
        yield client


@pytest.mark.integration
def test_server_answers_data_loss_for_a_swapped_file_never_the_wrong_bytes(server: Server, admin: ParamServerClient) -> None:
    chunks: list[ChunkData] = []
    for i in range(3):
        data = os.urandom(64 * KiB + i)
        chunks.append(make_chunk(content_id(data), data))
    a, b, c = chunks
    assert admin.put_chunks(chunks).chunks_stored == 3
    before = admin.server_status()
    swap(server.chunk_at(a.id), server.chunk_at(b.id))  # A's record (header names A) where B's and C's were
    swap(server.chunk_at(a.id), server.chunk_at(c.id))
    with pytest.raises(grpc.RpcError) as info:
        list(admin.get_chunks([b.id]))
    assert info.value.code() == grpc.StatusCode.DATA_LOSS and b.id in (info.value.details() or "")
    items = list(admin.get_chunks_partial([a.id, c.id]))
    assert items[0] == a
    assert isinstance(items[1], pb.ChunkAck) and items[1].id == c.id and items[1].status == pb.CORRUPT
    status = admin.server_status()
    assert status.quarantined == before.quarantined + 2 and status.repair_queue >= 2
    assert admin.put_chunks([b]).chunks_stored == 1  # a good copy repairs it
    assert list(admin.get_chunks([b.id])) == [b]


@pytest.mark.integration
def test_server_refuses_a_decompression_bomb_without_inflating_it(server: Server, admin: ParamServerClient) -> None:
    import zstandard

    n = 1 << 30  # a 1 GiB frame of zeros, a few tens of KiB on the wire
    cctx = zstandard.ZstdCompressor(level=1)
    chunker = cctx.chunker(size=n, chunk_size=1 << 17)
    piece = bytes(8 << 20)
    frame = b"".join([*(b"".join(chunker.compress(piece)) for _ in range(n // len(piece))), *chunker.finish()])
    peak_before = server.peak_rss()
    with pytest.raises(grpc.RpcError) as info:
        admin.put_chunks([make_chunk("cd" * 32, frame, codec="zstd", raw_size=n)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(64 << 20) in (info.value.details() or "")
    assert server.peak_rss() < peak_before + (64 << 20), "the server inflated the bomb"
    assert admin.has_chunks(["cd" * 32]) == [False]


def test_concurrent_reads_of_migrated_format_1_files_agree(tmp_path: Path) -> None:
    import threading

    chunks = [raw_chunk(8 * KiB, seed=20 + i) for i in range(12)]
    for c in chunks:
        write_v1(tmp_path / "data", c[0], c)
    fresh = ChunkStore(tmp_path / "data", cache_bytes=0, fsync=False)
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for _ in range(5):
                for c in chunks[k % 3 :]:
                    assert fresh.get(c[0]).data == c[1]
                fresh.claim([c[0] for c in chunks])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    for c in chunks:
        assert fresh.get(c[0]).data == c[1]
    assert fresh.stats().live_bytes == sum(HEADER_SIZE + len(c[1]) for c in chunks) and fresh.stats().chunk_count == len(chunks)
    on_disk = chunks_on_disk(tmp_path / "data")
    assert sorted(on_disk) == sorted(c[0] for c in chunks)
    assert all(parse_header(loc.read_record()[:HEADER_SIZE]).format == FORMAT for loc in on_disk.values())
