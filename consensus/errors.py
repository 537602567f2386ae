"""Typed errors of the metadata plane. The gRPC layer maps them to status codes.

NotFound -> NOT_FOUND, Conflict -> ABORTED, Invalid -> INVALID_ARGUMENT,
NotLeader/NoQuorum/CommitTimeout -> UNAVAILABLE (retryable).
"""
from __future__ import annotations


class MetadataError(Exception):
    """Base class for every error of the metadata plane."""


class NotFound(MetadataError):
    """The model, version, tag or member does not exist."""


class Conflict(MetadataError):
    """The command contradicts committed state (concurrent push, tag in use, ...)."""


class Invalid(MetadataError, ValueError):
    """The command's arguments are malformed (bad model name, negative size, ...)."""


class ConfigError(Invalid):
    """The node configuration is unusable; the message says which field to fix."""


class Unavailable(MetadataError):
    """The cluster cannot commit right now; retrying later may succeed."""


class NotLeader(Unavailable):
    """This node is not the leader and could not forward the write."""

    def __init__(self, message: str, leader: str | None = None) -> None:
        super().__init__(message)
        self.leader = leader


class NoQuorum(Unavailable):
    """No leader is reachable: a majority of servers is down or partitioned away."""


class CatchingUp(Unavailable):
    """This member's state may be behind the cluster's (restarted, cut off, or a new leader's first
    commit pending): it answers no serializable read; another member, or the leader, can."""


class CommitTimeout(Unavailable):
    """The write was sent but not confirmed committed in time; it may still commit."""


class DamagedState(MetadataError):
    """A Raft state file (term/vote, journal, full dump) is damaged or unreadable; the node refuses to start.

    The message names the file. Starting anyway could forget a vote and let two leaders win one term.
    """


class RaftStopped(Unavailable):
    """This node could not write its Raft state (disk full, I/O error) and takes no part in Raft until restarted.

    The message is the one-line reason, naming the file. Other members go on without this one.
    """


class JournalFailure(RuntimeError):
    """A write or sync of the Raft state failed; the node stops taking part in Raft until restarted.

    After a failed fsync the kernel may have dropped the dirty pages and a retry could report
    success for data that never reached the disk, so there is no retry. Not a MetadataError: it
    never leaves the Raft layer (the node turns it into RaftStopped for callers).
    """


class NodeNotStarted(Unavailable):
    """The node was used before start() or after close()."""
