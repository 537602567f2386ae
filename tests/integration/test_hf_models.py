"""Hugging Face transformers models through a real 3-server cluster.

Small random BERT and GPT-2 models (``save_pretrained``) are pushed with ``paramctl push``:
their ``model.safetensors`` alone, into a model built under ``worker.loader.empty_weights()``
and filled by ``load_into``; or the whole folder (``paramctl push DIR``), then deleted, for
``worker.hf.load_pretrained`` (which reads ``config.json`` from the version) and
``paramworker serve --hf``. Outputs must be identical (``torch.equal``) to ``from_pretrained``
on the local folder, in eval mode.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from deploy.local import LocalCluster
from tests.conftest import local_cluster, stop_process
from worker.loader import FillError, empty_weights, load_into

tf = pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]

BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)
GPT2 = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
IDS = torch.tensor([[1, 7, 42, 9, 99, 3], [5, 6, 0, 2, 8, 11]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("hf"), servers=3, extra_args=("--no-fsync",)) as c:
        yield c


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bert")
    tf.BertModel(tf.BertConfig(**BERT)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("gpt2")
    tf.GPT2LMHeadModel(tf.GPT2Config(**GPT2)).save_pretrained(path)  # lm_head tied to transformer.wte: saved once
    return path


def paramctl(*args: str, cluster: LocalCluster) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}
    env["PARAMS_CLUSTER"] = cluster.seed
    r = subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], env=env, capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr


def bert_out(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=IDS, attention_mask=MASK).last_hidden_state
    return out


def gpt2_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=IDS, attention_mask=MASK).logits
    return out


def test_bert_load_into_equals_from_pretrained(cluster: LocalCluster, bert_dir: Path) -> None:
    paramctl("push", str(bert_dir / "model.safetensors"), "--model", "bert", "--tag", "prod", cluster=cluster)
    want = tf.BertModel.from_pretrained(bert_dir).eval()
    config = tf.BertConfig.from_pretrained(bert_dir)

    # What the user tried first: everything on meta loses position_ids; refused before any fetch, saying what to do.
    with torch.device("meta"):
        on_meta = tf.BertModel(config)
    with pytest.raises(FillError, match=r"position_ids.*empty_weights"):
        load_into(on_meta, cluster.seed, "bert:prod")

    with empty_weights():
        model = tf.BertModel(config)
    assert all(p.is_meta for p in model.parameters())
    report = load_into(model, cluster.seed, "bert:prod")
    model.eval()
    assert report.version == 1 and report.bytes_total > 0
    assert torch.equal(model.embeddings.position_ids, want.embeddings.position_ids)
    assert torch.equal(bert_out(model), bert_out(want))


def test_bert_checkpoint_with_position_ids_loads_strict(cluster: LocalCluster, bert_dir: Path, tmp_path: Path) -> None:
    """Older BERT checkpoints carry the non-persistent ``embeddings.position_ids``: skipped, not an error."""
    state = load_file(bert_dir / "model.safetensors")
    state["embeddings.position_ids"] = torch.arange(512).expand(1, -1).contiguous()
    old = tmp_path / "model.safetensors"
    save_file(state, old, metadata={"format": "pt"})
    paramctl("push", str(old), "--model", "bert-old", "--tag", "prod", cluster=cluster)
    with empty_weights():
        model = tf.BertModel(tf.BertConfig.from_pretrained(bert_dir))
    load_into(model, cluster.seed, "bert-old:prod", strict=True)
    assert torch.equal(bert_out(model.eval()), bert_out(tf.BertModel.from_pretrained(bert_dir).eval()))


def test_gpt2_tied_load_into_equals_from_pretrained(cluster: LocalCluster, gpt2_dir: Path) -> None:
    paramctl("push", str(gpt2_dir / "model.safetensors"), "--model", "gpt2", "--tag", "prod", cluster=cluster)
    want = tf.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    with empty_weights():
        model = tf.GPT2LMHeadModel(tf.GPT2Config.from_pretrained(gpt2_dir))
    load_into(model, cluster.seed, "gpt2:prod")  # no lm_head.weight in the checkpoint: it is tied to wte
    model.eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(gpt2_logits(model), gpt2_logits(want))


@pytest.fixture(scope="module")
def folders(cluster: LocalCluster, bert_dir: Path, gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both folders pushed whole (``paramctl push DIR``), then deleted: what the cluster has is all there is.
    Returns the outputs ``from_pretrained`` gives on the local folders, taken before."""
    want = {
        "bert": bert_out(tf.BertModel.from_pretrained(bert_dir).eval()),
        "lm": gpt2_logits(tf.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()),
        "gpt2": tf.GPT2Model.from_pretrained(gpt2_dir).eval()(input_ids=IDS).last_hidden_state.detach(),
    }
    root = tmp_path_factory.mktemp("folders")
    for src, model in ((bert_dir, "bert-dir"), (gpt2_dir, "gpt2-dir")):
        copy = root / model
        shutil.copytree(src, copy)
        paramctl("push", str(copy), "--model", model, "--tag", "prod", cluster=cluster)
        shutil.rmtree(copy)
    return want


def test_folder_load_pretrained_bert_and_gpt2(cluster: LocalCluster, folders: dict[str, Any]) -> None:
    from worker.hf import load_pretrained

    bert = load_pretrained(cluster.seed, "bert-dir:prod")  # AutoModel from config.json
    assert type(bert).__name__ == "BertModel" and not bert.training
    assert torch.equal(bert_out(bert), folders["bert"])
    lm = load_pretrained(cluster.seed, "gpt2-dir:prod", tf.GPT2LMHeadModel)
    assert lm.lm_head.weight is lm.transformer.wte.weight and not lm.training
    assert torch.equal(gpt2_logits(lm), folders["lm"])
    auto_lm = load_pretrained(cluster.seed, "gpt2-dir:prod", tf.AutoModelForCausalLM)
    assert torch.equal(gpt2_logits(auto_lm), folders["lm"])
    base = load_pretrained(cluster.seed, "gpt2-dir:prod")  # AutoModel: "transformer." stripped, as from_pretrained does
    assert type(base).__name__ == "GPT2Model"
    with torch.no_grad():
        assert torch.equal(base(input_ids=IDS).last_hidden_state, folders["gpt2"])


def test_load_pretrained_of_a_weights_file_says_what_to_do(cluster: LocalCluster, bert_dir: Path) -> None:
    from paramserver.client.errors import NotFound
    from paramserver.client.push import push
    from worker.hf import load_pretrained

    push(cluster.seed, str(bert_dir / "model.safetensors"), model="bert-file", tag="prod")
    with pytest.raises(NotFound, match=r"config\.json.*weights file.*paramctl push DIR"):
        load_pretrained(cluster.seed, "bert-file:prod")


def test_serve_hf_answers_token_ids(cluster: LocalCluster, folders: dict[str, Any]) -> None:
    """``ModelServer`` with ``hf=`` (what ``paramworker serve --hf`` runs), in process."""
    from paramserver.client.session import ClusterClient
    from worker.hf import HFServing
    from worker.serve import ModelServer

    with ClusterClient(cluster.seed) as client:
        server = ModelServer(client, "bert-dir:prod", None, hf=HFServing())
        try:
            address = server.start("127.0.0.1:0", poll_s=0)
            body = json.dumps({"input": IDS.tolist(), "attention_mask": MASK.tolist()}).encode()
            answer = post(address, body)
            assert answer["output_name"] == "last_hidden_state" and answer["cache"] == "computed"
            assert torch.equal(torch.tensor(answer["output"]), folders["bert"])
            assert post(address, body)["cache"] == "hit_l1"
            with pytest.raises(urllib.error.HTTPError) as bad:
                post(address, json.dumps({"input": [[1.5, 2.0]]}).encode())
            assert bad.value.code == 400
        finally:
            server.stop()


def post(address: str, body: bytes) -> dict[str, Any]:
    req = urllib.request.Request(f"http://{address}/infer", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def test_paramworker_serve_hf(cluster: LocalCluster, folders: dict[str, Any]) -> None:
    """The CLI: ``paramworker serve --hf --hf-class AutoModelForCausalLM`` answers logits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "serve", "--model", "gpt2-dir:prod", "--hf", "--hf-class", "AutoModelForCausalLM",
         "--cluster", cluster.seed, "--listen", "127.0.0.1:0", "--device", "cpu", "--cache-mb", "16"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and not line.startswith("LISTENING"):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"paramworker serve exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        address = line.split()[1]
        answer = post(address, json.dumps({"input": IDS.tolist(), "attention_mask": MASK.tolist()}).encode())
        assert answer["output_name"] == "logits" and answer["model"] == "gpt2-dir"
        assert torch.equal(torch.tensor(answer["output"]), folders["lm"])
    finally:
        stop_process(proc)
