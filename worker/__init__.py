"""worker package: caches, heatmap, staging and readiness for GPU workers pulling weights."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Import submodules on first use: the cache and heatmap users (the simulator, the servers'
# heat aggregation) should not pay for importing torch.
_EXPORTS = {
    "worker.config": ("CacheConfig", "PrefetchConfig"),
    "worker.disk_cache": ("DiskCache", "DiskCacheStats"),
    "worker.errors": (
        "BufferTooSmall", "CacheError", "ConfigError", "HeatmapMismatch", "ReadinessTimeout",
        "StagingTimeout", "TensorFailed", "UnknownTensor", "WorkerError",
    ),
    "worker.heatmap": ("HeatReport", "HeatmapRecorder", "merge", "prefetch_order"),
    "worker.lru": ("LRUCache",),
    "worker.lru_k": ("CacheStats", "LRUKCache"),
    "worker.readiness": ("TensorReadiness",),
    "worker.staging": ("COMPLETED", "Copier", "CopyFence", "StagingBuffer", "StagingPool", "byte_view"),
    "worker.tiered_cache": ("Lookup", "TieredCache"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from worker.config import CacheConfig, PrefetchConfig
    from worker.disk_cache import DiskCache, DiskCacheStats
    from worker.errors import (
        BufferTooSmall,
        CacheError,
        ConfigError,
        HeatmapMismatch,
        ReadinessTimeout,
        StagingTimeout,
        TensorFailed,
        UnknownTensor,
        WorkerError,
    )
    from worker.heatmap import HeatmapRecorder, HeatReport, merge, prefetch_order
    from worker.lru import LRUCache
    from worker.lru_k import CacheStats, LRUKCache
    from worker.readiness import TensorReadiness
    from worker.staging import COMPLETED, Copier, CopyFence, StagingBuffer, StagingPool, byte_view
    from worker.tiered_cache import Lookup, TieredCache


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BufferTooSmall",
    "COMPLETED",
    "CacheConfig",
    "CacheError",
    "CacheStats",
    "ConfigError",
    "Copier",
    "CopyFence",
    "DiskCache",
    "DiskCacheStats",
    "HeatReport",
    "HeatmapMismatch",
    "HeatmapRecorder",
    "LRUCache",
    "LRUKCache",
    "Lookup",
    "PrefetchConfig",
    "ReadinessTimeout",
    "StagingBuffer",
    "StagingPool",
    "StagingTimeout",
    "TensorFailed",
    "TensorReadiness",
    "TieredCache",
    "UnknownTensor",
    "WorkerError",
    "byte_view",
    "merge",
    "prefetch_order",
]
