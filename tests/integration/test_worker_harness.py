"""A real 3-server cluster for the worker's integration tests, plus a push helper.

``make_cluster`` returns, by default, ``deploy.local.LocalCluster`` processes (``python -m
paramserver serve``). The fallback ``harness`` backend runs each server as its own process too: a
pysyncobj metadata node (real Raft) plus the paramserver gRPC service (real chunk store), started
by ``python -m tests.integration.test_worker_harness serve``. Both expose the same interface
(addresses, seed, kill, restart, down, chunk_location, push, set_tag, rollback_tag).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from deploy.local import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]




# ---------------------------------------------------------------- server process


def serve_main(argv: list[str]) -> int:
    from consensus.config import RaftConfig
    from consensus.node import MetadataNode
    from consensus.records import MemberRecord
    from paramserver.server.config import ServerConfig
    from paramserver.server.service import start_server

    p = argparse.ArgumentParser()
    p.add_argument("--id", required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--raft", required=True)
    p.add_argument("--peer", action="append", default=[])
    args = p.parse_args(argv)
    node = MetadataNode(RaftConfig(server_id=args.id, raft_address=args.raft, peers=tuple(args.peer),
                                   data_dir=args.data_dir / "raft"))
    node.start()
    config = ServerConfig(server_id=args.id, data_dir=args.data_dir / "store", listen=args.listen, raft=args.raft,
                          peers=tuple(args.peer), cache_bytes=0, fsync=False, workers=8).validate()
    running = start_server(config, metadata=node)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            if node.wait_ready(1.0):
                node.add_member(MemberRecord(args.id, args.listen, args.raft))
                break
        except Exception:  # noqa: BLE001 - no leader yet; retry
            time.sleep(0.2)
    print(f"READY {args.id}", flush=True)
    stop.wait()
    running.stop(grace=0.5)
    node.close()
    return 0


# ---------------------------------------------------------------- test-side handle


@dataclass
class Slot:
    server_id: str
    grpc: str
    raft: str
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None


class Cluster:
    def __init__(self, root: Path, servers: int = 3) -> None:
        self.root = root
        self.slots = [Slot(f"ps{i + 1}", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", root / f"ps{i + 1}")
                      for i in range(servers)]

    @property
    def addresses(self) -> list[str]:
        return [s.grpc for s in self.slots]

    @property
    def seed(self) -> str:
        return ",".join(self.addresses)

    def slot(self, server_id: str) -> Slot:
        return next(s for s in self.slots if s.server_id == server_id)

    def _spawn(self, slot: Slot) -> None:
        slot.data_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "tests.integration.test_worker_harness", "serve", "--id", slot.server_id,
                "--data-dir", str(slot.data_dir), "--listen", slot.grpc, "--raft", slot.raft]
        for other in self.slots:
            if other is not slot:
                args += ["--peer", other.raft]
        with open(self.root / f"{slot.server_id}.log", "ab") as log:
            slot.proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def up(self, timeout: float = 60.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for slot in self.slots:
            self._spawn(slot)
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        from paramserver.client.rpc import ParamServerClient

        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            ok = 0
            for slot in self.slots:
                if slot.proc is None:
                    continue
                if slot.proc.poll() is not None:
                    raise RuntimeError(f"{slot.server_id} exited: {(self.root / f'{slot.server_id}.log').read_text()[-3000:]}")
                try:
                    with ParamServerClient(slot.grpc) as c:
                        info = c.cluster_info()
                    if info.leader_id and len([m for m in info.members if m.state == "up"]) == len(self.slots):
                        ok += 1
                except Exception as exc:  # noqa: BLE001 - not up yet: retried until the deadline
                    last = exc
            if ok == len([s for s in self.slots if s.proc is not None]):
                return
            time.sleep(0.2)
        raise TimeoutError(f"cluster not ready after {timeout}s ({last})")

    def kill(self, server_id: str) -> None:
        slot = self.slot(server_id)
        if slot.proc is not None:
            slot.proc.send_signal(signal.SIGKILL)
            slot.proc.wait(timeout=10)
            slot.proc = None

    def restart(self, server_id: str, timeout: float = 60.0) -> None:
        slot = self.slot(server_id)
        if slot.proc is None:
            self._spawn(slot)
        self.wait_ready(timeout)

    def down(self) -> None:
        for slot in self.slots:
            if slot.proc is not None:
                slot.proc.terminate()
        for slot in self.slots:
            if slot.proc is not None:
                try:
                    slot.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    slot.proc.kill()
                    slot.proc.wait(timeout=10)
                slot.proc = None

    def chunk_location(self, server_id: str, chunk_id: str) -> Any:
        """Where the server's chunk record lies in its segment files (a ChunkLocation), or None."""
        from paramserver.server.segments import locate_on_disk

        return locate_on_disk(self.slot(server_id).data_dir / "store", chunk_id)

    # ---------------------------------------------------------------- publishing

    def push(self, state: dict[str, torch.Tensor], model: str, tag: str = "", parent: int | None = None,
             publisher: str = "tests") -> Any:
        """Pack ``state``, write each chunk to its R ring replicas and the manifest to every server,
        then commit through Raft. Returns the VersionReply."""
        from chunking.pack import pack
        from paramserver.client.rpc import ParamServerClient, make_chunk
        from paramserver.client.session import ClusterClient

        result = pack(state, model=model)
        manifest_bytes = result.manifest.to_bytes()
        manifest_id = result.manifest.id
        with ClusterClient(self.seed) as view:
            members = view.members()
            per_server: dict[str, list[Any]] = {sid: [] for sid in members}
            for chunk in result.chunks(unique=True):
                data = chunk.data
                c = make_chunk(chunk.ref.id, data, chunk.ref.codec, chunk.ref.raw_size)
                for sid in view.replicas(chunk.ref.id):
                    per_server[sid].append(c)
            for sid, chunks in per_server.items():
                with ParamServerClient(members[sid].grpc_address) as ps:
                    ps.put_chunks(chunks + [make_chunk(manifest_id, manifest_bytes)])
        with ParamServerClient(self.addresses[0]) as ps:
            for _ in range(50):
                try:
                    return ps.commit_version(model, manifest_id, parent=parent, publisher=publisher, tag=tag,
                                             nbytes=result.manifest.raw_bytes, chunk_count=len(result.manifest.chunks))
                except Exception as exc:
                    if "UNAVAILABLE" not in repr(exc):
                        raise
                    time.sleep(0.2)
        raise TimeoutError("commit did not succeed")

    def set_tag(self, model: str, tag: str, version: int) -> Any:
        from paramserver.client.rpc import ParamServerClient

        with ParamServerClient(self.addresses[0]) as ps:
            return ps.set_tag(model, tag, version, who="tests")

    def rollback_tag(self, model: str, tag: str) -> Any:
        from paramserver.client.rpc import ParamServerClient

        with ParamServerClient(self.addresses[0]) as ps:
            return ps.rollback_tag(model, tag, who="tests")


class LocalClusterBackend(Cluster):
    """The same interface over ``deploy.local.LocalCluster`` (``python -m paramserver serve``).

    Server-side caching and scrubbing are off so a test's on-disk corruption is what a read meets.
    """

    def __init__(self, root: Path, servers: int = 3) -> None:
        from deploy.local import LocalCluster, LocalClusterConfig

        self.root = root
        self.local = LocalCluster(LocalClusterConfig(
            root=root, servers=servers,
            extra_args=("--cache-mb", "0", "--no-fsync", "--scrub-mb-per-s", "0", "--log-level", "WARNING"),
        ))
        self.slots = []

    @property
    def addresses(self) -> list[str]:
        return self.local.addresses

    def slot(self, server_id: str) -> Slot:
        s = self.local.slot(server_id)
        return Slot(s.server_id, s.grpc, s.raft, Path(s.data_dir))

    def up(self, timeout: float = 60.0) -> None:
        self.local.up(wait=timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        self.local.wait_ready(timeout)

    def kill(self, server_id: str) -> None:
        self.local.kill(server_id)

    def restart(self, server_id: str, timeout: float = 60.0) -> None:
        self.local.restart(server_id)
        self.local.wait_ready(timeout)

    def down(self) -> None:
        self.local.down()

    def chunk_location(self, server_id: str, chunk_id: str) -> Any:
        """Where the server's chunk record lies in its segment files (a ChunkLocation), or None."""
        from paramserver.server.segments import locate_on_disk

        return locate_on_disk(self.slot(server_id).data_dir, chunk_id)


def make_cluster(root: Path, servers: int = 3) -> Cluster:
    """The default ``local`` runs the tests on deploy.local (``python -m paramserver serve``, what
    users launch); ``PARAMWORKER_TEST_CLUSTER=harness`` runs this module's own servers (same gRPC
    service and Raft node, fewer moving parts) to tell a worker bug from a server bug."""
    backend = os.environ.get("PARAMWORKER_TEST_CLUSTER", "local")
    if backend == "local":
        return LocalClusterBackend(root, servers)
    if backend != "harness":
        raise ValueError(f"PARAMWORKER_TEST_CLUSTER must be 'harness' or 'local', got {backend!r}")
    return Cluster(root, servers)


@contextmanager
def running_cluster(root: Path, servers: int = 3) -> Iterator[Cluster]:
    """``make_cluster`` up for the block (the worker tests' module fixtures), down after it."""
    c = make_cluster(root, servers)
    try:
        c.up()
        yield c
    finally:
        c.down()


# ---------------------------------------------------------------- self-test


def test_harness_places_chunks_on_ring_replicas_and_survives_restart(tmp_path: Path) -> None:
    """The other worker tests trust this harness: pushes land on exactly the ring's replicas
    (R=3 of 3 here, so on every server), and a killed server restarts with its chunks."""
    from paramserver.client.rpc import ParamServerClient
    from paramserver.client.session import ClusterClient

    cluster = make_cluster(tmp_path)
    try:
        cluster.up()
        state = {"w": torch.arange(300_000, dtype=torch.float32)}
        reply = cluster.push(state, "h", tag="prod")
        assert reply.version.number == 1
        with ClusterClient(cluster.seed) as view:
            info = view.resolve("h", "prod")
            ids = [r.id for r in view.manifest(info.manifest_id).chunks]
            placement = {cid: set(view.replicas(cid)) for cid in ids}
            members = view.members()
        for sid, member in members.items():
            with ParamServerClient(member.grpc_address) as ps:
                present = ps.has_chunks(ids)
            assert present == [sid in placement[cid] for cid in ids]
        cluster.kill("ps1")
        cluster.restart("ps1")
        with ParamServerClient(cluster.slot("ps1").grpc) as ps:
            assert all(ps.has_chunks(ids))
    finally:
        cluster.down()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(serve_main(sys.argv[2:]))
    print("usage: python -m tests.integration.test_worker_harness serve --id ID --data-dir DIR --listen A --raft B --peer P...")
    sys.exit(2)
