"""Three (or four) real metadata node processes on 127.0.0.1."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from consensus.errors import Conflict, MetadataError, NotFound

from .consensus_harness import Cluster, DevNode, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MANIFEST = ["%064x" % i for i in range(1, 100)]
SETTLE = 60.0  # generous: the CI machine is small and shared


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, size=3)
    try:
        c.start()
        yield c
    finally:
        c.close()


def commit(node: DevNode, model: str, n: int, parent: int | None, publisher: str = "pub", **extra: Any) -> dict[str, Any]:
    return node.call("commit_version", model=model, manifest_id=MANIFEST[n], parent=parent, publisher=publisher,
                     nbytes=1000 + n, chunk_count=n + 1, **extra)


def commit_eventually(node: DevNode, model: str, n: int, parent: int | None) -> dict[str, Any]:
    """Retry through an election; the request id makes each attempt apply at most once."""
    return wait_until(lambda: commit(node, model, n, parent), SETTLE, interval=0.1, what="a committed write")


def visible(node: DevNode, model: str, number: int) -> bool:
    return node.call("get_version", model=model, number=number)["value"]["number"] == number


def test_commit_on_leader_is_visible_on_all_nodes(cluster: Cluster) -> None:
    leader = cluster.leader()
    record = commit(leader, "resnet50", 1, None, tag="prod")
    assert record["number"] == 1 and record["clock"] == {"pub": 1}
    for node in cluster.nodes:
        wait_until(lambda n=node: visible(n, "resnet50", 1), SETTLE, what=f"v1 on {node.server_id}")
        read = node.call("resolve_tag", model="resnet50", tag="prod")
        assert read["value"]["manifest_id"] == MANIFEST[1]
        assert read["value"]["clock"] == {"pub": 1}
        assert read["commit_index"] >= 1
    # A write sent to a follower is forwarded, and its typed error comes back typed.
    follower = cluster.followers()[0]
    assert commit(follower, "resnet50", 2, 1)["number"] == 2
    with pytest.raises(NotFound):
        follower.call("set_tag", model="resnet50", tag="prod", version=99, who="ops")
    linear = follower.call("resolve_tag", model="resnet50", tag="latest", linearizable=True)
    assert linear["linearizable"] and linear["value"]["number"] == 2


def test_leader_killed_new_leader_commits_and_old_leader_catches_up(cluster: Cluster) -> None:
    old = cluster.leader()
    commit(old, "bert", 1, None)
    old.kill()
    survivor = cluster.alive()[0]
    record = commit_eventually(survivor, "bert", 2, 1)
    assert record["number"] == 2
    new = cluster.leader()
    assert new is not old and new.alive
    old.start()
    wait_until(lambda: visible(old, "bert", 2), SETTLE, what="restarted old leader catching up")
    assert old.call("resolve_tag", model="bert", tag="latest")["value"]["number"] == 2


def test_full_cluster_restart_keeps_every_version_and_tag(cluster: Cluster) -> None:
    leader = cluster.leader()
    for n in range(1, 6):
        commit(leader, "gpt", n, n - 1 if n > 1 else None)
    leader.call("set_tag", model="gpt", tag="prod", version=3, who="ops")
    leader.call("set_tag", model="gpt", tag="prod", version=4, who="ops")
    leader.call("rollback_tag", model="gpt", tag="prod", who="ops")
    leader.call("delete_version", model="gpt", version=1)
    before_versions = leader.call("list_versions", model="gpt")["value"]
    before_tags = leader.call("list_tags", model="gpt")["value"]
    # Every node must hold the commits before the kill, or a restart could legitimately miss them.
    for node in cluster.nodes:
        wait_until(lambda n=node: n.call("list_tags", model="gpt")["value"] == before_tags, SETTLE)
    for node in cluster.nodes:
        node.kill()
    for node in cluster.nodes:
        node.start()
    cluster.wait_ready(SETTLE)
    for node in cluster.nodes:
        wait_until(lambda n=node: n.call("list_versions", model="gpt")["value"] == before_versions, SETTLE,
                   what=f"versions on {node.server_id} after restart")
        assert node.call("list_tags", model="gpt")["value"] == before_tags
    prod = cluster.nodes[0].call("resolve_tag", model="gpt", tag="prod")["value"]
    assert prod["number"] == 3
    # Numbering continues after the restart; nothing is reused.
    assert commit_eventually(cluster.nodes[1], "gpt", 6, 5)["number"] == 6


def test_two_publishers_on_the_same_parent_one_wins_one_conflicts(cluster: Cluster) -> None:
    leader = cluster.leader()
    commit(leader, "llama", 1, None, publisher="alice")
    a, b = cluster.followers()
    wait_until(lambda: visible(a, "llama", 1) and visible(b, "llama", 1), SETTLE)
    outcomes: dict[str, Any] = {}
    barrier = threading.Barrier(2)

    def push(node: DevNode, publisher: str, n: int) -> None:
        barrier.wait(timeout=30)
        try:
            outcomes[publisher] = commit(node, "llama", n, 1, publisher=publisher)
        except MetadataError as exc:
            outcomes[publisher] = exc

    threads = [threading.Thread(target=push, args=(a, "alice", 2)), threading.Thread(target=push, args=(b, "bob", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    wins = [o for o in outcomes.values() if isinstance(o, dict)]
    conflicts = [o for o in outcomes.values() if isinstance(o, Conflict)]
    assert len(wins) == 1 and len(conflicts) == 1, outcomes
    assert wins[0]["number"] == 2
    assert "llama:2" in str(conflicts[0]) and "llama:1" in str(conflicts[0])
    versions = leader.call("list_versions", model="llama", wait=30)["value"]
    assert [v["number"] for v in versions] == [1, 2]


def test_member_added_and_removed(cluster: Cluster, tmp_path: Path) -> None:
    for node in cluster.nodes:
        cluster.nodes[0].call("add_member", server_id=node.server_id, grpc_address=f"127.0.0.1:{free_port()}",
                              raft_address=node.raft, zone="a")
    commit(cluster.leader(), "vit", 1, None)
    newcomer = DevNode("n3", f"127.0.0.1:{free_port()}", [n.raft for n in cluster.nodes], tmp_path / "n3")
    cluster.nodes.append(newcomer)  # so that the fixture kills it too
    newcomer.start()
    cluster.nodes[1].call("add_member", server_id="n3", grpc_address="127.0.0.1:1", raft_address=newcomer.raft,
                          zone="b", wait=60)
    wait_until(lambda: visible(newcomer, "vit", 1), SETTLE, what="newcomer catching up")
    ids = [m["server_id"] for m in newcomer.call("members")["value"]]
    assert ids == ["n0", "n1", "n2", "n3"]
    assert newcomer.raft in cluster.leader().call("status")["cluster"]
    assert commit_eventually(newcomer, "vit", 2, 1)["number"] == 2

    cluster.nodes[0].call("remove_member", server_id="n3", wait=60)
    for node in cluster.nodes[:3]:
        wait_until(lambda n=node: newcomer.raft not in n.call("status")["cluster"], SETTLE)
        wait_until(lambda n=node: "n3" not in [m["server_id"] for m in n.call("members")["value"]], SETTLE)
    newcomer.kill()
    assert commit_eventually(cluster.nodes[2], "vit", 3, 2)["number"] == 3
    with pytest.raises(NotFound):
        cluster.nodes[0].call("remove_member", server_id="n3")
