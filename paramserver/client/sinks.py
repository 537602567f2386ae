"""Sinks of the fetch engine for host tensors: received straight into the tensors' bytes.

``TensorSink`` fills fresh tensors (a pull's, in recycled host arenas, or a ``.safetensors``
file's pages) through ``chunking.Assembler``: a raw chunk that fills one tensor region whole is
received there and verified in place; others are verified in a bounce buffer and copied. The
tensors reach the caller only once complete, so unverified bytes are never seen.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from chunking.assembler import Assembler
from chunking.hashing import Buffer
from chunking.manifest import ChunkRef, Manifest

Progress = Callable[[int], None]  # raw bytes landed so far


class TensorSink:
    def __init__(self, manifest: Manifest, targets: Mapping[str, torch.Tensor], *, on_bytes: Progress | None = None) -> None:
        self.assembler = Assembler(manifest, targets, private_targets=True)
        self.indices = self.assembler.indices_by_id
        self._on_bytes = on_bytes
        self._lock = threading.Lock()
        self.raw_done = 0

    def region(self, ref: ChunkRef) -> memoryview | None:
        return self.assembler.direct_view(self.indices[ref.id][0])

    def landed_in_place(self, chunks: Sequence[tuple[ChunkRef, memoryview]]) -> None:
        indices = self.indices
        for ref, _region in chunks:
            self.assembler.commit_direct(indices[ref.id][0])
        self._count(sum(ref.raw_size for ref, _ in chunks))

    def write(self, ref: ChunkRef, raw: Buffer) -> None:
        for index in self.indices[ref.id]:
            self.assembler.write_chunk(index, raw)
        self._count(ref.raw_size)

    def _count(self, n: int) -> None:
        with self._lock:
            self.raw_done += n
            done = self.raw_done
        if self._on_bytes is not None:
            self._on_bytes(done)


__all__ = ["TensorSink"]
