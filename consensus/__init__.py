"""Replicated metadata (models, versions, tags, members) on pysyncobj, and vector clocks.

The light names (errors, configuration, records, clocks, the state machine) import without
pysyncobj: a client that only checks a name (``consensus.validation``) must not load the Raft
library. The Raft node (``MetadataNode``) is imported on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .clock import Ordering, VectorClock
from .config import RaftConfig
from .errors import (CatchingUp, CommitTimeout, ConfigError, Conflict, DamagedState, Invalid, MetadataError, NodeNotStarted,
                     NoQuorum, NotFound, NotLeader, RaftStopped, Unavailable)
from .records import MemberRecord, ReadResult, TagMove, TagRecord, VersionRecord
from .state import MetadataState

if TYPE_CHECKING:  # for type checkers only; at run time __getattr__ imports them on first use
    from .node import MetadataNode

_HEAVY = {"MetadataNode": "node"}  # name -> submodule that needs pysyncobj

__all__ = [
    "CatchingUp", "CommitTimeout", "Conflict", "DamagedState", "Invalid", "MetadataError", "NoQuorum", "NotFound", "NotLeader",
    "RaftStopped", "Unavailable",
    "ConfigError", "NodeNotStarted",
    "MemberRecord", "ReadResult", "TagMove", "TagRecord", "VersionRecord",
    "MetadataNode", "MetadataState", "Ordering", "RaftConfig", "VectorClock",
]


def __getattr__(name: str) -> Any:
    if name in _HEAVY:
        import importlib
        value = getattr(importlib.import_module(f".{_HEAVY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
