"""One coalesced, verified, failing-over fetch of a set of chunks (used by ClusterClient.fetch).

The chunks are planned onto replicas (``ReplicaSelector``), batched into GetChunks calls of many
ids per server, and run on the client's bounded pool of streams. A call that fails (UNAVAILABLE,
a timeout, DATA_LOSS, a CORRUPT/MISSING ack, bytes that fail the manifest's checks) hands the
chunks it still owed back to the planner, which sends them to replicas not tried yet.

When the server advertises a bulk port (paramserver.bulk) the call reads the chunk bytes there
instead (plain TCP, ``recv_into`` a reused buffer); whatever the bulk path did not deliver (a
connection error, a refused token, a bad frame) goes over GetChunks in the same call, and the
address is parked for a while. MISSING and CORRUPT answers count as on the gRPC path. Either
way every chunk is checked against the manifest (size + CRC32C, and the content id with
``verify="content"``) before on_chunk sees it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from chunking.codec import decode_chunk
from chunking.errors import ChunkCorrupt
from chunking.hashing import Buffer, content_id
from chunking.manifest import ChunkRef
from paramserver import bulk as bulk_proto
from paramserver.bulkclient import BulkError
from paramserver.proto import pb
from worker.errors import ChunkDataLoss, ChunkUnavailable, ClusterUnavailable, WorkerError
from worker.replicas import Want, batches

if TYPE_CHECKING:
    from worker.client import ClusterClient

# Codes after which another server may well succeed.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION}

OnChunk = Callable[[ChunkRef, Buffer, str], None]

# "crc": size + CRC32C from the (content-id-verified) manifest; "content": also the chunk's content id.
VERIFY_MODES = ("crc", "content")


@dataclass
class FetchStats:
    chunks: int = 0
    stored_bytes: int = 0
    calls: int = 0
    failovers: int = 0
    corrupt_reports: int = 0
    by_server: dict[str, int] = field(default_factory=dict)
    bulk_bytes: int = 0  # stored bytes that came over bulk ports (the rest over GetChunks)
    bulk_fallbacks: int = 0  # calls whose bulk read failed and went on over GetChunks

    def merge(self, other: FetchStats) -> None:
        self.chunks += other.chunks
        self.stored_bytes += other.stored_bytes
        self.calls += other.calls
        self.failovers += other.failovers
        self.corrupt_reports += other.corrupt_reports
        self.bulk_bytes += other.bulk_bytes
        self.bulk_fallbacks += other.bulk_fallbacks
        for k, v in other.by_server.items():
            self.by_server[k] = self.by_server.get(k, 0) + v



class ChunkFetch:
    """One fetch: a set of pending chunks, calls in flight, failover by re-planning leftovers."""

    def __init__(self, client: ClusterClient, refs: Sequence[ChunkRef], on_chunk: OnChunk, algorithm: str,
                 tensors_of: Callable[[ChunkRef], Sequence[str]] | None) -> None:
        self.c = client
        self.on_chunk = on_chunk
        self.algorithm = algorithm
        self.tensors_of = tensors_of
        self.refs = {r.id: r for r in refs}
        self.order = {r.id: i for i, r in enumerate(refs)}
        self.pending = set(self.refs)
        self.attempts: dict[str, dict[str, str]] = {}
        self.corrupt: dict[str, set[str]] = {}
        self.cond = threading.Condition()
        self.in_flight = 0
        self.error: BaseException | None = None
        self.stats = FetchStats()

    def run(self) -> FetchStats:
        if not self.pending:
            return self.stats
        self.c._ensure_ring()
        self._submit(sorted(self.pending, key=self.order.__getitem__))
        with self.cond:
            while self.in_flight and self.error is None:
                self.cond.wait(0.5)
            error = self.error
        if error is not None:
            with self.cond:
                self.pending.clear()  # running calls stop delivering
            raise error
        if self.pending:  # unreachable in practice: every call either delivers or re-plans
            cid = next(iter(self.pending))
            raise ChunkUnavailable(cid, self.attempts.get(cid, {}), self._tensors(cid))
        with self.c._lock:
            self.c.stats.merge(self.stats)
        return self.stats

    def _tensors(self, cid: str) -> tuple[str, ...]:
        return tuple(self.tensors_of(self.refs[cid])) if self.tensors_of else ()

    def _candidates(self, cid: str, replicas: list[str], up: list[str]) -> list[str]:
        tried = self.attempts.get(cid, {})
        first = [s for s in replicas if s not in tried]
        if first:
            return first
        # Every ring replica failed: another member may still hold a copy (rebalance, repair).
        return [s for s in up if s not in tried]

    def _submit(self, ids: list[str]) -> None:
        try:
            with self.c._lock:
                ring, r = self.c._ring, self.c._r
                up = sorted(sid for sid, m in self.c._members.items() if m.up)
            assert ring is not None
            wants = []
            for cid in ids:
                cands = self._candidates(cid, ring.replicas(cid, r), up)
                if not cands:
                    raise self._give_up(cid)
                wants.append(Want(cid, self.refs[cid].stored_size, cands))
            plan = self.c.selector.plan(wants)
            tasks = [(server, batch) for server, sids in plan.items() for batch in batches(sids, self.c.config.chunks_per_call)]
            tasks.sort(key=lambda t: self.order[t[1][0]])  # earliest-needed chunks first
            with self.cond:
                self.in_flight += len(tasks)
            for server, batch in tasks:
                self.c._pool.submit(self._call, server, batch)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self._fail(exc)

    def _give_up(self, cid: str) -> WorkerError:
        attempts = self.attempts.get(cid, {})
        if attempts and set(attempts) <= self.corrupt.get(cid, set()):
            return ChunkDataLoss(cid, attempts, self._tensors(cid))
        return ChunkUnavailable(cid, attempts, self._tensors(cid))

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    def _note(self, cid: str, server: str, reason: str, corrupt: bool = False) -> None:
        with self.cond:
            self.attempts.setdefault(cid, {})[server] = reason
            if corrupt:
                self.corrupt.setdefault(cid, set()).add(server)

    def _call(self, server: str, ids: list[str]) -> None:
        left = [cid for cid in ids if cid in self.pending]
        try:
            if left and self.error is None:
                self._stream(server, left)
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()

    def _deliver(self, server: str, cid: str, data: Buffer, retry: list[str]) -> int:
        """Verify one received chunk and hand it on; the stored bytes delivered (0 when not)."""
        c = self.c
        ref = self.refs[cid]
        try:
            raw = decode_chunk(ref, data, algorithm=self.algorithm)
            if c.verify == "content" and content_id(raw, self.algorithm) != cid:
                raise ChunkCorrupt(cid, "content id of the raw bytes does not match", (), ref.index)
        except ChunkCorrupt as exc:
            # Bytes that fail the manifest's checks never reach a tensor.
            self._note(cid, server, f"corrupt bytes ({exc.reason})", corrupt=True)
            c._report_async([cid], server, f"worker verification failed: {exc.reason}")
            with self.cond:
                self.stats.corrupt_reports += 1
            retry.append(cid)
            return 0
        with self.cond:
            if cid not in self.pending or self.error is not None:
                return 0
            self.pending.discard(cid)
        self.on_chunk(ref, raw, server)
        n = len(data)
        with self.cond:
            self.stats.chunks += 1
            self.stats.stored_bytes += n
            self.stats.by_server[server] = self.stats.by_server.get(server, 0) + n
        return n

    def _refused(self, server: str, cid: str, corrupt: bool, message: str, retry: list[str]) -> None:
        """The server answered MISSING or CORRUPT for ``cid``."""
        self._note(cid, server, ("DATA_LOSS: " if corrupt else "missing: ") + message[:200], corrupt=corrupt)
        if corrupt:
            self.c._report_async([cid], server, "server answered CORRUPT: " + message[:200])
            with self.cond:
                self.stats.corrupt_reports += 1
        retry.append(cid)

    def _bulk(self, server: str, waiting: dict[str, None], retry: list[str]) -> int:
        """Read what ``waiting`` owes over the server's bulk port; what is left goes to GetChunks."""
        c = self.c
        if c.bulk is None:
            return 0
        client = c.bulk.client(c._bulk_address(server))
        if client is None:
            return 0
        got = 0
        try:
            for item in client.fetch(list(waiting)):
                if item.id not in waiting:
                    continue
                del waiting[item.id]
                if item.status == bulk_proto.OK:
                    got += self._deliver(server, item.id, item.data, retry)
                else:
                    self._refused(server, item.id, item.status == bulk_proto.CORRUPT, item.message, retry)
        except BulkError:
            c.bulk.mark_broken(client.address)  # GetChunks serves the rest and, for a while, this server
            with self.cond:
                self.stats.bulk_fallbacks += 1
        with self.cond:
            self.stats.bulk_bytes += got
        return got

    def _stream(self, server: str, ids: list[str]) -> None:
        c = self.c
        waiting = dict.fromkeys(ids)  # ordered set of ids this call still owes
        nbytes = sum(self.refs[i].stored_size for i in ids)
        timeout = c.config.call_timeout_s + nbytes / c.config.min_stream_bytes_per_s
        got = 0
        start = time.perf_counter()
        retry: list[str] = []
        self.stats.calls += 1
        try:
            got += self._bulk(server, waiting, retry)
            if waiting:
                address = c._address(server)
                request = pb.GetChunksRequest(ids=list(waiting), max_message_bytes=c.config.get_message_bytes, allow_partial=True)
                for reply in c.server(address).stub.GetChunks(request, timeout=timeout):
                    for chunk in reply.chunks:
                        if chunk.id not in waiting:
                            continue
                        del waiting[chunk.id]
                        got += self._deliver(server, chunk.id, chunk.data, retry)
                    for ack in reply.errors:
                        if ack.id not in waiting:
                            continue
                        del waiting[ack.id]
                        self._refused(server, ack.id, ack.status == pb.CORRUPT, ack.message, retry)
        except grpc.RpcError as exc:
            code = exc.code()
            if code not in RETRYABLE and code != grpc.StatusCode.NOT_FOUND:
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise WorkerError(f"{server}: {exc.details()}; pass --token or set PARAMS_READ_TOKEN") from None
            corrupt = code == grpc.StatusCode.DATA_LOSS
            for cid in waiting:
                self._note(cid, server, f"{code.name}: {(exc.details() or '')[:200]}", corrupt=corrupt)
            retry.extend(waiting)
            waiting.clear()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                c.selector.mark_down(server)
                try:
                    c.refresh(force=False)
                except ClusterUnavailable:
                    pass
        except ClusterUnavailable as exc:
            for cid in waiting:
                self._note(cid, server, str(exc))
            retry.extend(waiting)
            waiting.clear()
        finally:
            elapsed = time.perf_counter() - start
            if got:
                c.selector.observe(server, got, elapsed)
        for cid in waiting:  # the server ended the stream without them
            self._note(cid, server, "not sent")
            retry.append(cid)
        retry = [cid for cid in retry if cid in self.pending]
        if retry:
            with self.cond:
                self.stats.failovers += len(retry)
            self._submit(sorted(retry, key=self.order.__getitem__))


__all__ = ["ChunkFetch", "FetchStats", "OnChunk", "RETRYABLE", "VERIFY_MODES"]
