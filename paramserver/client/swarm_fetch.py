"""A worker's fetch from peers and servers together: the swarm.

``Swarm.fetch`` reads a load's chunks in windows (``window_bytes`` of stored bytes, in fetch
order, ``windows_in_flight`` at a time). Each window is planned when it starts, with the peers of
the version this process knows of at that moment (FindPeers, refreshed every ``refresh_s``): the
policy (paramserver.client.swarm_plan) names a first-choice peer for each block, or the servers,
and the fetch planner sends every chunk a peer cannot give (not there in time, slow, gone, refused,
corrupt) to the servers. Windows are why workers that start a second apart still split a version:
the first one's later windows are planned knowing the others.

A peer's bytes are proven by content id (fetch.py). A peer whose bytes fail is dropped by this
process for ``drop_s``, logged and counted; one that breaks or is slow is left for that window.

``serve_at(address, versions)`` makes this process visible to others: it announces what it holds
or loads (``versions()``, from the worker) to the ring owners of each version, every ``lease_s / 3``
and at once on ``announce_now()``; ``close()`` says it is leaving.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from chunking.chunk_table import ChunkRows, ChunkTable
from paramserver.client.errors import ConfigError
from paramserver.client.fetch import ChunkSink, FetchStats
from paramserver.client.fetch_plan import PEER_PREFIX, Wants
from paramserver.client.peers import PeerDirectory, PeerEntry, PeerVersion, PeerView
from paramserver.client.swarm_plan import SwarmMember, choose_sources, version_salt
from paramserver.wire.exposure import is_loopback_host
from paramserver.wire.address import split_host_port
from paramserver.wire.limits import MAX_PEERS_FOUND, PEER_LEASE_MAX_S, PEER_LEASE_MIN_S

if TYPE_CHECKING:
    from paramserver.client.session import ClusterClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwarmOptions:
    enabled: bool = True
    lease_s: float = 10.0  # an announcement lives this long unless repeated (every lease_s / 3)
    peer_wait_s: float = 5.0  # a peer holds a read for a chunk it is loading at most this long
    seed_window_s: float = 1.0  # loaders that start this close to the first one split the version
    window_bytes: int = 64 << 20  # planned at a time, with the peers known then (the first ones from 4 MiB up)
    windows_in_flight: int = 2
    block_bytes: int = 1 << 20  # neighbouring chunks a peer is asked for together
    refresh_s: float = 0.3  # FindPeers at most this often per version while loading
    max_peers: int = MAX_PEERS_FOUND
    drop_s: float = 600.0  # a peer that served bad bytes is not asked again for this long

    def validate(self) -> SwarmOptions:
        if not PEER_LEASE_MIN_S <= self.lease_s <= PEER_LEASE_MAX_S:
            raise ConfigError(f"peer lease_s must be within {PEER_LEASE_MIN_S:g}..{PEER_LEASE_MAX_S:g} s, got {self.lease_s}")
        for name in ("peer_wait_s", "seed_window_s", "refresh_s", "drop_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"swarm {name} must be >= 0, got {getattr(self, name)}")
        if self.window_bytes < 1 << 20 or self.block_bytes < 4096 or self.windows_in_flight < 1:
            raise ConfigError("swarm window_bytes must be >= 1 MiB, block_bytes >= 4 KiB, windows_in_flight >= 1")
        if not 1 <= self.max_peers <= MAX_PEERS_FOUND:
            raise ConfigError(f"swarm max_peers must be within 1..{MAX_PEERS_FOUND}, got {self.max_peers}")
        return self


@dataclass
class SwarmCounters:
    """What the worker's /metrics shows of this process's reads from peers."""

    peer_bytes: int = 0  # stored bytes landed from peers
    peers_dropped: dict[str, int] = field(default_factory=dict)  # by reason


class Swarm:
    """One per process (per ClusterClient): announces this worker, finds peers, fetches with them."""

    def __init__(self, client: ClusterClient, *, worker_id: str | None = None,
                 options: SwarmOptions = SwarmOptions()) -> None:
        self.client = client
        self.options = options.validate()
        self.worker_id = worker_id or client.worker_id
        self.directory = PeerDirectory(client, self.worker_id, lease_s=self.options.lease_s)
        self.counters = SwarmCounters()
        self._lock = threading.Lock()
        self._views: dict[str, tuple[float, PeerView]] = {}
        self._dropped: dict[str, float] = {}  # worker id -> until (monotonic)
        self._started: dict[str, float] = {}  # manifest id -> when this process started loading it
        self._address = ""
        self._versions: Callable[[], Sequence[PeerVersion]] | None = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        client.engine.peer_report = self._bad_peer

    # ------------------------------------------------------------ being a peer

    def serve_at(self, address: str, versions: Callable[[], Sequence[PeerVersion]]) -> None:
        """Announce this process at ``address`` (its peer port) with what ``versions()`` says it holds."""
        with self._lock:
            self._address, self._versions = address, versions
            start = self._thread is None
            if start:
                self._thread = threading.Thread(target=self._announce_loop, name="peer-announce", daemon=True)
        if start:
            assert self._thread is not None
            self._thread.start()
        self.announce_now()

    def announce_now(self) -> None:
        self._wake.set()

    def _announce_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.options.lease_s / 3)
            self._wake.clear()
            if self._closed.is_set():
                return
            self._announce()

    def _announce(self, leaving: bool = False) -> None:
        with self._lock:
            address, versions = self._address, self._versions
        if not address or versions is None:
            return
        try:
            if not self.directory.announce(address, list(versions()), leaving=leaving):
                log.debug("no server took the peer announce; the next one tries again")
        except Exception as exc:  # noqa: BLE001 - soft state: the next announce tries again
            log.debug("peer announce failed: %s", exc)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._announce(leaving=True)
        self.directory.close()

    # ------------------------------------------------------------ reading from peers

    def _bad_peer(self, peer: str, ids: tuple[str, ...], reason: str) -> None:
        worker = peer.removeprefix(PEER_PREFIX)
        with self._lock:
            first = worker not in self._dropped
            self._dropped[worker] = time.monotonic() + self.options.drop_s
            if first:
                self.counters.peers_dropped["corrupt"] = self.counters.peers_dropped.get("corrupt", 0) + 1
        if first:
            log.warning("peer %s served bytes that failed verification (%s, chunk %s): not asked again for %g s",
                        worker, reason[:200], ids[0][:16] if ids else "?", self.options.drop_s)

    def _view(self, manifest_id: str) -> tuple[list[PeerEntry], int | None]:
        """The peers of ``manifest_id`` this process may ask (FindPeers at most every ``refresh_s``; dropped
        and unreachable ones left out), and this worker's rank in the swarm."""
        now = time.monotonic()
        with self._lock:
            cached = self._views.get(manifest_id)
        if cached is None or now - cached[0] >= self.options.refresh_s:
            try:
                found = self.directory.find(manifest_id, self.options.max_peers)
            except Exception as exc:  # noqa: BLE001 - no view: the servers serve everything
                log.debug("FindPeers failed: %s", exc)
                found = cached[1] if cached else PeerView([])
            with self._lock:
                self._views[manifest_id] = (now, found)
            cached = (now, found)
        mine = self.directory.host_id
        with self._lock:
            dropped = {w for w, until in self._dropped.items() if until > now}
        view = cached[1]
        return [p for p in view.peers if p.worker_id not in dropped and _reachable(p, mine)], view.rank

    def _rows_per_block(self, table: ChunkTable) -> int:
        """Manifest rows per block: from the version's largest chunk, so every worker cuts the same blocks."""
        biggest = int(table.raw_size.max()) if len(table.raw_size) else 1
        return max(1, self.options.block_bytes // max(1, biggest))

    def fetch(self, manifest_id: str, chunks: ChunkRows, sink: ChunkSink, *, algorithm: str = "blake3",
              tensors_of: Callable[[int], Sequence[str]] | None = None) -> FetchStats:
        """Fetch ``chunks`` of version ``manifest_id`` into ``sink`` from peers and servers (see above)."""
        if not self.options.enabled:
            return self.client.fetch(chunks, sink, algorithm=algorithm, tensors_of=tensors_of)
        started = self._started_at(manifest_id)
        serving = bool(self._address)
        # A process that serves nobody never seeds: it reads from those that came before, as a late one.
        me = SwarmMember(self.worker_id, False, started if serving else float("inf"))
        salt = version_salt(manifest_id)
        table, rows = chunks.table, chunks.rows
        windows = self._windows(table, rows)
        rows_per_block = self._rows_per_block(table)
        total = FetchStats()

        def one(window: np.ndarray) -> FetchStats:
            def with_peers(wants: Wants) -> Wants:
                view, rank = self._view(manifest_id)
                members = [SwarmMember(p.worker_id, p.complete, p.started_at) for p in view]
                choice = choose_sources(me, members, window // rows_per_block, salt,
                                        seed_window_s=self.options.seed_window_s, rank=rank if serving else None)
                if not choice.peers:
                    return wants
                addresses = {PEER_PREFIX + p.worker_id: p.address for p in view}
                self.client.transport.peer_addresses.update({p: addresses[p] for p in choice.peers if p in addresses})
                return replace(wants, peers=choice.peers, peer_of=choice.peer_of)

            return self.client.fetch(ChunkRows(table, window), sink, algorithm=algorithm, tensors_of=tensors_of,
                                     with_peers=with_peers)

        pool = ThreadPoolExecutor(max_workers=self.options.windows_in_flight, thread_name_prefix="swarm-window")
        futures = [pool.submit(one, w) for w in windows]
        try:
            for future in futures:
                total.add(future.result())
        finally:
            for future in futures:  # after a failure: windows not started are not
                future.cancel()
            pool.shutdown(wait=True)
            with self._lock:
                self.counters.peer_bytes += total.peer_bytes
        return total

    def _windows(self, table: ChunkTable, rows: np.ndarray) -> list[np.ndarray]:
        """``rows`` cut in fetch order into windows that grow from a sixteenth of ``window_bytes`` to it: the
        first ones are planned before this worker may know of the others that start with it, so they
        are small (what the servers may send twice), the later ones large (fewer plans, fewer stalls)."""
        if not len(rows):
            return []
        ends = np.cumsum(table.stored_size[rows])
        size = max(4 << 20, self.options.window_bytes // 16)
        marks: list[int] = []
        at = size
        while at < int(ends[-1]):
            marks.append(at)
            size = min(self.options.window_bytes, size * 2)
            at += size
        return [w for w in np.split(rows, np.searchsorted(ends, np.array(marks, dtype=np.int64), side="right")) if len(w)]

    def _started_at(self, manifest_id: str) -> float:
        with self._lock:
            versions = self._versions
        if versions is not None:
            try:
                for v in versions():
                    if v.manifest_id == manifest_id and not v.complete:
                        return v.started_at
            except Exception:  # noqa: BLE001 - the worker's list is advisory here
                pass
        with self._lock:
            return self._started.setdefault(manifest_id, time.time())


def _reachable(peer: PeerEntry, my_host: str) -> bool:
    """A peer that announced a loopback address is reachable only from its own machine."""
    try:
        host, _ = split_host_port(peer.address)
    except ValueError:
        return False
    return not is_loopback_host(host) or peer.host_id == my_host


__all__ = ["Swarm", "SwarmCounters", "SwarmOptions"]
