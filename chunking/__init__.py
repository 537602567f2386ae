"""Chunking: model weights <-> content-addressed chunks plus a manifest.

No network, no Raft: the pure library the server, worker and CLI build on.
"""
from __future__ import annotations

from chunking.assembler import Assembler
from chunking.codec import decode_chunk, encode_chunk
from chunking.config import ChunkingConfig
from chunking.diff import DiffResult, diff
from chunking.errors import ChunkCorrupt, ChunkingError, ChunkMissing, DecompressionBomb, InvalidInput, ManifestError
from chunking.hashing import content_id, crc32c, is_content_id
from chunking.manifest import FORMAT_VERSION, ChunkRef, Manifest, TensorEntry
from chunking.pack import Chunk, PackResult, PackStream, pack, pack_stream
from chunking.sources import load_source
from chunking.unpack import ChunkSource, unpack

__all__ = [
    "FORMAT_VERSION",
    "Assembler",
    "Chunk",
    "ChunkCorrupt",
    "ChunkMissing",
    "ChunkRef",
    "ChunkSource",
    "ChunkingConfig",
    "ChunkingError",
    "DecompressionBomb",
    "DiffResult",
    "InvalidInput",
    "Manifest",
    "ManifestError",
    "PackResult",
    "TensorEntry",
    "content_id",
    "crc32c",
    "decode_chunk",
    "diff",
    "encode_chunk",
    "is_content_id",
    "load_source",
    "pack",
    "pack_stream",
    "PackStream",
    "unpack",
]
