"""The manifest's vocabulary: format numbers, field and key lists, the tensor and file entries, and
the checks and parsers of one field, row or key set that every byte form shares (``chunking.manifest``)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from chunking import manifest_split
from chunking.chunk_table import ChunkRef
from chunking.config import MAX_CHUNK_SIZE
from chunking.errors import ManifestError
from chunking.hashing import is_content_id

JSON_FORMAT = 1
BINARY_FORMAT = 2
SPLIT_FORMAT = 3
LAYOUT_SPLIT_FORMAT = 4
SPLIT_FORMATS = (SPLIT_FORMAT, LAYOUT_SPLIT_FORMAT)
FORMAT_VERSION = LAYOUT_SPLIT_FORMAT  # the newest; pack writes it from SPLIT_FROM_CHUNKS chunks up (written_format)
READABLE_FORMATS = (JSON_FORMAT, BINARY_FORMAT, SPLIT_FORMAT, LAYOUT_SPLIT_FORMAT)
TENSOR_FIELDS = ("name", "dtype", "shape", "offset", "nbytes")
CHUNK_FIELDS = ("id", "raw_size", "stored_size", "codec", "crc32c", "introduced_in", "created_at")
FILE_FIELDS = ("path", "size", "blake3", "chunks")
FILE_CHUNK_FIELDS = ("id", "raw_size", "stored_size", "codec", "crc32c")
MAX_PATH_BYTES = 1024
MAX_VERSION = (1 << 63) - 1  # introduced_in is a u64 column in format 2; a version number fits an int64
HEADER_KEYS = frozenset({"format_version", "model", "version", "chunk_size", "hash_algorithm", "fingerprint",
                         "tensor_fields", "tensors"})
BASE_KEYS = HEADER_KEYS | {"chunk_fields", "chunks"}  # format 1
BINARY_KEYS = HEADER_KEYS | {"chunk_count", "runs", "codecs"}  # format 2
SPLIT_KEYS = HEADER_KEYS | {"parts"}  # format 3's root
LAYOUT_KEYS = frozenset({"tensor_fields", "tensors"})  # format 4's layout blob (and the file and shard keys)
FILE_KEYS = frozenset({"file_fields", "file_chunk_fields", "files"})
SHARD_KEYS = frozenset({"weight_files", "tensor_file"})
SHARD_METADATA_KEY = "weight_file_metadata"  # optional beside SHARD_KEYS: each shard's safetensors __metadata__


def written_format(chunk_count: int) -> int:
    """The byte form pack gives a manifest of ``chunk_count`` chunks: split only where parts pay."""
    return LAYOUT_SPLIT_FORMAT if chunk_count >= manifest_split.SPLIT_FROM_CHUNKS else BINARY_FORMAT


def is_codec_name(name: str) -> bool:
    if name in ("raw", "zstd"):
        return True
    prefix = "zstd+shuffle"
    return isinstance(name, str) and name.startswith(prefix) and name[len(prefix):] in ("2", "4", "8", "16")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FileEntry:
    """A non-tensor file of a model folder: relative POSIX path, size, BLAKE3 of its bytes, and
    its chunks (``ChunkRef`` with ``index`` = position in the file, in order; they cover ``size``)."""

    path: str
    size: int
    blake3: str
    chunks: tuple[ChunkRef, ...]


def check_relative_path(path: str) -> str | None:
    """Why ``path`` is not a safe relative path inside a folder, or None when it is."""
    if not isinstance(path, str) or not path:
        return "is empty"
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"is longer than {MAX_PATH_BYTES} bytes"
    if path.startswith("/") or (len(path) >= 2 and path[1] == ":"):
        return "is absolute"
    if "\\" in path:
        return "has a backslash (use / between folders)"
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' component"
    if any(ord(ch) < 32 for ch in path):
        return "has a control character"
    return None


def fail(msg: str) -> ManifestError:
    return ManifestError(f"malformed manifest: {msg}. Fetch it again or re-push the model.")


def int_field(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise fail(f"{what} must be an integer >= {lo}, got {value!r}")
    return value


def unsupported(fmt: Any) -> ManifestError:
    return ManifestError(
        f"manifest format version {fmt!r} is not supported: this chunking library reads versions "
        f"{', '.join(map(str, READABLE_FORMATS))}. Upgrade the worker/server software to read it, or re-push the "
        "model with this version."
    )


def mismatch(expected_id: str) -> ManifestError:
    return ManifestError(
        f"manifest bytes do not match the id {expected_id}: they were corrupted or belong to another "
        "version. Fetch the manifest again from another server."
    )


def check_root_keys(root: manifest_split.Root) -> None:
    if root.layout is None:
        check_keys(set(root.doc), SPLIT_KEYS)
        return
    # Exactly these: the tensors, files and shards belong in the layout blob.
    expected = HEADER_KEYS - LAYOUT_KEYS | manifest_split.ROOT4_KEYS
    if set(root.doc) != expected:
        raise fail(f"format-4 root keys {sorted(set(root.doc) ^ expected)} are missing or unexpected")


def metadata_pairs(metadata: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """A safetensors ``__metadata__`` object as the manifest keeps it: sorted (key, value) pairs."""
    return tuple(sorted(metadata.items()))


def check_keys(keys: set[str], base: frozenset[str]) -> None:
    expected = set(base)
    if keys & FILE_KEYS:
        expected |= FILE_KEYS
    if keys & SHARD_KEYS:
        expected |= SHARD_KEYS
        if SHARD_METADATA_KEY in keys:
            expected.add(SHARD_METADATA_KEY)
    if keys != expected:
        raise fail(f"keys {sorted(keys ^ expected)} are missing or unexpected")


def chunk_span(tensors: tuple[TensorEntry, ...], chunk_size: int) -> int:
    end = max((t.offset + t.nbytes for t in tensors if t.nbytes), default=0)
    return -(-end // chunk_size)


def spans(tensors: tuple[TensorEntry, ...], chunk_size: int, count: int) -> bool:
    return chunk_span(tensors, chunk_size) == count


def tensor_from(item: Any, i: int) -> TensorEntry:
    if not isinstance(item, list) or len(item) != len(TENSOR_FIELDS):
        raise fail(f"tensor #{i} is not a {len(TENSOR_FIELDS)}-field list")
    name, dtype, shape, offset, nbytes = item
    if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, list):
        raise fail(f"tensor #{i} has a bad name, dtype or shape")
    dims = tuple(int_field(d, f"tensor {name!r} dimension") for d in shape)
    return TensorEntry(name, dtype, dims, int_field(offset, f"tensor {name!r} offset"), int_field(nbytes, f"tensor {name!r} nbytes"))


def chunk_from(item: Any, i: int) -> ChunkRef:
    if not isinstance(item, list) or len(item) != len(CHUNK_FIELDS):
        raise fail(f"chunk #{i} is not a {len(CHUNK_FIELDS)}-field list")
    cid, raw_size, stored_size, codec, crc, introduced_in, created_at = item
    if not is_content_id(cid):
        raise fail(f"chunk #{i} id {cid!r} is not a content id")
    if not is_codec_name(codec):
        raise fail(f"chunk #{i} codec {codec!r} is unknown")
    if not isinstance(created_at, (int, float)) or isinstance(created_at, bool):
        raise fail(f"chunk #{i} created_at is not a number")
    return ChunkRef(
        index=i,
        id=cid,
        raw_size=int_field(raw_size, f"chunk #{i} raw_size", 1, MAX_CHUNK_SIZE),
        stored_size=int_field(stored_size, f"chunk #{i} stored_size", 1, 0xFFFFFFFF),
        codec=codec,
        crc32c=int_field(crc, f"chunk #{i} crc32c", 0, 0xFFFFFFFF),
        introduced_in=int_field(introduced_in, f"chunk #{i} introduced_in", 0, MAX_VERSION),
        created_at=float(created_at),
    )


def file_from(item: Any, i: int) -> FileEntry:
    if not isinstance(item, list) or len(item) != len(FILE_FIELDS):
        raise fail(f"file #{i} is not a {len(FILE_FIELDS)}-field list")
    path, size, digest, chunks = item
    if not isinstance(path, str) or not isinstance(digest, str) or not isinstance(chunks, list):
        raise fail(f"file #{i} has a bad path, hash or chunk list")
    refs = []
    for k, c in enumerate(chunks):
        if not isinstance(c, list) or len(c) != len(FILE_CHUNK_FIELDS):
            raise fail(f"file {path!r} chunk #{k} is not a {len(FILE_CHUNK_FIELDS)}-field list")
        cid, raw_size, stored_size, codec, crc = c
        if not is_content_id(cid) or not is_codec_name(codec):
            raise fail(f"file {path!r} chunk #{k} has a bad id or codec")
        refs.append(ChunkRef(index=k, id=cid, raw_size=int_field(raw_size, f"file {path!r} chunk raw_size", 1),
                             stored_size=int_field(stored_size, f"file {path!r} chunk stored_size", 1), codec=codec,
                             crc32c=int_field(crc, f"file {path!r} chunk crc32c", 0, 0xFFFFFFFF), introduced_in=0, created_at=0.0))
    return FileEntry(path, int_field(size, f"file {path!r} size"), digest, tuple(refs))
