"""Errors raised by the chunking library. Messages say what to do next."""
from __future__ import annotations

from collections.abc import Sequence


class ChunkingError(Exception):
    """Base class for every error raised by ``chunking``."""


class InvalidInput(ChunkingError, ValueError):
    """The state dict, file or option given to pack/unpack is not usable."""


class ManifestError(ChunkingError):
    """A manifest could not be read: malformed, unknown format version, or id mismatch."""


class ChunkCorrupt(ChunkingError):
    """A chunk's bytes do not match its CRC32C or content id.

    Names the chunk and the tensors it feeds, so an operator knows what to repair.
    """

    def __init__(self, chunk_id: str, reason: str, tensors: Sequence[str] = (), index: int | None = None) -> None:
        self.chunk_id = chunk_id
        self.reason = reason
        self.tensors = tuple(tensors)
        self.index = index
        where = f" (chunk #{index})" if index is not None else ""
        feeds = f"; it feeds tensors: {', '.join(self.tensors[:8])}" + (" ..." if len(self.tensors) > 8 else "") if self.tensors else ""
        super().__init__(
            f"chunk {chunk_id}{where} is corrupt: {reason}{feeds}. "
            "Read it from another replica or re-push the model."
        )


class DecompressionBomb(ChunkCorrupt):
    """A compressed chunk would expand beyond its declared raw size."""


class ChunkMissing(ChunkingError):
    """A chunk source did not deliver every chunk a manifest names."""

    def __init__(self, chunk_ids: Sequence[str], tensors: Sequence[str] = ()) -> None:
        self.chunk_ids = tuple(chunk_ids)
        self.tensors = tuple(tensors)
        shown = ", ".join(self.chunk_ids[:4]) + (" ..." if len(self.chunk_ids) > 4 else "")
        feeds = f"; incomplete tensors: {', '.join(self.tensors[:8])}" + (" ..." if len(self.tensors) > 8 else "") if self.tensors else ""
        super().__init__(
            f"{len(self.chunk_ids)} chunk(s) were not delivered: {shown}{feeds}. "
            "Check that the chunk source holds every chunk of the manifest (push again or repair the replicas)."
        )
