#!/usr/bin/env python
"""Manifests and per-chunk costs at LLM scale (issue #18).

    .venv/bin/python bench/bench_scale.py [--parts a,b,c] [--sizes 1g,140g,800g] [--rounds 3]
        [--skip-json-above GB] [--b-mib 2048] [--b-chunks-kib 4,256] [--c-mib 8192] [--dir DIR]

Part a: size, encode time, decode time and decoded RSS of synthetic manifests for 1 GB, 140 GB
and 800 GB bf16 checkpoints at 256 KiB chunks, format 1 (JSON) next to format 2 (binary
columns), format 3 (a JSON root and parts, each its own blob; the size is root plus parts) and
format 4 (a binary root, a shared layout blob and parts cut per large tensor), in one run. Then
fine-tunes of each, in formats 3 and 4: every tenth tensor (name order) gets new chunks, at each
of the ten offsets (so each tensor is changed by exactly one of the ten picks). For each pick,
the bytes of the blobs its manifest adds (those the first version does not have) are given as
a share of all its blobs' bytes, next to the share of chunks the pick changes: a chunk's id is
32 bytes of hash, so no content-addressed manifest can add a smaller share than that.

The 140 GB model has the shape of a 70B-class decoder (80 layers of q/k/v/o, gate/up/down and two
norms, an embedding and an output head: 723 tensors); the others scale its layer count.
Chunk ids and CRCs are random; every chunk is raw and introduced in version 1 (what a first push
writes). Each decode runs in a fresh process that reads the bytes, then times
``Manifest.from_bytes(data, expected_id=...)`` (id check, validation, canonical re-encode) and
measures the RSS the decoded manifest holds (its bytes included) and the peak over the decode.
Rounds alternate which format goes first; medians. After that, for the format-2 manifest, the
per-chunk views callers use (hex ids, one ref per distinct chunk, the segment plan) are timed
once each.

Parts b and c, end to end on a local 3-server cluster (deploy.local defaults: R=3, W=2): a
synthetic bf16 model (chunking.synthetic) of --b-mib MiB at each chunk size of --b-chunks-kib
(part b; 4 KiB chunks give ~524k chunks for 2 GiB), and of --c-mib MiB at 256 KiB (part c). Each
step runs in a fresh child process: push (its commit time is the CommitVersion call: the leader's
quorum check of every chunk, then Raft), ``paramctl pull`` (``pull_tensors``), the worker's
manifest fetch and decode alone (``ClusterClient.resolve_ref`` + ``manifest``), and a worker cold
load (``worker.loader.load`` with the default memory tier). Each reports its time and its peak
RSS (VmHWM) as a multiple of the model's bytes; the servers' VmHWM is reset before and read after
every step. Pull and load are compared with the pushed tensors by BLAKE3 per tensor.

Targets (issue #18): the 140 GB manifest encodes to <= 25 MB and decodes in <= 0.3 s with
<= 100 MB of RSS for the decoded manifest; at ~524k chunks the commit check takes <= 3 s, the
worker's manifest fetch and decode <= 0.5 s and its cold load >= 0.3 GB/s, bit-exact; the 8 GiB
model pushes, pulls and loads bit-exact with no process's peak RSS above 1.5x the model's bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.measure import hwm_bytes, reset_hwm, rss_bytes  # noqa: E402 - after the path
from chunking.chunk_table import ChunkTable  # noqa: E402
from chunking.layout import chunk_raw_sizes, place_tensors  # noqa: E402
from chunking.manifest import Manifest, TensorEntry  # noqa: E402

CHUNK = 256 << 10
HIDDEN, KV, FFN, VOCAB = 8192, 1024, 28672, 128256
# decoder shapes (layers, hidden, kv width, ffn, vocab): a ~1 GB small model; a 70B-class one; 800 GB by more layers
SIZES = {"1g": (8, 2048, 256, 5632, 32000), "140g": (80, HIDDEN, KV, FFN, VOCAB), "800g": (458, HIDDEN, KV, FFN, VOCAB)}


def fine_tuned(base: Manifest, *, every: int = 10, offset: int = 0, seed: int = 1) -> tuple[Manifest, int]:
    """Version 2 of ``base`` in which every ``every``-th tensor from ``offset`` has new bytes: its
    chunks get new ids and CRCs, introduced in version 2. Returns it and the number of chunks changed."""
    t = base.chunks
    changed = np.zeros(len(t), bool)
    for k, tensor in enumerate(base.tensors):
        if k % every == offset and tensor.nbytes:
            changed[tensor.offset // base.chunk_size : (tensor.offset + tensor.nbytes - 1) // base.chunk_size + 1] = True
    rng = np.random.default_rng(seed)
    rows = np.flatnonzero(changed)
    digests, crc, introduced = t.digests.copy(), t.crc32c.copy(), t.introduced_in.copy()
    digests[rows] = rng.integers(0, 256, (len(rows), 32), dtype=np.uint8)
    crc[rows] = rng.integers(0, 1 << 32, len(rows), dtype=np.uint32)
    introduced[rows] = 2
    table = ChunkTable(digests, t.raw_size, t.stored_size, crc, t.codec_index, t.codecs, introduced, t.created_at)
    return dataclasses.replace(base, version=2, chunks=table), len(rows)


def synthetic_manifest(layers: int, hidden: int, kv: int, ffn: int, vocab: int, *, seed: int = 0) -> Manifest:
    """A bf16 decoder checkpoint's manifest (80 layers of the 70B shape give 723 tensors, ~141 GB)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                   p + "mlp.down_proj.weight": (hidden, ffn), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    names = sorted(shapes)
    nbytes = [int(np.prod(shapes[n])) * 2 for n in names]
    offsets = place_tensors([(nb, 2) for nb in nbytes], CHUNK)
    tensors = tuple(TensorEntry(n, "bfloat16", shapes[n], off, nb) for n, off, nb in zip(names, offsets, nbytes))
    raw = chunk_raw_sizes([(t.offset, t.nbytes) for t in tensors], CHUNK)
    rng = np.random.default_rng(seed)
    n = len(raw)
    table = ChunkTable(rng.integers(0, 256, (n, 32), dtype=np.uint8), raw, raw, rng.integers(0, 1 << 32, n, dtype=np.uint32),
                       np.zeros(n, np.uint8), ("raw",), np.ones(n, np.int64), np.full(n, 1.7e9))
    return Manifest(model="llm", version=1, chunk_size=CHUNK, format_version=2, tensors=tensors, chunks=table,
                    fingerprint="0" * 64)


def decode_child(path: str, expected_id: str) -> None:
    """Child process: decode the manifest at ``path`` (formats 3 and 4: a folder of root and the blobs it names); print
    one JSON line of figures."""
    gc.collect()
    base = rss_bytes()
    reset_hwm()
    folder = Path(path)
    if folder.is_dir():
        data = (folder / "root").read_bytes()
        blobs: dict[str, bytes] | None = {f.name: f.read_bytes() for f in folder.iterdir() if f.name != "root"}
    else:
        data, blobs = folder.read_bytes(), None
    t0 = time.perf_counter()
    manifest = Manifest.from_bytes(data, expected_id=expected_id, parts=blobs)
    seconds = time.perf_counter() - t0
    del data, blobs  # format 2 keeps its bytes alive through its column views; formats 1, 3 and 4 let them go
    gc.collect()
    held = rss_bytes() - base
    print(json.dumps({"seconds": seconds, "held": held, "peak": hwm_bytes() - base, "chunks": len(manifest.chunks)}))


def run_child(path: Path, expected_id: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--decode-child", str(path), expected_id], check=True,
                         capture_output=True, text=True, cwd=REPO)
    figures: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


MODEL_SEED = 11


def _digests(tensors: dict[str, Any]) -> dict[str, str]:
    """dtype, shape and BLAKE3 of every tensor's bytes."""
    import blake3
    import torch

    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        out[name] = f"{t.dtype}|{tuple(t.shape)}|" + blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
    return out


def e2e_child(step: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One timed step in this fresh process; returns its figures."""
    import torch  # imported (and counted) before the RSS baseline

    from chunking.config import ChunkingConfig

    ref = f"{spec['model']}:prod"
    gc.collect()
    base = rss_bytes()
    out: dict[str, Any] = {"step": step}
    if step == "push":
        from chunking.synthetic import synthetic_state_dict
        from paramserver.client.push import push

        state = synthetic_state_dict(spec["mib"] << 20, dtype=torch.bfloat16, seed=MODEL_SEED)
        Path(spec["digests"]).write_text(json.dumps(_digests(state)))
        gc.collect()
        reset_hwm()
        t0 = time.perf_counter()
        rep = push(spec["seed"], state, model=spec["model"], tag="prod", config=ChunkingConfig(chunk_size=spec["chunk"]))
        out |= {"seconds": time.perf_counter() - t0, "pack": rep.pack_seconds, "upload": rep.upload_seconds,
                "commit": rep.commit_seconds, "chunks": rep.chunks_total, "bytes": rep.bytes_total}
        out["peak_rss"] = hwm_bytes() - base
        return out
    want = json.loads(Path(spec["digests"]).read_text())
    if step == "pull":
        from paramserver.client.pull import pull_tensors

        reset_hwm()
        t0 = time.perf_counter()
        tensors, _ = pull_tensors(spec["seed"], ref)
        out["seconds"] = time.perf_counter() - t0
        out["peak_rss"] = hwm_bytes() - base
        out["bit_exact"] = _digests(tensors) == want
        return out
    from paramserver.client.session import ClusterClient

    client = ClusterClient(spec["seed"])
    client.refresh()
    try:
        if step == "manifest":
            reset_hwm()
            t0 = time.perf_counter()
            info = client.resolve_ref(ref, linearizable=True)
            manifest = client.manifest(info.manifest_id)
            out["seconds"] = time.perf_counter() - t0
            out["peak_rss"] = hwm_bytes() - base
            out["chunks"] = len(manifest.chunks)
            out["manifest_bytes"] = sum(len(b) for b in manifest.blobs().values())  # formats 3 and 4: root, layout and parts
            # Where the time goes, asked again: the tag, the GetManifest RPC of the root, the parts and the decode (with its plan).
            t0 = time.perf_counter()
            info = client.resolve_ref(ref, linearizable=True)
            t1 = time.perf_counter()
            reply = client.server(info.server).get_manifest(manifest_id=info.manifest_id)
            t2 = time.perf_counter()
            again = client.server(info.server).read_manifest(reply)
            again.plan  # noqa: B018 - what ClusterClient.manifest does too
            t3 = time.perf_counter()
            out["parts"] = {"resolve": t1 - t0, "rpc": t2 - t1, "parts+decode": t3 - t2}
            return out
        from worker.config import CacheConfig
        from worker.loader import load
        from worker.tiered_cache import TieredCache

        cache = TieredCache.from_config(CacheConfig())
        reset_hwm()
        t0 = time.perf_counter()
        loaded = load(client, ref, "cpu", cache)
        out["seconds"] = time.perf_counter() - t0
        out["peak_rss"] = hwm_bytes() - base
        out["bit_exact"] = _digests(loaded.tensors) == want
        out["network_bytes"] = loaded.report.bytes_network
        return out
    finally:
        client.close()


def _server_hwm(pids: list[int], reset: bool) -> int:
    """The largest VmHWM of the server processes (after resetting it, when ``reset``)."""
    worst = 0
    for pid in pids:
        try:
            if reset:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")
            with open(f"/proc/{pid}/status") as f:
                worst = max(worst, next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")))
        except (OSError, StopIteration):
            pass
    return worst


def run_e2e(cases: list[tuple[int, int]], work: Path) -> list[dict[str, Any]]:
    from deploy.local import LocalCluster, LocalClusterConfig

    cluster = LocalCluster(LocalClusterConfig(root=work / "cluster", servers=3))
    rows = []
    try:
        cluster.up(wait=120)
        pids = [s.pid for s in cluster.slots if s.pid]
        for mib, chunk in cases:
            spec = {"seed": cluster.seed, "mib": mib, "chunk": chunk, "model": f"scale{mib}m{chunk >> 10}k",
                    "digests": str(work / f"digests-{mib}-{chunk}.json")}
            spec_path = work / "spec.json"
            spec_path.write_text(json.dumps(spec))
            model_bytes = None
            for step in ("push", "pull", "manifest", "load"):
                _server_hwm(pids, reset=True)
                proc = subprocess.run([sys.executable, __file__, "--e2e-child", step, str(spec_path)], capture_output=True,
                                      text=True, cwd=REPO, timeout=3600)
                if proc.returncode != 0:
                    raise SystemExit(f"bench_scale: {step} of {mib} MiB at {chunk >> 10} KiB failed:\n{proc.stderr[-3000:]}")
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                row |= {"mib": mib, "chunk_kib": chunk >> 10, "server_peak_rss": _server_hwm(pids, reset=False)}
                model_bytes = row.get("bytes", model_bytes)
                row["model_bytes"] = model_bytes
                rows.append(row)
                print(f"  {mib} MiB @ {chunk >> 10} KiB {step}: {row['seconds']:.2f} s, peak RSS {row['peak_rss'] / 2**20:.0f} MiB"
                      + (f", bit-exact {row['bit_exact']}" if "bit_exact" in row else ""), flush=True)
    finally:
        cluster.down()
    return rows


def print_e2e(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'model':>12} {'chunks':>8} {'step':>9} {'seconds':>8} {'GB/s':>6} {'client RSS':>10} {'server RSS':>10}  notes")
    for r in rows:
        mb = r["model_bytes"]
        gbps = mb / r["seconds"] / 1e9 if r["step"] in ("push", "pull", "load") else None
        notes = []
        if r["step"] == "push":
            notes.append(f"pack {r['pack']:.2f} s, upload {r['upload']:.2f} s, commit {r['commit']:.2f} s")
        if "bit_exact" in r:
            notes.append("bit-exact" if r["bit_exact"] else "NOT BIT-EXACT")
        if r["step"] == "manifest":
            notes.append(f"{r['manifest_bytes'] / 1e6:.1f} MB manifest; asked again: "
                         + ", ".join(f"{k} {v:.2f} s" for k, v in r["parts"].items()))
        print(f"{r['mib']:>6} MiB@{r['chunk_kib']:>3}K {r.get('chunks', ''):>8} {r['step']:>9} {r['seconds']:8.2f} "
              f"{'' if gbps is None else f'{gbps:6.3f}':>6} {r['peak_rss'] / mb:9.2f}x {r['server_peak_rss'] / mb:9.2f}x  "
              + "; ".join(notes))
    print("  (RSS: peak of the step's process above its imports, and the largest server VmHWM, as multiples of the model's bytes)")
    small = [r for r in rows if r["chunk_kib"] == 4]
    if small:
        by = {r["step"]: r for r in small}
        print("\n4 KiB chunks, issue #18 bars:")
        for what, value, bar, higher in (("commit check <= 3 s", by["push"]["commit"], 3.0, False),
                                          ("worker manifest fetch + decode <= 0.5 s", by["manifest"]["seconds"], 0.5, False),
                                          ("worker cold load >= 0.3 GB/s", by["load"]["model_bytes"] / by["load"]["seconds"] / 1e9,
                                           0.3, True)):
            ok = value >= bar if higher else value <= bar
            print(f"  {what}: {value:.3f} -> {'PASS' if ok else 'BELOW'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1g,140g,800g", help="comma-separated from 1g, 140g, 800g (default: all three)")
    ap.add_argument("--rounds", type=int, default=3, help="decodes per format and size, alternating order (default 3)")
    ap.add_argument("--skip-json-above", type=float, default=None, metavar="GB",
                    help="do not build or decode format 1 above this checkpoint size (it takes minutes and GBs)")
    ap.add_argument("--parts", default="a,b,c", help="which parts to run: a (manifests), b (chunk counts), c (8 GiB)")
    ap.add_argument("--b-mib", type=int, default=2048, help="part b's model size in MiB (default 2048)")
    ap.add_argument("--b-chunks-kib", default="4,256", help="part b's chunk sizes in KiB (default 4,256)")
    ap.add_argument("--c-mib", type=int, default=8192, help="part c's model size in MiB at 256 KiB chunks (default 8192)")
    ap.add_argument("--dir", type=Path, default=None, help="folder for the cluster's data (default: a temporary one)")
    ap.add_argument("--decode-child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--e2e-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.decode_child:
        decode_child(*args.decode_child)
        return
    if args.e2e_child:
        step, spec_path = args.e2e_child
        print(json.dumps(e2e_child(step, json.loads(Path(spec_path).read_text()))), flush=True)
        return
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= {"a", "b", "c"}:
        raise SystemExit(f"bench_scale: unknown part in --parts {args.parts!r}: use a, b, c")
    if "a" in parts:
        bench_manifests(args)
    cases = [(args.b_mib, int(k) << 10) for k in args.b_chunks_kib.split(",")] if "b" in parts else []
    cases += [(args.c_mib, CHUNK)] if "c" in parts else []
    if cases:
        if args.dir is not None:
            args.dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.dir) as tmp:
            print_e2e(run_e2e(cases, Path(tmp)))


def bench_manifests(args: argparse.Namespace) -> None:
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or args.rounds < 1:
        raise SystemExit(f"bench_scale: unknown size {unknown} (use 1g, 140g, 800g) or --rounds < 1")
    rows = []
    tunes: list[tuple[str, int, int, list[tuple[float, float]]]] = []  # model, format, parts, (chunk share, added share) per pick
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for size in sizes:
            binary = synthetic_manifest(*SIZES[size])
            gb = binary.total_bytes / 1e9
            formats = [2, 3, 4] if args.skip_json_above is not None and gb > args.skip_json_above else [1, 2, 3, 4]
            figures: dict[int, dict[str, float]] = {}
            files: dict[int, tuple[Path, str]] = {}
            for fmt in formats:
                fresh = binary.in_format(fmt)
                t0 = time.perf_counter()
                blobs = fresh.blobs()  # formats 3 and 4: root, layout and parts; otherwise the one blob
                encode_s = time.perf_counter() - t0
                path = Path(tmp) / f"{size}-{fmt}"
                if fmt >= 3:
                    path.mkdir()
                    for bid, data in blobs.items():
                        (path / ("root" if bid == fresh.id else bid)).write_bytes(data)
                    picks = []
                    for offset in range(10):
                        tune, changed = fine_tuned(fresh, offset=offset)
                        tuned = tune.blobs()
                        added = sum(len(d) for bid, d in tuned.items() if bid not in blobs)
                        picks.append((changed / len(fresh.chunks), added / sum(len(d) for d in tuned.values())))
                        del tune, tuned
                    tunes.append((size, fmt, len(fresh.parts), picks))
                else:
                    path.write_bytes(blobs[fresh.id])
                files[fmt] = (path, fresh.id)
                figures[fmt] = {"bytes": sum(len(d) for d in blobs.values()), "encode": encode_s}
                del fresh, blobs
                gc.collect()
            decodes: dict[int, list[dict[str, float]]] = {fmt: [] for fmt in formats}
            for r in range(args.rounds):
                for fmt in formats[r % len(formats):] + formats[: r % len(formats)]:  # rotated: each goes first in turn
                    decodes[fmt].append(run_child(*files[fmt]))
            for fmt in formats:
                for key in ("seconds", "held", "peak"):
                    figures[fmt][key] = statistics.median(d[key] for d in decodes[fmt])
                rows.append((size, gb, len(binary.chunks), len(binary.tensors), fmt, figures[fmt]))
            views: dict[str, float] = {}
            calls: list[tuple[str, Callable[[Manifest], object]]] = [
                ("hex ids", lambda m: m.chunk_ids()), ("distinct refs", lambda m: m.unique_chunks()),
                ("segment plan", lambda m: m.plan)]
            for name, fn in calls:
                decoded = Manifest.from_bytes(files[2][0].read_bytes())
                t0 = time.perf_counter()
                fn(decoded)
                views[name] = time.perf_counter() - t0
                del decoded
                gc.collect()
            print(f"{size}: format-2 views: " + ", ".join(f"{k} {v:.2f} s" for k, v in views.items()), flush=True)
            for fmt in formats:
                if files[fmt][0].is_dir():
                    shutil.rmtree(files[fmt][0])
                else:
                    os.unlink(files[fmt][0])
    print(f"\n{'model':>6} {'GB':>7} {'chunks':>9} {'tensors':>7} {'format':>6} {'MB':>8} {'encode s':>9} "
          f"{'decode s':>9} {'held MB':>8} {'peak MB':>8}")
    for size, gb, chunks, tensors, fmt, f in rows:
        print(f"{size:>6} {gb:7.1f} {chunks:9d} {tensors:7d} {fmt:6d} {f['bytes'] / 1e6:8.1f} {f['encode']:9.3f} "
              f"{f['seconds']:9.3f} {f['held'] / 1e6:8.1f} {f['peak'] / 1e6:8.1f}")
    print("\nfine-tunes: every 10th tensor (name order) new, from each offset 0..9; the share of the manifest's bytes "
          "the new version adds (bar <= 15%), next to the share of chunks it changes (the floor)")
    print(f"{'model':>6} {'format':>6} {'parts':>6} {'offset 0: chunks':>17} {'added':>7} {'mean: chunks':>13} "
          f"{'added':>7} {'worst: offset':>14} {'chunks':>7} {'added':>7} {'max excess':>11} {'picks <= 15%':>13}")
    for size, fmt, nparts, picks in tunes:
        shares, adds = np.asarray([p[0] for p in picks]), np.asarray([p[1] for p in picks])
        worst = int(np.argmax(adds))
        print(f"{size:>6} {fmt:6d} {nparts:6d} {shares[0]:17.1%} {adds[0]:7.1%} {shares.mean():13.1%} {adds.mean():7.1%} "
              f"{worst:14d} {shares[worst]:7.1%} {adds[worst]:7.1%} {float((adds - shares).max()):10.1%}p "
              f"{int((adds <= 0.15).sum()):>10d}/10")
    by = {(size, fmt): f for size, _, _, _, fmt, f in rows}
    for fmt in (2, 3, 4):
        if ("140g", fmt) not in by:
            continue
        f = by[("140g", fmt)]
        checks = [("encoded size <= 25 MB", f["bytes"] / 1e6, 25.0), ("decode <= 0.3 s", f["seconds"], 0.3),
                  ("decoded RSS <= 100 MB", f["held"] / 1e6, 100.0)]
        print(f"\n140 GB, format {fmt}, issue #18 bars:")
        for what, value, bar in checks:
            print(f"  {what}: {value:.3f} -> {'PASS' if value <= bar else 'BELOW'}")
        if ("140g", 1) in by:
            old = by[("140g", 1)]
            print(f"  vs format 1: {old['bytes'] / f['bytes']:.1f}x smaller, decode {old['seconds'] / f['seconds']:.0f}x "
                  f"faster, {old['held'] / max(f['held'], 1):.1f}x less RSS held")


if __name__ == "__main__":
    main()
