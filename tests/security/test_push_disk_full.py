"""A push into a cluster where one server's disk is full (issue 12; the store half: test_store_disk_full.py).

One server's data dir is a 16 MiB tmpfs (root only; skipped with the reason elsewhere) and a model
bigger than that is pushed. The push either commits on the other replicas (W=2 of R=3) and then
loads bit-exact, or fails with an error that names the full server and its free space. Either way
the full server stays up and keeps serving reads (ClusterInfo, ServerStatus and the chunks of a
version pushed before), every version committed before still loads bit-exact, and with the cluster
down every store's index matches its segments, no torn record anywhere.
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from chunking.manifest import Manifest
from deploy.local import LocalCluster
from paramserver.client.errors import TransferError
from paramserver.client.pull import pull_tensors
from paramserver.client.push import PushOptions, PushReport, push
from paramserver.client.rpc import ParamServerClient
from tests.conftest import local_cluster, mounted_tmpfs
from tests.store_checks import assert_bit_exact, check_stopped_store, load_from_server

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.timeout(240)]

ADMIN, READ = "admin-token-pushfull", "read-token-pushfull"
FULL = "ps2"  # the server whose data dir is the small tmpfs
TMPFS_MIB = 16


def weights(seed: int, mib: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = mib * (1 << 20) // 4
    return {
        "w.f32": torch.randn(n // 2 - 7, generator=gen),
        "w.bf16": torch.randn(n // 2 + 3, generator=gen).bfloat16(),
        "w.odd": torch.randn(37, 53, generator=gen),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def leader_of(cluster: LocalCluster) -> str:
    with ParamServerClient(cluster.addresses[0], token=ADMIN) as c:
        return c.cluster_info().leader_grpc_address or cluster.addresses[0]


@pytest.fixture
def cluster_root(tmp_path: Path) -> Iterator[Path]:
    """The cluster folder, with FULL's data dir a small tmpfs (unmounted afterwards)."""
    root = tmp_path / "cluster"
    with mounted_tmpfs(root / FULL, TMPFS_MIB, "one server's full disk"):  # where LocalCluster keeps that server's data dir
        yield root


def test_a_push_bigger_than_one_servers_disk_fails_over_or_names_it_and_loses_nothing(cluster_root: Path) -> None:
    with local_cluster(cluster_root, servers=3, admin_token=ADMIN, read_token=READ, extra_args=("--anti-entropy-interval", "2")) as cluster:
        data_dir = Path(cluster.slot(FULL).data_dir)
        assert os.statvfs(data_dir).f_blocks * os.statvfs(data_dir).f_frsize <= TMPFS_MIB << 20  # it really is the tmpfs
        small = weights(1, 1)
        before = push(cluster.seed, small, model="small", tag="prod", token=ADMIN)
        assert before.unreachable == ()

        big = weights(2, 2 * TMPFS_MIB)  # 32 MiB: cannot fit on FULL whatever else is there
        report: PushReport | None = None
        try:
            # small batches: FULL fills up to its last free bytes (less the store's own reserve)
            report = push(cluster.seed, big, model="big", tag="prod", token=ADMIN, options=PushOptions(batch_bytes=256 << 10))
        except TransferError as exc:
            message = str(exc)
            print(f"push refused: {message}")
            free = re.search(r"(\d+) bytes free", message)
            assert FULL in message and free is not None, f"the error names neither the full server nor its free space: {message}"
            assert str(data_dir) in message, message
            assert "nothing was committed" in message, message
            with ParamServerClient(leader_of(cluster), token=ADMIN) as c:
                try:
                    listed = list(c.list_versions("big").versions)
                except grpc.RpcError as rpc:
                    assert rpc.code() == grpc.StatusCode.NOT_FOUND, rpc
                    listed = []
            assert listed == [], f"a failed push committed {listed}"
        if report is not None:  # failed over: committed on the other replicas
            print(f"push committed v{report.version} without {report.unreachable or FULL}")
            assert report.write_quorum == 2 and report.replication == 3
            assert FULL in report.refused and "full" in report.refused[FULL], report.refused  # the report says why
            tensors, _ = pull_tensors(cluster.seed, f"big@{report.version}", token=READ)
            assert_bit_exact(tensors, big, "big")

        # Metadata still commits with FULL's disk full (its Raft journal is beside the store), and FULL applies it.
        with ParamServerClient(leader_of(cluster), token=ADMIN) as c:
            c.set_tag("small", "canary", before.version)
        deadline = time.monotonic() + 30
        while True:
            with ParamServerClient(cluster.slot(FULL).grpc, token=READ) as c:
                try:
                    if c.resolve_tag("small", "canary").version.number == before.version:
                        break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
            assert time.monotonic() < deadline, f"{FULL} did not apply a tag move within 30 s"
            time.sleep(0.2)

        # The full server is still up and serves reads: metadata, status, and its copy of the earlier version.
        assert FULL in cluster.running(), f"{FULL} exited; its log ends:\n" + Path(cluster.slot(FULL).log_file).read_text()[-3000:]
        address = cluster.slot(FULL).grpc
        with ParamServerClient(address, token=READ) as c:
            assert c.cluster_info().server_id == FULL
            status = c.server_status()
            assert status.chunk_count > 0
            reply = c.get_manifest(model="small", version=before.version)
        manifest = Manifest.from_bytes(reply.data, expected_id=reply.manifest_id)
        assert_bit_exact(load_from_server(address, READ, manifest), small, f"small from {FULL}")
        # What was committed before still loads bit-exact through the cluster.
        tensors, _ = pull_tensors(cluster.seed, f"small@{before.version}", token=READ)
        assert_bit_exact(tensors, small, "small")
        data_dirs = [slot.data_dir for slot in cluster.slots]
    # With every server stopped: each store's index matches its segments, no torn or corrupt record.
    for d in data_dirs:
        check_stopped_store(d)
