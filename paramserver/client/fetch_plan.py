"""The chunk-fetch planner: which replica to read which chunks from, and what to do when one fails.

A pure state machine in the manner of etcd's raft: no sockets, no threads, no clock. The caller
(``paramserver.client.fetch.FetchEngine``) feeds it events -- a chunk landed, a replica refused
or served bad bytes, a read broke or ran past its deadline, a read ended -- and carries out the
decisions it returns: read these ids from that replica, report that replica's bad copies, give
up naming the chunk. Every chunk lands once, from a replica whose bytes verified, or the fetch
gives up naming it.

Placement: each chunk goes to the least-loaded (by bytes assigned) of its ring replicas not yet
tried -- or to the replica the previous chunk went to while that one is at most ``STICKY_BYTES``
(and a sixteenth of a member's share) ahead, so each server is asked for runs of neighbouring
chunks, which it reads with one pread; when every ring replica has failed, to any other member not yet tried (repair or a
rebalance may have moved a copy there). A hot chunk (``Want.extras``: servers that advertised an
extra copy, paramserver.server.hot_chunks) has those holders as candidates too, and its ties go
to a per-fetch ``salt``-ed order instead of the primary, so that clients which do not know of
each other spread their reads of it over every holder; ties of other chunks go to the primary
(their reads stay on one server's cache). A replica whose read broke, or ran past its deadline,
is taken out of this fetch, so its leftovers, and later re-plans, go to the others at once; it
is asked again only for a chunk no other replica could serve.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

# --------------------------------------------------------------------------- events in


@dataclass(frozen=True)
class Landed:
    """``chunk_ids`` (those that arrived together) landed from read ``read`` and verified."""

    read: int
    chunk_ids: tuple[str, ...]


@dataclass(frozen=True)
class Refused:
    """Read ``read`` could not deliver ``chunk_id``: the replica answered MISSING or CORRUPT, or
    the bytes it sent failed verification (``corrupt``: the copy there is bad, report it)."""

    read: int
    chunk_id: str
    reason: str
    corrupt: bool = False
    report: bool = False  # the client saw the bad bytes itself: tell the server


@dataclass(frozen=True)
class ReadFailed:
    """Read ``read`` broke (connection lost, deadline passed, replica unreachable); the ids it
    still owed go elsewhere. ``replica_down``: avoid that replica for the rest of this fetch."""

    read: int
    reason: str
    replica_down: bool = True


@dataclass(frozen=True)
class ReadEnded:
    """Read ``read`` finished; ids it neither delivered nor refused were not sent."""

    read: int


Event = Landed | Refused | ReadFailed | ReadEnded

# --------------------------------------------------------------------------- decisions out


@dataclass(frozen=True)
class Read:
    read: int
    server: str
    ids: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class ReportCorrupt:
    server: str
    ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class GiveUp:
    chunk_id: str
    attempts: dict[str, str]
    data_loss: bool  # every replica that answered had a bad copy


Decision = Read | ReportCorrupt | GiveUp


STICKY_BYTES = 1 << 20  # how far ahead a replica may get while it keeps taking the next chunks


class Want(NamedTuple):
    """A chunk to fetch: its id, its stored size, its ring replicas (primary first) and the servers
    that advertised an extra copy of it (a hot chunk; candidates as good as the replicas). A named
    tuple, not a frozen dataclass: one is made per chunk of a fetch, half a million of 4 KiB."""

    id: str
    size: int
    replicas: tuple[str, ...]
    extras: tuple[str, ...] = ()


def _least_loaded(servers: Sequence[str], load: dict[str, int]) -> str:
    """The server with the least bytes planned so far; ties go to the earliest (ring order: the primary)."""
    best = servers[0]
    best_load = load.get(best, 0)
    for s in servers[1:]:
        s_load = load.get(s, 0)
        if s_load < best_load:
            best, best_load = s, s_load
    return best


def spread_rank(salt: int, chunk_id: str, server: str) -> int:
    """A salted order of a hot chunk's holders (rendezvous hashing): each fetch prefers another one."""
    digest = hashlib.blake2b(f"{salt}:{chunk_id}:{server}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class _ReadState:
    server: str
    owed: dict[str, None]  # ordered set


@dataclass
class FetchPlanner:
    """Plan one fetch of ``wants`` over ``members`` (every server id, for the last-resort pass).

    ``reads_per_server(server)`` says how many reads may share one replica's ids (e.g. one bulk
    connection, or a few gRPC streams); ``max_read_bytes`` caps one read so a late failure costs
    little and the earliest-wanted chunks go first.
    """

    wants: Sequence[Want]
    members: Sequence[str]
    reads_per_server: Callable[[str], int] = lambda _server: 1
    max_read_bytes: int = 64 << 20
    salt: int = 0  # orders the holders of hot chunks (Want.extras) on ties; vary it per fetch
    _want: dict[str, Want] = field(init=False)
    _order: dict[str, int] | None = field(init=False)  # id -> its place in the fetch order
    _pending_order: list[str] = field(init=False)
    _pending: dict[str, None] = field(init=False)  # not landed, not given up
    _attempts: dict[str, dict[str, str]] = field(init=False)
    _corrupt: dict[str, set[str]] = field(init=False)
    _reads: dict[int, _ReadState] = field(init=False)
    _down: set[str] = field(init=False)
    _broken: dict[str, set[str]] = field(init=False)  # chunk -> replicas whose read broke while owing it
    _retried: set[tuple[str, str]] = field(init=False)
    _next_read: int = field(init=False, default=0)
    failovers: int = field(init=False, default=0)
    given_up: list[GiveUp] = field(init=False)

    def __post_init__(self) -> None:
        ids = [w.id for w in self.wants]
        self._want = dict(zip(ids, self.wants))
        self._pending_order = ids
        self._order = None
        self._pending = dict.fromkeys(ids)
        self._attempts = {}
        self._corrupt = {}
        self._reads = {}
        self._down = set()
        self._broken = {}
        self._retried = set()
        self.given_up = []

    # ------------------------------------------------------------------ queries

    @property
    def done(self) -> bool:
        """Nothing in flight and nothing left to plan (every chunk landed, or the fetch gave up)."""
        return not self._reads and (not self._pending or bool(self.given_up))

    @property
    def landed_all(self) -> bool:
        return not self._pending and not self.given_up

    def pending(self) -> tuple[str, ...]:
        return tuple(self._pending)

    def attempts(self, chunk_id: str) -> dict[str, str]:
        return dict(self._attempts.get(chunk_id, {}))

    def down(self) -> frozenset[str]:
        return frozenset(self._down)

    def in_flight(self) -> int:
        return len(self._reads)

    # ------------------------------------------------------------------ transitions

    def start(self) -> list[Decision]:
        return self._plan(list(self._pending), in_order=True)

    def step(self, event: Event) -> list[Decision]:
        state = self._reads.get(event.read)
        if state is None:
            return []  # a read already closed (late event after a failure): never trusted
        if isinstance(event, Landed):
            owed, pending = state.owed, self._pending
            for cid in event.chunk_ids:
                if cid in owed:
                    del owed[cid]
                    pending.pop(cid, None)
            return self._close_if_empty(event.read, state)
        if isinstance(event, Refused):
            if event.chunk_id not in state.owed:
                return []
            del state.owed[event.chunk_id]
            self._note(event.chunk_id, state.server, event.reason, event.corrupt)
            out: list[Decision] = []
            if event.report:
                out.append(ReportCorrupt(state.server, (event.chunk_id,), event.reason))
            out += self._close_if_empty(event.read, state)
            out += self._plan([event.chunk_id])
            return out
        if isinstance(event, ReadFailed):
            if event.replica_down:
                self._down.add(state.server)
            for cid in state.owed:
                self._note(cid, state.server, event.reason, False)
                self._broken.setdefault(cid, set()).add(state.server)
            leftovers = list(state.owed)
            del self._reads[event.read]
            return self._plan(leftovers)
        # ReadEnded
        for cid in state.owed:
            self._note(cid, state.server, "not sent", False)
        leftovers = list(state.owed)
        del self._reads[event.read]
        return self._plan(leftovers)

    # ------------------------------------------------------------------ internals

    def _close_if_empty(self, read: int, state: _ReadState) -> list[Decision]:
        if not state.owed:
            del self._reads[read]
        return []

    def _note(self, cid: str, server: str, reason: str, corrupt: bool) -> None:
        self._attempts.setdefault(cid, {})[server] = reason
        if corrupt:
            self._corrupt.setdefault(cid, set()).add(server)

    def _candidates(self, cid: str) -> list[str]:
        tried = self._attempts.get(cid, {})
        want = self._want[cid]
        holders = (*want.replicas, *(s for s in want.extras if s not in want.replicas))
        ring = [s for s in holders if s not in tried and s not in self._down]
        if ring:
            return ring
        others = [s for s in self.members if s not in tried and s not in self._down]
        if others:
            return others
        # Last resort before giving up: a replica whose read broke earlier (it may be back), once
        # more; never one that refused the chunk or served bad bytes.
        again = [s for s in (*self._want[cid].replicas, *self.members) if s not in tried]
        if again:
            return again
        retry = [s for s in self._broken.get(cid, ()) if (cid, s) not in self._retried]
        for s in retry[:1]:
            self._retried.add((cid, s))
            del self._attempts[cid][s]
        return retry[:1]

    def _plan(self, ids: Iterable[str], in_order: bool = False) -> list[Decision]:
        """``in_order``: ``ids`` are pending and in fetch order already (the first plan)."""
        if in_order:
            todo = list(ids)
        else:
            todo = sorted((cid for cid in ids if cid in self._pending), key=self._position)
        if not todo:
            return []
        tried, down, wants = self._attempts, self._down, self._want
        if tried and any(cid in tried for cid in todo):
            self.failovers += sum(1 for cid in todo if cid in tried)
        load: dict[str, int] = {}
        # server -> (ids, their sizes, their positions in ``todo``): what it is asked for, in order
        picked: dict[str, tuple[list[str], list[int], list[int]]] = {}
        gave_up: list[Decision] = []
        fresh: dict[tuple[str, ...], list[str]] = {}  # replicas -> the ones not down, for chunks never tried
        # A chunk stays on the replica the previous one went to while that replica is at most
        # ``slack`` bytes ahead of the least loaded: each server is then asked for runs of
        # neighbouring chunks (records it stored together: read with one pread; bytes received
        # next to each other), and the plan stays balanced to within ``slack``.
        slack = min(STICKY_BYTES, sum(wants[cid].size for cid in todo) // (16 * max(1, len(self.members))))
        prev: str | None = None
        for position, cid in enumerate(todo):
            want = wants[cid]
            best: str | None = None
            if not want.extras and cid not in tried:
                # The common case (a first plan of half a million chunks): the replicas in ring
                # order, the least loaded by bytes, ties to the earliest (the primary); the
                # replica list is worked out once per replica set.
                ring = fresh.get(want.replicas)
                if ring is None:
                    ring = fresh[want.replicas] = [s for s in want.replicas if s not in down]
                    for s in ring:
                        load.setdefault(s, 0)
                if ring:
                    best = ring[0]
                    best_load = load[best]
                    for s in ring[1:]:
                        if load[s] < best_load:
                            best, best_load = s, load[s]
                    if prev is not None and prev != best and prev in ring and load[prev] - best_load <= slack:
                        best, best_load = prev, load[prev]
                    prev = best
                    load[best] = best_load + want.size
            if best is None:
                candidates = self._candidates(cid)
                if not candidates:
                    attempts = self._attempts.get(cid, {})
                    bad = self._corrupt.get(cid, set())
                    give_up = GiveUp(cid, dict(attempts), bool(attempts) and set(attempts) <= bad)
                    self.given_up.append(give_up)
                    del self._pending[cid]
                    gave_up.append(give_up)
                    continue
                # Least loaded; ties go to the earliest in ring order (the primary), or for a hot chunk
                # to this fetch's salted order of its holders.
                if want.extras:
                    best = min(candidates, key=lambda s: (load.get(s, 0), spread_rank(self.salt, cid, s)))
                else:
                    best = _least_loaded(candidates, load)
                self._down.discard(best)  # a last-resort pick gets its chance
                load[best] = load.get(best, 0) + want.size
            lists = picked.get(best)
            if lists is None:
                lists = picked[best] = ([], [], [])
            lists[0].append(cid)
            lists[1].append(want.size)
            lists[2].append(position)
        if self.given_up:
            return gave_up  # the fetch has failed: start nothing new
        reads: list[tuple[int, Read]] = []
        for server, (sids, sizes, positions) in picked.items():
            reads += self._reads_for(server, sids, sizes, positions)
        reads.sort(key=lambda pr: pr[0])  # the earliest-wanted chunks first
        return [*gave_up, *(read for _, read in reads)]

    def _position(self, cid: str) -> int:
        if self._order is None:  # only a re-plan needs it: made on the first
            self._order = dict(zip(self._pending_order, range(len(self._pending_order))))
        return self._order[cid]

    def _reads_for(self, server: str, ids: list[str], sizes: list[int], positions: list[int]) -> list[tuple[int, Read]]:
        """(position of its first chunk, read) of the reads that ask ``server`` for ``ids``."""
        streams = max(1, self.reads_per_server(server))
        ends = list(itertools.accumulate(sizes))
        total = ends[-1] if ends else 0
        # Split in ``streams`` contiguous runs, each cut again at max_read_bytes: a read closes at
        # the first chunk that brings it to ``cap`` bytes.
        per_stream = max(1, -(-total // streams))
        cap = max(1, min(per_stream, self.max_read_bytes))
        reads: list[tuple[int, Read]] = []
        start, before = 0, 0
        while start < len(ids):
            stop = min(bisect.bisect_left(ends, before + cap, lo=start) + 1, len(ids))
            reads.append((positions[start], self._open(server, ids[start:stop], ends[stop - 1] - before)))
            start, before = stop, ends[stop - 1]
        return reads

    def _open(self, server: str, ids: list[str], nbytes: int) -> Read:
        number = self._next_read
        self._next_read += 1
        self._reads[number] = _ReadState(server, dict.fromkeys(ids))
        return Read(number, server, tuple(ids), nbytes)


__all__ = [
    "Decision", "Event", "FetchPlanner", "GiveUp", "Landed", "Read", "ReadEnded", "ReadFailed", "Refused", "ReportCorrupt",
    "Want", "spread_rank",
]
