"""Re-replication towards a peer that just came back: one more try on a fresh channel, not the old one's back-off."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import grpc
import pytest

from chunking.hashing import content_id, crc32c
from consensus.records import MemberRecord
from paramserver.client.rpc import ChunkData
from paramserver.server.cluster import PeerSet
from paramserver.server.replication import ReReplicator
from paramserver.server.store import ChunkStore
from paramserver.wire.proto import pb
from paramserver.wire.ring import RingConfig
from paramserver.wire.status_keys import PLACEMENT_AT_KEY, PLACEMENT_RING_KEY
from tests.conftest import FakeRpcError


class Peer:
    """A peer client: ``fail`` is raised by every call while set (a channel still in reconnect back-off)."""

    def __init__(self, fail: grpc.StatusCode | None = None) -> None:
        self.fail = fail
        self.stored: set[str] = set()
        self.calls = 0

    def has_chunks(self, ids: list[str]) -> list[bool]:
        self.calls += 1
        if self.fail is not None:
            raise FakeRpcError(self.fail)
        return [cid in self.stored for cid in ids]

    def put_chunks(self, chunks: Iterable[ChunkData], batch_bytes: int = 0) -> pb.PutChunksReply:
        self.calls += 1
        if self.fail is not None:
            raise FakeRpcError(self.fail)
        reply = pb.PutChunksReply()
        for c in chunks:
            self.stored.add(c.id)
            reply.chunks_stored += 1
        return reply


class Peers(PeerSet):
    def __init__(self, first: Peer, fresh: Peer, self_state: str = "up") -> None:
        members = [MemberRecord("ps1", "127.0.0.1:1", "127.0.0.1:2", self_state), MemberRecord("ps2", "127.0.0.1:3", "127.0.0.1:4")]
        super().__init__("ps1", lambda: members, ring_config=RingConfig(vnodes=16), replication_factor=2)
        self.current, self.fresh = first, fresh
        self.reconnects = 0

    def client(self, member: MemberRecord) -> Peer:  # type: ignore[override]
        assert member.server_id == "ps2"
        return self.current

    def reconnect(self, member: MemberRecord, failed: Peer) -> Peer:  # type: ignore[override]
        assert failed is self.current
        self.reconnects += 1
        self.current = self.fresh
        return self.fresh


def _store(tmp_path: Path, n: int = 20) -> tuple[ChunkStore, set[str]]:
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False)
    ids = set()
    for _ in range(n):
        data = os.urandom(4096)
        cid = content_id(data)
        store.put(cid, data, "raw", len(data), crc32c(data))
        ids.add(cid)
    return store, ids


def test_a_peer_back_from_a_restart_gets_its_copies_in_the_same_pass(tmp_path: Path) -> None:
    store, ids = _store(tmp_path)
    stale, fresh = Peer(fail=grpc.StatusCode.UNAVAILABLE), Peer()
    peers = Peers(stale, fresh)
    report = ReReplicator(peers, store, batch=8).step()
    assert peers.reconnects == 1 and stale.calls == 1
    assert fresh.stored == ids and report.copied == len(ids) and not report.unreachable
    assert report.checked == len(ids) and report.missing == len(ids) and report.bytes_copied == 4096 * len(ids)
    store.close()


def test_a_peer_still_down_costs_one_fresh_channel_per_pass_and_is_reported(tmp_path: Path) -> None:
    store, _ids = _store(tmp_path)
    stale, fresh = Peer(fail=grpc.StatusCode.UNAVAILABLE), Peer(fail=grpc.StatusCode.UNAVAILABLE)
    peers = Peers(stale, fresh)
    report = ReReplicator(peers, store, batch=8).step()
    assert peers.reconnects == 1 and fresh.calls == 1
    assert report.unreachable == ["ps2"] and report.copied == 0 and report.checked == 0
    store.close()


@pytest.mark.parametrize("code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.PERMISSION_DENIED])
def test_other_failures_keep_the_channel(tmp_path: Path, code: grpc.StatusCode) -> None:
    store, _ids = _store(tmp_path)
    peers = Peers(Peer(fail=code), Peer())
    report = ReReplicator(peers, store, batch=8).step()
    assert peers.reconnects == 0 and report.unreachable == ["ps2"]
    store.close()


def test_placement_names_the_ring_of_the_last_clean_pass_only(tmp_path: Path) -> None:
    """What `paramctl member drain` reads: set by a pass that found every copy, cleared by one that
    had to copy or could not reach a peer."""
    store, ids = _store(tmp_path)
    peer = Peer()
    rr = ReReplicator(Peers(peer, Peer()), store, batch=8, full_pass_every=1)
    assert rr.placement() == {}
    assert rr.step().copied == len(ids) and rr.placement() == {}  # it had to copy: not known complete yet
    assert rr.step().missing == 0
    placed = rr.placement()
    assert placed[PLACEMENT_RING_KEY] == "ps1,ps2" and float(placed[PLACEMENT_AT_KEY]) > 0
    peer.fail = grpc.StatusCode.DEADLINE_EXCEEDED
    assert rr.step().unreachable == ["ps2"] and rr.placement() == {}
    store.close()


def test_a_leaving_server_copies_everything_to_the_ring_without_it_even_a_ring_of_one(tmp_path: Path) -> None:
    store, ids = _store(tmp_path)
    peer = Peer()
    rr = ReReplicator(Peers(peer, Peer(), self_state="leaving"), store, batch=8)
    assert rr.step().copied == len(ids) and peer.stored == ids
    assert rr.step().missing == 0 and rr.placement()[PLACEMENT_RING_KEY] == "ps2"
    store.close()


def test_hand_off_deletes_what_the_ring_places_elsewhere_once_every_replica_was_found_holding_it(tmp_path: Path) -> None:
    """A leaving server (the ring is ps2 alone): the pass that copies keeps its copies, the next one,
    finding them on ps2, deletes them, except the ones ``keep`` names (hot-chunk extras)."""
    store, ids = _store(tmp_path)
    kept = sorted(ids)[:3]
    peer = Peer()
    rr = ReReplicator(Peers(peer, Peer(), self_state="leaving"), store, batch=8, keep=kept.__contains__)
    first = rr.step()
    assert first.copied == len(ids) and first.handed_off == 0 and set(store.iter_ids()) == ids
    second = rr.step()
    assert second.handed_off == len(ids) - 3 and sorted(store.iter_ids()) == kept and peer.stored == ids
    store.close()


def test_hand_off_waits_for_every_replica_and_never_touches_a_chunk_placed_here(tmp_path: Path) -> None:
    store, ids = _store(tmp_path)
    peer = Peer()
    peer.stored = set(ids)
    up = ReReplicator(Peers(peer, Peer()), store, batch=8, full_pass_every=1)  # ps1 and ps2 are both replicas (R=2)
    assert up.step().handed_off == 0 and set(store.iter_ids()) == ids
    peer.fail = grpc.StatusCode.DEADLINE_EXCEEDED  # a replica not reached: nothing is known to be there
    leaving = ReReplicator(Peers(peer, Peer(), self_state="leaving"), store, batch=8)
    assert leaving.step().handed_off == 0 and set(store.iter_ids()) == ids
    store.close()
