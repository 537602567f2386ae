"""Pull a version by tag: resolve, fetch the manifest, stream chunks from replicas, verify, save.

Chunks are spread over their replicas by bytes already assigned, fetched with
a few parallel GetChunks streams per server (allow_partial, so one missing or
corrupt chunk does not end a stream), verified (CRC32C, size, content id) and
written straight into the destination tensors. When a member advertises a bulk
port (paramserver.bulk) and TLS is off, chunk bytes come over it instead: plain
TCP, received straight into the destination tensors (or a reused buffer), no gRPC
per-byte cost; any bulk failure falls
back to GetChunks for that request and parks the address for a while. A chunk that fails on one
replica is fetched from another, then from any member (repair may have moved
it); a replica that served bad bytes is told with ReportCorrupt. The worker
package has the full-featured client (cache, heatmap order, GPU staging);
this one is the simple, correct path for paramctl, the demo and benchmarks.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import grpc
import torch

from chunking.assembler import Assembler
from chunking.codec import decode_chunk
from chunking.errors import ChunkCorrupt, ChunkingError, ManifestError
from chunking.hashing import content_id, crc32c
from chunking.manifest import ChunkRef, Manifest

from . import bulk as bulk_proto
from .bulkclient import BulkError, BulkItem, BulkPool
from .clusterview import RETRYABLE, ClusterOptions, ClusterView, parse_seeds
from .errors import ConfigError
from .hostmem import ArenaPool, HostMemoryConfig, Targets, allocate_targets
from .progress import ProgressFn, no_progress
from .proto import pb
from .rawchunks import RawChunk, get_chunks_raw, open_channel
from .safetensors_out import SafetensorsOut
from .transfer_errors import PullError, TransferError, rpc_code, rpc_details


VERIFY_MODES = ("content", "crc")


@dataclass(frozen=True)
class PullOptions:
    # Measured here (3 servers, 256 MiB, loopback, noisy 2 cores): 3 streams of 2 MiB messages
    # were at or near the best of {2,3,4,6} x {1,2,4} MiB; one stream per server was slowest.
    streams_per_server: int = 3  # parallel GetChunks calls per server
    message_bytes: int = 2 << 20  # GetChunks coalescing target
    rounds: int = 4  # fetch rounds: later ones retry what failed on other replicas
    linearizable: bool = True  # resolve the tag at the leader: a pull right after a push sees it
    # "crc" (default, as the worker): raw chunks are checked by size and the manifest's CRC32C
    # (the manifest itself is verified by its content id, so its CRCs are authentic): catches
    # corruption on disk or the wire; BLAKE3 would cost ~0.4 ns/B more on the client, and the
    # servers check it on ingest and the scrubber re-checks stored chunks. "content": every
    # chunk's BLAKE3 content id is checked too (safe even against a replica that forges CRCs).
    verify: str = "crc"
    # Read chunk bytes over the members' bulk ports when they advertise one (never with TLS).
    bulk: bool = True
    # Connections per server on the bulk path. Measured here (3 servers, 256 MiB, 2 noisy cores):
    # 1 per server 1.4 GB/s, 3 per server 0.5 GB/s: more threads copying into fresh tensor pages
    # contend for the GIL and the page-fault lock, while one connection already fills the link.
    bulk_streams_per_server: int = 1
    bulk_down_s: float = 30.0  # after a bulk failure, use gRPC for that address this long
    # Carve the tensors out of host memory released by an earlier pull when one fits
    # (paramserver.hostmem): skips the kernel's zeroing of fresh pages, the largest client cost.
    recycle_memory: bool = True

    def validate(self) -> PullOptions:
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}")
        if not 1 <= self.streams_per_server <= 16:
            raise ConfigError(f"streams_per_server must be between 1 and 16, got {self.streams_per_server}")
        if not 64 << 10 <= self.message_bytes <= 64 << 20:
            raise ConfigError(f"message_bytes must be between 64 KiB and 64 MiB, got {self.message_bytes}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if not 1 <= self.bulk_streams_per_server <= 16:
            raise ConfigError(f"bulk_streams_per_server must be between 1 and 16, got {self.bulk_streams_per_server}")
        if self.bulk_down_s < 0:
            raise ConfigError(f"bulk_down_s must be >= 0, got {self.bulk_down_s}")
        return self


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

    @property
    def gbps(self) -> float:
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def fetch_gbps(self) -> float:
        return self.bytes_total / self.fetch_seconds / 1e9 if self.fetch_seconds > 0 else 0.0


@dataclass(frozen=True)
class ModelRef:
    model: str
    tag: str | None = None
    version: int | None = None  # None with no tag: the latest version

    def __str__(self) -> str:
        if self.tag:
            return f"{self.model}:{self.tag}"
        return f"{self.model}@{self.version}" if self.version else self.model


def parse_ref(text: str) -> ModelRef:
    """"model:tag", "model@3" (a version number) or "model" (its latest version)."""
    model, sep, tag = text.partition(":")
    if sep:
        if not model or not tag:
            raise ConfigError(f"{text!r} is not MODEL:TAG (e.g. resnet50:prod)")
        return ModelRef(model, tag=tag)
    model, sep, number = text.partition("@")
    if sep:
        if not model or not number.isdigit() or int(number) < 1:
            raise ConfigError(f"{text!r} is not MODEL@VERSION (e.g. resnet50@3)")
        return ModelRef(model, version=int(number))
    if not text:
        raise ConfigError("empty model reference: use MODEL:TAG, MODEL@VERSION or MODEL")
    return ModelRef(text)


def resolve(view: ClusterView, ref: ModelRef, linearizable: bool = True) -> pb.Version:
    """The version ``ref`` names, asked of the leader (linearizable) and, failing that, of any member."""

    def ask(client_linear: bool) -> pb.Version:
        client = view.leader_client() if client_linear else view.any_client()
        if ref.tag:
            return client.resolve_tag(ref.model, ref.tag, linearizable=client_linear).version
        if ref.version:
            return client.get_version(ref.model, ref.version, linearizable=client_linear).version
        versions = client.list_versions(ref.model).versions
        if not versions:
            raise PullError(f"model {ref.model} has no versions; push one first", grpc.StatusCode.NOT_FOUND)
        return max(versions, key=lambda v: v.number)

    try:
        return ask(linearizable)
    except grpc.RpcError as exc:
        if linearizable and rpc_code(exc) in RETRYABLE:
            try:
                return ask(False)
            except grpc.RpcError as exc2:
                exc = exc2
        raise PullError(f"cannot resolve {ref}: {rpc_details(exc)}", rpc_code(exc)) from None


# Manifests are immutable and named by their content id: a process that pulls a version again
# (a reload, a rollback, a rolling restart) reuses the parsed one; parsing and planning 4,000
# chunks costs ~50 ms of Python on each pull of a 1 GiB model.
_MANIFESTS: OrderedDict[str, Manifest] = OrderedDict()
_MANIFESTS_KEPT = 8
_MANIFESTS_LOCK = threading.Lock()


def fetch_manifest_by_id(view: ClusterView, manifest_id: str) -> Manifest:
    """Manifest bytes from the leader or any member, accepted only if they hash to ``manifest_id``."""
    with _MANIFESTS_LOCK:
        cached = _MANIFESTS.get(manifest_id)
        if cached is not None:
            _MANIFESTS.move_to_end(manifest_id)
            return cached
    manifest = _fetch_manifest(view, manifest_id)
    manifest.plan  # noqa: B018 - plan once, here, rather than on every pull
    with _MANIFESTS_LOCK:
        _MANIFESTS[manifest_id] = manifest
        while len(_MANIFESTS) > _MANIFESTS_KEPT:
            _MANIFESTS.popitem(last=False)
    return manifest


def _fetch_manifest(view: ClusterView, manifest_id: str) -> Manifest:
    addresses = [view.leader_client().address, *(m.grpc_address for m in view.members.values())]
    problems: list[str] = []
    for address in dict.fromkeys(addresses):
        try:
            reply = view.client(address).get_manifest(manifest_id=manifest_id)
            return Manifest.from_bytes(reply.data, expected_id=manifest_id)
        except grpc.RpcError as exc:
            if rpc_code(exc) in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise PullError(f"{address}: {rpc_details(exc)}", rpc_code(exc)) from None
            problems.append(f"{address}: {rpc_code(exc).name}")
        except ManifestError as exc:
            problems.append(f"{address}: {exc}")
    raise PullError(f"manifest {manifest_id} is not readable from any member ({'; '.join(problems)})", grpc.StatusCode.UNAVAILABLE)


class _Fetcher:
    def __init__(self, view: ClusterView, manifest: Manifest, targets: Mapping[str, torch.Tensor], options: PullOptions) -> None:
        self.view = view
        self.manifest = manifest
        self.options = options
        # The targets are fresh and reach the caller only when complete: raw chunks may be
        # received straight into them (no bounce buffer) and verified in place.
        self.assembler = Assembler(manifest, targets, private_targets=True)
        self.refs: dict[str, ChunkRef] = {r.id: r for r in manifest.unique_chunks()}
        self.indices = self.assembler.indices_by_id
        self.lock = threading.Lock()
        self.raw_done = 0
        self.per_server: Counter[str] = Counter()
        self.down: set[str] = set()
        # Servers each chunk was asked of, as "ps1\nps2": strings are not tracked by the garbage
        # collector, thousands of sets would be (and would set off full collections).
        self.tried: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.retried = 0
        opts = view.options
        use_bulk = options.bulk and not opts.tls and opts.tls_ca is None
        self.bulk = BulkPool(opts.token, down_for_s=options.bulk_down_s) if use_bulk else None
        self.bulk_bytes = 0
        self.bulk_fallbacks = 0
        self.direct: dict[str, memoryview] = {}  # chunk id -> target region it is being received into

    def _into(self, chunk_id: str, codec: str, stored_size: int) -> memoryview | None:
        """Where to receive a bulk chunk: its place in the target tensor when it is a raw chunk
        that fills one region whole (verified there before it counts), else None (a bounce buffer)."""
        ref = self.refs.get(chunk_id)
        if ref is None or codec != "raw" or ref.codec != "raw" or stored_size != ref.stored_size:
            return None
        view = self.assembler.direct_view(self.indices[chunk_id][0])
        if view is not None:
            self.direct[chunk_id] = view
        return view

    def _write(self, server: str, item: RawChunk | BulkItem) -> None:
        ref = self.refs[item.id]
        direct = self.direct.pop(item.id, None)
        if direct is not None and item.data is direct:
            if item.crc32c != ref.crc32c or crc32c(direct) != ref.crc32c or (
                self.options.verify == "content" and content_id(direct, self.manifest.hash_algorithm) != ref.id
            ):
                raise ChunkCorrupt(ref.id, "CRC32C or content id of the received bytes does not match the manifest", (), ref.index)
            self.assembler.commit_direct(self.indices[item.id][0])
        elif item.codec == ref.codec and item.crc32c == ref.crc32c:
            if self.options.verify == "crc" and ref.codec == "raw":
                if len(item.data) != ref.stored_size or crc32c(item.data) != ref.crc32c:
                    raise ChunkCorrupt(ref.id, "size or CRC32C of the stored bytes does not match the manifest", (), ref.index)
                for index in self.indices[item.id]:
                    self.assembler.write_chunk(index, item.data)
            else:
                self.assembler.add_stored(ref, item.data)
        else:
            # The server kept another encoding of the same raw bytes (pushed earlier with another
            # codec): check it against what it declares, then prove the raw bytes by the content id.
            theirs = dataclasses.replace(ref, codec=item.codec, crc32c=item.crc32c, stored_size=len(item.data))
            raw = decode_chunk(theirs, item.data, algorithm=self.manifest.hash_algorithm)
            for index in self.indices[item.id]:
                self.assembler.write_chunk(index, raw)
        with self.lock:
            self.raw_done += ref.raw_size
            self.per_server[server] += len(item.data)

    def _accept(self, server: str, item: RawChunk | BulkItem, pending: set[str], failed: list[str], corrupt: list[str]) -> None:
        if item.id not in pending:
            return  # not asked for (or sent twice): never trusted
        pending.discard(item.id)
        try:
            self._write(server, item)
        except ChunkCorrupt as exc:
            self.errors[item.id] = f"{server}: {exc}"
            corrupt.append(item.id)
            failed.append(item.id)

    def _bulk(self, server: str, address: str, ids: list[str], pending: set[str], failed: list[str], corrupt: list[str]) -> None:
        """Read ``ids`` over the bulk port; what is still pending afterwards goes to GetChunks."""
        assert self.bulk is not None
        client = self.bulk.client(address)
        if client is None:
            return
        got = 0
        try:
            # A raw chunk that fills one tensor region is received straight into it (``_into``)
            # and verified there; others land in the connection's reused buffer and are checked
            # and copied. The servers' streams (one thread each) overlap: recv_into and crc32c
            # release the GIL, and the kernel keeps receiving into the socket buffer meanwhile.
            for item in client.fetch(ids, self._into):
                if item.status == bulk_proto.OK:
                    got += len(item.data)
                    self._accept(server, item, pending, failed, corrupt)  # a BulkItem has the fields of a RawChunk
                elif item.id in pending:
                    pending.discard(item.id)
                    self.errors[item.id] = f"{server}: {item.status_name} {item.message}"
                    failed.append(item.id)  # CORRUPT: the server quarantined it and queued its repair
        except BulkError as exc:
            self.bulk.mark_broken(address)
            with self.lock:
                self.bulk_fallbacks += 1
            self.errors.update({cid: f"{server}: {exc}" for cid in pending})
        with self.lock:
            self.bulk_bytes += got

    def _task(self, server: str, ids: list[str]) -> list[str]:
        """Fetch ``ids`` from ``server``; return the ids that failed there."""
        pending = set(ids)
        failed: list[str] = []
        corrupt: list[str] = []
        opts = self.view.options
        member = self.view.members[server]
        if self.bulk is not None and member.bulk_address:
            self._bulk(server, member.bulk_address, ids, pending, failed, corrupt)
            if not pending:
                self._report(server, corrupt)
                return failed
            ids = [cid for cid in ids if cid in pending]  # the rest over gRPC
        # A channel per task: parallel streams then use separate connections (and HTTP/2 windows).
        channel = open_channel(member.grpc_address, token=opts.token, max_message_bytes=opts.max_message_bytes, tls=opts.tls, tls_ca=opts.tls_ca)
        try:
            for chunks, errors in get_chunks_raw(channel, ids, max_message_bytes=self.options.message_bytes):
                for item in chunks:
                    self._accept(server, item, pending, failed, corrupt)
                for ack in errors:
                    if ack.id in pending:
                        pending.discard(ack.id)
                        self.errors[ack.id] = f"{server}: {pb.ChunkStatus.Name(ack.status)} {ack.message}"
                        failed.append(ack.id)
        except grpc.RpcError as exc:
            if rpc_code(exc) in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise PullError(f"{server}: {rpc_details(exc)}", rpc_code(exc)) from None
            if rpc_code(exc) in RETRYABLE:
                self.down.add(server)
            for cid in pending:
                self.errors[cid] = f"{server}: {rpc_code(exc).name} {rpc_details(exc)}"
            failed.extend(pending)
            pending.clear()
        except ValueError as exc:  # a malformed reply: treat like a failed stream
            for cid in pending:
                self.errors[cid] = f"{server}: {exc}"
            failed.extend(pending)
            pending.clear()
        finally:
            channel.close()
        # Asked for but neither sent nor reported: the stream ended early.
        for cid in pending:
            self.errors[cid] = f"{server}: not in the reply"
        failed.extend(pending)
        self._report(server, corrupt)
        return failed

    def _report(self, server: str, corrupt: list[str]) -> None:
        if corrupt:
            try:
                self.view.server_client(server).report_corrupt(corrupt, server_id=server, reporter="paramctl-pull", reason="pull verification failed")
            except grpc.RpcError:
                pass  # best effort: the scrubber finds it too

    def _streams(self, server: str) -> int:
        member = self.view.members.get(server)
        if self.bulk is not None and member is not None and member.bulk_address and self.bulk.client(member.bulk_address) is not None:
            return self.options.bulk_streams_per_server
        return self.options.streams_per_server

    def _assign(self, ids: Sequence[str]) -> tuple[dict[str, list[str]], list[str]]:
        load: Counter[str] = Counter()
        plan: dict[str, list[str]] = {}
        stuck: list[str] = []
        everyone = sorted(self.view.members)
        for cid in ids:
            tried = self.tried.get(cid, "").split("\n")
            ring = [s for s in self.view.replicas(cid) if s not in tried and s not in self.down]
            candidates = ring or [s for s in everyone if s not in tried and s not in self.down]
            if not candidates:
                stuck.append(cid)
                continue
            best = min(candidates, key=lambda s: load[s])
            load[best] += self.refs[cid].stored_size
            plan.setdefault(best, []).append(cid)
            self.tried[cid] = f"{self.tried[cid]}\n{best}" if cid in self.tried else best
        return plan, stuck

    def run(self, progress: ProgressFn) -> None:
        ids = list(self.refs)
        # Chunks fill every index they are used at; count raw bytes per distinct chunk.
        total = sum(r.raw_size for r in self.refs.values())
        streams = max(self.options.streams_per_server, self.options.bulk_streams_per_server)
        with ThreadPoolExecutor(max_workers=max(1, len(self.view.members) * streams), thread_name_prefix="pull") as pool:
            for round_no in range(self.options.rounds):
                plan, stuck = self._assign(ids)
                if stuck and not plan:
                    break
                futures: list[Future[list[str]]] = []
                for server, server_ids in plan.items():
                    n = min(self._streams(server), len(server_ids))
                    step = -(-len(server_ids) // n)
                    for i in range(0, len(server_ids), step):
                        futures.append(pool.submit(self._task, server, server_ids[i : i + step]))
                failed: list[str] = list(stuck)
                pending_f = set(futures)
                while pending_f:
                    done, pending_f = wait(pending_f, timeout=0.1, return_when=FIRST_COMPLETED)
                    for f in done:
                        failed.extend(f.result())
                    progress("fetch", self.raw_done, total)
                if round_no > 0:
                    self.retried += len(ids) - len(failed)
                ids = failed
                if not ids:
                    break
        progress("fetch", self.raw_done, total)
        if ids:
            example = ids[0]
            raise PullError(
                f"{len(ids)} of {len(self.refs)} chunks of {self.manifest.model} could not be fetched intact from any replica "
                f"(e.g. {example}: {self.errors.get(example, 'no replica reachable')}); unreachable: {', '.join(sorted(self.down)) or 'none'}. "
                "Retry when the servers are back; repair restores lost replicas",
                grpc.StatusCode.UNAVAILABLE,
            )
        self.assembler.raise_if_incomplete()


def pull_tensors(
    seeds: str | Sequence[str],
    ref: str | ModelRef,
    *,
    token: str | None = None,
    progress: ProgressFn | None = None,
    options: PullOptions = PullOptions(),
    cluster: ClusterOptions | None = None,
) -> tuple[dict[str, torch.Tensor], PullReport]:
    """The verified tensors of a version (CPU, in manifest order) and a report."""
    return _pull(seeds, ref, token=token, progress=progress, options=options, cluster=cluster)


Allocate = Callable[[Manifest, pb.Version], Targets]


def _pull(
    seeds: str | Sequence[str],
    ref: str | ModelRef,
    *,
    token: str | None,
    progress: ProgressFn | None,
    options: PullOptions,
    cluster: ClusterOptions | None,
    allocate: Allocate | None = None,
) -> tuple[dict[str, torch.Tensor], PullReport]:
    """pull_tensors, with the destination chosen by ``allocate(manifest, version)``."""
    t0 = time.perf_counter()
    options.validate()
    progress = progress or no_progress
    target = parse_ref(ref) if isinstance(ref, str) else ref
    cluster = cluster or ClusterOptions(parse_seeds(seeds), token=token)
    with ClusterView.connect(cluster) as view:
        progress("resolve", 0, 1)
        version = resolve(view, target, options.linearizable)
        manifest = fetch_manifest_by_id(view, version.manifest_id)
        progress("resolve", 1, 1)
        if allocate is not None:
            targets = allocate(manifest, version)
        else:
            targets = allocate_targets(manifest, pool=None if options.recycle_memory else ArenaPool(HostMemoryConfig(keep_bytes=0)))
        tensors = targets.tensors
        t_fetch = time.perf_counter()
        fetcher = _Fetcher(view, manifest, tensors, options)
        prefault = targets.prefaulter().start()
        try:
            fetcher.run(progress)
        except ChunkingError as exc:
            raise PullError(f"{target}: {exc}", grpc.StatusCode.DATA_LOSS) from None
        finally:
            prefault.stop()
            if fetcher.bulk is not None:
                fetcher.bulk.close()
        fetch_s = time.perf_counter() - t_fetch
        out = {t.name: tensors[t.name] for t in manifest.tensors}
        report = PullReport(
            model=target.model,
            version=version.number,
            tag=target.tag,
            manifest_id=version.manifest_id,
            bytes_total=manifest.raw_bytes,
            bytes_fetched=sum(fetcher.per_server.values()),
            chunks_total=len(manifest.chunks),
            chunks_unique=len(fetcher.refs),
            seconds=time.perf_counter() - t0,
            fetch_seconds=fetch_s,
            save_seconds=0.0,
            per_server=dict(fetcher.per_server),
            retried=fetcher.retried,
            bulk_bytes=fetcher.bulk_bytes,
            bulk_fallbacks=fetcher.bulk_fallbacks,
        )
        return out, report


def pull(
    seeds: str | Sequence[str],
    ref: str | ModelRef,
    out: str | os.PathLike[str],
    *,
    token: str | None = None,
    progress: ProgressFn | None = None,
    options: PullOptions = PullOptions(),
    cluster: ClusterOptions | None = None,
) -> PullReport:
    """Pull ``ref`` ("model:tag", "model@N" or "model") into a .safetensors file at ``out``.

    Chunks are received straight into the output file's pages (paramserver.safetensors_out):
    no second copy of the model in memory. The file appears, complete and fsynced, only when
    every chunk is in and verified; a failed pull leaves nothing at ``out``.
    """
    t0 = time.perf_counter()
    progress = progress or no_progress
    holder: list[SafetensorsOut] = []

    def in_file(manifest: Manifest, version: pb.Version) -> Targets:
        meta = {"model": manifest.model, "version": str(version.number), "manifest_id": version.manifest_id}
        try:
            holder.append(SafetensorsOut(out, manifest, meta))
        except (OSError, ValueError) as exc:
            raise TransferError(f"cannot write {out}: {exc}", grpc.StatusCode.UNKNOWN) from None
        return holder[0].targets

    try:
        tensors, report = _pull(seeds, ref, token=token, progress=progress, options=options, cluster=cluster, allocate=in_file)
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
        raise TransferError(f"cannot write {out}: {exc}", grpc.StatusCode.UNKNOWN) from None
    progress("save", report.bytes_total, report.bytes_total)
    now = time.perf_counter()
    return dataclasses.replace(report, seconds=now - t0, save_seconds=now - t_save, path=str(out))


__all__ = ["VERIFY_MODES", "pull", "pull_tensors", "PullOptions", "PullReport", "ModelRef", "parse_ref", "resolve", "fetch_manifest_by_id"]
