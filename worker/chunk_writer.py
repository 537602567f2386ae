"""``ChunkWriter``: verified raw chunk bytes into the destination tensors of one manifest.

On CPU one copy from the received (or cached) bytes into the tensor's memory; on CUDA through the
reused pinned staging pool and a ``non_blocking`` copy on a side stream (``worker.staging``).
``region()`` says where a chunk that fills one CPU tensor region whole lies, so the fetch can
receive it there (and the memory tier and the peer shelf can serve it from there).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from chunking.codec import as_u8
from chunking.hashing import Buffer
from chunking.manifest import Manifest
from paramserver.client.hostmem import ArenaView
from worker.config import PrefetchConfig
from worker.readiness import TensorReadiness
from worker.staging import COMPLETED, Copier, StagingPool, byte_view
from worker.tiered_cache import Locate


class ChunkWriter:
    """Writes verified raw chunk bytes into the destination tensors of one manifest. Thread-safe."""

    def __init__(self, manifest: Manifest, targets: Mapping[str, torch.Tensor], readiness: TensorReadiness,
                 config: PrefetchConfig, pool: StagingPool | None = None, arena: ArenaView | None = None) -> None:
        """``arena``: where the CPU targets lie in one host arena (``arena_locate`` then slices it)."""
        self.manifest = manifest
        self.arena = arena
        self.readiness = readiness
        self.config = config
        self._plan = manifest.plan
        self._cpu: list[np.ndarray | None] = []
        self._dev: list[torch.Tensor | None] = []
        cuda = False
        for entry in manifest.tensors:
            u8 = byte_view(targets[entry.name].detach())
            if u8.device.type == "cpu":
                self._cpu.append(u8.numpy())
                self._dev.append(None)
            else:
                cuda = True
                self._cpu.append(None)
                self._dev.append(u8)
        self.whole = self._whole_chunks()
        self._whole: list[int] = self.whole.tolist()  # region() reads one entry per chunk: a list is faster
        # With an arena, each whole chunk's place in it, worked out for all chunks at once: region()
        # is then one slice (it is asked for every chunk received, half a million of 4 KiB).
        # ``arena_locate(index)``: that slice, or None. A function holding the arena's view and the
        # offsets, not this writer (so not the tensors): the memory tier keeps it after the load.
        self.arena_locate: Locate | None = None
        self.arena_at: np.ndarray | None = None  # per row: where its bytes start in the arena, or -1
        if arena is not None:
            base = np.array([arena.offsets.get(e.name, -1) for e in manifest.tensors] or [-1], dtype=np.int64)
            t = np.maximum(self.whole, 0)
            at = base[t] + self._plan.whole_at
            at[(self.whole < 0) | (base[t] < 0)] = -1
            self.arena_at = at
            self.arena_locate = _slicer(arena.view, at.tolist(), list(self._plan.raw_sizes))
        self.pool = pool
        self.copier: Copier | None = None
        if cuda:
            device = next(t.device for t in self._dev if t is not None)
            self.pool = pool or StagingPool.from_config(config)
            self.copier = Copier(device)

    def write(self, index: int, raw: Buffer) -> None:
        src = as_u8(raw)
        if len(src) != self._plan.raw_sizes[index]:
            raise ValueError(f"chunk #{index} is {len(src)} bytes; the manifest says {self._plan.raw_sizes[index]}")
        segs = self._plan.segments[index]
        fence = COMPLETED
        if self.copier is not None and any(self._dev[s.tensor] is not None for s in segs):
            assert self.pool is not None
            buf = self.pool.acquire(self.config.acquire_timeout_s)
            try:
                buf.write(0, src)
            except BaseException:
                buf.release()
                raise
            copies = []
            for s in segs:
                dev = self._dev[s.tensor]
                if dev is not None:
                    copies.append((s.chunk_offset, dev[s.tensor_offset : s.tensor_offset + s.length]))
                else:
                    cpu = self._cpu[s.tensor]
                    assert cpu is not None
                    cpu[s.tensor_offset : s.tensor_offset + s.length] = src[s.chunk_offset : s.chunk_offset + s.length]
            fence = self.copier.copy_from(buf, copies)
        else:
            for s in segs:
                cpu = self._cpu[s.tensor]
                assert cpu is not None
                cpu[s.tensor_offset : s.tensor_offset + s.length] = src[s.chunk_offset : s.chunk_offset + s.length]
        self.readiness.mark_landed(index, fence)

    def _span(self, index: int) -> tuple[int, int, int] | None:
        """(tensor, start, stop) of the tensor bytes chunk ``index`` fills when they are one whole region."""
        t = self._whole[index]
        if t < 0:
            return None
        start = int(self._plan.whole_at[index])
        return t, start, start + self._plan.raw_sizes[index]

    def region(self, index: int) -> memoryview | None:
        """The CPU tensor bytes chunk ``index`` fills when they are one whole region, else None
        (with an arena: as a slice of the arena's view, ``arena_locate``)."""
        if self.arena_locate is not None:
            view = self.arena_locate(index)
            if view is not None:
                return view
        span = self._span(index)
        if span is None:
            return None
        t, start, stop = span
        cpu = self._cpu[t]
        if cpu is None:  # released (release_targets): a late reader (the peer shelf) gets nothing, not the old bytes
            return None
        return cpu[start:stop].data

    def _whole_chunks(self) -> np.ndarray:
        """Per chunk: the CPU tensor whose bytes it is exactly (``ChunkPlan.whole``), or -1."""
        cpu = np.array([c is not None for c in self._cpu] or [False], dtype=bool)
        whole = self._plan.whole
        return np.where((whole >= 0) & cpu[np.maximum(whole, 0)], whole, -1)

    def synchronize(self) -> None:
        if self.copier is not None:
            self.copier.synchronize()

    def release_targets(self) -> None:
        """Forget the targets (their numpy views keep the memory in use); the writer is done."""
        self._cpu = [None] * len(self._cpu)
        self._dev = [None] * len(self._dev)


def _slicer(view: memoryview, offsets: list[int], sizes: list[int]) -> Locate:
    def locate(index: int) -> memoryview | None:
        at = offsets[index]
        return view[at : at + sizes[index]] if at >= 0 else None

    return locate


__all__ = ["ChunkWriter"]
