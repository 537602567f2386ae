"""Replicated metadata (models, versions, tags, members) on pysyncobj, and vector clocks."""
from __future__ import annotations

from .clock import Ordering, VectorClock
from .config import ConfigError, RaftConfig
from .errors import (CommitTimeout, Conflict, DamagedState, Invalid, MetadataError, NoQuorum, NotFound, NotLeader,
                     RaftStopped, Unavailable)
from .node import MetadataNode, NodeNotStarted
from .records import MemberRecord, ReadResult, TagMove, TagRecord, VersionRecord
from .state import MetadataState

__all__ = [
    "CommitTimeout", "Conflict", "DamagedState", "Invalid", "MetadataError", "NoQuorum", "NotFound", "NotLeader",
    "RaftStopped", "Unavailable",
    "ConfigError", "NodeNotStarted",
    "MemberRecord", "ReadResult", "TagMove", "TagRecord", "VersionRecord",
    "MetadataNode", "MetadataState", "Ordering", "RaftConfig", "VectorClock",
]
