"""The manifest: what a model version is made of, serialised canonically.

The byte form is compact JSON with sorted keys and UTF-8 text; the same
manifest gives the same bytes in any process, so its content id names it.
Tensors and chunks are stored as arrays (fields in ``TENSOR_FIELDS`` and
``CHUNK_FIELDS`` order) to keep a 1 GiB model's manifest small.

A model folder (``chunking.folder``) adds two optional parts, written only when present so a
plain weights file's manifest keeps its bytes and id: ``files``, the non-tensor files (config,
tokenizer, ...) with their relative path, size, BLAKE3 and chunks of their own; and
``weight_files`` with ``tensor_file``, the safetensors shard each tensor came from, so a pull
writes the shards (and the index that names them) back.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from chunking.config import HASH_ALGORITHMS, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from chunking.dtypes import DTYPES, element_size
from chunking.errors import ManifestError
from chunking.hashing import content_id, is_content_id
from chunking.layout import ChunkPlan, plan_chunks

FORMAT_VERSION = 1
TENSOR_FIELDS = ("name", "dtype", "shape", "offset", "nbytes")
CHUNK_FIELDS = ("id", "raw_size", "stored_size", "codec", "crc32c", "introduced_in", "created_at")
FILE_FIELDS = ("path", "size", "blake3", "chunks")
FILE_CHUNK_FIELDS = ("id", "raw_size", "stored_size", "codec", "crc32c")
MAX_PATH_BYTES = 1024
BASE_KEYS = frozenset({"format_version", "model", "version", "chunk_size", "hash_algorithm", "fingerprint",
                       "tensor_fields", "tensors", "chunk_fields", "chunks"})
FILE_KEYS = frozenset({"file_fields", "file_chunk_fields", "files"})
SHARD_KEYS = frozenset({"weight_files", "tensor_file"})


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
class ChunkRef:
    index: int
    id: str
    raw_size: int
    stored_size: int
    codec: str
    crc32c: int
    introduced_in: int
    created_at: float

    def __post_init__(self) -> None:
        # JSON writes 0 and 0.0 differently; always a float keeps the bytes canonical.
        object.__setattr__(self, "created_at", float(self.created_at))


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


def _fail(msg: str) -> ManifestError:
    return ManifestError(f"malformed manifest: {msg}. Fetch it again or re-push the model.")


def _int(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise _fail(f"{what} must be an integer >= {lo}, got {value!r}")
    return value


@dataclass(frozen=True)
class Manifest:
    model: str
    version: int
    chunk_size: int
    format_version: int
    tensors: tuple[TensorEntry, ...]
    chunks: tuple[ChunkRef, ...]
    fingerprint: str
    hash_algorithm: str = "blake3"
    files: tuple[FileEntry, ...] = ()
    weight_files: tuple[str, ...] = ()  # safetensors shards of a model folder, in order
    tensor_file: tuple[int, ...] = ()  # per tensor: its index in weight_files

    # -- serialisation ---------------------------------------------------
    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format_version": self.format_version,
            "model": self.model,
            "version": self.version,
            "chunk_size": self.chunk_size,
            "hash_algorithm": self.hash_algorithm,
            "fingerprint": self.fingerprint,
            "tensor_fields": list(TENSOR_FIELDS),
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors],
            "chunk_fields": list(CHUNK_FIELDS),
            "chunks": [
                [c.id, c.raw_size, c.stored_size, c.codec, c.crc32c, c.introduced_in, c.created_at]
                for c in self.chunks
            ],
        }
        if self.files:
            doc["file_fields"] = list(FILE_FIELDS)
            doc["file_chunk_fields"] = list(FILE_CHUNK_FIELDS)
            doc["files"] = [
                [f.path, f.size, f.blake3, [[c.id, c.raw_size, c.stored_size, c.codec, c.crc32c] for c in f.chunks]]
                for f in self.files
            ]
        if self.weight_files:
            doc["weight_files"] = list(self.weight_files)
            doc["tensor_file"] = list(self.tensor_file)
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, expected_id: str | None = None) -> Manifest:
        """Parse and validate manifest bytes; refuse unknown format versions and id mismatches."""
        raw = bytes(data)
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise _fail(f"not UTF-8 JSON ({exc}); the bytes may be truncated") from None
        if not isinstance(doc, dict):
            raise _fail("top level is not an object")
        fmt = doc.get("format_version")
        if fmt != FORMAT_VERSION:
            raise ManifestError(
                f"manifest format version {fmt!r} is not supported: this chunking library reads version "
                f"{FORMAT_VERSION}. Upgrade the worker/server software to read it, or re-push the model with this version."
            )
        algorithm = doc.get("hash_algorithm")
        if algorithm not in HASH_ALGORITHMS:
            raise _fail(f"hash_algorithm {algorithm!r} is unknown")
        if expected_id is not None and content_id(raw, algorithm) != expected_id:
            raise ManifestError(
                f"manifest bytes do not match the id {expected_id}: they were corrupted or belong to another "
                "version. Fetch the manifest again from another server."
            )
        manifest = cls._from_doc(doc)
        if manifest.to_bytes() != raw:
            raise _fail("bytes are not in canonical form (re-serialised bytes differ), so its id would not be stable")
        return manifest

    @classmethod
    def _from_doc(cls, doc: dict[str, Any]) -> Manifest:
        keys = set(doc)
        expected_keys = set(BASE_KEYS)
        if keys & FILE_KEYS:
            expected_keys |= FILE_KEYS
        if keys & SHARD_KEYS:
            expected_keys |= SHARD_KEYS
        if keys != expected_keys:
            raise _fail(f"keys {sorted(keys ^ expected_keys)} are missing or unexpected")
        if "files" in doc and (doc["file_fields"] != list(FILE_FIELDS) or doc["file_chunk_fields"] != list(FILE_CHUNK_FIELDS)):
            raise _fail("file field lists differ from this format version")
        if doc["tensor_fields"] != list(TENSOR_FIELDS) or doc["chunk_fields"] != list(CHUNK_FIELDS):
            raise _fail("field lists differ from this format version")
        if not isinstance(doc["model"], str) or not isinstance(doc["fingerprint"], str):
            raise _fail("model and fingerprint must be strings")
        if not isinstance(doc["tensors"], list) or not isinstance(doc["chunks"], list):
            raise _fail("tensors and chunks must be lists")
        tensors = tuple(_tensor_from(item, i) for i, item in enumerate(doc["tensors"]))
        chunks = tuple(_chunk_from(item, i) for i, item in enumerate(doc["chunks"]))
        files: tuple[FileEntry, ...] = ()
        if "files" in doc:
            if not isinstance(doc["files"], list) or not doc["files"]:
                raise _fail("files must be a non-empty list when present")
            files = tuple(_file_from(item, i) for i, item in enumerate(doc["files"]))
        weight_files: tuple[str, ...] = ()
        tensor_file: tuple[int, ...] = ()
        if "weight_files" in doc:
            wf, tf = doc["weight_files"], doc["tensor_file"]
            if not isinstance(wf, list) or not wf or not all(isinstance(p, str) for p in wf) or not isinstance(tf, list):
                raise _fail("weight_files must be a non-empty list of paths and tensor_file a list")
            weight_files = tuple(wf)
            tensor_file = tuple(_int(x, "tensor_file entry", 0, len(wf) - 1) for x in tf)
        manifest = cls(
            model=doc["model"],
            version=_int(doc["version"], "version"),
            chunk_size=_int(doc["chunk_size"], "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE),
            format_version=FORMAT_VERSION,
            tensors=tensors,
            chunks=chunks,
            fingerprint=doc["fingerprint"],
            hash_algorithm=doc["hash_algorithm"],
            files=files,
            weight_files=weight_files,
            tensor_file=tensor_file,
        )
        manifest.check()
        return manifest

    def check(self) -> None:
        """Raise ManifestError unless tensors, byte ranges and chunks agree."""
        cs = self.chunk_size
        if cs & (cs - 1):
            raise _fail(f"chunk_size {cs} is not a power of two")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise _fail("tensor names repeat")
        for t in self.tensors:
            if t.dtype not in DTYPES:
                raise _fail(f"tensor {t.name!r} has unknown dtype {t.dtype!r}")
            if t.nbytes != t.numel * element_size(t.dtype):
                raise _fail(f"tensor {t.name!r}: nbytes {t.nbytes} does not match shape {t.shape} x {t.dtype}")
        end = max((t.offset + t.nbytes for t in self.tensors if t.nbytes), default=0)
        if -(-end // cs) != len(self.chunks):
            # Checked before planning so a forged huge offset cannot make us allocate a huge plan.
            raise _fail(f"{len(self.chunks)} chunks listed but the tensors span {-(-end // cs)}")
        try:
            plan = self.plan
        except ValueError as exc:
            raise _fail(str(exc)) from None
        if len(self.chunks) != plan.count:
            raise _fail(f"{len(self.chunks)} chunks listed but the tensors span {plan.count}")
        for i, (ref, size) in enumerate(zip(self.chunks, plan.raw_sizes)):
            if ref.index != i:
                raise _fail(f"chunk at position {i} says index {ref.index}")
            if ref.raw_size != size:
                raise _fail(f"chunk #{ref.index} raw_size {ref.raw_size} differs from the layout's {size}")
            if ref.codec.startswith("zstd+shuffle") and ref.raw_size % int(ref.codec[len("zstd+shuffle"):]):
                raise _fail(f"chunk #{ref.index} shuffle width does not divide its raw size")
            if ref.codec == "raw" and ref.stored_size != ref.raw_size:
                raise _fail(f"raw chunk #{ref.index} has stored_size {ref.stored_size} != raw_size {ref.raw_size}")
        if not is_content_id(self.fingerprint):
            raise _fail("fingerprint is not 64 hex digits")
        self._check_folder()

    def _check_folder(self) -> None:
        paths = [f.path for f in self.files] + list(self.weight_files)
        for path in paths:
            why = check_relative_path(path)
            if why is not None:
                raise _fail(f"file path {path!r} {why}")
        if len(set(paths)) != len(paths):
            raise _fail("file paths repeat")
        if self.weight_files and len(self.tensor_file) != len(self.tensors):
            raise _fail(f"tensor_file has {len(self.tensor_file)} entries for {len(self.tensors)} tensors")
        if self.tensor_file and not self.weight_files:
            raise _fail("tensor_file without weight_files")
        if any(not p.endswith(".safetensors") for p in self.weight_files):
            raise _fail("weight_files must be .safetensors paths")
        for f in self.files:
            if not is_content_id(f.blake3):
                raise _fail(f"file {f.path!r} hash is not 64 hex digits")
            if sum(c.raw_size for c in f.chunks) != f.size or (f.size and not f.chunks):
                raise _fail(f"file {f.path!r}: its chunks do not add up to its size {f.size}")
            for k, c in enumerate(f.chunks):
                if c.index != k or c.raw_size > self.chunk_size:
                    raise _fail(f"file {f.path!r} chunk #{k} is out of order or larger than the chunk size")
                if c.codec == "raw" and c.stored_size != c.raw_size:
                    raise _fail(f"file {f.path!r} raw chunk #{k} has stored_size {c.stored_size} != raw_size {c.raw_size}")

    # -- derived views ---------------------------------------------------
    @property
    def id(self) -> str:
        return content_id(self.to_bytes(), self.hash_algorithm)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (without alignment gaps)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def raw_bytes(self) -> int:
        return sum(c.raw_size for c in self.chunks)

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_size for c in self.chunks)

    def chunk_ids(self) -> tuple[str, ...]:
        """Chunk ids in index order (an id repeats when two chunks hold equal bytes)."""
        return tuple(c.id for c in self.chunks)

    def file_chunks(self) -> tuple[ChunkRef, ...]:
        """One ref per distinct chunk id of the non-tensor files, first occurrence first."""
        seen: dict[str, ChunkRef] = {}
        for f in self.files:
            for c in f.chunks:
                seen.setdefault(c.id, c)
        return tuple(seen.values())

    def all_chunk_ids(self) -> frozenset[str]:
        """Every chunk id the version needs: its tensors' and its files' (what GC must keep)."""
        return frozenset(c.id for c in self.chunks) | frozenset(c.id for f in self.files for c in f.chunks)

    def file(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    def unique_chunks(self) -> tuple[ChunkRef, ...]:
        """One ref per distinct chunk id, first occurrence first."""
        seen: dict[str, ChunkRef] = {}
        for c in self.chunks:
            seen.setdefault(c.id, c)
        return tuple(seen.values())

    @cached_property
    def plan(self) -> ChunkPlan:
        return plan_chunks([(t.offset, t.nbytes) for t in self.tensors], self.chunk_size)

    def tensors_of_chunk(self, index: int) -> tuple[str, ...]:
        return tuple(self.tensors[s.tensor].name for s in self.plan.segments[index])

    def chunks_of_tensor(self, name: str) -> tuple[int, ...]:
        return self.plan.tensor_chunks[self.tensor_index[name]]

    @cached_property
    def tensor_index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tensors)}

    def with_version(self, version: int) -> Manifest:
        """A copy for version slot ``version``; chunks this version introduced are re-stamped."""
        chunks = tuple(
            dataclasses.replace(c, introduced_in=version) if c.introduced_in == self.version else c
            for c in self.chunks
        )
        return dataclasses.replace(self, version=version, chunks=chunks)


def _tensor_from(item: Any, i: int) -> TensorEntry:
    if not isinstance(item, list) or len(item) != len(TENSOR_FIELDS):
        raise _fail(f"tensor #{i} is not a {len(TENSOR_FIELDS)}-field list")
    name, dtype, shape, offset, nbytes = item
    if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, list):
        raise _fail(f"tensor #{i} has a bad name, dtype or shape")
    dims = tuple(_int(d, f"tensor {name!r} dimension") for d in shape)
    return TensorEntry(name, dtype, dims, _int(offset, f"tensor {name!r} offset"), _int(nbytes, f"tensor {name!r} nbytes"))


def _chunk_from(item: Any, i: int) -> ChunkRef:
    if not isinstance(item, list) or len(item) != len(CHUNK_FIELDS):
        raise _fail(f"chunk #{i} is not a {len(CHUNK_FIELDS)}-field list")
    cid, raw_size, stored_size, codec, crc, introduced_in, created_at = item
    if not is_content_id(cid):
        raise _fail(f"chunk #{i} id {cid!r} is not a content id")
    if not is_codec_name(codec):
        raise _fail(f"chunk #{i} codec {codec!r} is unknown")
    if not isinstance(created_at, (int, float)) or isinstance(created_at, bool):
        raise _fail(f"chunk #{i} created_at is not a number")
    return ChunkRef(
        index=i,
        id=cid,
        raw_size=_int(raw_size, f"chunk #{i} raw_size", 1),
        stored_size=_int(stored_size, f"chunk #{i} stored_size", 1),
        codec=codec,
        crc32c=_int(crc, f"chunk #{i} crc32c", 0, 0xFFFFFFFF),
        introduced_in=_int(introduced_in, f"chunk #{i} introduced_in"),
        created_at=float(created_at),
    )


def _file_from(item: Any, i: int) -> FileEntry:
    if not isinstance(item, list) or len(item) != len(FILE_FIELDS):
        raise _fail(f"file #{i} is not a {len(FILE_FIELDS)}-field list")
    path, size, digest, chunks = item
    if not isinstance(path, str) or not isinstance(digest, str) or not isinstance(chunks, list):
        raise _fail(f"file #{i} has a bad path, hash or chunk list")
    refs = []
    for k, c in enumerate(chunks):
        if not isinstance(c, list) or len(c) != len(FILE_CHUNK_FIELDS):
            raise _fail(f"file {path!r} chunk #{k} is not a {len(FILE_CHUNK_FIELDS)}-field list")
        cid, raw_size, stored_size, codec, crc = c
        if not is_content_id(cid) or not is_codec_name(codec):
            raise _fail(f"file {path!r} chunk #{k} has a bad id or codec")
        refs.append(ChunkRef(index=k, id=cid, raw_size=_int(raw_size, f"file {path!r} chunk raw_size", 1),
                             stored_size=_int(stored_size, f"file {path!r} chunk stored_size", 1), codec=codec,
                             crc32c=_int(crc, f"file {path!r} chunk crc32c", 0, 0xFFFFFFFF), introduced_in=0, created_at=0.0))
    return FileEntry(path, _int(size, f"file {path!r} size"), digest, tuple(refs))
