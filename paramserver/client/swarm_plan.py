"""Which peer a worker asks for which chunks: the swarm policy, pure (no sockets, threads or clock).

Workers that load one version at the same time split it, and a worker that comes later reads from
those that came before. Every worker decides alone, from its own view of the version's peers
(``FindPeers``: the earliest loaders first, then a sample), yet the decisions fit together:

- **Seeds**: the workers that started loading within ``seed_window_s`` of the earliest one (at
  most ``max_seeds``), this worker included when it is one. Each block goes to the seed with the
  highest rendezvous score; the one that wins its own blocks reads them from the servers. So the
  seeds together fetch the version from the servers about once, each a different share, and the
  rest from each other.
- **Followers** (workers that started later), in line after the seeds: the r-th reads each block,
  by rendezvous, from one of those between r/2 and r in line (FindPeers names a sample of them,
  paramserver.server.peer_directory, with this worker's rank); the first in line reads from the
  seeds. A worker is then asked by those up to about twice as far in line as it, about 1.4 copies of
  the version in all, and the chain from the seeds stays about log2(N) deep.
- **Holders** (workers that hold the whole version) keep their place in line: the early ones
  finish first, and would be asked by everyone otherwise; a worker that comes after the swarm is
  last in line and reads from the later half of it. Only a worker with no place in line (it serves
  nobody, so the servers have no entry of it) spreads its blocks over every holder it sees.

A chunk that is not there in time, or fails, goes to the servers (the fetch planner's failover),
never to another peer. Why this cannot deadlock: a worker waits on a peer only for a chunk that
peer is loading; a follower asks only peers that started before it, and a seed asks only the seed
whose rendezvous score beats its own for that block (a peer it sees beats it, so along any chain
of waits the score grows and no chain comes back). Blocks are cut by the chunks' rows in the
manifest (``rows_per_block``), which every worker of a version numbers the same way, whatever
order or subset of the chunks it fetches.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from paramserver.client.fetch_plan import PEER_PREFIX
from paramserver.wire.limits import PEER_SEEDS

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class SwarmMember:
    """A worker as the policy sees it: its id, whether it holds the whole version, when it started
    loading it (its own wall clock, unix seconds)."""

    worker_id: str
    complete: bool
    started_at: float


@dataclass(frozen=True)
class SwarmChoice:
    """``peers``: the peers named (``peer:ID``); ``peer_of``: per slot, the index of the peer to ask
    first, -1 for the servers; ``role``: ``alone``, ``seed``, ``follower`` or ``from-holders``."""

    peers: tuple[str, ...]
    peer_of: np.ndarray
    role: str
    seeds: int = 0


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays: a rendezvous score per (block, worker)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out


def worker_key(worker_id: str) -> np.uint64:
    """A stable 64-bit key of a worker id (FNV-1a, then mixed): the same on every worker."""
    h = 0xCBF29CE484222325
    for b in worker_id.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return np.uint64(int(_mix(np.array([h], dtype=np.uint64))[0]))


def rendezvous(blocks: np.ndarray, salt: int, candidates: Sequence[str]) -> np.ndarray:
    """For each block number, the index (into ``candidates``) of the one with the highest score."""
    keys = _mix(blocks.astype(np.uint64) ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF))
    best = np.zeros(len(blocks), dtype=np.int64)
    top = np.zeros(len(blocks), dtype=np.uint64)
    for k, cid in enumerate(candidates):
        score = _mix(keys ^ worker_key(cid))
        better = score > top if k else np.ones(len(blocks), dtype=bool)
        best[better] = k
        top[better] = score[better]
    return best


def _order(m: SwarmMember) -> tuple[float, str]:
    return (m.started_at, m.worker_id)


def choose_sources(me: SwarmMember, view: Sequence[SwarmMember], blocks: np.ndarray, salt: int, *,
                   seed_window_s: float = 1.0, max_seeds: int = PEER_SEEDS, rank: int | None = None) -> SwarmChoice:
    """Where each slot (``blocks``: its block number, from its manifest row) is read first.

    ``me``: this worker, loading; ``view``: the other workers this one knows of for the version
    (dropped ones already left out; FindPeers names the seeds first, then those that rank between
    the seeds plus half this worker's rank past them and this worker); ``salt``: the version's (e.g.
    from its manifest id), the same on every worker; ``rank``: this worker's rank in the swarm, as
    FindPeers said (None: unknown)."""
    others = [m for m in view if m.worker_id != me.worker_id]
    none = np.full(len(blocks), -1, dtype=np.int64)
    if rank is None and others and all(m.complete for m in others):  # outside the line, the swarm over: every holder
        holders = sorted(others, key=lambda m: m.worker_id)
        names = tuple(PEER_PREFIX + m.worker_id for m in holders)
        return SwarmChoice(names, rendezvous(blocks, salt, [m.worker_id for m in holders]), "from-holders")
    # While any loader is in view, a holder ranks as the loader it was (when it started): the early
    # ones finish first, and if every later worker turned to them they would be asked by all.
    everyone = sorted([*others, me], key=_order)
    if len(everyone) == 1:
        return SwarmChoice((), none, "alone")
    earliest = everyone[0].started_at
    seeds = [m for m in everyone if m.started_at <= earliest + seed_window_s][:max(1, max_seeds)]
    if me in seeds:
        ids = [m.worker_id for m in seeds]
        winner = rendezvous(blocks, salt, ids)
        mine = ids.index(me.worker_id)
        peers = [i for i in range(len(ids)) if i != mine]
        index = np.full(len(ids), -1, dtype=np.int64)
        index[peers] = np.arange(len(peers), dtype=np.int64)
        return SwarmChoice(tuple(PEER_PREFIX + ids[i] for i in peers), index[winner], "seed", len(seeds))
    seed_ids = {m.worker_id for m in seeds}
    before = [m for m in everyone if _order(m) < _order(me)]
    followers = [m for m in before if m.worker_id not in seed_ids]
    # Past the seeds, a worker r-th in line reads from those between r/2 and r (in line): each is
    # then asked by those up to about twice as far in line as it (about 1.4 copies), and the first
    # in line reads from the seeds (one copy spread over them, beside their own exchange).
    r = rank - len(seeds) if rank is not None else len(followers)
    if r <= 0 or not followers:
        pool = [m for m in before if m.worker_id in seed_ids]
    elif len(followers) >= r:  # every one before it is in view: take the later half of them
        pool = followers[r // 2:]
    else:  # a sample FindPeers drew from that later half already
        pool = followers
    ids = [m.worker_id for m in pool]
    return SwarmChoice(tuple(PEER_PREFIX + i for i in ids), rendezvous(blocks, salt, ids), "follower", len(seeds))


def version_salt(manifest_id: str) -> int:
    """The rendezvous salt of a version: its manifest id's first 8 bytes."""
    return int(manifest_id[:16], 16) if len(manifest_id) >= 16 else 0


__all__ = ["SwarmChoice", "SwarmMember", "choose_sources", "rendezvous", "version_salt", "worker_key"]
