"""Prometheus metrics, read from the live components at scrape time.

A custom collector rather than counters updated on the hot path: a scrape
costs a few dict reads and one statvfs, a GetChunks stream one locked add per reply message
(the served bytes, ``served_bytes.ServedBytes``).
The alert rules and the dashboard in ``deploy/monitoring/`` use these names
(``tests/integration/test_monitoring.py`` checks them against a live server).
"""
from __future__ import annotations

import os
from typing import Callable, Iterator

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from consensus.api import MetadataPlane

from paramserver.server.heat import HeatAggregator
from paramserver.server.hot_chunks import HotChunks
from paramserver.server.peer_service import PeerService
from paramserver.server.repair import RepairQueue, Scrubber
from paramserver.server.served_bytes import ServedBytes
from paramserver.server.store import ChunkStore
from paramserver.wire.auth import READ_TOKEN_ENV, bearer_token, tokens_match


class ServerCollector(Collector):
    def __init__(self, server_id: str, store: ChunkStore, metadata: MetadataPlane, queue: RepairQueue,
                 members: Callable[[], int], scrubber: Scrubber | None = None, hot: HotChunks | None = None,
                 heat: HeatAggregator | None = None, served: ServedBytes | None = None,
                 peers: PeerService | None = None) -> None:
        self.server_id = server_id
        self.served = served
        self.peers = peers
        self.heat = heat
        self.hot = hot
        self.scrubber = scrubber
        self.store = store
        self.metadata = metadata
        self.queue = queue
        self.members = members

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["server"]
        stats = self.store.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.server_id], value)
            return g

        yield gauge("paramserver_chunks", "chunks stored on disk", stats.chunk_count)
        yield gauge("paramserver_disk_bytes", "stored chunk bytes on disk", stats.bytes_on_disk)
        fs = self._filesystem()
        if fs is not None:
            # free: what an unprivileged writer may still use, the figure the store refuses writes by (so blocks
            # reserved for root count as used); capacity: the file system's size
            yield gauge("paramserver_disk_free_bytes", "bytes still writable on the data dir's file system", fs[0])
            yield gauge("paramserver_disk_capacity_bytes", "size of the data dir's file system in bytes", fs[1])
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
        try:
            has_quorum = self.metadata.status().get("has_quorum")
        except Exception:  # noqa: BLE001 - a node shutting down has no status; skip the gauge
            has_quorum = None
        if isinstance(has_quorum, bool):
            yield gauge("paramserver_raft_has_quorum",
                        "1 while this server is connected to a majority of the Raft members (itself included)",
                        1.0 if has_quorum else 0.0)
        # The background scrubber, since start (zeros with --scrub-mb-per-s 0: enabled says which).
        scrub = self.scrubber
        yield gauge("paramserver_scrub_enabled", "1 when the background scrubber runs", 0.0 if scrub is None else 1.0)
        for name, doc, value in (
            ("paramserver_scrub_checked_chunks", "chunks the scrubber proved intact or found corrupt", scrub.checked_total if scrub else 0),
            ("paramserver_scrub_checked_bytes", "raw bytes the scrubber checked", scrub.bytes_total if scrub else 0),
            ("paramserver_scrub_corrupt_chunks", "chunks the scrubber found corrupt (quarantined, queued for repair)",
             scrub.corrupt_total if scrub else 0),
            ("paramserver_scrub_passes", "complete passes of the scrubber over the store", scrub.passes if scrub else 0),
            ("paramserver_scrub_busy_steps", "scrub steps run at the busy rate (the store was serving reads or writes)",
             scrub.busy_steps if scrub else 0),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.server_id], float(value))
            yield c

        if self.served is not None:  # chunk bytes sent to readers, per read path (a fleet's cold start shows here)
            c = CounterMetricFamily("paramserver_served_bytes", "chunk bytes sent to readers, by read path (bulk port, gRPC "
                                    "GetChunks)", labels=["server", "path"])
            for path, value in self.served.by_path().items():
                c.add_metric([self.server_id, path], float(value))
            yield c
        if self.peers is not None:
            yield gauge("paramserver_peer_entries", "live worker-peer entries (worker, version) kept here "
                        "(AnnouncePeer soft state)", self.peers.entries())

        if self.heat is not None:  # ReportHeat calls: parsed, and refused before a parse (a flood shows here)
            for name, doc, value in (
                ("paramserver_heat_reports_parsed", "ReportHeat calls whose entries were parsed", self.heat.parsed_reports),
                ("paramserver_heat_reports_refused_unparsed", "ReportHeat calls refused before their entries were parsed "
                 "(too large, no model or version, or a version this server does not have)", self.heat.refused_unparsed),
            ):
                c = CounterMetricFamily(name, doc, labels=labels)
                c.add_metric([self.server_id], float(value))
                yield c

        # Hot chunks (paramserver.server.hot_chunks): absent with --hot-chunks off.
        if self.hot is not None:
            h = self.hot.stats()
            yield gauge("paramserver_hot_chunks", "chunks this server holds as a ring replica and placed extra copies of", h.hot_chunks)
            yield gauge("paramserver_hot_chunk_bytes", "stored bytes of those hot chunks", h.hot_bytes)
            yield gauge("paramserver_hot_advertised_chunks", "hot chunks advertised with at least one confirmed extra copy",
                        h.advertised)
            yield gauge("paramserver_hot_extra_chunks", "extra copies of other servers' hot chunks held here", h.extra_chunks)
            yield gauge("paramserver_hot_extra_bytes", "stored bytes of the extra copies held here", h.extra_bytes)
            yield gauge("paramserver_hot_tracked_chunks", "chunks whose read rate is tracked", h.tracked)
            for name, doc, value in (
                ("paramserver_hot_copies_pushed", "extra copies this server sent to other servers", h.pushed_total),
                ("paramserver_hot_copies_pushed_bytes", "bytes of extra copies this server sent", h.pushed_bytes_total),
                ("paramserver_hot_extras_dropped", "extra copies held here dropped after their chunk cooled", h.dropped_total),
                ("paramserver_hot_copies_refused", "hot copies refused here (over the extra-copy bounds)", h.refused_total),
            ):
                c = CounterMetricFamily(name, doc, labels=labels)
                c.add_metric([self.server_id], float(value))
                yield c

    def _filesystem(self) -> tuple[int, int] | None:
        """(free bytes, capacity bytes) of the store's file system; None when it cannot be read."""
        try:
            st = os.statvfs(self.store.data_dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


class MetricsServer(ThreadingHTTPServer):
    """``GET /metrics`` of one registry; with ``tokens`` (the read and admin tokens), only for a scrape
    that sends one of them as ``Authorization: Bearer`` (Prometheus: ``authorization: credentials_file``).
    prometheus_client's own server checks nothing, so the metrics port had no credential at all."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry, tokens: tuple[str, ...]) -> None:
        self.registry = registry
        self.tokens = tokens
        super().__init__(address, _MetricsHandler)


class _MetricsHandler(BaseHTTPRequestHandler):
    server: MetricsServer
    timeout = 10  # a scrape that sends nothing does not hold its thread

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            return self._error(404, f"no such path {self.path.split('?', 1)[0]!r}; metrics are at GET /metrics")
        if self.server.tokens:
            given = bearer_token(self.headers.get("Authorization"))
            if not any(tokens_match(given, token) for token in self.server.tokens):
                problem = "no token was sent" if given is None else "the token sent is wrong"
                return self._error(401, f"metrics need the read token (${READ_TOKEN_ENV}) or the admin token as "
                                        f"'Authorization: Bearer <token>'; {problem}")
        body = generate_latest(self.server.registry)
        self._send(200, body, CONTENT_TYPE_LATEST)

    def _error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode() + b"\n", "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="paramserver metrics"')
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per scrape would drown the server's log


def serve_metrics(port: int, host: str, collector: ServerCollector, tokens: tuple[str | None, ...] = ()) -> MetricsServer:
    """Serve ``collector`` on host:port in a daemon thread; ``tokens``: those a scrape may send (None
    entries ignored; none at all: open, which ServerConfig allows on loopback or with --insecure only)."""
    registry = CollectorRegistry()
    registry.register(collector)
    server = MetricsServer((host.strip("[]"), port), registry, tuple(t for t in tokens if t))
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


__all__ = ["MetricsServer", "ServerCollector", "serve_metrics"]
