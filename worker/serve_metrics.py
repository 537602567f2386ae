"""What ``paramworker serve`` exports at ``GET /metrics`` (Prometheus text, ``prometheus-client``).

One registry per server, so several servers in one process (tests) do not share counters.
The peer port's and the swarm's counters (``worker.peer_link.PeerStats``) are read when scraped.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from worker.peer_link import PeerStats

OUTCOMES = ("hit_l1", "hit_l2", "computed", "joined", "shed", "error")
TIERS = ("memory", "disk", "network", "peer")  # network: the servers; peer: other workers
CONTENT_TYPE = CONTENT_TYPE_LATEST


class PeerCollector:
    """``pdparams_peer_*`` from the process's peer link at scrape time (zeros without one)."""

    def __init__(self, stats: Callable[[], PeerStats | None]) -> None:
        self._stats = stats

    def _families(self, s: PeerStats) -> list[Metric]:
        served = CounterMetricFamily("pdparams_peer_served_bytes", "Chunk bytes this worker sent to other workers "
                                     "(its peer port)", value=s.served_bytes)
        dropped = CounterMetricFamily("pdparams_peer_dropped", "Peers this worker's loads stopped reading from, by why "
                                      "(bad bytes, refused, slow, gone)", labels=["reason"])
        for reason, n in sorted(s.dropped.items()):
            dropped.add_metric([reason], n)
        connections = GaugeMetricFamily("pdparams_peer_connections", "Open connections to this worker's peer port",
                                        value=s.connections)
        return [served, dropped, connections]

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(PeerStats()))

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats() or PeerStats()
        except Exception:  # noqa: BLE001 - a scrape never fails for the peers' counters
            stats = PeerStats()
        return iter(self._families(stats))


class ServeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("pdparams_infer_requests", "Inference requests by how they were answered",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.forward = Counter("pdparams_forward", "Forward passes run", registry=r)
        self.seconds = Histogram("pdparams_infer_seconds", "Inference request latency, admission to answer", registry=r,
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.cache_bytes = Gauge("pdparams_result_cache_bytes", "Bytes held by the result cache (L1: this process)",
                                 ["level"], registry=r)
        self.l2_errors = Counter("pdparams_result_cache_l2_errors", "Redis calls that failed or were too slow", registry=r)
        self.l2_rejected = Counter("pdparams_result_cache_l2_rejected",
                                   "L2 entries not served: their authentication (HMAC under the workers' key) failed",
                                   registry=r)
        self.breaker_open = Gauge("pdparams_result_cache_breaker_open", "1 while the Redis circuit breaker is open or half-open",
                                  registry=r)
        self.breaker_transitions = Counter("pdparams_result_cache_breaker_transitions",
                                           "Circuit breaker state changes, by the state entered", ["state"], registry=r)
        for state in ("open", "half_open", "closed"):
            self.breaker_transitions.labels(state)
        self.load_bytes = Counter("pdparams_load_bytes", "Weight bytes loaded, by the tier they came from", ["tier"], registry=r)
        for tier in TIERS:
            self.load_bytes.labels(tier)
        self.queue = Gauge("pdparams_infer_queue", "Requests waiting for a forward slot", registry=r)
        self.running = Gauge("pdparams_infer_running", "Forward passes running", registry=r)
        self.version = Gauge("pdparams_serving_version", "Version number being served", ["model"], registry=r)

    def watch(self, queue: Callable[[], float], running: Callable[[], float], l1_bytes: Callable[[], float]) -> None:
        self.queue.set_function(queue)
        self.running.set_function(running)
        self.cache_bytes.labels("l1").set_function(l1_bytes)

    def breaker_changed(self, _old: str, new: str) -> None:
        self.breaker_transitions.labels(new).inc()
        self.breaker_open.set(0 if new == "closed" else 1)

    def watch_peers(self, stats: Callable[[], PeerStats | None]) -> None:
        self.registry.register(PeerCollector(stats))

    def loaded(self, memory: int, disk: int, network: int, peer: int = 0) -> None:
        for tier, n in zip(TIERS, (memory, disk, network, peer), strict=True):
            if n > 0:
                self.load_bytes.labels(tier).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "OUTCOMES", "PeerCollector", "ServeMetrics", "TIERS"]
