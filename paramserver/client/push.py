"""Push a model into the cluster: pack, dedup, replicate with W acks, commit.

Protocol (invariant 2: a version is committed only after every chunk it names
reached its write quorum):

1. ClusterInfo -> the ring, R and W, exactly as the servers compute them;
2. pack the weights into chunks (with the parent's manifest as ``previous`` so
   unchanged chunks keep their ``introduced_in``) as a stream: each batch of
   chunks is checked with HasChunks on its replicas (dedup, one batch ahead of
   the sender) and the missing ones are sent while later ones are still being
   hashed (``paramserver.client.push_sender.SendSession``: the servers' bulk
   write ports, gRPC PutChunks as the fallback); acks are counted per chunk;
3. the manifest, complete once the last chunk is packed, goes last; blobs short
   of W after a failed stream are checked again and re-sent (bounded rounds);
4. CommitVersion at the leader, following it through an election (a silent
   leader is left as soon as a member names a newer one); sent again only after
   checking that an earlier try did not land.

Memory stays bounded whatever the model size: only the batches in flight are held.
Nothing is committed unless step 4 runs, so a failed or interrupted push
leaves only orphan chunks, which the servers collect later.
"""
from __future__ import annotations

import getpass
import re
import socket
import os
import time
from collections import deque
from functools import partial
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Sequence

import grpc
import numpy as np

from chunking.config import ChunkingConfig
from chunking.errors import ChunkingError
from chunking.hashing import crc32c
from chunking.hashing import Buffer
from chunking.manifest import ChunkRef
from chunking.folder import FolderPackResult, FolderPackStream, pack_folder_stream
from chunking.pack import PackResult, PackStream, pack_stream
from chunking.sources import Source
from consensus.errors import Invalid
from consensus.validation import check_name

from paramserver.client.rpc import ChunkData
from paramserver.client.cluster_view import ClusterOptions, ClusterView
from paramserver.client.config import ClientSettings, resolve_settings, split_cluster_arg
from paramserver.client.errors import ConfigError
from paramserver.client.progress import ProgressFn, no_progress
from paramserver.client.push_plan import AckLedger, Item, plan_uploads, wanted_by_server
from paramserver.client.push_sender import SendOptions, SendSession
from paramserver.client.errors import ClusterUnreachable, PushError, TransferError, rpc_code, rpc_details
from paramserver.client.session import ClusterClient
# head_version, fetch_manifest and commit: re-exported, their home is the session's writes
from paramserver.client.writes import commit, fetch_manifest, head_version

Parent = int | None | Literal["head"]

# PutChunks failures another round would only repeat (bad token, refused bytes): the push stops
# at once. Others (a server dying, DATA_LOSS in transit) are retried.
FATAL_STREAM_CODES = frozenset({
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
})  # fmt: skip
# A full disk (or a message over one server's limit) is that server's problem: the push goes on
# to the other replicas, and commits if they reach W; it stops at once when every server refuses.
PER_SERVER_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class PushOptions:
    queue_bytes: int = 32 << 20  # per-server send queue
    stream_bytes: int = 512 << 20  # one PutChunks call is closed (and acked) after about this much
    batch_bytes: int = 4 << 20  # one PutChunks message
    has_batch: int = 16384  # ids per HasChunks call
    dedup_batch_bytes: int = 32 << 20  # chunks are checked (HasChunks) and sent in batches of about this many stored bytes
    rounds: int = 3  # send rounds: the first sends everything missing, later ones what is still short of W
    commit_deadline_s: float = 60.0  # keep retrying CommitVersion on UNAVAILABLE this long
    force: bool = False  # commit even when concurrent with the head (kept as a forced version)

    def validate(self) -> PushOptions:
        if self.queue_bytes < 1 << 20:
            raise ConfigError(f"queue_bytes must be at least 1 MiB, got {self.queue_bytes}")
        if self.stream_bytes < self.batch_bytes or self.batch_bytes < 64 << 10:
            raise ConfigError("batch_bytes must be >= 64 KiB and stream_bytes >= batch_bytes")
        if not 1 <= self.has_batch <= 1 << 20:
            raise ConfigError(f"has_batch must be between 1 and {1 << 20}, got {self.has_batch}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if self.commit_deadline_s <= 0:
            raise ConfigError(f"commit_deadline_s must be > 0, got {self.commit_deadline_s}")
        return self


@dataclass(frozen=True)
class PushReport:
    model: str
    version: int
    manifest_id: str
    parent: int | None
    tag: str | None
    clock: Mapping[str, int]
    bytes_total: int  # raw tensor bytes of the version
    bytes_stored: int  # stored (encoded) bytes of its distinct chunks
    bytes_sent: int  # stored bytes of the distinct chunks uploaded (each counted once)
    wire_bytes: int  # bytes over all streams (a chunk counts once per replica it went to)
    chunks_total: int
    chunks_unique: int
    chunks_deduplicated: int  # distinct chunks no reachable replica lacked
    chunks_sent: int
    seconds: float
    pack_seconds: float
    upload_seconds: float
    replication: int
    write_quorum: int
    unreachable: tuple[str, ...] = ()  # servers that took no part (down or failing)
    refused: Mapping[str, str] = field(default_factory=dict)  # server -> why its chunks failed (a full disk, a crash)
    forced: bool = False
    servers: tuple[str, ...] = field(default=())
    commit_seconds: float = 0.0  # CommitVersion: the leader's quorum check of every chunk, then Raft

    @property
    def gbps(self) -> float:
        """Model bytes per second, end to end (pack + dedup + upload + commit)."""
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def upload_gbps(self) -> float:
        return self.wire_bytes / self.upload_seconds / 1e9 if self.upload_seconds > 0 else 0.0


def default_publisher() -> str:
    """user.host, reduced to the characters metadata names allow."""
    try:
        user = getpass.getuser()
    except (ImportError, KeyError, OSError):  # no pwd module, no passwd entry for the uid (3.13: OSError)
        user = "user"
    raw = f"{user}.{socket.gethostname()}"
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", raw)
    clean = re.sub(r"\.{2,}", ".", clean).lstrip("._-")[:128]
    return clean or "paramctl"


def _checked_name(kind: str, value: str) -> str:
    try:
        return check_name(kind, value)
    except Invalid as exc:
        raise PushError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None


class _Push:
    """One streaming push: chunks are checked (HasChunks) and sent while later ones are still packed.

    The pack hands out blocks of chunks as it hashes them; the dedup check of a batch runs on a
    thread ahead of the sender, so pack, dedup and upload overlap and only the batches in flight
    are held. The manifest, complete only when the last chunk is packed, is sent last. Blobs still
    short of W after the first round are checked again and re-sent (their bytes made again from
    the caller's tensors) in later rounds.
    """

    def __init__(self, view: ClusterView, stream: PackStream | FolderPackStream, options: PushOptions,
                 progress: ProgressFn) -> None:
        self.view = view
        self.stream = stream
        self.options = options
        self.progress = progress
        self.ledger = AckLedger({}, view.write_quorum)
        self.refs: dict[str, ChunkRef] = {}  # distinct chunks, first occurrence
        self.items: dict[str, Item] = {}
        self.unreachable: set[str] = set()
        self.failed: dict[str, tuple[grpc.StatusCode | None, str]] = {}
        self.packed: PackResult | FolderPackResult | None = None
        self.manifest_id = ""
        self.manifest_blobs: dict[str, bytes] = {}  # the manifest's root (or sole blob), layout and parts
        self.dedup = 0
        self.sent_ids: set[str] = set()
        self.wire = 0
        self.pack_seconds = 0.0

    # ------------------------------------------------------------------ dedup

    def has(self, ids: Sequence[str]) -> dict[str, set[str] | None]:
        """HasChunks (claim) on each replica for its share of ``ids``; None for a server that did not answer."""
        placement = self.ledger.placement
        wanted = wanted_by_server({cid: placement[cid] for cid in ids})
        batch = self.options.has_batch

        def ask(server: str) -> set[str] | None:
            if server in self.unreachable:
                return None
            try:
                client = self.view.server_client(server)
                ids_here = wanted[server]
                found: set[str] = set()
                for i in range(0, len(ids_here), batch):
                    part = ids_here[i : i + batch]
                    # A replica cut off by a partition must cost seconds, not the whole call deadline.
                    deadline = min(self.view.options.timeout_s, 3.0 + len(part) / 2000)
                    found.update(cid for cid, ok in zip(part, client.has_chunks(part, claim=True, timeout=deadline)) if ok)
                return found
            except grpc.RpcError as exc:
                if rpc_code(exc) in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    # The dedup check claims chunks, a write: a read token stops the push here, before any byte is sent.
                    raise PushError(f"{server}: {rpc_details(exc)}; nothing was committed", rpc_code(exc)) from None
                return None

        if not wanted:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(wanted)), thread_name_prefix="push-has") as pool:
            result = dict(zip(wanted, pool.map(ask, list(wanted))))
        self.unreachable.update(s for s, v in result.items() if v is None)
        return result

    # ------------------------------------------------------------------ sending

    def _place(self, entries: Sequence[tuple[str, int]]) -> list[str]:
        """Register (id, stored size) blobs not seen before in this push; returns the new ids."""
        new = [(cid, size) for cid, size in entries if cid not in self.items]
        for cid, size in new:
            self.items[cid] = Item(cid, size)
        self.ledger.add({cid: self.view.replicas(cid) for cid, _ in new})
        return [cid for cid, _ in new]

    def _send_checked(self, session: SendSession, ids: Sequence[str], present: Mapping[str, set[str] | None],
                      data: Callable[[str], ChunkData], first_round: bool) -> None:
        self.ledger.record_present(present, ids)
        plan = plan_uploads([self.items[c] for c in ids], self.ledger.placement, present)
        if first_round:
            self.dedup += sum(1 for c in plan.deduplicated if c not in self.manifest_blobs)
        self.wire += plan.wire_bytes
        for cid in ids:
            servers = plan.targets.get(cid)
            if servers:
                self.sent_ids.add(cid)
                session.submit(data(cid), servers)

    def _check_fatal(self, failed: Mapping[str, tuple[grpc.StatusCode | None, str]]) -> None:
        self.failed.update(failed)
        for server, (code, message) in failed.items():
            if code in FATAL_STREAM_CODES:
                # Another round would fail the same way: this is the caller's to fix.
                raise PushError(f"PutChunks to {server} refused: {message}; nothing was committed", code)
        exhausted = {s: m for s, (c, m) in self.failed.items() if c in PER_SERVER_CODES}
        if exhausted and set(exhausted) >= set(self.view.members):
            server, message = sorted(exhausted.items())[0]
            raise PushError(f"PutChunks refused by every server (e.g. {server}: {message}); nothing was committed",
                            grpc.StatusCode.RESOURCE_EXHAUSTED)

    def _session(self) -> SendSession:
        chunk_size = self.stream.config.chunk_size
        options = SendOptions(
            queue_items=max(2, self.options.queue_bytes // max(1, chunk_size)),
            stream_bytes=self.options.stream_bytes,
            batch_bytes=self.options.batch_bytes,
        )
        base = self.wire  # what earlier rounds planned

        def report(done: int) -> None:
            self.progress("upload", base + done, max(self.wire, base + done))

        return SendSession(self.view, self.ledger, options, report)

    def upload(self) -> None:
        """Round 1 streams the pack; later rounds re-send what is still short of W."""
        dedup_bytes = max(self.options.dedup_batch_bytes, self.stream.config.chunk_size)
        with self._session() as session, ThreadPoolExecutor(max_workers=1, thread_name_prefix="push-dedup") as ahead:
            pending: deque[tuple[list[str], dict[str, Buffer], Future[dict[str, set[str] | None]]]] = deque()

            def drain(keep: int) -> None:
                while len(pending) > keep:
                    ids, buffers, checked = pending.popleft()
                    self._send_checked(session, ids, checked.result(), partial(self._chunk_data, buffers=buffers), True)
                    self._check_fatal(session.failed())

            batch_ids: list[str] = []
            batch_data: dict[str, Buffer] = {}
            batch_bytes = 0
            packed_bytes = 0
            total = self.stream.raw_bytes
            blocks = self.stream.blocks()
            while True:
                t = time.perf_counter()
                block = next(blocks, None)
                self.pack_seconds += time.perf_counter() - t
                if block is not None:
                    for ref, data in block:
                        packed_bytes += ref.raw_size
                        if ref.id in self.refs:
                            continue
                        self.refs[ref.id] = ref
                        batch_data[ref.id] = data
                        batch_bytes += ref.stored_size
                    self.progress("pack", packed_bytes, total)
                if batch_data and (block is None or batch_bytes >= dedup_bytes):
                    batch_ids = self._place([(cid, self.refs[cid].stored_size) for cid in batch_data])
                    pending.append((batch_ids, batch_data, ahead.submit(self.has, batch_ids)))
                    batch_data, batch_bytes = {}, 0
                    drain(keep=1)  # one batch's dedup check runs while the one before it is sent
                if block is None:
                    break
            drain(keep=0)
            self.packed = self.stream.result()
            manifest = self.packed.manifest
            self.manifest_id = manifest.id
            self.manifest_blobs = manifest.blobs()
            ids = self._place([(bid, len(data)) for bid, data in self.manifest_blobs.items()])
            if ids:
                self._send_checked(session, ids, self.has(ids), self._chunk_data, True)
            self._check_fatal(session.finish())
        for _round in range(1, self.options.rounds):
            short = self.ledger.short()
            if not short:
                break
            with self._session() as session:
                self._send_checked(session, short, self.has(short), self._chunk_data, False)
                self._check_fatal(session.finish())

    def _chunk_data(self, cid: str, buffers: Mapping[str, Buffer] | None = None) -> ChunkData:
        data = self.manifest_blobs.get(cid)
        if data is not None:
            return ChunkData(cid, "raw", len(data), crc32c(data), data)
        ref = self.refs[cid]
        held = buffers.get(cid) if buffers is not None else None
        if held is None:  # a later round: made again from the caller's tensors, CRC-checked against the manifest
            assert self.packed is not None
            return ChunkData(cid, ref.codec, ref.raw_size, ref.crc32c, self.packed.chunk(ref.index).data)
        if isinstance(held, np.ndarray):
            view: bytes | bytearray | memoryview = held.reshape(-1).view(np.uint8).data  # a view of the tensor: no copy
        elif isinstance(held, memoryview):
            view = held.cast("B") if held.format != "B" or held.ndim != 1 else held
        else:
            view = held
        return ChunkData(cid, ref.codec, ref.raw_size, ref.crc32c, view)

    def check_quorum(self) -> None:
        short = self.ledger.short()
        if not short:
            return
        w, r = self.view.write_quorum, self.view.replication
        example = short[0]
        why = "; ".join(f"{s}: {msg}" for s, (_c, msg) in sorted(self.failed.items())) or "no reachable replica took them"
        down = ", ".join(sorted(self.unreachable)) or "none"
        raise PushError(
            f"{len(short)} of {len(self.items)} blobs reached fewer than W={w} of their R={r} replicas "
            f"(e.g. {example} is on {self.ledger.count(example)}); unreachable servers: {down}; stream errors: {why}. "
            "Nothing was committed; bring the servers back and push again (chunks already stored are not re-sent)",
            grpc.StatusCode.UNAVAILABLE,
        )

    def sent_summary(self) -> tuple[int, int]:
        """(distinct chunks sent, their stored bytes once each), the manifest's blobs not counted."""
        data_sent = [c for c in self.sent_ids if c not in self.manifest_blobs]
        return len(data_sent), sum(self.items[c].stored_size for c in data_sent)


STALE_LEADER_S = 1.0  # an upload longer than this asks who leads before the commit


def push(
    seeds: str | Sequence[str] | ClientSettings | Source | None = None,
    source: Source | None = None,
    *,
    model: str,
    tag: str | None = None,
    parent: Parent = "head",
    publisher: str | None = None,
    token: str | None = None,
    config: ChunkingConfig = ChunkingConfig(),
    progress: ProgressFn | None = None,
    options: PushOptions = PushOptions(),
    cluster: ClusterOptions | None = None,
) -> PushReport:
    """Push ``source`` (a state dict, a .safetensors / torch file, or a model folder: its
    safetensors shards and every other file, see ``chunking.folder``) as a new version of ``model``.

    ``parent``: "head" (default) commits on the model's latest version, so a
    normal push never conflicts; an int commits on that version (ABORTED ->
    PushConflict if it is not the head); None starts a model's history.
    Raises TransferError (with a gRPC status ``code``) when nothing was committed.

    ``seeds`` (addresses or ClientSettings) may be left out, ``push(state_dict, model=...)``: the
    cluster, the admin token and TLS come as for ``paramctl push`` (arguments > environment >
    ``PARAMS_CONFIG`` file); ``cluster`` (ClusterOptions) is used as it is.
    """
    at, source = split_cluster_arg(seeds, source, what="source (a state dict, a file or a folder)")
    t0 = time.perf_counter()
    options.validate()
    config.validate()
    progress = progress or no_progress
    _checked_name("model name", model)
    if tag is not None:
        _checked_name("tag", tag)
    publisher = _checked_name("publisher", publisher or default_publisher())
    cluster = cluster or resolve_settings(at, token=token, write=True).cluster_options(write=True)
    with ClusterClient.for_options(cluster) as session:
        view = session.view()  # this push's one view: refreshed only before the commit (below)
        head = head_version(view, model)
        base: int | None = head if parent == "head" else parent
        previous = fetch_manifest(view, model, base) if base is not None else None
        progress("pack", 0, 0)
        try:
            stream: PackStream | FolderPackStream
            if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
                stream = pack_folder_stream(source, model=model, version=(head or 0) + 1, config=config, previous=previous,
                                            created_at=time.time())
            else:
                stream = pack_stream(source, model=model, version=(head or 0) + 1, config=config, previous=previous,
                                     created_at=time.time())
        except ChunkingError as exc:
            raise PushError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        job = _Push(view, stream, options, progress)
        t_up = time.perf_counter()
        try:
            job.upload()
        except ChunkingError as exc:  # e.g. the weights changed while they were being pushed
            raise PushError(f"{exc}; nothing was committed", grpc.StatusCode.INVALID_ARGUMENT) from None
        job.check_quorum()
        upload_s = time.perf_counter() - t_up
        assert job.packed is not None
        manifest = job.packed.manifest
        sent, bytes_sent = job.sent_summary()
        dedup, wire = job.dedup, job.wire
        pack_s = job.pack_seconds
        progress("commit", 0, 1)
        t_commit = time.perf_counter()
        if t_commit - t_up > STALE_LEADER_S:
            # An election during a long upload: learn the new leader now. Sent to the old one, the
            # commit is forwarded, but only after that server ran the whole quorum check, and the
            # client, moving to the new leader meanwhile, has it run the check again.
            try:
                view.refresh(deadline_s=min(2.0, options.commit_deadline_s))
            except (ClusterUnreachable, TransferError):
                pass  # the commit's own leader search reports it
        version = commit(
            view, model=model, manifest_id=job.manifest_id, parent=base, publisher=publisher, tag=tag,
            nbytes=manifest.raw_bytes, chunk_count=len(manifest.chunks), force=options.force, deadline_s=options.commit_deadline_s,
            suspects=job.unreachable | set(job.failed),
        )  # fmt: skip
        progress("commit", 1, 1)
        commit_s = time.perf_counter() - t_commit
        return PushReport(
            model=model,
            version=version.number,
            manifest_id=job.manifest_id,
            parent=base,
            tag=tag,
            clock=dict(version.clock),
            bytes_total=manifest.raw_bytes,
            bytes_stored=sum(r.stored_size for r in job.refs.values()),
            bytes_sent=bytes_sent,
            wire_bytes=wire,
            chunks_total=len(manifest.chunks) + sum(len(f.chunks) for f in manifest.files),  # as chunks_unique: the files' too
            chunks_unique=len(job.refs),
            chunks_deduplicated=dedup,
            chunks_sent=sent,
            seconds=time.perf_counter() - t0,
            pack_seconds=pack_s,
            upload_seconds=upload_s,
            replication=view.replication,
            write_quorum=view.write_quorum,
            unreachable=tuple(sorted(job.unreachable)),
            refused={server: message for server, (_code, message) in sorted(job.failed.items())},
            forced=version.forced,
            servers=tuple(sorted(view.members)),
            commit_seconds=commit_s,
        )


__all__ = ["push", "PushOptions", "PushReport", "Parent", "default_publisher", "head_version", "fetch_manifest", "commit"]
