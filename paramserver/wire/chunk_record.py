"""The one shape of a chunk on the write path, from the client's sender to the server's store.

A :class:`ChunkRecord` is a chunk as it travels: its content id, how its bytes are encoded, the
decoded size, the CRC32C of the stored bytes and the stored bytes themselves (a push may pass a
view of its tensors; a server's reader a view of the PUT's buffer). Nothing in it is verified:
the receiver proves the bytes against the id before it keeps them. The same type is what a read
returns, so one chunk never changes shape between ``paramctl push`` and the segment file.
"""
from __future__ import annotations

from typing import NamedTuple

ChunkBytes = bytes | bytearray | memoryview


class ChunkRecord(NamedTuple):
    id: str  # content id (hex)
    codec: str  # "raw" or a registered codec name
    raw_size: int  # bytes once decoded
    crc32c: int  # CRC32C of ``data`` as stored (and sent)
    data: ChunkBytes  # stored bytes, not yet verified


__all__ = ["ChunkBytes", "ChunkRecord"]
