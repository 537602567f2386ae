from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from consensus.clock import Ordering, VectorClock
from consensus.errors import Conflict, Invalid, MetadataError, NotFound
from consensus.state import CLOCK_RULE, MAX_RECENT_REQUESTS, MetadataState

M = ["%064x" % i for i in range(1, 50)]


def commit(state: MetadataState, parent: int | None, publisher: str = "alice", *, model: str = "resnet",
           n: int = 1, at: float = 100.0, **extra: Any) -> dict[str, Any]:
    """A commit as MetadataNode proposes it (its clock rule unless ``clock_rule`` is given)."""
    return state.apply({"op": "commit_version", "model": model, "manifest_id": M[n], "parent": parent,
                        "publisher": publisher, "nbytes": 10 * n, "chunk_count": n, "created_at": at,
                        "clock_rule": CLOCK_RULE, **extra})


def tag_cmd(op: str, tag: str, *, model: str = "resnet", who: str = "ops", when: float = 200.0, **extra: Any) -> dict:
    return {"op": op, "model": model, "tag": tag, "who": who, "when": when, **extra}


@pytest.fixture
def state() -> MetadataState:
    return MetadataState()


# ---------------------------------------------------------------- commit_version
def test_first_commit(state: MetadataState) -> None:
    v = commit(state, None)
    assert v == {"model": "resnet", "number": 1, "manifest_id": M[1], "clock": {"alice": 1}, "parent": None,
                 "created_at": 100.0, "nbytes": 10, "chunk_count": 1, "publisher": "alice", "forced": False}
    assert state.list_models() == ["resnet"]
    assert state.resolve_tag("resnet", "latest")["number"] == 1


def test_clock_is_parent_clock_incremented_for_publisher(state: MetadataState) -> None:
    commit(state, None, "alice")
    assert commit(state, 1, "bob", n=2)["clock"] == {"alice": 1, "bob": 1}
    assert commit(state, 2, "bob", n=3)["clock"] == {"alice": 1, "bob": 2}


def test_numbers_increase_and_are_never_reused(state: MetadataState) -> None:
    commit(state, None)
    commit(state, 1, n=2)
    state.apply(tag_cmd("set_tag", "latest", version=1))
    state.apply({"op": "delete_version", "model": "resnet", "version": 2})
    assert commit(state, 1, n=3)["number"] == 3


def test_concurrent_commit_is_a_conflict_naming_both_versions(state: MetadataState) -> None:
    commit(state, None, "alice")
    commit(state, 1, "alice", n=2)
    with pytest.raises(Conflict) as err:
        commit(state, 1, "bob", n=3)
    assert "resnet:1" in str(err.value) and "resnet:2" in str(err.value) and "force" in str(err.value)
    assert [v["number"] for v in state.list_versions("resnet")] == [1, 2]


def test_first_push_on_existing_model_conflicts(state: MetadataState) -> None:
    commit(state, None, "alice")
    with pytest.raises(Conflict):
        commit(state, None, "bob", n=2)


def test_force_commits_marked_without_moving_latest(state: MetadataState) -> None:
    commit(state, None, "alice")
    commit(state, 1, "alice", n=2)
    forced = commit(state, 1, "bob", n=3, force=True)
    assert forced["forced"] and forced["number"] == 3 and forced["clock"] == {"alice": 1, "bob": 1}
    assert state.resolve_tag("resnet", "latest")["number"] == 2
    assert state.head("resnet")["number"] == 2  # a forced version is never the head
    # force on a commit that does not conflict changes nothing
    normal = commit(state, 2, "alice", n=4, force=True)
    assert not normal["forced"] and state.resolve_tag("resnet", "latest")["number"] == 4


def test_a_forced_sibling_by_the_same_publisher_gets_a_clock_of_its_own(state: MetadataState) -> None:
    """alice commits v2 on v1, then force-commits v3 on v1 again: the plain increment gave v3 v2's
    clock, and clients that had seen the tag on v2 then refused a move to v3 for good."""
    commit(state, None, "alice")
    v2 = commit(state, 1, "alice", n=2)
    v3 = commit(state, 1, "alice", n=3, force=True)
    assert v3["forced"] and v3["clock"] == {"alice": 1, "alice/v3": 1} != v2["clock"]
    v1c, v2c, v3c = (VectorClock(v["clock"]) for v in (state.list_versions("resnet")[0], v2, v3))
    assert v3c.compare(v1c) is Ordering.AFTER and v3c.compare(v2c) is Ordering.CONCURRENT
    v4 = commit(state, 3, "alice", n=4, force=True)  # on the sibling: after it
    assert VectorClock(v4["clock"]).compare(v3c) is Ordering.AFTER
    clocks = [tuple(sorted(v["clock"].items())) for v in state.list_versions("resnet")]
    assert len(set(clocks)) == len(clocks)


def test_a_commit_on_a_forced_sibling_does_not_pass_over_the_head_it_does_not_contain(state: MetadataState) -> None:
    """alice: v2 on v1, then v3 forced on v1, then v4 on v3. The plain increment gave v4
    {alice: 2, alice/v3: 1}, which compares after v2 {alice: 2}: no conflict, and latest moved
    from v2 to a version that never had v2's change."""
    commit(state, None, "alice")
    commit(state, 1, "alice", n=2)
    commit(state, 1, "alice", n=3, force=True)
    with pytest.raises(Conflict, match="head is resnet:2"):
        commit(state, 3, "alice", n=4)
    assert state.resolve_tag("resnet", "latest")["number"] == 2
    v4 = commit(state, 3, "alice", n=4, force=True)  # alice counts on in the sibling line's key
    assert v4["forced"] and v4["clock"] == {"alice": 1, "alice/v3": 2}
    v5 = commit(state, 4, "bob", n=5, force=True)  # another publisher on the sibling line: its own key is new
    assert v5["clock"] == {"alice": 1, "alice/v3": 2, "bob": 1}
    clocks = {v["number"]: VectorClock(v["clock"]) for v in state.list_versions("resnet")}
    assert clocks[5].compare(clocks[3]) is Ordering.AFTER and clocks[5].compare(clocks[2]) is Ordering.CONCURRENT
    # The head's own line goes on with plain increments.
    assert commit(state, 2, "alice", n=6)["clock"] == {"alice": 3}


def test_a_line_keeps_one_key_per_fork_however_many_commits_follow(state: MetadataState) -> None:
    """After one forced sibling, every later commit by the same publisher on the head used to start
    a key of its own: 2,000 commits carried 1,998 keys (34 MB of clocks)."""
    commit(state, None, "alice")
    commit(state, 1, "bob", n=2)
    commit(state, 1, "alice", n=3, force=True)  # takes alice's count 2 off the head line
    head = 2
    for i in range(40):
        head = commit(state, head, "alice", n=4 + i)["number"]
    clock = state.get_version("resnet", head)["clock"]
    assert clock == {"alice": 1, "bob": 1, "alice/v4": 40}
    assert state.resolve_tag("resnet", "latest")["number"] == head


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(["alice", "bob", "carol"]), st.booleans()),
                min_size=1, max_size=30))
def test_a_clock_is_after_exactly_its_ancestors(steps: list[tuple[int, str, bool]]) -> None:
    """Whatever the forks: no two versions share a clock, and one compares after another exactly
    when the other is its ancestor (so the conflict check and the workers' monotonic check hold)."""
    state = MetadataState()
    parents: dict[int, int | None] = {}
    for i, (pick, publisher, on_head) in enumerate(steps):
        numbers = sorted(parents)
        parent = None if not numbers else (state.head("resnet") or {}).get("number") if on_head else numbers[pick % len(numbers)]
        v = commit(state, parent, publisher, n=1 + i % 48, force=True)
        parents[v["number"]] = parent
    clocks = {v["number"]: VectorClock(v["clock"]) for v in state.list_versions("resnet")}

    def ancestors(n: int) -> set[int]:
        out: set[int] = set()
        p = parents[n]
        while p is not None:
            out.add(p)
            p = parents[p]
        return out

    assert len({tuple(sorted(c.to_dict().items())) for c in clocks.values()}) == len(clocks)
    for a in clocks:
        for b in clocks:
            if a != b:
                assert (clocks[a].compare(clocks[b]) is Ordering.AFTER) == (b in ancestors(a)), (a, b)


def test_a_leader_proposes_the_rule_every_member_applies(state: MetadataState) -> None:
    """A server from before rule 2 ignores the command's clock_rule and replays rule 1: while one is a
    member, rule 1 is proposed, so replicas never diverge in a rolling upgrade."""
    assert state.proposal_clock_rule() == 1  # no member record yet
    member = {"op": "add_member", "grpc_address": "127.0.0.1:7000", "raft_address": "127.0.0.1:7100"}
    state.apply({**member, "server_id": "ps1", "clock_rule": CLOCK_RULE})
    assert state.proposal_clock_rule() == CLOCK_RULE
    state.apply({**member, "server_id": "ps2", "grpc_address": "127.0.0.1:7001", "raft_address": "127.0.0.1:7101"})
    assert state.member("ps2")["clock_rule"] == 1 and state.proposal_clock_rule() == 1  # an old server's record
    state.apply({**member, "server_id": "ps2", "grpc_address": "127.0.0.1:7001", "raft_address": "127.0.0.1:7101",
                 "clock_rule": 7})  # a newer server applies more: this code proposes what it knows
    assert state.proposal_clock_rule() == CLOCK_RULE
    for bad in (0, True, "2", 10**6):
        with pytest.raises(Invalid, match="clock_rule must be an integer"):
            state.apply({**member, "server_id": "ps3", "grpc_address": "127.0.0.1:7002",
                         "raft_address": "127.0.0.1:7102", "clock_rule": bad})


def test_a_journal_replays_to_the_clocks_it_was_acknowledged_with(state: MetadataState) -> None:
    """A command without clock_rule was proposed by a server from before rule 2: replayed, it gets
    the clock that server gave it, so a replica rebuilt from the log matches one loaded from a dump."""
    state.apply({"op": "commit_version", "model": "resnet", "manifest_id": M[1], "parent": None,
                 "publisher": "alice", "nbytes": 1, "chunk_count": 1, "created_at": 1.0})
    commit(state, 1, "alice", n=2, clock_rule=1)
    commit(state, 1, "alice", n=3, force=True)
    old = commit(state, 3, "alice", n=4, clock_rule=1)  # rule 1: the plain increment, after v2
    assert old["clock"] == {"alice": 2, "alice/v3": 1} and not old["forced"]
    with pytest.raises(Invalid, match="clock_rule must be one of"):
        commit(state, 4, "alice", n=5, clock_rule=CLOCK_RULE + 1)


def test_rule_2_replays_as_it_was_proposed(state: MetadataState) -> None:
    """Rule 2 (a key per commit after a fork) was proposed by code before rule 3: its commands keep
    their clocks, whatever this code proposes now."""
    commit(state, None, "alice", clock_rule=2)
    commit(state, 1, "alice", n=2, clock_rule=2)
    commit(state, 1, "alice", n=3, force=True, clock_rule=2)
    v4 = commit(state, 3, "alice", n=4, force=True, clock_rule=2)
    assert v4["clock"] == {"alice": 1, "alice/v3": 1, "alice/v4": 1}
    v5 = commit(state, 3, "alice", n=5, force=True)  # rule 3 on the same line: its key counts on
    assert v5["clock"] == {"alice": 1, "alice/v3": 2}


def test_commit_with_tag_sets_it_atomically(state: MetadataState) -> None:
    v = commit(state, None, tag="prod")
    assert state.resolve_tag("resnet", "prod")["number"] == v["number"]
    with pytest.raises(Invalid):
        commit(state, 1, n=2, tag="bad/tag")
    assert len(state.list_versions("resnet")) == 1  # nothing half-applied


def test_missing_parent_is_not_found(state: MetadataState) -> None:
    with pytest.raises(NotFound):
        commit(state, 1)
    commit(state, None)
    with pytest.raises(NotFound):
        commit(state, 7, n=2)


@pytest.mark.parametrize("field,value", [
    ("model", ""), ("model", "a" * 129), ("model", "a/b"), ("model", "a..b"), ("model", ".hidden"), ("model", "-x"),
    ("model", 5), ("manifest_id", "A" * 64), ("manifest_id", "a" * 63), ("manifest_id", None),
    ("publisher", ""), ("nbytes", -1), ("nbytes", 1.5), ("chunk_count", True), ("created_at", float("nan")),
    ("created_at", None), ("parent", 0), ("parent", "1"), ("force", "yes"), ("tag", ""),
])
def test_commit_validation(state: MetadataState, field: str, value: Any) -> None:
    command = {"op": "commit_version", "model": "resnet", "manifest_id": M[1], "parent": None, "publisher": "alice",
               "nbytes": 1, "chunk_count": 1, "created_at": 1.0, field: value}
    with pytest.raises(Invalid):
        state.apply(command)
    assert state.list_models() == []


def test_names_allowed(state: MetadataState) -> None:
    for name in ["a", "A9", "resnet-50_v2.1", "x" * 128]:
        commit(state, None, model=name)


def test_unknown_command(state: MetadataState) -> None:
    with pytest.raises(Invalid):
        state.apply({"op": "drop_everything"})
    with pytest.raises(Invalid):
        state.apply("commit_version")  # type: ignore[arg-type]


# ------------------------------------------------------------------------ tags
def test_latest_follows_newest_until_set_explicitly(state: MetadataState) -> None:
    commit(state, None)
    commit(state, 1, n=2)
    assert state.resolve_tag("resnet", "latest")["number"] == 2
    state.apply(tag_cmd("set_tag", "latest", version=1))
    assert state.latest_pinned("resnet")
    commit(state, 2, n=3)
    assert state.resolve_tag("resnet", "latest")["number"] == 1  # pinned: stays
    state.apply(tag_cmd("delete_tag", "latest"))  # unpins and jumps to the head
    assert not state.latest_pinned("resnet")
    assert state.resolve_tag("resnet", "latest")["number"] == 3
    commit(state, 3, n=4)
    assert state.resolve_tag("resnet", "latest")["number"] == 4


def test_rollback_of_latest_pins_it(state: MetadataState) -> None:
    commit(state, None)
    commit(state, 1, n=2)
    state.apply(tag_cmd("rollback_tag", "latest"))
    assert state.resolve_tag("resnet", "latest")["number"] == 1
    commit(state, 2, n=3)
    assert state.resolve_tag("resnet", "latest")["number"] == 1


def test_tag_history_and_rollback_walk_back(state: MetadataState) -> None:
    for n in range(1, 4):
        commit(state, n - 1 or None, n=n)
    state.apply(tag_cmd("set_tag", "prod", version=1, who="a", when=1.0))
    state.apply(tag_cmd("set_tag", "prod", version=2, who="b", when=2.0))
    state.apply(tag_cmd("set_tag", "prod", version=3, who="c", when=3.0))
    def rollback_to() -> int | None:
        return next(t for t in state.list_tags("resnet") if t["tag"] == "prod")["rollback_to"]

    assert rollback_to() == 2
    rec = state.apply(tag_cmd("rollback_tag", "prod", who="d", when=4.0))
    assert rec["version"] == 2 and rollback_to() == 1  # not 3, which the last move came from
    rec = state.apply(tag_cmd("rollback_tag", "prod", who="e", when=5.0))
    assert rec["version"] == 1 and rollback_to() is None
    assert [(m["from_version"], m["to_version"], m["who"], m["when"]) for m in rec["history"]] == [
        (None, 1, "a", 1.0), (1, 2, "b", 2.0), (2, 3, "c", 3.0), (3, 2, "d", 4.0), (2, 1, "e", 5.0)]
    with pytest.raises(Conflict):
        state.apply(tag_cmd("rollback_tag", "prod"))
    assert state.get_tag("resnet", "prod")["version"] == 1


def test_set_tag_to_same_version_records_nothing(state: MetadataState) -> None:
    commit(state, None)
    state.apply(tag_cmd("set_tag", "prod", version=1))
    rec = state.apply(tag_cmd("set_tag", "prod", version=1))
    assert len(rec["history"]) == 1


def test_rollback_skips_deleted_versions(state: MetadataState) -> None:
    for n in range(1, 4):
        commit(state, n - 1 or None, n=n)
    state.apply(tag_cmd("set_tag", "prod", version=1))
    state.apply(tag_cmd("set_tag", "prod", version=2))
    state.apply(tag_cmd("set_tag", "prod", version=3))
    state.apply({"op": "delete_version", "model": "resnet", "version": 2})
    assert [t["rollback_to"] for t in state.list_tags("resnet") if t["tag"] == "prod"] == [1]
    assert state.apply(tag_cmd("rollback_tag", "prod"))["version"] == 1


def test_tag_errors(state: MetadataState) -> None:
    with pytest.raises(NotFound):
        state.apply(tag_cmd("set_tag", "prod", version=1))  # no model
    commit(state, None)
    with pytest.raises(NotFound):
        state.apply(tag_cmd("set_tag", "prod", version=9))
    with pytest.raises(NotFound):
        state.apply(tag_cmd("rollback_tag", "prod"))
    with pytest.raises(NotFound):
        state.apply(tag_cmd("delete_tag", "prod"))
    with pytest.raises(NotFound):
        state.resolve_tag("resnet", "prod")
    with pytest.raises(Invalid):
        state.apply(tag_cmd("set_tag", "a/b", version=1))
    with pytest.raises(Invalid):
        state.apply(tag_cmd("set_tag", "prod", version=1, who=""))
    with pytest.raises(Invalid):
        state.apply(tag_cmd("set_tag", "prod", version=0))
    with pytest.raises(Invalid):
        state.apply(tag_cmd("set_tag", "prod", version=1, when=-1))


def test_delete_tag_keeps_history_for_a_recreated_tag(state: MetadataState) -> None:
    commit(state, None)
    state.apply(tag_cmd("set_tag", "prod", version=1, when=1.0))
    state.apply(tag_cmd("delete_tag", "prod", when=2.0))
    assert [t["tag"] for t in state.list_tags("resnet")] == ["latest"]
    rec = state.apply(tag_cmd("set_tag", "prod", version=1, when=3.0))
    assert [(m["from_version"], m["to_version"]) for m in rec["history"]] == [(None, 1), (1, None), (None, 1)]


# ------------------------------------------------------------- delete_version
def test_delete_version_refused_while_tagged(state: MetadataState) -> None:
    commit(state, None)
    commit(state, 1, n=2)
    state.apply(tag_cmd("set_tag", "prod", version=1))
    with pytest.raises(Conflict) as err:
        state.apply({"op": "delete_version", "model": "resnet", "version": 1})
    assert "prod" in str(err.value)
    with pytest.raises(Conflict):
        state.apply({"op": "delete_version", "model": "resnet", "version": 2})  # latest points at it
    state.apply(tag_cmd("set_tag", "prod", version=2))
    state.apply({"op": "delete_version", "model": "resnet", "version": 1})
    with pytest.raises(NotFound):
        state.get_version("resnet", 1)
    with pytest.raises(NotFound):
        state.apply({"op": "delete_version", "model": "resnet", "version": 1})
    with pytest.raises(NotFound):
        state.apply({"op": "delete_version", "model": "nope", "version": 1})


# ------------------------------------------------------------------- members
def member(server_id: str = "s1", raft: str = "10.0.0.1:7000", **extra: Any) -> dict[str, Any]:
    return {"op": "add_member", "server_id": server_id, "grpc_address": "10.0.0.1:50051", "raft_address": raft,
            **extra}


def test_members_upsert_and_remove(state: MetadataState) -> None:
    state.apply(member("s2", "10.0.0.2:7000"))
    state.apply(member("s1", zone="eu-1"))
    state.apply(member("s1", state="leaving", zone="eu-1"))
    assert [(m["server_id"], m["state"], m["zone"]) for m in state.members()] == [
        ("s1", "leaving", "eu-1"), ("s2", "up", "")]
    state.apply({"op": "remove_member", "server_id": "s1"})
    assert [m["server_id"] for m in state.members()] == ["s2"]
    with pytest.raises(NotFound):
        state.apply({"op": "remove_member", "server_id": "s1"})


@pytest.mark.parametrize("bad", [
    {"server_id": "a/b"}, {"grpc_address": "nohost"}, {"raft_address": "h:0"}, {"raft_address": "h:x"},
    {"state": "gone"}, {"zone": 3},
])
def test_member_validation(state: MetadataState, bad: dict[str, Any]) -> None:
    with pytest.raises(Invalid):
        state.apply({**member(), **bad})


def test_member_raft_address_must_be_unique(state: MetadataState) -> None:
    state.apply(member("s1"))
    with pytest.raises(Conflict):
        state.apply(member("s2"))


# -------------------------------------------------- dedupe, determinism, snapshot
def test_request_id_applies_once(state: MetadataState) -> None:
    cmd = {"op": "commit_version", "model": "m", "manifest_id": M[1], "parent": None, "publisher": "p",
           "nbytes": 1, "chunk_count": 1, "created_at": 1.0, "request_id": "r1"}
    first = state.apply(cmd)
    assert state.apply(cmd) == first
    assert len(state.list_versions("m")) == 1
    bad = {**cmd, "parent": 9, "request_id": "r2"}
    for _ in range(2):
        with pytest.raises(NotFound):
            state.apply(bad)


def test_request_id_memory_is_bounded(state: MetadataState) -> None:
    for i in range(MAX_RECENT_REQUESTS + 10):
        state.apply({"op": "barrier", "request_id": f"r{i}"})
    assert len(state.snapshot()["recent"]) == MAX_RECENT_REQUESTS


def scenario() -> list[dict[str, Any]]:
    cmds: list[dict[str, Any]] = [member("s1"), member("s2", "10.0.0.2:7000")]
    base = {"op": "commit_version", "model": "m", "nbytes": 5, "chunk_count": 1}
    cmds += [
        {**base, "manifest_id": M[1], "parent": None, "publisher": "a", "created_at": 1.0},
        {**base, "manifest_id": M[2], "parent": 1, "publisher": "b", "created_at": 2.0, "tag": "prod"},
        {**base, "manifest_id": M[3], "parent": 1, "publisher": "c", "created_at": 3.0},  # conflict
        {**base, "manifest_id": M[3], "parent": 1, "publisher": "c", "created_at": 3.0, "force": True},
        tag_cmd("set_tag", "canary", model="m", version=3),
        tag_cmd("rollback_tag", "prod", model="m"),  # no earlier target: conflict
        {**base, "manifest_id": M[4], "parent": 2, "publisher": "a", "created_at": 4.0},
        tag_cmd("set_tag", "prod", model="m", version=4),
        tag_cmd("rollback_tag", "prod", model="m"),
        {"op": "delete_version", "model": "m", "version": 1},
        {"op": "remove_member", "server_id": "s2"},
    ]
    return cmds


def run(cmds: list[dict[str, Any]]) -> tuple[MetadataState, list[Any]]:
    state = MetadataState()
    results: list[Any] = []
    for c in cmds:
        try:
            results.append(state.apply(copy.deepcopy(c)))
        except MetadataError as exc:
            results.append((type(exc).__name__, str(exc)))
    return state, results


def test_two_replicas_fed_the_same_commands_agree() -> None:
    a, ra = run(scenario())
    b, rb = run(scenario())
    assert ra == rb
    assert a.snapshot() == b.snapshot()
    assert json.dumps(a.snapshot(), sort_keys=True) == json.dumps(b.snapshot(), sort_keys=True)
    assert ("Conflict" in [r[0] for r in ra if isinstance(r, tuple)])


def test_snapshot_restore_round_trip_through_json() -> None:
    a, _ = run(scenario())
    b = MetadataState()
    b.restore(json.loads(json.dumps(a.snapshot())))
    assert b.snapshot() == a.snapshot()
    # the restored replica keeps applying identically
    nxt = {"op": "commit_version", "model": "m", "manifest_id": M[5], "parent": 4, "publisher": "a",
           "nbytes": 1, "chunk_count": 1, "created_at": 9.0}
    assert a.apply(dict(nxt)) == b.apply(dict(nxt))
    assert a.snapshot() == b.snapshot()
    with pytest.raises(Invalid):
        b.restore({"format": 99})


def test_reads_return_copies(state: MetadataState) -> None:
    commit(state, None)
    state.get_version("resnet", 1)["clock"]["alice"] = 99
    state.list_tags("resnet")[0]["history"].clear()
    assert state.get_version("resnet", 1)["clock"] == {"alice": 1}
    assert state.list_tags("resnet")[0]["history"]


ops = st.sampled_from(["commit", "force", "set", "rollback", "delete_tag", "delete_version"])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(ops, st.integers(1, 6), st.sampled_from(["a", "b"]), st.sampled_from(["prod", "latest"])),
                max_size=40))
def test_random_sequences_are_deterministic_and_snapshot_stable(steps: list[tuple[str, int, str, str]]) -> None:
    cmds: list[dict[str, Any]] = []
    for i, (op, n, who, tag) in enumerate(steps):
        when = float(i)
        if op in ("commit", "force"):
            cmds.append({"op": "commit_version", "model": "m", "manifest_id": M[n], "parent": n if n > 1 else None,
                         "publisher": who, "nbytes": n, "chunk_count": n, "created_at": when, "force": op == "force"})
        elif op == "set":
            cmds.append(tag_cmd("set_tag", tag, model="m", version=n, when=when))
        elif op == "rollback":
            cmds.append(tag_cmd("rollback_tag", tag, model="m", when=when))
        elif op == "delete_tag":
            cmds.append(tag_cmd("delete_tag", tag, model="m", when=when))
        else:
            cmds.append({"op": "delete_version", "model": "m", "version": n})
    a, ra = run(cmds)
    b, rb = run(cmds)
    assert ra == rb and a.snapshot() == b.snapshot()
    c = MetadataState()
    c.restore(json.loads(json.dumps(a.snapshot())))
    assert c.snapshot() == a.snapshot()
    if "m" in a.list_models():
        versions = [v["number"] for v in a.list_versions("m")]
        assert versions == sorted(versions)
        for t in a.list_tags("m"):
            assert t["version"] in versions  # a tag never points at a deleted version


def test_member_raft_address_cannot_change_in_place(state: MetadataState) -> None:
    state.apply(member("s1"))
    with pytest.raises(Conflict, match="remove the member"):
        state.apply(member("s1", "10.0.0.9:7000"))
    with pytest.raises(Invalid):
        state.check_add_member({**member("s9"), "grpc_address": "x"})
    state.check_add_member(member("s9", "10.0.0.9:7000"))
    assert [m["server_id"] for m in state.members()] == ["s1"]  # a check changes nothing
