"""worker package: GPU workers pulling weights from the cluster.

``load_state_dict(cluster, "resnet50:prod", device=...)`` / ``load_into(module, ...)`` load a
version by tag (``MODEL:TAG``) or number (``MODEL@N``); ``ClusterClient`` reads verified chunks
from replicas; ``HotSwapper`` follows a tag; caches, heatmap, staging and readiness underneath.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Import submodules on first use: the cache and heatmap users (the simulator, the servers'
# heat aggregation) should not pay for importing torch.
_EXPORTS = {
    "worker.client": ("ClusterClient", "FetchStats", "VersionInfo"),
    "worker.config": ("CacheConfig", "ClusterClientConfig", "PrefetchConfig"),
    "worker.disk_cache": ("DiskCache", "DiskCacheStats"),
    "worker.errors": (
        "BadModelRef", "BufferTooSmall", "CacheError", "ChunkDataLoss", "ChunkUnavailable", "ClusterUnavailable",
        "ConfigError", "HeatmapMismatch", "ManifestUnavailable", "ModelNotFound", "ReadinessTimeout", "StaleRead",
        "StagingTimeout", "TensorFailed", "UnknownTensor", "WorkerError",
    ),
    "worker.heatmap": ("HeatReport", "HeatmapRecorder", "merge", "prefetch_order"),
    "worker.loader": ("LoadHandle", "LoadReport", "LoadedModel", "ModelRef", "load", "load_into", "load_state_dict",
                      "start_load"),
    "worker.lru": ("LRUCache",),
    "worker.lru_k": ("CacheStats", "LRUKCache"),
    "worker.monotonic": ("MonotonicReads", "Resolution"),
    "worker.prefetch": ("Prefetcher",),
    "worker.readiness": ("TensorReadiness",),
    "worker.replicas": ("ReplicaSelector",),
    "worker.staging": ("COMPLETED", "Copier", "CopyFence", "StagingBuffer", "StagingPool", "byte_view"),
    "worker.swap": ("HotSwapper",),
    "worker.tiered_cache": ("Lookup", "TieredCache"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from worker.client import ClusterClient, FetchStats, VersionInfo
    from worker.config import CacheConfig, ClusterClientConfig, PrefetchConfig
    from worker.disk_cache import DiskCache, DiskCacheStats
    from worker.errors import (
        BadModelRef,
        BufferTooSmall,
        CacheError,
        ChunkDataLoss,
        ChunkUnavailable,
        ClusterUnavailable,
        ConfigError,
        HeatmapMismatch,
        ManifestUnavailable,
        ModelNotFound,
        ReadinessTimeout,
        StaleRead,
        StagingTimeout,
        TensorFailed,
        UnknownTensor,
        WorkerError,
    )
    from worker.heatmap import HeatmapRecorder, HeatReport, merge, prefetch_order
    from worker.loader import LoadedModel, LoadHandle, LoadReport, ModelRef, load, load_into, load_state_dict, start_load
    from worker.lru import LRUCache
    from worker.lru_k import CacheStats, LRUKCache
    from worker.monotonic import MonotonicReads, Resolution
    from worker.prefetch import Prefetcher
    from worker.readiness import TensorReadiness
    from worker.replicas import ReplicaSelector
    from worker.staging import COMPLETED, Copier, CopyFence, StagingBuffer, StagingPool, byte_view
    from worker.swap import HotSwapper
    from worker.tiered_cache import Lookup, TieredCache


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BadModelRef",
    "BufferTooSmall",
    "COMPLETED",
    "CacheConfig",
    "CacheError",
    "CacheStats",
    "ChunkDataLoss",
    "ChunkUnavailable",
    "ClusterClient",
    "ClusterClientConfig",
    "ClusterUnavailable",
    "ConfigError",
    "Copier",
    "CopyFence",
    "DiskCache",
    "DiskCacheStats",
    "FetchStats",
    "HeatReport",
    "HeatmapMismatch",
    "HeatmapRecorder",
    "HotSwapper",
    "LRUCache",
    "LRUKCache",
    "LoadHandle",
    "LoadReport",
    "LoadedModel",
    "Lookup",
    "ManifestUnavailable",
    "ModelNotFound",
    "ModelRef",
    "MonotonicReads",
    "PrefetchConfig",
    "Prefetcher",
    "ReadinessTimeout",
    "ReplicaSelector",
    "Resolution",
    "StagingBuffer",
    "StagingPool",
    "StagingTimeout",
    "StaleRead",
    "TensorFailed",
    "TensorReadiness",
    "TieredCache",
    "UnknownTensor",
    "VersionInfo",
    "WorkerError",
    "byte_view",
    "load",
    "load_into",
    "load_state_dict",
    "merge",
    "prefetch_order",
    "start_load",
]
