"""When a member may answer a serializable read (consensus.sync.judge_sync): facts in, verdict out."""
from __future__ import annotations

from dataclasses import replace

from consensus.sync import IN_SYNC, SyncFacts, judge_sync

TIMEOUT = 0.6
FOLLOWER = SyncFacts(leading=False, leader_known=True, ready=True, last_applied=120, leader_commit=120, term=4,
                     applied_term=4, heard_age_s=0.05)


def test_a_follower_that_heard_its_leader_and_applied_what_it_committed_is_in_sync() -> None:
    assert judge_sync(FOLLOWER, TIMEOUT) == IN_SYNC
    assert judge_sync(replace(FOLLOWER, last_applied=121), TIMEOUT).in_sync  # applied past the last heartbeat's index


def test_a_restarted_member_behind_the_leaders_commit_index_is_not() -> None:
    verdict = judge_sync(replace(FOLLOWER, last_applied=90), TIMEOUT)
    assert not verdict.in_sync and verdict.behind == 30
    assert "applied 90 of the leader's 120" in verdict.reason


def test_a_member_that_has_not_heard_the_leader_since_it_started_is_not() -> None:
    never = replace(FOLLOWER, leader_commit=None, ready=False, heard_age_s=None)
    assert "not heard from the leader yet" in judge_sync(never, TIMEOUT).reason
    assert "not caught up" in judge_sync(replace(never, heard_age_s=0.01), TIMEOUT).reason


def test_silence_longer_than_an_election_timeout_means_not_in_sync() -> None:
    verdict = judge_sync(replace(FOLLOWER, heard_age_s=0.8), TIMEOUT)
    assert not verdict.in_sync and "not heard from the leader for 0.80 s" in verdict.reason
    assert judge_sync(replace(FOLLOWER, heard_age_s=TIMEOUT), TIMEOUT).in_sync


def test_a_leader_needs_a_majority_that_answered_within_the_timeout() -> None:
    leader = replace(FOLLOWER, leading=True)
    assert judge_sync(leader, TIMEOUT).in_sync
    verdict = judge_sync(replace(leader, heard_age_s=1.5), TIMEOUT)
    assert not verdict.in_sync and "a majority of the members" in verdict.reason


def test_a_new_leaders_term_must_have_an_applied_entry() -> None:
    """A new leader's commit index covers what earlier leaders committed only once its first entry
    of the term commits; until then neither it nor its followers may answer from their state."""
    for leading in (True, False):
        verdict = judge_sync(replace(FOLLOWER, leading=leading, term=5, applied_term=4), TIMEOUT)
        assert not verdict.in_sync and "current term 5" in verdict.reason


def test_no_leader_or_a_failed_journal_is_never_in_sync() -> None:
    assert "hears no leader" in judge_sync(replace(FOLLOWER, leader_known=False), TIMEOUT).reason
    assert "left Raft (disk full)" in judge_sync(replace(FOLLOWER, failure="disk full"), TIMEOUT).reason
