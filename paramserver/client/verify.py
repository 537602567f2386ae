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

from collections.abc import Sequence

import numpy as np

from chunking.codec import decode_chunk
from chunking.hashing import Buffer, bytes_like, content_id, crc32c
from chunking.manifest import ChunkRef
from paramserver.client.errors import ConfigError

VERIFY_MODES = ("crc", "content")


class Verifier:
    def __init__(self, mode: str = "crc", algorithm: str = "blake3") -> None:
        if mode not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")
        self.mode = mode
        self.algorithm = algorithm

    def check_in_place(self, expected_crcs: np.ndarray, server_crcs: np.ndarray, regions: Sequence[memoryview],
                       ids: Sequence[str]) -> np.ndarray:
        """Raw chunks received straight into their destinations (``regions``): per chunk, whether
        its bytes there match the manifest (``expected_crcs``; ``ids`` in ``content`` mode); the
        server's own CRC (``server_crcs``) must match too."""
        got = np.fromiter(map(crc32c, regions), dtype=np.uint32, count=len(regions))
        good: np.ndarray = (got == expected_crcs) & (server_crcs == expected_crcs)
        if self.mode == "content":
            for k in np.flatnonzero(good).tolist():
                if content_id(regions[k], self.algorithm) != ids[k]:
                    good[k] = False
        return good

    def raw(self, ref: ChunkRef, codec: str, crc: int, data: Buffer) -> Buffer:
        """The verified raw bytes of a chunk received into a bounce buffer (may be a view of it);
        ChunkCorrupt when they do not match the manifest."""
        content = self.mode == "content"
        if codec == ref.codec and crc == ref.crc32c:
            return decode_chunk(ref, data, algorithm=self.algorithm, check_id=content)
        theirs = ref._replace(codec=codec, crc32c=crc, stored_size=len(memoryview(bytes_like(data))))
        return decode_chunk(theirs, data, algorithm=self.algorithm, check_id=True)


__all__ = ["VERIFY_MODES", "Verifier"]
