"""Configuration of one metadata node (one Raft member)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError as ConfigError  # re-exported: its old home
from .errors import Invalid
from .validation import check_address, check_name


@dataclass(frozen=True)
class RaftConfig:
    server_id: str
    raft_address: str  # host:port this node listens on for Raft; reachable by cluster members only
    peers: tuple[str, ...]  # the other members' Raft addresses
    data_dir: Path  # journal and full dump live here; keep it across restarts
    secret: str | None = None  # cluster secret: encrypts and authenticates Raft traffic (needs `cryptography`)
    # Measured on loopback (issue 3): 0.3/0.6/0.05 with live links gives ~0.5 s failover.
    election_min_timeout: float = 0.3
    election_max_timeout: float = 0.6
    append_entries_period: float = 0.05
    # A link with no bytes read for this long is dropped. Every link carries a keepalive
    # message each link_keepalive_period, so this only fires for a really dead peer.
    connection_timeout: float = 3.0
    link_keepalive_period: float = 0.3
    connection_retry: float = 0.5  # seconds between reconnect attempts to a peer that is down
    # Kernel keepalive (idle s, interval s, probes) for half-open links the peer never closed.
    tcp_keepalive: tuple[int, int, int] = (2, 1, 3)
    leader_fallback_timeout: float = 3.0  # a leader cut off from the majority steps down after this
    commit_timeout: float = 5.0  # a write not committed by then raises CommitTimeout / NoQuorum
    # Sending each write at once (no batching) keeps a synchronous commit in the milliseconds.
    batch_appends: bool = False
    log_compaction_min_entries: int = 5000
    log_compaction_min_time: float = 300.0
    # Journal, term/vote and dump reach the disk before anything that depends on them is sent
    # (consensus/durable/). False (--no-fsync) is for tests and drills: a power loss can
    # then lose acknowledged commits and votes.
    fsync: bool = True

    @property
    def journal_file(self) -> Path:
        return self.data_dir / "raft.journal"

    @property
    def dump_file(self) -> Path:
        return self.data_dir / "raft.dump"

    @property
    def meta_file(self) -> Path:
        """Term, vote and commit index; pysyncobj names it after the journal."""
        return self.data_dir / "raft.journal.meta"

    def validate(self) -> None:
        try:
            check_name("server_id", self.server_id)
            check_address("raft_address", self.raft_address)
            for peer in self.peers:
                check_address("peer", peer)
        except Invalid as exc:
            raise ConfigError(str(exc)) from None
        if not isinstance(self.peers, tuple):
            raise ConfigError("peers must be a tuple of 'host:port' strings")
        if self.raft_address in self.peers:
            raise ConfigError(f"peers must list the other members only; remove {self.raft_address} (this node)")
        if len(set(self.peers)) != len(self.peers):
            raise ConfigError(f"peers lists an address twice: {self.peers}")
        if not isinstance(self.data_dir, Path):
            raise ConfigError(f"data_dir must be a pathlib.Path, got {type(self.data_dir).__name__}")
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise ConfigError(f"data_dir {self.data_dir} exists and is not a directory")
        if self.secret is not None:
            if not isinstance(self.secret, str) or not self.secret:
                raise ConfigError("secret must be a non-empty string, or None for an unencrypted cluster")
            if importlib.util.find_spec("cryptography") is None:
                raise ConfigError("a cluster secret needs the 'cryptography' package: pip install cryptography")
        for name in ("election_min_timeout", "election_max_timeout", "append_entries_period", "connection_timeout",
                     "link_keepalive_period", "leader_fallback_timeout", "commit_timeout", "log_compaction_min_time"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.connection_retry < 0:
            raise ConfigError(f"connection_retry must be >= 0, got {self.connection_retry!r}")
        if self.election_min_timeout <= 3 * self.append_entries_period:
            raise ConfigError(
                f"election_min_timeout ({self.election_min_timeout}) must exceed 3 x append_entries_period "
                f"({self.append_entries_period}); pysyncobj requires it"
            )
        if self.election_max_timeout <= self.election_min_timeout:
            raise ConfigError("election_max_timeout must be greater than election_min_timeout")
        if self.connection_timeout < self.election_max_timeout:
            raise ConfigError("connection_timeout must be at least election_max_timeout")
        if self.link_keepalive_period * 2 >= self.connection_timeout:
            raise ConfigError(
                "link_keepalive_period must be under half of connection_timeout, or idle links time out "
                "and drop the next message (the lost vote request of pysyncobj issue 172)"
            )
        if self.leader_fallback_timeout <= self.append_entries_period:
            raise ConfigError("leader_fallback_timeout must be greater than append_entries_period")
        if (not isinstance(self.tcp_keepalive, tuple) or len(self.tcp_keepalive) != 3
                or not all(isinstance(v, int) and v > 0 for v in self.tcp_keepalive)):
            raise ConfigError("tcp_keepalive must be three ints > 0: (idle seconds, probe interval seconds, probes)")
        if not isinstance(self.fsync, bool):
            raise ConfigError(f"fsync must be True or False, got {self.fsync!r}")
        if self.log_compaction_min_entries < 2:
            raise ConfigError("log_compaction_min_entries must be >= 2")
