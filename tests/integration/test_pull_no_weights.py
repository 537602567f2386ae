"""``paramctl pull --out-dir DIR --no-weights`` through the real CLI and a real 3-server cluster: the
version's other files byte for byte, no weights and no weights index (what ``vllm serve DIR
--load-format pdparams`` reads); the mistakes are one line and an exit code, and leave nothing."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deploy.local import LocalCluster
from tests.conftest import local_cluster, paramctl_at

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("no-weights"), servers=3) as c:
        yield c


paramctl = paramctl_at


@pytest.mark.timeout(240)
def test_no_weights_pulls_every_other_file_and_no_weight(cluster: LocalCluster, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    (folder / "tokenizer").mkdir(parents=True)
    save_file({"a": torch.randn(300, 300), "b": torch.arange(10)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.randn(64, 64)}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer" / "vocab.txt").write_bytes(os.urandom(700_000))  # several chunks
    (folder / "tokenizer" / "tokenizer.model").write_bytes(b"sentencepiece")  # a tokenizer, not weights
    # Weights in other formats that ride along in real model repositories: left out too.
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.00.pth").write_bytes(os.urandom(300_000))
    (folder / "pytorch_model.bin").write_bytes(os.urandom(1000))
    assert paramctl(cluster, "push", str(folder), "--model", "nw", "--tag", "prod").returncode == 0

    out = tmp_path / "cfg"
    done = paramctl(cluster, "pull", "nw:prod", "--out-dir", str(out), "--no-weights")
    assert done.returncode == 0, done.stderr
    assert "without its weights" in done.stdout and '"ref": "nw:prod"' in done.stdout
    assert "left out too:" in done.stdout and "original/consolidated.00.pth" in done.stdout
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == ["config.json", "tokenizer/tokenizer.model", "tokenizer/vocab.txt"]
    for rel in got:
        assert (out / rel).read_bytes() == (folder / rel).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cfg.")]  # no staging folder left behind


@pytest.mark.timeout(240)
def test_no_weights_mistakes_are_one_line(cluster: LocalCluster, tmp_path: Path) -> None:
    weights = tmp_path / "w.safetensors"
    save_file({"x": torch.ones(4)}, str(weights))
    assert paramctl(cluster, "push", str(weights), "--model", "single", "--tag", "prod").returncode == 0

    done = paramctl(cluster, "pull", "single:prod", "--out", str(tmp_path / "x.safetensors"), "--no-weights")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "--no-weights writes a model folder without its weights: give it with --out-dir DIR" in done.stderr

    out = tmp_path / "cfg"
    done = paramctl(cluster, "pull", "single:prod", "--out-dir", str(out), "--no-weights")
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "has no file besides its weights" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".cfg.")]

    done = paramctl(cluster, "pull", "nosuch:prod", "--out-dir", str(out), "--no-weights")
    assert done.returncode == 3 and "nosuch" in done.stderr and not out.exists()
