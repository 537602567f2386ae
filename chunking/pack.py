"""Pack a model into content-addressed chunks and a manifest.

``pack_stream`` hands out each block of chunks as soon as it is hashed (a push sends them
while later ones are still being hashed) and has the manifest at the end; ``pack`` runs it
to the end first. Chunk bytes can then be produced again by ``PackResult.chunks()`` from the
caller's tensors, so a raw-codec pack of a 1 GiB model holds no second copy. Compressed chunks
are kept from the first pass up to ``keep_stored_bytes`` and re-encoded on demand beyond that.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from chunking.codec import compress, encode_chunk, shuffle_width
from chunking.config import ChunkingConfig
from chunking.dtypes import dtype_name, element_size
from chunking.errors import ChunkingError, InvalidInput
from chunking.hashing import Buffer, bytes_like, content_id, crc32c
from chunking.layout import ChunkPlan, place_tensors, plan_chunks
from chunking.chunk_table import ChunkTable
from chunking.manifest import ChunkRef, Manifest, TensorEntry, written_format
from chunking.parallel import chunks_per_block, default_threads, map_blocks
from chunking.sources import Source, load_source

FINGERPRINT_DOMAIN = b"pdparams-fingerprint-v1\n"


@dataclass(frozen=True)
class Chunk:
    ref: ChunkRef
    data: bytes


def tensor_bytes(tensor: torch.Tensor, name: str = "") -> torch.Tensor:
    """The tensor's own bytes as a contiguous CPU uint8 tensor (a view when possible)."""
    if tensor.layout != torch.strided:
        raise InvalidInput(f"tensor {name!r} has layout {tensor.layout}; convert it to a dense tensor first")
    if tensor.is_quantized or tensor.device.type == "meta":
        raise InvalidInput(f"tensor {name!r} is quantized or on the meta device; it has no plain bytes to pack")
    dtype_name(tensor.dtype)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.numel() == 0:
        # Empty tensors may carry zero strides that refuse a dtype view; they have no bytes anyway.
        return torch.empty(0, dtype=torch.uint8)
    # A view into a larger (shared) storage is fine: only its own elements are read.
    return t.contiguous().reshape(-1).view(torch.uint8)


def fingerprint(tensors: tuple[TensorEntry, ...], chunk_ids: list[str], chunk_size: int, algorithm: str) -> str:
    """SHA-256 over structure and weights, derived from the chunk ids.

    The chunk ids (BLAKE3/SHA-256 of every raw byte) already commit to the
    weights, so the fingerprint covers them without hashing 1 GiB twice; it
    therefore also depends on chunk size and hash algorithm.
    """
    doc = {
        "chunk_size": chunk_size,
        "hash_algorithm": algorithm,
        "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in tensors],
        "chunks": chunk_ids,
    }
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(FINGERPRINT_DOMAIN + body).hexdigest()


class PackResult:
    """A packed model: its manifest and a lazy source of its stored chunks."""

    def __init__(self, manifest: Manifest, views: list[np.ndarray], plan: ChunkPlan, config: ChunkingConfig,
                 kept: dict[int, bytes]) -> None:
        self.manifest = manifest
        self.config = config
        self._views = views
        self._plan = plan
        self._kept = kept

    def raw_chunk(self, index: int) -> np.ndarray:
        """Raw bytes of chunk ``index``: a view into the tensor when the chunk lies inside one."""
        return gather(self._views, self._plan, index)

    def chunk(self, index: int) -> Chunk:
        """Stored bytes of chunk ``index``, checked against the manifest's CRC32C.

        The check catches weights changed in place after ``pack()`` (training
        continued, say), which would otherwise ship bytes that do not match
        their content id.
        """
        ref = self.manifest.chunks[index]
        kept = self._kept.get(index)
        if kept is not None:
            return Chunk(ref, kept)
        raw = self.raw_chunk(index)
        data = raw.tobytes() if ref.codec == "raw" else compress(raw, shuffle_width(ref.codec), self.config.zstd_level)
        if crc32c(data) != ref.crc32c:
            raise ChunkingError(
                f"chunk #{index} no longer matches the manifest: its tensors changed after pack(). "
                "Keep the weights unchanged until the push is done, or pack again"
            )
        return Chunk(ref, data)

    def chunks(self, ids: Collection[str] | None = None, *, unique: bool = False) -> Iterator[Chunk]:
        """Stored chunks in index order; only ``ids`` when given; each id once when ``unique``."""
        refs = self.manifest.unique_chunks() if unique else self.manifest.chunks
        for ref in refs:
            if ids is None or ref.id in ids:
                yield self.chunk(ref.index)

    def source(self) -> dict[str, bytes]:
        """All distinct stored chunks by id (convenient for tests and local round trips)."""
        return {c.ref.id: c.data for c in self.chunks(unique=True)}


def gather(views: list[np.ndarray], plan: ChunkPlan, index: int) -> np.ndarray:
    segs = plan.segments[index]
    size = plan.raw_sizes[index]
    if len(segs) == 1 and segs[0].length == size:
        s = segs[0]
        return views[s.tensor][s.tensor_offset : s.tensor_offset + size]
    buf = np.zeros(size, dtype=np.uint8)
    for s in segs:
        buf[s.chunk_offset : s.chunk_offset + s.length] = views[s.tensor][s.tensor_offset : s.tensor_offset + s.length]
    return buf


class PackStream:
    """A pack whose chunks come out while it runs: ``blocks()`` yields them in index order, block
    by block, as soon as they are hashed (and encoded); ``result()`` then has the manifest.

    This lets a push send the first chunk while later ones are still being hashed, and keeps only
    the blocks in flight in memory. A raw chunk that lies inside one tensor comes out as a view of
    that tensor's bytes (no copy); the caller must keep the weights unchanged until it is done.
    """

    def __init__(self, source: Source, *, model: str, version: int, config: ChunkingConfig, previous: Manifest | None,
                 created_at: float, threads: int | None, keep_stored_bytes: int) -> None:
        config.validate()
        if not isinstance(version, int) or version < 0:
            raise InvalidInput(f"version {version!r} must be a non-negative int")
        stamp = float(created_at)
        if not math.isfinite(stamp):
            raise InvalidInput(f"created_at {created_at!r} must be a finite timestamp")
        state = load_source(source)
        names = sorted(state)
        u8 = [tensor_bytes(state[n], n) for n in names]
        entries_wo_offset = [(n, dtype_name(state[n].dtype), tuple(int(d) for d in state[n].shape)) for n in names]
        sizes = [(v.numel(), state[n].dtype.itemsize) for n, v in zip(names, u8)]
        offsets = place_tensors(sizes, config.chunk_size)
        self.tensors = tuple(
            TensorEntry(name, dt, shape, off, nb) for (name, dt, shape), off, (nb, _) in zip(entries_wo_offset, offsets, sizes)
        )
        self.plan = plan_chunks([(t.offset, t.nbytes) for t in self.tensors], config.chunk_size)
        self.views = [v.numpy() for v in u8]
        self._elem_sizes = [element_size(t.dtype) for t in self.tensors]
        self.model, self.version, self.config, self.stamp = model, version, config, stamp
        self.threads = threads if threads is not None else (default_threads() if self.plan.count > 16 else 1)
        # A chunk the previous version has keeps when it came in, so the manifest rows (and parts)
        # of tensors a fine-tune left alone stay byte for byte the same.
        self._known = (dict(zip(previous.chunks.ids, zip(previous.chunks.introduced_in.tolist(),
                                                         previous.chunks.created_at.tolist())))
                       if previous is not None else {})
        self._keep_budget = keep_stored_bytes
        self._refs: list[ChunkRef] = []
        self._kept: dict[int, bytes] = {}
        self._done = False

    @property
    def chunk_count(self) -> int:
        return self.plan.count

    @property
    def raw_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def _chunk_elem(self, index: int) -> int:
        # Shuffle by the width of the tensor that fills most of the chunk.
        seg = max(self.plan.segments[index], key=lambda s: s.length)
        return self._elem_sizes[seg.tensor]

    def _work(self, indices: list[int]) -> list[tuple[str, str, int, int, Buffer]]:
        out = []
        for i in indices:
            raw = gather(self.views, self.plan, i)
            cid = content_id(raw, self.config.hash_algorithm)
            codec, stored = encode_chunk(raw, self.config, self._chunk_elem(i))
            out.append((cid, codec, memoryview(bytes_like(stored)).nbytes, crc32c(stored), stored))
        return out

    def blocks(self) -> Iterator[list[tuple[ChunkRef, Buffer]]]:
        """(ref, stored bytes) of every chunk in index order, a block at a time; once only."""
        if self._done or self._refs:
            raise ChunkingError("a PackStream's blocks can be read only once")
        block_size = chunks_per_block(self.config.chunk_size)
        # Results stream in index order, so compressed bytes beyond the budget are dropped as they arrive.
        for block in map_blocks(self._work, range(self.plan.count), threads=self.threads, block=block_size):
            out = []
            for cid, codec, stored_size, crc, data in block:
                i = len(self._refs)
                introduced, created = self._known.get(cid, (self.version, self.stamp))
                ref = ChunkRef(i, cid, self.plan.raw_sizes[i], stored_size, codec, crc, introduced, created)
                self._refs.append(ref)
                if codec != "raw" and stored_size <= self._keep_budget:
                    self._kept[i] = bytes(data)
                    self._keep_budget -= stored_size
                out.append((ref, data))
            yield out
        self._done = True

    def result(self) -> PackResult:
        """The finished pack (manifest and random access to chunks); after ``blocks()`` ran out."""
        if not self._done:
            if self._refs:
                raise ChunkingError("PackStream.result() before its blocks were all read")
            for _ in self.blocks():
                pass
        refs = self._refs
        manifest = Manifest(
            model=self.model,
            version=self.version,
            chunk_size=self.config.chunk_size,
            format_version=written_format(len(refs)),
            tensors=self.tensors,
            chunks=ChunkTable.from_refs(refs),
            fingerprint=fingerprint(self.tensors, [r.id for r in refs], self.config.chunk_size, self.config.hash_algorithm),
            hash_algorithm=self.config.hash_algorithm,
        )
        return PackResult(manifest, self.views, self.plan, self.config, self._kept)


def pack_stream(
    source: Source,
    *,
    model: str,
    version: int = 1,
    config: ChunkingConfig = ChunkingConfig(),
    previous: Manifest | None = None,
    created_at: float = 0.0,
    threads: int | None = None,
    keep_stored_bytes: int = 0,
) -> PackStream:
    """Like :func:`pack`, but chunks come out while it runs (``PackStream.blocks()``)."""
    return PackStream(source, model=model, version=version, config=config, previous=previous, created_at=created_at,
                      threads=threads, keep_stored_bytes=keep_stored_bytes)


def pack(
    source: Source,
    *,
    model: str,
    version: int = 1,
    config: ChunkingConfig = ChunkingConfig(),
    previous: Manifest | None = None,
    created_at: float = 0.0,
    threads: int | None = None,
    keep_stored_bytes: int = 512 << 20,
) -> PackResult:
    """Cut ``source`` into chunks and describe them in a manifest.

    Tensors are laid out sorted by name (code point order), so the same weights
    give the same manifest whatever the dict order or file format. Chunks whose
    id ``previous`` already names keep its ``introduced_in`` and ``created_at``.
    """
    stream = pack_stream(source, model=model, version=version, config=config, previous=previous, created_at=created_at,
                         threads=threads, keep_stored_bytes=keep_stored_bytes)
    for _ in stream.blocks():
        pass
    return stream.result()
