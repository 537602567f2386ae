"""Model folders on the client side: read one file of a version, pull a whole folder back.

``push`` takes a folder already (``paramctl push DIR``; ``chunking.folder``). Here:

- :func:`read_file`: one non-tensor file of a version (``config.json``), fetched and checked
  against its BLAKE3 from the (content-verified) manifest.
- :func:`pull_folder`: the folder written back under ``out_dir``: every file byte for byte, the
  weights as the safetensors shards they came from (received straight into the shards' pages),
  so the stored ``model.safetensors.index.json`` names them and ``transformers`` opens the
  folder. It is built in a hidden sibling folder and renamed into place only when complete and
  fsynced: a failed pull leaves no folder. A version pushed from a single weights file comes
  back as ``model.safetensors``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import blake3
import grpc
import numpy as np
import torch

from chunking.chunk_table import ChunkRows
from chunking.errors import ChunkingError
from chunking.folder import file_hash
from chunking.hashing import Buffer, bytes_like
from chunking.manifest import FileEntry, Manifest, TensorEntry
from paramserver.client.cluster_view import ClusterOptions
from paramserver.client.errors import NotFound, PullError, TransferError
from paramserver.client.hostmem import Targets
from paramserver.client.progress import ProgressFn, no_progress
from paramserver.client.pull import PullOptions, PullReport, _pull, write_failure
from paramserver.client.push import PushReport, push
from paramserver.client.refs import ModelRef
from paramserver.client.safetensors_out import SafetensorsOut, current_umask
from paramserver.client.session import ClusterClient, VersionInfo

SINGLE_FILE_NAME = "model.safetensors"
# What ``--no-weights`` leaves out besides the tensors: weights in the other formats a model folder
# may carry (PyTorch pickles, GGUF, TF/Flax, ONNX, Meta's original/consolidated.*.pth) and the
# indexes naming weight shards that are not there.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz",
                   ".safetensors.index.json", ".bin.index.json", ".pt.index.json", ".pth.index.json")


def is_weight_file(path: str) -> bool:
    return path.lower().endswith(WEIGHT_SUFFIXES)


class FileSink:
    """Fetch-engine sink for whole files: each verified chunk is written at its offsets
    (``into[path]`` is an open binary file or a bytearray)."""

    def __init__(self, files: Sequence[FileEntry], chunk_size: int, into: Mapping[str, object]) -> None:
        self._at: dict[str, list[tuple[str, int]]] = {}
        for f in files:
            for c in f.chunks:
                self._at.setdefault(c.id, []).append((f.path, c.index * chunk_size))
        self.chunks = ChunkRows.of_refs(list({c.id: c for f in files for c in f.chunks}.values()))
        self._into = into
        self._lock = threading.Lock()

    def regions(self, rows: np.ndarray) -> None:
        return None

    def landed_in_place(self, rows: np.ndarray, source: str = "network") -> None:  # never: regions() gives none
        raise AssertionError("file chunks are never received in place")

    def write(self, row: int, raw: Buffer, source: str = "network") -> None:
        data = raw if isinstance(raw, bytes) else bytes(memoryview(bytes_like(raw)).cast("B"))
        with self._lock:
            for path, offset in self._at[self.chunks.table.ids[row]]:
                target = self._into[path]
                if isinstance(target, bytearray):
                    target[offset:offset + len(data)] = data
                else:
                    os.pwrite(target.fileno(), data, offset)  # type: ignore[attr-defined]


def _check_hash(f: FileEntry, data: bytes | None, path: Path | None) -> None:
    if data is not None:
        digest = blake3.blake3(data).hexdigest()
    else:
        assert path is not None
        digest = file_hash(path)  # what push recorded for the file (chunking.folder)
    if digest != f.blake3:
        raise PullError(f"file {f.path}: its bytes do not match the manifest's BLAKE3 after every chunk was verified; "
                        "pull again (a replica may hold a damaged copy)", grpc.StatusCode.DATA_LOSS)


def read_file(client: ClusterClient, manifest: Manifest, path: str) -> bytes:
    """The bytes of the non-tensor file ``path`` of this version (e.g. ``config.json``)."""
    entry = manifest.file(path)
    if entry is None:
        have = ", ".join(f.path for f in manifest.files[:20]) or "none (it was pushed from a weights file, not a folder)"
        raise NotFound(f"{manifest.model} v{manifest.version} has no file {path!r}; its files: {have}")
    buf = bytearray(entry.size)
    if entry.chunks:
        sink = FileSink([entry], manifest.chunk_size, {path: buf})
        client.fetch(sink.chunks, sink, algorithm=manifest.hash_algorithm)
    data = bytes(buf)
    _check_hash(entry, data, None)
    return data


def shard_plan(manifest: Manifest) -> dict[str, tuple[TensorEntry, ...]]:
    """Which tensors go into which safetensors file of the pulled folder."""
    if not manifest.weight_files:
        return {SINGLE_FILE_NAME: manifest.tensors}
    out: dict[str, list[TensorEntry]] = {p: [] for p in manifest.weight_files}
    for t, k in zip(manifest.tensors, manifest.tensor_file, strict=True):
        out[manifest.weight_files[k]].append(t)
    return {p: tuple(ts) for p, ts in out.items()}


def pull_folder(
    seeds: str | Sequence[str],
    ref: str | ModelRef,
    out_dir: str | os.PathLike[str],
    *,
    token: str | None = None,
    progress: ProgressFn | None = None,
    options: PullOptions = PullOptions(),
    cluster: ClusterOptions | None = None,
    weights: bool = True,
) -> PullReport:
    """Pull ``ref`` as a model folder at ``out_dir`` (which must not exist yet).

    ``weights=False`` (``--no-weights``): only the other files (config, generation config,
    tokenizer), e.g. for ``vllm serve DIR --load-format pdparams``, which streams the weights from
    the cluster; weight files of other formats and weight indexes are left out too
    (``is_weight_file``), and ``PullReport.skipped`` names them."""
    t0 = time.perf_counter()
    progress = progress or no_progress
    final = Path(out_dir)
    if final.exists():
        raise TransferError(f"--out-dir {final} already exists; remove it or choose a new folder (nothing was written)",
                            grpc.StatusCode.ALREADY_EXISTS)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp's 0700 would hide the pulled folder from other users
    if not weights:
        try:
            report = _pull_files_only(seeds, ref, staging, token=token, options=options, cluster=cluster)
            _place(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return dataclasses.replace(report, seconds=time.perf_counter() - t0, path=str(final))
    shards: list[SafetensorsOut] = []

    def in_shards(manifest: Manifest, version: VersionInfo) -> Targets:
        # Each shard's own metadata as pushed (e.g. transformers' "format"), else "pt"; then where it came
        # from, last: a folder pulled and pushed again carries the old pull's model/version, now untrue.
        provenance = {"model": manifest.model, "version": str(version.number), "manifest_id": version.manifest_id}
        kept = dict(zip(manifest.weight_files, manifest.weight_file_metadata))
        tensors: dict[str, torch.Tensor] = {}
        fresh: list[torch.Tensor] = []
        try:
            for rel, entries in shard_plan(manifest).items():
                meta = {"format": "pt", **dict(kept.get(rel, ())), **provenance}
                out = SafetensorsOut(staging / rel, manifest, meta, only=entries)
                shards.append(out)
                tensors.update(out.targets.tensors)
                fresh.extend(out.targets.fresh)
        except (OSError, ValueError) as exc:
            raise write_failure(final, exc) from None
        return Targets(tensors, fresh)

    files_bytes = [0]

    def files(client: ClusterClient, manifest: Manifest) -> None:
        files_bytes[0] = _pull_files(client, manifest, staging)

    try:
        tensors, report = _pull(seeds, ref, token=token, progress=progress, options=options, cluster=cluster,
                                allocate=in_shards, then=files)
        del tensors  # views of the shards' mappings: released before they are closed
        t_save = time.perf_counter()
        for out in shards:
            out.commit()
        _place(staging, final)
    except BaseException:
        for out in shards:
            out.abort()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    now = time.perf_counter()
    return dataclasses.replace(report, seconds=now - t0, save_seconds=now - t_save, path=str(final),
                               bytes_total=report.bytes_total + files_bytes[0])


def _pull_files_only(seeds: str | Sequence[str], ref: str | ModelRef, staging: Path, *, token: str | None,
                     options: PullOptions, cluster: ClusterOptions | None) -> PullReport:
    """The version's non-weight files into ``staging`` (``pull_folder(weights=False)``)."""
    target = ModelRef.parse(ref) if isinstance(ref, str) else ref
    client = ClusterClient(seeds, token=token, config=options.session(), bulk=options.bulk, verify=options.verify,
                           cluster=cluster)
    with client:
        version = client.resolve_ref(target, linearizable=options.linearizable)
        manifest = client.manifest(version.manifest_id)
        files = [f for f in manifest.files if not is_weight_file(f.path)]
        skipped = tuple(f.path for f in manifest.files if is_weight_file(f.path))
        if not files:
            raise NotFound(f"{target} (v{version.number}) has no file besides its weights (pushed from a weights file, "
                           "not a model folder): nothing to pull without them; push the model folder (paramctl push DIR)")
        size = _pull_files(client, manifest, staging, files)
    return PullReport(model=target.model, version=version.number, tag=target.tag, manifest_id=version.manifest_id,
                      bytes_total=size, bytes_fetched=size, chunks_total=sum(len(f.chunks) for f in files),
                      chunks_unique=len({c.id for f in files for c in f.chunks}), seconds=0.0, fetch_seconds=0.0,
                      save_seconds=0.0, per_server={}, retried=0, skipped=skipped)


def _pull_files(client: ClusterClient, manifest: Manifest, staging: Path, files: Sequence[FileEntry] | None = None) -> int:
    """The version's non-tensor files (or ``files`` of them) into ``staging``, fsynced and checked against their BLAKE3."""
    files = manifest.files if files is None else files
    if not files:
        return 0
    with contextlib.ExitStack() as stack:
        handles = {}
        for f in files:
            target = staging / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            handle = stack.enter_context(open(target, "wb"))
            handles[f.path] = handle
            os.ftruncate(handle.fileno(), f.size)
        try:
            sink = FileSink(files, manifest.chunk_size, handles)
            client.fetch(sink.chunks, sink, algorithm=manifest.hash_algorithm)
        except ChunkingError as exc:
            raise PullError(f"{manifest.model} v{manifest.version}: {exc}", grpc.StatusCode.DATA_LOSS) from None
        for handle in handles.values():
            handle.flush()
            os.fsync(handle.fileno())
    for f in files:
        _check_hash(f, None, staging / f.path)
    return sum(f.size for f in files)


def _place(staging: Path, final: Path) -> None:
    """The complete folder into place: every file and folder fsynced, one rename, its parent fsynced."""
    _fsync_tree(staging)
    os.rename(staging, final)
    _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # some filesystems cannot fsync a folder


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, _files in os.walk(root):
        _fsync_dir(Path(dirpath))


def push_folder(seeds: str | Sequence[str], folder: str | os.PathLike[str], *, model: str, tag: str | None = None,
                token: str | None = None, **kwargs: object) -> PushReport:
    """``push`` of a model folder (the same as ``push(seeds, folder, ...)``); named for readers."""
    if not Path(folder).is_dir():
        raise TransferError(f"{folder} is not a folder", grpc.StatusCode.INVALID_ARGUMENT)
    return push(seeds, str(folder), model=model, tag=tag, token=token, **kwargs)  # type: ignore[arg-type]


__all__ = ["FileSink", "SINGLE_FILE_NAME", "WEIGHT_SUFFIXES", "is_weight_file", "pull_folder", "push_folder", "read_file",
           "shard_plan"]
