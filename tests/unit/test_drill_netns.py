"""The pure parts of deploy.netns and the launcher's namespace options (no root, nothing created)."""
from __future__ import annotations

from pathlib import Path

import pytest

from deploy.local import LauncherError, LocalCluster, LocalClusterConfig
from deploy.netns import HOST, NetnsConfig, NetnsError, NetnsTopology, cleanup_stale


def topo(n: int = 3, clients: int = 1) -> NetnsTopology:
    return NetnsTopology(NetnsConfig("pdp-t1-", n, clients, "10.231.9.0/24"))


def test_fresh_prefixes_are_unique_and_valid() -> None:
    a, b = NetnsConfig.fresh(3), NetnsConfig.fresh(3)
    assert a.prefix != b.prefix and a.prefix.startswith("pdp-")
    a.validate()


@pytest.mark.parametrize("cfg, match", [
    (NetnsConfig("eth", 3), "start with 'pdp-'"),
    (NetnsConfig("pdp-waytoolongname-", 3), "prefix"),
    (NetnsConfig("pdp-a-", 0), "servers"),
    (NetnsConfig("pdp-a-", 3, clients=17), "clients"),
    (NetnsConfig("pdp-a-", 3, subnet="10.231.9.0/16"), "/24"),
    (NetnsConfig("pdp-a-", 3, subnet="8.8.8.0/24"), "not private"),
    (NetnsConfig("pdp-a-", 3, subnet="nonsense"), "IPv4 network"),
])
def test_bad_configs_say_what_to_fix(cfg: NetnsConfig, match: str) -> None:
    with pytest.raises(NetnsError, match=match):
        cfg.validate()


def test_names_addresses_and_exec_args() -> None:
    t = topo()
    assert t.ns(0) == "pdp-t1-s0" and t.bridge_ns == "pdp-t1-br" and t.host_link == "pdp-t1-h"
    assert len(t.host_link) <= 15  # IFNAMSIZ
    assert [t.address(i) for i in range(3)] == ["10.231.9.1", "10.231.9.2", "10.231.9.3"]
    assert t.address(HOST) == "10.231.9.254" and t.address("c0") == "10.231.9.101"
    assert t.exec_args(1, ["python", "-V"]) == ["ip", "netns", "exec", "pdp-t1-s1", "python", "-V"]
    assert t.client_exec_args(0, ["x"])[:4] == ["ip", "netns", "exec", "pdp-t1-c0"]
    assert t.endpoints() == [0, 1, 2, HOST, "c0"]
    with pytest.raises(NetnsError, match="server index"):
        t.ns(3)
    with pytest.raises(NetnsError, match="unknown endpoint"):
        t.address("c1")
    with pytest.raises(NetnsError, match="call create"):
        NetnsTopology(NetnsConfig("pdp-t2-", 3)).address(0)


def test_partition_groups_are_validated_before_anything_is_touched() -> None:
    t = topo()
    with pytest.raises(NetnsError, match="in two groups"):
        t.partition([{0, 1}, {1, 2}])
    with pytest.raises(NetnsError, match=r"servers \[2\] are in no group"):
        t.partition([{0}, {1}])
    with pytest.raises(NetnsError, match="unknown endpoint"):
        t.partition([{0, "nope"}, {1, 2}])
    assert t.cuts() == {}


def test_cleanup_refuses_foreign_names() -> None:
    with pytest.raises(NetnsError, match="refusing"):
        cleanup_stale("eth")


def test_launcher_namespace_options(tmp_path: Path) -> None:
    with pytest.raises(LauncherError, match="need netns=True"):
        LocalClusterConfig(root=tmp_path, netns_clients=1).validate()
    c = LocalCluster(LocalClusterConfig(root=tmp_path, servers=3))
    c.slots = c._plan()
    assert all(s.netns is None and s.grpc.startswith("127.0.0.1:") for s in c.slots)
    with pytest.raises(LauncherError, match="namespace mode"):
        c.isolate("ps1")
    # Namespace mode without creating anything: addresses and argv come from the topology.
    c.topology = topo(3, 0)
    c.slots = c._plan()
    assert [s.grpc for s in c.slots] == ["10.231.9.1:7070", "10.231.9.2:7070", "10.231.9.3:7070"]
    assert c._args_for(c.slots[1])[:4] == ["ip", "netns", "exec", "pdp-t1-s1"]
    with pytest.raises(LauncherError, match="host_side"):
        c.partition([["ps1"], ["ps2", "ps3"]], host_side=5)
