"""Proof that bytes are the chunk they claim to be: CRC32C, decode within the size cap, content id."""
from __future__ import annotations

from chunking.hashing import content_id, crc32c

from paramserver.server import codecs
from paramserver.server.errors import ChunkTransferCorruptError, InvalidChunkError, UnknownCodecError
from paramserver.server.store.files import human_size
from paramserver.server.store.state import StoreState
from paramserver.wire.limits import MAX_CODEC_LEN


class ContentProofs(StoreState):
    """Checks that bytes are the chunk their id names (ingest, scrub, migration, recovery)."""

    def validate_incoming(self, chunk_id: str, data: bytes, codec: str, raw_size: int, crc: int) -> None:
        """Prove that ``data`` is chunk ``chunk_id``; raise InvalidChunkError naming why not."""
        self.check_id(chunk_id)
        if not codec or len(codec) > MAX_CODEC_LEN or not codec.isascii():
            raise InvalidChunkError(chunk_id, f"chunk {chunk_id}: codec {codec!r} is not a valid codec name")
        if raw_size < 0:
            raise InvalidChunkError(chunk_id, f"chunk {chunk_id}: raw_size {raw_size} is out of range")
        if raw_size > self.max_raw_bytes:
            raise InvalidChunkError(
                chunk_id,
                f"chunk {chunk_id}: raw_size {raw_size} is over this server's limit of {self.max_raw_bytes} bytes "
                f"({human_size(self.max_raw_bytes)}, the largest chunk size); refused without decoding it",
            )
        if crc32c(data) != crc:
            raise ChunkTransferCorruptError(
                chunk_id,
                f"chunk {chunk_id}: CRC32C of the {len(data)} received bytes does not match the declared {crc:#010x}; "
                "it was damaged in transit or truncated, send it again",
            )
        self._prove_content(chunk_id, data, codec, raw_size)

    def _prove_content(self, chunk_id: str, data: bytes, codec: str, raw_size: int) -> None:
        try:
            raw = codecs.decode(codec, data, raw_size, limit=self.max_raw_bytes)
        except UnknownCodecError as exc:
            raise UnknownCodecError(chunk_id, f"chunk {chunk_id}: {exc}") from None
        except codecs.DecodeError as exc:
            raise InvalidChunkError(chunk_id, f"chunk {chunk_id}: {exc}") from None
        for algorithm in self.hash_algorithms:
            if content_id(raw, algorithm) == chunk_id:
                return
        raise InvalidChunkError(
            chunk_id,
            f"chunk {chunk_id}: its {raw_size} decoded bytes hash to {content_id(raw, self.hash_algorithms[0])}, not to its id; "
            "the sender has the wrong bytes for this id",
        )
