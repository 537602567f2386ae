"""gRPC data plane over the chunk store: PutChunks, GetChunks, HasChunks, ReportCorrupt.

Typed store errors become status codes here (via rpc_errors) and nowhere else:
a chunk whose bytes do not match its id -> INVALID_ARGUMENT; received bytes
failing their CRC32C, or a stored copy failing verification -> DATA_LOSS; an
unknown chunk -> NOT_FOUND. Every message names the chunk.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import grpc

from paramserver.server.config import DEFAULT_GET_MESSAGE_BYTES
from paramserver.server.errors import ChunkCorruptError, ChunkNotFoundError, InvalidChunkError
from paramserver.wire.proto import pb
from paramserver.server.repair import RepairQueue
from paramserver.server.rpc_errors import abort_with, invalid
from paramserver.server.store import ChunkStore
from paramserver.wire.getchunks import ReplyBuilder

MAX_IDS_PER_CALL = 1 << 20


class ChunkService:
    def __init__(
        self,
        store: ChunkStore,
        server_id: str,
        *,
        repair_queue: RepairQueue | None = None,
        get_message_bytes: int = DEFAULT_GET_MESSAGE_BYTES,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        self.store = store
        self.server_id = server_id
        self.repair_queue = repair_queue
        self.get_message_bytes = get_message_bytes
        self.max_message_bytes = max_message_bytes

    # ----------------------------------------------------------- PutChunks

    def PutChunks(self, request_iterator: Iterable[pb.PutChunksRequest], context: grpc.ServicerContext) -> pb.PutChunksReply:
        reply = pb.PutChunksReply(server_id=self.server_id)
        stored = present = nbytes = 0
        for request in request_iterator:
            batch = [(c.id, c.data, c.codec, c.raw_size, c.crc32c) for c in request.chunks]
            try:
                results = self.store.put_many(batch)
            except InvalidChunkError as exc:
                abort_with(context, exc)
            for (chunk_id, data, *_rest), was_stored in zip(batch, results):
                if was_stored:
                    stored += 1
                    nbytes += len(data)
                    reply.acks.add(id=chunk_id, status=pb.STORED)
                else:
                    present += 1
                    reply.acks.add(id=chunk_id, status=pb.ALREADY_PRESENT)
                if self.repair_queue is not None:
                    self.repair_queue.done(chunk_id)  # a fresh verified copy arrived
        reply.chunks_stored, reply.chunks_present, reply.bytes_stored = stored, present, nbytes
        return reply

    # ----------------------------------------------------------- GetChunks

    def GetChunks(self, request: pb.GetChunksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        if len(request.ids) > MAX_IDS_PER_CALL:
            invalid(context, f"GetChunks asks for {len(request.ids)} chunks; split the request into calls of at most {MAX_IDS_PER_CALL}")
        target = request.max_message_bytes or self.get_message_bytes
        # Payload is capped at 3/4 of the hard limit so per-chunk envelopes never overflow it.
        target = max(1, min(target, self.max_message_bytes * 3 // 4))
        partial = request.allow_partial
        # Replies are pre-encoded bytes (wire.ReplyBuilder); the server registers
        # GetChunks with a pass-through serializer (service.register_servicer).
        reply = ReplyBuilder()
        for chunk_id in request.ids:
            try:
                chunk = self.store.get(chunk_id)
            except (ChunkNotFoundError, ChunkCorruptError) as exc:
                if not partial:
                    if reply.count:
                        yield reply.encode()
                    abort_with(context, exc)
                reply.add_error(chunk_id, pb.MISSING if isinstance(exc, ChunkNotFoundError) else pb.CORRUPT, str(exc))
                continue
            except InvalidChunkError as exc:
                abort_with(context, exc)
            if reply.count and reply.payload_bytes + len(chunk.data) > target:
                yield reply.encode()
                reply = ReplyBuilder()
            # The bytes read from disk go into the message as-is: one join, no re-encoding.
            reply.add_chunk(chunk_id, chunk.data, chunk.codec, chunk.raw_size, chunk.crc32c)
        if reply:
            yield reply.encode()

    # ----------------------------------------------------------- HasChunks

    def HasChunks(self, request: pb.HasChunksRequest, context: grpc.ServicerContext) -> pb.HasChunksReply:
        if len(request.ids) > MAX_IDS_PER_CALL:
            invalid(context, f"HasChunks asks about {len(request.ids)} chunks; split it into calls of at most {MAX_IDS_PER_CALL}")
        if request.claim:
            # A chunk reported present to a push will not be sent again: it must not be
            # collected as an orphan before that push commits (see paramserver.server.gc).
            present = self.store.claim(request.ids)
        else:
            has = self.store.has
            present = [has(chunk_id) for chunk_id in request.ids]
        return pb.HasChunksReply(present=present, present_count=sum(present))

    # ----------------------------------------------------------- ReportCorrupt

    def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: grpc.ServicerContext) -> pb.ReportCorruptReply:
        """A client saw bad bytes from a replica. If that replica is us, re-verify now."""
        accepted = 0
        for chunk_id in request.chunk_ids:
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


__all__ = ["ChunkService", "MAX_IDS_PER_CALL"]
