"""The ParamServer servicer and server assembly.

``ParamServerServicer`` composes the data plane (always present) with the
metadata plane (present once a MetadataPlane is wired in; until then its RPCs
answer UNAVAILABLE). ``start_server`` builds a grpc.Server with explicit
message limits, the token interceptor, the standard health service, and
optional TLS, and returns a handle that stops it cleanly.
"""
from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from consensus.api import MetadataPlane

from paramserver.server.auth import AuthConfig, TokenAuthInterceptor, server_credentials
from paramserver.server.config import ServerConfig
from paramserver.server.dataplane import ChunkService
from paramserver.server.heat import HeatAggregator, HeatEntry
from paramserver.wire.grpc_options import server_options
from paramserver.server.metaservice import BlobFetcher, MetadataService, RingInfo, VersionCheck
from paramserver.wire.proto import SERVICE_NAME, pb, pb_grpc
from paramserver.server.repair import RepairQueue
from paramserver.server.rpc_errors import invalid
from paramserver.server.store import ChunkStore
from paramserver.wire.getchunks import passthrough_serializer


def _no_metadata(context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAVAILABLE, "this server runs without a metadata plane yet; ask a server started with --raft")


class ParamServerServicer(pb_grpc.ParamServerServicer):
    def __init__(
        self,
        chunks: ChunkService,
        metadata: MetadataService | None = None,
        heat: HeatAggregator | None = None,
        repair_queue: RepairQueue | None = None,
    ) -> None:
        self.chunks = chunks
        self.metadata = metadata
        self.heat = heat or HeatAggregator()
        self.repair_queue = repair_queue

    # data plane
    def PutChunks(self, request_iterator: Iterable[pb.PutChunksRequest], context: grpc.ServicerContext) -> pb.PutChunksReply:
        return self.chunks.PutChunks(request_iterator, context)

    def GetChunks(self, request: pb.GetChunksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        return self.chunks.GetChunks(request, context)

    def HasChunks(self, request: pb.HasChunksRequest, context: grpc.ServicerContext) -> pb.HasChunksReply:
        return self.chunks.HasChunks(request, context)

    def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: grpc.ServicerContext) -> pb.ReportCorruptReply:
        return self.chunks.ReportCorrupt(request, context)

    # operations
    def ServerStatus(self, request: pb.ServerStatusRequest, context: grpc.ServicerContext) -> pb.ServerStatusReply:
        stats = self.chunks.store.stats()
        c = stats.cache
        reply = pb.ServerStatusReply(
            server_id=self.chunks.server_id,
            chunk_count=stats.chunk_count,
            bytes_on_disk=stats.bytes_on_disk,
            quarantined=stats.quarantined,
            repair_queue=len(self.repair_queue) if self.repair_queue is not None else 0,
            cache=pb.CacheStats(
                capacity_bytes=c.capacity_bytes, used_bytes=c.used_bytes, entries=c.entries,
                hits=c.hits, misses=c.misses, evictions=c.evictions,
            ),
        )
        if self.metadata is not None:
            plane = self.metadata.metadata
            reply.is_leader, reply.term, reply.commit_index = plane.is_leader(), plane.term(), plane.commit_index()
        return reply

    def ReportHeat(self, request: pb.ReportHeatRequest, context: grpc.ServicerContext) -> pb.ReportHeatReply:
        if not request.model or not request.version:
            invalid(context, "ReportHeat needs model and version")
        self.heat.report(request.model, request.version, (HeatEntry(e.chunk_index, e.count, e.first_access_order) for e in request.entries))
        return pb.ReportHeatReply()

    def GetHeat(self, request: pb.GetHeatRequest, context: grpc.ServicerContext) -> pb.GetHeatReply:
        entries, reports = self.heat.get(request.model, request.version)
        return pb.GetHeatReply(
            model=request.model,
            version=request.version,
            entries=[pb.HeatEntry(chunk_index=e.chunk_index, count=e.count, first_access_order=e.first_access_order) for e in entries],
            reports=reports,
        )


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: ParamServerServicer, request: Any, context: grpc.ServicerContext) -> Any:
        if self.metadata is None:
            return _no_metadata(context)
        return getattr(self.metadata, name)(request, context)

    method.__name__ = name
    return method


for _name in (
    "ClusterInfo", "CommitVersion", "GetManifest", "ResolveTag", "GetVersion", "ListModels", "ListVersions",
    "ListTags", "SetTag", "RollbackTag", "DeleteTag", "AddMember", "RemoveMember",
):  # fmt: skip
    setattr(ParamServerServicer, _name, _delegate(_name))


class _HandlerCapture:
    """Stands in for a grpc.Server to capture the generated method-handler table."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service_name: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]) -> None:
        self.handlers = dict(handlers)


def register_servicer(servicer: pb_grpc.ParamServerServicer, server: grpc.Server) -> None:
    """Like the generated add_ParamServerServicer_to_server, but GetChunks sends
    pre-encoded bytes (paramserver.wire.getchunks), skipping protobuf's slow serializer."""
    capture = _HandlerCapture()
    pb_grpc.add_ParamServerServicer_to_server(servicer, capture)
    handlers = capture.handlers
    get = handlers["GetChunks"]
    assert get.unary_stream is not None  # GetChunks is unary -> stream in paramserver.proto
    handlers["GetChunks"] = grpc.unary_stream_rpc_method_handler(
        get.unary_stream, request_deserializer=get.request_deserializer, response_serializer=passthrough_serializer
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    address: str
    servicer: ParamServerServicer
    health: health.HealthServicer

    def stop(self, grace: float | None = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(timeout=(grace or 0) + 5)


def start_server(
    config: ServerConfig,
    store: ChunkStore | None = None,
    *,
    metadata: MetadataPlane | None = None,
    repair_queue: RepairQueue | None = None,
    fetch_blob: BlobFetcher | None = None,
    version_check: VersionCheck | None = None,
) -> RunningServer:
    """Build, bind and start the gRPC server described by ``config`` (port 0 picks a free port)."""
    config.validate()
    queue = repair_queue if repair_queue is not None else RepairQueue()
    if store is None:
        store = ChunkStore(config.data_dir, cache_bytes=config.cache_bytes, fsync=config.fsync, on_corrupt=queue.add)
    chunks = ChunkService(
        store, config.server_id, repair_queue=queue, get_message_bytes=config.get_message_bytes, max_message_bytes=config.max_message_bytes
    )
    meta = None
    if metadata is not None:
        ring = RingInfo(config.vnodes, config.replication_factor, config.write_quorum)
        meta = MetadataService(metadata, store, ring, fetch_blob=fetch_blob, version_check=version_check)
    servicer = ParamServerServicer(chunks, meta, repair_queue=queue)

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix=f"grpc-{config.server_id}"),
        interceptors=[TokenAuthInterceptor(AuthConfig(config.admin_token, config.read_token))],
        options=server_options(config.max_message_bytes),
        maximum_concurrent_rpcs=config.workers * 8,
    )
    register_servicer(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.tls_cert is not None and config.tls_key is not None:
        port = server.add_secure_port(config.listen, server_credentials(config.tls_cert, config.tls_key, config.tls_ca))
    else:
        port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}: the address is in use or not local")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = config.listen.rpartition(":")[0]
    return RunningServer(server, port, f"{host}:{port}", servicer, health_servicer)


__all__ = ["ParamServerServicer", "RunningServer", "start_server", "register_servicer"]
