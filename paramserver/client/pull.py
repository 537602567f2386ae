"""Pull a version by reference into host tensors or a ``.safetensors`` file.

The client session (``paramserver.client.session.ClusterClient``) resolves the reference at the
leader (a pull right after a push sees it), fetches the proven manifest, and its fetch engine
reads every chunk from its replicas -- over the bulk ports when they are advertised, GetChunks
otherwise -- verified and received straight into the destination: tensors carved from recycled
host arenas (``paramserver.client.hostmem``) or the output file's pages
(``paramserver.client.safetensors_out``).
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Mapping

import grpc
import torch

from chunking.chunk_table import ChunkRows
from chunking.errors import ChunkingError
from chunking.manifest import Manifest
from paramserver.client.cluster_view import ClusterOptions
from paramserver.client.config import ClientSettings, resolve_settings, split_cluster_arg
from paramserver.client.errors import PATH_ERRORS, ConfigError, PullError, TransferError
from paramserver.client.hostmem import ArenaPool, HostMemoryConfig, Targets, allocate_targets
from paramserver.client.progress import ProgressFn, no_progress
from paramserver.client.refs import ModelRef, parse_ref
from paramserver.client.safetensors_out import NotSafetensors, SafetensorsOut
from paramserver.client.session import ClusterClient, SessionConfig, VersionInfo
from paramserver.client.sinks import TensorSink
from paramserver.client.verify import VERIFY_MODES


@dataclass(frozen=True)
class PullOptions:
    # Measured here (3 servers, 256 MiB, loopback, noisy 2 cores): 3 streams of 2 MiB messages
    # were at or near the best of {2,3,4,6} x {1,2,4} MiB; one stream per server was slowest.
    streams_per_server: int = 3  # parallel GetChunks reads per server
    message_bytes: int = 2 << 20  # GetChunks coalescing target
    linearizable: bool = True  # resolve the tag at the leader: a pull right after a push sees it
    # "crc" (default): size and CRC32C from the (content-id-verified) manifest; "content": also
    # every chunk's BLAKE3 content id (safe even against a replica that forges CRCs).
    verify: str = "crc"
    # Read chunk bytes over the members' bulk ports when they advertise one (never with TLS).
    bulk: bool = True
    # Connections per server on the bulk path. Measured here (3 servers, 256 MiB, 2 noisy cores):
    # 1 per server 1.4 GB/s, 3 per server 0.5 GB/s: more threads copying into fresh tensor pages
    # contend for the GIL and the page-fault lock, while one connection already fills the link.
    bulk_streams_per_server: int = 1
    bulk_down_s: float = 30.0  # after a bulk failure, use gRPC for that address this long
    # Carve the tensors out of host memory released by an earlier pull when one fits
    # (paramserver.client.hostmem): skips the kernel's zeroing of fresh pages.
    recycle_memory: bool = True

    def validate(self) -> PullOptions:
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}")
        if not 1 <= self.streams_per_server <= 16:
            raise ConfigError(f"streams_per_server must be between 1 and 16, got {self.streams_per_server}")
        if not 64 << 10 <= self.message_bytes <= 64 << 20:
            raise ConfigError(f"message_bytes must be between 64 KiB and 64 MiB, got {self.message_bytes}")
        if not 1 <= self.bulk_streams_per_server <= 16:
            raise ConfigError(f"bulk_streams_per_server must be between 1 and 16, got {self.bulk_streams_per_server}")
        if self.bulk_down_s < 0:
            raise ConfigError(f"bulk_down_s must be >= 0, got {self.bulk_down_s}")
        return self

    def session(self) -> SessionConfig:
        return SessionConfig(grpc_streams_per_server=self.streams_per_server, bulk_streams_per_server=self.bulk_streams_per_server,
                             get_message_bytes=self.message_bytes, bulk_down_s=self.bulk_down_s)


@dataclass(frozen=True)
class PullReport:
    model: str
    version: int
    tag: str | None
    manifest_id: str
    bytes_total: int  # raw tensor bytes
    bytes_fetched: int  # stored bytes received (retries included)
    chunks_total: int
    chunks_unique: int
    seconds: float  # resolve + fetch + verify (+ save when writing a file)
    fetch_seconds: float
    save_seconds: float
    per_server: Mapping[str, int]  # stored bytes received from each server
    retried: int  # chunk fetches that failed once and were fetched elsewhere
    path: str | None = None
    bulk_bytes: int = 0  # stored bytes that came over bulk ports (the rest over GetChunks)
    bulk_fallbacks: int = 0  # bulk requests that failed and went to GetChunks
    skipped: tuple[str, ...] = ()  # files of the version not written (pull_folder(weights=False): other weight files)

    @property
    def gbps(self) -> float:
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def fetch_gbps(self) -> float:
        return self.bytes_total / self.fetch_seconds / 1e9 if self.fetch_seconds > 0 else 0.0


def pull_tensors(
    seeds: str | Sequence[str] | ClientSettings | ModelRef | None = None,
    ref: str | ModelRef | None = None,
    *,
    token: str | None = None,
    progress: ProgressFn | None = None,
    options: PullOptions | None = None,
    cluster: ClusterOptions | None = None,
) -> tuple[dict[str, torch.Tensor], PullReport]:
    """The verified tensors of a version (CPU, in manifest order) and a report.

    ``pull_tensors(ref)``: the cluster, token, TLS, verify mode and bulk come as for ``paramctl
    pull`` (see :func:`_pull`)."""
    at, target = split_cluster_arg(seeds, ref, what="ref")
    return _pull(at, target, token=token, progress=progress, options=options, cluster=cluster)


Allocate = Callable[[Manifest, VersionInfo], Targets]


def _pull(
    seeds: str | Sequence[str] | ClientSettings | None,
    ref: str | ModelRef,
    *,
    token: str | None,
    progress: ProgressFn | None,
    options: PullOptions | None,
    cluster: ClusterOptions | None,
    allocate: Allocate | None = None,
    then: Callable[[ClusterClient, Manifest], None] | None = None,
) -> tuple[dict[str, torch.Tensor], PullReport]:
    """pull_tensors, with the destination chosen by ``allocate(manifest, version)``; ``then(client,
    manifest)`` runs after the tensors landed, on the same client (a folder's other files).

    Without ``cluster`` (ClusterOptions, used as it is), what is not given comes as for ``paramctl
    pull``: arguments > environment > ``PARAMS_CONFIG`` file > defaults, the verify mode and bulk
    included unless ``options`` are given."""
    t0 = time.perf_counter()
    if cluster is None:
        settings = resolve_settings(seeds, token=token)
        cluster = settings.cluster_options(write=False)
        options = options or PullOptions(verify=settings.verify, bulk=settings.bulk)
    options = (options or PullOptions()).validate()
    progress = progress or no_progress
    target = parse_ref(ref) if isinstance(ref, str) else ref
    with ClusterClient(cluster=cluster, token=token, config=options.session(), bulk=options.bulk, verify=options.verify) as client:
        progress("resolve", 0, 1)
        version = client.resolve_ref(target, linearizable=options.linearizable)
        manifest = client.manifest(version.manifest_id)
        progress("resolve", 1, 1)
        if allocate is not None:
            targets = allocate(manifest, version)
        else:
            targets = allocate_targets(manifest, pool=None if options.recycle_memory else ArenaPool(HostMemoryConfig(keep_bytes=0)))
        tensors = targets.tensors
        chunks = ChunkRows.of(manifest.chunks)
        total = int(manifest.chunks.raw_size[chunks.rows].sum())
        sink = TensorSink(manifest, tensors, on_bytes=lambda done: progress("fetch", done, total))
        t_fetch = time.perf_counter()
        prefault = targets.prefaulter().start()
        try:
            stats = client.fetch(chunks, sink, algorithm=manifest.hash_algorithm, tensors_of=manifest.tensors_of_chunk)
            sink.assembler.raise_if_incomplete()
        except ChunkingError as exc:
            raise PullError(f"{target}: {exc}", grpc.StatusCode.DATA_LOSS) from None
        finally:
            prefault.stop()
        progress("fetch", total, total)
        if then is not None:
            then(client, manifest)
        fetch_s = time.perf_counter() - t_fetch
        out = {t.name: tensors[t.name] for t in manifest.tensors}
        transport = client.transport.stats
        report = PullReport(
            model=target.model,
            version=version.number,
            tag=target.tag,
            manifest_id=version.manifest_id,
            bytes_total=manifest.raw_bytes,
            bytes_fetched=stats.stored_bytes,
            chunks_total=len(manifest.chunks),
            chunks_unique=len(chunks),
            seconds=time.perf_counter() - t0,
            fetch_seconds=fetch_s,
            save_seconds=0.0,
            per_server=dict(stats.by_server),
            retried=stats.failovers,
            bulk_bytes=transport.bulk_bytes,
            bulk_fallbacks=transport.bulk_fallbacks,
        )
        return out, report


def write_failure(out: object, exc: BaseException) -> TransferError:
    """Writing the pulled weights failed: a path the user named that cannot be written is a bad
    argument (exit 2); anything else (a full disk) is an error of its own."""
    if isinstance(exc, NotSafetensors):
        return TransferError(f"cannot write {out} as .safetensors: {exc}", grpc.StatusCode.INVALID_ARGUMENT)
    if isinstance(exc, OSError) and exc.strerror:
        text = f"cannot write {out}: {exc.strerror}" + (f" ({exc.filename})" if exc.filename else "")
    else:
        text = f"cannot write {out}: {exc}"
    code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, PATH_ERRORS) else grpc.StatusCode.UNKNOWN
    return TransferError(text + "; check the path and its permissions", code)


def pull(
    seeds: str | Sequence[str] | ClientSettings | ModelRef | None = None,
    ref: str | ModelRef | os.PathLike[str] | None = None,
    out: str | os.PathLike[str] | None = None,
    *,
    token: str | None = None,
    progress: ProgressFn | None = None,
    options: PullOptions | None = None,
    cluster: ClusterOptions | None = None,
) -> PullReport:
    """Pull ``ref`` ("model:tag", "model@N" or "model") into a .safetensors file at ``out``.

    ``pull(ref, out)``: the cluster, token, TLS, verify mode and bulk come as for ``paramctl pull``
    (arguments > environment > ``PARAMS_CONFIG`` file > defaults).

    Chunks are received straight into the output file's pages (paramserver.client.safetensors_out):
    no second copy of the model in memory. The file appears, complete and fsynced, only when
    every chunk is in and verified; a failed pull leaves nothing at ``out``.
    """
    at, target, out = split_cluster_arg(seeds, ref, out, what="ref and out")
    t0 = time.perf_counter()
    progress = progress or no_progress
    holder: list[SafetensorsOut] = []

    def in_file(manifest: Manifest, version: VersionInfo) -> Targets:
        meta = {"model": manifest.model, "version": str(version.number), "manifest_id": version.manifest_id}
        try:
            holder.append(SafetensorsOut(out, manifest, meta))
        except (OSError, ValueError) as exc:
            raise write_failure(out, exc) from None
        return holder[0].targets

    try:
        tensors, report = _pull(at, target, token=token, progress=progress, options=options, cluster=cluster, allocate=in_file)
    except BaseException:
        if holder:
            holder[0].abort()
        raise
    del tensors  # views of the file's mapping: released before it is closed
    t_save = time.perf_counter()
    progress("save", 0, report.bytes_total)
    try:
        holder[0].commit()
    except OSError as exc:
        holder[0].abort()
        raise write_failure(out, exc) from None
    progress("save", report.bytes_total, report.bytes_total)
    now = time.perf_counter()
    return dataclasses.replace(report, seconds=now - t0, save_seconds=now - t_save, path=str(out))


__all__ = ["VERIFY_MODES", "ModelRef", "PullOptions", "PullReport", "parse_ref", "pull", "pull_tensors", "write_failure"]
