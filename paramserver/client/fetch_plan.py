"""The chunk-fetch planner: which replica to read which chunks from, and what to do when one fails.

A pure state machine in the manner of etcd's raft: no sockets, no threads, no clock. The caller
(``paramserver.client.fetch.FetchEngine``) feeds it events -- chunks landed, a replica refused
or served bad bytes, a read broke or ran past its deadline, a read ended -- and carries out the
decisions it returns: read these chunks from that replica, report that replica's bad copies,
give up naming the chunk. Every chunk lands once, from a replica whose bytes verified, or the
fetch gives up naming it.

A chunk is named by its *slot*, its position in the fetch order, and the fetch's chunks are
columns (:class:`Wants`): sizes, and per slot the index of its ring replica list among the few
distinct lists. Half a million 4 KiB chunks are planned with array operations, not an object and
a dict entry each.

Placement: the chunks are cut, in fetch order, into blocks of neighbours that share a usable ring
replica (not down, not tried), each at most ``slack`` bytes (a sixteenth of a member's share, at
most ``STICKY_BYTES``). A block goes to its least-loaded (by bytes assigned) shared replica, ties
to the earliest in the ring order of its first chunk (the primary) -- or to the replica the
previous block went to while that one is at most ``slack`` ahead, so each server is asked for
runs of neighbouring chunks, which it stored together and reads with one pread. A chunk whose ring
replicas have all failed goes to any other member not yet tried (repair or a rebalance may have
moved a copy there). A hot chunk (``Wants.extras``: servers that advertised an extra copy,
paramserver.server.hot_chunks) has those holders as candidates too, and its ties go to a
per-fetch ``salt``-ed order instead of the primary, so that clients which do not know of each
other spread their reads of it over every holder. A replica whose read broke, or ran past its
deadline, is taken out of this fetch, so its leftovers, and later re-plans, go to the others at
once; it is asked again only for a chunk no other replica could serve.

Peers (other workers, ``Wants.peers``, named ``peer:ID``): a slot may name a first-choice peer
(``Wants.peer_of``). Such a slot goes to that peer while the peer is neither down nor already tried
for it; once it failed there (refused, bad bytes, broke, too slow) the slot is planned as any other,
over the servers. A peer is never a candidate of the last-resort passes: the servers hold every
chunk, a peer only what it happens to have.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from chunking.chunk_table import ChunkRows
from paramserver.wire.ring import Ring, key_point

# --------------------------------------------------------------------------- events in


@dataclass(frozen=True, eq=False)
class Landed:
    """``slots`` (chunks that arrived together) landed from read ``read`` and verified."""

    read: int
    slots: Sequence[int] | np.ndarray


@dataclass(frozen=True)
class Refused:
    """Read ``read`` could not deliver ``slot``: the replica answered MISSING or CORRUPT, or the
    bytes it sent failed verification (``corrupt``: the copy there is bad, report it)."""

    read: int
    slot: int
    reason: str
    corrupt: bool = False
    report: bool = False  # the client saw the bad bytes itself: tell the server


@dataclass(frozen=True)
class ReadFailed:
    """Read ``read`` broke (connection lost, deadline passed, replica unreachable); the chunks it
    still owed go elsewhere. ``replica_down``: avoid that replica for the rest of this fetch."""

    read: int
    reason: str
    replica_down: bool = True


@dataclass(frozen=True)
class ReadEnded:
    """Read ``read`` finished; chunks it neither delivered nor refused were not sent."""

    read: int


Event = Landed | Refused | ReadFailed | ReadEnded

# --------------------------------------------------------------------------- decisions out


@dataclass(frozen=True, eq=False)
class Read:
    """Read ``slots`` (in fetch order) from ``server``: ``nbytes`` stored bytes."""

    read: int
    server: str
    slots: np.ndarray
    nbytes: int


@dataclass(frozen=True)
class ReportCorrupt:
    server: str
    slots: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class GiveUp:
    slot: int
    attempts: dict[str, str]
    data_loss: bool  # every replica that answered had a bad copy


Decision = Read | ReportCorrupt | GiveUp


STICKY_BYTES = 1 << 20  # how far ahead a replica may get while it keeps taking the next chunks
PENDING, LANDED, GAVE_UP = -1, -2, -3  # a slot's owner when no read owes it
PEER_PREFIX = "peer:"  # how a worker peer is named beside the servers' ids


def is_peer(server: str) -> bool:
    return server.startswith(PEER_PREFIX)


class Want(NamedTuple):
    """One chunk to fetch, for fetches small enough to describe chunk by chunk (tests, a file's
    chunks): its id, its stored size, its ring replicas (primary first) and the servers that
    advertised an extra copy of it (a hot chunk)."""

    id: str
    size: int
    replicas: tuple[str, ...]
    extras: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class Wants:
    """The chunks of one fetch as columns, in fetch order; slot ``k`` is the k-th chunk.

    ``sizes``: stored bytes; ``replica_sets``: the distinct ring replica lists (primary first) and
    ``set_of``: each slot's index into them; ``extras``: slot -> servers with an extra copy (hot
    chunks: few); ``keys``: each slot's ring point (orders a hot chunk's holders per fetch);
    ``peers``: worker peers (``peer:ID``) and ``peer_of``: each slot's first-choice peer as an
    index into them, -1 for none."""

    sizes: np.ndarray
    replica_sets: tuple[tuple[str, ...], ...]
    set_of: np.ndarray
    extras: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    keys: np.ndarray | None = None
    peers: tuple[str, ...] = ()
    peer_of: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.sizes)
        if self.set_of.shape != (n,) or (self.keys is not None and self.keys.shape != (n,)):
            raise ValueError(f"every column of a fetch has one entry per chunk ({n})")
        if self.peer_of is not None:
            if self.peer_of.shape != (n,):
                raise ValueError(f"every column of a fetch has one entry per chunk ({n})")
            if n and (int(self.peer_of.min()) < -1 or int(self.peer_of.max()) >= len(self.peers)):
                raise ValueError("a chunk names a peer that is not in peers")
        if any(not is_peer(p) for p in self.peers):
            raise ValueError(f"peers are named {PEER_PREFIX}ID")
        if n and (int(self.set_of.min()) < 0 or int(self.set_of.max()) >= len(self.replica_sets)):
            raise ValueError("a chunk names a replica list that is not in replica_sets")
        if any(not s for s in self.replica_sets):
            raise ValueError("a chunk has no ring replica")

    @classmethod
    def of(cls, wants: Sequence[Want]) -> Wants:
        index: dict[tuple[str, ...], int] = {}
        set_of = np.array([index.setdefault(tuple(w.replicas), len(index)) for w in wants], dtype=np.int64)
        extras = {k: tuple(w.extras) for k, w in enumerate(wants) if w.extras}
        keys = np.array([key_point(w.id) for w in wants], dtype=np.uint64)
        return cls(np.array([w.size for w in wants], dtype=np.int64), tuple(index), set_of, extras, keys)

    def __len__(self) -> int:
        return len(self.sizes)


def wants_on_ring(chunks: ChunkRows, ring: Ring, replication: int, hot: Mapping[str, Sequence[str]] | None = None) -> Wants:
    """The wants of ``chunks`` placed on ``ring`` in one array pass: stored sizes, replica lists
    (``replication`` of them), and the extra holders of those that are ``hot`` (id -> servers)."""
    table, rows = chunks.table, chunks.rows
    keys = table.ring_keys[rows]
    sets, set_of = ring.placement_sets(keys, replication)
    extras: dict[int, tuple[str, ...]] = {}
    if hot:
        hot_keys = np.array([key_point(cid) for cid in hot], dtype=np.uint64)
        for slot in np.flatnonzero(np.isin(keys, hot_keys)).tolist():  # a few: their ids alone, in hex
            holders = hot.get(bytes(table.digests[int(rows[slot])]).hex())
            if holders:
                extras[slot] = tuple(holders)
    return Wants(table.stored_size[rows], sets, set_of, extras, keys)


def spread_rank(salt: int, key: int, server: str) -> int:
    """A salted order of a hot chunk's holders (rendezvous hashing): each fetch prefers another one."""
    digest = hashlib.blake2b(f"{salt}:{key}:{server}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class _ReadState:
    server: str
    slots: np.ndarray
    owed: int


class FetchPlanner:
    """Plan one fetch of ``wants`` over ``members`` (every server id, for the last-resort pass).

    ``reads_per_server(server)`` says how many reads may share one replica's chunks (e.g. one
    bulk connection, or a few gRPC streams); ``max_read_bytes`` caps one read so a late failure
    costs little and the earliest-wanted chunks go first.
    """

    def __init__(self, wants: Wants | Sequence[Want], members: Sequence[str],
                 reads_per_server: Callable[[str], int] = lambda _server: 1, max_read_bytes: int = 64 << 20,
                 salt: int = 0) -> None:
        self.wants = wants if isinstance(wants, Wants) else Wants.of(wants)
        self.members = list(members)
        self.reads_per_server = reads_per_server
        self.max_read_bytes = max_read_bytes
        self.salt = salt  # orders the holders of hot chunks (Wants.extras) on ties; vary it per fetch
        w = self.wants
        self._sizes = np.asarray(w.sizes, dtype=np.int64)
        self._set_of = np.asarray(w.set_of, dtype=np.int64)
        # Servers as bits: a replica list, the down servers and a chunk's tried ones are masks.
        names = list(dict.fromkeys([*self.members, *(s for rs in w.replica_sets for s in rs),
                                    *(s for ex in w.extras.values() for s in ex), *w.peers]))
        self._servers = names
        self._bit = {s: i for i, s in enumerate(names)}
        self._set_mask = [sum(1 << self._bit[s] for s in rs) for rs in w.replica_sets]
        self._set_order = [tuple(self._bit[s] for s in rs) for rs in w.replica_sets]
        self._hot = np.zeros(len(self._sizes), dtype=bool)
        if w.extras:
            self._hot[np.fromiter(w.extras, dtype=np.int64, count=len(w.extras))] = True
        self._peer_of = None if w.peer_of is None or not w.peers else np.asarray(w.peer_of, dtype=np.int64)
        self._owner = np.full(len(self._sizes), PENDING, dtype=np.int64)
        self._pending = len(self._sizes)  # slots neither landed nor given up
        self._attempts: dict[int, dict[str, str]] = {}
        self._corrupt: dict[int, set[str]] = {}
        self._reads: dict[int, _ReadState] = {}
        self._down: set[str] = set()
        self._broken: dict[int, set[str]] = {}  # slot -> replicas whose read broke while owing it
        self._retried: set[tuple[int, str]] = set()
        self._next_read = 0
        self.failovers = 0
        self.given_up: list[GiveUp] = []

    # ------------------------------------------------------------------ queries

    @property
    def done(self) -> bool:
        """Nothing in flight and nothing left to plan (every chunk landed, or the fetch gave up)."""
        return not self._reads and (not self._pending or bool(self.given_up))

    @property
    def landed_all(self) -> bool:
        return not self._pending and not self.given_up

    def pending(self) -> tuple[int, ...]:
        return tuple(np.flatnonzero(self._owner >= PENDING).tolist())

    def attempts(self, slot: int) -> dict[str, str]:
        return dict(self._attempts.get(slot, {}))

    def down(self) -> frozenset[str]:
        return frozenset(self._down)

    def in_flight(self) -> int:
        return len(self._reads)

    # ------------------------------------------------------------------ transitions

    def start(self) -> list[Decision]:
        return self._plan(np.arange(len(self._sizes), dtype=np.int64))

    def step(self, event: Event) -> list[Decision]:
        state = self._reads.get(event.read)
        if state is None:
            return []  # a read already closed (late event after a failure): never trusted
        if isinstance(event, Landed):
            slots = np.asarray(event.slots, dtype=np.int64)
            mine = slots[self._owner[slots] == event.read]
            if len(mine) > 1:
                mine = np.unique(mine)
            self._owner[mine] = LANDED
            state.owed -= len(mine)
            self._pending -= len(mine)
            self._close_if_empty(event.read, state)
            return []
        if isinstance(event, Refused):
            slot = event.slot
            if not 0 <= slot < len(self._owner) or self._owner[slot] != event.read:
                return []
            self._owner[slot] = PENDING
            state.owed -= 1
            self._note(slot, state.server, event.reason, event.corrupt)
            out: list[Decision] = []
            if event.report:
                out.append(ReportCorrupt(state.server, (slot,), event.reason))
            self._close_if_empty(event.read, state)
            out += self._plan(np.array([slot], dtype=np.int64))
            return out
        # ReadFailed / ReadEnded: what it still owed goes elsewhere
        leftovers = state.slots[self._owner[state.slots] == event.read]
        self._owner[leftovers] = PENDING
        del self._reads[event.read]
        if isinstance(event, ReadFailed):
            if event.replica_down:
                self._down.add(state.server)
            for slot in leftovers.tolist():
                self._note(slot, state.server, event.reason, False)
                self._broken.setdefault(slot, set()).add(state.server)
        else:
            for slot in leftovers.tolist():
                self._note(slot, state.server, "not sent", False)
        return self._plan(leftovers)

    # ------------------------------------------------------------------ internals

    def _close_if_empty(self, read: int, state: _ReadState) -> None:
        if state.owed <= 0:
            del self._reads[read]

    def _note(self, slot: int, server: str, reason: str, corrupt: bool) -> None:
        self._attempts.setdefault(slot, {})[server] = reason
        if corrupt:
            self._corrupt.setdefault(slot, set()).add(server)

    def _usable(self, slots: np.ndarray) -> tuple[list[int], np.ndarray]:
        """``(masks, mask_of)``: the distinct masks of usable ring replicas (not down, not tried)
        and each slot's index into them; a mask of 0 means no ring replica is left to ask."""
        down = sum(1 << self._bit[s] for s in self._down)
        masks: dict[int, int] = {}
        # Replica lists with the same usable servers (R of N=R servers in any order) share a mask.
        by_set = [m & ~down for m in self._set_mask]
        mask_of_set = np.array([masks.setdefault(m, len(masks)) for m in by_set], dtype=np.int64)
        set_of = self._set_of[slots]
        if not self._attempts:
            return list(masks), mask_of_set[set_of]
        masks = {}
        out = np.empty(len(slots), dtype=np.int64)
        bit = self._bit
        for k, (slot, s) in enumerate(zip(slots.tolist(), set_of.tolist())):
            m = by_set[s]
            tried = self._attempts.get(slot)
            if tried:
                for server in tried:
                    m &= ~(1 << bit[server])
            out[k] = masks.setdefault(m, len(masks))
        return list(masks), out

    def _plan(self, slots: np.ndarray) -> list[Decision]:
        """Plan ``slots`` that no read owes (others are skipped), in fetch order."""
        slots = np.sort(slots[self._owner[slots] == PENDING])
        if not len(slots):
            return []
        if self._attempts:
            self.failovers += sum(1 for s in slots.tolist() if s in self._attempts)
        reads: list[tuple[int, Read]] = []
        if self._peer_of is not None:
            slots, reads = self._plan_peers(slots)
            if not len(slots):
                reads.sort(key=lambda pr: pr[0])
                return [read for _, read in reads]
        total = int(self._sizes[slots].sum())
        slack = min(STICKY_BYTES, total // (16 * max(1, len(self.members))))
        load = [0] * len(self._servers)
        server_of = np.full(len(slots), -1, dtype=np.int64)
        masks, mask_of = self._usable(slots)
        mask_values = np.array([m != 0 for m in masks], dtype=bool)
        plain = mask_values[mask_of] & ~self._hot[slots]
        if plain.any():
            self._place_blocks(slots, np.flatnonzero(plain), masks, mask_of, slack, load, server_of)
        gave_up: list[Decision] = []
        for k in np.flatnonzero(~plain).tolist():
            best = self._place_one(int(slots[k]), load)
            if best is None:
                slot = int(slots[k])
                attempts = self._attempts.get(slot, {})
                bad = self._corrupt.get(slot, set())
                give_up = GiveUp(slot, dict(attempts), bool(attempts) and set(attempts) <= bad)
                self.given_up.append(give_up)
                self._owner[slot] = GAVE_UP
                self._pending -= 1
                gave_up.append(give_up)
            else:
                server_of[k] = best
        if self.given_up:
            for _, read in reads:  # planned to peers just now: never started
                for slot in read.slots.tolist():
                    if self._owner[slot] == read.read:
                        self._owner[slot] = PENDING
                del self._reads[read.read]
            return gave_up  # the fetch has failed: start nothing new
        order = np.argsort(server_of, kind="stable")
        placed = server_of[order]
        for b in np.unique(placed).tolist():
            lo, hi = np.searchsorted(placed, b, side="left"), np.searchsorted(placed, b, side="right")
            reads += self._reads_for(self._servers[b], slots[np.sort(order[lo:hi])])
        reads.sort(key=lambda pr: pr[0])  # the earliest-wanted chunks first
        return [read for _, read in reads]

    def _plan_peers(self, slots: np.ndarray) -> tuple[np.ndarray, list[tuple[int, Read]]]:
        """Open reads for the slots whose first-choice peer is still usable for them; returns the
        other slots (for the servers) and those reads."""
        assert self._peer_of is not None
        peers = self.wants.peers
        choice = self._peer_of[slots]
        use = choice >= 0
        if self._down and use.any():
            down = [k for k, p in enumerate(peers) if p in self._down]
            if down:
                use &= ~np.isin(choice, np.array(down, dtype=np.int64))
        if self._attempts and use.any():
            for k in np.flatnonzero(use).tolist():
                tried = self._attempts.get(int(slots[k]))
                if tried and peers[int(choice[k])] in tried:
                    use[k] = False
        reads: list[tuple[int, Read]] = []
        if use.any():
            for q in np.unique(choice[use]).tolist():
                reads += self._reads_for(peers[q], slots[use & (choice == q)])
        return slots[~use], reads

    def _place_blocks(self, slots: np.ndarray, picked: np.ndarray, masks: list[int], mask_of: np.ndarray, slack: int,
                      load: list[int], server_of: np.ndarray) -> None:
        """Place ``slots[picked]`` (each with a usable ring replica, none hot) a block at a time."""
        sizes = self._sizes[slots[picked]]
        mi = mask_of[picked]
        # Runs of neighbours whose usable replicas intersect: cut where the running AND would be empty.
        change = np.flatnonzero(mi[1:] != mi[:-1]) + 1
        run_starts = [0]
        run_masks = [masks[int(mi[0])]]
        if len(change):
            acc = run_masks[0]
            for at, m in zip(change.tolist(), [masks[i] for i in mi[change].tolist()]):
                if acc & m:
                    acc &= m
                else:
                    run_masks[-1] = acc
                    run_starts.append(at)
                    run_masks.append(m)
                    acc = m
            run_masks[-1] = acc
        starts = np.array(run_starts, dtype=np.int64)
        run_of = np.zeros(len(picked), dtype=np.int64)
        run_of[starts[1:]] = 1
        run_of = np.cumsum(run_of)
        # ... and each run into blocks of at most ``slack`` bytes.
        before = np.cumsum(sizes) - sizes
        within = before - before[starts][run_of]
        block = within // max(1, slack)
        new_block = np.ones(len(picked), dtype=bool)
        new_block[1:] = (run_of[1:] != run_of[:-1]) | (block[1:] != block[:-1])
        block_starts = np.flatnonzero(new_block)
        block_bytes = np.add.reduceat(sizes, block_starts)
        first_set = self._set_of[slots[picked[block_starts]]]
        chosen = np.empty(len(block_starts), dtype=np.int64)
        prev = -1
        set_order = self._set_order
        for k, (run, nbytes, s) in enumerate(zip(run_of[block_starts].tolist(), block_bytes.tolist(), first_set.tolist())):
            mask = run_masks[run]
            best = -1
            best_load = 0
            for b in set_order[s]:  # ring order of the block's first chunk: ties to the primary
                if mask >> b & 1 and (best < 0 or load[b] < best_load):
                    best, best_load = b, load[b]
            if prev >= 0 and prev != best and mask >> prev & 1 and load[prev] - best_load <= slack:
                best = prev
            load[best] += nbytes
            chosen[k] = prev = best
        counts = np.diff(np.append(block_starts, len(picked)))
        server_of[picked] = np.repeat(chosen, counts)

    def _place_one(self, slot: int, load: list[int]) -> int | None:
        """The server for one chunk planned on its own (hot, or no ring replica left); None: give up."""
        candidates = self._candidates(slot)
        if not candidates:
            return None
        bit = self._bit
        if self._hot[slot]:
            key = int(self.wants.keys[slot]) if self.wants.keys is not None else slot
            best = min(candidates, key=lambda s: (load[bit[s]], spread_rank(self.salt, key, s)))
        else:
            best = candidates[0]  # least loaded; ties to the earliest in ring order
            for s in candidates[1:]:
                if load[bit[s]] < load[bit[best]]:
                    best = s
        self._down.discard(best)  # a last-resort pick gets its chance
        load[bit[best]] += int(self._sizes[slot])
        return bit[best]

    def _candidates(self, slot: int) -> list[str]:
        tried = self._attempts.get(slot, {})
        replicas = self.wants.replica_sets[int(self._set_of[slot])]
        extras = self.wants.extras.get(slot, ())
        holders = (*replicas, *(s for s in extras if s not in replicas))
        ring = [s for s in holders if s not in tried and s not in self._down]
        if ring:
            return ring
        others = [s for s in self.members if s not in tried and s not in self._down]
        if others:
            return others
        # Last resort before giving up: a replica whose read broke earlier (it may be back), once
        # more; never one that refused the chunk or served bad bytes.
        again = [s for s in (*replicas, *self.members) if s not in tried]
        if again:
            return again
        retry = [s for s in self._broken.get(slot, ()) if (slot, s) not in self._retried]
        for s in retry[:1]:
            self._retried.add((slot, s))
            del self._attempts[slot][s]
        return retry[:1]

    def _reads_for(self, server: str, slots: np.ndarray) -> list[tuple[int, Read]]:
        """(first slot, read) of the reads that ask ``server`` for ``slots`` (in fetch order)."""
        streams = max(1, self.reads_per_server(server))
        ends = np.cumsum(self._sizes[slots])
        total = int(ends[-1]) if len(ends) else 0
        # Split in ``streams`` contiguous runs, each cut again at max_read_bytes: a read closes at
        # the first chunk that brings it to ``cap`` bytes.
        cap = max(1, min(-(-total // streams), self.max_read_bytes))
        reads: list[tuple[int, Read]] = []
        start, before = 0, 0
        while start < len(slots):
            stop = min(int(np.searchsorted(ends, before + cap, side="left")) + 1, len(slots))
            reads.append((int(slots[start]), self._open(server, slots[start:stop], int(ends[stop - 1]) - before)))
            start, before = stop, int(ends[stop - 1])
        return reads

    def _open(self, server: str, slots: np.ndarray, nbytes: int) -> Read:
        number = self._next_read
        self._next_read += 1
        self._reads[number] = _ReadState(server, slots, len(slots))
        self._owner[slots] = number
        return Read(number, server, slots, nbytes)


__all__ = [
    "Decision", "Event", "FetchPlanner", "GiveUp", "Landed", "Read", "ReadEnded", "ReadFailed", "Refused", "ReportCorrupt",
    "PEER_PREFIX", "STICKY_BYTES", "Want", "Wants", "is_peer", "spread_rank", "wants_on_ring",
]
