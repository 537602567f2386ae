"""ClusterView.leader_call's I/O around the failover decisions, with fake member clients.

The decisions themselves are tested on a fake clock (test_client_failover.py); here a leader
that never answers, members that name a successor late, and a write that may have landed check
that the caller's thread moves, never waits for the old leader, and asks before sending again.
Real servers behind a real partition: tests/integration/test_drills.py (the partition drill).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc
import pytest

from paramserver.client.cluster_view import ClusterOptions, ClusterView
from paramserver.client.errors import ClusterUnreachable
from paramserver.client.failover import FailoverPolicy
from paramserver.wire.proto import pb
from tests.conftest import FakeRpcError

FAST = FailoverPolicy(ask_after_s=0.05, ask_every_s=0.05, ask_timeout_s=0.3, retry_after_s=0.02, retry_max_s=0.1)
ADDR = {"ps1": "10.0.0.1:7070", "ps2": "10.0.0.2:7070", "ps3": "10.0.0.3:7070"}


def info(answering: str, leader: str | None, term: int) -> pb.ClusterInfoReply:
    reply = pb.ClusterInfoReply(
        server_id=answering, term=term,
        members=[pb.Member(server_id=s, grpc_address=a, state="up") for s, a in ADDR.items()],
        ring=pb.RingParams(vnodes=16, replication_factor=3, write_quorum=2),
    )  # fmt: skip
    if leader is not None:
        reply.leader_id, reply.leader_grpc_address = leader, ADDR[leader]
        reply.is_leader = leader == answering  # what a real server says
    return reply


class Member:
    """A fake ParamServerClient: ``answers`` says what ClusterInfo returns (None: silent until the
    deadline); ``work`` is what the leader call does on this member."""

    def __init__(self, server_id: str, answers: Callable[[], pb.ClusterInfoReply | None],
                 work: Callable[[], str]) -> None:
        self.server_id = server_id
        self.address = ADDR[server_id]
        self.answers = answers
        self.work = work
        self.calls = 0
        self.stub = self
        self.ClusterInfo = self

    def future(self, request: pb.ClusterInfoRequest, timeout: float) -> Future:
        f: Future = Future()
        got = self.answers()

        def end() -> None:
            if f.set_running_or_notify_cancel():  # the caller may have cancelled a question it gave up on
                f.set_exception(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED)) if got is None else f.set_result(got)

        threading.Timer(timeout if got is None else 0.002, end).start()
        return f

    def do(self) -> str:
        self.calls += 1
        return self.work()


def silent(release: threading.Event, timeout: float = 3.0) -> Callable[[], str]:
    def work() -> str:
        release.wait(timeout)
        raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED)
    return work


def view_of(members: dict[str, Member], believed: pb.ClusterInfoReply) -> ClusterView:
    first = members[believed.server_id]
    view = ClusterView(ClusterOptions(tuple(ADDR.values()), timeout_s=3.0), believed, first)  # type: ignore[arg-type]
    by_address = {m.address: m for m in members.values()}
    view.client = lambda address: by_address[address]  # type: ignore[method-assign]
    view.failover = FAST
    return view


def elected_after(seconds: float, old: str, new: str, term: int, me: str) -> Callable[[], pb.ClusterInfoReply]:
    t0 = time.monotonic()
    return lambda: info(me, old, term - 1) if time.monotonic() - t0 < seconds else info(me, new, term)


def test_a_silent_leader_is_left_for_the_successor_as_soon_as_a_member_names_it() -> None:
    release = threading.Event()
    members = {
        "ps2": Member("ps2", lambda: None, silent(release)),  # cut off: answers nothing
        "ps1": Member("ps1", elected_after(0.3, "ps2", "ps3", 6, "ps1"), lambda: "ps1 is no leader"),
        "ps3": Member("ps3", elected_after(0.3, "ps2", "ps3", 6, "ps3"), lambda: "done on ps3"),
    }
    view = view_of(members, info("ps1", "ps2", 5))
    checks: list[float] = []
    started = time.monotonic()
    try:
        got = view.leader_call(lambda c: c.do(), deadline_s=5.0, before_resend=lambda: checks.append(time.monotonic()) or None)
    finally:
        release.set()
    took = time.monotonic() - started
    assert got == "done on ps3"
    assert 0.3 <= took < 1.0, f"moved after {took:.2f}s: the election took 0.3 s, the old leader's deadline 3 s"
    assert len(checks) == 1, "the abandoned try may have landed: checked once before sending again"
    assert view.info.leader_grpc_address == ADDR["ps3"] and view.info.term == 6
    assert (members["ps2"].calls, members["ps3"].calls, members["ps1"].calls) == (1, 1, 0)


def test_a_write_that_landed_on_the_old_leader_is_not_sent_again() -> None:
    release = threading.Event()
    members = {
        "ps2": Member("ps2", lambda: None, silent(release)),
        "ps1": Member("ps1", lambda: info("ps1", "ps3", 6), lambda: "wrong"),
        "ps3": Member("ps3", lambda: info("ps3", "ps3", 6), lambda: "sent twice"),
    }
    view = view_of(members, info("ps1", "ps2", 5))
    try:
        got = view.leader_call(lambda c: c.do(), deadline_s=5.0, before_resend=lambda: "found committed")
    finally:
        release.set()
    assert got == "found committed" and members["ps3"].calls == 0


def test_a_slow_healthy_leader_is_waited_for() -> None:
    def slow() -> str:
        time.sleep(0.4)
        return "slow but fine"

    members = {
        "ps2": Member("ps2", lambda: info("ps2", "ps2", 5), slow),
        "ps1": Member("ps1", lambda: info("ps1", "ps2", 5), lambda: "wrong"),
        "ps3": Member("ps3", lambda: info("ps3", "ps2", 5), lambda: "wrong"),
    }
    view = view_of(members, info("ps1", "ps2", 5))
    resent: list[int] = []
    assert view.leader_call(lambda c: c.do(), deadline_s=5.0, before_resend=lambda: resent.append(1) or None) == "slow but fine"
    assert members["ps2"].calls == 1 and not resent


def test_a_killed_leader_is_retried_then_followed_and_errors_keep_their_code() -> None:
    def refused() -> str:
        raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)

    members = {
        "ps2": Member("ps2", lambda: None, refused),
        "ps1": Member("ps1", elected_after(0.2, "ps2", "ps1", 6, "ps1"), lambda: "done on ps1"),
        "ps3": Member("ps3", elected_after(0.2, "ps2", "ps1", 6, "ps3"), lambda: "wrong"),
    }
    view = view_of(members, info("ps3", "ps2", 5))
    assert view.leader_call(lambda c: c.do(), deadline_s=5.0) == "done on ps1"
    assert members["ps2"].calls >= 2  # retried with backoff while nobody named a successor

    def denied() -> str:
        raise FakeRpcError(grpc.StatusCode.PERMISSION_DENIED)

    members["ps1"].work = denied
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        view.leader_call(lambda c: c.do(), deadline_s=5.0)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and time.monotonic() - t0 < 0.5


def test_the_deadline_raises_the_last_error_or_cluster_unreachable() -> None:
    def refused() -> str:
        raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)

    members = {s: Member(s, lambda s=s: info(s, "ps2", 5), refused) for s in ADDR}
    view = view_of(members, info("ps1", "ps2", 5))
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        view.leader_call(lambda c: c.do(), deadline_s=0.3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and 0.3 <= time.monotonic() - t0 < 0.8

    release = threading.Event()
    members["ps2"].work = silent(release)
    try:
        with pytest.raises(ClusterUnreachable, match="did not answer within 0.3s"):
            view.leader_call(lambda c: c.do(), deadline_s=0.3)
    finally:
        release.set()


def test_refresh_takes_the_newest_leader_and_is_not_held_up_by_silent_members() -> None:
    members = {
        "ps1": Member("ps1", lambda: info("ps1", "ps3", 6), lambda: ""),
        "ps2": Member("ps2", lambda: None, lambda: ""),  # cut off
        "ps3": Member("ps3", lambda: info("ps3", "ps3", 6), lambda: ""),
    }
    view = view_of(members, info("ps1", "ps2", 5))
    t0 = time.monotonic()
    view.refresh(deadline_s=5.0)
    assert view.info.leader_id == "ps3" and time.monotonic() - t0 < 0.2

    # Only the minority answers, with an older term: it is applied after ask_timeout_s, not after
    # the silent members' full deadline, and the call still returns (the best there is).
    members["ps1"].answers = members["ps3"].answers = lambda: None
    members["ps2"].answers = lambda: info("ps2", "ps2", 5)
    t0 = time.monotonic()
    view.refresh(deadline_s=5.0)
    took = time.monotonic() - t0
    assert view.info.leader_id == "ps2" and FAST.ask_timeout_s <= took < FAST.ask_timeout_s + 0.3

    members["ps2"].answers = lambda: None
    with pytest.raises(ClusterUnreachable, match="no cluster member answered"):
        view.refresh(deadline_s=0.4)


def test_a_view_without_a_leader_calls_nobody_until_one_is_named() -> None:
    """The minority side of a cut: its member has no leader and an old head version. Reading the
    head there made a push straddling the heal commit on a stale parent (PushConflict)."""
    members = {
        "ps2": Member("ps2", lambda: info("ps2", None, 2), lambda: "stale head from the minority"),
        "ps1": Member("ps1", lambda: None, lambda: "wrong"),
        "ps3": Member("ps3", lambda: None, lambda: "head from the leader"),
    }
    view = view_of(members, info("ps2", None, 2))
    with pytest.raises(ClusterUnreachable, match="no cluster member named a leader"):
        view.leader_call(lambda c: c.do(), deadline_s=0.4)
    assert members["ps2"].calls == 0
    members["ps3"].answers = lambda: info("ps3", "ps3", 3)  # healed: the majority's leader answers
    assert view.leader_call(lambda c: c.do(), deadline_s=2.0) == "head from the leader"
    assert members["ps2"].calls == 0


def test_a_stale_belief_in_the_current_term_gives_way_to_the_leader_claiming_it() -> None:
    """A member that voted in term 6 but still names the term-5 leader: a view built from it
    believes ps2 leads term 6. ps2 (now a follower) is slow to answer; ps3 says it leads term 6."""
    release = threading.Event()
    members = {
        "ps2": Member("ps2", lambda: info("ps2", "ps3", 6), silent(release)),
        "ps1": Member("ps1", lambda: info("ps1", "ps2", 6), lambda: "ps1 is no leader"),  # the stale belief
        "ps3": Member("ps3", lambda: info("ps3", "ps3", 6), lambda: "done on ps3"),
    }
    view = view_of(members, info("ps1", "ps2", 6))
    started = time.monotonic()
    try:
        assert view.leader_call(lambda c: c.do(), deadline_s=3.0) == "done on ps3"
        assert time.monotonic() - started < 1.0 and members["ps1"].calls == 0
    finally:
        release.set()
    view.refresh(deadline_s=2.0)  # the same answers: the claim wins over the belief
    assert view.info.leader_id == "ps3"


def test_a_write_waits_for_the_member_that_answers_as_the_leader() -> None:
    """paramctl's tag/rollback/untag probe: a deposed leader still answers ServerStatus, as a
    follower; the write must go to the member that leads now, not to it."""
    from paramserver.client.ctl import _leader_status

    def status(server_id: str, leads: bool) -> Callable[[], pb.ServerStatusReply]:
        return lambda: pb.ServerStatusReply(server_id=server_id, is_leader=leads)

    members = {
        "ps2": Member("ps2", lambda: info("ps2", "ps3", 6), status("ps2", False)),  # deposed, still answers
        "ps1": Member("ps1", lambda: info("ps1", "ps3", 6), status("ps1", False)),
        "ps3": Member("ps3", lambda: info("ps3", "ps3", 6), status("ps3", True)),
    }
    for m in members.values():
        m.server_status = m.do  # type: ignore[attr-defined]
    view = view_of(members, info("ps1", "ps2", 5))
    got = view.leader_call(_leader_status, deadline_s=5.0)  # type: ignore[arg-type]
    assert got.server_id == "ps3" and got.is_leader
    assert members["ps2"].calls >= 1 and members["ps3"].calls == 1 and members["ps1"].calls == 0
    assert view.info.leader_id == "ps3"
