"""Hot-chunk replication against real clusters (issue #14): 6 concurrent cold loads with hot chunks
on cut the server skew of bytes served against off, in the same run, and the extra copies go
away after the load ends.

Two 3-server clusters with R=2, one after the other, one started with ``--hot-chunks off`` and one
with ``on`` (R=2: with R=3 every server holds every chunk and there is nowhere to put an extra
copy). Each gets the same 1 MiB model (4 chunks: the planner's per-load balance then reads 2
chunks from one server and 1 from each of the others, the same choice in every client, so "off"
has max/mean 1.5 whatever the placement), then WAVES (8) waves of 6 concurrent cold loads (one fresh
ClusterClient per load, worker.loader.load, no cache). Skew is max/mean over the servers of the
bytes served (the clients' stats.by_server), over every wave, the first included (it cannot use
extra copies: its reads are what make the chunks hot). max/mean is at least 1, so "cut by half" is
read as its excess over 1: (on - 1) <= (off - 1) / 2. The planner picks among a hot chunk's holders
by a random per-fetch salt, so "on" varies from run to run: a simulation of this workload with the
real planner (2000 runs) gives median 1.09, worst 1.26, and 0.05% of runs over the 1.25 bound
(0.9% with 5 waves, hence 8).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from chunking.synthetic import synthetic_state_dict
from deploy.local import LocalCluster
from paramserver.client.push import push
from paramserver.client.rpc import ClientConfig, ParamServerClient
from paramserver.client.session import ClusterClient, SessionConfig
from paramserver.wire.ring import Ring
from tests.conftest import local_cluster
from worker.loader import load

pytestmark = pytest.mark.integration
MiB = 1 << 20
LOADS, WAVES, PACE_S = 6, 8, 0.3
HOT = {"hot_interval_s": 0.25, "hot_tau_s": 2.0, "hot_rate": 1.0, "hot_cool_rate": 0.25, "hot_cool_s": 1.0,
       "hot_lease_s": 2.0, "hot_extra_copies": 2}


def skew(served: dict[str, int], servers: list[str]) -> float:
    values = [served.get(s, 0) for s in servers]
    return max(values) / (sum(values) / len(values))


def status(cluster: LocalCluster) -> dict[str, dict[str, str]]:
    out = {}
    for address in cluster.addresses:
        c = ParamServerClient(ClientConfig(address, timeout_s=3.0))
        try:
            reply = c.server_status()
            out[reply.server_id] = {**reply.extra, "chunk_count": str(reply.chunk_count)}
        finally:
            c.close()
    return out


def one_wave(cluster: LocalCluster) -> tuple[list[ClusterClient], list[dict[str, torch.Tensor]]]:
    """LOADS concurrent cold loads, each through a fresh client; (the clients, still open; what they loaded)."""
    clients = [ClusterClient(cluster.addresses, config=SessionConfig(hot_refresh_s=0.3)) for _ in range(LOADS)]
    for c in clients:
        c.view()
    errors: list[BaseException] = []
    got: list[dict[str, torch.Tensor]] = []
    barrier = threading.Barrier(LOADS)

    def one(c: ClusterClient) -> None:
        try:
            barrier.wait()
            got.append(load(c, "hot:prod", device="cpu").tensors)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(got) == LOADS
    return clients, got


def waves(cluster: LocalCluster, state: dict[str, torch.Tensor]) -> tuple[dict[str, int], int, int]:
    """(bytes served by server, bytes read from extra copies, most extra copies seen held at once)."""
    served: dict[str, int] = {}
    extra = peak = 0
    for n in range(WAVES):
        if n:
            time.sleep(PACE_S)
        clients, got = one_wave(cluster)
        for c in clients:
            for k, v in c.stats.by_server.items():
                served[k] = served.get(k, 0) + v
            extra += c.stats.extra_bytes
            c.close()
        for name, tensor in state.items():
            assert torch.equal(got[n % LOADS][name].view(torch.uint8), tensor.view(torch.uint8)), name
        peak = max(peak, sum(int(s.get("hot_extra_chunks", "0")) for s in status(cluster).values()))
    return served, extra, peak


def on_every_ring_replica(cluster: LocalCluster, r: int) -> None:
    """Every chunk of the model (and its manifest) still on all of its R ring replicas."""
    with ClusterClient(cluster.addresses) as client:
        info = client.resolve("hot", "prod")
        manifest = client.manifest(info.manifest_id)
        ring = Ring(sorted(client.members()))
        address = {sid: m.grpc_address for sid, m in client.members().items()}
    ids = [info.manifest_id, *(c.id for c in manifest.chunks)]
    for sid in address:
        mine = [cid for cid in ids if sid in ring.replicas(cid, r)]
        c = ParamServerClient(ClientConfig(address[sid], timeout_s=3.0))
        try:
            assert all(c.has_chunks(mine)), f"{sid} lost a chunk it holds as a ring replica"
        finally:
            c.close()


def test_hot_chunks_cut_skew_and_extras_go_away(tmp_path: Path) -> None:
    started = time.monotonic()
    state = synthetic_state_dict(total_bytes=1 * MiB, dtype=torch.bfloat16, seed=5)
    config = tmp_path / "hot.json"
    config.write_text(json.dumps(HOT))
    results: dict[str, tuple[dict[str, int], int, int]] = {}
    servers: list[str] = []
    for mode in ("off", "on"):
        args = ("--no-fsync", "--log-level", "WARNING", "--config", str(config), "--hot-chunks", mode)
        with local_cluster(tmp_path / mode, servers=3, replication=2, extra_args=args) as cluster:
            report = push(cluster.addresses, state, model="hot", tag="prod")
            assert report.version == 1
            before = {sid: s["chunk_count"] for sid, s in status(cluster).items()}
            servers = sorted(before)
            results[mode] = waves(cluster, state)
            if mode == "on":
                # The extra copies disappear once the chunks cool (bounded wait), and nothing else does.
                deadline = time.monotonic() + 30.0
                while True:
                    now = status(cluster)
                    if all(s["hot_extra_chunks"] == "0" for s in now.values()):
                        break
                    assert time.monotonic() < deadline, f"extra copies still held 30 s after the load: {now}"
                    time.sleep(0.25)
                assert {sid: s["chunk_count"] for sid, s in now.items()} == before
                assert all(s["hot_chunks"] == "0" and s["hot_advertised"] == "0" for s in now.values()), now
                on_every_ring_replica(cluster, 2)
    off_served, off_extra, off_peak = results["off"]
    on_served, on_extra, on_peak = results["on"]
    off, on = skew(off_served, servers), skew(on_served, servers)
    print(f"skew max/mean: off {off:.3f} {off_served}, on {on:.3f} {on_served}; extra-copy bytes read {on_extra}")
    assert off_extra == 0 and off_peak == 0  # off: no extra copy anywhere, none read
    assert on_peak > 0 and on_extra > 0  # on: extras were placed and clients read from them
    assert sum(on_served.values()) == sum(off_served.values())  # the same bytes, spread differently
    assert off > 1.3, f"the baseline has the skew this test is about: {off:.3f}"
    assert on - 1 <= (off - 1) / 2, f"hot chunks on: skew {on:.3f} against {off:.3f} off"
    assert time.monotonic() - started < 120
