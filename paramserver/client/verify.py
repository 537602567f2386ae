"""The one chunk verifier of the client: every received chunk is checked against the manifest
before its bytes count, and never with a hash the mode does not need.

- ``crc`` (the default): the stored size and CRC32C from the manifest. The manifest is proven
  by its own content id, so its CRCs are authentic: this catches damage on a disk or on the
  wire. No BLAKE3. A zstd chunk is inflated (with the bomb limit of its declared raw size).
- ``content``: also the chunk's content id (BLAKE3, or the manifest's algorithm), once per
  chunk, over the raw bytes: safe even against a replica that forges CRCs.

A replica may hold another encoding of the same raw bytes (pushed earlier with another codec):
its CRC is then the server's, not the manifest's, so the raw bytes are proven by their content
id in either mode.
"""
from __future__ import annotations

from typing import NamedTuple

from chunking.codec import decode_chunk
from chunking.errors import ChunkCorrupt
from chunking.hashing import Buffer, bytes_like, content_id, crc32c
from chunking.manifest import ChunkRef
from paramserver.client.errors import ConfigError

VERIFY_MODES = ("crc", "content")


class Arrival(NamedTuple):
    """One chunk as a transport delivered it: OK with its stored bytes, or refused."""

    id: str
    ok: bool
    corrupt: bool  # refused because the server's copy failed its own check
    codec: str
    crc32c: int
    data: Buffer  # OK: stored bytes (a view that may be reused once consumed); else unused
    message: str = ""


class Verifier:
    def __init__(self, mode: str = "crc", algorithm: str = "blake3") -> None:
        if mode not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")
        self.mode = mode
        self.algorithm = algorithm

    def check_in_place(self, ref: ChunkRef, arrival: Arrival, region: memoryview) -> None:
        """A raw chunk received straight into ``region`` (its destination): check it there."""
        if arrival.codec != "raw" or arrival.crc32c != ref.crc32c or crc32c(region) != ref.crc32c:
            raise ChunkCorrupt(ref.id, "CRC32C of the received bytes does not match the manifest", (), ref.index)
        if self.mode == "content" and content_id(region, self.algorithm) != ref.id:
            raise ChunkCorrupt(ref.id, "content id of the received bytes does not match the manifest", (), ref.index)

    def raw(self, ref: ChunkRef, arrival: Arrival) -> Buffer:
        """The verified raw bytes of a chunk received into a bounce buffer (may be a view of it)."""
        content = self.mode == "content"
        if arrival.codec == ref.codec and arrival.crc32c == ref.crc32c:
            return decode_chunk(ref, arrival.data, algorithm=self.algorithm, check_id=content)
        theirs = ref._replace(codec=arrival.codec, crc32c=arrival.crc32c, stored_size=len(memoryview(bytes_like(arrival.data))))
        return decode_chunk(theirs, arrival.data, algorithm=self.algorithm, check_id=True)


__all__ = ["Arrival", "VERIFY_MODES", "Verifier"]
