"""Write verified chunks straight into destination tensors and track which are complete."""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import numpy as np
import torch

from chunking.codec import as_u8, decode_chunk
from chunking.dtypes import torch_dtype
from chunking.errors import ChunkCorrupt, ChunkMissing, InvalidInput
from chunking.hashing import Buffer
from chunking.layout import Segment
from chunking.manifest import ChunkRef, Manifest


class Assembler:
    """Fills ``targets`` (name -> preallocated tensor) from a manifest's chunks.

    ``add_stored`` verifies a stored chunk and writes it; ``write_chunk`` writes
    raw bytes the caller has verified itself. Both may be called from several
    threads and in any order; a chunk id used at several indices fills all of
    them. A tensor is reported ready (``ready_tensors()``, ``on_tensor_ready``)
    only once every chunk it spans has been written; tensors without bytes
    (empty ones) are reported during construction. Bytes reach a target only
    after they are verified, so a corrupt chunk never overwrites live weights.
    Targets on CPU are written through numpy views; others (CUDA) through
    ``Tensor.copy_``. Extra names in ``targets`` are ignored.

    With ``private_targets=True`` the caller promises that nobody reads the targets until
    the assembler is done (a pull into fresh tensors). Then ``direct_view`` hands out the
    target region of a chunk that fills one CPU region whole, to receive it there without a
    bounce buffer; the caller verifies those bytes in place and calls ``commit_direct``.
    Bytes that fail verification stay there unseen until a good copy overwrites them.
    """

    def __init__(
        self,
        manifest: Manifest,
        targets: Mapping[str, torch.Tensor],
        *,
        on_tensor_ready: Callable[[str], None] | None = None,
        private_targets: bool = False,
    ) -> None:
        self.manifest = manifest
        self.private_targets = private_targets
        self._plan = manifest.plan
        self._on_ready = on_tensor_ready
        self._cpu: list[np.ndarray | None] = []
        self._dev: list[torch.Tensor | None] = []
        for entry in manifest.tensors:
            t = targets.get(entry.name)
            if t is None:
                raise InvalidInput(f"target has no tensor {entry.name!r}; pass one for every tensor of the manifest")
            want = torch_dtype(entry.dtype)
            if t.dtype != want or tuple(t.shape) != entry.shape:
                raise InvalidInput(
                    f"target tensor {entry.name!r} is {t.dtype} {tuple(t.shape)}; the manifest needs {want} {entry.shape}"
                )
            if not t.is_contiguous() or t.layout != torch.strided:
                raise InvalidInput(f"target tensor {entry.name!r} must be dense and contiguous to be filled in place")
            u8 = t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            if t.device.type == "cpu":
                self._cpu.append(u8.numpy())
                self._dev.append(None)
            else:
                self._cpu.append(None)
                self._dev.append(u8)
        # Per chunk: the CPU target it fills whole (received there directly), or -1.
        cpu_mask = np.array([c is not None for c in self._cpu] or [False], dtype=bool)
        whole = self._plan.whole
        self._whole_cpu = np.where((whole >= 0) & cpu_mask[np.maximum(whole, 0)], whole, -1)
        self._lock = threading.Lock()
        self._written = bytearray(self._plan.count)
        self._remaining = [len(c) for c in self._plan.tensor_chunks]
        self._missing = self._plan.count
        self._ready: list[str] = []
        for i, left in enumerate(self._remaining):
            if left == 0:
                self._mark_ready(manifest.tensors[i].name)

    # -- state -----------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._missing == 0

    def ready_tensors(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._ready)

    def missing_chunks(self) -> tuple[ChunkRef, ...]:
        return tuple(self.manifest.chunks.rows(np.flatnonzero(np.frombuffer(self._written, dtype=np.uint8) == 0)))

    def incomplete_tensors(self) -> tuple[str, ...]:
        return tuple(t.name for t, left in zip(self.manifest.tensors, self._remaining) if left)

    def raise_if_incomplete(self) -> None:
        if not self.done:
            missing = self.missing_chunks()
            raise ChunkMissing(sorted({r.id for r in missing}), self.incomplete_tensors())

    # -- writing ---------------------------------------------------------
    def add_stored(self, ref: ChunkRef, stored: Buffer) -> None:
        """Verify a stored chunk (CRC32C, size, content id) and write it wherever the manifest uses it."""
        mine = self._own_ref(ref)
        rows = self._rows(mine.index)
        indices = [i for i in rows if not self._written[i]]
        if not indices:
            return
        try:
            raw = decode_chunk(mine, stored, algorithm=self.manifest.hash_algorithm)
        except ChunkCorrupt as exc:
            names = {n: None for i in rows for n in self.manifest.tensors_of_chunk(i)}
            raise type(exc)(exc.chunk_id, exc.reason, tuple(names), mine.index) from None
        for i in indices:
            self.write_chunk(i, raw)

    def write_chunk(self, index: int, raw: Buffer | torch.Tensor) -> None:
        """Copy the raw bytes of chunk ``index`` (already verified) into its tensors.

        ``raw`` may be any buffer or a CPU tensor (e.g. a slice of a pinned staging pool).
        """
        src = raw.detach().reshape(-1).view(torch.uint8).numpy() if isinstance(raw, torch.Tensor) else as_u8(raw)
        segs = self._plan.segments[index]
        if len(src) != self._plan.raw_sizes[index]:
            raise ValueError(f"chunk #{index} is {len(src)} bytes; the manifest says {self._plan.raw_sizes[index]}")
        for s in segs:
            dst = self._cpu[s.tensor]
            if dst is not None:
                dst[s.tensor_offset : s.tensor_offset + s.length] = src[s.chunk_offset : s.chunk_offset + s.length]
            else:
                dev = self._dev[s.tensor]
                assert dev is not None
                piece = torch.from_numpy(src[s.chunk_offset : s.chunk_offset + s.length].copy())
                dev[s.tensor_offset : s.tensor_offset + s.length].copy_(piece)
        self._mark_written(index, segs)

    def _mark_written(self, index: int, segs: tuple[Segment, ...]) -> None:
        ready: list[str] = []
        with self._lock:
            if self._written[index]:
                return
            self._written[index] = 1
            self._missing -= 1
            for s in segs:
                self._remaining[s.tensor] -= 1
                if self._remaining[s.tensor] == 0:
                    ready.append(self.manifest.tensors[s.tensor].name)
        for name in ready:
            self._mark_ready(name)

    def _rows(self, index: int) -> tuple[int, ...]:
        """Every index of the manifest that holds the id of chunk ``index``."""
        table = self.manifest.chunks
        return table.rows_of(int(table.first_of[index]))

    def direct_views(self, indices: np.ndarray) -> list[memoryview | None]:
        """``direct_view`` of each index (chunks about to arrive together), worked out as arrays."""
        rows = np.asarray(indices, dtype=np.int64)
        if not self.private_targets:
            return [None] * len(rows)
        tensors = self._whole_cpu[rows]
        written = np.frombuffer(self._written, dtype=np.uint8)[rows]
        cpu, raw_sizes = self._cpu, self._plan.raw_sizes
        out: list[memoryview | None] = []
        for row, t, at, done in zip(rows.tolist(), tensors.tolist(), self._plan.whole_at[rows].tolist(), written.tolist()):
            if t < 0 or done:
                out.append(None)
                continue
            dst = cpu[t]
            assert dst is not None
            out.append(dst[at : at + raw_sizes[row]].data)
        return out

    def direct_view(self, index: int) -> memoryview | None:
        """The writable target bytes of chunk ``index`` when they are one whole CPU region, else None.

        Only with ``private_targets``, and only for a chunk not written yet: the caller fills
        the view, verifies it in place, then calls ``commit_direct(index)``.
        """
        return self.direct_views(np.array([index], dtype=np.int64))[0]

    def commit_direct_many(self, indices: np.ndarray) -> None:
        """Chunks received into ``direct_views`` of ``indices`` (first rows of their ids) and verified:
        mark them written, and fill the other places the manifest uses the same chunks."""
        rows = np.asarray(indices, dtype=np.int64)
        tensors = self._whole_cpu[rows]
        if not self.private_targets or (tensors < 0).any():
            bad = int(rows[tensors < 0][0]) if (tensors < 0).any() else int(rows[0])
            raise ValueError(f"chunk #{bad} has no direct view (not one whole CPU region, or the targets are not private)")
        repeats = self.manifest.chunks.repeats
        if repeats:
            for row, t, at in zip(rows.tolist(), tensors.tolist(), self._plan.whole_at[rows].tolist()):
                others = repeats.get(row)
                if others:
                    dst = self._cpu[t]
                    assert dst is not None
                    region = dst[at : at + self._plan.raw_sizes[row]]
                    for i in others[1:]:
                        if not self._written[i]:
                            self.write_chunk(i, region)
        ready: list[str] = []
        with self._lock:
            written = np.frombuffer(self._written, dtype=np.uint8)
            new = rows[written[rows] == 0]
            if len(new) > 1:
                new = np.unique(new)
            written[new] = 1
            self._missing -= len(new)
            counts = np.bincount(self._whole_cpu[new], minlength=len(self._remaining))
            for t in np.flatnonzero(counts).tolist():
                self._remaining[t] -= int(counts[t])
                if self._remaining[t] == 0:
                    ready.append(self.manifest.tensors[t].name)
        for name in ready:
            self._mark_ready(name)

    def commit_direct(self, index: int) -> None:
        """Chunk ``index`` was received into ``direct_view(index)`` and verified: mark it written,
        and fill the other places the manifest uses the same chunk."""
        if self._written[index]:
            raise ValueError(f"chunk #{index} has no direct view (written already)")
        self.commit_direct_many(np.array([index], dtype=np.int64))

    def _mark_ready(self, name: str) -> None:
        with self._lock:
            self._ready.append(name)
        if self._on_ready is not None:
            self._on_ready(name)

    def _own_ref(self, ref: ChunkRef) -> ChunkRef:
        # Trust only the manifest's sizes and checksums, never the source's copy of the ref.
        if 0 <= ref.index < len(self.manifest.chunks) and self.manifest.chunks.ids[ref.index] == ref.id:
            return self.manifest.chunks[ref.index]
        row = self.manifest.chunks.first_row_of.get(ref.id)
        if row is None:
            raise InvalidInput(f"chunk {ref.id} is not part of manifest {self.manifest.model} v{self.manifest.version}")
        return self.manifest.chunks[row]
