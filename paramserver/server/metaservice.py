"""gRPC metadata plane: versions, tags, members, manifests, over a MetadataPlane.

Consensus errors are mapped to status codes here (rpc_errors): NotFound ->
NOT_FOUND, Conflict -> ABORTED, Invalid -> INVALID_ARGUMENT, NotLeader /
NoQuorum / CommitTimeout / CatchingUp -> UNAVAILABLE (NotLeader adds the leader's address
as trailing metadata ``pdparams-leader``).

Serializable metadata reads (every read not marked ``linearizable``, ClusterInfo aside) are
answered only while this member is in sync (``MetadataPlane.sync_state``); a member catching
up refuses them with CatchingUp, so clients ask another (``paramserver.wire.reads``).

Before a commit, ``version_check`` (a hook the cluster layer provides) must
prove invariant 2: every chunk of the manifest reached its write quorum with the
manifest's CRC, and say which model the manifest names (a commit under another
model is refused). The default only proves that the manifest itself is readable here.

Before AddMember, ``member_probe`` (also from the cluster layer) must show that the
new member answers ServerStatus as the server id it is added under and runs this
cluster's id (``cluster_id``: derived from the cluster secret and the ring's vnodes);
a refusal is FAILED_PRECONDITION naming the address, and is logged at WARNING.
Self-registration (paramserver.server.process) calls the metadata plane directly.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import grpc

from chunking.hashing import content_id, is_content_id
from consensus.api import MetadataPlane
from consensus.errors import CatchingUp
from consensus.records import MemberRecord, ReadResult, TagRecord, VersionRecord

from paramserver.server import codecs
from paramserver.server.errors import InvalidChunkError, ParamServerError
from paramserver.wire.limits import MAX_PART_IDS_PER_CALL, MAX_PARTS_REPLY_BYTES
from paramserver.wire.proto import pb
from paramserver.wire.reads import wants_local
from paramserver.wire.ring import replication_and_quorum
from paramserver.server.rpc_errors import MAPPED, PreconditionFailed, abort_with, invalid
from paramserver.server.store import ChunkStore

log = logging.getLogger(__name__)

CLUSTER_ID_KEY = "cluster_id"  # ServerStatusReply.extra key

# A serializable read at a member not in sync waits this long for it before being refused: a new
# leader's first commit, or a follower one heartbeat behind, is in sync again within it, while a
# member catching up after a restart sends its clients on to another member at little cost.
CATCH_UP_WAIT_S = 0.2
_CATCH_UP_POLL_S = 0.01


def cluster_id(secret: str | None, vnodes: int, hash_name: str = "blake3") -> str:
    """What every member of one cluster shares: an HMAC of the ring parameters under the cluster
    secret (never the secret itself). Members with another secret, or another ring, differ."""
    message = f"pdparams cluster id v1|vnodes={vnodes}|hash={hash_name}".encode()
    return hmac.new((secret or "").encode(), message, hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class VersionFacts:
    nbytes: int
    chunk_count: int
    model: str | None = None  # the model the manifest names; None when the check did not read it


class VersionCheck(Protocol):
    def __call__(self, manifest_id: str, manifest: bytes) -> VersionFacts | None:
        """Raise PreconditionFailed when some chunk lacks its quorum; may return sizes."""


# Manifest bytes by id (decoded, content-verified); raise a ChunkError when unavailable.
BlobFetcher = Callable[[str], bytes]

# Raise PreconditionFailed (naming the address) unless the member answers and runs this cluster.
MemberProbe = Callable[[MemberRecord], None]


@dataclass(frozen=True)
class RingInfo:
    vnodes: int
    replication_factor: int
    write_quorum: int | None  # None -> majority of R capped by cluster size
    hash: str = "blake3"


def local_blob_fetcher(store: ChunkStore) -> BlobFetcher:
    def fetch(blob_id: str) -> bytes:
        chunk = store.get(blob_id)
        raw = codecs.decode(chunk.codec, chunk.data, chunk.raw_size)
        if content_id(raw) != blob_id:
            raise InvalidChunkError(blob_id, f"blob {blob_id} does not decode to its id")
        return bytes(raw)

    return fetch


def _version_pb(v: VersionRecord) -> pb.Version:
    msg = pb.Version(
        model=v.model,
        number=v.number,
        manifest_id=v.manifest_id,
        clock=dict(v.clock),
        created_at=v.created_at,
        nbytes=v.nbytes,
        chunk_count=v.chunk_count,
        publisher=v.publisher,
        forced=v.forced,
    )
    if v.parent is not None:
        msg.parent = v.parent
    return msg


def _tag_pb(t: TagRecord) -> pb.Tag:
    msg = pb.Tag(model=t.model, tag=t.tag, version=t.version)
    if t.rollback_to is not None:
        msg.rollback_to = t.rollback_to
    for move in t.history:
        m = msg.history.add(who=move.who, when=move.when)
        if move.from_version is not None:
            m.from_version = move.from_version
        if move.to_version is not None:
            m.to_version = move.to_version
    return msg


def _member_pb(m: MemberRecord) -> pb.Member:
    return pb.Member(server_id=m.server_id, grpc_address=m.grpc_address, raft_address=m.raft_address, state=m.state, zone=m.zone,
                     bulk_address=m.bulk_address)


def _read_pb(r: ReadResult[Any]) -> pb.ReadInfo:
    return pb.ReadInfo(commit_index=r.commit_index, server_id=r.server_id, linearizable=r.linearizable)


def _need(context: grpc.ServicerContext, **fields: str) -> None:
    for name, value in fields.items():
        if not value:
            invalid(context, f"{name} must not be empty")


class MetadataService:
    def __init__(
        self,
        metadata: MetadataPlane,
        store: ChunkStore,
        ring: RingInfo,
        *,
        fetch_blob: BlobFetcher | None = None,
        version_check: VersionCheck | None = None,
        member_probe: MemberProbe | None = None,
    ) -> None:
        self.metadata = metadata
        self.store = store
        self.ring = ring
        self.fetch_blob = fetch_blob or local_blob_fetcher(store)
        self.version_check = version_check
        self.member_probe = member_probe

    def _ring_pb(self, cluster_size: int) -> pb.RingParams:
        r, w = replication_and_quorum(self.ring.replication_factor, self.ring.write_quorum, cluster_size)
        return pb.RingParams(vnodes=self.ring.vnodes, replication_factor=r, write_quorum=w, hash=self.ring.hash)

    def ClusterInfo(self, request: pb.ClusterInfoRequest, context: grpc.ServicerContext) -> pb.ClusterInfoReply:
        try:
            members = self.metadata.members()
            leader_raft = self.metadata.leader_raft_address() or ""
            reply = pb.ClusterInfoReply(
                server_id=self.metadata.server_id,
                members=[_member_pb(m) for m in members.value],
                leader_raft_address=leader_raft,
                term=self.metadata.term(),
                commit_index=members.commit_index,
                ring=self._ring_pb(len([m for m in members.value if m.state == "up"])),
                is_leader=self.metadata.is_leader(),
            )
        except MAPPED as exc:
            abort_with(context, exc)
        for m in members.value:
            if leader_raft and m.raft_address == leader_raft:
                reply.leader_id, reply.leader_grpc_address = m.server_id, m.grpc_address
        return reply

    # ------------------------------------------------------------ writes

    def CommitVersion(self, request: pb.CommitVersionRequest, context: grpc.ServicerContext) -> pb.VersionReply:
        _need(context, model=request.model, publisher=request.publisher)
        if not is_content_id(request.manifest_id):
            invalid(context, f"manifest_id {request.manifest_id[:80]!r} is not a content id (64 lowercase hex digits)")
        try:
            manifest = self.fetch_blob(request.manifest_id)
        except (ParamServerError, ValueError) as exc:
            missing = PreconditionFailed(
                f"manifest {request.manifest_id} is not readable ({exc}); "
                "push the manifest and its chunks with PutChunks before CommitVersion"
            )
            abort_with(context, missing)
        nbytes, chunk_count = request.nbytes, request.chunk_count
        try:
            if self.version_check is not None:
                facts = self.version_check(request.manifest_id, manifest)
                if facts is not None:
                    if facts.model is not None and facts.model != request.model:
                        invalid(context, f"manifest {request.manifest_id} is of model {facts.model[:200]!r}, not "
                                         f"{request.model[:200]!r}: commit it under its own model, or pack the model again")
                    nbytes, chunk_count = facts.nbytes, facts.chunk_count
            record = self.metadata.commit_version(
                request.model,
                request.manifest_id,
                request.parent if request.HasField("parent") else None,
                request.publisher,
                nbytes,
                chunk_count,
                force=request.force,
                tag=request.tag or None,
            )
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.VersionReply(
            version=_version_pb(record),
            read=pb.ReadInfo(commit_index=self.metadata.commit_index(), server_id=self.metadata.server_id),
            tag=request.tag,
        )

    def SetTag(self, request: pb.SetTagRequest, context: grpc.ServicerContext) -> pb.TagReply:
        _need(context, model=request.model, tag=request.tag)
        try:
            record = self.metadata.set_tag(request.model, request.tag, request.version, request.who or "unknown")
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.TagReply(tag=_tag_pb(record), read=self._write_read())

    def RollbackTag(self, request: pb.RollbackTagRequest, context: grpc.ServicerContext) -> pb.TagReply:
        _need(context, model=request.model, tag=request.tag)
        try:
            record = self.metadata.rollback_tag(request.model, request.tag, request.who or "unknown")
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.TagReply(tag=_tag_pb(record), read=self._write_read())

    def DeleteTag(self, request: pb.DeleteTagRequest, context: grpc.ServicerContext) -> pb.DeleteTagReply:
        _need(context, model=request.model, tag=request.tag)
        try:
            self.metadata.delete_tag(request.model, request.tag, request.who or "unknown")
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.DeleteTagReply(read=self._write_read())

    def AddMember(self, request: pb.AddMemberRequest, context: grpc.ServicerContext) -> pb.MembershipReply:
        m = request.member
        _need(context, server_id=m.server_id, grpc_address=m.grpc_address, raft_address=m.raft_address)
        record = MemberRecord(m.server_id, m.grpc_address, m.raft_address, m.state or "up", m.zone, m.bulk_address)
        try:
            known = self._known_at(record)
            if known is not None:
                # What the server itself registered stays: an operator's `member add` of a known server
                # at its addresses names no bulk port and cannot know the server's clock rule.
                record = replace(record, bulk_address=record.bulk_address or known.bulk_address, clock_rule=known.clock_rule)
            # A member joining the ring (or moving) must answer; marking a known member leaving at the
            # same addresses need not (it may be down: that is why it leaves).
            if self.member_probe is not None and not (known is not None and record.state != "up"):
                try:
                    self.member_probe(record)
                except PreconditionFailed as exc:
                    log.warning("member refused: server_id=%s grpc_address=%s raft_address=%s reason=%s",
                                record.server_id, record.grpc_address, record.raft_address, exc)
                    raise
            self.metadata.add_member(record)
            members = self.metadata.members()
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.MembershipReply(members=[_member_pb(x) for x in members.value], read=_read_pb(members))

    def _known_at(self, record: MemberRecord) -> MemberRecord | None:
        """The member record of ``record``'s server when it is known at the same addresses."""
        known = {x.server_id: x for x in self.metadata.members().value}.get(record.server_id)
        if known is None or (known.grpc_address, known.raft_address) != (record.grpc_address, record.raft_address):
            return None
        return known

    def RemoveMember(self, request: pb.RemoveMemberRequest, context: grpc.ServicerContext) -> pb.MembershipReply:
        _need(context, server_id=request.server_id)
        try:
            self.metadata.remove_member(request.server_id)
            members = self.metadata.members()
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.MembershipReply(members=[_member_pb(x) for x in members.value], read=_read_pb(members))

    def _write_read(self) -> pb.ReadInfo:
        return pb.ReadInfo(commit_index=self.metadata.commit_index(), server_id=self.metadata.server_id, linearizable=True)

    # ------------------------------------------------------------ reads

    def _local_state_current(self, context: grpc.ServicerContext, linearizable: bool = False) -> None:
        """Refuse a serializable read (UNAVAILABLE, naming why) while this member is catching up:
        its state may miss tag moves the cluster acknowledged (docs/architecture.md). A
        linearizable read goes through the leader anyway; a probe may ask for the local state."""
        if linearizable or wants_local(context.invocation_metadata()):
            return
        verdict = self.metadata.sync_state()
        deadline = time.monotonic() + CATCH_UP_WAIT_S
        while not verdict.in_sync and time.monotonic() < deadline:
            time.sleep(_CATCH_UP_POLL_S)
            verdict = self.metadata.sync_state()
        if not verdict.in_sync:
            abort_with(context, CatchingUp(
                f"{self.metadata.server_id} is catching up with the cluster and answers no serializable read: {verdict.reason}; "
                "ask another member, or read linearizably (through the leader)"
            ))

    def ResolveTag(self, request: pb.ResolveTagRequest, context: grpc.ServicerContext) -> pb.VersionReply:
        _need(context, model=request.model, tag=request.tag)
        self._local_state_current(context, request.linearizable)
        try:
            result = self.metadata.resolve_tag(request.model, request.tag, linearizable=request.linearizable)
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.VersionReply(version=_version_pb(result.value), read=_read_pb(result), tag=request.tag)

    def GetVersion(self, request: pb.GetVersionRequest, context: grpc.ServicerContext) -> pb.VersionReply:
        _need(context, model=request.model)
        self._local_state_current(context, request.linearizable)
        try:
            result = self.metadata.get_version(request.model, request.number, linearizable=request.linearizable)
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.VersionReply(version=_version_pb(result.value), read=_read_pb(result))

    def GetManifest(self, request: pb.GetManifestRequest, context: grpc.ServicerContext) -> pb.GetManifestReply:
        if request.part_ids:
            return self._parts(request, context)
        reply = pb.GetManifestReply()
        try:
            manifest_id = request.manifest_id
            if not manifest_id:
                _need(context, model=request.model)
                self._local_state_current(context, request.linearizable)
                if request.version:
                    result = self.metadata.get_version(request.model, request.version, linearizable=request.linearizable)
                elif request.tag:
                    result = self.metadata.resolve_tag(request.model, request.tag, linearizable=request.linearizable)
                else:
                    invalid(context, "GetManifest needs manifest_id, or model with version or tag")
                manifest_id = result.value.manifest_id
                reply.version.CopyFrom(_version_pb(result.value))
                reply.read.CopyFrom(_read_pb(result))
            elif not is_content_id(manifest_id):
                invalid(context, f"manifest_id {manifest_id[:80]!r} is not a content id (64 lowercase hex digits)")
            reply.manifest_id = manifest_id
            reply.data = self.fetch_blob(manifest_id)
        except MAPPED as exc:
            abort_with(context, exc)
        return reply

    def _parts(self, request: pb.GetManifestRequest, context: grpc.ServicerContext) -> pb.GetManifestReply:
        """A prefix of the asked parts, in order, within MAX_PARTS_REPLY_BYTES (at least one)."""
        ids = request.part_ids
        if request.manifest_id or request.model or request.version or request.tag:
            invalid(context, "GetManifest takes part_ids alone, not with manifest_id, model, version or tag")
        if len(ids) > MAX_PART_IDS_PER_CALL:
            invalid(context, f"GetManifest names {len(ids)} part_ids; at most {MAX_PART_IDS_PER_CALL} per call")
        bad = next((i for i in ids if not is_content_id(i)), None)
        if bad is not None:
            invalid(context, f"part id {bad[:80]!r} is not a content id (64 lowercase hex digits)")
        reply = pb.GetManifestReply()
        size = 0
        try:
            for part_id in ids:
                if reply.parts and size >= MAX_PARTS_REPLY_BYTES:
                    break
                data = self.fetch_blob(part_id)
                reply.parts.append(data)
                size += len(data)
        except MAPPED as exc:
            abort_with(context, exc)
        return reply

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsReply:
        self._local_state_current(context)
        try:
            result = self.metadata.list_models()
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.ListModelsReply(models=list(result.value), read=_read_pb(result))

    def ListVersions(self, request: pb.ListVersionsRequest, context: grpc.ServicerContext) -> pb.ListVersionsReply:
        _need(context, model=request.model)
        self._local_state_current(context)
        try:
            result = self.metadata.list_versions(request.model)
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.ListVersionsReply(versions=[_version_pb(v) for v in result.value], read=_read_pb(result))

    def ListTags(self, request: pb.ListTagsRequest, context: grpc.ServicerContext) -> pb.ListTagsReply:
        _need(context, model=request.model)
        self._local_state_current(context)
        try:
            result = self.metadata.list_tags(request.model)
        except MAPPED as exc:
            abort_with(context, exc)
        return pb.ListTagsReply(tags=[_tag_pb(t) for t in result.value], read=_read_pb(result))


__all__ = [
    "CATCH_UP_WAIT_S", "CLUSTER_ID_KEY", "BlobFetcher", "MemberProbe", "MetadataService", "RingInfo", "VersionCheck", "VersionFacts",
    "cluster_id", "local_blob_fetcher",
]
