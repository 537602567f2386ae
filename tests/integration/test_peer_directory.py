"""Worker-peer discovery on real servers (a deploy.local cluster of 3 ``paramserver`` processes):
AnnouncePeer / FindPeers over gRPC with the read token, leases that expire, refusals that say
what to fix, survival of a server killed with -9, and ``paramctl status --json``'s served bytes
growing with a pull over either read path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import torch
from safetensors.torch import save_file

from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.rpc import ClientConfig, ParamServerClient
from paramserver.wire.proto import pb

pytestmark = pytest.mark.integration

ADMIN, READ = "admin-token-peers", "read-token-peers"
M1, M2 = "1" * 64, "2" * 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(LocalClusterConfig(root=tmp_path_factory.mktemp("peers"), servers=3, admin_token=ADMIN, read_token=READ,
                                        extra_args=("--no-fsync", "--log-level", "WARNING")))
    try:
        c.up(wait=90)
        yield c
    finally:
        c.down()


def client(address: str, token: str | None = READ) -> ParamServerClient:
    return ParamServerClient(ClientConfig(address, token=token, timeout_s=5.0))


def announce(address: str, worker: str, *versions: pb.PeerVersion, lease: float = 30.0, **kw: Any) -> pb.AnnouncePeerReply:
    with client(address) as c:
        return c.announce_peer(pb.AnnouncePeerRequest(worker_id=worker, address=f"127.0.0.1:{9000 + len(worker)}",
                                                      instance="i1", host_id="h", versions=list(versions), lease_s=lease,
                                                      **kw))


def found(address: str, manifest_id: str, **kw: Any) -> list[str]:
    with client(address) as c:
        return [p.worker_id for p in c.find_peers(manifest_id, **kw).peers]


def refusal(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def paramctl(cluster: LocalCluster, *args: str, token: str = ADMIN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN")}
    env.update(PARAMS_CLUSTER=cluster.seed, PARAMS_ADMIN_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def status_json(cluster: LocalCluster) -> dict[str, Any]:
    r = paramctl(cluster, "status", "--json", token=READ)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 1, r.stdout  # one JSON object, nothing else
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def test_announce_to_every_server_find_from_each_and_the_asker_is_excluded(cluster: LocalCluster) -> None:
    for address in cluster.addresses:
        reply = announce(address, "w-load", pb.PeerVersion(manifest_id=M1, complete=False, started_at=100.0), lease=0.2)
        assert reply.versions == 1 and reply.lease_s == 1.0  # clamped to the shortest lease
        assert announce(address, "w-load", pb.PeerVersion(manifest_id=M1, started_at=100.0)).lease_s == 30.0
        announce(address, "w-hold", pb.PeerVersion(manifest_id=M1, complete=True, started_at=200.0))
    for address in cluster.addresses:
        with client(address) as c:
            reply = c.find_peers(M1)
        assert reply.known == 2 and reply.server_id in {s.server_id for s in cluster.slots}
        assert [p.worker_id for p in reply.peers][0] == "w-load"  # the earliest first (a seed)
        assert {p.worker_id for p in reply.peers} == {"w-load", "w-hold"}
        assert found(address, M1, exclude_worker="w-load") == ["w-hold"]
        assert found(address, M2) == []


def test_an_entry_expires_after_its_lease(cluster: LocalCluster) -> None:
    address = cluster.addresses[1]
    announce(address, "w-brief", pb.PeerVersion(manifest_id=M2, complete=True), lease=1.0)
    assert found(address, M2) == ["w-brief"]
    time.sleep(1.5)
    with client(address) as c:
        reply = c.find_peers(M2)
    assert list(reply.peers) == [] and reply.known == 0
    announce(address, "w-gone", pb.PeerVersion(manifest_id=M2, complete=True))
    announce(address, "w-gone", leaving=True)  # a goodbye drops it at once
    assert found(address, M2) == []


def test_bad_input_is_refused_with_one_line_that_says_what_to_fix(cluster: LocalCluster) -> None:
    address = cluster.addresses[0]
    cases = [
        (lambda: announce(address, "w", pb.PeerVersion(manifest_id="ABC")), "64 lowercase hex"),
        (lambda: announce(address, "", pb.PeerVersion(manifest_id=M1)), "worker_id is empty"),
        (lambda: announce(address, "w" * 300, pb.PeerVersion(manifest_id=M1)), "at most 256"),
        (lambda: announce(address, "w", *(pb.PeerVersion(manifest_id=f"{i:064x}") for i in range(17))), "at most 16"),
        (lambda: announce(address, "w", pb.PeerVersion(manifest_id=M1, started_at=float("nan"))), "finite"),
        (lambda: found(address, "not-a-manifest-id"), "64 lowercase hex"),
    ]
    for call, words in cases:
        err = refusal(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert words in (err.details() or "") and "\n" not in (err.details() or ""), err.details()
    with client(address) as c:
        err = refusal(lambda: c.announce_peer(pb.AnnouncePeerRequest(worker_id="w", address="no-port",
                                                                     versions=[pb.PeerVersion(manifest_id=M1)])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "HOST:PORT" in (err.details() or "")
    with client(address, token=None) as c:  # a token is needed; the read token is enough (above)
        err = refusal(lambda: c.find_peers(M1))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_status_json_shows_served_bytes_growing_with_a_pull_on_either_path(cluster: LocalCluster, tmp_path: Path) -> None:
    before = status_json(cluster)
    assert [s["id"] for s in before["servers"]] == ["ps1", "ps2", "ps3"]
    for s in before["servers"]:
        assert isinstance(s["served_bytes"], int) and s["role"] in ("leader", "follower") and s["chunks"] >= 0, s
        assert {"grpc", "raft", "state", "disk_bytes", "repair_queue", "quarantined", "peer_entries"} <= set(s)
    assert before["leader"] in ("ps1", "ps2", "ps3") and before["ring"]["replication_factor"] == 3
    assert sum(s["peer_entries"] for s in before["servers"]) >= 6  # the announces of the first test, on every server
    weights = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))}, str(weights))  # 1 MiB
    assert paramctl(cluster, "push", str(weights), "--model", "peers", "--no-progress").returncode == 0
    total = before["served_bytes"]
    for flags in (("--no-bulk",), ()):  # GetChunks, then the bulk port
        r = paramctl(cluster, "pull", "peers", "--out", str(tmp_path / f"out{len(flags)}.safetensors"), "--no-progress",
                     *flags, token=READ)
        assert r.returncode == 0, r.stderr
        after = status_json(cluster)
        assert after["served_bytes"] == sum(s["served_bytes"] for s in after["servers"])
        assert after["served_bytes"] - total >= 1 << 20, (flags, total, after)  # at least the model's bytes
        total = after["served_bytes"]


def test_a_server_killed_with_9_leaves_the_peers_findable_on_the_others(cluster: LocalCluster) -> None:
    for address in cluster.addresses:
        announce(address, "w-survivor", pb.PeerVersion(manifest_id=M2, complete=True))
    cluster.kill("ps1")
    for address in cluster.addresses[1:]:
        assert found(address, M2) == ["w-survivor"]
    with client(cluster.addresses[0]) as c:
        assert refusal(lambda: c.find_peers(M2)).code() == grpc.StatusCode.UNAVAILABLE
