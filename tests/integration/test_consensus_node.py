"""MetadataNode in-process: error mapping, link keepalive, encryption."""
from __future__ import annotations

import importlib.util
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest

from consensus import Conflict, MemberRecord, MetadataNode, NodeNotStarted, NoQuorum, NotFound, NotLeader, RaftConfig
from consensus.records import VersionRecord

from .consensus_harness import free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
M1, M2 = "1" * 64, "2" * 64


def make_nodes(tmp_path: Path, size: int = 3, **tuning: object) -> list[MetadataNode]:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(size)]
    return [
        MetadataNode(RaftConfig(f"n{i}", a, tuple(p for p in addresses if p != a), tmp_path / f"n{i}", **tuning))
        for i, a in enumerate(addresses)
    ]


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[MetadataNode]]:
    started = make_nodes(tmp_path)
    try:
        for n in started:
            n.start()
        for n in started:
            assert n.wait_ready(60)
        yield started
    finally:
        for n in started:
            n.close()


def test_records_and_typed_errors_through_a_follower(nodes: list[MetadataNode]) -> None:
    follower = next(n for n in nodes if not n.is_leader())
    v1 = follower.commit_version("m", M1, None, "alice", 10, 1, created_at=5.0, tag="prod")
    assert isinstance(v1, VersionRecord) and v1.created_at == 5.0 and dict(v1.clock) == {"alice": 1}
    follower.commit_version("m", M2, 1, "alice", 10, 1)
    with pytest.raises(Conflict):
        follower.commit_version("m", M2, 1, "bob", 10, 1)
    with pytest.raises(NotFound):
        follower.rollback_tag("m", "nope", "ops")
    read = follower.resolve_tag("m", "latest", linearizable=True)
    assert read.linearizable and read.value.number == 2 and read.commit_index >= 3
    tags = follower.list_tags("m").value
    assert [t.tag for t in tags] == ["latest", "prod"] and tags[0].history[-1].to_version == 2
    assert follower.head("m").value.number == 2
    status = follower.status()
    assert status["leader"] == follower.leader_raft_address() and len(status["cluster"]) == 3


def test_the_clock_rule_waits_for_every_member_to_apply_it(nodes: list[MetadataNode]) -> None:
    """bob commits v2 on v1, alice forces v3 on v1, then alice commits on the head: rule 2 gives that
    commit a key of its own (alice's count 1 is v3's), rule 1 the plain count. While one member's
    record is from a server that applies rule 1 only, every node proposes rule 1."""
    from consensus.state import CLOCK_RULE

    follower = next(n for n in nodes if not n.is_leader())
    addresses = [n.config.raft_address for n in nodes]
    for i, n in enumerate(nodes):  # n0 registers as a server from before the field (rule 1)
        follower.add_member(MemberRecord(n.server_id, f"127.0.0.1:{7000 + i}", addresses[i], clock_rule=1 if i == 0 else CLOCK_RULE))

    def forked_commit(model: str) -> dict[str, int]:
        follower.commit_version(model, M1, None, "ops", 10, 1)
        follower.commit_version(model, M2, 1, "bob", 10, 1)
        follower.commit_version(model, M2, 1, "alice", 10, 1, force=True)
        return dict(follower.commit_version(model, M1, 2, "alice", 10, 1).clock)

    assert forked_commit("old") == {"ops": 1, "bob": 1, "alice": 1}
    follower.add_member(MemberRecord(nodes[0].server_id, "127.0.0.1:7000", addresses[0], clock_rule=CLOCK_RULE))
    assert forked_commit("new") == {"ops": 1, "bob": 1, "alice/v4": 1}
    wait_until(lambda: all(len(n.list_versions("new").value) == 4 for n in nodes), 30)
    for n in nodes:  # every replica applied the commands to the same clocks
        assert [dict(v.clock) for v in n.list_versions("new").value] == [dict(v.clock) for v in follower.list_versions("new").value]


def test_in_sync_means_applied_up_to_the_leaders_commit_index(nodes: list[MetadataNode]) -> None:
    leader = next(n for n in nodes if n.is_leader())
    leader.commit_version("m", M1, None, "alice", 10, 1)
    wait_until(lambda: all(n.in_sync() for n in nodes), 30)
    follower = next(n for n in nodes if not n.is_leader())
    so = follower._syncobj
    assert so is not None
    # A follower still catching up has raftCommitIndex == raftLastApplied (it caps its commit
    # index at the log it holds); only the leader's commit index tells it that it is behind.
    # The leader's heartbeats overwrite what is set here, so a few tries: one is enough.
    def behind_is_seen() -> bool:
        so._SyncObj__leaderCommitIndex = so.raftLastApplied + 5  # as an AppendEntries would say
        return not follower.in_sync()

    assert so.raftCommitIndex <= so.raftLastApplied
    assert any(behind_is_seen() for _ in range(20))
    wait_until(follower.in_sync, 30)  # the next heartbeat brings the true commit index back


def test_follower_links_stay_up_past_the_connection_timeout(tmp_path: Path) -> None:
    # Without keepalives the follower-follower link expires after connection_timeout of
    # silence and the next vote request on it is dropped (pysyncobj issue 172).
    started = make_nodes(tmp_path, connection_timeout=1.5, link_keepalive_period=0.2)
    try:
        for n in started:
            n.start()
        for n in started:
            assert n.wait_ready(60)
        leader = next(n for n in started if n.is_leader())
        a, b = [n for n in started if n is not leader]
        so_a = a._syncobj
        assert so_a is not None
        peer_b = next(p for p in so_a.otherNodes if p.address == b.config.raft_address)
        wait_until(lambda: so_a.isNodeConnected(peer_b), 30)
        # pysyncobj expires a link lazily, on the next send, once nothing was read on it for
        # connection_timeout; so what matters is how long the link has been silent.
        conn = so_a._SyncObj__transport._connections[peer_b]
        deadline = time.monotonic() + 4.0  # well past connection_timeout
        while time.monotonic() < deadline:
            assert so_a.isNodeConnected(peer_b)
            assert time.monotonic() - conn._TcpConnection__lastReadTime < 1.5
            time.sleep(0.1)
    finally:
        for n in started:
            n.close()


def test_no_quorum_when_the_majority_is_down(tmp_path: Path) -> None:
    lonely = make_nodes(tmp_path, commit_timeout=1.0)[0]
    lonely.start()
    try:
        assert not lonely.wait_ready(0.5)
        with pytest.raises(NoQuorum, match="majority"):
            lonely.commit_version("m", M1, None, "alice", 1, 1)
    finally:
        lonely.close()


def test_unstarted_node_says_so(tmp_path: Path) -> None:
    node = make_nodes(tmp_path)[0]
    with pytest.raises(NodeNotStarted, match="start"):
        node.list_models()


@pytest.mark.skipif(importlib.util.find_spec("cryptography") is None, reason="a cluster secret needs cryptography")
def test_encrypted_cluster_commits(tmp_path: Path) -> None:
    started = make_nodes(tmp_path, secret="correct horse")
    try:
        for n in started:
            n.start()
        for n in started:
            assert n.wait_ready(60)
        assert started[0].commit_version("m", M1, None, "alice", 1, 1).number == 1
    finally:
        for n in started:
            n.close()


def test_restart_from_full_dump_after_log_compaction(tmp_path: Path) -> None:
    tuning = {"log_compaction_min_entries": 20}
    first = make_nodes(tmp_path, **tuning)
    configs = [n.config for n in first]
    try:
        for n in first:
            n.start()
        for n in first:
            assert n.wait_ready(60)
        parent = None
        for i in range(60):
            parent = first[i % 3].commit_version("m", "%064x" % (i + 1), parent, "alice", i, 1, created_at=float(i)).number
        first[0].set_tag("m", "prod", 30, "ops")
        for n in first:
            n.barrier()
        wait_until(lambda: all(c.dump_file.exists() for c in configs), 60, what="full dumps written")
        expected = first[0].list_versions("m").value
    finally:
        for n in first:
            n.close()
    second = [MetadataNode(c) for c in configs]
    try:
        for n in second:
            n.start()
        for n in second:
            assert n.wait_ready(60)
        for n in second:
            wait_until(lambda n=n: n.list_versions("m").value == expected, 60, what="state restored")
            assert n.resolve_tag("m", "prod").value.number == 30
        assert second[1].commit_version("m", "f" * 64, 60, "alice", 1, 1).number == 61
    finally:
        for n in second:
            n.close()


def test_transfer_leadership_then_remove_the_old_leader(nodes: list[MetadataNode]) -> None:
    leader = next(n for n in nodes if n.is_leader())
    others = [n for n in nodes if n is not leader]
    for n in nodes:
        others[0].add_member(MemberRecord(n.server_id, "127.0.0.1:1", n.config.raft_address))
    with pytest.raises(Conflict, match="transfer_leadership"):
        others[0].remove_member(leader.server_id)
    with pytest.raises(Conflict, match="itself"):
        leader.remove_member(leader.server_id)
    new_address = wait_until(lambda: leader.transfer_leadership(), 30, what="leadership transferred")
    assert new_address in [n.config.raft_address for n in others]
    with pytest.raises(NotLeader):
        leader.transfer_leadership()
    remover = others[0]
    wait_until(lambda: remover.leader_raft_address() == new_address, 30)
    remover.remove_member(leader.server_id)
    assert leader.config.raft_address not in remover.cluster_addresses()
    assert leader.server_id not in [m.server_id for m in remover.members().value]
    assert remover.commit_version("m", M1, None, "alice", 1, 1).number == 1


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_silent_raft_connections_are_closed_and_a_closed_listener_listens_again(
        nodes: list[MetadataNode], monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection to the Raft port that never sent its first message was held forever (pysyncobj
    checks timeouts only on a connection's own events), and an accept error (EMFILE) closed the
    listening socket for good: the node took no link from a peer again."""
    from consensus import links

    monkeypatch.setattr(links, "HANDSHAKE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(links, "MAX_HANDSHAKING", 8)
    target = next(n for n in nodes if not n.is_leader())
    host, port = target.config.raft_address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(12)]
    try:
        # Past the cap, the oldest waiting ones go at once; the rest after the handshake timeout.
        assert all(_closed_by_peer(s, 2.0) for s in silent[:4])
        assert all(_closed_by_peer(s, 4.0) for s in silent[4:])
    finally:
        for s in silent:
            s.close()

    so = target._syncobj
    assert so is not None
    transport = so._SyncObj__transport
    server = transport._server
    bind, fails = server.bind, [20]  # 5 s of failed binds, one each bindRetryTime (0.25 s)

    def bind_while_out_of_descriptors() -> None:
        if fails[0]:
            fails[0] -= 1
            raise OSError(24, "Too many open files")
        bind()

    server.bind = bind_while_out_of_descriptors
    server.unbind()  # what pysyncobj does on an accept error
    # While it cannot bind, the node goes on: it still applies what the leader commits.
    leader = next(n for n in nodes if n.is_leader())
    leader.commit_version("while-unbound", M1, None, "alice", 10, 1)
    wait_until(lambda: "while-unbound" in target.list_models().value, 3)
    wait_until(lambda: server._TcpServer__fileno is not None, 15)
    assert fails[0] == 0
    probe = socket.create_connection((host, int(port)), timeout=5)
    probe.close()
    assert transport._server._TcpServer__socket.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    leader.commit_version("after-rebind", M1, None, "alice", 10, 1)
    wait_until(lambda: "after-rebind" in target.list_models().value, 30)
