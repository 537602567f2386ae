"""Fake loads for the peer shelf and port tests: a manifest's chunk table and an arena its chunks land in."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunking.chunk_table import ChunkRef, ChunkTable
from chunking.hashing import content_id, crc32c
from worker.peer_shelf import LoadEntry, PeerShelf


@dataclass
class FakeManifest:
    id: str
    chunks: ChunkTable


def chunks(n: int, size: int = 1000, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def manifest_of(datas: list[bytes], name: str = "m") -> FakeManifest:
    refs = [ChunkRef(i, content_id(d), len(d), len(d), "raw", crc32c(d), 1, 0.0) for i, d in enumerate(datas)]
    return FakeManifest(content_id(name.encode()), ChunkTable.from_refs(refs))


class Arena:
    """A load's destination: one buffer, each row at its offset (what a real arena's locate gives)."""

    def __init__(self, datas: list[bytes]) -> None:
        self.offsets = np.concatenate([[0], np.cumsum([len(d) for d in datas])]).astype(int).tolist()
        self.buf = bytearray(self.offsets[-1])
        self.datas = datas

    def fill(self, row: int) -> None:
        self.buf[self.offsets[row] : self.offsets[row + 1]] = self.datas[row]

    def locate(self, row: int) -> memoryview | None:
        return memoryview(self.buf)[self.offsets[row] : self.offsets[row + 1]]

    def land(self, entry: LoadEntry, rows: list[int]) -> None:
        for row in rows:
            self.fill(row)
        entry.landed(np.array(rows, dtype=np.int64))


def loading(shelf: PeerShelf, datas: list[bytes], landed: list[int], name: str = "m") -> tuple[FakeManifest, Arena, LoadEntry]:
    """A load of ``datas`` on ``shelf`` with the rows ``landed`` already landed."""
    m, arena = manifest_of(datas, name), Arena(datas)
    entry = shelf.begin_load(m, arena.locate, 0.0)
    arena.land(entry, landed)
    return m, arena, entry
