"""Rebuild a model's tensors from its manifest and any source of stored chunks."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol, Union, runtime_checkable

import torch

from chunking.assembler import Assembler
from chunking.dtypes import torch_dtype
from chunking.errors import InvalidInput
from chunking.hashing import Buffer
from chunking.manifest import ChunkRef, Manifest
from chunking.parallel import chunks_per_block, default_threads, map_blocks

PARALLEL_MIN_BYTES = 16 << 20


@runtime_checkable
class ChunkSource(Protocol):
    """Anything that can deliver stored chunks: a store, a cache, a gRPC client.

    ``get_chunks`` may yield in any order and may skip chunks it does not
    have (unpack then reports them missing); a yielded buffer must not be
    reused or changed afterwards.
    """

    def get_chunks(self, refs: Sequence[ChunkRef]) -> Iterable[tuple[ChunkRef, Buffer]]: ...


AnySource = Union[ChunkSource, Mapping[str, Buffer]]


def iter_source(source: AnySource, refs: Sequence[ChunkRef]) -> Iterator[tuple[ChunkRef, Buffer]]:
    if isinstance(source, Mapping):
        for ref in refs:
            data = source.get(ref.id)
            if data is not None:
                yield ref, data
        return
    if isinstance(source, ChunkSource):
        yield from source.get_chunks(refs)
        return
    raise InvalidInput(f"{type(source).__name__} is not a chunk source: pass a mapping id -> bytes or an object with get_chunks()")


def empty_like_manifest(manifest: Manifest, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    return {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device) for t in manifest.tensors}


def unpack(
    manifest: Manifest,
    source: AnySource,
    *,
    target: Mapping[str, torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors of ``manifest`` (in manifest order), every byte verified.

    Each distinct chunk is requested once and written straight into the
    destination tensors. With ``target`` those tensors are validated and filled
    (``device`` is then ignored); otherwise new ones are made on CPU and moved
    to ``device`` at the end. Raises ChunkCorrupt or ChunkMissing.
    """
    tensors = dict(target) if target is not None else empty_like_manifest(manifest)
    assembler = Assembler(manifest, tensors)
    refs = manifest.unique_chunks()
    if threads is None:
        threads = default_threads() if manifest.raw_bytes >= PARALLEL_MIN_BYTES else 1

    def work(block: list[tuple[ChunkRef, Buffer]]) -> None:
        for ref, data in block:
            assembler.add_stored(ref, data)

    for _ in map_blocks(work, iter_source(source, refs), threads=threads, block=chunks_per_block(manifest.chunk_size)):
        pass
    assembler.raise_if_incomplete()
    out = {t.name: tensors[t.name] for t in manifest.tensors}
    if target is None and torch.device(device).type != "cpu":
        out = {k: v.to(device) for k, v in out.items()}
    return out
