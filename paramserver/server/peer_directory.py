"""Worker peers: the soft-state table a server keeps of who holds or loads which version.

Pure policy, no I/O and no locks: every method takes ``now`` (a monotonic clock, seconds) and
``find`` takes the random source, so the unit tests drive it with a fake clock and a seeded
``random.Random``. ``paramserver.server.peer_service`` puts it behind AnnouncePeer / FindPeers,
with a lock and input checks.

Why soft state with a lease: a worker that dies says nothing, and an entry that outlived its
worker would send loads to a dead address. Each announce replaces what this table keeps of the
worker (the versions it lists are those this server owns on the ring) and lives ``lease_s``; the
worker announces again well before that. Nothing is written to Raft or disk: a restarted server
learns its entries back within one announce period.

Bounded memory, whatever the announces: at most ``max_versions`` versions per worker (an announce
with more is refused), ``max_per_version`` workers per version and ``max_workers`` workers in all;
past a bound the least recently announced entry goes first (it is the likeliest to be gone, and a
live one is back at its next announce). The expiry heap is rebuilt when stale items outnumber
the live workers, so a flood of announces cannot grow it either.
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, Sequence, TypeVar

from paramserver.wire.limits import (
    MAX_PEER_VERSIONS, MAX_PEER_WORKERS, MAX_PEERS_FOUND, MAX_PEERS_PER_VERSION, PEER_LEASE_MAX_S, PEER_LEASE_MIN_S, PEER_SEEDS,
)

DEFAULT_PEERS_FOUND = 32  # a FindPeers with limit 0
DEFAULT_LEASE_S = 10.0  # an announce with lease_s 0 (the client's default lease)

T = TypeVar("T")


class Sampler(Protocol):
    """What ``find`` needs of its random source (``random.Random`` has it)."""

    def sample(self, population: Sequence[T], k: int) -> list[T]: ...


@dataclass(frozen=True)
class Version:
    """A version an announce lists: its manifest id, whether the worker holds it whole, and when
    (the worker's wall clock) it started loading it."""

    manifest_id: str
    complete: bool
    started_at: float


@dataclass(frozen=True)
class Announcement:
    """An AnnouncePeer request's fields, already checked (peer_service.announcement)."""

    worker_id: str
    address: str = ""
    instance: str = ""
    host_id: str = ""
    versions: tuple[Version, ...] = ()
    lease_s: float = 0.0
    leaving: bool = False


@dataclass(frozen=True)
class PeerEntry:
    """One live entry of a version, as FindPeers names it."""

    worker_id: str
    address: str
    complete: bool
    started_at: float
    host_id: str
    lease_left_s: float


@dataclass(frozen=True)
class Limits:
    max_versions: int = MAX_PEER_VERSIONS
    max_per_version: int = MAX_PEERS_PER_VERSION
    max_workers: int = MAX_PEER_WORKERS
    max_found: int = MAX_PEERS_FOUND
    seeds: int = PEER_SEEDS
    lease_min_s: float = PEER_LEASE_MIN_S
    lease_max_s: float = PEER_LEASE_MAX_S
    default_found: int = DEFAULT_PEERS_FOUND
    default_lease_s: float = DEFAULT_LEASE_S

    def validate(self) -> Limits:
        for name in ("max_versions", "max_per_version", "max_workers", "max_found", "default_found"):
            if getattr(self, name) < 1:
                raise ValueError(f"peer directory {name} must be at least 1, got {getattr(self, name)}")
        if self.seeds < 0:
            raise ValueError(f"peer directory seeds must be >= 0, got {self.seeds}")
        if not 0 < self.lease_min_s <= self.lease_max_s:
            raise ValueError(f"peer leases need 0 < lease_min_s <= lease_max_s, got {self.lease_min_s} and {self.lease_max_s}")
        return self


class _Worker:
    __slots__ = ("worker_id", "instance", "address", "host_id", "versions", "expires_at")

    def __init__(self, a: Announcement, expires_at: float) -> None:
        self.worker_id = a.worker_id
        self.instance = a.instance
        self.address = a.address
        self.host_id = a.host_id
        self.versions: dict[str, Version] = {}
        self.expires_at = expires_at


class PeerDirectory:
    """The table. Not thread-safe: its caller holds a lock (peer_service.PeerService)."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits.validate()
        # Workers by last announce, oldest first (the first evicted when the table is full).
        self._workers: OrderedDict[str, _Worker] = OrderedDict()
        # Per version, its workers by last announce, oldest first.
        self._by_version: dict[str, OrderedDict[str, None]] = {}
        # Per version, its entries' (started_at, worker_id), sorted: a worker's rank in the version's
        # swarm, kept as entries come and go (a re-announce removes and inserts one key: O(n) moves).
        self._order: dict[str, list[tuple[float, str]]] = {}
        self._expiry: list[tuple[float, str]] = []  # (expires_at, worker_id); stale items skipped when popped
        self._entries = 0  # (worker, version) pairs kept
        self.evicted = 0  # entries dropped for a bound (not for expiry)
        self.expired = 0  # workers dropped when their lease ran out

    # ------------------------------------------------------------ announce

    def lease_for(self, requested: float) -> float:
        """The lease the table applies: the default for 0, else clamped to the limits."""
        if not math.isfinite(requested) or requested < 0:
            raise ValueError(f"lease_s must be a finite number of seconds >= 0, got {requested}")
        if requested == 0:
            requested = self.limits.default_lease_s
        return min(self.limits.lease_max_s, max(self.limits.lease_min_s, requested))

    def announce(self, a: Announcement, now: float) -> tuple[float, int]:
        """Replace what is kept of ``a.worker_id`` by ``a``; ``(lease applied, versions kept)``.

        ``leaving`` drops the worker (unless ``a.instance`` names another process than the one
        kept: a late goodbye of a restarted worker's old process must not drop the new one). An
        announce listing no versions drops it too: there is nothing to find it by."""
        if len(a.versions) > self.limits.max_versions:
            raise ValueError(f"an announce lists at most {self.limits.max_versions} versions, got {len(a.versions)}")
        seen: set[str] = set()
        for v in a.versions:
            if v.manifest_id in seen:
                raise ValueError(f"version {v.manifest_id} is listed twice; list each version once")
            seen.add(v.manifest_id)
        lease = self.lease_for(a.lease_s)
        self.expire(now)
        old = self._workers.get(a.worker_id)
        if a.leaving:
            if old is not None and (not a.instance or a.instance == old.instance):
                self._drop(old)
            return lease, 0
        if old is not None:
            self._drop(old)  # a new instance, or the same one: the announce replaces the entry whole
        if not a.versions:
            return lease, 0
        worker = _Worker(a, now + lease)
        self._workers[a.worker_id] = worker
        heapq.heappush(self._expiry, (worker.expires_at, a.worker_id))
        for v in a.versions:
            worker.versions[v.manifest_id] = v
            holders = self._by_version.setdefault(v.manifest_id, OrderedDict())
            holders[a.worker_id] = None
            bisect.insort(self._order.setdefault(v.manifest_id, []), (v.started_at, a.worker_id))
            self._entries += 1
            while len(holders) > self.limits.max_per_version:
                oldest, _ = holders.popitem(last=False)
                self._forget_version(self._workers[oldest], v.manifest_id, unlink=False)
                self.evicted += 1
        while len(self._workers) > self.limits.max_workers:
            _, oldest_worker = next(iter(self._workers.items()))
            self.evicted += len(oldest_worker.versions)
            self._drop(oldest_worker)
        self._compact()
        kept = self._workers.get(a.worker_id)
        return lease, len(kept.versions) if kept is not None else 0

    def _forget_version(self, worker: _Worker, manifest_id: str, *, unlink: bool = True) -> None:
        """Drop one version of ``worker`` (and the worker, when it was its last)."""
        version = worker.versions.pop(manifest_id, None)
        if version is None:
            return
        self._entries -= 1
        if unlink:
            self._unlink(manifest_id, worker.worker_id)
        elif not self._by_version.get(manifest_id):
            self._by_version.pop(manifest_id, None)
        self._unorder(manifest_id, version.started_at, worker.worker_id)
        if not worker.versions:
            self._workers.pop(worker.worker_id, None)

    def _unlink(self, manifest_id: str, worker_id: str) -> None:
        holders = self._by_version.get(manifest_id)
        if holders is None:
            return
        holders.pop(worker_id, None)
        if not holders:
            del self._by_version[manifest_id]

    def _unorder(self, manifest_id: str, started_at: float, worker_id: str) -> None:
        keys = self._order.get(manifest_id)
        if keys is None:
            return
        at = bisect.bisect_left(keys, (started_at, worker_id))
        if at < len(keys) and keys[at] == (started_at, worker_id):
            del keys[at]
        if not keys:
            del self._order[manifest_id]

    def _drop(self, worker: _Worker) -> None:
        for manifest_id, version in worker.versions.items():
            self._unlink(manifest_id, worker.worker_id)
            self._unorder(manifest_id, version.started_at, worker.worker_id)
        self._entries -= len(worker.versions)
        worker.versions.clear()
        self._workers.pop(worker.worker_id, None)

    # ------------------------------------------------------------ expiry

    def expire(self, now: float) -> int:
        """Drop every worker whose lease ran out by ``now``; how many were dropped."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, worker_id = heapq.heappop(self._expiry)
            worker = self._workers.get(worker_id)
            if worker is not None and worker.expires_at == expires_at:  # else a stale item: announced again since
                self._drop(worker)
                dropped += 1
        self.expired += dropped
        return dropped

    def _compact(self) -> None:
        """Rebuild the heap from the live workers once stale items outnumber them: each announce
        pushes an item, so without this a fast announcer would grow it for up to a lease."""
        if len(self._expiry) > 2 * len(self._workers) + 64:
            self._expiry = [(w.expires_at, w.worker_id) for w in self._workers.values()]
            heapq.heapify(self._expiry)

    # ------------------------------------------------------------ find

    def find(self, manifest_id: str, limit: int, exclude_worker: str, now: float, rng: Sampler) -> list[PeerEntry]:
        """Live entries of ``manifest_id``, at most ``limit`` (0: the default) and never more than
        ``max_found``, never ``exclude_worker`` (the asker):

        - first the ``seeds`` earliest (by started_at, then worker id; holders and loaders alike: a
          holder is a loader that finished), so every worker of a swarm knows the same seeds;
        - then, when the asker has an entry of the version (it announced it), a sample of those that
          rank between the seeds plus half the asker's rank past them, and the asker: the ones a
          late loader reads from (paramserver.client.swarm_plan), so each worker is asked by about
          as many as it asks and the chain from the seeds stays about log2(N) deep;
        - then a sample of the others (when the asker has an entry: of those after it), to fill ``limit``."""
        self.expire(now)
        want = min(limit or self.limits.default_found, self.limits.max_found)
        keys = self._order.get(manifest_id)
        if not keys or want <= 0:
            return []
        n_seeds = min(self.limits.seeds, want)
        seeds = [k for k in keys[: n_seeds + 1] if k[1] != exclude_worker][:n_seeds]
        chosen = {k[1] for k in seeds}
        picked = list(seeds)
        asker = self._workers.get(exclude_worker)
        mine = asker.versions.get(manifest_id) if asker is not None else None
        rest = keys
        if mine is not None:
            rank = bisect.bisect_left(keys, (mine.started_at, exclude_worker))
            lo = len(seeds) + max(0, rank - len(seeds)) // 2
            parents = [k for k in keys[lo:rank] if k[1] not in chosen]
            picked += rng.sample(parents, min(len(parents), want - len(picked)))
            chosen.update(k[1] for k in picked)
            rest = keys[rank + 1:]  # never more of the early ones than the rule gives: they would be asked by all
        if len(picked) < want:
            others = [k for k in rest if k[1] not in chosen and k[1] != exclude_worker]
            picked += rng.sample(others, min(len(others), want - len(picked)))
        return [self._entry(self._workers[k[1]], manifest_id, now) for k in picked]

    def rank(self, manifest_id: str, worker_id: str) -> int | None:
        """``worker_id``'s rank among the entries of ``manifest_id`` (0: the earliest), None without one."""
        worker = self._workers.get(worker_id)
        mine = worker.versions.get(manifest_id) if worker is not None else None
        if mine is None:
            return None
        return bisect.bisect_left(self._order.get(manifest_id, []), (mine.started_at, worker_id))

    def _entry(self, w: _Worker, manifest_id: str, now: float) -> PeerEntry:
        v = w.versions[manifest_id]
        return PeerEntry(w.worker_id, w.address, v.complete, v.started_at, w.host_id, max(0.0, w.expires_at - now))

    def known(self, manifest_id: str, now: float) -> int:
        """Live entries of ``manifest_id``."""
        self.expire(now)
        return len(self._by_version.get(manifest_id, ()))

    # ------------------------------------------------------------ size

    def entries(self) -> int:
        """(worker, version) entries kept (expired ones stay counted until the next expire)."""
        return self._entries

    def workers(self) -> int:
        return len(self._workers)

    def versions(self) -> int:
        return len(self._by_version)


__all__ = ["DEFAULT_LEASE_S", "DEFAULT_PEERS_FOUND", "Announcement", "Limits", "PeerDirectory", "PeerEntry", "Sampler", "Version"]
