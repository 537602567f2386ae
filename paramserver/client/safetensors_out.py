"""Pull straight into a .safetensors file: the pulled tensors live in the file's own pages.

Why: pulling into memory and then saving copies every byte once more and needs the whole
model in RAM twice over (tensors, then the file's page cache). Here the output file is laid
out first (header, then every tensor's bytes, no holes, as the format requires), sized and
mapped; the tensors handed to the fetcher are views of that mapping, so chunks land in the
file directly. The file is written under a temporary name and renamed only once every chunk
is in and verified, then flushed and fsynced: a failed pull leaves no file behind.

Tensors are laid out in decreasing element size (stable in manifest order), so each one
starts at a multiple of its own element size and can be viewed with its real dtype, as
safetensors' own writer does.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from pathlib import Path
from collections.abc import Mapping, Sequence

import torch

from chunking.dtypes import SAFETENSORS_CODES, torch_dtype
from chunking.manifest import Manifest, TensorEntry

from paramserver.client.errors import NotSafetensors as NotSafetensors  # re-exported: its old home
from paramserver.client.hostmem import PAGE_ALIGNED_BYTES, Targets

_CODES = SAFETENSORS_CODES


METADATA_KEY = "__metadata__"  # the header key safetensors keeps for its string-to-string metadata


def unwritable(tensors: Sequence[TensorEntry]) -> str | None:
    """Why ``tensors`` cannot be one .safetensors file, or None."""
    bad = sorted({t.dtype for t in tensors if t.dtype not in _CODES})
    if bad:
        return f"safetensors has no dtype for {', '.join(bad)}"
    if any(t.name == METADATA_KEY for t in tensors):
        return f"a tensor is named {METADATA_KEY}, the key safetensors keeps for its metadata"
    return None


def supported(manifest: Manifest) -> bool:
    """True when ``manifest``'s tensors can be written as a .safetensors file."""
    return unwritable(manifest.tensors) is None


def header_bytes(manifest: Manifest, metadata: Mapping[str, str],
                 tensors: Sequence[TensorEntry] | None = None) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length prefix and JSON header, padded to 8) and each tensor's data
    offset; ``tensors``: the ones this file holds (one shard of a folder), default all."""
    entries = manifest.tensors if tensors is None else tensors
    order = sorted(entries, key=lambda t: -torch_dtype(t.dtype).itemsize)  # sorted() is stable
    offsets: dict[str, int] = {}
    doc: dict[str, object] = {METADATA_KEY: dict(metadata)} if metadata else {}
    at = 0
    for t in order:
        offsets[t.name] = at
        doc[t.name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def current_umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


class SafetensorsOut:
    """A .safetensors file being filled in place; ``commit`` or ``abort`` it."""

    def __init__(self, path: str | os.PathLike[str], manifest: Manifest, metadata: Mapping[str, str],
                 only: Sequence[TensorEntry] | None = None) -> None:
        """``only``: the tensors this file holds (one shard of a folder), default all of them."""
        entries = manifest.tensors if only is None else tuple(only)
        why = unwritable(entries)
        if why is not None:
            raise NotSafetensors(f"{why}; paramworker load and load_state_dict() keep every dtype and tensor name")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        head, offsets = header_bytes(manifest, metadata, entries)
        size = len(head) + sum(t.nbytes for t in entries)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._fd: int | None = fd
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 would hide the pulled file from other users
        self._area: mmap.mmap | None = None
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, head, 0)
            self._area = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            tensors: dict[str, torch.Tensor] = {}
            large: list[torch.Tensor] = []
            for t in entries:
                dtype = torch_dtype(t.dtype)
                if not t.nbytes:
                    tensors[t.name] = torch.empty(t.shape, dtype=dtype)
                    continue
                view = torch.frombuffer(self._area, dtype=torch.uint8, count=t.nbytes, offset=len(head) + offsets[t.name])
                tensors[t.name] = view.view(dtype).reshape(t.shape)
                if t.nbytes >= PAGE_ALIGNED_BYTES:
                    large.append(tensors[t.name])
        except BaseException:
            self.abort()
            raise
        self.targets = Targets(tensors, large)

    def commit(self) -> None:
        """Flush, fsync and rename into place. Drop every tensor of ``targets`` first."""
        assert self._area is not None and self._fd is not None
        self.targets = Targets({}, [])
        self._area.flush()
        os.fsync(self._fd)
        os.replace(self.tmp, self.path)
        try:
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass  # some filesystems cannot fsync a folder; the file itself is durable
        self._release()

    def abort(self) -> None:
        """Remove the temporary file (a failed pull leaves nothing behind)."""
        self.targets = Targets({}, [])
        self._release()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def _release(self) -> None:
        if self._area is not None:
            try:
                self._area.close()
            except BufferError:
                pass  # a tensor view is still referenced somewhere: the mapping goes with it
            self._area = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["METADATA_KEY", "NotSafetensors", "SafetensorsOut", "current_umask", "header_bytes", "supported", "unwritable"]
