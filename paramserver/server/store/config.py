"""The chunk store's options (``StoreConfig``, read from a server config's ``store_*`` keys)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from chunking.config import MAX_CHUNK_SIZE

from paramserver.server.errors import ConfigError

KiB, MiB = 1 << 10, 1 << 20

# The largest raw size a chunk may declare: chunking's largest chunk size (64 MiB). Nothing
# bigger is ever decoded, so a small frame that claims to inflate to gigabytes is refused.
DEFAULT_MAX_RAW_BYTES = MAX_CHUNK_SIZE


_STORE_KEYS: tuple[tuple[str, type], ...] = (
    ("segment_bytes", int), ("compact_live_fraction", float), ("compact_dead_ratio", float), ("compact_bytes_per_s", int),
    ("compact_interval_s", float), ("meta_reserve_bytes", int), ("verify_index_on_open", bool),
)
CONFIG_KEYS = ("store_direct_writes", *(f"store_{name}" for name, _ in _STORE_KEYS))  # a server config's keys for the store


@dataclass(frozen=True)
class StoreConfig:
    """Options of the segment store (defaults are what a server runs with)."""

    segment_bytes: int = 256 * MiB  # a segment is sealed once the next record would pass this
    compact_live_fraction: float = 0.5  # a sealed segment with less live data than this is rewritten
    # ... and, emptiest first, any segment with dead bytes while the store's dead bytes exceed this
    # fraction of its live bytes (bounds the space overhead, e.g. 0.1: disk use <= 1.1 x live + one segment)
    compact_dead_ratio: float = 0.1
    compact_bytes_per_s: int = 64 * MiB  # compaction I/O budget (bytes read + written)
    compact_interval_s: float = 1.0  # how often the background task runs a compaction step
    # chunk writes leave this much free space for the store's own small records (tombstones of deletes
    # and quarantines, segment indexes, compaction copies), so a full disk can still be cleaned up
    meta_reserve_bytes: int = 1 * MiB
    verify_index_on_open: bool = True  # check each .idx entry against its record header on open
    # True: appends' whole blocks go around the page cache (O_DIRECT, paramserver.server.direct_io),
    # falling back to buffered writes, logged once, where the file system refuses it. None (auto):
    # O_DIRECT only with fsync on. Without fsync a write is acknowledged once written, and an
    # O_DIRECT write waits for the device, the very wait --no-fsync is asked to skip; with fsync on,
    # the bytes must reach the device before the ack anyway, and O_DIRECT spares the page cache.
    direct_writes: bool | None = None

    def validate(self) -> StoreConfig:
        if not 4 * KiB <= self.segment_bytes <= 1 << 40:
            raise ConfigError(f"store segment_bytes must be 4 KiB..1 TiB, got {self.segment_bytes}")
        if not 0.0 < self.compact_live_fraction <= 1.0:
            raise ConfigError(f"store compact_live_fraction must be in (0, 1], got {self.compact_live_fraction}")
        if self.compact_dead_ratio < 0:
            raise ConfigError(f"store compact_dead_ratio must be >= 0, got {self.compact_dead_ratio}")
        if self.compact_bytes_per_s < 1:
            raise ConfigError(f"store compact_bytes_per_s must be >= 1, got {self.compact_bytes_per_s}")
        if not self.compact_interval_s > 0:
            raise ConfigError(f"store compact_interval_s must be > 0, got {self.compact_interval_s}")
        if self.meta_reserve_bytes < 0:
            raise ConfigError(f"store meta_reserve_bytes must be >= 0, got {self.meta_reserve_bytes}")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> StoreConfig:
        """From a server config file's extra keys ``store_segment_bytes``, ``store_compact_live_fraction``,
        ``store_compact_dead_ratio``, ``store_compact_bytes_per_s``, ``store_compact_interval_s``,
        ``store_meta_reserve_bytes``, ``store_verify_index_on_open`` and ``store_direct_writes`` (true,
        false or "auto")."""
        values: dict[str, object] = {}
        direct = extra.get("store_direct_writes")
        if direct is not None:
            if not (isinstance(direct, bool) or direct == "auto"):
                raise ConfigError(f'store_direct_writes must be true, false or "auto", got {direct!r}')
            values["direct_writes"] = None if direct == "auto" else direct
        for name, kind in _STORE_KEYS:
            value = extra.get(f"store_{name}")
            if value is None:
                continue
            if kind is bool:
                if not isinstance(value, bool):
                    raise ConfigError(f"store_{name} must be true or false, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
                raise ConfigError(f"store_{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
            values[name] = kind(value)
        return cls(**values).validate()  # type: ignore[arg-type]
