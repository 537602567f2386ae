"""A real network partition between three metadata nodes, each in its own network namespace.

The leader is cut off alone (the minority when n=3): it must commit nothing,
the majority must elect a leader and keep committing, and after healing every
node must hold the same versions, tags and vector clocks.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from consensus.errors import MetadataError
from deploy.netns import NetnsConfig, NetnsTopology, netns_available

from .consensus_harness import DevNode, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.timeout(120)]

_OK, _WHY = netns_available()
if not _OK:
    pytestmark.append(pytest.mark.skip(reason=f"partition test skipped: {_WHY}"))

RAFT_PORT = 7301  # every node has its own namespace, so one fixed port serves all
MANIFEST = ["%064x" % i for i in range(1, 50)]
SETTLE = 30.0


class NsDevNode(DevNode):
    """A devnode started inside a network namespace (``ip netns exec`` execs it: same pid, same pipes)."""

    def __init__(self, topo: NetnsTopology, index: int, data_dir: Path) -> None:
        addresses = [f"{topo.address(i)}:{RAFT_PORT}" for i in range(topo.n)]
        super().__init__(f"n{index}", addresses[index], [a for a in addresses if a != addresses[index]], data_dir)
        self.index = index
        self.topo = topo

    def wrap(self, cmd: list[str]) -> list[str]:
        return self.topo.exec_args(self.index, cmd)


@pytest.fixture
def topo() -> Iterator[NetnsTopology]:
    t = NetnsTopology(NetnsConfig.fresh(3))
    try:
        t.create()
        yield t
    finally:
        t.destroy()


@pytest.fixture
def nodes(topo: NetnsTopology, tmp_path: Path) -> Iterator[list[NsDevNode]]:
    ns = [NsDevNode(topo, i, tmp_path / f"n{i}") for i in range(topo.n)]
    try:
        for n in ns:
            n.start()
        for n in ns:
            wait_until(lambda n=n: n.call("wait_ready", timeout=1.0), SETTLE, what=f"{n.server_id} ready")
        yield ns
    finally:
        for n in ns:
            n.kill()


def commit(node: DevNode, n: int, parent: int | None, wait: float = 10.0) -> dict[str, Any]:
    return node.call("commit_version", wait=wait, model="m", manifest_id=MANIFEST[n], parent=parent,
                     publisher="pub", nbytes=100 + n, chunk_count=1)


def leader_of(group: list[NsDevNode]) -> NsDevNode | None:
    """The node of group that the whole group agrees is leader and that says so itself."""
    views = {n.call("leader", wait=5) for n in group}
    if len(views) != 1 or None in views:
        return None
    (address,) = views
    node = next((n for n in group if n.raft == address), None)
    return node if node is not None and node.call("is_leader", wait=5) else None


def state_of(node: DevNode) -> tuple[Any, Any]:
    return node.call("list_versions", model="m")["value"], node.call("list_tags", model="m")["value"]


def test_minority_leader_commits_nothing_majority_continues_and_all_converge(
        topo: NetnsTopology, nodes: list[NsDevNode]) -> None:
    started = time.monotonic()
    old = wait_until(lambda: leader_of(nodes), SETTLE, what="one agreed leader")
    commit(old, 1, None)
    for n in nodes:
        wait_until(lambda n=n: state_of(n)[0] and state_of(n)[0][-1]["number"] == 1, SETTLE, what=f"v1 on {n.server_id}")

    majority = [n for n in nodes if n is not old]
    topo.isolate(old.index)
    cut_at = time.monotonic()

    # The majority elects one of its own and commits.
    new = wait_until(lambda: leader_of(majority), SETTLE, interval=0.1, what="a leader on the majority side")
    assert new is not old
    record = wait_until(lambda: commit(new, 2, 1), SETTLE, interval=0.1, what="a majority commit")
    assert record["number"] == 2
    to_commit = time.monotonic() - cut_at

    # The minority cannot commit: its write fails or times out, and nothing new is visible there.
    with pytest.raises((MetadataError, TimeoutError)):
        commit(old, 3, 1, wait=15.0)
    assert [v["number"] for v in state_of(old)[0]] == [1]
    with pytest.raises((MetadataError, TimeoutError)):
        old.call("resolve_tag", wait=10.0, model="m", tag="latest", linearizable=True)

    topo.heal()
    want = state_of(new)
    for n in nodes:
        wait_until(lambda n=n: state_of(n) == want, SETTLE, interval=0.1, what=f"{n.server_id} converged after heal")
    versions, tags = want
    assert [v["number"] for v in versions] == [1, 2]
    assert MANIFEST[3] not in {v["manifest_id"] for v in versions}, "the minority's write must never commit"
    assert {v["number"]: v["clock"] for v in versions} == {v["number"]: v["clock"] for v in state_of(old)[0]}
    # The cluster still commits after healing (the old leader may have been re-elected: any leader will do).
    leader = wait_until(lambda: leader_of(nodes), SETTLE, what="one leader after heal")
    assert commit(leader, 4, 2)["number"] == 3
    assert time.monotonic() - started < 60, f"partition drill too slow (majority commit after {to_commit:.2f}s)"
