"""Hugging Face model folders through the real CLIs and a real 3-server cluster: ``paramctl push
DIR``, ``paramctl pull --out-dir``, ``paramctl ls``; files byte for byte, tensors bit-exact,
``from_pretrained`` on the pulled folder equal to the original; re-push dedup."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deploy.local import LocalCluster
from paramserver.client.push import push
from tests.conftest import local_cluster, paramctl_at

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("folders"), servers=3) as c:
        yield c


paramctl = paramctl_at


def bert(root: Path) -> tuple[Any, Path]:
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=100, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    out = root / "bert"
    model.save_pretrained(out)
    (out / "vocab.txt").write_text("\n".join(f"tok{i}" for i in range(100)))
    (out / "README.md").write_text("# a tiny BERT\n")
    return model, out


def gpt2(root: Path, seed: int = 1) -> tuple[Any, Path]:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    out = root / "gpt2"
    model.save_pretrained(out, max_shard_size="20KB")  # several shards and an index
    return model, out


def outputs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        result = model(input_ids=ids)
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def shard_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("make", [bert, gpt2], ids=["bert", "gpt2-sharded"])
def test_folder_push_pull_round_trip_gives_the_same_model(cluster: LocalCluster, tmp_path: Path, make: Any) -> None:
    original, folder = make(tmp_path)
    name = folder.name
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if name == "gpt2":
        assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    pushed = paramctl(cluster, "push", str(folder), "--model", name, "--tag", "prod")
    assert pushed.returncode == 0, pushed.stderr
    listed = paramctl(cluster, "ls", f"{name}:prod")
    assert listed.returncode == 0, listed.stderr
    for s in shards:
        assert s in listed.stdout
    assert "config.json" in listed.stdout
    out = tmp_path / "pulled"
    pulled = paramctl(cluster, "pull", f"{name}:prod", "--out-dir", str(out))
    assert pulled.returncode == 0, pulled.stderr
    assert not list(tmp_path.glob(".pulled.*"))  # the staging folder was renamed, not left behind
    originals = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    got = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert got == originals
    for rel in originals:
        if not rel.endswith(".safetensors"):
            assert (out / rel).read_bytes() == (folder / rel).read_bytes(), rel  # byte for byte
    want, have = shard_tensors(folder), shard_tensors(out)
    assert set(want) == set(have)
    for k in want:
        assert want[k].dtype == have[k].dtype and torch.equal(want[k], have[k]), k
    for s in shards:  # each tensor is in the shard it came from, under the metadata the shard had
        assert set(load_file(str(out / s))) == set(load_file(str(folder / s)))
        with safe_open(str(folder / s), "pt") as a, safe_open(str(out / s), "pt") as b:
            kept, written = a.metadata() or {}, b.metadata()
        assert written == {**written, **kept} and written["model"] == name, (kept, written)
    ids = torch.tensor([[1, 5, 7, 42, 99, 3]])
    reloaded = type(original).from_pretrained(out).eval()
    assert torch.equal(outputs(reloaded, ids), outputs(type(original).from_pretrained(folder).eval(), ids))
    # Again into an existing folder: refused, nothing touched.
    again = paramctl(cluster, "pull", f"{name}:prod", "--out-dir", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.timeout(240)
def test_re_push_sends_nothing_and_a_changed_shard_sends_only_its_changed_chunks(cluster: LocalCluster, tmp_path: Path) -> None:
    _model, folder = gpt2(tmp_path, seed=7)  # weights no other test pushed
    first = push(cluster.seed, str(folder), model="dedup", tag="prod")
    assert first.chunks_sent > 0
    same = push(cluster.seed, str(folder), model="dedup", tag="prod")
    assert same.bytes_sent == 0 and same.chunks_sent == 0  # only the new manifest
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    tensors = load_file(str(shard))
    name = max(tensors, key=lambda k: tensors[k].numel())
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    changed = push(cluster.seed, str(folder), model="dedup", tag="prod")
    nbytes = tensors[name].numel() * tensors[name].element_size()
    chunk = 256 << 10
    assert 0 < changed.bytes_sent <= nbytes + 2 * chunk, (changed.bytes_sent, nbytes)
    assert changed.version == same.version + 1


def test_bad_folders_and_refs_fail_with_one_line_and_leave_nothing(cluster: LocalCluster, tmp_path: Path) -> None:
    _model, folder = bert(tmp_path)
    (folder / "evil.json").symlink_to("/etc/hostname")
    bad = paramctl(cluster, "push", str(folder), "--model", "evil")
    assert bad.returncode == 2 and "symlink" in bad.stderr and "Traceback" not in bad.stderr
    out = tmp_path / "nothing"
    missing = paramctl(cluster, "pull", "no-such-model:prod", "--out-dir", str(out))
    assert missing.returncode == 3 and "Traceback" not in missing.stderr
    assert not out.exists() and not list(tmp_path.glob(".nothing.*"))
