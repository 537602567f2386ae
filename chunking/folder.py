"""Model folders (a Hugging Face checkpoint as it is): safetensors shards plus any other files.

:func:`open_folder` walks a folder without following symlinks: every ``*.safetensors`` file is a
weight shard, read through a memory map (no copy, pages the kernel can drop again, so a folder
of any size packs in bounded memory); every other file (``config.json``, tokenizer files,
``model.safetensors.index.json``, a README) is kept byte for byte as content-addressed chunks of
its own. :func:`pack_folder_stream` packs both into one version whose manifest lists the files
(path, size, BLAKE3) and which shard each tensor came from.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chunking.codec import encode_chunk
from chunking.config import ChunkingConfig
from chunking.dtypes import FROM_SAFETENSORS, torch_dtype
from chunking.errors import ChunkingError, InvalidInput
from chunking.hashing import Buffer, bytes_like, content_id, crc32c
from chunking.manifest import ChunkRef, FileEntry, Manifest, check_relative_path, metadata_pairs
from chunking.pack import PackResult, PackStream, pack_stream

FILE_FINGERPRINT_DOMAIN = b"pdparams-folder-fingerprint-v1\n"
SKIPPED_DIRS = (".git", ".cache")  # a clone's or the hub client's bookkeeping, not the model
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class FolderFile:
    path: str  # relative, "/"-separated
    source: Path
    size: int


@dataclass(frozen=True)
class ModelFolder:
    root: Path
    weight_files: tuple[FolderFile, ...]  # sorted by path
    files: tuple[FolderFile, ...]  # everything else, sorted by path

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Every shard's tensors as views of its memory map, and the shard index of each name."""
        out: dict[str, torch.Tensor] = {}
        shard_of: dict[str, int] = {}
        for i, shard in enumerate(self.weight_files):
            for name, tensor in map_safetensors(shard.source, shard.path).items():
                if name in out:
                    raise InvalidInput(f"tensor {name!r} is in both {self.weight_files[shard_of[name]].path} and {shard.path}; "
                                       "a folder's shards must hold distinct tensors")
                out[name] = tensor
                shard_of[name] = i
        return out, shard_of

    def metadata(self) -> tuple[tuple[tuple[str, str], ...], ...]:
        """Each shard's ``__metadata__`` (sorted pairs), kept so a pulled folder's shards carry it
        again; () when no shard has any."""
        found = tuple(metadata_pairs(safetensors_metadata(s.source, s.path)) for s in self.weight_files)
        return found if any(found) else ()


def _check_utf8(path: Path, base: Path) -> None:
    """A name the manifest can hold: UTF-8 (os.walk hands undecodable bytes over as surrogates,
    which the manifest's JSON then failed on, with a traceback)."""
    rel = path.relative_to(base).as_posix()
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"file name {os.fsencode(rel)!r} in {base} is not UTF-8, and a model's file names must be: "
                           "rename it (or move it out of the folder)") from None


def open_folder(root: str | os.PathLike[str]) -> ModelFolder:
    """The weight shards and other files of ``root``; refuses symlinks and unsafe names."""
    base = Path(root)
    if not base.is_dir():
        raise InvalidInput(f"{base} is not a folder")
    weights: list[FolderFile] = []
    files: list[FolderFile] = []
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        here = Path(dirpath)
        for d in list(dirnames):
            _check_utf8(here / d, base)
            if (here / d).is_symlink():
                raise InvalidInput(f"{here / d} is a symlink; links are not followed: copy what it points to into the folder")
            if d in SKIPPED_DIRS:
                dirnames.remove(d)
        dirnames.sort()
        for name in sorted(filenames):
            full = here / name
            _check_utf8(full, base)
            rel = full.relative_to(base).as_posix()
            if full.is_symlink():
                raise InvalidInput(f"{full} is a symlink; links are not followed: copy the file into the folder")
            if not full.is_file():
                raise InvalidInput(f"{full} is not a regular file (a device, socket or pipe); remove it from the folder")
            why = check_relative_path(rel)
            if why is not None:
                raise InvalidInput(f"file name {rel!r} {why}; rename it")
            entry = FolderFile(rel, full, full.stat().st_size)
            (weights if name.endswith(".safetensors") else files).append(entry)
    if not weights:
        raise InvalidInput(f"{base} holds no .safetensors weights; save the model with save_pretrained(..., safe_serialization=True)")
    return ModelFolder(base, tuple(sorted(weights, key=lambda f: f.path)), tuple(sorted(files, key=lambda f: f.path)))


def safetensors_metadata(path: Path, shown: str | None = None) -> dict[str, str]:
    """The ``__metadata__`` of a .safetensors file ({} when it has none)."""
    where = shown or str(path)
    doc, _n, _size = _header(path, where)
    meta = doc.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidInput(f"{where}: its __metadata__ must map strings to strings, as safetensors requires")
    return meta


def _header(path: Path, where: str) -> tuple[dict[str, Any], int, int]:
    """(the JSON header, its length, the file's size) of a .safetensors file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise InvalidInput(f"{where} is not a safetensors file: shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise InvalidInput(f"{where} is not a safetensors file: header length {n} does not fit the file")
            doc = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{where} is not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"{where} is not a safetensors file: its header is not an object")
    return doc, n, size


def map_safetensors(path: Path, shown: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file as views of a private memory map of it (copy on write:
    nothing is read until packed, nothing written back)."""
    where = shown or str(path)
    doc, n, size = _header(path, where)
    data_start = 8 + n
    data_len = size - data_start
    area = np.memmap(path, dtype=np.uint8, mode="c", offset=data_start, shape=(data_len,)) if data_len > 0 else None
    out: dict[str, torch.Tensor] = {}
    for name, info in doc.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise InvalidInput(f"{where}: tensor {name!r} has no dtype, shape or data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        dtype_name = FROM_SAFETENSORS.get(code)
        if dtype_name is None:
            raise InvalidInput(f"{where}: tensor {name!r} has dtype {code!r}, which this store does not carry")
        dtype = torch_dtype(dtype_name)
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)):
            raise InvalidInput(f"{where}: tensor {name!r} has a malformed shape or data_offsets")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise InvalidInput(f"{where}: tensor {name!r} data_offsets {offsets} do not match its shape {shape} x {code} "
                               f"inside the file's {data_len} data bytes")
        if nbytes == 0 or area is None:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.from_numpy(area[begin:end])
        out[name] = raw.view(dtype).reshape(shape) if begin % dtype.itemsize == 0 else raw.clone().view(dtype).reshape(shape)
    return out


def file_chunks(path: Path, config: ChunkingConfig) -> Iterator[tuple[ChunkRef, Buffer]]:
    """(ref, stored bytes) of each chunk of a plain file, in order."""
    with open(path, "rb") as f:
        k = 0
        while True:
            raw = f.read(config.chunk_size)
            if not raw:
                return
            codec, stored = encode_chunk(raw, config, 1)
            data = bytes_like(stored)
            yield ChunkRef(k, content_id(raw, config.hash_algorithm), len(raw), memoryview(data).nbytes, codec,
                           crc32c(data), 0, 0.0), data
            k += 1


def file_hash(path: Path) -> str:
    import blake3

    h = blake3.blake3()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return str(h.hexdigest())


def folder_fingerprint(tensor_fingerprint: str, files: tuple[FileEntry, ...], weight_files: tuple[str, ...],
                       tensor_file: tuple[int, ...]) -> str:
    """The model fingerprint of a folder: its weights' and every file's content (a changed
    config.json is another model), and which shard holds which tensor."""
    doc = [tensor_fingerprint, [[f.path, f.size, f.blake3] for f in files], list(weight_files), list(tensor_file)]
    return content_id(FILE_FINGERPRINT_DOMAIN + json.dumps(doc, separators=(",", ":")).encode())


class FolderPackStream:
    """A :class:`PackStream` of a folder's tensors followed by its files' chunks.

    Tensor chunks keep their indices; file chunks are numbered after them (``index >=
    tensor_chunks``) so ``result().chunk(index)`` can make any of them again for a re-send.
    """

    def __init__(self, folder: ModelFolder, *, model: str, version: int, config: ChunkingConfig,
                 previous: Manifest | None, created_at: float) -> None:
        self.folder = folder
        tensors, shard_of = folder.tensors()
        self.tensors_stream: PackStream = pack_stream(tensors, model=model, version=version, config=config,
                                                      previous=previous, created_at=created_at)
        self.config = config
        self.shard_of = shard_of
        self._files: list[FileEntry] = []
        self._file_index: dict[int, tuple[Path, int, ChunkRef]] = {}  # pack index -> (file, chunk number, ref)
        self._done = False

    @property
    def raw_bytes(self) -> int:
        return self.tensors_stream.raw_bytes + sum(f.size for f in self.folder.files)

    @property
    def chunk_count(self) -> int:
        return self.tensors_stream.chunk_count + sum(-(-f.size // self.config.chunk_size) for f in self.folder.files)

    def blocks(self) -> Iterator[list[tuple[ChunkRef, Buffer]]]:
        yield from self.tensors_stream.blocks()
        at = self.tensors_stream.chunk_count
        for f in self.folder.files:
            refs: list[ChunkRef] = []
            block: list[tuple[ChunkRef, Buffer]] = []
            for ref, data in file_chunks(f.source, self.config):
                refs.append(ref)
                self._file_index[at] = (f.source, ref.index, ref)
                block.append((ref._replace(index=at), data))
                at += 1
            if sum(r.raw_size for r in refs) != f.size:
                raise ChunkingError(f"{f.path} changed while it was being pushed; push again once it stays the same")
            self._files.append(FileEntry(f.path, f.size, file_hash(f.source), tuple(refs)))
            if block:
                yield block
        self._done = True

    def result(self) -> FolderPackResult:
        if not self._done:
            for _ in self.blocks():
                pass
        inner = self.tensors_stream.result()
        m = inner.manifest
        files = tuple(self._files)
        weight_files = tuple(w.path for w in self.folder.weight_files)
        tensor_file = tuple(self.shard_of[t.name] for t in m.tensors)
        manifest = dataclasses.replace(m, files=files, weight_files=weight_files, tensor_file=tensor_file,
                                       weight_file_metadata=self.folder.metadata(),
                                       fingerprint=folder_fingerprint(m.fingerprint, files, weight_files, tensor_file))
        manifest.check()
        return FolderPackResult(manifest, inner, self._file_index, self.config)


class FolderPackResult:
    def __init__(self, manifest: Manifest, tensors: PackResult, file_index: dict[int, tuple[Path, int, ChunkRef]],
                 config: ChunkingConfig) -> None:
        self.manifest = manifest
        self.tensors = tensors
        self._file_index = file_index
        self.config = config

    def chunk(self, index: int) -> _Made:
        """Chunk ``index`` made again: a tensor chunk from the mapped shards, a file chunk from its file."""
        if index < len(self.manifest.chunks):
            return _Made(self.tensors.chunk(index).data)
        path, k, ref = self._file_index[index]
        with open(path, "rb") as f:
            f.seek(k * self.config.chunk_size)
            raw = f.read(ref.raw_size)
        _codec, stored = encode_chunk(raw, self.config, 1)
        data = bytes_like(stored)
        if len(raw) != ref.raw_size or crc32c(data) != ref.crc32c:
            raise ChunkingError(f"{path} changed while it was being pushed; push again once it stays the same")
        return _Made(bytes(data))


@dataclass(frozen=True)
class _Made:
    data: bytes


def pack_folder_stream(root: str | os.PathLike[str], *, model: str, version: int = 1, config: ChunkingConfig = ChunkingConfig(),
                       previous: Manifest | None = None, created_at: float = 0.0) -> FolderPackStream:
    return FolderPackStream(open_folder(root), model=model, version=version, config=config, previous=previous,
                            created_at=created_at)


__all__ = ["FolderFile", "FolderPackResult", "FolderPackStream", "ModelFolder", "file_hash", "folder_fingerprint",
           "map_safetensors", "open_folder", "pack_folder_stream"]
