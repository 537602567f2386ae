"""The parameter server: wire contract, chunk store, placement ring, data and metadata services."""
from __future__ import annotations

from .client import ChunkData, ClientConfig, ParamServerClient, make_chunk
from .config import ServerConfig
from .errors import (
    AuthError,
    ChunkCorruptError,
    ChunkNotFoundError,
    ChunkTransferCorruptError,
    ConfigError,
    InvalidChunkError,
    ParamServerError,
    UnknownCodecError,
)
from .ring import Ring, RingConfig
from .store import ChunkStore, StoredChunk

__all__ = [
    "ChunkData",
    "ClientConfig",
    "ParamServerClient",
    "make_chunk",
    "ServerConfig",
    "Ring",
    "RingConfig",
    "ChunkStore",
    "StoredChunk",
    "ParamServerError",
    "ConfigError",
    "InvalidChunkError",
    "ChunkTransferCorruptError",
    "ChunkNotFoundError",
    "ChunkCorruptError",
    "UnknownCodecError",
    "AuthError",
]
