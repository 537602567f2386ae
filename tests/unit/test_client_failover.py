"""The client's leader failover decisions (paramserver.client.failover), on a fake clock.

The stories are the faults of the drills: a leader cut off by a partition (silent: no answer,
no error), a leader killed (its calls fail at once), a slow but healthy leader, a member cut
off with the old leader, no leader known when the view was built.
"""
from __future__ import annotations

import math

import pytest

from paramserver.client.errors import ConfigError
from paramserver.client.failover import (
    FailoverPolicy,
    LeaderFailover,
    Plan,
    best_answer,
)

# notice_after_s past every deadline here: the notice has tests of its own (N below).
P = FailoverPolicy(ask_after_s=0.2, ask_every_s=0.1, ask_timeout_s=0.5, retry_after_s=0.1, retry_max_s=0.4, notice_after_s=100.0)
N = FailoverPolicy(ask_after_s=0.2, ask_every_s=0.1, ask_timeout_s=0.5, retry_after_s=0.1, retry_max_s=0.4, notice_after_s=3.0)
L, A, B = "ps2:7070", "ps1:7070", "ps3:7070"


def watch(now: float = 0.0, deadline: float = 10.0, target: str = L, term: int | None = 5) -> LeaderFailover:
    return LeaderFailover(target, term, [A, target, B], P, now=now, deadline=deadline)


def test_a_healthy_leader_is_called_once_and_nobody_is_asked_before_ask_after() -> None:
    w = watch()
    assert w.poll(0.0) == Plan(call=L, wake_at=0.2)
    assert w.poll(0.1) == Plan(wake_at=0.2)  # the call is out: nothing new, wake when it is overdue
    assert w.others == [A, B]


def test_a_silent_leader_is_left_for_the_first_member_that_names_a_newer_term() -> None:
    """The partition: the call to the old leader never ends; the majority elects ps3 in term 6."""
    w = watch()
    w.poll(0.0)
    plan = w.poll(0.2)
    assert plan.call is None and plan.ask == (A, B)
    assert w.poll(0.25).ask == ()  # both questions still out: nobody is asked twice at once
    # Before the election the members still name the old leader in the old term: no news.
    assert not w.answered(A, L, 5, now=0.26)
    assert not w.answered(B, L, 5, now=0.27)
    assert w.poll(0.30).ask == ()  # each is asked again ask_every_s after its last answer
    assert w.poll(0.36).ask == (A,)
    assert w.poll(0.37).ask == (B,)
    # ps3 won: the first answer naming it in a newer term moves the call there.
    assert w.answered(B, B, 6, now=0.5)
    assert (w.target, w.term, w.moves) == (B, 6, 1)
    assert w.poll(0.5).call == B
    # A late answer from the member that has not heard of the election yet does not move it back.
    assert not w.answered(A, L, 5, now=0.55)
    assert w.target == B
    assert w.others == [L, A]  # the old leader is asked like any member from now on


def test_an_answer_from_the_minority_side_never_moves_the_client_back() -> None:
    w = watch(term=6, target=B)
    w.poll(0.0)
    w.poll(0.2)
    assert not w.answered(L, L, 5, now=0.3)  # the old leader, cut off, still believes in term 5
    assert not w.answered(A, "", 9, now=0.3)  # a candidate that keeps losing: a high term, no leader
    assert w.target == B and w.term == 6
    assert w.answered(A, A, 7, now=0.4)  # a real newer leader still moves it (term 9 named no one)


def test_a_suspect_leader_is_called_and_the_others_asked_at_once() -> None:
    """The push's stream to the leader just broke: do not give it ask_after_s of grace."""
    w = LeaderFailover(L, 5, [A, B], P, now=0.0, deadline=10.0, suspect=True)
    assert w.poll(0.0) == Plan(call=L, ask=(A, B), wake_at=10.0)  # nothing to do but wait for answers
    assert w.answered(A, B, 6, now=0.01)
    assert w.poll(0.01).call == B
    assert w.poll(0.05).ask == ()  # the new leader gets the usual grace
    assert w.poll(0.22).ask == (L, A)


def test_a_slow_healthy_leader_keeps_its_call() -> None:
    w = watch()
    w.poll(0.0)
    for t in (0.2, 0.31, 0.42, 0.53):
        plan = w.poll(t)
        assert plan.call is None
        for m in plan.ask:
            assert not w.answered(m, L, 5, now=t + 0.01)  # everyone confirms the leader we call
    assert w.target == L and w.moves == 0


def test_a_killed_leader_is_retried_with_backoff_until_someone_names_a_successor() -> None:
    w = watch()
    assert w.poll(0.0).call == L
    w.call_failed(0.01)  # connection refused: UNAVAILABLE at once
    plan = w.poll(0.01)
    assert plan.call is None and plan.ask == (A, B) and plan.wake_at == pytest.approx(0.11)
    assert w.poll(0.11).call == L  # nobody named another yet: the same leader again after retry_after_s
    w.call_failed(0.12)
    assert w.poll(0.12).call is None
    assert w.poll(0.31).call is None  # backoff doubled: 0.2 s
    assert w.poll(0.32).call == L
    w.call_failed(0.33)  # doubled again: 0.4 s, which is retry_max_s
    assert w.poll(0.72).call is None
    assert w.poll(0.73).call == L
    w.call_failed(0.74)  # capped at retry_max_s
    assert w.poll(1.13).call is None
    assert w.poll(1.141).call == L
    w.call_failed(1.15)
    assert w.answered(A, B, 6, now=1.16)  # the successor: call it at once, no backoff
    assert w.poll(1.16).call == B


def test_the_same_leader_reelected_in_a_newer_term_is_called_again_at_once() -> None:
    w = watch()
    w.poll(0.0)
    w.call_failed(0.01)
    w.poll(0.01)
    assert not w.answered(A, L, 6, now=0.05)  # not a move: the same address
    assert w.term == 6
    assert w.poll(0.05).call == L  # without waiting out the backoff


def test_with_no_leader_known_nothing_is_called_until_someone_names_one() -> None:
    """The view came from a member with no leader (an election, or the minority side of a cut):
    its reads may be stale (a head version the majority moved past), so it is not called."""
    w = LeaderFailover(None, None, [A, B], P, now=0.0, deadline=10.0)
    assert w.poll(0.0) == Plan(ask=(A, B), wake_at=10.0)
    assert not w.answered(B, "", 3, now=0.05)  # a candidate: no leader yet
    plan = w.poll(0.1)
    assert plan.call is None and plan.ask == () and plan.wake_at == pytest.approx(0.15)  # A's question is out
    assert w.poll(0.151).ask == (B,)
    assert w.answered(A, B, 3, now=0.2)
    assert w.target == B and w.term == 3
    assert w.poll(0.2).call == B
    w2 = LeaderFailover(None, None, [A], P, now=0.0, deadline=1.0)
    w2.poll(0.0)
    assert w2.poll(1.0).give_up  # nobody ever named a leader: the caller raises ClusterUnreachable


def test_a_leader_named_that_the_view_does_not_list_is_followed_and_asked_later() -> None:
    w = watch()
    w.poll(0.0)
    w.poll(0.2)
    assert w.answered(A, "ps4:7070", 6, now=0.3)
    assert w.poll(0.3).call == "ps4:7070"
    assert set(w.others) == {L, A, B}


def test_failed_questions_are_asked_again_after_ask_every() -> None:
    w = watch()
    w.poll(0.0)
    assert w.poll(0.2).ask == (A, B)
    w.ask_failed(A, 0.7)  # a cut-off member: its question ran into ask_timeout_s
    w.answered(B, L, 5, now=0.21)
    assert w.poll(0.75).ask == (B,)
    assert w.poll(0.8).ask == (A,)


def test_the_deadline_gives_up_even_with_a_call_in_flight() -> None:
    w = watch(deadline=1.0)
    w.poll(0.0)
    assert not w.poll(0.99).give_up
    assert w.poll(1.0) == Plan(give_up=True)
    assert w.poll(0.5).wake_at <= 1.0  # never sleeps past the deadline


def test_wake_at_is_the_earliest_thing_to_do() -> None:
    w = watch()
    w.poll(0.0)
    w.poll(0.2)
    w.answered(A, L, 5, now=0.22)
    assert w.poll(0.23).wake_at == pytest.approx(0.32)  # A is due again; B's question is still out
    w.call_failed(0.24)
    assert w.poll(0.24).wake_at == pytest.approx(0.32)  # retry at 0.34, A due at 0.32
    assert math.isfinite(w.poll(0.24).wake_at)


def test_best_answer_prefers_the_newest_term_that_names_a_leader() -> None:
    assert best_answer([]) is None
    assert best_answer([("", 9)]) == 0  # a leaderless answer still lists the members
    assert best_answer([("", 9), ("a", 3)]) == 1
    assert best_answer([("a", 3), ("b", 4), ("a", 3)]) == 1
    assert best_answer([("a", 4), ("b", 4)]) == 0  # the same term: the first in


@pytest.mark.parametrize("bad", [
    {"ask_after_s": 0}, {"ask_every_s": -1}, {"ask_timeout_s": math.inf}, {"retry_after_s": 0},
    {"retry_after_s": 1.0, "retry_max_s": 0.5},
])
def test_policy_values_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="failover"):
        FailoverPolicy(**bad).validate()
    with pytest.raises(ConfigError):
        LeaderFailover(L, 1, [A], FailoverPolicy(**bad), now=0, deadline=1)


def test_a_claim_to_lead_beats_a_stale_belief_in_the_same_term() -> None:
    # A member that just voted has the new term but may still name the old leader: the view can
    # start out believing L in term 6 when B won term 6. B's own claim moves the call at once.
    w = watch(term=6)
    assert w.poll(0.0).call == L
    assert not w.answered(A, L, 6, now=0.2)  # another stale belief: no news
    assert not w.answered(A, B, 6, now=0.2)  # a belief, not a claim: the same term is no news
    assert w.answered(B, B, 6, now=0.3, claims=True)
    assert w.target == B and w.poll(0.3).call == B
    assert not w.answered(L, L, 6, now=0.4)  # L's stale belief in itself without a claim cannot move it back
    assert not w.answered(A, B, 5, now=0.4, claims=True)  # an older term never moves it


def test_best_answer_prefers_a_claim_within_a_term() -> None:
    assert best_answer([("a", 4, False), ("b", 4, True)]) == 1
    assert best_answer([("a", 5, False), ("b", 4, True)]) == 0  # a newer term still wins


def test_with_no_leader_for_notice_after_the_user_is_told_once_who_answers() -> None:
    """A lost quorum: the member left names no leader. The wait (up to the deadline) is said once,
    with the members that answer, instead of being silent."""
    w = LeaderFailover(None, None, [A, L, B], N, now=0.0, deadline=30.0)
    plan = w.poll(0.0)
    assert plan.ask == (A, L, B) and not plan.notice and plan.wake_at == 3.0
    assert not w.answered(A, "", 1, now=0.01)
    w.ask_failed(L, 0.5)
    w.ask_failed(B, 0.5)
    assert not any(w.poll(t / 10).notice for t in range(1, 30))
    assert w.poll(3.0).notice and w.answering == [A]
    assert not any(w.poll(3.0 + t / 10).notice for t in range(1, 100))  # once
    w.ask_failed(A, 13.0)  # it went away too
    assert w.answering == []


def test_a_slow_but_healthy_leader_gets_no_notice_and_a_failing_one_does() -> None:
    """A commit's quorum check can take seconds: a call in flight with no failure is no news."""
    healthy = LeaderFailover(L, 5, [A, B], N, now=0.0, deadline=30.0)
    assert healthy.poll(0.0).call == L
    assert not healthy.answered(A, L, 5, now=0.3)
    assert not any(healthy.poll(t / 10).notice for t in range(1, 200))
    failing = LeaderFailover(L, 5, [A, B], N, now=0.0, deadline=30.0)
    failing.poll(0.0)
    failing.call_failed(0.01)  # the leader was killed: its calls are refused
    assert not failing.answered(A, L, 5, now=0.3)  # A still names it, in the same term
    notices = [t / 10 for t in range(1, 200) if failing.poll(t / 10).notice]
    assert notices == [3.0] and failing.answering == [A]
    assert failing.answered(B, B, 6, now=3.5) and not failing.leaderless  # B won an election: a leader again
