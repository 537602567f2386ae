"""The paramserver process itself: CLI, config errors, re-replication, orphan GC, metrics.

Real processes on 127.0.0.1 through deploy.local.LocalCluster; chunks are placed
by hand with the low-level client so each test controls exactly which replica
holds what.
"""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from chunking import pack
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.rpc import ParamServerClient, make_chunk
from paramserver.wire.ring import Ring, RingConfig
from tests.conftest import free_port

pytestmark = pytest.mark.integration

METRICS_PORT = free_port()


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("server-process")
    c = LocalCluster(LocalClusterConfig(
        root=root, servers=3,
        extra_args=("--anti-entropy-interval", "0.5", "--gc-interval", "1", "--orphan-grace", "2", "--no-fsync"),
    ))
    try:
        c.up(wait=90)
        yield c
    finally:
        c.down()


class Placement:
    def __init__(self, cluster: LocalCluster) -> None:
        info = ParamServerClient(cluster.addresses[0]).cluster_info()
        self.ring = Ring(sorted(m.server_id for m in info.members if m.state == "up"), RingConfig(vnodes=info.ring.vnodes))
        self.clients = {m.server_id: ParamServerClient(m.grpc_address) for m in info.members}
        self.r = min(info.ring.replication_factor, len(self.ring))

    def replicas(self, chunk_id: str) -> list[str]:
        return self.ring.replicas(chunk_id, self.r)

    def holders(self, chunk_id: str) -> set[str]:
        return {sid for sid, c in self.clients.items() if c.has_chunks([chunk_id])[0]}


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(200_000, generator=g), "b": torch.randn(17, generator=g).to(torch.bfloat16)}


def test_serve_help_documents_options() -> None:
    out = subprocess.run([sys.executable, "-m", "paramserver", "serve", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--id", "--data-dir", "--listen", "--raft", "--peer", "--config", "--replication", "--write-quorum",
                 "--admin-token-file", "--read-token-file", "--cluster-secret-file", "--insecure", "--tls-cert",
                 "--metrics-port"):
        assert flag in out
    assert "default" in out


def test_bad_config_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    bad = tmp_path / "ps.toml"
    bad.write_text('server_id = "ps1"\ndata_dir = "%s"\nlisten = "nowhere"\n' % tmp_path)
    proc = subprocess.run([sys.executable, "-m", "paramserver", "serve", "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "listen must be HOST:PORT" in proc.stderr
    missing = subprocess.run([sys.executable, "-m", "paramserver", "serve", "--listen", "127.0.0.1:1"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "server_id" in missing.stderr


def test_version_pushed_to_two_replicas_gets_its_third(cluster: LocalCluster) -> None:
    placement = Placement(cluster)
    result = pack(_model(1), model="rerep")
    manifest = result.manifest
    per_server: dict[str, list[object]] = {}
    short_of: dict[str, str] = {}
    for chunk in result.chunks():
        reps = placement.replicas(chunk.ref.id)
        short_of[chunk.ref.id] = reps[-1]
        for sid in reps[:2]:  # W=2 of R=3: exactly the quorum, the third replica is left out
            per_server.setdefault(sid, []).append(make_chunk(chunk.ref.id, chunk.data, chunk.ref.codec, chunk.ref.raw_size))
    blob = manifest.to_bytes()
    for sid in placement.replicas(manifest.id)[:2]:
        per_server.setdefault(sid, []).append(make_chunk(manifest.id, blob))
    for sid, chunks in per_server.items():
        placement.clients[sid].put_chunks(chunks)
    version = placement.clients["ps1"].commit_version("rerep", manifest.id, publisher="test").version
    assert version.number == 1
    for chunk_id, missing_on in short_of.items():
        wait_until(lambda chunk_id=chunk_id, missing_on=missing_on: missing_on in placement.holders(chunk_id), 30,
                   f"chunk {chunk_id[:12]} re-replicated to {missing_on}")
        assert placement.holders(chunk_id) == set(placement.replicas(chunk_id))


def test_commit_refused_below_write_quorum(cluster: LocalCluster) -> None:
    import grpc

    placement = Placement(cluster)
    result = pack(_model(2), model="short")
    first = next(iter(result.chunks()))
    for chunk in result.chunks():
        if chunk.ref.id != first.ref.id:
            for sid in placement.replicas(chunk.ref.id):
                placement.clients[sid].put_chunks([make_chunk(chunk.ref.id, chunk.data, chunk.ref.codec, chunk.ref.raw_size)])
    only = placement.replicas(first.ref.id)[0]
    placement.clients[only].put_chunks([make_chunk(first.ref.id, first.data, first.ref.codec, first.ref.raw_size)])
    blob = result.manifest.to_bytes()
    for sid in placement.replicas(result.manifest.id):
        placement.clients[sid].put_chunks([make_chunk(result.manifest.id, blob)])
    with pytest.raises(grpc.RpcError) as err:
        placement.clients["ps2"].commit_version("short", result.manifest.id, publisher="test")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "write quorum" in err.value.details()
    assert "short" not in list(placement.clients["ps3"].list_models().models)


def test_orphans_are_collected_and_committed_chunks_kept(cluster: LocalCluster) -> None:
    placement = Placement(cluster)
    kept = pack(_model(3), model="kept")
    for chunk in kept.chunks():
        for sid in placement.replicas(chunk.ref.id):
            placement.clients[sid].put_chunks([make_chunk(chunk.ref.id, chunk.data, chunk.ref.codec, chunk.ref.raw_size)])
    blob = kept.manifest.to_bytes()
    for sid in placement.replicas(kept.manifest.id):
        placement.clients[sid].put_chunks([make_chunk(kept.manifest.id, blob)])
    placement.clients["ps1"].commit_version("kept", kept.manifest.id, publisher="test")

    orphan = pack(_model(4), model="orphan")  # uploaded, never committed: an interrupted push
    orphan_ids = []
    for chunk in orphan.chunks():
        orphan_ids.append(chunk.ref.id)
        for client in placement.clients.values():
            client.put_chunks([make_chunk(chunk.ref.id, chunk.data, chunk.ref.codec, chunk.ref.raw_size)])
    wait_until(lambda: all(not placement.holders(cid) for cid in orphan_ids), 60, "orphan chunks collected on every server")
    for chunk in kept.chunks():
        assert placement.holders(chunk.ref.id) == set(placement.replicas(chunk.ref.id))


def test_orphans_claimed_by_a_push_outlive_the_grace_period(cluster: LocalCluster) -> None:
    # A push that finds chunks by dedup claims them (HasChunks claim=True): orphans it reuses must
    # not be collected before it commits, however old they are. Grace is 2 s here, GC every 1 s.
    placement = Placement(cluster)
    orphan = pack(_model(5), model="reused-orphan")
    ids = [chunk.ref.id for chunk in orphan.chunks()]
    for chunk in orphan.chunks():
        for client in placement.clients.values():
            client.put_chunks([make_chunk(chunk.ref.id, chunk.data, chunk.ref.codec, chunk.ref.raw_size)])
    deadline = time.monotonic() + 5.0  # 2.5 grace periods
    while time.monotonic() < deadline:
        for client in placement.clients.values():
            assert client.has_chunks(ids, claim=True) == [True] * len(ids)
        time.sleep(0.5)
    # no longer claimed: collected like any orphan
    wait_until(lambda: all(not placement.holders(cid) for cid in ids), 60, "unclaimed orphans collected")


def test_metrics_endpoint(tmp_path: Path) -> None:
    grpc_port, raft_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "paramserver", "serve", "--id", "solo", "--data-dir", str(tmp_path / "solo"),
                             "--listen", f"127.0.0.1:{grpc_port}", "--raft", f"127.0.0.1:{raft_port}",
                             "--metrics-port", str(METRICS_PORT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        body = ""

        def scraped() -> bool:
            nonlocal body
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=2).read().decode()
            except OSError:
                return False
            return "paramserver_is_leader" in body and 'paramserver_members{server="solo"} 1.0' in body

        wait_until(scraped, 60, "metrics to show a registered one-server cluster")
        assert 'paramserver_chunks{server="solo"}' in body
        assert 'paramserver_is_leader{server="solo"} 1.0' in body
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_up_after_down_restarts_the_same_cluster_with_its_data(tmp_path: Path) -> None:
    # The Raft journal names members by address: `up` on a folder with data must bring the
    # servers back on their old ports, not on fresh ones (which would never elect a leader).
    from deploy.local import LauncherError
    from paramserver.client.pull import pull_tensors
    from paramserver.client.push import push

    want = {"w": torch.randn(300, 300), "b": torch.randn(7)}
    config = LocalClusterConfig(root=tmp_path / "c", servers=3, extra_args=("--no-fsync",))
    first = LocalCluster(config)
    first.up(wait=90)
    try:
        push(first.seed, want, model="kept", tag="prod")
        addresses = sorted(first.addresses)
    finally:
        first.down()
    with pytest.raises(LauncherError, match="--servers 3"):
        LocalCluster(LocalClusterConfig(root=tmp_path / "c", servers=2)).up(wait=5)
    import socket

    host, _, port = addresses[0].rpartition(":")
    with socket.socket() as squatter:  # someone took one of its ports meanwhile
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port may be in TIME_WAIT
        squatter.bind((host, int(port)))
        squatter.listen()
        with pytest.raises(LauncherError, match="that port is in use"):
            LocalCluster(config).up(wait=5)
    again = LocalCluster(config)
    again.up(wait=90)
    try:
        assert sorted(again.addresses) == addresses
        got, _ = pull_tensors(again.seed, "kept:prod")
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        again.down()


@pytest.mark.timeout(240)
def test_a_server_alone_without_its_journal_collects_none_of_its_chunks(tmp_path: Path) -> None:
    """Started alone from an empty Raft journal (docs/operations.md's advice for a damaged one), a server
    saw no committed version, took every chunk it held for an orphan and deleted all of them once
    the grace period had passed. Orphan collection now waits until it is in sync with a leader."""
    import shutil

    from paramserver.client.pull import pull_tensors
    from paramserver.client.push import push

    c = LocalCluster(LocalClusterConfig(root=tmp_path / "c", servers=3,
                                        extra_args=("--gc-interval", "1", "--orphan-grace", "2", "--no-fsync")))
    try:
        c.up(wait=90)
        weights = _model(7)
        push(c.seed, weights, model="kept", tag="prod")
        ps1 = ParamServerClient(c.slot("ps1").grpc)
        held = ps1.server_status().chunk_count
        assert held > 0
        ps1.close()
        for slot in c.slots:
            c.kill(slot.server_id)
        shutil.move(str(Path(c.slot("ps1").data_dir) / "raft"), str(tmp_path / "raft-moved-away"))
        c.restart("ps1")
        ps1 = ParamServerClient(c.slot("ps1").grpc)
        wait_until(lambda: _answers(ps1), 60, "ps1 to answer")
        time.sleep(6)  # three times grace + interval: long enough for a collection that should not happen
        assert ps1.server_status().chunk_count == held
        assert "orphan collection waits" in Path(c.slot("ps1").log_file).read_text()
        for sid in ("ps2", "ps3"):
            c.restart(sid)
        # A leader first (ps2 or ps3: their journals are the longer ones): until one is elected, ps1
        # with its empty journal is the only member that answers, and it rightly knows no 'kept'.
        c.wait_ready(90)
        got = pull_tensors(c.seed, "kept:prod")[0]
        assert all(torch.equal(got[k].view(torch.uint8) if got[k].dim() else got[k], weights[k].view(torch.uint8)
                               if weights[k].dim() else weights[k]) for k in weights)
        time.sleep(4)  # in sync again: its chunks are referenced, none collected
        assert ps1.server_status().chunk_count >= held
        ps1.close()
    finally:
        c.down()


def _answers(client: ParamServerClient) -> bool:
    try:
        client.server_status()
        return True
    except Exception:  # noqa: BLE001 - starting up
        return False


@pytest.mark.timeout(180)
def test_a_data_dir_in_use_or_of_another_cluster_is_refused(tmp_path: Path) -> None:
    """A second process on a running server's data dir rewrote its Raft vote; a server started on
    another cluster's data dir won an election and spliced that cluster's log into this one."""
    c = LocalCluster(LocalClusterConfig(root=tmp_path / "c", servers=1, secret="secret-of-cluster-one-0123456789",
                                        extra_args=("--no-fsync",)))
    data = c.root / "ps1"
    serve = [sys.executable, "-m", "paramserver", "serve", "--id", "ps1", "--data-dir", str(data), "--no-fsync"]
    other = tmp_path / "other.secret"
    other.write_text("the-secret-of-another-cluster-987654\n")
    # A first start with the wrong secret (here: one that never reaches its peer) joins nothing and
    # must leave no cluster id behind that would refuse the right secret afterwards.
    mistyped = subprocess.Popen([*serve, "--listen", f"127.0.0.1:{free_port()}", "--raft", f"127.0.0.1:{free_port()}",
                                 "--peer", f"127.0.0.1:{free_port()}", "--cluster-secret-file", str(other)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (data / "raft").is_dir(), 60, "the mistyped server to open its journal")
        time.sleep(2.0)
    finally:
        mistyped.terminate()
        mistyped.wait(30)
    assert not (data / "raft" / "cluster.id").exists()
    try:
        c.up(wait=90)
        wait_until(lambda: (data / "raft" / "cluster.id").exists(), 60, "the cluster id, recorded once ps1 joined")
        twin = subprocess.run([*serve, "--listen", f"127.0.0.1:{free_port()}", "--raft", f"127.0.0.1:{free_port()}"],
                              capture_output=True, text=True, timeout=60)
        assert twin.returncode == 2, twin.stderr
        assert f"data dir {data} is in use by another paramserver (pid {c.slot('ps1').pid})" in twin.stderr
        assert "Traceback" not in twin.stderr
    finally:
        c.down()
    recorded = (data / "raft" / "cluster.id").read_text()
    foreign = subprocess.run([*serve, "--listen", f"127.0.0.1:{free_port()}", "--raft", f"127.0.0.1:{free_port()}",
                              "--cluster-secret-file", str(other)], capture_output=True, text=True, timeout=60)
    assert foreign.returncode == 2, foreign.stderr
    assert f"data dir {data} belongs to another cluster" in foreign.stderr and "Traceback" not in foreign.stderr
    assert (data / "raft" / "cluster.id").read_text() == recorded
    restarted = LocalCluster(LocalClusterConfig(root=tmp_path / "c", servers=1, secret="secret-of-cluster-one-0123456789",
                                                extra_args=("--no-fsync",)))
    try:
        restarted.up(wait=90)  # its own cluster still starts on it
    finally:
        restarted.down()


@pytest.mark.timeout(240)
def test_a_member_without_its_cluster_id_and_with_another_vnodes_refuses_to_serve(tmp_path: Path) -> None:
    """Raft proves the secret, not --vnodes: ps3, restarted on a data dir from before cluster.id
    with another --vnodes, joined, recorded that id, and placed chunks on a ring of its own."""
    c = LocalCluster(LocalClusterConfig(root=tmp_path / "c", servers=3, secret="secret-of-the-vnodes-cluster-0123456",
                                        extra_args=("--no-fsync",)))
    c.up(wait=90)
    try:
        slot = c.slot("ps3")
        ident = Path(slot.data_dir) / "raft" / "cluster.id"
        wait_until(ident.exists, 60, "ps3's cluster id")
        c.kill("ps3")
        ident.unlink()  # as a data dir from before the file
        wrong = subprocess.run([*c._args_for(slot), "--vnodes", "17"],
                               capture_output=True, text=True, timeout=120)
        assert wrong.returncode == 2, wrong.stderr[-2000:]
        assert "ps3 refuses to serve" in wrong.stderr and "--vnodes 17" in wrong.stderr, wrong.stderr[-2000:]
        assert "Traceback" not in wrong.stderr and not ident.exists()
        c.restart("ps3")  # with the cluster's --vnodes: it joins and records the id
        wait_until(ident.exists, 60, "ps3's cluster id after a start with the right --vnodes")
    finally:
        c.down()
