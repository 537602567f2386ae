"""Frozen, validated configuration for the worker's cache and prefetch components."""
from __future__ import annotations

from dataclasses import dataclass

from worker.errors import ConfigError

KIB = 1 << 10
MIB = 1 << 20
MAX_BODY_BYTES = 64 * MIB  # paramworker serve's largest request body (--max-body-bytes)
GIB = 1 << 30


@dataclass(frozen=True)
class CacheConfig:
    """Memory tier (LRU-K) over an optional disk tier.

    ``correlated_reference_period_s``: references to a chunk closer together than this count as
    one (a single load touching the same chunk twice is not evidence of popularity).
    ``retained_information_period_s``: how long the reference history of an evicted chunk is kept,
    so a chunk that comes back soon is recognised as popular; ``max_retained_history`` bounds that
    history in entries so memory cannot grow without limit.
    """

    memory_bytes: int = 4 * GIB
    k: int = 2
    correlated_reference_period_s: float = 0.5
    retained_information_period_s: float = 3600.0
    max_retained_history: int = 100_000
    disk_dir: str | None = None
    disk_bytes: int = 0
    disk_verify: str = "crc32c"
    disk_fsync: bool = True

    def validate(self) -> CacheConfig:
        if self.memory_bytes < 0:
            raise ConfigError(f"memory_bytes must be >= 0 (0 disables the memory tier), got {self.memory_bytes}")
        if self.k < 1:
            raise ConfigError(f"k must be >= 1 (2 is the usual LRU-K choice), got {self.k}")
        if self.correlated_reference_period_s < 0:
            raise ConfigError(f"correlated_reference_period_s must be >= 0, got {self.correlated_reference_period_s}")
        if self.retained_information_period_s < self.correlated_reference_period_s:
            raise ConfigError(
                "retained_information_period_s must be at least correlated_reference_period_s "
                f"({self.retained_information_period_s} < {self.correlated_reference_period_s})"
            )
        if self.max_retained_history < 0:
            raise ConfigError(f"max_retained_history must be >= 0, got {self.max_retained_history}")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ConfigError("disk_dir is set but disk_bytes is not: give the disk tier a byte budget > 0")
        if self.disk_bytes < 0:
            raise ConfigError(f"disk_bytes must be >= 0, got {self.disk_bytes}")
        if self.disk_verify not in ("crc32c", "content_id"):
            raise ConfigError(f"disk_verify must be 'crc32c' or 'content_id', got {self.disk_verify!r}")
        return self


HOST_STAGING = ("auto", "always", "never")


@dataclass(frozen=True)
class PrefetchConfig:
    """Staging pool and prefetch concurrency.

    ``staging_buffers`` x ``staging_buffer_bytes`` is the pinned memory the worker holds; the pool
    size is also the back-pressure bound: fetches wait when every buffer is waiting on a copy.
    """

    staging_buffer_bytes: int = 4 * MIB
    staging_buffers: int = 8
    max_streams_in_flight: int = 4
    chunks_per_stream: int = 64
    acquire_timeout_s: float = 60.0
    use_heatmap: bool = True
    # Pause the cyclic garbage collector while a load plans and fetches (see
    # chunking.chunk_table.collector_paused): a load makes several acyclic objects per chunk.
    pause_collector: bool = True
    # A load onto a device (not cpu): "auto" lands it in a page-locked host arena and moves each
    # tensor up whole (worker.upload) when the memory tier will hold the model, else chunk by chunk
    # through the staging pool; "always" and "never" force one way (a model larger than the tier
    # then holds its size in page-locked memory for the load).
    host_staging: str = "auto"

    def validate(self) -> PrefetchConfig:
        if self.staging_buffer_bytes < 4 * KIB:
            raise ConfigError(f"staging_buffer_bytes must be >= 4 KiB, got {self.staging_buffer_bytes}")
        if self.staging_buffers < 1:
            raise ConfigError(f"staging_buffers must be >= 1, got {self.staging_buffers}")
        if self.max_streams_in_flight < 1:
            raise ConfigError(f"max_streams_in_flight must be >= 1, got {self.max_streams_in_flight}")
        if self.chunks_per_stream < 1:
            raise ConfigError(f"chunks_per_stream must be >= 1, got {self.chunks_per_stream}")
        if self.acquire_timeout_s <= 0:
            raise ConfigError(f"acquire_timeout_s must be > 0, got {self.acquire_timeout_s}")
        if self.host_staging not in HOST_STAGING:
            raise ConfigError(f"host_staging must be one of {', '.join(HOST_STAGING)}, got {self.host_staging!r}")
        return self


