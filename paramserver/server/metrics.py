"""Prometheus metrics, read from the live components at scrape time.

A custom collector rather than counters updated on the hot path: a scrape
costs a few dict reads, a GetChunks stream costs nothing extra.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily
from prometheus_client.registry import Collector

from consensus.api import MetadataPlane

from paramserver.server.repair import RepairQueue
from paramserver.server.store import ChunkStore


class ServerCollector(Collector):
    def __init__(self, server_id: str, store: ChunkStore, metadata: MetadataPlane, queue: RepairQueue,
                 members: Callable[[], int]) -> None:
        self.server_id = server_id
        self.store = store
        self.metadata = metadata
        self.queue = queue
        self.members = members

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["server"]
        stats = self.store.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.server_id], value)
            return g

        yield gauge("paramserver_chunks", "chunks stored on disk", stats.chunk_count)
        yield gauge("paramserver_disk_bytes", "stored chunk bytes on disk", stats.bytes_on_disk)
        yield gauge("paramserver_quarantined_chunks", "chunk files found corrupt and set aside", stats.quarantined)
        yield gauge("paramserver_repair_queue", "chunks waiting for repair from a healthy replica", len(self.queue))
        yield gauge("paramserver_cache_bytes", "bytes in the hot-chunk cache", stats.cache.used_bytes)
        yield gauge("paramserver_cache_hits", "hot-chunk cache hits", stats.cache.hits)
        yield gauge("paramserver_cache_misses", "hot-chunk cache misses", stats.cache.misses)
        yield gauge("paramserver_is_leader", "1 when this server is the Raft leader", 1.0 if self.metadata.is_leader() else 0.0)
        try:
            yield gauge("paramserver_raft_term", "current Raft term", self.metadata.term())
            yield gauge("paramserver_raft_commit_index", "Raft commit index", self.metadata.commit_index())
        except Exception:  # noqa: BLE001 - a node shutting down has no term; skip those two
            pass
        yield gauge("paramserver_members", "cluster members known to this server", self.members())


def serve_metrics(port: int, host: str, collector: ServerCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, addr=host, registry=registry)
    return registry


__all__ = ["ServerCollector", "serve_metrics"]
