"""Replicated metadata (models, versions, tags, members) on pysyncobj, and vector clocks."""
from __future__ import annotations

from .errors import CommitTimeout, Conflict, Invalid, MetadataError, NoQuorum, NotFound, NotLeader, Unavailable
from .records import MemberRecord, ReadResult, TagMove, TagRecord, VersionRecord

__all__ = [
    "CommitTimeout", "Conflict", "Invalid", "MetadataError", "NoQuorum", "NotFound", "NotLeader", "Unavailable",
    "MemberRecord", "ReadResult", "TagMove", "TagRecord", "VersionRecord",
]
