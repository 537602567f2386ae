"""Pure parts of the cluster client: monotonic reads, replica choice, model references."""
from __future__ import annotations

from pathlib import Path

import pytest

from paramserver.client.errors import StaleRead
from paramserver.client.refs import BadModelRef
from paramserver.client.refs import ModelRef
from paramserver.client.monotonic import MonotonicReads, Order, Resolution, compare_clocks, judge


def res(version: int, clock: dict[str, int], commit: int, server: str = "s") -> Resolution:
    return Resolution("m", "prod", version, f"{version:064x}", clock, commit, server)


class TestClocks:
    def test_orders(self) -> None:
        assert compare_clocks({"a": 2}, {"a": 1}) is Order.AFTER
        assert compare_clocks({"a": 1}, {"a": 2}) is Order.BEFORE
        assert compare_clocks({"a": 1, "b": 0}, {"a": 1}) is Order.EQUAL
        assert compare_clocks({"a": 2}, {"b": 1}) is Order.CONCURRENT
        assert compare_clocks({"a": 1, "b": 1}, {"a": 1}) is Order.AFTER


class TestJudge:
    def test_first_and_newer_accepted(self) -> None:
        assert judge(None, res(1, {"p": 1}, 5)).accepted
        assert judge(res(1, {"p": 1}, 5), res(2, {"p": 2}, 9)).accepted
        assert judge(res(2, {"p": 2}, 9), res(2, {"p": 2}, 9)).accepted

    def test_older_from_stale_server_refused(self) -> None:
        v = judge(res(2, {"p": 2}, 9), res(1, {"p": 1}, 5, server="ps3"))
        assert not v.accepted
        assert "ps3" in v.reason and "v1" in v.reason and "v2" in v.reason

    def test_older_with_same_commit_index_refused(self) -> None:
        assert not judge(res(2, {"p": 2}, 9), res(1, {"p": 1}, 9)).accepted

    def test_rollback_proven_by_later_commit_accepted_unless_disabled(self) -> None:
        seen, back = res(2, {"p": 2}, 9), res(1, {"p": 1}, 12)
        assert judge(seen, back).accepted
        assert not judge(seen, back, allow_rollback=False).accepted

    def test_a_lagging_server_cannot_undo_a_rollback(self) -> None:
        """The tag went v2 -> v3 -> back to v2 (seen at index 20); a server that applied only up to
        index 15 still answers v3, whose clock is after v2's: that was accepted, and undid the rollback."""
        seen = res(2, {"p": 2}, 20)
        stale = judge(seen, res(3, {"p": 3}, 15, server="ps3"))
        assert not stale.accepted and "ps3" in stale.reason and "older state" in stale.reason
        assert judge(seen, res(3, {"p": 3}, 21)).accepted  # moved forward again, after what was seen
        assert judge(seen, res(3, {"p": 3}, 0)).accepted  # no index to compare (a server from before): the clock decides

    def test_concurrent_refused_without_fresher_commit(self) -> None:
        assert not judge(res(2, {"a": 2}, 9), res(3, {"b": 1}, 8)).accepted

    def test_versions_with_one_clock_are_judged_as_concurrent(self) -> None:
        """Forced siblings committed before each got a clock of its own share one: a deliberate tag
        move between them (a newer commit index) is followed, a stale answer is not."""
        seen = res(2, {"alice": 2}, 9)
        moved = judge(seen, res(3, {"alice": 2}, 12))
        assert moved.accepted and "commit index 12" in moved.reason
        stale = judge(seen, res(3, {"alice": 2}, 8))
        assert not stale.accepted and "concurrent with v2" in stale.reason

    def test_no_clocks_falls_back_to_version_numbers(self) -> None:
        assert judge(res(2, {}, 0), res(3, {}, 0)).accepted
        assert not judge(res(3, {}, 0), res(2, {}, 0)).accepted


class TestMonotonicReads:
    def test_accept_then_refuse_and_persist(self, tmp_path: Path) -> None:
        path = tmp_path / "seen.json"
        mem = MonotonicReads(path)
        mem.accept(res(2, {"p": 2}, 9))
        with pytest.raises(StaleRead, match="older than"):
            mem.accept(res(1, {"p": 1}, 3))
        again = MonotonicReads(path)  # a restarted worker remembers
        assert again.seen("m", "prod") == res(2, {"p": 2}, 9)
        with pytest.raises(StaleRead):
            again.accept(res(1, {"p": 1}, 3))

    def test_same_version_from_lagging_server_keeps_highest_commit_index(self) -> None:
        mem = MonotonicReads()
        mem.accept(res(2, {"p": 2}, 9))
        mem.accept(res(2, {"p": 2}, 4))
        seen = mem.seen("m", "prod")
        assert seen is not None and seen.commit_index == 9
        # A rollback must still be proven against commit index 9, not 4.
        with pytest.raises(StaleRead):
            mem.accept(res(1, {"p": 1}, 6))

    def test_unreadable_file_says_what_to_do(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.json"
        path.write_text("{nope")
        with pytest.raises(StaleRead, match="delete it"):
            MonotonicReads(path)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TestModelRef:
    def test_parse(self) -> None:
        assert ModelRef.parse("resnet50:prod") == ModelRef("resnet50", "prod", None)
        assert ModelRef.parse("resnet50@3") == ModelRef("resnet50", None, 3)
        assert ModelRef.parse("m:v3") == ModelRef("m", "v3", None)
        assert str(ModelRef.parse("m@12")) == "m@12"
        assert ModelRef.parse("resnet50") == ModelRef("resnet50", None, None)  # its latest version

    @pytest.mark.parametrize("bad", ["", "m:", "m@", "m@0", "m@x", "m:a:b", "a b:c", ":tag", "ft@\u0663", "ft@\uff13"])
    def test_refuses_bad(self, bad: str) -> None:
        with pytest.raises(BadModelRef, match="MODEL:TAG"):
            ModelRef.parse(bad)


def test_client_ring_matches_the_servers_placement() -> None:
    """The worker must find chunks where the servers put them: same members -> same replicas."""
    import hashlib

    from consensus.records import MemberRecord
    from paramserver.server.cluster import PeerSet
    from paramserver.wire.proto import pb
    from paramserver.wire.ring import RingConfig
    from paramserver.client.cluster_view import ClusterOptions, ClusterView
    from paramserver.client.rpc import ParamServerClient

    records = [MemberRecord(f"ps{i}", f"127.0.0.1:{7000 + i}", f"127.0.0.1:{7100 + i}", "up", f"z{i % 2}") for i in range(5)]
    records.append(MemberRecord("gone", "127.0.0.1:7999", "127.0.0.1:7998", "leaving", "z0"))
    info = pb.ClusterInfoReply(
        server_id="ps0", leader_id="ps0", term=3,
        members=[pb.Member(server_id=m.server_id, grpc_address=m.grpc_address, raft_address=m.raft_address,
                           state=m.state, zone=m.zone) for m in records],
        ring=pb.RingParams(vnodes=128, replication_factor=3, write_quorum=2, hash="blake3"),
    )
    client = ClusterView(ClusterOptions(("127.0.0.1:1",)), info, ParamServerClient("127.0.0.1:1"))
    try:
        peers = PeerSet("ps0", lambda: records, ring_config=RingConfig(vnodes=128), replication_factor=3)
        for i in range(300):
            cid = hashlib.sha256(str(i).encode()).hexdigest()
            assert client.replicas(cid) == peers.ring().replicas(cid, 3)
            assert "gone" not in client.replicas(cid)
    finally:
        client.close()
