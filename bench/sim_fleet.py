"""A fleet cold-starting one version, simulated: the REAL fetch planner and swarm policy, no sockets.

    python bench/sim_fleet.py --workers 1000 --model-gb 140 --link-gbit 100 --servers 3 [--no-peers]
        [--join-spread-s S] [--fail FRACTION] [--unit-mb N] [--seed N] [--variant]
    python bench/sim_fleet.py --table          the standard grid as a markdown table (docs/benchmarks.md)

Real: a worker's load is windows of ``--window-units`` units, 2 in flight, each planned when it starts
as the worker's Swarm does: ``swarm_plan.choose_sources`` on the peers it knows then (a FindPeers
answer, refreshed every 0.3 s: the 8 earliest loaders, then a random sample, at most 64; peers that
failed it left out), then a ``fetch_plan.FetchPlanner`` with those peers and each unit's replicas on
a real ``Ring``; the simulation carries out its Reads and feeds it Landed / Refused / ReadFailed.

Modelled: each host's link, up and down; a server's egress also capped by its disk. Links are shared
max-min fairly (approximated by a few rounds of equal shares of what is left); rates hold between
events, so time jumps from one flow's end to the next. A read waits a round trip for its first byte.
A peer sends a unit it has at once; one it is receiving, as it lands (cut-through, one 4 MiB chunk
behind: a real peer serves each chunk once verified); one it has not started, it holds the read for
at most 5 s, then answers MISSING (Refused -> the servers). A worker that completes is a holder.
``--fail F`` kills a fraction F of the loading workers at ``fail_at`` x the ideal: reads from them
break (ReadFailed: the reader drops the peer, fails over); they stay in FindPeers answers until their
10 s lease runs out.

Units: a unit is a run of neighbouring chunks (``--unit-mb``; by default ~140 per model, printed)
planned, read and landed as one piece. Fair because the planner reads runs of neighbours from one
source anyway and the policy gives a block of neighbours one source; pessimistic because a window
of 6 units waits for its slowest before the next starts, and a rendezvous split of ~140 blocks is
lumpier than of thousands: coarse units add delay at every hop of the swarm.

Ideal: model bytes / one worker's link (no worker receives faster), plus a pipeline fill of one
round trip and one real 32 MiB window at the link's rate.
"""
from __future__ import annotations

import argparse
import functools
import heapq
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paramserver.client.fetch_plan import PEER_PREFIX, FetchPlanner, GiveUp, Landed, Read, ReadFailed, Refused, Wants
from paramserver.client import swarm_plan
from paramserver.client.swarm_plan import SwarmChoice, SwarmMember, choose_sources, rendezvous, version_salt
from paramserver.server.peer_directory import Announcement, Limits, PeerDirectory, Version
from paramserver.wire.limits import MAX_PEERS_FOUND, MAX_PEERS_PER_VERSION, PEER_SEEDS
from paramserver.wire.ring import Ring

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
MIB = 1 << 20
REAL_WINDOW = 32 * MIB  # the worker's fetch window (SwarmOptions.window_bytes): the ideal's pipeline fill
SIM_MANIFEST = "5a" * 32  # the version the fleet loads
SALT = version_salt(SIM_MANIFEST)
# worker_key is pure (FNV over the id); remembering it only saves the simulation time
swarm_plan.worker_key = functools.lru_cache(maxsize=1 << 16)(swarm_plan.worker_key)
Policy = Callable[..., SwarmChoice]  # choose_sources(me, view, blocks, salt, *, seed_window_s=...)


def variant_policy(me: SwarmMember, view: Sequence[SwarmMember], blocks: np.ndarray, salt: int, *, seed_window_s: float,
                   pool_size: int = 1) -> SwarmChoice:
    """LOCAL EXPERIMENT (``--variant``, with FindPeers naming the 28 loaders that started just before
    the asker), NOT swarm_plan.py: (1) while a loader is in view, holders count as the loaders they
    were, instead of everyone reading from the few holders all see (the 8 earliest, first to
    complete); (2) no seeds: each loader reads from the ``pool_size`` loaders that started just
    before it (1: a chain, cut-through at every hop), the servers standing in for those it lacks,
    so each worker uploads about one copy and the servers send about one."""
    others = [m for m in view if m.worker_id != me.worker_id]
    if not any(not m.complete for m in others):
        return choose_sources(me, others, blocks, salt, seed_window_s=seed_window_s)
    members = sorted([*(replace(m, complete=False) for m in others), me], key=lambda m: (m.started_at, m.worker_id))
    pool = [m.worker_id for m in members[:members.index(me)]][-pool_size:]
    # places a short pool lacks are the servers'
    ids = pool + [f"servers#{k}" for k in range(pool_size - len(pool))]
    index = np.array([*range(len(pool)), *([-1] * (pool_size - len(pool)))], dtype=np.int64)
    return SwarmChoice(tuple(PEER_PREFIX + i for i in pool), index[rendezvous(blocks, salt, ids)], "follower")


@dataclass(frozen=True)
class SimConfig:
    workers: int = 1000
    model_gb: float = 140.0
    link_gbit: float = 100.0             # every host, up and down separately
    servers: int = 3
    replication: int = 3
    server_link_gbit: float = 0.0        # 0: the same as link_gbit
    server_disk_gbyte_s: float = 25.0    # a server's disk read rate, GB/s (caps its egress with its link)
    rtt_ms: float = 0.2                  # one request's round trip before its first byte
    peers: bool = True
    join_spread_s: float = 0.0           # joins uniform over [0, S]; 0: all at once
    fail: float = 0.0                    # fraction of the loading workers killed at fail_at x ideal
    fail_at: float = 0.5
    unit_mb: int = 0                     # 0: by model size (unit_bytes)
    window_units: int = 6
    windows_in_flight: int = 2
    find_every_s: float = 0.3
    peer_wait_s: float = 5.0
    seed_window_s: float = 1.0
    lease_s: float = 10.0
    dt_min_s: float = 0.002
    variant: bool = False                # LOCAL EXPERIMENT: variant_policy, FindPeers with the asker's predecessors
    cut_through: bool = True             # a peer passes on each chunk of a unit as it lands (False: whole units)
    chunk_mb: float = 4.0                # how far a forwarded unit stays behind its copy in progress
    seed: int = 0

    def validate(self) -> SimConfig:
        if min(self.workers, self.servers, self.replication, self.window_units, self.windows_in_flight) < 1:
            raise ValueError("--workers, --servers, --window-units and the replication must be at least 1")
        if min(self.model_gb, self.link_gbit, self.server_disk_gbyte_s) <= 0 or not 0 <= self.fail < 1:
            raise ValueError("--model-gb, --link-gbit and the disk rate must be positive; --fail is a fraction in [0, 1)")
        if self.join_spread_s < 0 or self.unit_mb < 0:
            raise ValueError("--join-spread-s and --unit-mb cannot be negative")
        return self

    @property
    def unit_bytes(self) -> int:
        """``unit_mb``, or by default ~140 units per model (a power of two, at least 8 MiB: 1 GB -> 8 MiB,
        14 GB -> 128 MiB, 140 GB -> 1 GiB), so a 2,000-worker run stays short."""
        return (self.unit_mb or max(8, 1 << int(np.ceil(np.log2(self.model_gb * 1e9 / 140 / MIB))))) * MIB

    @property
    def model_bytes(self) -> int:
        return int(self.model_gb * 1e9)

    def ideal_s(self) -> float:
        link = self.link_gbit * GBIT
        return self.model_bytes / link + self.rtt_ms / 1e3 + min(REAL_WINDOW, self.model_bytes) / link


@dataclass
class SimResult:
    config: SimConfig
    last_ready_s: float
    ideal_s: float
    server_copies: float
    ready: int
    killed: int
    unfinished: int
    p50_ready_s: float
    max_upload_copies: float     # the busiest worker's upload, in model copies
    seed_upload_copies: float    # the 8 earliest workers' mean upload, in copies
    peer_refused: int            # units a peer could not give in time (-> servers)
    peer_failed_reads: int       # reads from a peer that broke (killed)
    gave_up: int
    wall_s: float
    events: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.last_ready_s / self.ideal_s


def share_rates(src: np.ndarray, dst: np.ndarray, up: np.ndarray, down: np.ndarray, cap: np.ndarray | None = None,
                rounds: int = 4) -> np.ndarray:
    """Each flow's rate, max-min fair approximately: in each round every flow not yet held takes an
    equal share of what is left at its sender's uplink and its receiver's downlink (the smaller; at
    most its own ``cap``), so no link is ever overfull; a flow whose link filled, or that reached its
    cap, is held, and the next round shares out what the others left."""
    hosts = len(up)
    rate = np.zeros(len(src))
    left_up, left_down = up.astype(np.float64), down.astype(np.float64)
    limit = np.full(len(src), np.inf) if cap is None else cap
    active = np.ones(len(src), dtype=bool)
    for _ in range(rounds):
        n_up = np.bincount(src, weights=active, minlength=hosts)
        n_down = np.bincount(dst, weights=active, minlength=hosts)
        inc = np.minimum(left_up[src] / np.maximum(n_up[src], 1), left_down[dst] / np.maximum(n_down[dst], 1))
        inc = np.where(active, np.maximum(np.minimum(inc, limit - rate), 0.0), 0.0)
        rate += inc
        left_up -= np.bincount(src, weights=inc, minlength=hosts)
        left_down -= np.bincount(dst, weights=inc, minlength=hosts)
        active &= (left_up[src] > 1e-6 * up[src]) & (left_down[dst] > 1e-6 * down[dst]) & (rate < limit * (1 - 1e-9))
        if not active.any():
            break
    return rate


class _Worker:
    def __init__(self, idx: int, wid: str, host: int, join: float, units: int) -> None:
        self.idx, self.wid, self.host, self.join = idx, wid, host, join
        self.alive, self.joined, self.have = True, False, np.zeros(units, dtype=bool)
        self.landed = self.next_unit = self.uploaded = 0
        self.windows: list[_Window] = []
        self.view: list[SwarmMember] = []
        self.rank: int | None = None  # its place in the swarm, as FindPeers says
        self.view_at, self.ready_at = -1e18, -1.0
        self.dropped: set[str] = set()              # peers that failed this worker: out of its view
        self.waiters: dict[int, list[int]] = {}   # unit -> reads waiting for it here
        self.inflow: dict[int, int] = {}           # unit -> the flow bringing it here
        self.serving: set[int] = set()             # reads this worker is the source of


@dataclass(eq=False)
class _Window:
    worker: _Worker
    units: np.ndarray
    planner: FetchPlanner


@dataclass(eq=False)
class _Read:
    gid: int
    window: _Window
    no: int
    src: int              # host
    peer: _Worker | None  # the source when it is a peer
    slots: list[int]
    pos: int = 0
    flow: int = -1
    waiting: bool = False
    deadline: float = 0.0
    closed: bool = False


class FleetSim:
    def __init__(self, config: SimConfig) -> None:
        self.cfg = cfg = config.validate()
        self.policy: Policy = variant_policy if cfg.variant else choose_sources
        self.neighbours = 28 if cfg.variant else 0  # FindPeers: loaders that started just before the asker
        self.rng = np.random.default_rng(cfg.seed)
        unit = cfg.unit_bytes
        n = -(-cfg.model_bytes // unit)
        self.sizes = np.full(n, unit, dtype=np.int64)
        self.sizes[-1] = cfg.model_bytes - unit * (n - 1)
        self.server_names = [f"s{k}" for k in range(cfg.servers)]
        keys = self.rng.integers(0, 2**63, size=n, dtype=np.int64).astype(np.uint64)
        self.replica_sets, self.set_of = Ring(self.server_names).placement_sets(keys, cfg.replication)
        link = cfg.link_gbit * GBIT
        server_up = min((cfg.server_link_gbit or cfg.link_gbit) * GBIT, cfg.server_disk_gbyte_s * 1e9)
        hosts = cfg.servers + cfg.workers
        self.up, self.down = np.full(hosts, link), np.full(hosts, link)
        self.up[:cfg.servers], self.down[:cfg.servers] = server_up, (cfg.server_link_gbit or cfg.link_gbit) * GBIT
        joins = np.sort(self.rng.uniform(0.0, cfg.join_spread_s, cfg.workers)) if cfg.join_spread_s else np.zeros(cfg.workers)
        ids = [f"{int(x):016x}" for x in self.rng.integers(0, 2**63, size=cfg.workers, dtype=np.int64)]
        self.workers = [_Worker(k, ids[k], cfg.servers + k, float(joins[k]), n) for k in range(cfg.workers)]
        self.by_name = {PEER_PREFIX + w.wid: w for w in self.workers}
        self.members = [(SwarmMember(w.wid, False, w.join), SwarmMember(w.wid, True, w.join)) for w in self.workers]
        self.order = np.array(sorted(range(cfg.workers), key=lambda k: (joins[k], ids[k])), dtype=np.int64)
        self.rank = np.empty(cfg.workers, dtype=np.int64)
        self.rank[self.order] = np.arange(cfg.workers)
        self.listed = np.zeros(cfg.workers, dtype=bool)   # in the directory (joined, lease not run out)
        # The real directory a version's ring owner keeps: announces at join and when ready, a goodbye at expiry.
        # Live workers re-announce before their lease runs out (every lease/3): here one lease that never does,
        # and a goodbye when a killed worker's last lease has run out.
        self.directory = PeerDirectory(Limits(max_per_version=max(MAX_PEERS_PER_VERSION, cfg.workers), lease_max_s=1e12))
        self.pyrng = random.Random(cfg.seed)
        self.listed_order: np.ndarray | None = None
        self.t, self.seq, self.next_gid = 0.0, 0, 0
        self.timers: list[tuple[float, int, str, int]] = []
        self.reads: dict[int, _Read] = {}
        # flows: parallel arrays with a free list; f_parent (cut-through): the flow bringing the unit to its sender
        cap = 1024
        self.f_src, self.f_dst, self.f_read = (np.zeros(cap, dtype=np.int64) for _ in range(3))
        self.f_rem, self.f_start, self.f_live = np.zeros(cap), np.zeros(cap), np.zeros(cap, dtype=bool)
        self.f_parent = np.full(cap, -1, dtype=np.int64)
        self.f_rate = np.zeros(cap)
        self.free: list[int] = list(range(cap - 1, -1, -1))
        self.server_bytes = 0
        self.counts = {"windows": 0, "reads": 0, "refused": 0, "peer_failed": 0, "gave_up": 0, "steps": 0}
        for w in self.workers:  # announced at once; planned when the first FindPeers answers
            self._at(w.join, "join", w.idx)
            self._at(w.join + cfg.rtt_ms / 1e3, "start", w.idx)
        if cfg.fail:
            self._at(cfg.fail_at * cfg.ideal_s(), "fail", 0)

    def _at(self, when: float, kind: str, arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (when, self.seq, kind, arg))

    def _flow(self, src: int, dst: int, nbytes: int, start: float, gid: int, parent: int = -1) -> int:
        if not self.free:
            old = len(self.f_src)
            for name in ("f_src", "f_dst", "f_rem", "f_start", "f_live", "f_read", "f_parent", "f_rate"):
                setattr(self, name, np.concatenate([arr := getattr(self, name), np.full_like(arr, -1 if name == "f_parent" else 0)]))
            self.free = list(range(2 * old - 1, old - 1, -1))
        k = self.free.pop()
        self.f_src[k], self.f_dst[k], self.f_rem[k], self.f_start[k], self.f_read[k] = src, dst, nbytes, start, gid
        self.f_live[k], self.f_parent[k], self.f_rate[k] = True, parent, 0.0
        return k

    def _drop_flow(self, k: int) -> None:
        if k >= 0 and self.f_live[k]:
            self.f_live[k] = False
            self.free.append(k)
            self.f_parent[self.f_parent == k] = -1

    def _find(self, me: _Worker) -> list[SwarmMember]:
        if not self.cfg.variant:  # the servers' own FindPeers (paramserver.server.peer_directory), as a swarm gets it
            found = self.directory.find(SIM_MANIFEST, MAX_PEERS_FOUND, me.wid, self.t, self.pyrng)
            me.rank = self.directory.rank(SIM_MANIFEST, me.wid)
            return [SwarmMember(e.worker_id, e.complete, e.started_at) for e in found]
        if self.listed_order is None:
            self.listed_order = self.order[self.listed[self.order]]
        listed = self.listed_order[self.listed_order != me.idx]
        picked, rest = listed[:PEER_SEEDS], listed[PEER_SEEDS:]
        if self.neighbours:  # LOCAL EXPERIMENT: the loaders that started just before the asker, then the sample
            at = int(np.searchsorted(self.rank[rest], self.rank[me.idx]))
            lo = max(0, at - self.neighbours)
            picked, rest = np.concatenate([picked, rest[lo:at]]), np.concatenate([rest[:lo], rest[at:]])
        room = MAX_PEERS_FOUND - len(picked)
        if len(rest) > room:
            rest = rest[np.sort(self.rng.choice(len(rest), room, replace=False))]
        members = self.members
        return [members[k][self.workers[k].ready_at >= 0] for k in np.concatenate([picked, rest]).tolist()]

    def _announce(self, w: _Worker, *, complete: bool, leaving: bool = False) -> None:
        version = Version(SIM_MANIFEST, complete, w.join)
        self.directory.announce(Announcement(w.wid, "sim:1", "i", "sim", (version,), 1e12, leaving), self.t)

    def _next_windows(self, w: _Worker) -> None:
        cfg = self.cfg
        while w.alive and len(w.windows) < cfg.windows_in_flight and w.next_unit < len(self.sizes):
            units = np.arange(w.next_unit, min(w.next_unit + cfg.window_units, len(self.sizes)), dtype=np.int64)
            w.next_unit = int(units[-1]) + 1
            peers: tuple[str, ...] = ()
            peer_of = None
            if cfg.peers:
                if self.t - w.view_at >= cfg.find_every_s:
                    w.view = self._find(w)
                    w.view_at = self.t
                view = [m for m in w.view if PEER_PREFIX + m.worker_id not in w.dropped]
                ranked = {} if cfg.variant else {"rank": w.rank}
                choice = self.policy(self.members[w.idx][0], view, units, SALT, seed_window_s=cfg.seed_window_s, **ranked)
                peers, peer_of = choice.peers, choice.peer_of
                self.counts[f"role:{choice.role}"] = self.counts.get(f"role:{choice.role}", 0) + 1
            wants = Wants(self.sizes[units], self.replica_sets, self.set_of[units], peers=peers, peer_of=peer_of)
            window = _Window(w, units, FetchPlanner(wants, self.server_names, salt=w.idx))
            w.windows.append(window)
            self.counts["windows"] += 1
            self._apply(window, window.planner.start())

    def _apply(self, window: _Window, decisions: Sequence[object]) -> None:
        for d in decisions:
            if isinstance(d, Read):
                self._start_read(window, d)
            elif isinstance(d, GiveUp):
                self.counts["gave_up"] += 1

    def _start_read(self, window: _Window, d: Read) -> None:
        peer = self.by_name.get(d.server)
        src = peer.host if peer is not None else self.server_names.index(d.server)
        r = _Read(self.next_gid, window, d.read, src, peer, [int(s) for s in d.slots], deadline=self.t + self.cfg.peer_wait_s)
        self.next_gid, self.counts["reads"] = self.next_gid + 1, self.counts["reads"] + 1
        if peer is not None and not peer.alive:  # connection refused: the planner fails over at once
            self._fail_read(r, "peer gone")
            return
        self.reads[r.gid] = r
        if peer is not None:
            peer.serving.add(r.gid)
        self._advance(r, self.t + self.cfg.rtt_ms / 1e3)

    def _advance(self, r: _Read, start: float) -> None:
        """Send the read's next unit, or wait for it at the peer, or refuse it (wait ran out)."""
        w = r.window.worker
        while r.pos < len(r.slots):
            unit = int(r.window.units[r.slots[r.pos]])
            through = self.cfg.cut_through and r.peer is not None and unit in r.peer.inflow
            if r.peer is None or r.peer.have[unit] or through:
                parent = r.peer.inflow[unit] if through and r.peer is not None else -1
                r.flow = self._flow(r.src, w.host, int(self.sizes[unit]), start, r.gid, parent)
                self._receiving(w, unit, r.flow)
                return
            if self.t < r.deadline:
                r.waiting = True
                r.peer.waiters.setdefault(unit, []).append(r.gid)
                self._at(r.deadline, "deadline", r.gid)
                return
            self.counts["refused"] += 1
            slot, r.pos = r.slots[r.pos], r.pos + 1
            if r.pos == len(r.slots):
                self._close(r)
            self._apply(r.window, r.window.planner.step(Refused(r.no, slot, "MISSING")))
        self._close(r)

    def _receiving(self, w: _Worker, unit: int, flow: int) -> None:
        """``flow`` brings ``unit`` to ``w``: with cut-through, reads waiting for it here follow it (and
        reads waiting at those readers follow them: a loop, as a chain of followers may be long)."""
        todo = [(w, flow)]
        while todo:
            at, parent = todo.pop()
            at.inflow[unit] = parent
            if self.cfg.cut_through:
                todo += self._wake(at, unit, parent)

    def _wake(self, w: _Worker, unit: int, parent: int) -> list[tuple[_Worker, int]]:
        """Start the reads waiting at ``w`` for ``unit``; returns (reader, its new flow) of each."""
        started = []
        for gid in w.waiters.pop(unit, []):
            waiting = self.reads.get(gid)
            if waiting is not None and waiting.waiting:
                waiting.waiting = False
                reader = waiting.window.worker
                waiting.flow = self._flow(w.host, reader.host, int(self.sizes[unit]), self.t, gid, parent)
                started.append((reader, waiting.flow))
        return started

    def _close(self, r: _Read) -> None:
        if not r.closed:
            r.closed = True
            self.reads.pop(r.gid, None)
            if r.peer is not None:
                r.peer.serving.discard(r.gid)

    def _fail_read(self, r: _Read, reason: str) -> None:
        w = r.window.worker
        if r.flow >= 0 and r.pos < len(r.slots):
            unit = int(r.window.units[r.slots[r.pos]])
            if w.inflow.get(unit) == r.flow:
                del w.inflow[unit]
        self._drop_flow(r.flow)
        self._close(r)
        self.counts["peer_failed"] += 1
        if r.peer is not None:
            w.dropped.add(PEER_PREFIX + r.peer.wid)
        if w.alive:
            self._apply(r.window, r.window.planner.step(ReadFailed(r.no, reason)))

    def _landed(self, r: _Read, finished_at: float) -> None:
        window, slot = r.window, r.slots[r.pos]
        w, unit = window.worker, int(window.units[slot])
        if r.peer is None:
            self.server_bytes += int(self.sizes[unit])
        else:
            r.peer.uploaded += int(self.sizes[unit])
        w.have[unit] = True
        w.landed += 1
        w.inflow.pop(unit, None)
        for reader, flow in self._wake(w, unit, -1):
            self._receiving(reader, unit, flow)
        r.pos, r.flow = r.pos + 1, -1
        self._apply(window, window.planner.step(Landed(r.no, [slot])))
        self._advance(r, self.t)
        if window.planner.done and window in w.windows:
            w.windows.remove(window)
            self._next_windows(w)
        if w.landed == len(self.sizes) and w.ready_at < 0:
            w.ready_at = finished_at
            self._announce(w, complete=True)

    def _kill(self) -> None:
        loading = [w for w in self.workers if w.alive and w.joined and w.ready_at < 0]
        count = int(round(self.cfg.fail * len(loading)))
        for k in sorted(self.rng.choice(len(loading), count, replace=False).tolist()):
            w = loading[k]
            w.alive = False  # its flows stop; reads from it break
            # its last announce was at most lease/3 ago: it stays listed until that lease runs out
            last = w.join + np.floor((self.t - w.join) / (self.cfg.lease_s / 3)) * (self.cfg.lease_s / 3)
            self._at(last + self.cfg.lease_s, "expire", w.idx)
            for mine in [r for r in self.reads.values() if r.window.worker is w]:
                self._drop_flow(mine.flow)
                self._close(mine)
            w.windows.clear()
            for gid in sorted(w.serving):
                theirs = self.reads.get(gid)
                if theirs is not None:
                    self._fail_read(theirs, "peer killed")

    def _timer(self, kind: str, arg: int) -> None:
        if kind in ("join", "expire"):  # in the directory from its first announce until its lease runs out
            self.workers[arg].joined = True
            self.listed[arg], self.listed_order = kind == "join", None
            self._announce(self.workers[arg], complete=False, leaving=kind == "expire")
        elif kind == "start":
            self._next_windows(self.workers[arg])
        elif kind == "deadline":
            r = self.reads.get(arg)
            if r is not None and r.waiting and self.t >= r.deadline:
                r.waiting = False
                self._advance(r, self.t)
        elif kind == "fail":
            self._kill()

    def run(self) -> SimResult:
        began = time.perf_counter()
        cfg = self.cfg
        while True:
            while self.timers and self.timers[0][0] <= self.t + 1e-12:
                _, _, kind, arg = heapq.heappop(self.timers)
                self._timer(kind, arg)
            live = np.flatnonzero(self.f_live)
            if not len(live) and not self.timers:
                break
            started = live[self.f_start[live] <= self.t]
            later = self.f_start[live][self.f_start[live] > self.t]
            nxt = min(self.timers[0][0] if self.timers else float("inf"), float(later.min()) if len(later) else float("inf"))
            if len(started):
                parent = self.f_parent[started]
                follows = parent >= 0
                rate = share_rates(self.f_src[started], self.f_dst[started], self.up, self.down)
                if follows.any():  # a unit passed on while it lands goes no faster than it lands: share again, capped
                    caught = follows & (self.f_rem[started] <= self.f_rem[np.maximum(parent, 0)] + self.cfg.chunk_mb * MIB + 1.0)
                    if caught.any():
                        self.f_rate[:] = 0.0
                        self.f_rate[started] = rate
                        cap = np.where(caught, self.f_rate[np.maximum(parent, 0)], np.inf)
                        rate = share_rates(self.f_src[started], self.f_dst[started], self.up, self.down, cap)
                ttf = self.f_rem[started] / np.maximum(rate, 1e-9)
                # events closer than dt_min, or than 1% of a typical flow's remaining time, go together
                floor = max(cfg.dt_min_s, 0.01 * float(np.median(ttf)))
                dt = min(nxt - self.t, max(float(ttf.min()), floor))
            else:
                dt = nxt - self.t
            dt = max(dt, 0.0)
            if len(started):
                self.f_rem[started] -= rate * dt
                if follows.any():
                    kids = started[follows]
                    pf = self.f_parent[kids]
                    behind = np.where(self.f_live[pf], self.f_rem[pf] + self.cfg.chunk_mb * MIB, 0.0)
                    self.f_rem[kids] = np.maximum(self.f_rem[kids], np.minimum(behind, self.f_rem[kids] + rate[follows] * dt))
                finished = self.f_rem[started] <= 1.0  # bytes: what float rounding leaves of a flow that ended
                done = started[finished]
                ends = self.t + dt + self.f_rem[done] / np.maximum(rate[finished], 1e-9)
            self.t += dt
            self.counts["steps"] += 1
            if len(started) and len(done):
                for k, end in sorted(zip(done.tolist(), ends.tolist()), key=lambda p: p[1]):
                    r = self.reads.get(int(self.f_read[k]))
                    self._drop_flow(k)
                    if r is not None and r.flow == k:
                        self._landed(r, end)
        return self._result(time.perf_counter() - began)

    def _result(self, wall: float) -> SimResult:
        cfg, model = self.cfg, self.cfg.model_bytes
        alive = [w for w in self.workers if w.alive]
        ready = [w.ready_at for w in alive if w.ready_at >= 0]
        seeds = [self.workers[k] for k in self.order[:PEER_SEEDS].tolist()]
        return SimResult(
            cfg, max(ready) if ready else float("inf"), cfg.ideal_s(), self.server_bytes / model, len(ready),
            cfg.workers - len(alive), len(alive) - len(ready), float(np.median(ready)) if ready else float("inf"),
            max(w.uploaded for w in self.workers) / model, float(np.mean([w.uploaded for w in seeds])) / model,
            self.counts["refused"], self.counts["peer_failed"], self.counts["gave_up"], wall, dict(self.counts))


def simulate(config: SimConfig) -> SimResult:
    return FleetSim(config).run()



def describe(result: SimResult) -> str:
    c = result.config
    return (("[LOCAL VARIANT policy] " if c.variant else "")
            + f"{c.workers} workers x {c.model_gb:g} GB, peers {'on' if c.peers else 'off'}, {c.link_gbit:g} Gbit/s per host, "
            f"{c.servers} servers: last ready {result.last_ready_s:.2f} s, ideal {result.ideal_s:.2f} s "
            f"(ratio {result.ratio:.2f}), servers sent {result.server_copies:.2f} model copies; "
            f"unit {c.unit_bytes // MIB} MiB x {-(-c.model_bytes // c.unit_bytes)}, median ready {result.p50_ready_s:.2f} s, "
            f"busiest uploader {result.max_upload_copies:.2f} copies, seeds {result.seed_upload_copies:.2f} copies each, "
            f"refused {result.peer_refused}, broken peer reads {result.peer_failed_reads}, killed {result.killed}, "
            f"unfinished {result.unfinished}, gave up {result.gave_up}; {result.wall_s:.1f} s to simulate")


GRID_WORKERS = (10, 100, 1000, 2000)
GRID_MODELS = (1.0, 14.0, 140.0)


def table(base: SimConfig, out: Callable[[str], None] = print) -> list[SimResult]:
    """The standard grid, peers on and off, then four points under the LOCAL VARIANT (labelled)."""
    out("| workers | model | peers | unit | last ready (s) | ideal (s) | ratio | servers' egress (copies) | busiest uploader (copies) |")
    out("|---:|---:|:---:|---:|---:|---:|---:|---:|---:|")
    points = [replace(base, workers=w, model_gb=m, peers=p) for w in GRID_WORKERS for m in GRID_MODELS for p in (True, False)]
    points += [replace(base, workers=w, model_gb=m, variant=True) for w, m in ((1000, 1.0), (1000, 14.0), (1000, 140.0), (2000, 140.0))]
    results = []
    for config in points:
        r = simulate(config)
        results.append(r)
        c = r.config
        peers = "variant" if c.variant else "on" if c.peers else "off"
        out(f"| {c.workers} | {c.model_gb:g} GB | {peers} | {c.unit_bytes // MIB} MiB | {r.last_ready_s:.2f} | {r.ideal_s:.2f} | "
            f"{r.ratio:.2f} | {r.server_copies:.2f} | {r.max_upload_copies:.2f} |")
        print(f"  ({describe(r)})", file=sys.stderr)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1000, help="workers cold-starting the version (default 1000)")
    parser.add_argument("--model-gb", type=float, default=140.0, help="model size in GB (default 140)")
    parser.add_argument("--link-gbit", type=float, default=100.0, help="every host's link, up and down each (default 100)")
    parser.add_argument("--servers", type=int, default=3, help="parameter servers (default 3; replication min(3, servers))")
    parser.add_argument("--server-disk-gbyte-s", type=float, default=25.0, help="a server's disk read rate in GB/s (default 25)")
    parser.add_argument("--rtt-ms", type=float, default=0.2, help="a request's round trip (default 0.2)")
    parser.add_argument("--no-peers", action="store_true", help="every worker reads everything from the servers")
    parser.add_argument("--join-spread-s", type=float, default=0.0, help="joins spread uniformly over S seconds (default 0: all at once)")
    parser.add_argument("--fail", type=float, default=0.0, help="fraction of the loading workers killed mid-run (default 0)")
    parser.add_argument("--fail-at", type=float, default=0.5, help="when to kill them, as a fraction of the ideal time (default 0.5)")
    parser.add_argument("--unit-mb", type=int, default=0, help="MiB of neighbouring chunks that move as one unit (default: per model size)")
    parser.add_argument("--window-units", type=int, default=6, help="units per planned window (default 6; 2 windows in flight)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (worker ids, joins, failures, samples)")
    parser.add_argument("--variant", action="store_true", help="LOCAL EXPERIMENT: the policy change the sim suggests (variant_policy)")
    parser.add_argument("--table", action="store_true", help="run the standard grid and print a markdown table")
    args = parser.parse_args(argv)
    config = SimConfig(workers=args.workers, model_gb=args.model_gb, link_gbit=args.link_gbit, servers=args.servers,
                       replication=min(3, max(1, args.servers)), server_disk_gbyte_s=args.server_disk_gbyte_s, rtt_ms=args.rtt_ms,
                       peers=not args.no_peers, join_spread_s=args.join_spread_s, fail=args.fail, fail_at=args.fail_at,
                       unit_mb=args.unit_mb, window_units=args.window_units, seed=args.seed, variant=args.variant)
    try:
        config.validate()
    except ValueError as e:
        print(f"sim_fleet: {e}", file=sys.stderr)
        return 2
    if args.table:
        table(config)
        return 0
    print(describe(simulate(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
