"""Small metadata records held in the replicated state. No chunk bytes, ever.

These are the types the rest of the cluster sees; the state machine stores
them as plain dicts so that pysyncobj can pickle its full dump cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class MemberRecord:
    server_id: str
    grpc_address: str  # host:port of the gRPC service
    raft_address: str  # host:port of the pysyncobj node
    state: str = "up"  # "up" | "leaving"
    zone: str = ""
    bulk_address: str = ""  # host:port of the bulk chunk-read port, "" when the server has none
    clock_rule: int = 1  # the highest vector-clock rule the server's code applies (consensus.state.CLOCK_RULES)


@dataclass(frozen=True)
class VersionRecord:
    model: str
    number: int  # 1, 2, 3 ... per model
    manifest_id: str  # content id of the manifest blob
    clock: Mapping[str, int]  # vector clock: publisher -> counter
    parent: int | None
    created_at: float  # set by the proposer, never by apply(), so replicas agree
    nbytes: int
    chunk_count: int
    publisher: str
    forced: bool = False  # committed with force despite a concurrent head


@dataclass(frozen=True)
class TagMove:
    from_version: int | None
    to_version: int | None  # None when the tag was deleted
    who: str
    when: float


@dataclass(frozen=True)
class TagRecord:
    model: str
    tag: str
    version: int
    history: tuple[TagMove, ...] = field(default_factory=tuple)
    rollback_to: int | None = None  # where a rollback would move the tag (listed tags only)


@dataclass(frozen=True)
class ReadResult(Generic[T]):
    """A read plus what a caller needs to judge its freshness."""

    value: T
    commit_index: int  # the last Raft entry the answering node had applied when it read
    server_id: str = ""
    linearizable: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
