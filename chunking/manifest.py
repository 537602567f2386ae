"""The manifest: what a model version is made of, serialised canonically.

The byte form is compact JSON with sorted keys and UTF-8 text; the same
manifest gives the same bytes in any process, so its content id names it.
Tensors and chunks are stored as arrays (fields in ``TENSOR_FIELDS`` and
``CHUNK_FIELDS`` order) to keep a 1 GiB model's manifest small.
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

    # -- serialisation ---------------------------------------------------
    def to_bytes(self) -> bytes:
        doc = {
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
        expected_keys = {"format_version", "model", "version", "chunk_size", "hash_algorithm", "fingerprint",
                         "tensor_fields", "tensors", "chunk_fields", "chunks"}
        if set(doc) != expected_keys:
            raise _fail(f"keys {sorted(set(doc) ^ expected_keys)} are missing or unexpected")
        if doc["tensor_fields"] != list(TENSOR_FIELDS) or doc["chunk_fields"] != list(CHUNK_FIELDS):
            raise _fail("field lists differ from this format version")
        if not isinstance(doc["model"], str) or not isinstance(doc["fingerprint"], str):
            raise _fail("model and fingerprint must be strings")
        if not isinstance(doc["tensors"], list) or not isinstance(doc["chunks"], list):
            raise _fail("tensors and chunks must be lists")
        tensors = tuple(_tensor_from(item, i) for i, item in enumerate(doc["tensors"]))
        chunks = tuple(_chunk_from(item, i) for i, item in enumerate(doc["chunks"]))
        manifest = cls(
            model=doc["model"],
            version=_int(doc["version"], "version"),
            chunk_size=_int(doc["chunk_size"], "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE),
            format_version=FORMAT_VERSION,
            tensors=tensors,
            chunks=chunks,
            fingerprint=doc["fingerprint"],
            hash_algorithm=doc["hash_algorithm"],
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

