"""Typed errors of the parameter server. Inner modules raise these; only the
gRPC service modules map them to status codes. Messages say what to do next."""
from __future__ import annotations

from paramserver.wire.bulk_frames import E_MALFORMED
from paramserver.wire.errors import ConfigError as WireConfigError


class ParamServerError(Exception):
    """Base class for every error raised by ``paramserver``."""


class ConfigError(ParamServerError, WireConfigError):
    """A server option is invalid.

    The paramserver hierarchy's one ConfigError is the wire one (``paramserver.wire.errors``); this
    subclass exists because the server's handlers catch ``ParamServerError`` and ``cli.py`` maps
    ``ConfigError`` to exit 2: a server config error must be both. The wire layer cannot import
    this package, so one class cannot be both.
    """


class DataDirInUse(ConfigError):
    """Another process holds the data dir."""


class ForeignDataDir(ConfigError):
    """The data dir's Raft journal belongs to another cluster."""


class PreconditionFailed(ParamServerError):
    """The call is well-formed but the cluster is not ready for it (e.g. chunks of a version missing)."""


class DecodeError(ValueError):
    """The stored bytes do not decode to ``raw_size`` bytes (a ValueError, as the codecs' callers expect)."""


class ChunkError(ParamServerError):
    """A problem with one chunk; ``chunk_id`` names it."""

    def __init__(self, chunk_id: str, message: str) -> None:
        super().__init__(message)
        self.chunk_id = chunk_id


class InvalidChunkError(ChunkError, ValueError):
    """A chunk offered for ingest is malformed or its bytes do not match its id.

    The sender is at fault; nothing was stored. Maps to INVALID_ARGUMENT.
    """


class ChunkTransferCorruptError(InvalidChunkError):
    """A chunk offered for ingest failed its CRC32C: damaged in transit. Maps to DATA_LOSS."""


class ChunkNotFoundError(ChunkError, KeyError):
    """The chunk is not stored on this server. Maps to NOT_FOUND."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ChunkCorruptError(ChunkError):
    """This server's stored copy failed verification; it was quarantined and
    will never be returned. Maps to DATA_LOSS; the chunk is queued for repair."""


class UnknownCodecError(InvalidChunkError):
    """The chunk's codec is not one this server can verify."""


class StoreFullError(ParamServerError):
    """The chunk store's disk is full (ENOSPC): this write was refused, nothing half-written is
    kept, reads go on. Maps to RESOURCE_EXHAUSTED; ``free_bytes`` is what the disk has left."""

    def __init__(self, message: str, free_bytes: int = 0) -> None:
        super().__init__(message)
        self.free_bytes = free_bytes


class AuthError(ParamServerError):
    """A call carried a missing or wrong token. Maps to UNAUTHENTICATED."""


class ForwardFailed(Exception):
    """Forwarding to the next hop failed; the message says why."""


class PutRefused(Exception):
    """A bulk PUT a write session will not take; ``error_class`` goes into the ERROR frame."""

    def __init__(self, message: str, error_class: int = E_MALFORMED) -> None:
        super().__init__(message)
        self.error_class = error_class


__all__ = [
    "ParamServerError",
    "ConfigError",
    "DataDirInUse", "ForeignDataDir", "PreconditionFailed", "DecodeError",
    "ChunkError",
    "InvalidChunkError",
    "ChunkTransferCorruptError",
    "ChunkNotFoundError",
    "ChunkCorruptError",
    "UnknownCodecError",
    "StoreFullError",
    "AuthError",
    "ForwardFailed", "PutRefused",
]
