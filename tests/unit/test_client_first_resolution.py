"""Issue 47, the client's side: a tag's first resolution goes to the leader; later ones to the members.

Two stand-in servers (a leader and a member, in-process gRPC) answer ClusterInfo and ResolveTag and
record how they were asked. The real cluster is exercised by tests/integration/test_tag_reads.py.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from paramserver.client.errors import ClusterUnreachable
from paramserver.client.session import ClusterClient
from paramserver.client.session_config import READ_FALLBACK, READ_LEADER, READ_MEMBER, SessionConfig
from paramserver.wire.proto import pb, pb_grpc
from paramserver.wire.reads import wants_local


class FakeServer(pb_grpc.ParamServerServicer):
    """ClusterInfo naming ``leader`` (as the cluster's view of itself), ResolveTag answering ``version``."""

    def __init__(self, server_id: str, version: int) -> None:
        self.server_id = server_id
        self.version = version
        self.members: list[pb.Member] = []
        self.leader: pb.Member | None = None
        self.asked: list[bool] = []  # the linearizable flag of each ResolveTag
        self.refuse = False  # serializable reads: as a member catching up does (a local read is answered)
        self.local: list[bool] = []  # whether each ResolveTag asked for the member's own state

    def ClusterInfo(self, request: pb.ClusterInfoRequest, context: grpc.ServicerContext) -> pb.ClusterInfoReply:  # noqa: N802
        leader = self.leader
        return pb.ClusterInfoReply(
            server_id=self.server_id, members=self.members, term=3, ring=pb.RingParams(vnodes=16, replication_factor=2, write_quorum=1),
            leader_id=leader.server_id if leader else "", leader_grpc_address=leader.grpc_address if leader else "",
            is_leader=leader is not None and leader.server_id == self.server_id,
        )

    def ResolveTag(self, request: pb.ResolveTagRequest, context: grpc.ServicerContext) -> pb.VersionReply:  # noqa: N802
        self.asked.append(request.linearizable)
        local = wants_local(context.invocation_metadata())
        self.local.append(local)
        if self.refuse and not request.linearizable and not local:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.server_id} is catching up with the cluster")
        v = self.version
        return pb.VersionReply(version=pb.Version(model=request.model, number=v, manifest_id=f"{v:064x}", clock={"p": v}),
                               read=pb.ReadInfo(commit_index=10 + v, server_id=self.server_id), tag=request.tag)


@pytest.fixture
def servers() -> Iterator[tuple[FakeServer, FakeServer, list[grpc.Server], list[str]]]:
    leader, member = FakeServer("ps1", 5), FakeServer("ps2", 4)  # the member is a heartbeat behind
    running, addresses = [], []
    for fake in (leader, member):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_ParamServerServicer_to_server(fake, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        running.append(server)
    members = [pb.Member(server_id=f.server_id, grpc_address=a, raft_address=f"127.0.0.1:{7100 + i}", state="up")
               for i, (f, a) in enumerate(zip((leader, member), addresses))]
    for fake in (leader, member):
        fake.members, fake.leader = members, members[0]
    yield leader, member, running, addresses
    for server in running:
        server.stop(0)


def client(seeds: list[str], **config: float) -> ClusterClient:
    return ClusterClient(seeds, config=SessionConfig(**config))  # type: ignore[arg-type]


def test_the_first_resolution_is_the_leaders_and_later_ones_the_members(servers: tuple[FakeServer, FakeServer, list[grpc.Server],
                                                                                          list[str]]) -> None:
    leader, member, _, addresses = servers
    with client([addresses[1], addresses[0]]) as c:  # the member is the nearer seed
        first = c.resolve("m", "prod")
        assert (first.number, first.read) == (5, READ_LEADER) and leader.asked == [True] and member.asked == []
        assert first.resolve_s > 0
        member.version = 5
        later = c.resolve("m", "prod")
        assert (later.number, later.read) == (5, READ_MEMBER) and member.asked == [False]
        assert c.resolve_ref("m:prod").read == READ_MEMBER  # the loaders' path: the same policy
    with client([addresses[1]]) as c:  # asked to read at the members: they answer
        assert c.resolve("m", "prod", linearizable=False).read == READ_MEMBER and leader.asked == [True]


def test_every_member_refusing_sends_a_later_resolution_to_the_leader(servers: tuple[FakeServer, FakeServer, list[grpc.Server],
                                                                                        list[str]]) -> None:
    leader, member, _, addresses = servers
    with client([addresses[1]]) as c:
        c.resolve("m", "prod")
        member.refuse = leader.refuse = True  # an election: no member in sync yet
        again = c.resolve("m", "prod")
        assert again.read == READ_LEADER and leader.asked == [True, False, True] and member.asked == [False]


def test_without_a_reachable_leader_a_members_answer_is_taken_and_said(servers: tuple[FakeServer, FakeServer, list[grpc.Server],
                                                                                         list[str]],
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    leader, member, running, addresses = servers
    running[0].stop(0)  # the leader is gone; the member still names it (one heartbeat ago)
    with caplog.at_level(logging.WARNING, logger="paramserver.client.session"):
        with client([addresses[1]], leader_read_wait_s=0.5) as c:
            info = c.resolve("m", "prod")
    assert (info.number, info.read) == (4, READ_FALLBACK) and member.asked == [False]
    assert any("m:prod resolved to v4 by member" in r.getMessage() and "without the leader" in r.getMessage()
               for r in caplog.records)
    assert member.local == [True]  # no leader answered: the member's own state, which it gives even while catching up
    member.refuse = True  # no leader heard any more: it refuses serializable reads, not a local one
    with client([addresses[1]], leader_read_wait_s=0.3) as c:
        info = c.resolve("m", "prod")
    assert (info.number, info.read) == (4, READ_FALLBACK) and member.local == [True, True]
    running[1].stop(0)
    with client([addresses[1]], leader_read_wait_s=0.3) as c, pytest.raises(ClusterUnreachable):
        c.resolve("m", "prod")
