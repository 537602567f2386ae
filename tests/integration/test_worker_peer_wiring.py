"""The worker's loads share through the process's peer link (issue 42), on a real 3-server cluster:
a load fetches through the swarm, puts its chunks on the shelf and announces at its start and
end; tag moves and pre-warm go through the same path; ``paramworker serve``'s
``GET /weights/digest`` gives per-tensor BLAKE3 of what it holds, equal to the pushed file's.
The peer parts are stand-ins (tests/peer_standins.py): this tests the wiring, not the peers."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from paramserver.client.session import ClusterClient
from tests import peer_standins
from tests.integration.test_worker_cluster import small_net
from tests.integration.test_worker_harness import Cluster
from worker.config import CacheConfig
from worker.loader import load
from worker.peer_link import close_link
from worker.tiered_cache import TieredCache
from worker.weights_digest import file_digests

pytestmark = pytest.mark.integration


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_a_load_fetches_through_the_swarm_shares_its_chunks_and_announces(cluster: Cluster,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    peer_standins.install(monkeypatch)
    monkeypatch.delenv("PARAMS_PEERS", raising=False)
    g = torch.Generator().manual_seed(42)
    state = {f"w{i}": torch.randn(300, 200, generator=g) for i in range(4)} | {"b": torch.randn(7, generator=g).half()}
    cluster.push(state, "peerwire", tag="prod")
    with ClusterClient(cluster.seed) as client:
        try:
            loaded = load(client, "peerwire:prod", "cpu")
            assert loaded.handle is not None and loaded.handle.heat_sent(10)  # the end announce goes out with it
            assert all(same(loaded.tensors[k], v) for k, v in state.items())
            (swarm,), (shelf,), (port,) = peer_standins.Swarm.made, peer_standins.PeerShelf.made, peer_standins.PeerPort.made
            manifest = loaded.manifest
            assert swarm.fetched == [manifest.id] and swarm.address == port.address
            assert port.token == client.options.token
            (entry,) = shelf.entries
            assert entry.manifest.id == manifest.id and entry.ended == [True]
            assert sorted(set(entry.landed_rows)) == sorted(manifest.chunks.first_rows.tolist())
            assert 0 < time.time() - entry.started_at < 120
            # At its start the load is announced as loading, at its end as complete.
            assert len(swarm.announced) >= 2
            assert [(v.manifest_id, v.complete) for v in swarm.announced[0]] == [(manifest.id, False)]
            assert [(v.manifest_id, v.complete) for v in swarm.announced[-1]] == [(manifest.id, True)]
            r = loaded.report
            assert (r.bytes_peer, r.bytes_network) == (0, manifest.raw_bytes)  # the stand-in swarm reads the servers
            # One link per client: a second load shares it; peers=False goes around it.
            load(client, "peerwire:prod", "cpu")
            load(client, "peerwire:prod", "cpu", peers=False)
            assert len(peer_standins.Swarm.made) == 1 and len(shelf.entries) == 2 and swarm.fetched == [manifest.id] * 2
        finally:
            close_link(client)
    assert swarm.closed and port.stopped


def _get(address: str, path: str, token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    req = urllib.request.Request(f"http://{address}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return r.status, json.loads(body) if r.headers.get("Content-Type", "").startswith("application/json") else body.decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_serve_digest_matches_the_pushed_file_and_swaps_and_prewarms_share(cluster: Cluster, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.serve import ModelServer

    peer_standins.install(monkeypatch)
    monkeypatch.delenv("PARAMS_PEERS", raising=False)
    torch.manual_seed(7)
    a, b = small_net().state_dict(), small_net().state_dict()
    pushed = tmp_path / "pushed.safetensors"
    save_file({k: v.contiguous() for k, v in a.items()}, str(pushed))
    v1 = cluster.push(a, "digest-net", tag="prod").version.number
    cache = TieredCache.from_config(CacheConfig(memory_bytes=64 << 20))
    with ClusterClient(cluster.seed) as client:
        server = ModelServer(client, "digest-net:prod", small_net, cache=cache, heat_report_s=600.0, cold_start=False,
                             admin_token="admin-secret")
        try:
            address = server.start("127.0.0.1:0", poll_s=0.2)
            assert server.wait_loaded(60) and server.load_error is None
            path = "/weights/digest?model=digest-net"
            code, body = _get(address, path)
            assert code == 401 and "admin token" in body["error"]
            assert _get(address, path, "wrong")[0] == 401
            code, body = _get(address, path, "admin-secret")
            assert code == 200, body
            assert (body["model"], body["version"], body["algorithm"]) == ("digest-net", v1, "blake3")
            assert body["tensors"] == file_digests(pushed)  # bit for bit what was pushed
            assert _get(address, f"{path}&version={v1}", "admin-secret")[1]["tensors"] == body["tensors"]
            assert _get(address, "/weights/digest?model=other", "admin-secret")[0] == 404
            assert _get(address, f"{path}&version={v1 + 5}", "admin-secret")[0] == 404
            assert _get(address, "/weights/digest", "admin-secret")[0] == 400
            assert _get(address, f"{path}&version=x", "admin-secret")[0] == 400
            code, health = _get(address, "/healthz")
            (port,) = peer_standins.PeerPort.made
            assert health["peers"] == {"address": port.address} and health["last_load"]["peer"] == 0
            port.counters.served_bytes = 4321
            code, metrics = _get(address, "/metrics")
            assert 'pdparams_load_bytes_total{tier="peer"}' in metrics and "pdparams_peer_served_bytes_total 4321.0" in metrics
            assert "pdparams_peer_connections" in metrics
            # A tag move and a pre-warm load through the same link: a shelf entry each, announced.
            (shelf,), (swarm,) = peer_standins.PeerShelf.made, peer_standins.Swarm.made
            assert len(shelf.entries) == 1
            v2 = cluster.push(b, "digest-net", parent=v1, tag="prod").version.number
            deadline = time.monotonic() + 30
            while server.swapper.swaps < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.swapper.swaps == 1 and len(shelf.entries) == 2
            assert shelf.entries[1].ended == [True] and swarm.fetched[-1] == shelf.entries[1].manifest.id
            code, body = _get(address, path, "admin-secret")
            assert body["version"] == v2 and body["tensors"] != file_digests(pushed)
            entry = server.prewarm("digest-net", v1)
            deadline = time.monotonic() + 30
            while entry.state == "loading" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert entry.state == "done" and len(shelf.entries) == 3 and shelf.entries[2].manifest.version == v1
            assert len(swarm.announced) >= 6  # start and end of each of the three loads
        finally:
            server.stop()
            close_link(client)
