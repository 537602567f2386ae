"""The peer port under TLS: a gRPC server with mutual TLS that answers only ``GetChunks``.

The bulk frames have no encryption, so a cluster that runs TLS reads peers the way it reads
servers: GetChunks over a channel with the cluster's CA and certificates. The client's certificate
must be signed by the cluster's CA (``require_client_auth``), and the call must carry the cluster's
read token as ``authorization: Bearer`` metadata, as the servers ask (paramserver.wire.auth). Every
other method of the ParamServer service is UNIMPLEMENTED (gRPC answers so for unknown methods).

Replies are the servers' exact encoding (paramserver.wire.getchunks ``ReplyBuilder``): chunks and
MISSING acks coalesced into messages of about the reader's ``max_message_bytes``; gRPC-Python takes
a message as bytes, so each reply is joined once (the bulk frames send from where the bytes lie).
Limits: ``max_connections`` open connections (gRPC core's quota), ``max_sessions`` calls answered
at once (the thread pool), more queued up to 4x then RESOURCE_EXHAUSTED. grpcio has no hook at
accept, so the per-source cap of the bulk port has no twin here: mutual TLS already limits who can
connect to holders of a certificate of the cluster's CA.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from google.protobuf.message import DecodeError

from chunking.hashing import is_content_id
from paramserver.wire.auth import AUTH_HEADER, bearer_token, read_tls_file
from paramserver.wire.getchunks import ReplyBuilder, passthrough_serializer
from paramserver.wire.grpc_options import server_options
from paramserver.wire.limits import DEFAULT_GET_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from paramserver.wire.proto import SERVICE_NAME, pb
from worker.errors import ConfigError
from worker.peer_common import MISSING_MESSAGE, PeerCounters, PeerPortConfig, TLSFiles, check_token, lower_priority
from worker.peer_shelf import PeerShelf

log = logging.getLogger(__name__)

MAX_IDS_PER_CALL = 1 << 16  # a swarm's window is a few thousand chunks; a call asking more is refused
_QUEUED_PER_SESSION = 4


def _request(raw: bytes) -> pb.GetChunksRequest | None:
    try:
        return pb.GetChunksRequest.FromString(raw)
    except DecodeError:  # answered INVALID_ARGUMENT, not INTERNAL
        return None


class PeerGrpcServer:
    def __init__(self, shelf: PeerShelf, config: PeerPortConfig, token: str | None, tls: TLSFiles,
                 counters: PeerCounters) -> None:
        self.shelf = shelf
        self.config = config
        self.token = token
        self.counters = counters
        self.active = 0  # calls being answered
        self._lock = threading.Lock()
        ca_path, cert_path, key_path = tls
        ca, cert, key = read_tls_file(ca_path), read_tls_file(cert_path), read_tls_file(key_path)
        assert ca is not None and cert is not None and key is not None
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=config.max_sessions, thread_name_prefix="peer-grpc"),
            options=server_options(DEFAULT_MAX_MESSAGE_BYTES, max_connections=config.max_connections),
            maximum_concurrent_rpcs=config.max_sessions * _QUEUED_PER_SESSION,
        )
        handler = grpc.unary_stream_rpc_method_handler(self.get_chunks, request_deserializer=_request,
                                                       response_serializer=passthrough_serializer)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"GetChunks": handler}),))
        credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        try:
            self.port = self._server.add_secure_port(config.listen, credentials)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {config.listen} for the peer port ({exc}); pick another --peer-listen") from None
        if not self.port:
            raise ConfigError(f"cannot listen on {config.listen} for the peer port; pick another --peer-listen")

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=1.0).wait(5.0)

    def get_chunks(self, request: pb.GetChunksRequest | None, context: grpc.ServicerContext) -> Iterator[bytes]:
        lower_priority()
        given = None
        for key, value in context.invocation_metadata() or ():
            if key == AUTH_HEADER:
                given = bearer_token(value)
        problem = check_token(given, self.token)
        if problem is not None:
            self.counters.refuse("unauthenticated")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
        if request is None:
            self.counters.refuse("bad_request")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "GetChunks request does not parse")
        assert request is not None
        ids = list(dict.fromkeys(request.ids))
        if len(ids) > MAX_IDS_PER_CALL:
            self.counters.refuse("bad_request")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"GetChunks asks a peer for {len(ids)} chunks; split it into calls of at most {MAX_IDS_PER_CALL}")
        with self._lock:
            self.active += 1
        try:
            yield from self._answer(ids, request, context)
        finally:
            with self._lock:
                self.active -= 1

    def _answer(self, ids: list[str], request: pb.GetChunksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        target = request.max_message_bytes or DEFAULT_GET_MESSAGE_BYTES
        target = max(1, min(target, DEFAULT_MAX_MESSAGE_BYTES * 3 // 4))
        left = context.time_remaining()
        wait_s = self.config.peer_wait_s if left is None else max(0.0, min(self.config.peer_wait_s, left - 0.5))
        wait_until = time.monotonic() + wait_s
        sizes = self.shelf.raw_sizes(ids).tolist()
        reply = ReplyBuilder()
        start = 0
        while start < len(ids):
            # a step waits for and reads about one message (sizes the shelf knows; an unknown one,
            # the disk tier's, is read alone)
            stop, planned = start, 0
            while stop < len(ids) and (stop == start or planned < target):
                planned += sizes[stop] or target
                stop += 1
            step = ids[start:stop]
            ok_chunks = ok_bytes = 0
            for chunk_id, found in zip(step, self.shelf.find(step, wait_until)):
                if found is None or not is_content_id(chunk_id):
                    if not request.allow_partial:
                        if reply:
                            yield reply.encode()
                        context.abort(grpc.StatusCode.NOT_FOUND, f"chunk {chunk_id[:80]}: {MISSING_MESSAGE}")
                    if reply and reply.size > target:
                        yield reply.encode()
                        reply = ReplyBuilder()
                    reply.add_error(chunk_id[:80], pb.MISSING, MISSING_MESSAGE)
                    continue
                n = found.view.nbytes
                if reply and reply.size + n > target:
                    yield reply.encode()
                    reply = ReplyBuilder()
                reply.add_chunk(chunk_id, found.view, "raw", n, found.crc)
                ok_chunks += 1
                ok_bytes += n
            self.counters.served(ok_chunks, ok_bytes, len(step) - ok_chunks)
            start = stop
        if reply:
            yield reply.encode()


__all__ = ["MAX_IDS_PER_CALL", "PeerGrpcServer"]
