"""Anti-entropy: every server makes sure each chunk it holds is on all of that
chunk's ring replicas, pushing copies to the ones that lack it.

This is what restores R copies after a server comes back (a push made while it
was down reached only W replicas), and what moves about 1/N of the chunks when
a member joins or leaves: the ring changes, and the new owners get copies.
Driven by explicit ``step()`` calls so tests control when it runs. A push in
flight needs no help: the client writes every replica itself.

A pass costs a walk of the whole store and a HasChunks of every chunk on every peer, so
after a clean pass (every replica complete, every peer reached) the next ones are skipped
while nothing that could leave a replica missing has changed: the members, R, what this store
lost (a deletion, a quarantine) and the set of committed chunks. Chunks arriving do not count:
a push writes every replica itself, and a busy push would otherwise rerun the whole pass every
interval. Every ``full_pass_every`` steps a pass runs
anyway, for what this server cannot see (a peer that lost files while it stayed up).

A peer whose disk is full answers a push with RESOURCE_EXHAUSTED: it is then left alone (no
HasChunks, no push) for a back-off of ``full_backoff_s`` (doubling, up to
``max_full_backoff_s``, while it stays full) and tried again after; this is logged once at
WARNING when it starts and once at INFO when the peer takes copies again, never per chunk.

Hand-off: a chunk this server holds but the ring no longer places here (a server joined, or this
one is leaving) is deleted once every one of its ring replicas was found holding it in the same
pass (HasChunks; a copy just sent counts from the next pass), unless a push claimed it since
the pass began or ``keep`` says to (the hot-chunk extras, held here on purpose). Without it a
scale-out would leave every old copy where it was, and disk use on the old servers would not fall.

``placement()`` says which ring this server's chunks are known to be placed on: the up members
of the last clean pass (every referenced chunk it holds found on all its ring replicas, every
peer reached). ``paramctl member drain`` compares it with the current ring on every member to
tell when a leaving server holds nothing that exists nowhere else.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Hashable, Iterator

import grpc

from consensus.records import MemberRecord

from paramserver.server.cluster import ParamServerClient, PeerSet
from paramserver.wire.chunk_record import ChunkRecord
from paramserver.server.errors import ParamServerError
from paramserver.wire.ring import Ring, points_of
from paramserver.wire.status_keys import PLACEMENT_AT_KEY, PLACEMENT_RING_KEY
from paramserver.server.store import ChunkStore

log = logging.getLogger(__name__)


@dataclass
class ReplicationReport:
    scanned: int = 0
    checked: int = 0  # (chunk, replica) pairs asked about
    copied: int = 0
    bytes_copied: int = 0
    missing: int = 0  # (chunk, replica) pairs found missing (and sent)
    handed_off: int = 0  # chunks deleted here because all their ring replicas hold them
    unreachable: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)  # replicas whose disk is full: not pushed to this pass
    skipped: bool = False  # nothing changed since the last clean pass


class PassGate:
    """Whether an anti-entropy pass is due: always, unless the last pass was clean and the
    state it saw is unchanged; and at least every ``full_pass_every`` steps. Pure logic."""

    def __init__(self, full_pass_every: int = 10) -> None:
        if full_pass_every < 1:
            raise ValueError(f"full_pass_every must be >= 1, got {full_pass_every}")
        self.full_pass_every = full_pass_every
        self._clean: Hashable | None = None
        self._skipped = 0

    def due(self, state: Hashable) -> bool:
        if self._clean is None or state != self._clean or self._skipped + 1 >= self.full_pass_every:
            return True
        self._skipped += 1
        return False

    def record(self, state: Hashable, *, clean: bool) -> None:
        self._clean = state if clean else None
        self._skipped = 0


class ReReplicator:
    def __init__(
        self,
        peers: PeerSet,
        store: ChunkStore,
        *,
        references: Callable[[], frozenset[str] | set[str] | None] | None = None,
        keep: Callable[[str], bool] | None = None,
        batch: int = 4096,
        push_batch_bytes: int = 4 << 20,
        full_pass_every: int = 10,
        full_backoff_s: float = 30.0,
        max_full_backoff_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.peers = peers
        # Only chunks of committed versions are copied: copying orphans would hand
        # them back to servers that just collected them, and they would never die.
        self.references = references
        self.keep = keep  # chunks held here on purpose though the ring places them elsewhere
        self.store = store
        self.batch = batch
        self.push_batch_bytes = push_batch_bytes
        self.gate = PassGate(full_pass_every)
        self.full_backoff_s = full_backoff_s
        self.max_full_backoff_s = max_full_backoff_s
        self.clock = clock
        self._full: dict[str, tuple[float, float]] = {}  # server -> (retry at, current back-off)
        self._placed: tuple[tuple[str, ...], float] | None = None  # (ring of the last clean pass, wall time)

    def step(self) -> ReplicationReport:
        report = ReplicationReport()
        ring = self.peers.ring()
        if not len(ring):
            self._placed = None
            return report
        if ring.servers == [self.peers.self_id]:
            self._placed = (tuple(ring.servers), time.time())  # no other replica to check or copy to
            return report
        r = min(self.peers.replication_factor, len(ring))
        members = self.peers.members()
        refs = self.references() if self.references is not None else None
        state = (self.store.loss_generation, r, frozenset(members.values()), None if refs is None else frozenset(refs))
        if not self.gate.due(state):
            report.skipped = True
            return report
        report = self._pass(report, ring, r, members, refs)
        clean = not report.unreachable and not report.missing and not report.full
        self.gate.record(state, clean=clean)
        self._placed = (tuple(sorted(ring.servers)), time.time()) if clean else None
        return report

    def placement(self) -> dict[str, str]:
        """ServerStatus extras: the ring (up members, sorted, comma-separated) on which every committed
        chunk this server holds was last found complete, and when; empty before a clean pass."""
        placed = self._placed
        if placed is None:
            return {}
        return {PLACEMENT_RING_KEY: ",".join(placed[0]), PLACEMENT_AT_KEY: f"{placed[1]:.3f}"}

    def _pass(self, report: ReplicationReport, ring: Ring, r: int, members: dict[str, MemberRecord],
              refs: frozenset[str] | set[str] | None) -> ReplicationReport:
        started = time.time()  # a chunk a push claims after this is not handed off in this pass
        stored = list(self.store.iter_ids())
        report.scanned = len(stored)
        ids = stored if refs is None else [cid for cid in stored if cid in refs]
        # Placed and grouped by replica set as arrays (a walk of the ring, or a tuple, per chunk
        # cost seconds a pass on a store of half a million chunks, every pass).
        points = points_of(ids)
        if points is not None:
            by_placement = {placed: [ids[k] for k in rows.tolist()]
                            for placed, rows in ring.placement_groups_by_point(points, r).items()}
        else:
            by_placement = {}
            for chunk_id, placed in zip(ids, ring.replicas_many(ids, r)):
                by_placement.setdefault(placed, []).append(chunk_id)
        wanted: dict[str, list[str]] = {}
        for placed, group in by_placement.items():
            for server in placed:
                if server != self.peers.self_id:
                    wanted.setdefault(server, []).extend(group)
        now = self.clock()
        found: dict[str, set[str]] = {}  # replica -> the chunks it was found holding (not sent to it) this pass
        for server, ids in wanted.items():
            member = members.get(server)
            if member is None:
                continue
            backoff = self._full.get(server)
            if backoff is not None and now < backoff[0]:
                report.full.append(server)  # its disk was full a moment ago: do not push at it yet
                continue
            try:
                for start in range(0, len(ids), self.batch):
                    part = ids[start:start + self.batch]
                    missing, copied, nbytes = self.peers.call(member, partial(self._copy_batch, part=part))
                    report.checked += len(part)
                    report.missing += len(missing)
                    found.setdefault(server, set()).update(part)
                    found[server].difference_update(missing)
                    report.copied += copied
                    report.bytes_copied += nbytes
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._target_full(server, exc)
                    report.full.append(server)
                    continue
                # A replica that is down is the normal case this task exists for; try it next round.
                report.unreachable.append(server)
                log.debug("re-replication to %s skipped: %s", server, code or exc)
                continue
            if backoff is not None:
                del self._full[server]
                log.info("re-replication to %s resumed: it accepts copies again", server)
        if report.copied:
            log.info("re-replication copied %d chunks (%d bytes)", report.copied, report.bytes_copied)
        self._hand_off(report, by_placement, found, started)
        return report

    def _hand_off(self, report: ReplicationReport, by_placement: dict[tuple[str, ...], list[str]],
                  found: dict[str, set[str]], started: float) -> None:
        me, keep = self.peers.self_id, self.keep
        moved = [cid for placed, group in by_placement.items() if me not in placed
                 for cid in group if all(cid in found.get(s, ()) for s in placed) and not (keep is not None and keep(cid))]
        if not moved:
            return
        report.handed_off = len(self.store.delete_unclaimed(moved, started))
        if report.handed_off:
            log.info("hand-off: deleted %d chunks the ring places on other servers, each found on all its replicas",
                     report.handed_off)

    def _copy_batch(self, client: ParamServerClient, part: list[str]) -> tuple[list[str], int, int]:
        """HasChunks of ``part`` on a peer, then a push of what it lacks: (the missing ids, copied, bytes sent)."""
        missing = [cid for cid, ok in zip(part, client.has_chunks(part)) if not ok]
        if not missing:
            return [], 0, 0
        sent = [0]
        reply = client.put_chunks(self._chunks(missing, sent), batch_bytes=self.push_batch_bytes)
        return missing, int(reply.chunks_stored), sent[0]

    def _target_full(self, server: str, exc: grpc.RpcError) -> None:
        previous = self._full.get(server)
        delay = self.full_backoff_s if previous is None else min(self.max_full_backoff_s, previous[1] * 2)
        self._full[server] = (self.clock() + delay, delay)
        if previous is None:
            details = exc.details() if hasattr(exc, "details") else str(exc)
            log.warning("re-replication to %s paused: it refused copies with RESOURCE_EXHAUSTED (%s); retrying in %.0f s, "
                        "backing off up to %.0f s while it stays full", server, details, delay, self.max_full_backoff_s)

    def full_targets(self) -> list[str]:
        """The replicas re-replication currently leaves alone because their disk was full."""
        now = self.clock()
        return sorted(s for s, (until, _) in self._full.items() if now < until)

    def _chunks(self, ids: list[str], sent: list[int]) -> Iterator[ChunkRecord]:
        for cid in ids:
            try:
                c = self.store.get(cid, use_cache=False)
            except ParamServerError:
                continue  # corrupt or deleted since the scan: the repair queue owns it now
            sent[0] += len(c.data)
            yield ChunkRecord(c.id, c.codec, c.raw_size, c.crc32c, c.data)


__all__ = ["PassGate", "ReReplicator", "ReplicationReport"]
