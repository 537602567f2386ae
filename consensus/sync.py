"""Whether a member's local state may answer a serializable read: a pure rule, no Raft, no clock.

A member answers a serializable read from the state it has applied. Right after a restart, or
back from a partition, that state is behind the cluster's: a tag moved meanwhile still points at
its old version there. ``judge_sync`` says whether the member is *in sync*: it hears a leader
(or leads and a majority answers it) within an election timeout, has applied everything the
leader had committed as of its last AppendEntries, and has applied an entry of the current term
(so nothing an earlier leader committed is missing: a new leader's commit index only covers it
once its first entry of the term commits). Such a member's answer is at most a heartbeat behind.

The facts come from ``consensus.node.MetadataNode.sync_state`` (pysyncobj's fields, read on its
tick thread where they change); the servers refuse serializable metadata reads with UNAVAILABLE
while the verdict is "not in sync" (``paramserver.server.metaservice``), so clients ask a member
that is. Unit tests feed facts directly (``tests/unit/test_consensus_sync.py``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncFacts:
    """What one member knows about its own progress, at one moment."""

    leading: bool  # this member is the Raft leader
    leader_known: bool  # it hears a leader (itself when leading)
    ready: bool  # pysyncobj has once applied up to the leader's commit index since start
    last_applied: int
    leader_commit: int | None  # the leader's commit index as of its last AppendEntries (own when leading); None: never heard
    term: int  # the current Raft term
    applied_term: int  # the newest term of an entry this member has applied (-1: not known yet)
    heard_age_s: float | None  # since the leader last spoke (leading: since a majority last answered); None: never
    failure: str | None = None  # the member left Raft (its journal could not be written)


@dataclass(frozen=True)
class SyncVerdict:
    in_sync: bool
    reason: str = ""  # why not, one clause for an error line ("" when in sync)
    behind: int = 0  # committed entries known but not applied yet


IN_SYNC = SyncVerdict(True)


def judge_sync(facts: SyncFacts, timeout_s: float) -> SyncVerdict:
    """In sync, or why not. ``timeout_s``: the election timeout; a member that heard nothing from
    its leader (a leader: from a majority) for longer may already have been replaced."""
    f = facts
    if f.failure is not None:
        return SyncVerdict(False, f"it left Raft ({f.failure})")
    if not f.leader_known:
        return SyncVerdict(False, "it hears no leader (an election is under way, or it is cut off)")
    if f.heard_age_s is None or f.heard_age_s > timeout_s:
        who = "a majority of the members" if f.leading else "the leader"
        when = "yet" if f.heard_age_s is None else f"for {f.heard_age_s:.2f} s"
        return SyncVerdict(False, f"it has not heard from {who} {when} (election timeout {timeout_s:g} s)")
    if f.leader_commit is None or not f.ready:
        return SyncVerdict(False, "it has not caught up with the leader since it started")
    if f.last_applied < f.leader_commit:
        behind = f.leader_commit - f.last_applied
        return SyncVerdict(False, f"it has applied {f.last_applied} of the leader's {f.leader_commit} committed entries",
                           behind=behind)
    if f.applied_term != f.term:
        return SyncVerdict(False, f"it has not applied an entry of the current term {f.term} yet (a new leader's first commit)")
    return IN_SYNC


__all__ = ["IN_SYNC", "SyncFacts", "SyncVerdict", "judge_sync"]
