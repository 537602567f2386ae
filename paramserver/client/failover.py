"""Following the Raft leader: when to stop waiting on it, whom to ask who leads now, when to move.

Pure decisions, no sockets: ``ClusterView.leader_call`` does the I/O and feeds
what happened back in, so the timing is unit-tested with a fake clock
(tests/unit/test_client_failover.py).

Why: a leader cut off by a partition does not refuse calls, it never answers
them. Waiting for a call's deadline made the first commit after a cut land
seconds after the majority had elected a new leader (issue #10). Instead, once
a call to the believed leader has gone unanswered for ``ask_after_s`` (or has
failed), the client asks every other member for ClusterInfo, again every
``ask_every_s``, and moves as soon as one names a newer leader. Raft has at most
one leader per term, so "newer" means a higher term: an answer from a member
that has not heard of the election yet (the old leader, the old term) never
moves the client, and one from a member cut off with the old leader cannot move
it back. A slow but healthy leader keeps its call: nobody names another.

Moving abandons the call in flight; its outcome is unknown (a CommitVersion may
still commit), so a caller that writes must check before sending again
(``ClusterView.leader_call(before_resend=...)``, ``push.commit``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from paramserver.client.errors import ConfigError


@dataclass(frozen=True)
class FailoverPolicy:
    # A call to the leader unanswered this long: ask the others who leads. A healthy leader answers
    # a metadata call (a commit too) in milliseconds; asking a healthy cluster costs a ClusterInfo each.
    ask_after_s: float = 0.1
    ask_every_s: float = 0.1  # ask a member again this long after its last answer (or failure)
    ask_timeout_s: float = 0.5  # deadline of one ClusterInfo question: a silent member costs nothing more
    # A call failed (UNAVAILABLE, deadline) and nobody names another leader: call the same one again
    # after retry_after_s, doubling per failure up to retry_max_s (a restarting leader, a lost reply).
    retry_after_s: float = 0.1
    retry_max_s: float = 1.0
    # No leader to call (none named, or the one named keeps failing) this long: say so once, since
    # an election takes about a second and a longer wait is a lost quorum the user should hear of.
    notice_after_s: float = 3.0

    def validate(self) -> FailoverPolicy:
        for name in ("ask_after_s", "ask_every_s", "ask_timeout_s", "retry_after_s", "retry_max_s", "notice_after_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"failover {name} must be a number of seconds > 0, got {value!r}")
        if self.retry_max_s < self.retry_after_s:
            raise ConfigError(f"failover retry_max_s ({self.retry_max_s}) must be >= retry_after_s ({self.retry_after_s})")
        return self


@dataclass(frozen=True)
class Plan:
    """What the caller does now: start ``call`` (an address), send ClusterInfo to ``ask``, or give up;
    then wait for an event (a call or a question ending) or until ``wake_at``, and poll again."""

    call: str | None = None
    ask: tuple[str, ...] = ()
    give_up: bool = False
    wake_at: float = math.inf
    notice: bool = False  # tell the user, once, that no leader answers yet (``LeaderFailover.answering`` says who does)


def best_answer(answers: Iterable[tuple[str, int] | tuple[str, int, bool]]) -> int | None:
    """Index of the answer to trust among (leader named, term[, the member claims to lead]) tuples:
    the highest term that names a leader, within a term a member's claim to lead itself over
    another's belief (``LeaderFailover.answered`` says why); else the first (a leaderless answer
    still lists the members); None if there are none."""
    best: int | None = None
    best_key: tuple[int, int, bool] | None = None
    for i, answer in enumerate(answers):
        leader, term = answer[0], answer[1]
        claims = bool(answer[2]) if len(answer) > 2 else False
        key = (1, term, claims) if leader else (0, 0, False)
        if best_key is None or key > best_key:
            best, best_key = i, key
    return best


class LeaderFailover:
    """One leader call's failover state. ``target``: the believed leader's address, the one calls go
    to, in ``term``; None when no leader is known (the view was built during an election, or from
    a member cut off with no leader): then nothing is called, since such a member's reads may be
    stale, and everyone is asked until someone names a leader. ``others``: every address to ask.

    Drive it with ``poll(now)`` and report events with ``call_failed``, ``answered`` and
    ``ask_failed``. ``poll`` hands each action out once (a call, a question) and records it as started.
    """

    def __init__(self, target: str | None, term: int | None, others: Iterable[str], policy: FailoverPolicy, *,
                 now: float, deadline: float, suspect: bool = False) -> None:
        self.policy = policy.validate()
        self._suspect = suspect  # the caller has seen target fail: ask the others with the first call
        self.target = target
        self.term = term if target is not None else None
        self.deadline = deadline
        self.moves = 0  # times the target changed (for reports and tests)
        self._members = list(dict.fromkeys([*([target] if target is not None else []), *others]))
        self._calling_since: float | None = None  # a call to target is in flight since then
        self._failures = 0  # failed calls to the current target
        self._retry_at = now  # no call in flight: start one at this time
        self._asking: set[str] = set()  # a question is in flight
        self._asked: dict[str, float] = {}  # when each member's last question ended
        self._answering: set[str] = set()  # members whose last question was answered
        self._notice_at: float | None = now + self.policy.notice_after_s  # None: said already

    @property
    def others(self) -> list[str]:
        return [m for m in self._members if m != self.target]

    @property
    def calling(self) -> bool:
        return self._calling_since is not None

    @property
    def answering(self) -> list[str]:
        """The members whose last ClusterInfo was answered (so they run, but name no newer leader)."""
        return [m for m in self._members if m in self._answering]

    @property
    def leaderless(self) -> bool:
        """No leader to call: none is named, or the one named has failed and nobody names another."""
        return self.target is None or self._failures > 0

    # ---- decisions -------------------------------------------------------------------------------
    def poll(self, now: float) -> Plan:
        if now >= self.deadline:
            return Plan(give_up=True)
        call = None
        if self.target is not None and self._calling_since is None and now >= self._retry_at:
            call = self.target
            self._calling_since = now
        wake = [self.deadline]
        ask: list[str] = []
        patience = 0.0 if self._suspect else self.policy.ask_after_s
        if self._calling_since is not None and now < self._calling_since + patience:
            wake.append(self._calling_since + patience)  # the leader may still answer in time
        else:
            for m in self.others:
                if m in self._asking:
                    continue
                due = self._asked.get(m, -math.inf) + self.policy.ask_every_s
                if now >= due:
                    ask.append(m)
                    self._asking.add(m)
                else:
                    wake.append(due)
        if self.target is not None and self._calling_since is None:
            wake.append(self._retry_at)
        notice = False
        if self._notice_at is not None:
            if now >= self._notice_at and self.leaderless:
                notice, self._notice_at = True, None
            else:
                wake.append(max(self._notice_at, now + self.policy.ask_every_s))
        return Plan(call=call, ask=tuple(ask), wake_at=min(wake), notice=notice)

    # ---- events ----------------------------------------------------------------------------------
    def call_failed(self, now: float) -> None:
        """The call to target failed with a retryable code (UNAVAILABLE, DEADLINE_EXCEEDED)."""
        self._calling_since = None
        self._failures += 1
        backoff = min(self.policy.retry_max_s, self.policy.retry_after_s * 2 ** (self._failures - 1))
        self._retry_at = now + backoff

    def answered(self, member: str, leader: str, term: int, now: float, *, claims: bool = False) -> bool:
        """``member`` says ``leader`` (an address, "" for none) leads in ``term``; ``claims``: the
        member says it is that leader itself. True: moved to that leader, so the call in flight (if
        any) is abandoned and the next poll calls the new target.

        A member's belief can be stale within a term (a vote raises its term before it forgets the
        old leader, so one answer may pair the old leader with the new term), but a member leads in
        a term only after winning it, and Raft elects one leader per term: a claim beats a belief
        in the same term."""
        self._asking.discard(member)
        self._asked[member] = now
        self._answering.add(member)
        if not leader:
            return False
        same_term_claim = claims and self.term is not None and term == self.term and leader != self.target
        if self.term is not None and term <= self.term and not same_term_claim:
            return False  # no news: the same or an older term
        self.term = term
        if leader == self.target:
            if self._calling_since is None:  # re-elected in a newer term: try it again at once
                self._retry_at = now
            return False
        if leader not in self._members:
            self._members.append(leader)
        self.target = leader
        self.moves += 1
        self._suspect = False
        self._calling_since = None
        self._failures = 0
        self._retry_at = now
        return True

    def ask_failed(self, member: str, now: float) -> None:
        self._asking.discard(member)
        self._asked[member] = now
        self._answering.discard(member)


__all__ = ["FailoverPolicy", "LeaderFailover", "Plan", "best_answer"]

