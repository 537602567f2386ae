"""A worker peer cut off by the network does not hold a load past its deadline (issue 42).

A namespace-mode local cluster (deploy.local, each server in its own network namespace, one extra
client namespace c0; deploy/netns.py). A holder ``paramworker serve`` runs inside c0 with its peer
port on c0's own address (``--peer-listen``/``--peer-advertise``, the cluster's read token) and is
checked reachable from the host. Then the traffic between c0 and the host is dropped on the bridge
(both directions, silently: connection attempts time out, they are not refused), while c0 still
reaches the servers, so the holder keeps renewing its announcement and every FindPeers of the reader
names it. A reader ``paramworker serve`` on the host must load the model from the servers, bit-exact
against the pushed file, within a bound derived from the peer deadlines: the transport gives a peer
2 s to connect and ``peer_io_timeout_s`` = 8 s per read, the fetch engine ``peer_call_timeout_s`` =
8 s per call, and an address that failed is left alone for 10 s, so a load may lose about one peer
deadline, never the servers' 30 s ones or more: it must be done in < 30 s (the measured time is
printed).
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import save_file

from deploy.local import LocalCluster, LocalClusterConfig
from deploy.netns import HOST, netns_available
from paramserver.client.bulk_transport import BulkClient
from paramserver.client.errors import BulkUnavailable
from paramserver.client.push import push
from paramserver.client.session import ClusterClient
from paramserver.wire import bulk_frames
from tests.fanout_helpers import MiB, Served, model_env, state_dict, wait_for
from worker.weights_digest import file_digests

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.timeout(240)]

_OK, _WHY = netns_available()
if not _OK:
    pytestmark.append(pytest.mark.skip(reason=f"the cut-off peer test needs network namespaces: {_WHY}"))

READY_S = 120.0
PEER_PORT = 7070
BOUND_S = 30.0  # a few peer deadlines (2 s connect, 8 s io, 8 s call), far below the servers' 30 s per call + retries


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("fanout-netns")
    c = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3, netns=True, netns_clients=1,
                                        extra_args=("--no-fsync", "--scrub-mb-per-s", "0", "--log-level", "WARNING")))
    try:
        c.up(wait=90)
        yield c
    finally:
        c.down()


def holders_of(client: ClusterClient, manifest_id: str) -> list[tuple[str, str, bool]]:
    owner = client.view().replicas(manifest_id)[0]
    peers = client.server(client.members()[owner].grpc_address).find_peers(manifest_id).peers
    return [(p.worker_id, p.address, p.complete) for p in peers]


def test_a_peer_cut_off_does_not_hold_a_load_past_its_deadline(cluster: LocalCluster, tmp_path: Path) -> None:
    topo = cluster.topology
    assert topo is not None
    layers = 4  # 64 MiB
    path = tmp_path / "cut.safetensors"
    save_file(state_dict(layers, seed=7), str(path))
    want, size = file_digests(path), path.stat().st_size
    push(cluster.client_settings(), path, model="cut", tag="prod")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}
    env.update(PARAMS_CONFIG=str(cluster.client_config_path), PYTHONPATH=str(Path(__file__).resolve().parents[2]),
               **model_env(layers))
    admin = cluster.config.admin_token
    assert admin, "namespace mode generates the tokens"
    env["PARAMS_ADMIN_TOKEN"] = admin
    peer = f"{topo.address('c0')}:{PEER_PORT}"
    holder = Served("cut:prod", env, tmp_path / "holder.log", "--worker-id", "cut-holder", "--poll-s", "0",
                    "--peer-listen", peer, "--peer-advertise", peer, prefix=("ip", "netns", "exec", topo.client_ns(0)),
                    admin_token=admin)
    reader: Served | None = None
    try:
        holder.wait_ready(READY_S)
        with ClusterClient.from_config(cluster.client_config_path) as client:
            manifest = client.manifest(client.resolve_ref("cut:prod").manifest_id)
            token = client.options.token
            wait_for(lambda: ("cut-holder", peer, True) in holders_of(client, manifest.id), 30, "the holder's announcement")
            ids = list(manifest.chunks.ids)[:2]
            # Reachable from the host before the cut: the reader would read it.
            bulk = BulkClient(peer, token, connect_timeout_s=3.0)
            try:
                assert [i.status for i in bulk.fetch(ids)] == [bulk_frames.OK] * 2
            finally:
                bulk.close()
            # Cut c0 <-> host both ways; c0 keeps the servers (and so its lease).
            cut: dict[str | int, set[str | int]] = {e: set() for e in topo.endpoints()}
            cut["c0"], cut[HOST] = {HOST}, {"c0"}
            topo._apply(cut)  # partition() puts every server in a group; this cuts one link only
            bulk = BulkClient(peer, token, connect_timeout_s=1.0)
            try:
                with pytest.raises(BulkUnavailable, match="timed out"):  # not refused: nothing answers
                    list(bulk.fetch(ids))
            finally:
                bulk.close()
            assert ("cut-holder", peer, True) in holders_of(client, manifest.id)

            t0 = time.monotonic()
            reader = Served("cut:prod", {**env}, tmp_path / "reader.log", "--worker-id", "cut-reader", "--poll-s", "0",
                            admin_token=admin)
            line = reader.wait_ready(READY_S)
            wall = time.monotonic() - t0
            m = re.search(r" in ([0-9.]+) s", line)
            assert m is not None, line
            load_s = float(m.group(1))
            failovers = re.search(r"(\d+) failovers", line)
            tiers = reader.tiers()
            print(f"cut-off peer: reader's load {load_s:.2f} s (spawn to ready {wall:.2f} s), "
                  f"peer {tiers.get('peer', 0) / MiB:.1f} MiB, servers {tiers.get('network', 0) / MiB:.1f} MiB, "
                  f"{failovers.group(1) if failovers else '?'} failovers")
            assert reader.digests()[1] == want  # bit-exact against the pushed file
            assert load_s < BOUND_S, line
            # it did try the holder (its view named it): chunks planned there went to the servers
            assert failovers is not None and int(failovers.group(1)) > 0, line
            assert tiers.get("peer", 0) == 0 and tiers.get("network", 0) >= size - MiB, tiers
            # the holder stayed announced the whole time: the reader's views named it
            assert ("cut-holder", peer, True) in holders_of(client, manifest.id)
    finally:
        if reader is not None:
            reader.stop()
        holder.stop()
        if cluster.topology is not None:
            cluster.topology.heal()
