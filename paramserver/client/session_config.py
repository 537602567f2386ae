"""How a client session talks to the cluster (``SessionConfig``), and what it resolves a model
reference to (``VersionInfo``): the session's value types, kept apart from ``ClusterClient``."""
from __future__ import annotations

from dataclasses import dataclass

from paramserver.client.errors import ConfigError

MIB = 1 << 20


@dataclass(frozen=True)
class SessionConfig:
    """How a client talks to the cluster.

    ``call_timeout_s`` bounds unary calls; a chunk read gets ``call_timeout_s`` plus the time its
    bytes take at ``min_stream_bytes_per_s``, so a hung replica is left for another one.
    """

    call_timeout_s: float = 10.0
    min_stream_bytes_per_s: float = 20e6
    grpc_streams_per_server: int = 3  # GetChunks reads in parallel per replica
    bulk_streams_per_server: int = 1  # one bulk connection already fills the link here
    max_read_bytes: int = 64 * MIB
    get_message_bytes: int = 2 * MIB
    refresh_interval_s: float = 5.0
    bulk_down_s: float = 30.0
    monotonic_path: str | None = None
    allow_rollback: bool = True
    worker_id: str = ""
    # Hot chunks: read extra copies that servers advertise (GetHotChunks, asked of every member at
    # most every hot_refresh_s, before a fetch); False reads ring replicas only.
    hot_chunks: bool = True
    hot_refresh_s: float = 2.0
    hot_timeout_s: float = 0.2
    # A linearizable read (a tag's first resolution, a pull) follows the leader through an election
    # for this long before it takes an in-sync member's answer instead (``VersionInfo.read``).
    leader_read_wait_s: float = 5.0

    def validate(self) -> SessionConfig:
        if self.call_timeout_s <= 0 or self.min_stream_bytes_per_s <= 0:
            raise ConfigError("call_timeout_s and min_stream_bytes_per_s must be > 0")
        if not 1 <= self.grpc_streams_per_server <= 16 or not 1 <= self.bulk_streams_per_server <= 16:
            raise ConfigError("grpc_streams_per_server and bulk_streams_per_server must be between 1 and 16")
        if not 64 << 10 <= self.get_message_bytes <= 64 * MIB:
            raise ConfigError(f"get_message_bytes must be between 64 KiB and 64 MiB, got {self.get_message_bytes}")
        if self.max_read_bytes < 1 * MIB:
            raise ConfigError(f"max_read_bytes must be >= 1 MiB, got {self.max_read_bytes}")
        if self.hot_refresh_s <= 0 or self.hot_timeout_s <= 0:
            raise ConfigError("hot_refresh_s and hot_timeout_s must be > 0")
        if self.refresh_interval_s <= 0 or self.bulk_down_s < 0:
            raise ConfigError("refresh_interval_s must be > 0 and bulk_down_s >= 0")
        if self.leader_read_wait_s <= 0:
            raise ConfigError(f"leader_read_wait_s must be > 0, got {self.leader_read_wait_s}")
        return self


# How a tag resolution was answered (``VersionInfo.read``): by the leader, linearizably; by a member
# in sync with it (serializable, checked by monotonic reads); or by such a member because no leader
# answered within ``leader_read_wait_s`` although a linearizable answer was wanted.
READ_LEADER = "leader"
READ_MEMBER = "member"
READ_FALLBACK = "member, no leader reachable"


@dataclass(frozen=True)
class VersionInfo:
    """A resolved model version (the wire's Version plus where it came from)."""

    model: str
    number: int
    manifest_id: str
    clock: dict[str, int]
    commit_index: int = 0
    server: str = ""
    tag: str = ""
    read: str = ""  # a tag's resolution: READ_LEADER, READ_MEMBER or READ_FALLBACK ("" for MODEL@N, MODEL)
    resolve_s: float = 0.0  # how long the resolution took


__all__ = ["MIB", "READ_FALLBACK", "READ_LEADER", "READ_MEMBER", "SessionConfig", "VersionInfo"]
