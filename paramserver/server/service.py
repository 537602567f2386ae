"""The ParamServer servicer and server assembly.

``ParamServerServicer`` composes the data plane (always present) with the
metadata plane (present once a MetadataPlane is wired in; until then its RPCs
answer UNAVAILABLE). ``start_server`` builds a grpc.Server with explicit
message limits, the token interceptor, the standard health service, and
optional TLS, and returns a handle that stops it cleanly.

ReportHeat is a read call, so it is bounded (issue 11): the version must exist on the
metadata plane (a server without one takes indexes below ``MAX_HEAT_ENTRIES_PER_CALL``),
one call carries at most the version's chunk count of entries (and at most
``MAX_HEAT_REQUEST_BYTES`` of message), every index below
the chunk count, and the aggregated heat is bounded (paramserver.server.heat). Its message is
received unparsed: an oversized one, one without model and version, or one for a version this
server does not have is refused before its entries are parsed (heat_entries.report_header).
ServerStatus carries this server's cluster id (``extra["cluster_id"]``, see
metaservice.cluster_id), which AddMember checks on a new member, the chunk bytes this server sent
(``served_bytes``, paramserver.server.served_bytes) and its worker-peer entries. AnnouncePeer and
FindPeers are the worker-peer directory's (paramserver.server.peer_service).
"""
from __future__ import annotations

import resource
import shutil
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from consensus.api import MetadataPlane
from consensus.errors import MetadataError
from consensus.validation import MAX_NAME_LENGTH

from paramserver.server.auth import AuthConfig, TokenAuthInterceptor, handler_like, server_credentials
from paramserver.server.config import ServerConfig
from paramserver.server.dataplane import DEFAULT_MAX_CALL_BYTES, ChunkService, WriteLimits
from paramserver.server.errors import ConfigError
from paramserver.server.grpc_gate import GrpcGate, private_backend_dir
from paramserver.server.heat import HeatAggregator
from paramserver.server.hot_chunks import HotChunks
from paramserver.server.peer_service import BadRequest, PeerService
from paramserver.server.served_bytes import ServedBytes
from paramserver.wire.conn_limits import ConnectionLimits
from paramserver.wire.grpc_options import server_options
from paramserver.wire.limits import HEAT_ENTRIES_PER_CALL, MAX_HEAT_ENTRIES_PER_CALL, MAX_HEAT_REQUEST_BYTES
from paramserver.server.metaservice import (
    CLUSTER_ID_KEY, BlobFetcher, MemberProbe, MetadataService, RingInfo, VersionCheck, cluster_id,
)
from paramserver.wire.proto import SERVICE_NAME, pb, pb_grpc
from paramserver.server.repair import RepairQueue
from paramserver.server.rpc_errors import abort_with, invalid
from paramserver.server.store import ChunkStore
from paramserver.wire.getchunks import passthrough_serializer
from paramserver.wire.heat_entries import report_header, request_arrays



class _RawHeat:
    """A ReportHeat message as received: parsed only once its size, model and version pass."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


def _heat_request(raw: bytes) -> _RawHeat:
    return _RawHeat(raw)


class _Malformed:
    """A request message that does not parse: the call is answered INVALID_ARGUMENT, not logged as
    grpc's "Exception deserializing message!" traceback (which any client could make it print)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError and whatever a message's own checks raise
            return _Malformed(f"{method}: the request message does not parse ({type(exc).__name__}); send a "
                              f"{method}Request of paramserver.proto")
    return parse


def _refuse_malformed(context: grpc.ServicerContext, request: Any) -> Any:
    if isinstance(request, _Malformed):
        invalid(context, request.error)
    return request


def _checked(handler: grpc.RpcMethodHandler[Any, Any], method: str) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with a request deserializer that never raises, and a behaviour that refuses
    what it could not parse."""
    deserialize = _lenient(handler.request_deserializer or (lambda raw: raw), method)
    inner = handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary
    assert inner is not None

    def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
        if handler.request_streaming:  # an iterator of requests, each checked as it is taken
            return inner((_refuse_malformed(context, r) for r in request), context)
        return inner(_refuse_malformed(context, request), context)

    return handler_like(handler, behaviour, deserialize)


def _no_metadata(context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAVAILABLE, "this server runs without a metadata plane yet; ask a server started with --raft")


class ParamServerServicer(pb_grpc.ParamServerServicer):
    def __init__(
        self,
        chunks: ChunkService,
        metadata: MetadataService | None = None,
        heat: HeatAggregator | None = None,
        repair_queue: RepairQueue | None = None,
        cluster_id: str = "",
        placement: Callable[[], Mapping[str, str]] | None = None,
        peers: PeerService | None = None,
    ) -> None:
        self.chunks = chunks
        # Worker peers (AnnouncePeer / FindPeers): soft state of this server (peer_service).
        self.peers = peers or PeerService(chunks.server_id)
        self.metadata = metadata
        self.heat = heat or HeatAggregator()
        self.repair_queue = repair_queue
        self.cluster_id = cluster_id
        self.placement = placement
        # The gRPC gate's connection counts (open, idle, refused, evicted), for ServerStatus.
        self.connections: Callable[[], Mapping[str, int]] | None = None

    # data plane
    def PutChunks(self, request_iterator: Iterable[pb.PutChunksRequest], context: grpc.ServicerContext) -> pb.PutChunksReply:
        return self.chunks.PutChunks(request_iterator, context)

    def GetChunks(self, request: pb.GetChunksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        return self.chunks.GetChunks(request, context)

    def HasChunks(self, request: pb.HasChunksRequest, context: grpc.ServicerContext) -> pb.HasChunksReply:
        return self.chunks.HasChunks(request, context)

    def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: grpc.ServicerContext) -> pb.ReportCorruptReply:
        return self.chunks.ReportCorrupt(request, context)

    def GetHotChunks(self, request: pb.GetHotChunksRequest, context: grpc.ServicerContext) -> pb.GetHotChunksReply:
        """The hot chunks this server placed extra copies for, and where (empty with hot chunks off)."""
        hot = self.chunks.hot
        if hot is None:
            return pb.GetHotChunksReply(server_id=self.chunks.server_id)
        return hot.reply(self.chunks.server_id)

    # worker peers
    def AnnouncePeer(self, request: pb.AnnouncePeerRequest, context: grpc.ServicerContext) -> pb.AnnouncePeerReply:
        """Keep what a worker says it holds or loads, for a lease (any valid token: a read)."""
        try:
            return self.peers.announce(request)
        except BadRequest as exc:
            invalid(context, f"AnnouncePeer: {exc}")

    def FindPeers(self, request: pb.FindPeersRequest, context: grpc.ServicerContext) -> pb.FindPeersReply:
        """The earliest loaders of a version, then a shuffled sample of its other peers."""
        try:
            return self.peers.find(request)
        except BadRequest as exc:
            invalid(context, f"FindPeers: {exc}")

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
            # the bulk port's sessions count into the same ServedBytes (start_server's ``served``)
            served_bytes=self.chunks.served.total(),
            peer_entries=self.peers.entries(),
        )
        reply.extra[CLUSTER_ID_KEY] = self.cluster_id
        if self.placement is not None:
            reply.extra.update(self.placement())
        if self.connections is not None:
            reply.extra.update({f"grpc_connections_{k}": str(v) for k, v in self.connections().items()})
        if self.chunks.hot is not None:
            h = self.chunks.hot.stats()
            reply.extra.update({"hot_chunks": str(h.hot_chunks), "hot_advertised": str(h.advertised),
                                "hot_extra_chunks": str(h.extra_chunks), "hot_extra_bytes": str(h.extra_bytes)})
        if self.metadata is not None:
            plane = self.metadata.metadata
            reply.is_leader, reply.term, reply.commit_index = plane.is_leader(), plane.term(), plane.commit_index()
        return reply

    def ReportHeat(self, request: _RawHeat, context: grpc.ServicerContext) -> pb.ReportHeatReply:
        # Refused before a parse when large, headless, or for a version this server does not have: a
        # flood of 20 MiB reports parsed each (GIL held) once cost the leader its elections.
        raw = request.raw
        if len(raw) > MAX_HEAT_REQUEST_BYTES:
            self._refuse_heat(context, f"ReportHeat message is {len(raw)} bytes; the limit is {MAX_HEAT_REQUEST_BYTES} "
                                       f"(at most {HEAT_ENTRIES_PER_CALL} entries per call, and no more than the "
                                       "version's chunk count)")
        try:
            model, version = report_header(raw)
        except ValueError as exc:
            self._refuse_heat(context, f"ReportHeat: the request message does not parse ({exc}); send a "
                                       "ReportHeatRequest of paramserver.proto")
        if not model or not version:
            self._refuse_heat(context, "ReportHeat needs model and version, before its entries (as protobuf writes them)")
        if len(model) > MAX_NAME_LENGTH:
            self._refuse_heat(context, f"model name is {len(model)} characters; model names have at most {MAX_NAME_LENGTH}")
        try:
            size = self._chunk_count(model, version, context)
        except BaseException:  # NOT_FOUND for a version this server does not have (abort raises)
            self.heat.count_call(parsed=False)
            raise
        self.heat.count_call(parsed=True)
        try:
            parsed = pb.ReportHeatRequest.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError: a message that is not one
            invalid(context, f"ReportHeat: the request message does not parse ({type(exc).__name__}); send a "
                             "ReportHeatRequest of paramserver.proto")
        if (parsed.model, parsed.version) != (model, version):
            invalid(context, "ReportHeat names its model or version twice, differently; send each once")
        n = len(parsed.entries)
        limit, what = MAX_HEAT_ENTRIES_PER_CALL, "the per-call limit"
        if size is not None and size < limit:
            limit, what = size, f"the chunk count of {model} version {version}"
        if n > limit:
            invalid(context, f"ReportHeat carries {n} entries; the limit is {limit} ({what}): one entry per chunk of the version")
        arrays = request_arrays(parsed)  # vectorised: no Python step per entry
        if n and int(arrays.index.max()) >= limit:
            bad = int(arrays.index.max())
            invalid(context, f"ReportHeat names chunk_index {bad}; the indexes of {model} version {version} are 0..{limit - 1} "
                             f"({what})")
        try:
            self.heat.report(model, version, arrays, size=size)
        except ValueError as exc:
            invalid(context, f"ReportHeat: {exc}")
        return pb.ReportHeatReply()

    def _refuse_heat(self, context: grpc.ServicerContext, message: str) -> NoReturn:
        self.heat.count_call(parsed=False)
        invalid(context, message)

    def _chunk_count(self, model: str, version: int, context: grpc.ServicerContext) -> int | None:
        """The version's chunk count from the metadata plane (NOT_FOUND when it has no such version);
        None without a metadata plane, or for a version recorded without a count."""
        if self.metadata is None:
            return None
        try:
            record = self.metadata.metadata.get_version(model, version).value
        except (MetadataError, ValueError) as exc:
            abort_with(context, exc)
        return record.chunk_count or None

    def GetHeat(self, request: pb.GetHeatRequest, context: grpc.ServicerContext) -> bytes:
        """The encoded GetHeatReply (registered with a pass-through serializer): cached per version."""
        if len(request.model) > MAX_NAME_LENGTH:
            invalid(context, f"model name is {len(request.model)} characters; model names have at most {MAX_NAME_LENGTH}")
        return self.heat.get_reply(request.model, request.version)


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
    """Like the generated add_ParamServerServicer_to_server, but GetChunks and GetHeat send
    pre-encoded bytes (paramserver.wire.getchunks, paramserver.server.heat), skipping protobuf's
    slow serializer, ReportHeat refuses an oversized message before parsing it, and a request that
    does not parse is answered INVALID_ARGUMENT."""
    capture = _HandlerCapture()
    pb_grpc.add_ParamServerServicer_to_server(servicer, capture)
    handlers = capture.handlers
    get = handlers["GetChunks"]
    assert get.unary_stream is not None  # GetChunks is unary -> stream in paramserver.proto
    handlers["GetChunks"] = grpc.unary_stream_rpc_method_handler(
        get.unary_stream, request_deserializer=get.request_deserializer, response_serializer=passthrough_serializer
    )
    heat = handlers["GetHeat"]
    assert heat.unary_unary is not None
    handlers["GetHeat"] = grpc.unary_unary_rpc_method_handler(
        heat.unary_unary, request_deserializer=heat.request_deserializer, response_serializer=passthrough_serializer
    )
    report = handlers["ReportHeat"]
    assert report.unary_unary is not None
    handlers["ReportHeat"] = grpc.unary_unary_rpc_method_handler(
        report.unary_unary, request_deserializer=_heat_request, response_serializer=report.response_serializer
    )
    handlers = {name: _checked(handler, name) for name, handler in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


@dataclass
class RunningServer:
    """``port``/``address``: the gate's (``paramserver.server.grpc_gate``), which owns ``--listen``."""

    server: grpc.Server
    port: int
    address: str
    servicer: ParamServerServicer
    health: health.HealthServicer
    gate: GrpcGate

    def stop(self, grace: float | None = 1.0) -> None:
        self.gate.close_listener()  # no new clients; the calls in flight finish through the gate
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(timeout=(grace or 0) + 5)
        self.gate.stop()
        self.servicer.chunks.close()


# A server config's keys for the gRPC service.
CONFIG_KEYS = ("get_call_bytes", "max_connections", "max_connections_per_source")
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_CONNECTIONS_PER_SOURCE = 256
# Of the open-file limit, what the gRPC port's connections may take: the rest is the chunk
# store's (one descriptor per segment file), Raft's links, the bulk port's and the metrics'.
CONNECTIONS_SHARE_OF_FDS = 4
# Through the gate a connection holds three descriptors in this process (the client's, the gate's
# end of the relay and gRPC's), so the gate admits at most this share of the open-file limit / 3.
GATE_SHARE_OF_FDS = 2
FDS_PER_GATED_CONNECTION = 3


def get_call_bytes(extra: Any) -> int:
    """GetChunks' per-call byte limit: the config file's extra key ``get_call_bytes``, else the default."""
    return _positive(extra, "get_call_bytes", DEFAULT_MAX_CALL_BYTES)


def max_connections(extra: Any, fd_limit: int | None = None) -> int:
    """How many connections the gRPC port keeps open at once: the config file's extra key
    ``max_connections`` (default 4096), and at most a quarter of the open-file limit."""
    wanted = _positive(extra, "max_connections", DEFAULT_MAX_CONNECTIONS)
    if fd_limit is None:
        fd_limit = _fd_limit()
    return max(1, min(wanted, fd_limit // CONNECTIONS_SHARE_OF_FDS))


def connection_limits(extra: Any, fd_limit: int | None = None) -> ConnectionLimits:
    """The gRPC port's connection limits: the config file's extra keys ``max_connections`` (total,
    default 4096) and ``max_connections_per_source`` (connections that made calls, from one client
    address; default 256), the total at most half the open-file limit's worth of gated connections
    (three descriptors each)."""
    if fd_limit is None:
        fd_limit = _fd_limit()
    per_source = _positive(extra, "max_connections_per_source", DEFAULT_MAX_CONNECTIONS_PER_SOURCE)
    limits = ConnectionLimits(per_source, max_connections(extra, fd_limit))
    return limits.within(fd_limit // GATE_SHARE_OF_FDS // FDS_PER_GATED_CONNECTION)


def _fd_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _positive(extra: Any, key: str, default: int) -> int:
    value = extra.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def start_server(
    config: ServerConfig,
    store: ChunkStore | None = None,
    *,
    metadata: MetadataPlane | None = None,
    repair_queue: RepairQueue | None = None,
    fetch_blob: BlobFetcher | None = None,
    version_check: VersionCheck | None = None,
    member_probe: MemberProbe | None = None,
    hot: HotChunks | None = None,
    heat: HeatAggregator | None = None,
    placement: Callable[[], Mapping[str, str]] | None = None,
    served: ServedBytes | None = None,
    peers: PeerService | None = None,
) -> RunningServer:
    """Build, bind and start the gRPC server described by ``config`` (port 0 picks a free port).

    ``member_probe``: AddMember's check that a new member answers and runs this cluster
    (paramserver.server.cluster.MemberCheck); None adds members unchecked. ``hot``: the hot-chunk
    state (paramserver.server.hot_chunks; None: hot chunks off). ``heat``: the heat aggregator
    (None: a fresh one, kept in memory only). ``placement``: ServerStatus extras saying where this
    server's chunks are placed (``ReReplicator.placement``). ``served``: the chunk-byte counters
    GetChunks adds to (give the bulk port the same one: ServerStatus reports their sum).
    ``peers``: the worker-peer directory (None: a fresh one). The write-stream
    limits and GetChunks' per-call byte limit come from the config file's extra keys
    ``max_write_streams``, ``write_stream_idle_s`` and ``get_call_bytes``."""
    config.validate()
    auth = AuthConfig(config.admin_token, config.read_token)
    queue = repair_queue if repair_queue is not None else RepairQueue()
    if store is None:
        store = ChunkStore(config.data_dir, cache_bytes=config.cache_bytes, fsync=config.fsync, on_corrupt=queue.add)
    chunks = ChunkService(
        store, config.server_id, repair_queue=queue, get_message_bytes=config.get_message_bytes,
        max_message_bytes=config.max_message_bytes, auth=auth, workers=config.workers,
        write_limits=WriteLimits.from_extra(config.extra), max_call_bytes=get_call_bytes(config.extra), hot=hot,
        served=served,
    )  # fmt: skip
    meta = None
    if metadata is not None:
        ring = RingInfo(config.vnodes, config.replication_factor, config.write_quorum)
        meta = MetadataService(metadata, store, ring, fetch_blob=fetch_blob, version_check=version_check, member_probe=member_probe)
    servicer = ParamServerServicer(chunks, meta, heat=heat, repair_queue=queue, placement=placement,
                                   cluster_id=cluster_id(config.cluster_secret, config.vnodes), peers=peers)

    limits = connection_limits(config.extra)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix=f"grpc-{config.server_id}"),
        interceptors=[TokenAuthInterceptor(auth)],
        # gRPC's own cap stays as a backstop behind the gate; the slack covers evicted connections
        # that gRPC has not finished closing when their places are taken again (a burst of them).
        options=server_options(config.max_message_bytes, max_connections=2 * limits.total + 64),
        maximum_concurrent_rpcs=config.workers * 8,
    )
    register_servicer(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # gRPC listens on a unix socket in a private directory; the gate owns --listen (grpc_gate.py).
    backend_dir = private_backend_dir()
    try:
        gate = GrpcGate(config.listen, backend_dir, limits)
    except (OSError, ValueError) as exc:
        shutil.rmtree(backend_dir, ignore_errors=True)
        raise OSError(f"cannot listen on {config.listen}: the address is in use or not local ({exc})") from None
    backend = f"unix:{gate.backend_path}"
    if config.tls_cert is not None and config.tls_key is not None:
        bound = server.add_secure_port(backend, server_credentials(config.tls_cert, config.tls_key, config.tls_ca))
    else:
        bound = server.add_insecure_port(backend)
    if bound == 0:
        gate.stop()
        raise OSError(f"cannot listen on {gate.backend_path} (the gRPC server behind {config.listen})")
    server.start()
    gate.start()
    servicer.connections = gate.stats
    chunks.source_of = gate.source_of  # read-slot shares are per client address, which only the gate sees
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = config.listen.rpartition(":")[0]
    return RunningServer(server, gate.port, f"{host}:{gate.port}", servicer, health_servicer, gate)


__all__ = ["CONFIG_KEYS", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_MAX_CONNECTIONS_PER_SOURCE", "MAX_HEAT_ENTRIES_PER_CALL",
           "MAX_HEAT_REQUEST_BYTES", "ParamServerServicer", "RunningServer", "connection_limits", "get_call_bytes",
           "max_connections", "register_servicer", "start_server"]
