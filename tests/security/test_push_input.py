"""What a user gets wrong on a push is one line naming the problem and the fix (issue 41):
a model folder with a file name that is not UTF-8 (was a traceback), and the read token used for a
write (was blamed on "HasChunks with claim", or called "wrong")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import save_file

from deploy.local import LocalCluster
from tests.conftest import local_cluster

ADMIN, READ = "admin-token-push-input", "read-token-push-input"


def paramctl(*args: str, cluster: str = "127.0.0.1:1") -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}, "PARAMS_CLUSTER": cluster}
    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def folder(root: Path) -> Path:
    root.mkdir()
    save_file({"w": torch.ones(64)}, str(root / "model.safetensors"))
    return root


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("push-input"), servers=1, replication=1, admin_token=ADMIN, read_token=READ,
                       extra_args=("--no-fsync",)) as c:
        yield c


@pytest.mark.timeout(180)
def test_a_file_name_that_is_not_utf8_is_one_line_naming_it(cluster: LocalCluster, tmp_path: Path) -> None:
    model = folder(tmp_path / "m")
    (model / os.fsdecode(b"notes-\xff.txt")).write_bytes(b"x")
    proc = paramctl("--token", ADMIN, "push", "--model", "m", str(model), cluster=cluster.seed)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    line = one_error_line(proc)
    assert "b'notes-\\xff.txt'" in line and "not UTF-8" in line and "rename" in line, line
    # in a sub-folder too
    sub = folder(tmp_path / "n")
    (sub / os.fsdecode(b"dir-\xfe")).mkdir()
    proc = paramctl("--token", ADMIN, "push", "--model", "m", str(sub), cluster=cluster.seed)
    assert proc.returncode == 2 and "b'dir-\\xfe'" in one_error_line(proc), proc.stderr


@pytest.mark.timeout(180)
def test_the_read_token_for_a_write_says_so(cluster: LocalCluster, tmp_path: Path) -> None:
    model = folder(tmp_path / "m")
    proc = paramctl("--token", READ, "push", "--model", "m", str(model), cluster=cluster.seed)
    assert proc.returncode == 5, (proc.returncode, proc.stderr)  # 5: authentication (paramctl --help)
    line = one_error_line(proc)
    assert "needs the admin token" in line and "the read token was sent" in line, line
    assert "wrong" not in line and line.index("admin token") < line.index("HasChunks"), line
    proc = paramctl("--token", ADMIN, "push", "--model", "m", str(model), cluster=cluster.seed)
    assert proc.returncode == 0, proc.stderr
    proc = paramctl("--token", READ, "tag", "m", "prod", "1", cluster=cluster.seed)
    assert proc.returncode == 5, (proc.returncode, proc.stderr)
    line = one_error_line(proc)
    assert "SetTag" in line and "needs the admin token" in line and "the read token was sent" in line, line
    assert "wrong" not in line, line
    # a token that is neither is still called wrong
    proc = paramctl("--token", "not-a-token-at-all", "tag", "m", "prod", "1", cluster=cluster.seed)
    assert proc.returncode == 5 and "wrong" in proc.stderr, proc.stderr
