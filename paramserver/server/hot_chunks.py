"""Hot chunks: extra copies of often-read chunks on servers beyond their R ring replicas.

Each server keeps a decayed read rate per chunk it serves (:class:`RateTracker`, bounded). A chunk
this server holds as a ring replica whose rate passes ``hot_rate`` becomes hot
(:class:`HotPolicy`: hysteresis, a chunk cools only after its rate stayed below ``cool_rate`` for
``cool_s``; at most ``max_hot_chunks`` / ``max_hot_bytes`` hot at once). For each hot chunk the
server makes sure the next ``extra_copies`` servers on the ring after its R replicas hold a copy:
HasChunks(renew_hot) renews the copies there, PutChunks(hot_copy) sends the missing ones, the
normal ingest path (CRC32C and BLAKE3 checked by the receiver). It advertises the copies it
confirmed through GetHotChunks; clients add those holders as candidates for that chunk and
spread their reads over them (``paramserver.client.fetch_plan``).

Soft state, never in Raft. The receiver keeps a copy it did not hold before as an *extra*
(:class:`ExtraCopies`: bounded in count and bytes; leased): when no replica renews it for
``lease_s`` (the chunk cooled, or its replicas went away) it is deleted, unless this server has
become one of the chunk's ring replicas meanwhile, or the chunk was written or claimed since it
arrived (a push or a commit check relies on it). Extras never count as replicas: the commit
check, the push and re-replication only ever count the ring replicas, so an extra can never
make an under-replicated chunk look safe; orphan collection treats an extra like any other
stored chunk. A chunk this server already held, or holds as a ring replica, is never registered
as an extra, so the hot path never deletes a copy the cluster relies on. The extras are listed
in ``DATA_DIR/hot_extras.json`` (written on change, no fsync: losing it only keeps copies longer),
so a restart still drops them once their fresh lease ends.

The pure parts (tracker, policy, registry) take an injected clock and are unit-tested without
sockets (tests/unit/test_hot_chunks.py); :class:`HotChunks` wires them to the store and peers.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from paramserver.server.errors import ConfigError, ParamServerError
from paramserver.wire.limits import MAX_HOT_CHUNKS_ADVERTISED, MiB
from paramserver.wire.proto import pb

if TYPE_CHECKING:
    from paramserver.server.cluster import PeerSet
    from paramserver.server.store import ChunkStore

log = logging.getLogger(__name__)

STATE_FILE = "hot_extras.json"
_ON = {"on", "true", "yes", "1"}
_OFF = {"off", "false", "no", "0"}


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class HotConfig:
    """Hot-chunk settings (config file keys ``hot_*``; see ``from_extra``)."""

    enabled: bool = True
    interval_s: float = 1.0  # how often the hot set is recomputed and extras pushed, renewed, dropped
    tau_s: float = 10.0  # time constant of the decayed read rate
    hot_rate: float = 2.0  # reads/s on this server (decayed) that make a chunk hot
    cool_rate: float | None = None  # a hot chunk cools below this (default hot_rate / 4) ...
    cool_s: float = 30.0  # ... held for this long
    extra_copies: int = 2  # extra holders per hot chunk, beyond its R replicas (capped by the cluster)
    max_hot_chunks: int = 1024  # hot chunks this server places extras for
    max_hot_bytes: int = 256 * MiB
    max_extra_chunks: int = 1024  # extra copies this server holds for the others
    max_extra_bytes: int = 256 * MiB
    lease_s: float = 30.0  # an extra copy no replica renewed for this long is dropped
    max_tracked: int = 65536  # chunks whose read rate is tracked
    push_bytes_per_step: int = 64 * MiB  # extra-copy bytes one step sends at most

    @property
    def cool(self) -> float:
        return self.hot_rate / 4 if self.cool_rate is None else self.cool_rate

    def validate(self) -> HotConfig:
        for name in ("interval_s", "tau_s", "hot_rate", "cool_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"hot_{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.cool <= self.hot_rate:
            raise ConfigError(f"hot_cool_rate must be > 0 and at most hot_rate ({self.hot_rate}), got {self.cool}")
        if not 1 <= self.extra_copies <= 16:
            raise ConfigError(f"hot_extra_copies must be between 1 and 16, got {self.extra_copies}")
        if not 1 <= self.max_hot_chunks <= MAX_HOT_CHUNKS_ADVERTISED:
            raise ConfigError(f"hot_max_chunks must be between 1 and {MAX_HOT_CHUNKS_ADVERTISED}, got {self.max_hot_chunks}")
        for name in ("max_hot_bytes", "max_extra_bytes", "push_bytes_per_step"):
            if getattr(self, name) < MiB:
                raise ConfigError(f"hot_{name} must be at least 1 MiB, got {getattr(self, name)}")
        if self.max_extra_chunks < 1 or self.max_tracked < 16:
            raise ConfigError("hot_max_extra_chunks must be >= 1 and hot_max_tracked >= 16")
        if self.lease_s <= self.interval_s:
            raise ConfigError(f"hot_lease_s ({self.lease_s}) must be longer than hot_interval_s ({self.interval_s}): "
                              "a replica renews each copy once per interval")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> HotConfig:
        """From a server config's extra keys: ``hot_chunks`` (on/off), ``hot_interval_s``, ``hot_tau_s``,
        ``hot_rate``, ``hot_cool_rate``, ``hot_cool_s``, ``hot_extra_copies``, ``hot_max_chunks``,
        ``hot_max_bytes``, ``hot_max_extra_chunks``, ``hot_max_extra_bytes``, ``hot_lease_s``,
        ``hot_max_tracked``, ``hot_push_bytes_per_step``."""
        values: dict[str, Any] = {}
        switch = extra.get("hot_chunks")
        if switch is not None:
            text = str(switch).lower()
            if isinstance(switch, bool):
                values["enabled"] = switch
            elif text in _ON | _OFF:
                values["enabled"] = text in _ON
            else:
                raise ConfigError(f"hot_chunks must be on or off, got {switch!r}")
        for name, key in _KEYS.items():
            value = extra.get(key)
            if value is None:
                continue
            integer = name not in _FLOATS
            if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
                raise ConfigError(f"{key} must be {'an integer' if integer else 'a number'}, got {value!r}")
            values[name] = value if integer else float(value)
        return cls(**values).validate()


_FLOATS = ("interval_s", "tau_s", "hot_rate", "cool_rate", "cool_s", "lease_s")
_KEYS = {  # HotConfig field -> config file key
    "interval_s": "hot_interval_s", "tau_s": "hot_tau_s", "hot_rate": "hot_rate", "cool_rate": "hot_cool_rate",
    "cool_s": "hot_cool_s", "lease_s": "hot_lease_s", "extra_copies": "hot_extra_copies", "max_hot_chunks": "hot_max_chunks",
    "max_hot_bytes": "hot_max_bytes", "max_extra_chunks": "hot_max_extra_chunks", "max_extra_bytes": "hot_max_extra_bytes",
    "max_tracked": "hot_max_tracked", "push_bytes_per_step": "hot_push_bytes_per_step",
}
CONFIG_KEYS = ("hot_chunks", *_KEYS.values())  # a server config's keys for hot chunks


# --------------------------------------------------------------------------- pure parts


class RateTracker:
    """Decayed read counts per chunk: each read adds 1, the count decays as exp(-t / tau).

    ``rate()`` is the count over tau, in reads per second (a steady rate converges to it). At most
    ``max_entries`` chunks are tracked: past that, the coldest half is forgotten (amortised O(1)
    per read). Thread-safe; the clock is injected."""

    def __init__(self, tau_s: float, max_entries: int = 65536, clock: Callable[[], float] = time.monotonic) -> None:
        if tau_s <= 0 or max_entries < 2:
            raise ValueError("tau_s must be > 0 and max_entries >= 2")
        self.tau_s = tau_s
        self.max_entries = max_entries
        self.clock = clock
        self._counts: dict[str, tuple[float, float]] = {}  # id -> (count, at)
        self._lock = threading.Lock()
        self.reads = 0
        self.evicted = 0

    def record(self, chunk_id: str, reads: int = 1) -> None:
        now = self.clock()
        with self._lock:
            self.reads += reads
            found = self._counts.get(chunk_id)
            count = reads if found is None else found[0] * math.exp(-(now - found[1]) / self.tau_s) + reads
            self._counts[chunk_id] = (count, now)
            if found is None and len(self._counts) > self.max_entries:
                self._evict_locked(now)

    def _evict_locked(self, now: float) -> None:
        decayed = sorted(((c * math.exp(-(now - at) / self.tau_s), cid) for cid, (c, at) in self._counts.items()), reverse=True)
        keep = decayed[: self.max_entries // 2]
        self.evicted += len(decayed) - len(keep)
        self._counts = {cid: (c, now) for c, cid in keep}

    def rate(self, chunk_id: str) -> float:
        now = self.clock()
        with self._lock:
            found = self._counts.get(chunk_id)
        if found is None:
            return 0.0
        return found[0] * math.exp(-(now - found[1]) / self.tau_s) / self.tau_s

    def rates(self, min_rate: float = 0.0) -> dict[str, float]:
        """Every tracked chunk's rate of at least ``min_rate``; forgets those that decayed to nothing."""
        now = self.clock()
        out: dict[str, float] = {}
        floor = min(min_rate, 1e-3) * self.tau_s
        with self._lock:
            dead = []
            for cid, (count, at) in self._counts.items():
                c = count * math.exp(-(now - at) / self.tau_s)
                if c < floor:
                    dead.append(cid)
                r = c / self.tau_s
                if r >= min_rate:
                    out[cid] = r
            for cid in dead:
                del self._counts[cid]
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)


@dataclass
class _Hot:
    size: int
    since: float
    below_since: float | None = None


@dataclass(frozen=True)
class HotUpdate:
    added: tuple[str, ...]
    cooled: tuple[str, ...]


class HotPolicy:
    """Which chunks are hot, from their rates. Pure: the caller passes the rates and the clock.

    A chunk becomes hot at ``hot_rate`` if the bounds allow (``max_chunks`` and ``max_bytes``,
    hottest first; a hot chunk is not displaced by a hotter one), and cools once its rate stayed
    below ``cool_rate`` for ``cool_s`` -- or at once when ``owned`` says this server no longer
    holds it as a ring replica."""

    def __init__(self, hot_rate: float, cool_rate: float, cool_s: float, *, max_chunks: int, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < cool_rate <= hot_rate:
            raise ValueError("need 0 < cool_rate <= hot_rate")
        self.hot_rate, self.cool_rate, self.cool_s = hot_rate, cool_rate, cool_s
        self.max_chunks, self.max_bytes = max_chunks, max_bytes
        self.clock = clock
        self._hot: dict[str, _Hot] = {}
        self._bytes = 0

    @property
    def hot(self) -> dict[str, int]:
        """Hot chunk id -> its stored size."""
        return {cid: h.size for cid, h in self._hot.items()}

    @property
    def hot_bytes(self) -> int:
        return self._bytes

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._hot

    def update(self, rates: Mapping[str, float], size_of: Callable[[str], int | None],
               owned: Callable[[str], bool] = lambda _cid: True) -> HotUpdate:
        """``rates``: chunk id -> reads/s (missing: 0); ``size_of``: stored size, None when not held here."""
        now = self.clock()
        cooled: list[str] = []
        for cid, h in list(self._hot.items()):
            if not owned(cid):
                cooled.append(cid)
                continue
            if rates.get(cid, 0.0) >= self.cool_rate:
                h.below_since = None
            elif h.below_since is None:
                h.below_since = now
            elif now - h.below_since >= self.cool_s:
                cooled.append(cid)
        for cid in cooled:
            self._bytes -= self._hot.pop(cid).size
        added: list[str] = []
        for cid, rate in sorted(rates.items(), key=lambda kv: (-kv[1], kv[0])):
            if rate < self.hot_rate:
                break
            if cid in self._hot or len(self._hot) >= self.max_chunks or not owned(cid):
                continue
            size = size_of(cid)
            if size is None or self._bytes + size > self.max_bytes:
                continue
            self._hot[cid] = _Hot(size, now)
            self._bytes += size
            added.append(cid)
        return HotUpdate(tuple(added), tuple(cooled))


@dataclass
class _Extra:
    size: int
    expires: float
    baseline: float | None  # the store's claim time of the copy when it arrived (None: reserved, not stored yet)


class ExtraCopies:
    """The extra copies this server holds for hot chunks of others: bounded, leased. Pure (clock injected)."""

    def __init__(self, max_chunks: int, max_bytes: int, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_chunks, self.max_bytes, self.lease_s = max_chunks, max_bytes, lease_s
        self.clock = clock
        self._items: dict[str, _Extra] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.changed = False  # set when the stored set changed (for the state file)

    def reserve(self, chunk_id: str, size: int) -> bool:
        """Room for a new extra copy of ``size`` bytes? Reserves it (``confirm`` or ``cancel`` next).
        An id already held as an extra is renewed and answers True."""
        with self._lock:
            found = self._items.get(chunk_id)
            if found is not None:
                found.expires = self.clock() + self.lease_s
                return True
            if len(self._items) >= self.max_chunks or self._bytes + size > self.max_bytes:
                return False
            self._items[chunk_id] = _Extra(size, self.clock() + self.lease_s, None)
            self._bytes += size
            return True

    def confirm(self, chunk_id: str, baseline: float) -> None:
        with self._lock:
            found = self._items.get(chunk_id)
            if found is not None and found.baseline is None:
                found.baseline = baseline
                self.changed = True

    def cancel(self, chunk_id: str) -> None:
        """Drop a reservation that was not stored (the chunk was here already); a held extra stays."""
        with self._lock:
            found = self._items.get(chunk_id)
            if found is not None and found.baseline is None:
                del self._items[chunk_id]
                self._bytes -= found.size

    def renew(self, chunk_ids: Iterable[str]) -> int:
        now = self.clock()
        n = 0
        with self._lock:
            for cid in chunk_ids:
                found = self._items.get(cid)
                if found is not None:
                    found.expires = now + self.lease_s
                    n += 1
        return n

    def expired(self) -> list[tuple[str, float]]:
        """(id, baseline) of the stored extras whose lease ended."""
        now = self.clock()
        with self._lock:
            return [(cid, e.baseline) for cid, e in self._items.items() if e.baseline is not None and e.expires <= now]

    def forget(self, chunk_id: str) -> None:
        with self._lock:
            found = self._items.pop(chunk_id, None)
            if found is not None:
                self._bytes -= found.size
                self.changed = True

    def held(self) -> dict[str, int]:
        with self._lock:
            return {cid: e.size for cid, e in self._items.items() if e.baseline is not None}

    def __contains__(self, chunk_id: object) -> bool:
        with self._lock:
            found = self._items.get(chunk_id) if isinstance(chunk_id, str) else None
            return found is not None and found.baseline is not None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self._items.values() if e.baseline is not None)

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._items.values() if e.baseline is not None)

    # state file: {"extras": {id: size}} -- baselines and leases are taken afresh on load
    def dump(self) -> bytes:
        return json.dumps({"extras": self.held()}, sort_keys=True).encode()

    def load(self, raw: bytes, baseline_of: Callable[[str], float | None]) -> int:
        """Re-register the extras listed in ``raw`` that are still stored (fresh lease); returns how many."""
        try:
            listed = json.loads(raw).get("extras", {})
        except (ValueError, AttributeError):
            return 0
        n = 0
        for cid, size in listed.items() if isinstance(listed, dict) else ():
            if not isinstance(cid, str) or not isinstance(size, int):
                continue
            baseline = baseline_of(cid)
            if baseline is not None and self.reserve(cid, size):
                self.confirm(cid, baseline)
                n += 1
        return n


# --------------------------------------------------------------------------- wiring


@dataclass
class HotReport:
    hot: int = 0
    added: int = 0
    cooled: int = 0
    pushed: int = 0
    pushed_bytes: int = 0
    renewed: int = 0
    dropped: int = 0
    unreachable: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class HotStats:
    hot_chunks: int
    hot_bytes: int
    advertised: int
    extra_chunks: int
    extra_bytes: int
    tracked: int
    pushed_total: int
    pushed_bytes_total: int
    dropped_total: int
    refused_total: int


class HotChunks:
    """One server's hot-chunk state: the read-rate tracker (fed by GetChunks and the bulk port),
    the hot set it places extras for (``step``, every ``interval_s``), and the extras it holds."""

    ADMIT, PLAIN = "extra", "plain"

    def __init__(self, config: HotConfig, store: ChunkStore, peers: PeerSet | None, *,
                 clock: Callable[[], float] = time.monotonic, state_path: Path | None = None) -> None:
        self.config = config.validate()
        self.store = store
        self.peers = peers
        self.clock = clock
        self.tracker = RateTracker(config.tau_s, config.max_tracked, clock)
        self.policy = HotPolicy(config.hot_rate, config.cool, config.cool_s, max_chunks=config.max_hot_chunks,
                                max_bytes=config.max_hot_bytes, clock=clock)
        self.extras = ExtraCopies(config.max_extra_chunks, config.max_extra_bytes, config.lease_s, clock)
        self.state_path = state_path
        self._advertised: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()
        # False while R covers every member (no server could take an extra copy): reads are not tracked then.
        self._active = True
        self.pushed_total = self.pushed_bytes_total = self.dropped_total = self.refused_total = 0
        if state_path is not None and state_path.exists():
            try:
                n = self.extras.load(state_path.read_bytes(), store.claimed_at)
            except OSError as exc:
                log.warning("hot chunks: cannot read %s (%s); its extra copies stay as ordinary chunks", state_path, exc)
            else:
                if n:
                    log.info("hot chunks: %d extra copies from before the restart, dropped when their lease ends", n)
            self.extras.changed = False

    # ------------------------------------------------------------ placement

    def _ring_replicas(self, chunk_id: str) -> tuple[list[str], list[str]]:
        """(the chunk's ring replicas, its extra holders in ring order) under the current members."""
        if self.peers is None:
            return [], []
        ring = self.peers.ring()
        n = len(ring)
        r = min(self.peers.replication_factor, n)
        order = ring.replicas(chunk_id, min(n, r + self.config.extra_copies)) if n else []
        return order[:r], order[r:]

    def is_replica(self, chunk_id: str) -> bool:
        return self.peers is not None and self.peers.self_id in self._ring_replicas(chunk_id)[0]

    # ------------------------------------------------------------ the read path (hot)

    def record_read(self, chunk_id: str) -> None:
        if self._active:
            self.tracker.record(chunk_id)

    # ------------------------------------------------------------ as an extra holder

    def admit(self, chunk_id: str, size: int) -> str | None:
        """What to do with a hot copy sent here: ADMIT (store as an extra), PLAIN (store as an ordinary
        chunk: this server is one of its ring replicas, or holds it already), or the reason it is refused."""
        if self.is_replica(chunk_id) or (self.store.has(chunk_id) and chunk_id not in self.extras):
            return self.PLAIN
        if self.extras.reserve(chunk_id, size):
            return self.ADMIT
        self.refused_total += 1
        return (f"extra-copy bounds reached ({self.config.max_extra_chunks} chunks, {self.config.max_extra_bytes} bytes "
                "of hot copies for other servers)")

    def stored(self, chunk_id: str, was_stored: bool) -> None:
        """An admitted hot copy went through the store: ``was_stored`` False when it was here already."""
        if not was_stored:
            self.extras.cancel(chunk_id)
            return
        baseline = self.store.claimed_at(chunk_id)
        if baseline is None:
            self.extras.cancel(chunk_id)
        else:
            self.extras.confirm(chunk_id, baseline)

    def renew(self, chunk_ids: Iterable[str]) -> int:
        return self.extras.renew(chunk_ids)

    # ------------------------------------------------------------ advertisement

    def advertised(self) -> list[tuple[str, tuple[str, ...]]]:
        with self._lock:
            return list(self._advertised.items())[:MAX_HOT_CHUNKS_ADVERTISED]

    def reply(self, server_id: str) -> pb.GetHotChunksReply:
        reply = pb.GetHotChunksReply(server_id=server_id)
        for cid, holders in self.advertised():
            reply.chunks.add(id=cid, holders=list(holders))
        return reply

    def stats(self) -> HotStats:
        with self._lock:
            advertised = len(self._advertised)
        return HotStats(len(self.policy.hot), self.policy.hot_bytes, advertised, len(self.extras), self.extras.nbytes,
                        len(self.tracker), self.pushed_total, self.pushed_bytes_total, self.dropped_total, self.refused_total)

    # ------------------------------------------------------------ the periodic step

    def step(self) -> HotReport:
        report = HotReport()
        self._drop_expired(report)
        if self.peers is None:
            return report
        members = self.peers.members()
        up = {sid for sid, m in members.items() if m.state == "up"}
        if len(up) <= min(self.peers.replication_factor, len(up)):
            # Every server is a replica of every chunk: there is nowhere to put an extra copy.
            self._active = False
            self.policy.update({}, lambda _cid: None, lambda _cid: False)
            self.tracker.rates(float("inf"))  # forgets what decayed
            with self._lock:
                self._advertised = {}
            return report
        self._active = True
        placement: dict[str, tuple[list[str], list[str]]] = {}

        def where(cid: str) -> tuple[list[str], list[str]]:
            found = placement.get(cid)
            if found is None:
                found = placement[cid] = self._ring_replicas(cid)
            return found

        def owned(cid: str) -> bool:
            return self.peers is not None and self.peers.self_id in where(cid)[0]

        update = self.policy.update(self.tracker.rates(self.config.cool), self.store.stored_size, owned)
        report.added, report.cooled = len(update.added), len(update.cooled)
        hot = self.policy.hot
        report.hot = len(hot)
        for cid in update.added:
            log.info("hot chunk %s: %.2f reads/s here; placing extra copies on %s", cid, self.tracker.rate(cid),
                     ", ".join(where(cid)[1]) or "(no other server)")
        for cid in update.cooled:
            log.info("hot chunk %s cooled: no longer advertised; its extra copies expire in %.0f s", cid, self.config.lease_s)
        by_target: dict[str, list[str]] = {}
        for cid in hot:
            for target in where(cid)[1]:
                if target in up and target != self.peers.self_id:
                    by_target.setdefault(target, []).append(cid)
        holders: dict[str, list[str]] = {}
        budget = self.config.push_bytes_per_step
        for target, ids in sorted(by_target.items()):
            confirmed, budget = self._ensure(members[target], target, ids, hot, budget, report)
            for cid in confirmed:
                holders.setdefault(cid, []).append(target)
        with self._lock:
            self._advertised = {cid: tuple(holders[cid]) for cid in hot if cid in holders}
        self.pushed_total += report.pushed
        self.pushed_bytes_total += report.pushed_bytes
        return report

    def _ensure(self, member: Any, target: str, ids: list[str], sizes: Mapping[str, int], budget: int,
                report: HotReport) -> tuple[list[str], int]:
        """Make ``target`` hold (and renew) its extra copies of ``ids``; returns (the ids it holds, budget left)."""
        assert self.peers is not None
        client = self.peers.client(member)
        try:
            reply = client.stub.HasChunks(pb.HasChunksRequest(ids=ids, renew_hot=True), timeout=self.peers.timeout_s)
            present = list(reply.present)
            held = [cid for cid, ok in zip(ids, present) if ok]
            report.renewed += len(held)
            missing = [cid for cid, ok in zip(ids, present) if not ok]
            send: list[pb.Chunk] = []
            for cid in missing:
                if budget < sizes.get(cid, 0):
                    break
                try:
                    c = self.store.get(cid)
                except ParamServerError:
                    continue  # gone or corrupt here: the repair queue owns it
                budget -= len(c.data)
                send.append(pb.Chunk(id=c.id, data=c.data, codec=c.codec, raw_size=c.raw_size, crc32c=c.crc32c))
            if send:
                put = client.stub.PutChunks(_hot_messages(send), timeout=self.peers.timeout_s * 3)
                for ack in put.acks:
                    if ack.status in (pb.STORED, pb.ALREADY_PRESENT):
                        held.append(ack.id)
                        if ack.status == pb.STORED:
                            report.pushed += 1
                            report.pushed_bytes += sizes.get(ack.id, 0)
        except grpc.RpcError as exc:
            report.unreachable.append(target)
            log.debug("hot copies to %s skipped: %s", target, exc.code() if hasattr(exc, "code") else exc)
            return [], budget
        return held, budget

    def _drop_expired(self, report: HotReport) -> None:
        for cid, baseline in self.extras.expired():
            if self.is_replica(cid):
                self.extras.forget(cid)  # a ring copy now (membership changed): the cluster relies on it
                continue
            try:
                # Only if it was neither written nor claimed since it arrived as a hot copy.
                deleted = self.store.delete_if_unclaimed(cid, baseline + 1e-6)
            except (ParamServerError, OSError) as exc:
                log.warning("hot chunks: cannot drop the extra copy of %s yet: %s", cid, exc)
                continue
            self.extras.forget(cid)
            if deleted:
                report.dropped += 1
        self.dropped_total += report.dropped
        if report.dropped:
            log.info("hot chunks: dropped %d extra copies that cooled", report.dropped)
        self._save()

    def _save(self) -> None:
        if self.state_path is None or not self.extras.changed:
            return
        self.extras.changed = False
        tmp = self.state_path.with_suffix(".tmp")
        try:
            tmp.write_bytes(self.extras.dump())
            os.replace(tmp, self.state_path)
        except OSError as exc:
            log.warning("hot chunks: cannot write %s (%s); extra copies stay until their lease ends", self.state_path, exc)


def _hot_messages(chunks: list[pb.Chunk], batch_bytes: int = 4 * MiB) -> Iterable[pb.PutChunksRequest]:
    batch: list[pb.Chunk] = []
    size = 0
    for c in chunks:
        if batch and size + len(c.data) > batch_bytes:
            yield pb.PutChunksRequest(chunks=batch, hot_copy=True)
            batch, size = [], 0
        batch.append(c)
        size += len(c.data)
    if batch:
        yield pb.PutChunksRequest(chunks=batch, hot_copy=True)


__all__ = [
    "CONFIG_KEYS", "ExtraCopies", "HotChunks", "HotConfig", "HotPolicy", "HotReport", "HotStats", "HotUpdate", "RateTracker",
    "STATE_FILE",
]
