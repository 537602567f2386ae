"""Checks shared by the crash and full-disk tests: a store's index against its segment files, and
the copies of a version that one server holds (issue 12)."""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from chunking.manifest import Manifest
from chunking.unpack import unpack
from paramserver.client.rpc import ChunkData, ParamServerClient
from paramserver.server.segments import (
    SEGMENTS_DIR,
    SegmentScan,
    index_file,
    list_segments,
    load_index_file,
    resolve,
    scan_segment,
    segment_file,
)
from paramserver.server.store import ChunkStore
from paramserver.wire.chunk_record import ChunkRecord
from paramserver.wire.proto import pb


def scan_segments(data_dir: str | Path) -> dict[int, SegmentScan]:
    """An independent scan of every segment of ``data_dir`` (record headers, each record's CRC checked,
    no .idx used), asserting that none has a torn tail, a damaged region, a corrupt record or a bad
    header; a sealed segment's .idx, when there is one, must list exactly the records the scan found."""
    folder = Path(data_dir) / SEGMENTS_DIR
    scans: dict[int, SegmentScan] = {}
    for segno in list_segments(folder):
        path = segment_file(folder, segno)
        fd = os.open(path, os.O_RDONLY)
        try:
            scan = scan_segment(fd, segno, path, check_data=True)
            assert scan.torn == 0 and not scan.damaged and not scan.corrupt and not scan.header_error, scan
            if os.path.exists(index_file(folder, segno)):
                idx = load_index_file(fd, segno, path, index_file(folder, segno), verify=True)
                assert idx is not None, f"{index_file(folder, segno)} does not fit its segment"
                assert not idx.corrupt, idx.corrupt
                assert sorted(idx.puts, key=lambda r: r.off) == scan.puts and sorted(idx.tombs, key=lambda t: t.off) == scan.tombs, (
                    f"{index_file(folder, segno)} does not list the records of its segment"
                )
        finally:
            os.close(fd)
        scans[segno] = scan
    return scans


def assert_index_matches_segments(store: ChunkStore, scans: Mapping[int, SegmentScan]) -> None:
    """The store's in-memory index is exactly the live view of ``scans``, each chunk at the record the scan found."""
    view = resolve(dict(scans))
    ids = set(store.iter_ids())
    assert set(view.index) == ids, (
        f"index and segments differ: {len(ids - set(view.index))} indexed chunks have no live record, "
        f"{len(set(view.index) - ids)} live records are not indexed"
    )
    for cid, (segno, rec) in view.index.items():
        loc = store.locate(cid)
        assert loc is not None and (int(loc.path.stem), loc.record_offset) == (segno, rec.off), (cid, loc, segno, rec.off)


def check_stopped_store(data_dir: str | Path) -> int:
    """For a data dir no server runs on: scan it, open its store, check index against segments and
    that every chunk reads back verified (CRC32C and content id). Returns the number of chunks."""
    scans = scan_segments(data_dir)  # before the store opens (which would cut a torn tail)
    store = ChunkStore(data_dir, cache_bytes=0, fsync=False)
    try:
        assert not store.read_only, f"something still holds the store lock of {data_dir}"
        assert_index_matches_segments(store, scans)
        ids = list(store.iter_ids())
        for cid in ids:
            store.verify(cid)
        return len(ids)
    finally:
        store.close()


def as_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bit_exact(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], what: str = "") -> None:
    assert set(got) == set(want), f"{what}: tensors {sorted(set(got) ^ set(want))} differ"
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and tuple(g.shape) == tuple(t.shape), f"{what}: {name} is {g.dtype}{tuple(g.shape)}"
        assert as_bytes(g) == as_bytes(t), f"{what}: tensor {name} differs"


def chunks_of_server(address: str, token: str | None, ids: list[str]) -> tuple[dict[str, bytes], dict[str, str]]:
    """(stored bytes by id, error status by id) that one server returns for ``ids`` (gRPC GetChunks,
    partial): MISSING / CORRUPT come back as errors, never as bytes."""
    found: dict[str, bytes] = {}
    errors: dict[str, str] = {}
    with ParamServerClient(address, token=token) as client:
        for item in client.get_chunks_partial(ids):
            if isinstance(item, ChunkData):
                found[item.id] = bytes(item.data)
            else:
                errors[item.id] = pb.ChunkStatus.Name(item.status)
    return found, errors


def load_from_server(address: str, token: str | None, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The tensors of ``manifest`` rebuilt from one server's copies only (every chunk verified)."""
    ids = sorted({c.id for c in manifest.chunks})
    found, errors = chunks_of_server(address, token, ids)
    assert not errors, f"{address} cannot serve {len(errors)} chunks: {errors}"
    return unpack(manifest, found, threads=1)



def records(chunks: Iterable[tuple[str, bytes, str, int, int]]) -> list[ChunkRecord]:
    """``ChunkStore.put_many``'s records from the tests' ``(id, stored bytes, codec, raw_size, crc32c)`` tuples."""
    return [ChunkRecord(cid, codec, raw_size, crc, data) for cid, data, codec, raw_size, crc in chunks]
