"""LocalCluster in namespace mode: real paramserver processes, each in its own network namespace.

Checks the launcher's side of the partition drill: servers bind their namespace
address, root-namespace clients reach them, a cut leader loses the majority,
healing restores one agreed leader, and down() removes every namespace.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from deploy.local import LocalCluster, LocalClusterConfig, main
from deploy.netns import netns_available

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.timeout(150)]

_OK, _WHY = netns_available()
if not _OK:
    pytestmark.append(pytest.mark.skip(reason=f"namespace-mode cluster test skipped: {_WHY}"))

SETTLE = 30.0


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(LocalClusterConfig(root=tmp_path / "cluster", servers=3, netns=True,
                                        extra_args=("--no-fsync",)))
    try:
        c.up(wait=90)
        yield c
    finally:
        c.down()


def agreed_leader(c: LocalCluster, servers: list[str]) -> str | None:
    views = {(c.cluster_info(s, timeout=1.0) or {}).get("leader_id") or None for s in servers}
    return next(iter(views)) if len(views) == 1 and None not in views else None


def wait_value(fn, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def test_namespace_cluster_partition_and_heal(cluster: LocalCluster) -> None:
    topo = cluster.topology
    assert topo is not None
    prefix = topo.prefix
    assert {s.netns for s in cluster.slots} == {topo.ns(i) for i in range(3)}
    assert all(s.grpc.startswith(topo.address(i) + ":") for i, s in enumerate(cluster.slots))
    old = cluster.wait_ready(SETTLE)

    cluster.isolate(old)
    rest = [s.server_id for s in cluster.slots if s.server_id != old]
    # Right after the cut the majority still names the old leader until its election timeout fires.
    new = wait_value(lambda: (lambda v: v if v not in (None, old) else None)(agreed_leader(cluster, rest)),
                     SETTLE, "a new leader on the majority side")
    assert new in rest
    # Root-namespace clients sit with the majority by default: the cut server is out of reach.
    assert cluster.cluster_info(old, timeout=1.0) is None

    # The state file is enough to find the topology again (what 'deploy.local heal' does).
    assert main(["heal", "--dir", str(cluster.root)]) == 0
    assert cluster.wait_ready(SETTLE) in {s.server_id for s in cluster.slots}
    reloaded = LocalCluster.load_state(cluster.root)
    assert reloaded.topology is not None and reloaded.topology.subnet == topo.subnet

    # Clients attached to one side see only that side.
    cluster.partition([[old], rest], host_side=0)
    assert all(cluster.cluster_info(s, timeout=1.0) is None for s in rest)
    cluster.heal()
    cluster.wait_ready(SETTLE)

    cluster.down()
    assert not any(n.startswith(prefix) for n in namespaces())
