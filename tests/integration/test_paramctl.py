"""The ``paramctl`` CLI in subprocesses against a real 3-server cluster."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from deploy.local import LocalCluster, LocalClusterConfig

pytestmark = pytest.mark.integration

ADMIN, READ = "admin-token-ctl", "read-token-ctl"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(LocalClusterConfig(root=tmp_path_factory.mktemp("ctl"), servers=3, admin_token=ADMIN, read_token=READ,
                                        extra_args=("--no-fsync",)))
    try:
        c.up(wait=90)
        yield c
    finally:
        c.down()


def paramctl(*args: str, cluster: LocalCluster | None = None, token: str | None = ADMIN,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ)
    for name in ("PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN"):
        full.pop(name, None)
    if cluster is not None:
        full["PARAMS_CLUSTER"] = cluster.seed
    if token is not None:
        full["PARAMS_ADMIN_TOKEN"] = token
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], env=full, capture_output=True, text=True, timeout=120)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("paramctl: error: "), result.stderr
    return lines[0]


def state(scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "encoder.weight": torch.randn(256, 300, generator=gen) * scale,
        "encoder.bias": torch.zeros(300).bfloat16(),
        "head.weight": torch.randn(64, 1000, generator=gen).half(),
        "step": torch.tensor(7),
    }


def test_help_documents_every_command_and_option() -> None:
    top = paramctl("--help", token=None)
    assert top.returncode == 0
    for word in ("--cluster", "--token", "--timeout", "PARAMS_CLUSTER",
                 "push", "pull", "tag", "rollback", "untag", "ls", "status", "exit codes"):
        assert word in top.stdout, word
    push_help = paramctl("push", "--help", token=None).stdout
    for word in ("--model", "--tag", "--parent", "--codec", "--chunk-size", "default"):
        assert word in push_help, word
    assert "--out" in paramctl("pull", "--help", token=None).stdout


def test_push_ls_tag_rollback_pull_untag_status(cluster: LocalCluster, tmp_path: Path) -> None:
    v1, v2 = tmp_path / "v1.safetensors", tmp_path / "v2.safetensors"
    save_file(state(1.0), str(v1))
    save_file({**state(1.0), "encoder.weight": state(2.0)["encoder.weight"]}, str(v2))

    r = paramctl("push", str(v1), "--model", "clf", "--tag", "prod", cluster=cluster)
    assert r.returncode == 0, r.stderr
    assert "pushed clf tag prod -> v1" in r.stdout and "deduplicated" in r.stdout and "GB/s" in r.stdout
    r = paramctl("push", str(v2), "--model", "clf", "--tag", "prod", "--codec", "auto", cluster=cluster)
    assert r.returncode == 0, r.stderr
    assert "v2 (parent v1" in r.stdout

    r = paramctl("ls", cluster=cluster, token=None, env={"PARAMS_READ_TOKEN": READ})
    assert r.returncode == 0, r.stderr
    assert "clf" in r.stdout and "prod=v2" in r.stdout
    r = paramctl("ls", "clf", cluster=cluster)
    assert r.returncode == 0 and "v1" in r.stdout and "v2" in r.stdout and "prod" in r.stdout

    assert "clf:prod -> v1" in paramctl("tag", "clf", "prod", "1", cluster=cluster).stdout
    out = tmp_path / "pulled.safetensors"
    r = paramctl("pull", "clf:prod", "--out", str(out), cluster=cluster, token=READ)
    assert r.returncode == 0, r.stderr
    assert torch.equal(load_file(str(out))["encoder.weight"], state(1.0)["encoder.weight"])

    assert "rolled back -> v2" in paramctl("rollback", "clf", "prod", cluster=cluster).stdout
    # ls says where the next rollback goes (v1, under the push that moved prod to v2), not where the last move came from
    listed = paramctl("ls", "clf", cluster=cluster).stdout
    assert re.search(r"rollback to", listed) and re.search(r"prod\s*│\s*v2\s*│\s*v1\s*│", listed), listed
    r = paramctl("pull", "clf:prod", "--out", str(out), cluster=cluster, token=READ)
    assert r.returncode == 0, r.stderr
    pulled, want = load_file(str(out)), load_file(str(v2))
    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1).view(torch.uint8) if t.dim() else t

    assert all(torch.equal(as_bytes(pulled[k]), as_bytes(want[k])) for k in want)

    assert paramctl("untag", "clf", "prod", cluster=cluster).returncode == 0
    r = paramctl("pull", "clf:prod", "--out", str(out), cluster=cluster, token=READ)
    assert r.returncode == 3 and "NOT_FOUND" in one_line_error(r)

    r = paramctl("status", cluster=cluster, token=READ)
    assert r.returncode == 0, r.stderr
    for word in ("ps1", "ps2", "ps3", "leader", "term"):
        assert word in r.stdout, word


def test_errors_are_one_line_with_distinct_exit_codes(cluster: LocalCluster, tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file(state(1.0), str(f))
    assert paramctl("push", str(f), "--model", "errs", cluster=cluster).returncode == 0
    assert paramctl("push", str(f), "--model", "errs", cluster=cluster).returncode == 0

    r = paramctl("push", str(f), "--model", "errs", "--parent", "1", cluster=cluster)
    line = one_line_error(r)
    assert r.returncode == 4 and "ABORTED" in line and "version 1" in line and "version 2" in line

    r = paramctl("ls", cluster=cluster, token="wrong-token-123")
    assert r.returncode == 5 and "UNAUTHENTICATED" in one_line_error(r)

    r = paramctl("push", str(f), "--model", "../x", cluster=cluster)
    assert r.returncode == 2 and "model name" in one_line_error(r)

    r = paramctl("push", str(tmp_path / "missing.safetensors"), "--model", "errs", cluster=cluster)
    assert r.returncode == 2 and "does not exist" in one_line_error(r)

    r = paramctl("--cluster", "127.0.0.1:1", "--timeout", "2", "status")
    assert r.returncode == 6 and "UNAVAILABLE" in one_line_error(r)

    r = paramctl("push", str(f), "--model", "errs", "--chunk-size", "1000", cluster=cluster)
    assert r.returncode == 2 and "chunk_size" in one_line_error(r)


def test_python_loads_take_the_token_from_the_environment_as_the_clis_do(
        cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_state_dict("HOST:PORT", ...)`` read neither PARAMS_READ_TOKEN nor PARAMS_CONFIG: against
    a cluster with tokens (deploy.local's default) it failed however the user had set them up."""
    from paramserver.client.errors import AuthFailed
    from worker.loader import load_state_dict

    weights = tmp_path / "py.safetensors"
    save_file(state(3.0), str(weights))
    assert paramctl("push", str(weights), "--model", "py", "--tag", "prod", cluster=cluster).returncode == 0
    for name in ("PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(AuthFailed):
        load_state_dict(cluster.seed, "py:prod", device="cpu")
    monkeypatch.setenv("PARAMS_READ_TOKEN", READ)
    got = load_state_dict(cluster.seed, "py:prod", device="cpu")
    assert torch.equal(got["encoder.weight"], state(3.0)["encoder.weight"])
    monkeypatch.delenv("PARAMS_READ_TOKEN")
    (tmp_path / "read.token").write_text(READ + "\n")
    (tmp_path / "client.toml").write_text(f'cluster = ["{cluster.seed}"]\nread_token_file = "read.token"\n')
    monkeypatch.setenv("PARAMS_CONFIG", str(tmp_path / "client.toml"))
    got = load_state_dict(cluster.seed, "py:prod", device="cpu")
    assert torch.equal(got["head.weight"], state(3.0)["head.weight"])
    with pytest.raises(AuthFailed):  # a token given in the call wins over the environment
        load_state_dict(cluster.seed, "py:prod", device="cpu", token="wrong-token")
