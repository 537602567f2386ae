"""Scale out and take a server out, as an operator does it: real servers, the real `paramctl member`.

A 3-server cluster with a model; `deploy.local add` starts ps4, `paramctl member add` joins it and
re-replication gives it its share (and the old servers hand off what moved); `member drain ps1` moves placement off ps1 and waits until
every member reports its chunks placed on the new ring; ps1 is stopped and `member remove`d.
Every step is checked bit for bit, and the refusals (not drained, still running, an address
that does not answer) exit with their codes and one line.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.cluster_view import ClusterView
from paramserver.client.members import current_members
from paramserver.wire.status_keys import PLACEMENT_RING_KEY

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def paramctl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}
    env["PARAMS_CONFIG"] = str(cluster.client_config_path)
    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], env=env, capture_output=True,
                          text=True, timeout=180, cwd=REPO)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def refused(result: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paramctl: error: ") and "Traceback" not in result.stderr, result.stderr
    for w in words:
        assert w in lines[0], lines[0]


def wait_placed(cluster: LocalCluster, ring: str, timeout: float = 60.0) -> None:
    """Every running member reports a clean re-replication pass on ``ring``."""
    view = ClusterView.connect(cluster.client_settings().cluster_options(write=False))
    try:
        deadline = time.monotonic() + timeout
        while True:
            seen = {m.server_id: view.client(m.grpc_address).server_status().extra.get(PLACEMENT_RING_KEY)
                    for m in current_members(view)}
            if all(v == ring for v in seen.values()):
                return
            assert time.monotonic() < deadline, f"not placed on {ring} after {timeout} s: {seen}"
            time.sleep(0.25)
    finally:
        view.close()


def chunk_counts(cluster: LocalCluster) -> dict[str, int]:
    view = ClusterView.connect(cluster.client_settings().cluster_options(write=False))
    try:
        return {m.server_id: int(view.client(m.grpc_address).server_status().chunk_count) for m in current_members(view)}
    finally:
        view.close()


def wait_counts(cluster: LocalCluster, ok: Callable[[dict[str, int]], bool], what: str, timeout: float = 60.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        counts = chunk_counts(cluster)
        if ok(counts):
            return counts
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s: {counts}"
        time.sleep(0.25)


def pulled_equal(cluster: LocalCluster, original: Path, out: Path) -> None:
    ok(paramctl(cluster, "pull", "m:prod", "--out", str(out), "--no-progress"))
    a, b = load_file(str(original)), load_file(str(out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_add_a_server_then_drain_stop_and_remove_another(tmp_path: Path) -> None:
    model = tmp_path / "m.safetensors"
    g = torch.Generator().manual_seed(7)
    save_file({f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(24)}, str(model))  # 24 MiB, 96 chunks
    cluster = LocalCluster(LocalClusterConfig(root=tmp_path / "c", generate_secrets=True,
                                              extra_args=("--no-fsync", "--anti-entropy-interval", "0.5")))
    cluster.up()
    try:
        ok(paramctl(cluster, "push", str(model), "--model", "m", "--tag", "prod", "--no-progress"))
        n = chunk_counts(cluster)["ps1"]  # every chunk and manifest blob: R=3 on 3 servers
        assert n > 96

        # Scale out: ps4 joins, gets its share (R=3 of 4: about three quarters of the chunks), serves it.
        slot = cluster.add_server()
        assert slot.server_id == "ps4" and cluster.join_command("ps4").startswith("paramctl member add ps4 --grpc ")
        refused(paramctl(cluster, "member", "add", "ps9", "--grpc", "127.0.0.1:1", "--raft", "127.0.0.1:2"), 7,
                "ps9", "does not answer")
        out = ok(paramctl(cluster, *cluster.join_command("ps4").split()[1:]))
        assert "ps4 (up)" in out
        wait_placed(cluster, "ps1,ps2,ps3,ps4")
        # Hand-off: each chunk ends on exactly its 3 ring replicas, so the old servers' stores shrink.
        counts = wait_counts(cluster, lambda c: sum(c.values()) == 3 * n, "three copies of each chunk in all")
        assert all(0 < c < n for c in counts.values()), counts
        pulled_equal(cluster, model, tmp_path / "a.safetensors")

        # Draining refuses what would lose data; a drained server keeps its state across a restart.
        refused(paramctl(cluster, "member", "remove", "ps2"), 7, "ps2 is up, not draining", "member drain ps2")
        refused(paramctl(cluster, "member", "drain", "ps0"), 3, "no member 'ps0'")
        out = ok(paramctl(cluster, "member", "drain", "ps1", "--wait", "120"))
        assert "ps1 marked leaving" in out and "ps1 is drained" in out and "stop ps1" in out
        counts = wait_counts(cluster, lambda c: c["ps1"] == 0, "ps1 handed every chunk off")
        assert sum(counts.values()) == 3 * n, counts
        cluster.kill("ps1")
        cluster.restart("ps1")
        cluster.wait_ready(60)
        time.sleep(1.0)  # its registration runs once it sees a leader
        members = {line.split()[1]: line for line in ok(paramctl(cluster, "status")).splitlines() if "127.0.0.1" in line}
        assert "leaving" in members["ps1"], members
        refused(paramctl(cluster, "member", "remove", "ps1"), 7, "still running", "stop it")

        # Stopped, it is removed; the three left serve every version bit for bit and take new pushes.
        cluster.kill("ps1")
        out = ok(paramctl(cluster, "member", "remove", "ps1"))
        assert "ps1 removed" in out and "ps1 (" not in out.split("members:")[1]
        cluster.forget("ps1")
        assert [s.server_id for s in cluster.slots] == ["ps2", "ps3", "ps4"]
        pulled_equal(cluster, model, tmp_path / "b.safetensors")
        ok(paramctl(cluster, "push", str(model), "--model", "m2", "--tag", "prod", "--no-progress"))
        wait_placed(cluster, "ps2,ps3,ps4")
    finally:
        cluster.down()
