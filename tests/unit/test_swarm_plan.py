"""The swarm policy (paramserver/client/swarm_plan.py): who reads which blocks from whom."""
from __future__ import annotations

import numpy as np

from paramserver.client.swarm_plan import SwarmMember, choose_sources, rendezvous, version_salt

BLOCKS = np.arange(600, dtype=np.int64)
SALT = version_salt("ab" * 32)


def member(name: str, start: float, complete: bool = False) -> SwarmMember:
    return SwarmMember(name, complete, start)


def test_alone_reads_everything_from_the_servers() -> None:
    choice = choose_sources(member("a", 0.0), [], BLOCKS, SALT)
    assert choice.role == "alone" and (choice.peer_of == -1).all() and choice.peers == ()


def test_seeds_split_the_version_once_between_them() -> None:
    names = [f"w{k}" for k in range(6)]
    view = [member(n, 0.1 * k) for k, n in enumerate(names)]
    from_servers = np.zeros(len(BLOCKS), dtype=np.int64)
    for k in range(len(names)):
        choice = choose_sources(view[k], view, BLOCKS, SALT)
        assert choice.role == "seed" and choice.seeds == 6
        mine = choice.peer_of == -1
        from_servers += mine
        # every other block is asked of the seed that wins it, as that seed sees it too
        for slot in np.flatnonzero(~mine)[:50].tolist():
            owner = choice.peers[int(choice.peer_of[slot])].removeprefix("peer:")
            theirs = choose_sources(view[names.index(owner)], view, BLOCKS, SALT)
            assert theirs.peer_of[slot] == -1
    assert (from_servers == 1).all()  # each block from the servers exactly once
    share = [(choose_sources(view[k], view, BLOCKS, SALT).peer_of == -1).sum() for k in range(6)]
    assert min(share) > len(BLOCKS) / 6 * 0.6


def test_a_late_loader_follows_earlier_ones_and_never_the_servers() -> None:
    view = [member(f"s{k}", 0.0 + 0.1 * k) for k in range(3)] + [member(f"f{k}", 5.0 + k) for k in range(4)]
    late = member("late", 20.0)
    choice = choose_sources(late, view, BLOCKS, SALT)
    assert choice.role == "follower" and (choice.peer_of >= 0).all()
    asked = {choice.peers[int(i)] for i in np.unique(choice.peer_of)}
    assert asked == {"peer:f2", "peer:f3"}  # 4th in line past the seeds: those 2nd and 3rd in line
    ranked = choose_sources(late, view, BLOCKS, SALT, rank=40)  # far down the line: what FindPeers sampled
    assert set(ranked.peers) == {"peer:f0", "peer:f1", "peer:f2", "peer:f3"}
    # a follower never asks a peer that started after it, nor a seed while it sees a non-seed before it
    mid = choose_sources(member("f1", 6.0), view, BLOCKS, SALT)
    assert mid.peers == ("peer:f0",)
    first = choose_sources(member("f0", 5.0), view, BLOCKS, SALT)  # no non-seed before it: the seeds
    assert set(first.peers) == {"peer:s0", "peer:s1", "peer:s2"}


def test_holders_rank_as_loaders_while_a_swarm_runs_and_are_spread_after() -> None:
    running = [member("h1", 0.0, True), member("h2", 0.5, True), member("l1", 5.0), member("l2", 6.0)]
    choice = choose_sources(member("me", 9.0), running, BLOCKS, SALT)
    assert choice.role == "follower" and set(choice.peers) == {"peer:l2"}  # not the early holders
    over = [member("h1", 0.0, True), member("h2", 1.0, True), member("h3", 5.0, True)]
    choice = choose_sources(member("me", 30.0), over, BLOCKS, SALT)
    assert choice.role == "from-holders" and set(choice.peers) == {"peer:h1", "peer:h2", "peer:h3"}
    counts = np.bincount(choice.peer_of, minlength=3)
    assert counts.min() > len(BLOCKS) * 0.25


def test_rendezvous_moves_only_the_newcomers_blocks() -> None:
    before = rendezvous(BLOCKS, SALT, ["a", "b", "c"])
    after = rendezvous(BLOCKS, SALT, ["a", "b", "c", "d"])
    moved = before != after
    assert (after[moved] == 3).all()
    assert 0.1 < moved.mean() < 0.4
