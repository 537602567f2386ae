"""Sinks of the fetch engine for host tensors: received straight into the tensors' bytes.

``TensorSink`` fills fresh tensors (a pull's, in recycled host arenas, or a ``.safetensors``
file's pages) through ``chunking.Assembler``: a raw chunk that fills one tensor region whole is
received there and verified in place; others are verified in a bounce buffer and copied. The
tensors reach the caller only once complete, so unverified bytes are never seen.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from chunking.assembler import Assembler
from chunking.hashing import Buffer
from chunking.manifest import Manifest

Progress = Callable[[int], None]  # raw bytes landed so far


class TensorSink:
    def __init__(self, manifest: Manifest, targets: Mapping[str, torch.Tensor], *, on_bytes: Progress | None = None) -> None:
        self.assembler = Assembler(manifest, targets, private_targets=True)
        self._table = manifest.chunks
        self._on_bytes = on_bytes
        self._lock = threading.Lock()
        self.raw_done = 0

    def regions(self, rows: np.ndarray) -> Sequence[memoryview | None]:
        return self.assembler.direct_views(rows)

    def landed_in_place(self, rows: np.ndarray, source: str = "network") -> None:
        self.assembler.commit_direct_many(rows)
        self._count(int(self._table.raw_size[rows].sum()))

    def write(self, row: int, raw: Buffer, source: str = "network") -> None:
        for index in self._table.rows_of(row):
            self.assembler.write_chunk(index, raw)
        self._count(int(self._table.raw_size[row]))

    def _count(self, n: int) -> None:
        with self._lock:
            self.raw_done += n
            done = self.raw_done
        if self._on_bytes is not None:
            self._on_bytes(done)


__all__ = ["TensorSink"]
