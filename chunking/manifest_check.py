"""The consistency checks of a whole manifest: tensors, byte ranges and chunks agree, and a model folder's
files and shards are sound. ``Manifest.check`` runs them on every manifest built or parsed."""
from __future__ import annotations

import numpy as np

from chunking.chunk_table import ChunkTable
from chunking.dtypes import DTYPES, element_size
from chunking.hashing import is_content_id
from chunking.layout import chunk_raw_sizes
from chunking.manifest_fields import (SHARD_METADATA_KEY, FileEntry, TensorEntry, check_relative_path, chunk_span, fail,
                                  spans)


def check_chunks(chunk_size: int, tensors: tuple[TensorEntry, ...], table: ChunkTable, fingerprint: str) -> None:
    """Raise ManifestError unless tensors, byte ranges and chunks agree."""
    cs = chunk_size
    if cs & (cs - 1):
        raise fail(f"chunk_size {cs} is not a power of two")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise fail("tensor names repeat")
    for t in tensors:
        if t.dtype not in DTYPES:
            raise fail(f"tensor {t.name!r} has unknown dtype {t.dtype!r}")
        if t.nbytes != t.numel * element_size(t.dtype):
            raise fail(f"tensor {t.name!r}: nbytes {t.nbytes} does not match shape {t.shape} x {t.dtype}")
    if not spans(tensors, cs, len(table)):
        # Checked before the layout so a forged huge offset cannot make us allocate a huge array.
        raise fail(f"{len(table)} chunks listed but the tensors span {chunk_span(tensors, cs)}")
    try:
        sizes = chunk_raw_sizes([(t.offset, t.nbytes) for t in tensors], cs)
    except ValueError as exc:
        raise fail(str(exc)) from None
    bad = np.flatnonzero(table.raw_size != sizes)
    if len(bad):
        i = int(bad[0])
        raise fail(f"chunk #{i} raw_size {int(table.raw_size[i])} differs from the layout's {int(sizes[i])}")
    for k, codec in enumerate(table.codecs):
        rows = np.flatnonzero(table.codec_index == k)
        if codec.startswith("zstd+shuffle"):
            bad = rows[table.raw_size[rows] % int(codec[len("zstd+shuffle"):]) != 0]
            if len(bad):
                raise fail(f"chunk #{int(bad[0])} shuffle width does not divide its raw size")
        if codec == "raw":
            bad = rows[table.stored_size[rows] != table.raw_size[rows]]
            if len(bad):
                i = int(bad[0])
                raise fail(f"raw chunk #{i} has stored_size {int(table.stored_size[i])} != raw_size {int(table.raw_size[i])}")
    if len(table) and (int(table.stored_size.min()) < 1 or int(table.introduced_in.min()) < 0):
        raise fail("a chunk has stored_size 0 or a negative introduced_in")
    if not is_content_id(fingerprint):
        raise fail("fingerprint is not 64 hex digits")


def check_folder(chunk_size: int, n_tensors: int, files: tuple[FileEntry, ...], weight_files: tuple[str, ...],
                 tensor_file: tuple[int, ...], weight_file_metadata: tuple[tuple[tuple[str, str], ...], ...]) -> None:
    """Raise ManifestError unless a model folder's files and shards are sound."""
    paths = [f.path for f in files] + list(weight_files)
    for path in paths:
        why = check_relative_path(path)
        if why is not None:
            raise fail(f"file path {path!r} {why}")
    if len(set(paths)) != len(paths):
        raise fail("file paths repeat")
    if weight_files and len(tensor_file) != n_tensors:
        raise fail(f"tensor_file has {len(tensor_file)} entries for {n_tensors} tensors")
    if tensor_file and not weight_files:
        raise fail("tensor_file without weight_files")
    if weight_file_metadata and len(weight_file_metadata) != len(weight_files):
        raise fail(f"{SHARD_METADATA_KEY} has {len(weight_file_metadata)} entries for {len(weight_files)} weight files")
    if any(list(pairs) != sorted(dict(pairs).items()) for pairs in weight_file_metadata):
        raise fail(f"{SHARD_METADATA_KEY} entries must be sorted pairs of distinct keys")
    if any(not p.endswith(".safetensors") for p in weight_files):
        raise fail("weight_files must be .safetensors paths")
    for f in files:
        if not is_content_id(f.blake3):
            raise fail(f"file {f.path!r} hash is not 64 hex digits")
        if sum(c.raw_size for c in f.chunks) != f.size or (f.size and not f.chunks):
            raise fail(f"file {f.path!r}: its chunks do not add up to its size {f.size}")
        for k, c in enumerate(f.chunks):
            if c.index != k or c.raw_size > chunk_size:
                raise fail(f"file {f.path!r} chunk #{k} is out of order or larger than the chunk size")
            if c.codec == "raw" and c.stored_size != c.raw_size:
                raise fail(f"file {f.path!r} raw chunk #{k} has stored_size {c.stored_size} != raw_size {c.raw_size}")
