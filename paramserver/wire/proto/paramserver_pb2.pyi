from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChunkStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHUNK_STATUS_UNSPECIFIED: _ClassVar[ChunkStatus]
    STORED: _ClassVar[ChunkStatus]
    ALREADY_PRESENT: _ClassVar[ChunkStatus]
    MISSING: _ClassVar[ChunkStatus]
    CORRUPT: _ClassVar[ChunkStatus]
    REJECTED: _ClassVar[ChunkStatus]
CHUNK_STATUS_UNSPECIFIED: ChunkStatus
STORED: ChunkStatus
ALREADY_PRESENT: ChunkStatus
MISSING: ChunkStatus
CORRUPT: ChunkStatus
REJECTED: ChunkStatus

class Member(_message.Message):
    __slots__ = ("server_id", "grpc_address", "raft_address", "state", "zone", "bulk_address")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RAFT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    grpc_address: str
    raft_address: str
    state: str
    zone: str
    bulk_address: str
    def __init__(self, server_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., raft_address: _Optional[str] = ..., state: _Optional[str] = ..., zone: _Optional[str] = ..., bulk_address: _Optional[str] = ...) -> None: ...

class RingParams(_message.Message):
    __slots__ = ("vnodes", "replication_factor", "write_quorum", "hash")
    VNODES_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    WRITE_QUORUM_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    vnodes: int
    replication_factor: int
    write_quorum: int
    hash: str
    def __init__(self, vnodes: _Optional[int] = ..., replication_factor: _Optional[int] = ..., write_quorum: _Optional[int] = ..., hash: _Optional[str] = ...) -> None: ...

class ClusterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterInfoReply(_message.Message):
    __slots__ = ("server_id", "members", "leader_id", "leader_grpc_address", "leader_raft_address", "term", "commit_index", "ring", "is_leader")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_RAFT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    members: _containers.RepeatedCompositeFieldContainer[Member]
    leader_id: str
    leader_grpc_address: str
    leader_raft_address: str
    term: int
    commit_index: int
    ring: RingParams
    is_leader: bool
    def __init__(self, server_id: _Optional[str] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., leader_id: _Optional[str] = ..., leader_grpc_address: _Optional[str] = ..., leader_raft_address: _Optional[str] = ..., term: _Optional[int] = ..., commit_index: _Optional[int] = ..., ring: _Optional[_Union[RingParams, _Mapping]] = ..., is_leader: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("id", "data", "codec", "raw_size", "crc32c")
    ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    id: str
    data: bytes
    codec: str
    raw_size: int
    crc32c: int
    def __init__(self, id: _Optional[str] = ..., data: _Optional[bytes] = ..., codec: _Optional[str] = ..., raw_size: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class ChunkAck(_message.Message):
    __slots__ = ("id", "status", "message")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: ChunkStatus
    message: str
    def __init__(self, id: _Optional[str] = ..., status: _Optional[_Union[ChunkStatus, str]] = ..., message: _Optional[str] = ...) -> None: ...

class PutChunksRequest(_message.Message):
    __slots__ = ("chunks", "hot_copy")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HOT_COPY_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    hot_copy: bool
    def __init__(self, chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., hot_copy: _Optional[bool] = ...) -> None: ...

class PutChunksReply(_message.Message):
    __slots__ = ("server_id", "acks", "chunks_stored", "bytes_stored", "chunks_present")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PRESENT_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    acks: _containers.RepeatedCompositeFieldContainer[ChunkAck]
    chunks_stored: int
    bytes_stored: int
    chunks_present: int
    def __init__(self, server_id: _Optional[str] = ..., acks: _Optional[_Iterable[_Union[ChunkAck, _Mapping]]] = ..., chunks_stored: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., chunks_present: _Optional[int] = ...) -> None: ...

class GetChunksRequest(_message.Message):
    __slots__ = ("ids", "max_message_bytes", "allow_partial")
    IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    max_message_bytes: int
    allow_partial: bool
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., max_message_bytes: _Optional[int] = ..., allow_partial: _Optional[bool] = ...) -> None: ...

class GetChunksReply(_message.Message):
    __slots__ = ("chunks", "errors")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    errors: _containers.RepeatedCompositeFieldContainer[ChunkAck]
    def __init__(self, chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[ChunkAck, _Mapping]]] = ...) -> None: ...

class HasChunksRequest(_message.Message):
    __slots__ = ("ids", "claim", "with_crc", "renew_hot", "packed_ids")
    IDS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    WITH_CRC_FIELD_NUMBER: _ClassVar[int]
    RENEW_HOT_FIELD_NUMBER: _ClassVar[int]
    PACKED_IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    claim: bool
    with_crc: bool
    renew_hot: bool
    packed_ids: bytes
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., claim: _Optional[bool] = ..., with_crc: _Optional[bool] = ..., renew_hot: _Optional[bool] = ..., packed_ids: _Optional[bytes] = ...) -> None: ...

class HasChunksReply(_message.Message):
    __slots__ = ("present", "present_count", "crc32c", "codec", "packed_present", "packed_crc32c", "packed_raw")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    PRESENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PACKED_PRESENT_FIELD_NUMBER: _ClassVar[int]
    PACKED_CRC32C_FIELD_NUMBER: _ClassVar[int]
    PACKED_RAW_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    present_count: int
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    codec: _containers.RepeatedScalarFieldContainer[str]
    packed_present: bytes
    packed_crc32c: bytes
    packed_raw: bytes
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., present_count: _Optional[int] = ..., crc32c: _Optional[_Iterable[int]] = ..., codec: _Optional[_Iterable[str]] = ..., packed_present: _Optional[bytes] = ..., packed_crc32c: _Optional[bytes] = ..., packed_raw: _Optional[bytes] = ...) -> None: ...

class HotChunk(_message.Message):
    __slots__ = ("id", "holders")
    ID_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    id: str
    holders: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., holders: _Optional[_Iterable[str]] = ...) -> None: ...

class GetHotChunksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetHotChunksReply(_message.Message):
    __slots__ = ("server_id", "chunks")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    chunks: _containers.RepeatedCompositeFieldContainer[HotChunk]
    def __init__(self, server_id: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[HotChunk, _Mapping]]] = ...) -> None: ...

class PeerVersion(_message.Message):
    __slots__ = ("manifest_id", "complete", "started_at")
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    manifest_id: str
    complete: bool
    started_at: float
    def __init__(self, manifest_id: _Optional[str] = ..., complete: _Optional[bool] = ..., started_at: _Optional[float] = ...) -> None: ...

class AnnouncePeerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "instance", "host_id", "versions", "lease_s", "leaving")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    instance: str
    host_id: str
    versions: _containers.RepeatedCompositeFieldContainer[PeerVersion]
    lease_s: float
    leaving: bool
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., instance: _Optional[str] = ..., host_id: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[PeerVersion, _Mapping]]] = ..., lease_s: _Optional[float] = ..., leaving: _Optional[bool] = ...) -> None: ...

class AnnouncePeerReply(_message.Message):
    __slots__ = ("lease_s", "versions")
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    versions: int
    def __init__(self, lease_s: _Optional[float] = ..., versions: _Optional[int] = ...) -> None: ...

class FindPeersRequest(_message.Message):
    __slots__ = ("manifest_id", "limit", "exclude_worker")
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_FIELD_NUMBER: _ClassVar[int]
    manifest_id: str
    limit: int
    exclude_worker: str
    def __init__(self, manifest_id: _Optional[str] = ..., limit: _Optional[int] = ..., exclude_worker: _Optional[str] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "complete", "started_at", "host_id", "lease_left_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    complete: bool
    started_at: float
    host_id: str
    lease_left_s: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., complete: _Optional[bool] = ..., started_at: _Optional[float] = ..., host_id: _Optional[str] = ..., lease_left_s: _Optional[float] = ...) -> None: ...

class FindPeersReply(_message.Message):
    __slots__ = ("server_id", "peers", "known", "rank")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    known: int
    rank: int
    def __init__(self, server_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., known: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class ReadInfo(_message.Message):
    __slots__ = ("commit_index", "server_id", "linearizable")
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    LINEARIZABLE_FIELD_NUMBER: _ClassVar[int]
    commit_index: int
    server_id: str
    linearizable: bool
    def __init__(self, commit_index: _Optional[int] = ..., server_id: _Optional[str] = ..., linearizable: _Optional[bool] = ...) -> None: ...

class Version(_message.Message):
    __slots__ = ("model", "number", "manifest_id", "clock", "parent", "created_at", "nbytes", "chunk_count", "publisher", "forced")
    class ClockEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    model: str
    number: int
    manifest_id: str
    clock: _containers.ScalarMap[str, int]
    parent: int
    created_at: float
    nbytes: int
    chunk_count: int
    publisher: str
    forced: bool
    def __init__(self, model: _Optional[str] = ..., number: _Optional[int] = ..., manifest_id: _Optional[str] = ..., clock: _Optional[_Mapping[str, int]] = ..., parent: _Optional[int] = ..., created_at: _Optional[float] = ..., nbytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., publisher: _Optional[str] = ..., forced: _Optional[bool] = ...) -> None: ...

class VersionReply(_message.Message):
    __slots__ = ("version", "read", "tag")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    version: Version
    read: ReadInfo
    tag: str
    def __init__(self, version: _Optional[_Union[Version, _Mapping]] = ..., read: _Optional[_Union[ReadInfo, _Mapping]] = ..., tag: _Optional[str] = ...) -> None: ...

class CommitVersionRequest(_message.Message):
    __slots__ = ("model", "manifest_id", "parent", "publisher", "tag", "force", "nbytes", "chunk_count")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    model: str
    manifest_id: str
    parent: int
    publisher: str
    tag: str
    force: bool
    nbytes: int
    chunk_count: int
    def __init__(self, model: _Optional[str] = ..., manifest_id: _Optional[str] = ..., parent: _Optional[int] = ..., publisher: _Optional[str] = ..., tag: _Optional[str] = ..., force: _Optional[bool] = ..., nbytes: _Optional[int] = ..., chunk_count: _Optional[int] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("manifest_id", "model", "version", "tag", "linearizable", "part_ids")
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    LINEARIZABLE_FIELD_NUMBER: _ClassVar[int]
    PART_IDS_FIELD_NUMBER: _ClassVar[int]
    manifest_id: str
    model: str
    version: int
    tag: str
    linearizable: bool
    part_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, manifest_id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., tag: _Optional[str] = ..., linearizable: _Optional[bool] = ..., part_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetManifestReply(_message.Message):
    __slots__ = ("manifest_id", "data", "version", "read", "parts")
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    manifest_id: str
    data: bytes
    version: Version
    read: ReadInfo
    parts: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, manifest_id: _Optional[str] = ..., data: _Optional[bytes] = ..., version: _Optional[_Union[Version, _Mapping]] = ..., read: _Optional[_Union[ReadInfo, _Mapping]] = ..., parts: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ResolveTagRequest(_message.Message):
    __slots__ = ("model", "tag", "linearizable")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    LINEARIZABLE_FIELD_NUMBER: _ClassVar[int]
    model: str
    tag: str
    linearizable: bool
    def __init__(self, model: _Optional[str] = ..., tag: _Optional[str] = ..., linearizable: _Optional[bool] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("model", "number", "linearizable")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    LINEARIZABLE_FIELD_NUMBER: _ClassVar[int]
    model: str
    number: int
    linearizable: bool
    def __init__(self, model: _Optional[str] = ..., number: _Optional[int] = ..., linearizable: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsReply(_message.Message):
    __slots__ = ("models", "read")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    read: ReadInfo
    def __init__(self, models: _Optional[_Iterable[str]] = ..., read: _Optional[_Union[ReadInfo, _Mapping]] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListVersionsReply(_message.Message):
    __slots__ = ("versions", "read")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[Version]
    read: ReadInfo
    def __init__(self, versions: _Optional[_Iterable[_Union[Version, _Mapping]]] = ..., read: _Optional[_Union[ReadInfo, _Mapping]] = ...) -> None: ...

class TagMove(_message.Message):
    __slots__ = ("from_version", "to_version", "who", "when")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    WHEN_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    to_version: int
    who: str
    when: float
    def __init__(self, from_version: _Optional[int] = ..., to_version: _Optional[int] = ..., who: _Optional[str] = ..., when: _Optional[float] = ...) -> None: ...

class Tag(_message.Message):
    __slots__ = ("model", "tag", "version", "history", "rollback_to")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_TO_FIELD_NUMBER: _ClassVar[int]
    model: str
    tag: str
    version: int
    history: _containers.RepeatedCompositeFieldContainer[TagMove]
    rollback_to: int
    def __init__(self, model: _Optional[str] = ..., tag: _Optional[str] = ..., version: _Optional[int] = ..., history: _Optional[_Iterable[_Union[TagMove, _Mapping]]] = ..., rollback_to: _Optional[int] = ...) -> None: ...

class ListTagsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListTagsReply(_message.Message):
    __slots__ = ("tags", "read")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedCompositeFieldContainer[Tag]
    read: ReadInfo
    def __init__(self, tags: _Optional[_Iterable[_Union[Tag, _Mapping]]] = ..., read: _Optional[_Union[ReadInfo, _Mapping]] = ...) -> None: ...

class SetTagRequest(_message.Message):
    __slots__ = ("model", "tag", "version", "who")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    model: str
    tag: str
    version: int
    who: str
    def __init__(self, model: _Optional[str] = ..., tag: _Optional[str] = ..., version: _Optional[int] = ..., who: _Optional[str] = ...) -> None: ...

class RollbackTagRequest(_message.Message):
    __slots__ = ("model", "tag", "who")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    model: str
    tag: str
    who: str
    def __init__(self, model: _Optional[str] = ..., tag: _Optional[str] = ..., who: _Optional[str] = ...) -> None: ...

class DeleteTagRequest(_message.Message):
    __slots__ = ("model", "tag", "who")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    model: str
    tag: str
    who: str
    def __init__(self, model: _Optional[str] = ..., tag: _Optional[str] = ..., who: _Optional[str] = ...) -> None: ...

class TagReply(_message.Message):
    __slots__ = ("tag", "read")
    TAG_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    tag: Tag
    read: ReadInfo
    def __init__(self, tag: _Optional[_Union[Tag, _Mapping]] = ..., read: _Optional[_Union[ReadInfo, _Mapping]] = ...) -> None: ...

class DeleteTagReply(_message.Message):
    __slots__ = ("read",)
    READ_FIELD_NUMBER: _ClassVar[int]
    read: ReadInfo
    def __init__(self, read: _Optional[_Union[ReadInfo, _Mapping]] = ...) -> None: ...

class AddMemberRequest(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: Member
    def __init__(self, member: _Optional[_Union[Member, _Mapping]] = ...) -> None: ...

class RemoveMemberRequest(_message.Message):
    __slots__ = ("server_id",)
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    def __init__(self, server_id: _Optional[str] = ...) -> None: ...

class MembershipReply(_message.Message):
    __slots__ = ("members", "read")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    read: ReadInfo
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., read: _Optional[_Union[ReadInfo, _Mapping]] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "entries", "hits", "misses", "evictions")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class ServerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStatusReply(_message.Message):
    __slots__ = ("server_id", "chunk_count", "bytes_on_disk", "quarantined", "repair_queue", "cache", "is_leader", "term", "commit_index", "extra", "served_bytes", "peer_entries")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    REPAIR_QUEUE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    chunk_count: int
    bytes_on_disk: int
    quarantined: int
    repair_queue: int
    cache: CacheStats
    is_leader: bool
    term: int
    commit_index: int
    extra: _containers.ScalarMap[str, str]
    served_bytes: int
    peer_entries: int
    def __init__(self, server_id: _Optional[str] = ..., chunk_count: _Optional[int] = ..., bytes_on_disk: _Optional[int] = ..., quarantined: _Optional[int] = ..., repair_queue: _Optional[int] = ..., cache: _Optional[_Union[CacheStats, _Mapping]] = ..., is_leader: _Optional[bool] = ..., term: _Optional[int] = ..., commit_index: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ..., served_bytes: _Optional[int] = ..., peer_entries: _Optional[int] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("chunk_ids", "server_id", "reporter", "reason")
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    server_id: str
    reporter: str
    reason: str
    def __init__(self, chunk_ids: _Optional[_Iterable[str]] = ..., server_id: _Optional[str] = ..., reporter: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportCorruptReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class HeatEntry(_message.Message):
    __slots__ = ("chunk_index", "count", "first_access_order")
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FIRST_ACCESS_ORDER_FIELD_NUMBER: _ClassVar[int]
    chunk_index: int
    count: int
    first_access_order: int
    def __init__(self, chunk_index: _Optional[int] = ..., count: _Optional[int] = ..., first_access_order: _Optional[int] = ...) -> None: ...

class ReportHeatRequest(_message.Message):
    __slots__ = ("model", "version", "worker", "entries")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    worker: str
    entries: _containers.RepeatedCompositeFieldContainer[HeatEntry]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., worker: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[HeatEntry, _Mapping]]] = ...) -> None: ...

class ReportHeatReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetHeatRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetHeatReply(_message.Message):
    __slots__ = ("model", "version", "entries", "reports")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    entries: _containers.RepeatedCompositeFieldContainer[HeatEntry]
    reports: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[HeatEntry, _Mapping]]] = ..., reports: _Optional[int] = ...) -> None: ...
