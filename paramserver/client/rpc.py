"""Low-level client for one parameter server.

Used by ``paramctl`` and by the worker's cluster client. It does not know
about rings or replicas: it talks to exactly one address. Errors surface as
``grpc.RpcError`` with the server's status code and message.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import grpc

from chunking.hashing import crc32c
from chunking.manifest import Manifest

from paramserver.client.channel import open_channel
from paramserver.client.manifests import read_from
from paramserver.wire.address import split_host_port
# ChunkData: the client's name for the wire's one chunk record
from paramserver.wire.chunk_record import ChunkRecord as ChunkData
from paramserver.wire.limits import DEFAULT_GET_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, MAX_PART_IDS_PER_CALL
from paramserver.client.errors import ConfigError
from paramserver.wire.proto import SERVICE_NAME, pb, pb_grpc
from paramserver.wire.getchunks import ReplyBuilder, passthrough_serializer
from paramserver.wire.heat_entries import HeatArrays, report_request
from paramserver.wire.reads import LOCAL_READ_METADATA




@dataclass(frozen=True)
class ClientConfig:
    address: str
    token: str | None = None
    tls_ca: Path | None = None  # set to use TLS (with the server's CA)
    tls: bool = False  # TLS with the system roots
    client_cert: Path | None = None  # mutual TLS: the certificate (and key) this client presents
    client_key: Path | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    timeout_s: float = 30.0  # unary calls
    stream_timeout_s: float | None = None  # streams: None = no deadline
    # Metadata reads ask for the server's own state even while it catches up (a probe comparing
    # servers); otherwise a member that is catching up refuses serializable reads (wire.reads).
    local_reads: bool = False

    def validate(self) -> ClientConfig:
        try:
            split_host_port(self.address)
        except ValueError:
            raise ConfigError(f"server address must be HOST:PORT, got {self.address!r}") from None
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if (self.client_cert is None) != (self.client_key is None):
            raise ConfigError("client_cert and client_key must be given together")
        return self


def _chunk_fields(chunk: ChunkData | pb.Chunk | tuple[Any, ...]) -> ChunkData:
    if isinstance(chunk, ChunkData):
        return chunk
    if isinstance(chunk, pb.Chunk):
        return ChunkData(chunk.id, chunk.codec, chunk.raw_size, chunk.crc32c, chunk.data)
    return ChunkData(*chunk)


def make_chunk(chunk_id: str, data: bytes, codec: str = "raw", raw_size: int | None = None) -> ChunkData:
    """A ChunkData with its CRC32C computed (raw_size defaults to len(data) for raw chunks)."""
    return ChunkData(chunk_id, codec, len(data) if raw_size is None else raw_size, crc32c(data), data)


class ParamServerClient:
    def __init__(self, config: ClientConfig | str, *, token: str | None = None) -> None:
        if isinstance(config, str):
            config = ClientConfig(config, token=token)
        self.config = config.validate()
        channel = open_channel(
            config.address, token=config.token, tls_ca=config.tls_ca, tls_cert=config.client_cert, tls_key=config.client_key,
            tls=config.tls, max_message_bytes=config.max_message_bytes,
        )  # fmt: skip
        self._channel = channel
        self.stub = pb_grpc.ParamServerStub(channel)
        # Keyword arguments of the metadata reads: none unless local reads were asked for.
        self._reads: dict[str, Any] = {"metadata": LOCAL_READ_METADATA} if config.local_reads else {}
        self._put_chunks = channel.stream_unary(
            f"/{SERVICE_NAME}/PutChunks", request_serializer=passthrough_serializer, response_deserializer=pb.PutChunksReply.FromString
        )
        # Encoded by heat_entries, not as protobuf objects: a report can be half a million entries.
        self._report_heat = channel.unary_unary(
            f"/{SERVICE_NAME}/ReportHeat", request_serializer=passthrough_serializer, response_deserializer=pb.ReportHeatReply.FromString
        )

    @property
    def address(self) -> str:
        return self.config.address

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ParamServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    # ------------------------------------------------------------ chunks

    def put_chunks(
        self, chunks: Iterable[ChunkData | pb.Chunk | tuple[Any, ...]], batch_bytes: int = 4 << 20
    ) -> pb.PutChunksReply:
        """Stream chunks in messages of about ``batch_bytes``; returns the server's acks.

        Messages are hand-encoded (paramserver.wire.getchunks): PutChunksRequest.chunks and
        GetChunksReply.chunks share field number 1, so the same encoder serves
        both, at several GB/s instead of protobuf's ~0.7 GB/s.
        """
        limit = min(batch_bytes, self.config.max_message_bytes * 3 // 4)

        def messages() -> Iterator[bytes]:
            batch = ReplyBuilder()
            for chunk in chunks:
                c = _chunk_fields(chunk)
                if batch.count and batch.payload_bytes + len(c.data) > limit:
                    yield batch.encode()
                    batch = ReplyBuilder()
                batch.add_chunk(c.id, c.data, c.codec, c.raw_size, c.crc32c)
            if batch.count:
                yield batch.encode()

        return self._put_chunks(messages(), timeout=self.config.stream_timeout_s)

    def get_chunks(
        self, ids: Sequence[str], *, max_message_bytes: int = DEFAULT_GET_MESSAGE_BYTES, allow_partial: bool = False
    ) -> Iterator[ChunkData]:
        """Stored chunks in request order. With ``allow_partial`` missing/corrupt ones are skipped
        (see :meth:`get_chunks_partial` to learn which)."""
        for reply in self.stub.GetChunks(
            pb.GetChunksRequest(ids=list(ids), max_message_bytes=max_message_bytes, allow_partial=allow_partial),
            timeout=self.config.stream_timeout_s,
        ):
            for c in reply.chunks:
                yield ChunkData(c.id, c.codec, c.raw_size, c.crc32c, c.data)

    def get_chunks_partial(
        self, ids: Sequence[str], *, max_message_bytes: int = DEFAULT_GET_MESSAGE_BYTES
    ) -> Iterator[ChunkData | pb.ChunkAck]:
        """Chunks, and a ChunkAck (MISSING / CORRUPT) for each one this server cannot serve."""
        for reply in self.stub.GetChunks(
            pb.GetChunksRequest(ids=list(ids), max_message_bytes=max_message_bytes, allow_partial=True),
            timeout=self.config.stream_timeout_s,
        ):
            for c in reply.chunks:
                yield ChunkData(c.id, c.codec, c.raw_size, c.crc32c, c.data)
            yield from reply.errors

    def has_chunks(self, ids: Sequence[str], *, claim: bool = False, timeout: float | None = None) -> list[bool]:
        """Which of ``ids`` the server holds. ``claim``: a push will rely on the ones found, so the
        server keeps them from orphan collection for another grace period."""
        request = pb.HasChunksRequest(ids=list(ids), claim=claim)
        return list(self.stub.HasChunks(request, timeout=timeout if timeout is not None else self.config.timeout_s).present)

    def report_corrupt(self, chunk_ids: Sequence[str], server_id: str, reporter: str, reason: str = "") -> int:
        reply = self.stub.ReportCorrupt(
            pb.ReportCorruptRequest(chunk_ids=list(chunk_ids), server_id=server_id, reporter=reporter, reason=reason),
            timeout=self.config.timeout_s,
        )
        return reply.accepted

    # ------------------------------------------------------------ metadata

    def announce_peer(self, request: pb.AnnouncePeerRequest, *, timeout: float = 2.0) -> pb.AnnouncePeerReply:
        return self.stub.AnnouncePeer(request, timeout=timeout)

    def find_peers(self, manifest_id: str, *, limit: int = 0, exclude_worker: str = "",
                   timeout: float = 2.0) -> pb.FindPeersReply:
        request = pb.FindPeersRequest(manifest_id=manifest_id, limit=limit, exclude_worker=exclude_worker)
        return self.stub.FindPeers(request, timeout=timeout)

    def cluster_info(self) -> pb.ClusterInfoReply:
        return self.stub.ClusterInfo(pb.ClusterInfoRequest(), timeout=self.config.timeout_s)

    def server_status(self) -> pb.ServerStatusReply:
        return self.stub.ServerStatus(pb.ServerStatusRequest(), timeout=self.config.timeout_s)

    def commit_version(
        self,
        model: str,
        manifest_id: str,
        *,
        parent: int | None = None,
        publisher: str,
        tag: str = "",
        force: bool = False,
        nbytes: int = 0,
        chunk_count: int = 0,
    ) -> pb.VersionReply:
        request = pb.CommitVersionRequest(
            model=model, manifest_id=manifest_id, publisher=publisher, tag=tag, force=force, nbytes=nbytes, chunk_count=chunk_count
        )
        if parent is not None:
            request.parent = parent
        return self.stub.CommitVersion(request, timeout=self.config.timeout_s)

    def get_manifest(
        self, *, manifest_id: str = "", model: str = "", version: int = 0, tag: str = "", linearizable: bool = False
    ) -> pb.GetManifestReply:
        return self.stub.GetManifest(
            pb.GetManifestRequest(manifest_id=manifest_id, model=model, version=version, tag=tag, linearizable=linearizable),
            timeout=self.config.timeout_s, **self._reads,
        )

    def read_manifest(self, reply: pb.GetManifestReply, *, parallel: int = 8) -> Manifest:
        """The manifest a GetManifest ``reply`` carries the root (or sole blob) of, its parts read
        from this server, every blob proven by its id: the client's one manifest reader
        (``paramserver.client.manifests``), this server only and no cache (a probe of it)."""
        return read_from(reply.manifest_id, [self.address], lambda _address: self, root=reply.data, parallel=parallel)

    def get_manifest_parts(self, part_ids: Sequence[str]) -> dict[str, bytes]:
        """The bytes of split-manifest parts, many per call (each reply holds a prefix that fits;
        the rest is asked again). Each part is proven by its id where it is decoded (Manifest.read)."""
        out: dict[str, bytes] = {}
        rest = list(dict.fromkeys(part_ids))
        while rest:
            reply = self.stub.GetManifest(pb.GetManifestRequest(part_ids=rest[:MAX_PART_IDS_PER_CALL]),
                                          timeout=self.config.timeout_s)
            got = list(reply.parts)
            if not got:  # a reply without parts (a server sends at least one) must not loop: one id at a time
                got = [self.get_manifest(manifest_id=rest[0]).data]
            out.update(zip(rest, got))
            rest = rest[len(got):]
        return out

    def resolve_tag(self, model: str, tag: str, *, linearizable: bool = False, local: bool = False) -> pb.VersionReply:
        """``local``: this member's own state, answered even while it catches up (a fallback when no leader answers)."""
        reads = {"metadata": LOCAL_READ_METADATA} if local else self._reads
        return self.stub.ResolveTag(pb.ResolveTagRequest(model=model, tag=tag, linearizable=linearizable), timeout=self.config.timeout_s,
                                    **reads)

    def get_version(self, model: str, number: int, *, linearizable: bool = False) -> pb.VersionReply:
        return self.stub.GetVersion(pb.GetVersionRequest(model=model, number=number, linearizable=linearizable),
                                    timeout=self.config.timeout_s, **self._reads)

    def list_models(self) -> pb.ListModelsReply:
        return self.stub.ListModels(pb.ListModelsRequest(), timeout=self.config.timeout_s, **self._reads)

    def list_versions(self, model: str) -> pb.ListVersionsReply:
        return self.stub.ListVersions(pb.ListVersionsRequest(model=model), timeout=self.config.timeout_s, **self._reads)

    def list_tags(self, model: str) -> pb.ListTagsReply:
        return self.stub.ListTags(pb.ListTagsRequest(model=model), timeout=self.config.timeout_s, **self._reads)

    def set_tag(self, model: str, tag: str, version: int, who: str = "") -> pb.TagReply:
        return self.stub.SetTag(pb.SetTagRequest(model=model, tag=tag, version=version, who=who), timeout=self.config.timeout_s)

    def rollback_tag(self, model: str, tag: str, who: str = "") -> pb.TagReply:
        return self.stub.RollbackTag(pb.RollbackTagRequest(model=model, tag=tag, who=who), timeout=self.config.timeout_s)

    def delete_tag(self, model: str, tag: str, who: str = "") -> pb.DeleteTagReply:
        return self.stub.DeleteTag(pb.DeleteTagRequest(model=model, tag=tag, who=who), timeout=self.config.timeout_s)

    def add_member(self, member: pb.Member) -> pb.MembershipReply:
        """Add a server to the cluster (Raft and the ring), or update a member's record (its state, its zone)."""
        return self.stub.AddMember(pb.AddMemberRequest(member=member), timeout=self.config.timeout_s)

    def remove_member(self, server_id: str) -> pb.MembershipReply:
        return self.stub.RemoveMember(pb.RemoveMemberRequest(server_id=server_id), timeout=self.config.timeout_s)

    def report_heat(self, model: str, version: int, worker: str, entries: HeatArrays | Iterable[tuple[int, int, int]]) -> None:
        """``entries``: (chunk index, count, first-access order) each, or the same as arrays."""
        self.report_heat_encoded(report_request(model, version, worker, HeatArrays.of(entries)))

    def report_heat_encoded(self, request: bytes) -> None:
        """Send a ReportHeatRequest serialised by ``heat_entries.report_request`` (one encoding for every server)."""
        self._report_heat(request, timeout=self.config.timeout_s)

    def get_heat(self, model: str, version: int) -> pb.GetHeatReply:
        return self.stub.GetHeat(pb.GetHeatRequest(model=model, version=version), timeout=self.config.timeout_s)


__all__ = ["ParamServerClient", "ClientConfig", "ChunkData", "make_chunk"]
