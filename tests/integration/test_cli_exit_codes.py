"""paramctl and paramworker fail the same way: same exit code, one line on stderr, no traceback.

A real 3-server cluster with tokens (deploy.local); the CLIs run as subprocesses with the client
config ``up`` writes. Servers keep no chunk cache and do not scrub, so bytes corrupted on disk
are what a read meets.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from chunking.manifest import Manifest
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.rpc import ParamServerClient
from paramserver.server.segments import corrupt_stored, locate_on_disk

pytestmark = pytest.mark.integration

ADMIN, READ = "codes-admin-token", "codes-read-token"
CLIENT_ENVS = ("PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_TLS_CA", "PARAMS_TLS_CERT", "PARAMS_TLS_KEY",
               "PARAMS_VERIFY", "PARAMS_CONFIG")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(LocalClusterConfig(
        root=tmp_path_factory.mktemp("codes"), servers=3, admin_token=ADMIN, read_token=READ,
        extra_args=("--no-fsync", "--cache-mb", "0", "--scrub-mb-per-s", "0", "--repair-interval", "60"),
    ))  # fmt: skip
    try:
        c.up(wait=90)
        yield c
    finally:
        c.down()


def env(cluster: LocalCluster, **extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in CLIENT_ENVS}
    out["PARAMS_CONFIG"] = str(cluster.client_config_path)
    out.update(extra)
    return out


def paramctl(cluster: LocalCluster, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], env=env(cluster, **extra),
                          capture_output=True, text=True, timeout=120)


def paramworker(cluster: LocalCluster, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker", *args, "--no-progress", "--device", "cpu"], env=env(cluster, **extra),
                          capture_output=True, text=True, timeout=120)


def one_line_error(result: subprocess.CompletedProcess[str], prog: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr
    return lines[0]


def both(cluster: LocalCluster, ctl_args: list[str], worker_args: list[str], **extra: str) -> tuple[int, str, str]:
    """Run both CLIs; assert they agree on the exit code; return it and their lines."""
    c, w = paramctl(cluster, *ctl_args, **extra), paramworker(cluster, *worker_args, **extra)
    ctl_line, worker_line = one_line_error(c, "paramctl"), one_line_error(w, "paramworker")
    assert c.returncode == w.returncode, (c.returncode, ctl_line, w.returncode, worker_line)
    return c.returncode, ctl_line, worker_line


def push_model(cluster: LocalCluster, tmp_path: Path, model: str, seed: int, *extra: str) -> subprocess.CompletedProcess[str]:
    g = torch.Generator().manual_seed(seed)
    f = tmp_path / f"{model}-{seed}.safetensors"
    save_file({"w": torch.randn(400, 400, generator=g), "b": torch.randn(400, generator=g)}, str(f))
    return paramctl(cluster, "push", str(f), "--model", model, "--tag", "prod", *extra)


def test_not_found_exits_3(cluster: LocalCluster, tmp_path: Path) -> None:
    assert push_model(cluster, tmp_path, "present", 1).returncode == 0
    code, ctl, worker = both(cluster, ["pull", "present:nope", "--out", str(tmp_path / "x.safetensors")], ["load", "present:nope"])
    assert code == 3 and ctl.startswith("paramctl: error: NOT_FOUND: ") and worker.startswith("paramworker: error: NOT_FOUND: ")
    code, _, worker = both(cluster, ["pull", "absent:prod", "--out", str(tmp_path / "x.safetensors")], ["load", "absent:prod"])
    assert code == 3 and "absent" in worker


def test_bad_token_exits_5(cluster: LocalCluster) -> None:
    code, ctl, worker = both(cluster, ["ls"], ["load", "present:prod"], PARAMS_READ_TOKEN="wrong-token-123")
    assert code == 5 and "UNAUTHENTICATED" in ctl and "UNAUTHENTICATED" in worker
    code, _, _ = both(cluster, ["--token", "wrong-token-123", "ls"], ["load", "present:prod", "--token", "wrong-token-123"])
    assert code == 5


def test_cluster_unavailable_exits_6(cluster: LocalCluster) -> None:
    code, ctl, worker = both(cluster, ["--cluster", "127.0.0.1:1", "--timeout", "2", "status"],
                             ["load", "present:prod", "--cluster", "127.0.0.1:1"])
    assert code == 6 and "UNAVAILABLE" in ctl and "UNAVAILABLE" in worker


def test_bad_arguments_exit_2(cluster: LocalCluster, tmp_path: Path) -> None:
    code, _, worker = both(cluster, ["pull", "present:prod", "--out", str(tmp_path / "x.bin")], ["load", "not a ref"])
    assert code == 2 and "MODEL:TAG" in worker
    code, ctl, worker = both(cluster, ["ls"], ["load", "present:prod"], PARAMS_TLS_CA=str(tmp_path / "absent-ca.pem"))
    assert code == 2 and "absent-ca.pem" in ctl and "absent-ca.pem" in worker and "PARAMS_TLS_CA" in worker
    bad = tmp_path / "bad.toml"
    bad.write_text('cluster = ["127.0.0.1:1"]\nadmin_token = "inline-secret"\n')
    code, ctl, _ = both(cluster, ["ls"], ["load", "present:prod"], PARAMS_CONFIG=str(bad))
    assert code == 2 and "unknown key" in ctl and "admin_token_file" in ctl


def test_conflict_exits_4(cluster: LocalCluster, tmp_path: Path) -> None:
    assert push_model(cluster, tmp_path, "raced", 1).returncode == 0
    assert push_model(cluster, tmp_path, "raced", 2).returncode == 0
    r = push_model(cluster, tmp_path, "raced", 3, "--parent", "1")
    line = one_line_error(r, "paramctl")
    assert r.returncode == 4 and "ABORTED" in line
    # paramworker never pushes; its table is the same one (tests/unit/test_client_exit_codes.py).
    from paramserver.client.errors import PushConflict
    from worker.cli import worker_exit_code

    assert worker_exit_code(PushConflict("concurrent", model="raced", parent=1, head=2)) == 4


def _corrupt_every_replica(cluster: LocalCluster, model: str) -> str:
    settings = cluster.client_settings()
    with ParamServerClient(settings.client_config(cluster.addresses[0])) as c:
        manifest = Manifest.from_bytes(c.get_manifest(model=model, tag="prod", linearizable=True).data)
    chunk = manifest.chunks[0].id
    hit = 0
    for slot in cluster.slots:
        location = locate_on_disk(slot.data_dir, chunk)
        if location is not None:
            corrupt_stored(location, at=3, xor=0x5A)
            hit += 1
    assert hit >= 2, f"chunk {chunk} found on {hit} servers"
    return chunk


def test_data_loss_exits_8(cluster: LocalCluster, tmp_path: Path) -> None:
    # One model per CLI: a corrupt copy is quarantined once read, and then reads as missing.
    assert push_model(cluster, tmp_path, "lost-a", 11).returncode == 0
    assert push_model(cluster, tmp_path, "lost-b", 12).returncode == 0
    chunk_a = _corrupt_every_replica(cluster, "lost-a")
    chunk_b = _corrupt_every_replica(cluster, "lost-b")
    c = paramctl(cluster, "pull", "lost-a:prod", "--out", str(tmp_path / "a.safetensors"))
    w = paramworker(cluster, "load", "lost-b:prod")
    ctl, worker = one_line_error(c, "paramctl"), one_line_error(w, "paramworker")
    assert c.returncode == w.returncode == 8, (c.returncode, ctl, w.returncode, worker)
    assert "DATA_LOSS" in ctl and chunk_a in ctl
    assert "DATA_LOSS" in worker and chunk_b in worker
    assert not (tmp_path / "a.safetensors").exists()
