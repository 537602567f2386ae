"""Configuration of how a model is cut into chunks and stored."""
from __future__ import annotations

from dataclasses import dataclass

from chunking.errors import InvalidInput

MIN_CHUNK_SIZE = 4 * 1024
MAX_CHUNK_SIZE = 64 * 1024 * 1024
CODEC_POLICIES = ("off", "auto", "on")
HASH_ALGORITHMS = ("blake3", "sha256")


@dataclass(frozen=True)
class ChunkingConfig:
    """How ``pack`` cuts and stores a model.

    ``codec``: "off" stores raw chunks (fastest to load on a fast link: zstd
    decompresses at ~1 GB/s, far below memcpy); "auto" keeps a zstd chunk only
    when it saves at least ``auto_min_saving`` of the bytes; "on" always
    compresses. ``shuffle`` groups the bytes of each element by position before
    zstd, which is what makes float weights (bf16 especially) compressible.
    """

    chunk_size: int = 262144
    codec: str = "off"
    zstd_level: int = 1
    shuffle: bool = True
    hash_algorithm: str = "blake3"
    auto_min_saving: float = 0.10

    def validate(self) -> None:
        cs = self.chunk_size
        if not isinstance(cs, int) or isinstance(cs, bool) or cs < MIN_CHUNK_SIZE or cs > MAX_CHUNK_SIZE or cs & (cs - 1):
            raise InvalidInput(
                f"chunk_size {cs!r} is not allowed: use a power of two from {MIN_CHUNK_SIZE} (4 KiB) "
                f"to {MAX_CHUNK_SIZE} (64 MiB), e.g. 262144"
            )
        if self.codec not in CODEC_POLICIES:
            raise InvalidInput(f"codec {self.codec!r} is unknown: use one of {', '.join(CODEC_POLICIES)}")
        if not isinstance(self.zstd_level, int) or not -7 <= self.zstd_level <= 22:
            raise InvalidInput(f"zstd_level {self.zstd_level!r} is out of range: use an int from -7 to 22 (1 is fast)")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise InvalidInput(f"hash_algorithm {self.hash_algorithm!r} is unknown: use one of {', '.join(HASH_ALGORITHMS)}")
        if not 0.0 <= self.auto_min_saving < 1.0:
            raise InvalidInput(f"auto_min_saving {self.auto_min_saving!r} must be in [0, 1), e.g. 0.10")
