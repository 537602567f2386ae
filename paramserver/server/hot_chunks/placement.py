"""``HotChunks``: one server's hot-chunk state wired to its store and peers: reads are tracked, the
hot set is placed as extra copies on the next servers of the ring, and the extras held are expired."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from paramserver.server.errors import ParamServerError
from paramserver.server.hot_chunks.config import HotConfig
from paramserver.server.hot_chunks.extras import ExtraCopies
from paramserver.server.hot_chunks.rates import HotPolicy, RateTracker
from paramserver.wire.limits import MAX_HOT_CHUNKS_ADVERTISED, MiB
from paramserver.wire.proto import pb

if TYPE_CHECKING:
    from paramserver.server.cluster import PeerSet
    from paramserver.server.store import ChunkStore

# One logger for hot chunks, under the name it had before hot_chunks became a package.
log = logging.getLogger("paramserver.server.hot_chunks")


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
