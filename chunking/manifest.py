"""The manifest: what a model version is made of, serialised canonically.

Two byte forms, both canonical (the same manifest gives the same bytes in any process, so its
content id names it):

- format 2, written by this library: a small JSON header (tensors, files, names) followed by
  the chunk fields as binary columns (``chunking.manifest_binary``). A 140 GB checkpoint's
  half-million chunks decode as numpy views, not as objects;
- format 4, written by this library for manifests of ``SPLIT_FROM_CHUNKS`` chunks or more: a
  binary root (the version's own fields and a table of parts), a layout blob (tensors and
  files) and parts (runs of chunk columns, a large tensor's rows in parts of their own), each a
  blob of its own (``chunking.manifest_split``), so versions that share tensors share manifest
  bytes. The root's bytes are ``to_bytes()`` and name the manifest; ``blobs()`` gives them all;
- format 3, still read and written on request: format 4's parts, cut more coarsely, under a
  JSON root that holds the tensors and files itself;
- format 1, still read (and re-written byte for byte, so its id holds): compact JSON with
  sorted keys, tensors and chunks as arrays in ``TENSOR_FIELDS`` / ``CHUNK_FIELDS`` order.

Either way ``Manifest.chunks`` is a ``ChunkTable``: columns, with a ``ChunkRef`` made only for
the rows a caller reads.

A model folder (``chunking.folder``) adds two optional parts, written only when present so a
plain weights file's manifest keeps its bytes and id: ``files``, the non-tensor files (config,
tokenizer, ...) with their relative path, size, BLAKE3 and chunks of their own; and
``weight_files`` with ``tensor_file``, the safetensors shard each tensor came from, so a pull
writes the shards (and the index that names them) back.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

from chunking import manifest_binary, manifest_split
from chunking.chunk_table import ChunkRef as ChunkRef  # re-exported: a manifest's rows
from chunking.chunk_table import ChunkTable
from chunking.config import HASH_ALGORITHMS, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from chunking.errors import ManifestError
from chunking.hashing import content_id
from chunking.layout import ChunkPlan, chunk_raw_sizes, plan_chunks
from chunking.manifest_check import check_chunks, check_folder
# The vocabulary, re-exported: every name below was importable from here when this was one module.
from chunking.manifest_fields import (BASE_KEYS, BINARY_FORMAT, BINARY_KEYS, CHUNK_FIELDS, FILE_CHUNK_FIELDS, FILE_FIELDS,
                                      FILE_KEYS, FORMAT_VERSION, HEADER_KEYS, JSON_FORMAT, LAYOUT_KEYS, LAYOUT_SPLIT_FORMAT,
                                      MAX_PATH_BYTES, MAX_VERSION, READABLE_FORMATS, SHARD_KEYS, SHARD_METADATA_KEY,
                                      SPLIT_FORMAT, SPLIT_FORMATS, SPLIT_KEYS, TENSOR_FIELDS, FileEntry, TensorEntry,
                                      check_keys, check_relative_path, check_root_keys, chunk_from, chunk_span, fail,
                                      file_from, int_field, is_codec_name, metadata_pairs, mismatch, spans, tensor_from,
                                      unsupported, written_format)

__all__ = [
    "BASE_KEYS", "BINARY_FORMAT", "BINARY_KEYS", "CHUNK_FIELDS", "FILE_CHUNK_FIELDS", "FILE_FIELDS", "FILE_KEYS",
    "FORMAT_VERSION", "HEADER_KEYS", "JSON_FORMAT", "LAYOUT_KEYS", "LAYOUT_SPLIT_FORMAT", "MAX_PATH_BYTES", "MAX_VERSION",
    "READABLE_FORMATS", "SHARD_KEYS", "SHARD_METADATA_KEY", "SPLIT_FORMAT", "SPLIT_FORMATS", "SPLIT_KEYS", "TENSOR_FIELDS",
    "ChunkRef", "FileEntry", "Manifest", "TensorEntry", "check_relative_path", "is_codec_name", "metadata_pairs",
    "written_format",
]


@dataclass(frozen=True)
class Manifest:
    model: str
    version: int
    chunk_size: int
    format_version: int
    tensors: tuple[TensorEntry, ...]
    chunks: ChunkTable  # a sequence of ChunkRef given here becomes a ChunkTable
    fingerprint: str
    hash_algorithm: str = "blake3"
    files: tuple[FileEntry, ...] = ()
    weight_files: tuple[str, ...] = ()  # safetensors shards of a model folder, in order
    tensor_file: tuple[int, ...] = ()  # per tensor: its index in weight_files
    # per weight file: its safetensors __metadata__ as sorted (key, value) pairs; () when no shard had any
    weight_file_metadata: tuple[tuple[tuple[str, str], ...], ...] = ()

    def __post_init__(self) -> None:
        given: object = self.chunks
        if not isinstance(given, ChunkTable):  # refs, e.g. from dataclasses.replace(m, chunks=(...))
            refs: tuple[ChunkRef, ...] = tuple(cast("Iterable[ChunkRef]", given))
            for i, ref in enumerate(refs):
                if ref.index != i:
                    raise fail(f"chunk at position {i} says index {ref.index}")
            try:
                table = ChunkTable.from_refs(refs)
            except (ValueError, OverflowError) as exc:
                raise fail(f"a chunk field is out of range ({exc})") from None
            object.__setattr__(self, "chunks", table)
        if self.format_version not in READABLE_FORMATS:
            raise unsupported(self.format_version)

    # -- serialisation ---------------------------------------------------
    def to_bytes(self) -> bytes:
        """The canonical bytes, in this manifest's ``format_version`` (format 3: the root's)."""
        return self._encoded

    @property
    def parts(self) -> tuple[manifest_split.Part, ...]:
        """The column parts a format-3 or format-4 root names, in chunk order; () in the other formats."""
        if self.format_version not in SPLIT_FORMATS:
            return ()
        return self._split[1]

    @property
    def layout_blob(self) -> tuple[str, bytes] | None:
        """``(id, bytes)`` of a format-4 manifest's layout blob (its tensors and files); None in the other formats."""
        if self.format_version != LAYOUT_SPLIT_FORMAT:
            return None
        return self._split[2]

    def blobs(self) -> dict[str, bytes]:
        """Every blob that makes up this manifest, id -> bytes: the root (or sole blob) first, then
        format 4's layout, then the parts."""
        out = {self.id: self.to_bytes()}
        if self.layout_blob is not None:
            out.setdefault(*self.layout_blob)
        for part in self.parts:
            out.setdefault(part.id, part.data)
        return out

    @cached_property
    def _split(self) -> tuple[bytes, tuple[manifest_split.Part, ...], tuple[str, bytes] | None]:
        t = self.chunks
        columns = manifest_binary.Columns(t.digests, t.crc32c, t.stored_size, t.codec_index, t.introduced_in, t.created_at)
        parts = manifest_split.split_columns(columns, t.codecs, self._part_bounds(), self.hash_algorithm)
        return self._roots(parts)

    def _part_bounds(self) -> list[tuple[int, int]]:
        return manifest_split.part_bounds([(x.offset, x.nbytes) for x in self.tensors], self.chunk_size, len(self.chunks),
                                          rule=self.format_version)

    def _roots(self, parts: tuple[manifest_split.Part, ...]
               ) -> tuple[bytes, tuple[manifest_split.Part, ...], tuple[str, bytes] | None]:
        """The root over ``parts`` and (format 4) the layout blob: what ``_split`` holds."""
        if self.format_version == SPLIT_FORMAT:
            return manifest_split.encode_root(self._header(), parts), parts, None
        layout = manifest_split.encode_layout(self._layout())
        layout_id = content_id(layout, self.hash_algorithm)
        return manifest_split.encode_root4(self._header(layout=False), layout_id, parts), parts, (layout_id, layout)

    def _header(self, *, layout: bool = True) -> dict[str, Any]:
        header: dict[str, Any] = {
            "format_version": self.format_version,
            "model": self.model,
            "version": self.version,
            "chunk_size": self.chunk_size,
            "hash_algorithm": self.hash_algorithm,
            "fingerprint": self.fingerprint,
        }
        return header | self._layout() if layout else header

    def _layout(self) -> dict[str, Any]:
        """Tensors, files and shards: what versions of a model usually share (format 4's layout blob)."""
        header: dict[str, Any] = {
            "tensor_fields": list(TENSOR_FIELDS),
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors],
        }
        if self.files:
            header["file_fields"] = list(FILE_FIELDS)
            header["file_chunk_fields"] = list(FILE_CHUNK_FIELDS)
            header["files"] = [
                [f.path, f.size, f.blake3, [[c.id, c.raw_size, c.stored_size, c.codec, c.crc32c] for c in f.chunks]]
                for f in self.files
            ]
        if self.weight_files:
            header["weight_files"] = list(self.weight_files)
            header["tensor_file"] = list(self.tensor_file)
            if self.weight_file_metadata:
                header[SHARD_METADATA_KEY] = [dict(pairs) for pairs in self.weight_file_metadata]
        return header

    @cached_property
    def _encoded(self) -> bytes:
        if self.format_version in SPLIT_FORMATS:
            return self._split[0]
        header = self._header()
        t = self.chunks
        if self.format_version == BINARY_FORMAT:
            header["codecs"] = list(t.codecs)
            return manifest_binary.encode(header, manifest_binary.Columns(
                t.digests, t.crc32c, t.stored_size, t.codec_index, t.introduced_in, t.created_at))
        header["chunk_fields"] = list(CHUNK_FIELDS)
        header["chunks"] = [list(row) for row in zip(t.ids, t.raw_size.tolist(), t.stored_size.tolist(), t.codec_names(),
                                                     t.crc32c.tolist(), t.introduced_in.tolist(), t.created_at.tolist())]
        return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()

    def in_format(self, format_version: int) -> Manifest:
        """This manifest in another byte form (another id: the id names the bytes)."""
        if format_version not in READABLE_FORMATS:
            raise unsupported(format_version)
        return dataclasses.replace(self, format_version=format_version)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, expected_id: str | None = None,
                   parts: Mapping[str, bytes] | None = None) -> Manifest:
        """Parse and validate manifest bytes (any readable format); refuse unknown format versions and id mismatches.

        A format-3 or format-4 root needs the blobs it names: ``parts`` maps the ids
        ``manifest_split.part_ids(data)`` gives to their bytes; ``Manifest.read`` fetches them."""
        raw = bytes(data)
        split_format, binary = manifest_split.root_format(raw), manifest_binary.is_binary(raw)
        split = split_format is not None
        columns: manifest_binary.Columns | None = None
        root: manifest_split.Root | None = None
        if split:
            try:
                root = manifest_split.parse_root(raw)
            except ValueError as exc:
                raise fail(f"format-{split_format} root is damaged: {exc}") from None
            doc = root.doc
        elif binary:
            try:
                doc, columns = manifest_binary.decode(raw)
            except ValueError as exc:
                raise fail(f"format-2 bytes are damaged: {exc}") from None
        else:
            try:
                doc = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError) as exc:
                raise fail(f"not UTF-8 JSON nor the binary format ({exc}); the bytes may be truncated") from None
            if not isinstance(doc, dict):
                raise fail("top level is not an object")
        fmt = doc.get("format_version")
        if split and fmt in manifest_split.ROOT_FORMATS and fmt != split_format:
            raise fail(f"its format_version {fmt} does not match its format-{split_format} magic bytes")
        if fmt != (split_format if split else BINARY_FORMAT if binary else JSON_FORMAT):
            if binary and doc.get("kind") == manifest_split.PART_KIND:
                raise fail("these bytes are a part of a split manifest, not a manifest: fetch the version's root")
            raise unsupported(fmt)
        algorithm = doc.get("hash_algorithm")
        if algorithm not in HASH_ALGORITHMS:
            raise fail(f"hash_algorithm {algorithm!r} is unknown")
        if expected_id is not None and content_id(raw, algorithm) != expected_id:
            raise mismatch(expected_id)
        if root is not None:
            if parts is None:
                raise ManifestError(
                    f"manifest {expected_id or content_id(raw, algorithm)} is split (format {root.format}): fetch the "
                    "blobs its root names (chunking.manifest_split.part_ids) and pass them as parts="
                )
            manifest = cls._from_split(root, parts)
        elif columns is not None:
            manifest = cls._from_binary(doc, columns)
        else:
            manifest = cls._from_doc(doc)
        try:
            again = manifest.to_bytes()  # formats 3 and 4: the root names the parts' (and layout's) ids, so this covers them
        except UnicodeEncodeError:
            raise fail("a name is not valid Unicode (a lone surrogate)") from None
        if again != raw:
            raise fail("bytes are not in canonical form (re-serialised bytes differ), so its id would not be stable")
        if expected_id is not None:
            manifest.__dict__["id"] = expected_id
        return manifest

    @classmethod
    def read(cls, manifest_id: str, get_blob: Callable[[str], bytes], *, root: bytes | None = None,
             get_parts: Callable[[Sequence[str]], Mapping[str, bytes]] | None = None, parallel: int = 8) -> Manifest:
        """The manifest named ``manifest_id``, proven by the ids of its blobs: the root from
        ``get_blob(id)`` (unless ``root`` is given), then the parts it names, ``parallel`` calls at
        a time: of ``get_parts(ids)`` (many per call) when given, else of ``get_blob``. What they
        raise passes through; so does ManifestError."""
        data = get_blob(manifest_id) if root is None else root
        split_format = manifest_split.root_format(data)
        if split_format is None:  # format 1 or 2: one blob
            return cls.from_bytes(data, expected_id=manifest_id)
        try:
            parsed = manifest_split.parse_root(bytes(data))
            manifest_split.check_repeats(parsed.parts)
        except ValueError as exc:
            raise fail(f"format-{split_format} root is damaged: {exc}") from None
        # The root's id is proven before any part is asked for: a forged root must not make us fetch.
        algorithm = parsed.doc.get("hash_algorithm")
        if algorithm not in HASH_ALGORITHMS:
            raise fail(f"hash_algorithm {algorithm!r} is unknown")
        if content_id(data, algorithm) != manifest_id:
            raise mismatch(manifest_id)
        check_root_keys(parsed)
        wanted = parsed.blob_ids
        if not wanted:  # a root of no chunks
            return cls.from_bytes(data, expected_id=manifest_id, parts={})
        calls = max(1, min(parallel, len(wanted)))
        blobs: dict[str, bytes] = {}
        pool = ThreadPoolExecutor(max_workers=calls, thread_name_prefix="manifest-parts")
        try:
            if get_parts is not None:
                step = -(-len(wanted) // calls)
                for got in pool.map(get_parts, [wanted[i : i + step] for i in range(0, len(wanted), step)]):
                    blobs.update(got)
            else:
                blobs.update(zip(wanted, pool.map(get_blob, wanted)))
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, the calls not yet started are not made
        return cls.from_bytes(data, expected_id=manifest_id, parts=blobs)

    @classmethod
    def _from_split(cls, root: manifest_split.Root, parts: Mapping[str, bytes]) -> Manifest:
        doc = root.doc
        check_root_keys(root)
        if root.layout is not None:
            data = parts.get(root.layout)
            if data is None:
                raise fail(f"its layout blob {root.layout} was not supplied")
            if content_id(data, doc["hash_algorithm"]) != root.layout:
                raise fail(f"its layout blob {root.layout}: the bytes do not match the id (corrupted, or another blob)")
            try:
                layout = manifest_split.decode_layout(data)
            except ValueError as exc:
                raise fail(f"its layout blob {root.layout} is damaged: {exc}") from None
            check_keys(set(layout), LAYOUT_KEYS)
            doc = {k: v for k, v in doc.items() if k not in manifest_split.ROOT4_KEYS} | layout
        # The rows the parts add up to must be the rows the tensors span, checked before any part
        # is decoded or joined.
        tensors, chunk_size = cls._header_tensors(doc)
        listed_rows = sum(count for _pid, count in root.parts)
        if not spans(tensors, chunk_size, listed_rows):
            raise fail(f"its parts hold {listed_rows} chunks but the tensors span {chunk_span(tensors, chunk_size)}")
        try:
            codecs, columns, parts_read = manifest_split.join_parts(root.parts, parts, doc["hash_algorithm"])
        except ValueError as exc:
            raise fail(str(exc)) from None
        manifest = cls._from_columns(doc, columns, codecs, root.format, header=(tensors, chunk_size))
        # Each part was proven canonical as it was read, so re-encoding it would give it back; what
        # is left to prove is that the parts are cut where the layout says (the root's re-encoding
        # in from_bytes then covers the rest, the layout blob's id included).
        if manifest._part_bounds() != [(p.start, p.stop) for p in parts_read]:
            raise fail("its parts are not cut where the tensor layout puts the cuts")
        manifest.__dict__["_split"] = manifest._roots(parts_read)
        return manifest

    @classmethod
    def _from_binary(cls, doc: dict[str, Any], columns: manifest_binary.Columns) -> Manifest:
        check_keys(set(doc), BINARY_KEYS)
        codecs = doc["codecs"]
        # Canonical: the table lists exactly the codecs used, in the order they first appear.
        if manifest_binary.first_use_order(columns.codec_index).tolist() != list(range(len(codecs))):
            raise fail("its codec table is not the codecs used in order of first use")
        return cls._from_columns(doc, columns, tuple(codecs), BINARY_FORMAT)

    @classmethod
    def _from_columns(cls, doc: dict[str, Any], columns: manifest_binary.Columns, codecs: tuple[str, ...],
                      fmt: int, *, header: tuple[tuple[TensorEntry, ...], int] | None = None) -> Manifest:
        """``header``: ``_header_tensors(doc)`` where the caller has it already."""
        if not all(is_codec_name(c) for c in codecs) or len(set(codecs)) != len(codecs):
            raise fail(f"codec table {list(codecs)!r} has an unknown or repeated codec")
        tensors, chunk_size = cls._header_tensors(doc) if header is None else header
        n = len(columns.digests)
        if not spans(tensors, chunk_size, n):
            raise fail(f"{n} chunks listed but the tensors span {chunk_span(tensors, chunk_size)}")
        try:
            raw_size = chunk_raw_sizes([(t.offset, t.nbytes) for t in tensors], chunk_size)
        except ValueError as exc:
            raise fail(str(exc)) from None
        table = ChunkTable(columns.digests, raw_size, columns.stored_size, columns.crc32c, columns.codec_index,
                           codecs, columns.introduced_in, columns.created_at)
        return cls._build(doc, tensors, table, fmt)

    @classmethod
    def _header_tensors(cls, doc: dict[str, Any]) -> tuple[tuple[TensorEntry, ...], int]:
        if doc["tensor_fields"] != list(TENSOR_FIELDS):
            raise fail("tensor field list differs from this format version")
        if not isinstance(doc["tensors"], list):
            raise fail("tensors must be a list")
        tensors = tuple(tensor_from(item, i) for i, item in enumerate(doc["tensors"]))
        return tensors, int_field(doc["chunk_size"], "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)

    @classmethod
    def _from_doc(cls, doc: dict[str, Any]) -> Manifest:
        check_keys(set(doc), BASE_KEYS)
        if doc["chunk_fields"] != list(CHUNK_FIELDS):
            raise fail("field lists differ from this format version")
        if not isinstance(doc["chunks"], list):
            raise fail("tensors and chunks must be lists")
        tensors, _ = cls._header_tensors(doc)
        chunks = tuple(chunk_from(item, i) for i, item in enumerate(doc["chunks"]))
        return cls._build(doc, tensors, chunks, JSON_FORMAT)

    @classmethod
    def _build(cls, doc: dict[str, Any], tensors: tuple[TensorEntry, ...], chunks: ChunkTable | tuple[ChunkRef, ...],
               fmt: int) -> Manifest:
        if "files" in doc and (doc["file_fields"] != list(FILE_FIELDS) or doc["file_chunk_fields"] != list(FILE_CHUNK_FIELDS)):
            raise fail("file field lists differ from this format version")
        if not isinstance(doc["model"], str) or not isinstance(doc["fingerprint"], str):
            raise fail("model and fingerprint must be strings")
        files: tuple[FileEntry, ...] = ()
        if "files" in doc:
            if not isinstance(doc["files"], list) or not doc["files"]:
                raise fail("files must be a non-empty list when present")
            files = tuple(file_from(item, i) for i, item in enumerate(doc["files"]))
        weight_files: tuple[str, ...] = ()
        tensor_file: tuple[int, ...] = ()
        if "weight_files" in doc:
            wf, tf = doc["weight_files"], doc["tensor_file"]
            if not isinstance(wf, list) or not wf or not all(isinstance(p, str) for p in wf) or not isinstance(tf, list):
                raise fail("weight_files must be a non-empty list of paths and tensor_file a list")
            weight_files = tuple(wf)
            tensor_file = tuple(int_field(x, "tensor_file entry", 0, len(wf) - 1) for x in tf)
        shard_metadata: tuple[tuple[tuple[str, str], ...], ...] = ()
        if SHARD_METADATA_KEY in doc:
            raw = doc[SHARD_METADATA_KEY]
            if (not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw)
                    or not all(isinstance(k, str) and isinstance(v, str) for m in raw for k, v in m.items())):
                raise fail(f"{SHARD_METADATA_KEY} must be a list of objects of strings")
            shard_metadata = tuple(metadata_pairs(m) for m in raw)
        manifest = cls(
            model=doc["model"],
            version=int_field(doc["version"], "version"),
            chunk_size=int_field(doc["chunk_size"], "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE),
            format_version=fmt,
            tensors=tensors,
            chunks=chunks,  # type: ignore[arg-type]  # __post_init__ makes a ChunkTable of refs
            fingerprint=doc["fingerprint"],
            hash_algorithm=doc["hash_algorithm"],
            files=files,
            weight_files=weight_files,
            tensor_file=tensor_file,
            weight_file_metadata=shard_metadata,
        )
        manifest.check()
        return manifest
    def check(self) -> None:
        """Raise ManifestError unless tensors, byte ranges and chunks agree (and a folder's files and shards are sound)."""
        check_chunks(self.chunk_size, self.tensors, self.chunks, self.fingerprint)
        check_folder(self.chunk_size, len(self.tensors), self.files, self.weight_files, self.tensor_file,
                     self.weight_file_metadata)

    # -- derived views ---------------------------------------------------
    @cached_property
    def id(self) -> str:
        return content_id(self.to_bytes(), self.hash_algorithm)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (without alignment gaps)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def raw_bytes(self) -> int:
        return int(self.chunks.raw_size.sum())

    @property
    def stored_bytes(self) -> int:
        return int(self.chunks.stored_size.sum())

    def chunk_ids(self) -> tuple[str, ...]:
        """Chunk ids in index order (an id repeats when two chunks hold equal bytes)."""
        return self.chunks.ids

    def file_chunks(self) -> tuple[ChunkRef, ...]:
        """One ref per distinct chunk id of the non-tensor files, first occurrence first."""
        seen: dict[str, ChunkRef] = {}
        for f in self.files:
            for c in f.chunks:
                seen.setdefault(c.id, c)
        return tuple(seen.values())

    def all_chunk_ids(self) -> frozenset[str]:
        """Every chunk id the version needs: its tensors', its files' and its manifest parts' (what GC
        must keep; the manifest's own id is not in it)."""
        return (frozenset(self.chunks.ids) | frozenset(c.id for f in self.files for c in f.chunks)
                | frozenset(self.blobs()) - {self.id})

    def file(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    def unique_chunks(self) -> tuple[ChunkRef, ...]:
        """One ref per distinct chunk id, first occurrence first."""
        return tuple(self.chunks.rows(self.chunks.first_rows))

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
        return dataclasses.replace(self, version=version, chunks=self.chunks.restamped(self.version, version))
