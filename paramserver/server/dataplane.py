"""gRPC data plane over the chunk store: PutChunks, GetChunks, HasChunks, ReportCorrupt.

Typed store errors become status codes here (via rpc_errors) and nowhere else:
a chunk whose bytes do not match its id -> INVALID_ARGUMENT; received bytes
failing their CRC32C, or a stored copy failing verification -> DATA_LOSS; an
unknown chunk -> NOT_FOUND; a full disk -> RESOURCE_EXHAUSTED. Every message
names the chunk (and, for PutChunks, this server).

PutChunks stores each message through ``paramserver.server.ingest``, as the bulk port stores
a PUT: the same per-chunk outcomes, worded here as acks, or as the status the call ends with
at the first chunk not taken (PUT_CODES: the codes clients give the bulk port's ACK statuses).

No client can make this server stop serving others (DESIGN invariant 6):

- Streams hold a gRPC worker thread for as long as they last, so they have concurrency
  limits below the pool: all streams (PutChunks and GetChunks) together leave
  ``stream_reserve(workers)`` threads to unary calls (status, metadata, HasChunks), and
  write streams alone are held to ``WriteLimits.max_streams`` (half the pool by default).
  A stream beyond a limit is answered RESOURCE_EXHAUSTED at once.
- A write stream that sends no message for ``WriteLimits.idle_s``, and a read stream whose
  client takes no message for as long, is ended DEADLINE_EXCEEDED by one watchdog thread
  (cancelling the call wakes a handler blocked on the request iterator or on a send),
  freeing its thread and its slot.
- One client identity (token class, mutual-TLS certificate, source address) holds at most its
  share of the slots, and a read stream whose client has taken nothing for a couple of seconds
  is cut at once when another stream needs its slot (``paramserver.server.stream_slots``).
- GetChunks answers each distinct id once, keeps every reply message (chunks and
  per-chunk errors together) near the coalescing target, and answers at most
  ``max_call_bytes`` of chunk data per call.
- HasChunks(claim=true) keeps chunks from orphan collection, a write: it needs the
  admin token when one is configured.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from dataclasses import dataclass
from dataclasses import field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import grpc
import numpy as np

from chunking.hashing import hex_ids
from paramserver.server.auth import AuthConfig, has_admin_token
from paramserver.server.config import DEFAULT_GET_MESSAGE_BYTES
from paramserver.server.errors import ChunkCorruptError, ChunkNotFoundError, ConfigError, InvalidChunkError
from paramserver.server.hot_chunks import HotChunks
from paramserver.server.ingest import Kind, ingest
from paramserver.wire.proto import pb
from paramserver.server.repair import RepairQueue
from paramserver.server.rpc_errors import abort_with, invalid
from paramserver.server.served_bytes import ServedBytes
from paramserver.server.store import ChunkStore
from paramserver.server import stream_slots
from paramserver.wire.rate_limited_log import RateLimitedLog
from paramserver.server.stream_slots import Slot, StreamLimits, StreamSlots, Taken, cert_identity, source_of_peer
from paramserver.wire.chunk_record import ChunkRecord
from paramserver.wire.getchunks import ReplyBuilder

log = logging.getLogger(__name__)

# The status a PutChunks call ends with when a chunk of it was not taken (the bulk port's ACK
# statuses; clients map those to these same codes).
PUT_CODES: dict[Kind, grpc.StatusCode] = {
    Kind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.CORRUPT_IN_TRANSIT: grpc.StatusCode.DATA_LOSS,
    Kind.FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.FAILED: grpc.StatusCode.UNAVAILABLE,
}
MAX_IDS_PER_CALL = 1 << 20
DEFAULT_MAX_CALL_BYTES = 1 << 30  # GetChunks chunk data per call; clients read at most 64 MiB per call
MAX_REPORT_IDS = 4096  # ReportCorrupt: each id costs a full read and verification
MAX_ERROR_MESSAGE = 512  # characters of one per-chunk error message in a GetChunks reply


CONFIG_KEYS = ("max_write_streams", "write_stream_idle_s", *stream_slots.CONFIG_KEYS)  # a server config's stream limits


@dataclass(frozen=True)
class WriteLimits:
    """Stream limits. ``max_streams`` None: half the gRPC worker pool (at least 1); ``reads``: the
    per-client share and the stalled-reader cut of the slots every stream needs."""

    max_streams: int | None = None
    idle_s: float = 30.0  # a write stream with no message for this long is ended DEADLINE_EXCEEDED
    reads: StreamLimits = field(default_factory=StreamLimits)

    def streams_for(self, workers: int) -> int:
        return self.max_streams if self.max_streams is not None else max(1, workers // 2)

    def validate(self, workers: int) -> WriteLimits:
        n = self.streams_for(workers)
        if n < 1 or (workers > 1 and n >= workers):
            raise ConfigError(f"max_write_streams must be between 1 and workers - 1 ({workers - 1}) so that reads always find "
                              f"a thread, got {n}")
        if self.idle_s <= 0:
            raise ConfigError(f"write_stream_idle_s must be > 0, got {self.idle_s}")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> WriteLimits:
        """From a server config file's extra keys ``max_write_streams`` and ``write_stream_idle_s``."""
        streams, idle = extra.get("max_write_streams"), extra.get("write_stream_idle_s", cls.idle_s)
        if (streams is not None and (not isinstance(streams, int) or isinstance(streams, bool))) or \
                not isinstance(idle, int | float) or isinstance(idle, bool):
            raise ConfigError(f"max_write_streams must be an integer and write_stream_idle_s a number of seconds, got "
                              f"{streams!r} and {idle!r}")
        return cls(streams, float(idle), StreamLimits.from_extra(extra))


def stream_reserve(workers: int) -> int:
    """gRPC worker threads that streams never take, so that unary calls always find one."""
    return min(workers - 1, max(1, workers // 8)) if workers > 1 else 0


def _end_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a call from another thread, waking a handler blocked on its request iterator.

    grpcio's call object can cancel with a status (what the client then sees); the public
    ``context.cancel()`` sends CANCELLED. Both make the blocked iterator return."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        cygrpc = importlib.import_module("grpc._cython.cygrpc")  # grpcio's own: the status-carrying cancel
        call.cancel(getattr(cygrpc.StatusCode, code.name.lower()), details)  # type: ignore[union-attr]
        return
    except Exception:  # noqa: BLE001 - another grpcio: fall back to the public cancel
        pass
    context.cancel()


class _Watch:
    __slots__ = ("context", "kind", "last", "busy", "expired", "peer")

    def __init__(self, context: grpc.ServicerContext, kind: str) -> None:
        self.context = context
        self.kind = kind  # "write": the client sends nothing; "read": it takes nothing we send
        self.last = time.monotonic()
        self.busy = False  # storing a message: not idle
        self.expired = False
        self.peer = context.peer()

    def touch(self, busy: bool) -> None:
        self.last = time.monotonic()
        self.busy = busy


class StreamWatchdog:
    """One thread ending the watched streams that sent nothing for ``idle_s`` (started on first use)."""

    def __init__(self, idle_s: float, server_id: str = "") -> None:
        self.idle_s = idle_s
        self.server_id = server_id
        self._watches: set[_Watch] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.expired = 0  # streams ended for idleness

    def watch(self, context: grpc.ServicerContext, kind: str = "write") -> _Watch:
        w = _Watch(context, kind)
        with self._cond:
            self._watches.add(w)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="write-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        return w

    def release(self, w: _Watch) -> None:
        with self._cond:
            self._watches.discard(w)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            due: list[_Watch] = []
            with self._cond:
                if self._closed:
                    return
                wake = self.idle_s
                for w in self._watches:
                    if w.expired or w.busy:
                        continue
                    left = w.last + self.idle_s - now
                    if left <= 0:
                        w.expired = True
                        due.append(w)
                    else:
                        wake = min(wake, left)
            for w in due:
                self.expired += 1
                log.warning("%s stream ended: idle server=%s peer=%s idle_s=%g", w.kind, self.server_id, w.peer, self.idle_s)
                if w.kind == "read":
                    message = (f"server {self.server_id}: the client took no message of its GetChunks stream for "
                               f"{self.idle_s:g} s; read a stream as it arrives, or cancel it")
                else:
                    message = (f"server {self.server_id}: PutChunks stream sent no message for {self.idle_s:g} s; send "
                               "chunks without pauses, or end the stream and open a new one")
                _end_call(w.context, grpc.StatusCode.DEADLINE_EXCEEDED, message)
            with self._cond:
                if not self._closed:
                    self._cond.wait(timeout=max(0.05, wake))


class ChunkService:
    def __init__(
        self,
        store: ChunkStore,
        server_id: str,
        *,
        repair_queue: RepairQueue | None = None,
        get_message_bytes: int = DEFAULT_GET_MESSAGE_BYTES,
        max_message_bytes: int = 64 << 20,
        auth: AuthConfig = AuthConfig(),
        workers: int = 16,
        write_limits: WriteLimits = WriteLimits(),
        max_call_bytes: int = DEFAULT_MAX_CALL_BYTES,
        hot: HotChunks | None = None,
        source_of: Callable[[str], str | None] = source_of_peer,
        served: ServedBytes | None = None,
    ) -> None:
        self.store = store
        self.served = served or ServedBytes()  # chunk bytes GetChunks sent (path "grpc")
        self.hot = hot  # hot chunks: reads are counted, hot copies admitted (None: off)
        self.server_id = server_id
        self.repair_queue = repair_queue
        self.get_message_bytes = get_message_bytes
        self.max_message_bytes = max_message_bytes
        self.auth = auth
        self.write_limits = write_limits.validate(workers)
        self.max_write_streams = write_limits.streams_for(workers)
        self._write_slots = threading.BoundedSemaphore(self.max_write_streams)
        self.max_streams = max(1, workers - stream_reserve(workers))
        # Read-token clients holding every stream slot starved the cluster's own reads: a peer's
        # repair and re-replication (the admin token). Some slots only admin-token calls may take.
        self.admin_streams = self.max_streams // 4
        # Read-token clients that stopped reading held the rest for the idle timeout: each client
        # identity gets a share, and a stalled reader is cut for a stream that needs its slot. A
        # stream waiting for a slot holds a thread too: the waiters leave one of the reserve.
        self._stream_slots = StreamSlots(self.max_streams - self.admin_streams, write_limits.reads,
                                         max_waiters=max(0, stream_reserve(workers) - 1))
        # The client's address in ``context.peer()``; a connection gate in front of grpc maps its own
        # peer back to the client's (None: unknown, all such clients share one identity).
        self.source_of = source_of
        self._admin_stream_slots = threading.BoundedSemaphore(self.admin_streams or 1)
        self.watchdog = StreamWatchdog(write_limits.idle_s, server_id)
        self.max_call_bytes = max_call_bytes
        self._refusals = RateLimitedLog(log)

    def close(self) -> None:
        self.watchdog.close()

    # ----------------------------------------------------------- PutChunks

    def _take_slot(self, slots: threading.BoundedSemaphore, limit: int, context: grpc.ServicerContext, what: str,
                   reason: str, serving: str, retry: str = "retry in a moment") -> None:
        """Take one of ``slots`` (``limit`` in all), or end the call RESOURCE_EXHAUSTED."""
        if not slots.acquire(blocking=False):
            self._refusals.warning(reason, "%s refused: server=%s peer=%s reason=%s limit=%d",
                                   what, self.server_id, context.peer(), reason, limit)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"server {self.server_id} is serving {limit} {serving}, its limit; {retry}")

    def identity(self, context: grpc.ServicerContext, admin: bool) -> str:
        """Who holds a stream slot: the token class, the client certificate and the source address."""
        token = "admin" if admin else ("read" if self.auth.read_token else "open")
        return f"{token} cert={cert_identity(context) or '-'} from={self.source_of(context.peer()) or '?'}"

    def _stream_slot(self, context: grpc.ServicerContext, what: str, *, read: bool = False, reserved: bool = False) -> Slot:
        """Take one of the slots every stream needs (``reserved``: or, when they are taken, one kept
        for admin-token calls), or end the call RESOURCE_EXHAUSTED. A client holding its share waits
        or is refused; a stalled reader is cut to make room (paramserver.server.stream_slots)."""
        metadata = context.invocation_metadata()
        # Calls with the admin token are trusted with writes: not held to a client's share.
        admin = self.auth.admin_token is not None and has_admin_token(metadata, self.auth)
        identity = self.identity(context, admin)
        pool = self._stream_slots
        reserve = reserved and self.admin_streams > 0 and has_admin_token(metadata, self.auth)
        got = pool.take(identity, context, read=read, capped=not admin, wait_s=0.0 if reserve else None)
        if isinstance(got, str) and reserve:
            if self._admin_stream_slots.acquire(blocking=False):
                return Slot(self._admin_stream_slots)
            got = pool.take(identity, context, read=read, capped=not admin)
        if isinstance(got, Taken):
            if got.victim is not None:
                self._cut(got.victim, what)
            return Slot(pool, got.key)
        limit, serving = pool.slots, "streams"
        if got == "client_limit":
            limit, serving = pool.per_client, "streams to this client (its share of the server's streams)"
        self._refusals.warning(got, "%s stream refused: server=%s peer=%s reason=%s limit=%d",
                               what, self.server_id, context.peer(), got, limit)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"server {self.server_id} is serving {limit} {serving}, its limit; read the streams already open "
                      "as they arrive or close them, retry in a moment, or read from another replica")
        raise AssertionError("abort returns by raising")  # pragma: no cover

    def _cut(self, victim: object, what: str) -> None:
        """End a stalled reader whose slot went to another stream (the watchdog's way: its thread wakes)."""
        context = victim if isinstance(victim, grpc.ServicerContext) else None
        stale = self._stream_slots.policy.limits.stale_s
        self._refusals.warning("stalled_cut", "stalled read stream cut for a %s stream: server=%s peer=%s stale_s=%g",
                               what, self.server_id, context.peer() if context else "?", stale)
        if context is not None:
            _end_call(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"server {self.server_id}: the client took no message of its GetChunks stream for over {stale:g} s "
                      "while another stream waited for its slot; read a stream as it arrives, or cancel it")

    def PutChunks(self, request_iterator: Iterable[pb.PutChunksRequest], context: grpc.ServicerContext) -> pb.PutChunksReply:
        self._take_slot(self._write_slots, self.max_write_streams, context, "write stream", "write_limit", "PutChunks streams")
        try:
            slot = self._stream_slot(context, "PutChunks", reserved=True)  # re-replication pushes with the admin token
        except BaseException:
            self._write_slots.release()
            raise
        try:
            watch = self.watchdog.watch(context)
            try:
                reply = self._put(request_iterator, context, watch)
            except grpc.RpcError:
                if not watch.expired:
                    raise  # the client went away
                reply = None
            finally:
                self.watchdog.release(watch)
        finally:
            slot.release()
            self._write_slots.release()
        if reply is None or watch.expired:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"server {self.server_id}: PutChunks stream sent no message for {self.watchdog.idle_s:g} s")
        return reply

    def _put(self, request_iterator: Iterable[pb.PutChunksRequest], context: grpc.ServicerContext, watch: _Watch) -> pb.PutChunksReply:
        reply = pb.PutChunksReply(server_id=self.server_id)
        stored = present = nbytes = 0
        where = f"server {self.server_id}"
        for request in request_iterator:
            if watch.expired:
                break
            watch.touch(busy=True)
            batch = [ChunkRecord(c.id, c.codec, c.raw_size, c.crc32c, c.data) for c in request.chunks]
            done = ingest(self.store, batch, where=where, repair_queue=self.repair_queue, hot=self.hot,
                          hot_copy=request.hot_copy)
            error = done.first_error()
            if error is not None:  # this call ends with the first chunk's error: acks are per call here
                context.abort(PUT_CODES[error.kind], error.message)
            for chunk, outcome in zip(batch, done.outcomes):
                if outcome.kind is Kind.REFUSED:
                    reply.acks.add(id=chunk.id, status=pb.REJECTED, message=outcome.message)
                else:
                    reply.acks.add(id=chunk.id, status=pb.STORED if outcome.kind is Kind.STORED else pb.ALREADY_PRESENT)
            stored, present, nbytes = stored + done.stored, present + done.present, nbytes + done.stored_bytes
            watch.touch(busy=False)
        reply.chunks_stored, reply.chunks_present, reply.bytes_stored = stored, present, nbytes
        return reply

    # ----------------------------------------------------------- GetChunks

    def GetChunks(self, request: pb.GetChunksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The stored chunks of ``request.ids``: each distinct id once, in the order of its first
        mention (a repeated id is answered once, not refused).

        Chunks and per-chunk errors (``allow_partial``) are coalesced into messages of about
        the target size; a chunk larger than the target goes alone. A call answers at most
        ``max_call_bytes`` of chunk data: past that it ends RESOURCE_EXHAUSTED naming the
        limit and the first id not sent (ask for the rest in another call).
        """
        if len(request.ids) > MAX_IDS_PER_CALL:
            invalid(context, f"GetChunks asks for {len(request.ids)} chunks; split the request into calls of at most {MAX_IDS_PER_CALL}")
        slot = self._stream_slot(context, "GetChunks", read=True, reserved=True)
        watch = self.watchdog.watch(context, "read")
        watch.touch(busy=True)  # reading from the store is work, not idleness
        slot.touch(busy=True)
        try:
            for message, carried in self._get(request, context):
                watch.touch(busy=False)  # from here until the client takes it, the watchdog's clock runs
                slot.touch(busy=False)  # and the stalled-reader clock (cut sooner, when others wait)
                yield message
                self.served.add("grpc", carried)  # gRPC took it: a call cancelled before that counts nothing
                watch.touch(busy=True)
                slot.touch(busy=True)
        finally:
            self.watchdog.release(watch)
            slot.release()

    def _get(self, request: pb.GetChunksRequest, context: grpc.ServicerContext) -> Iterator[tuple[bytes, int]]:
        """The reply messages, each with the chunk bytes it carries (for the served-bytes count)."""
        ids = list(dict.fromkeys(request.ids))
        target = request.max_message_bytes or self.get_message_bytes
        # Payload is capped at 3/4 of the hard limit so per-chunk envelopes never overflow it.
        target = max(1, min(target, self.max_message_bytes * 3 // 4))
        partial = request.allow_partial
        sent = 0
        # Replies are pre-encoded bytes (wire.ReplyBuilder); the server registers
        # GetChunks with a pass-through serializer (service.register_servicer).
        reply, carried = ReplyBuilder(), 0
        for n, chunk_id in enumerate(ids):
            try:
                chunk = self.store.get(chunk_id)
            except (ChunkNotFoundError, ChunkCorruptError) as exc:
                if not partial:
                    if reply:
                        yield reply.encode(), carried
                    abort_with(context, exc)
                if reply and reply.size > target:
                    yield reply.encode(), carried
                    reply, carried = ReplyBuilder(), 0
                reply.add_error(chunk_id, pb.MISSING if isinstance(exc, ChunkNotFoundError) else pb.CORRUPT,
                                str(exc)[:MAX_ERROR_MESSAGE])
                continue
            except InvalidChunkError as exc:
                if reply:
                    yield reply.encode(), carried
                abort_with(context, exc)
            if sent + len(chunk.data) > self.max_call_bytes:
                if reply:
                    yield reply.encode(), carried
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"GetChunks answers at most {self.max_call_bytes} bytes of chunk data per call; {len(ids) - n} of "
                              f"{len(ids)} distinct ids were not sent, from {chunk_id}: ask for them in another call")
            sent += len(chunk.data)
            if self.hot is not None:
                self.hot.record_read(chunk_id)
            if reply and reply.size + len(chunk.data) > target:
                yield reply.encode(), carried
                reply, carried = ReplyBuilder(), 0
            # The bytes read from disk go into the message as-is: one join, no re-encoding.
            reply.add_chunk(chunk_id, chunk.data, chunk.codec, chunk.raw_size, chunk.crc32c)
            carried += len(chunk.data)
        if reply:
            yield reply.encode(), carried

    # ----------------------------------------------------------- HasChunks

    def HasChunks(self, request: pb.HasChunksRequest, context: grpc.ServicerContext) -> pb.HasChunksReply:
        """Which ids are here. ``claim`` (keep them from orphan collection) needs the admin token;
        ``with_crc`` adds the CRC32C and codec each present chunk's stored copy declares (0 and ""
        when absent; a copy whose header cannot be read counts as absent)."""
        packed = request.packed_ids
        if packed and (request.ids or len(packed) % 32):
            invalid(context, "HasChunks packed_ids must be whole 32-byte ids, and without ids: send one or the other")
        count = len(packed) // 32 if packed else len(request.ids)
        if count > MAX_IDS_PER_CALL:  # counted before any id is expanded
            invalid(context, f"HasChunks asks about {count} chunks; split it into calls of at most {MAX_IDS_PER_CALL}")
        ids: Sequence[str] = hex_ids(packed) if packed else request.ids  # the store is keyed by hex ids
        if request.claim:
            if not has_admin_token(context.invocation_metadata(), self.auth):
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              "HasChunks with claim keeps chunks from orphan collection, a write: it needs the admin token "
                              "(paramctl --token or $PARAMS_ADMIN_TOKEN); ask without claim to only look")
            # A chunk reported present to a push will not be sent again: it must not be
            # collected as an orphan before that push commits (see paramserver.server.gc).
            if packed and request.with_crc:
                # The commit check's question, about every chunk of a version: answered from the
                # index in one pass, straight into the packed arrays.
                held, crc, raw = self.store.held(ids, claim=True)
                return pb.HasChunksReply(present_count=int(held.sum()), packed_present=held.astype(np.uint8).tobytes(),
                                         packed_crc32c=crc.astype("<u4").tobytes(), packed_raw=raw.astype(np.uint8).tobytes())
            present = self.store.claim(ids)
        else:
            if request.renew_hot and not has_admin_token(context.invocation_metadata(), self.auth):
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              "HasChunks with renew_hot keeps hot copies alive, a write: it needs the admin token")
            present = self.store.has_many(ids)
            if request.renew_hot and self.hot is not None:
                self.hot.renew(cid for cid, ok in zip(ids, present) if ok)
        headers: list[tuple[int, str] | None] = []
        if request.with_crc:  # a copy whose header cannot be read is not one this server can serve
            headers = self.store.stored_headers(ids, present)
            present = [h is not None for h in headers]
        if packed:
            reply = pb.HasChunksReply(present_count=sum(present), packed_present=bytes(present))
            if request.with_crc:
                reply.packed_crc32c = np.fromiter((0 if h is None else h[0] for h in headers), "<u4", len(headers)).tobytes()
                reply.packed_raw = bytes(h is not None and h[1] == "raw" for h in headers)
            return reply
        reply = pb.HasChunksReply(present=present, present_count=sum(present))
        reply.crc32c.extend(0 if h is None else h[0] for h in headers)
        reply.codec.extend("" if h is None else h[1] for h in headers)
        return reply

    # ----------------------------------------------------------- ReportCorrupt

    def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: grpc.ServicerContext) -> pb.ReportCorruptReply:
        """A client saw bad bytes from a replica. If that replica is us, re-verify now (each
        distinct id once; at most MAX_REPORT_IDS per call, as each costs a full read)."""
        ids = list(dict.fromkeys(request.chunk_ids))
        if len(ids) > MAX_REPORT_IDS:
            invalid(context, f"ReportCorrupt names {len(ids)} chunks; report at most {MAX_REPORT_IDS} per call")
        accepted = 0
        for chunk_id in ids:
            if not self.store.has(chunk_id):
                continue
            if request.server_id and request.server_id != self.server_id:
                continue  # the lead's cluster layer forwards reports to the named replica
            try:
                self.store.verify(chunk_id)
            except ChunkCorruptError:
                accepted += 1  # quarantined; on_corrupt queued the repair
            except (ChunkNotFoundError, InvalidChunkError):
                continue
        return pb.ReportCorruptReply(accepted=accepted)


__all__ = [
    "CONFIG_KEYS",
    "ChunkService", "DEFAULT_MAX_CALL_BYTES", "MAX_IDS_PER_CALL", "MAX_REPORT_IDS", "RateLimitedLog", "StreamWatchdog", "WriteLimits",
    "stream_reserve",
]
