#!/usr/bin/env python
"""Worker load vs pull vs Redis vs memcpy, side by side, with peak RSS (issue #10).

    .venv/bin/python bench/bench_load.py [--mib 512] [--rounds 4] [--dir DIR] [--json FILE] [--server-arg=--cache-mb=1024 ...]

One run: starts a local 3-server cluster (deploy.local with its defaults: R=3, W=2 and the
servers' own defaults for cache, fsync and scrub), pushes a synthetic bf16 model of --mib MiB
(chunking.synthetic, 256 KiB raw chunks: ChunkingConfig()), SETs the same chunks into a local
redis-server (no persistence), then measures, each in a fresh child process of this script:

  1. worker cold load: ``worker.loader.load(client, "bench:prod", "cpu", cache)`` with a fresh
     ``ClusterClient`` and a fresh ``TieredCache.from_config(CacheConfig())`` (default memory tier);
  2. worker memory-tier load: a second ``load`` through the same, now warm, TieredCache (same
     child, same client, the cold load's tensors dropped first);
  3. the ``paramctl pull`` path: ``paramserver.client.pull.pull_tensors(seed, "bench:prod")``;
  4. a Redis loader: redis-py with the hiredis parser, GET pipelined 32 at a time, every chunk's
     size and CRC32C (chunking.hashing.crc32c, what the product uses) checked against the manifest, copied into tensors
     allocated (torch.empty) before the clock starts;
  5. memcpy: ``torch.Tensor.copy_`` of the same bytes (already in memory) into preallocated
     tensors whose pages are already touched (the copy alone: the stricter baseline; the memory
     tier's tensors can reuse pages the cold load freed). The first copy into the same tensors,
     fresh from torch.empty (first touch, the kernel's page faults included), is shown for
     information.

Rounds run every method once, in orders from a balanced (Williams) design: over every 4 rounds
each method runs in each position and right after each other method once (a plain rotation puts
the worker right after memcpy in every round, so what one child leaves behind, memory for the
kernel to reclaim or servers still busy, always lands on the same next one); figures are medians
over rounds, after one unmeasured warm-up pull (the servers' first reads of what the push wrote
past their page cache are paid by no method). CPU ns/B: the loading child's own CPU time (user
and system, every thread; not the servers') in the timed part, per model byte, median. Peak RSS:
each child reads VmRSS after its imports and cluster connection (the baseline), resets the
kernel's high-water mark (/proc/self/clear_refs), runs the timed load and reads VmHWM; the
figure is (VmHWM - baseline) / model bytes, the worst over the rounds. Every method's result is
compared byte for byte with the source once (round 1, not timed, after the RSS reading).
Compare figures within one run only: the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any


REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.measure import balanced_orders, ceil3, floor3, hwm_bytes, reset_hwm, rss_bytes  # noqa: E402 - after the path

MiB = 1 << 20
MODEL, TAG = "bench", "prod"
REF = f"{MODEL}:{TAG}"
CHILD_TIMEOUT_S = 240.0  # one child (worker: cold + memory tier) on a 512 MiB model takes seconds

# The methods; the worker child measures both worker rows.
KINDS = ("worker", "pull", "redis", "memcpy")
ROWS = {
    "worker_cold": "worker cold load (fresh client + cache, default mem tier)",
    "worker_memory": "worker memory-tier load (same warm TieredCache)",
    "pull": "paramctl pull path (pull_tensors)",
    "redis": "Redis loader (hiredis, pipe 32, CRC32C, copy)",
    "memcpy": "memcpy (torch copy_, preallocated touched tensors)",
    "memcpy_fresh": "  info: memcpy into fresh tensors (first touch)",
}
ROWS_OF_KIND = {"worker": ("worker_cold", "worker_memory"), "pull": ("pull",), "redis": ("redis",),
                "memcpy": ("memcpy", "memcpy_fresh")}


# ----------------------------------------------------------------------------------- memory

# ----------------------------------------------------------------------------------- child side

class Source:
    """The pushed model's bytes, as written by the parent to source.bin (tensors in name order)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.path = spec["source_file"]
        self.index: list[dict[str, Any]] = spec["tensors"]  # name, dtype, shape, offset, nbytes

    def read_into_new(self) -> dict[str, Any]:
        import torch

        out = {}
        with open(self.path, "rb", buffering=0) as f:
            for t in self.index:
                tensor = torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]))
                if t["nbytes"]:
                    f.seek(t["offset"])
                    view = tensor.reshape(-1).view(torch.uint8).numpy().data
                    got = f.readinto(view)
                    assert got == t["nbytes"], (t["name"], got)
                out[t["name"]] = tensor
        return out

    def compare(self, tensors: dict[str, Any]) -> str:
        """"ok" when every tensor has the source's name, dtype, shape and bytes; else what differs.

        Reads the source with read() into one reused buffer (no mmap), after the RSS reading.
        """
        import torch

        names = {t["name"] for t in self.index}
        if set(tensors) != names:
            return f"tensor names differ: {len(set(tensors) - names)} extra, {len(names - set(tensors))} missing"
        buf = bytearray(max([t["nbytes"] for t in self.index] + [1]))
        with open(self.path, "rb", buffering=0) as f:
            for t in self.index:
                got = tensors[t["name"]]
                if str(got.dtype) != f"torch.{t['dtype']}" or list(got.shape) != t["shape"]:
                    return f"{t['name']}: {got.dtype} {list(got.shape)}, source torch.{t['dtype']} {t['shape']}"
                if got.device.type != "cpu":
                    return f"{t['name']}: on {got.device}, not cpu"
                n = t["nbytes"]
                if not n:
                    continue
                f.seek(t["offset"])
                view = memoryview(buf)[:n]
                if f.readinto(view) != n:
                    return f"{t['name']}: short read of the source"
                want = torch.frombuffer(buf, dtype=torch.uint8, count=n)
                have = got.contiguous().reshape(-1).view(torch.uint8)
                if not torch.equal(want, have):
                    bad = int((want != have).sum())
                    return f"{t['name']}: {bad} of {n} bytes differ"
        return "ok"


def _cpu_s() -> float:
    """User plus system CPU seconds of this process (every thread) so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _measure(fn: Callable[[], Any], baseline: int) -> tuple[float, int, bool, float, Any]:
    """(seconds, peak RSS above baseline, hwm_was_reset, CPU seconds, result) of ``fn()``; the CPU
    is this child's only (the servers' is not in it)."""
    was_reset = reset_hwm()
    c0 = _cpu_s()
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    cpu_s = _cpu_s() - c0
    peak = hwm_bytes() - baseline
    return seconds, peak, was_reset, cpu_s, result


def child_worker(spec: dict[str, Any], check: bool) -> list[dict[str, Any]]:
    import torch  # noqa: F401 - loaded (and its memory counted) before the RSS baseline

    from deploy.local import LocalCluster
    from paramserver.client.session import ClusterClient
    from worker.config import CacheConfig
    from worker.loader import load
    from worker.tiered_cache import TieredCache

    LocalCluster.load_state(Path(spec["cluster_root"])).cluster_info()  # gRPC runtime up
    client = ClusterClient(spec["seed"])
    client.refresh()  # members, ring: connected
    cache = TieredCache.from_config(CacheConfig())  # the default memory tier, no disk tier
    source = Source(spec)
    gc.collect()
    baseline = rss_bytes()
    rows = []
    try:
        for row in ("worker_cold", "worker_memory"):
            seconds, peak, was_reset, cpu_s, loaded = _measure(lambda: load(client, REF, "cpu", cache), baseline)
            rep = loaded.report
            notes = []
            if row == "worker_cold" and rep.bytes_network != rep.bytes_total:
                notes.append(f"only {rep.bytes_network} of {rep.bytes_total} bytes came from the network")
            if row == "worker_memory" and rep.bytes_memory != rep.bytes_total:
                notes.append(f"only {rep.bytes_memory} of {rep.bytes_total} bytes came from the memory tier")
            if not was_reset:
                notes.append("VmHWM could not be reset: peak includes earlier work in this child")
            exact = source.compare(loaded.tensors) if check else None
            rows.append({"row": row, "seconds": seconds, "peak_rss_above": peak, "baseline_rss": baseline, "cpu_s": cpu_s,
                         "bit_exact": exact, "notes": notes, "report": rep.to_dict(),
                         "rss_after": rss_bytes()})
            del loaded, rep
            gc.collect()
    finally:
        client.close()
    return rows


def child_pull(spec: dict[str, Any], check: bool) -> list[dict[str, Any]]:
    import torch  # noqa: F401 - loaded (and its memory counted) before the RSS baseline

    from deploy.local import LocalCluster
    from paramserver.client.pull import PullOptions, pull_tensors

    LocalCluster.load_state(Path(spec["cluster_root"])).cluster_info()  # gRPC runtime up
    source = Source(spec)
    gc.collect()
    baseline = rss_bytes()
    seconds, peak, was_reset, cpu_s, (tensors, rep) = _measure(
        lambda: pull_tensors(spec["seed"], REF, options=PullOptions()), baseline)
    notes = [] if was_reset else ["VmHWM could not be reset"]
    if rep.bulk_bytes != rep.bytes_fetched:
        notes.append(f"only {rep.bulk_bytes} of {rep.bytes_fetched} bytes came over bulk ({rep.bulk_fallbacks} fallbacks)")
    exact = source.compare(tensors) if check else None
    report = {k: v for k, v in vars(rep).items() if isinstance(v, (int, float, str, type(None)))}
    return [{"row": "pull", "seconds": seconds, "peak_rss_above": peak, "baseline_rss": baseline, "cpu_s": cpu_s,
             "bit_exact": exact, "notes": notes, "report": report}]


def child_redis(spec: dict[str, Any], check: bool) -> list[dict[str, Any]]:
    import numpy as np
    import redis
    import redis.utils
    import torch

    from chunking.dtypes import torch_dtype
    from chunking.hashing import crc32c  # the CRC32C the product uses: the baseline checks as fast
    from chunking.manifest import Manifest

    manifest = Manifest.from_bytes(Path(spec["manifest_file"]).read_bytes())
    plan = manifest.plan
    r = redis.Redis(host="127.0.0.1", port=spec["redis_port"], socket_timeout=60)
    r.ping()
    depth = spec["pipeline"]
    # Preallocated destination: allocated before the clock, pages first touched by the copies.
    targets = {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype)) for t in manifest.tensors}
    views = [targets[t.name].reshape(-1).view(torch.uint8).numpy() for t in manifest.tensors]
    chunks = manifest.chunks
    source = Source(spec)
    gc.collect()
    baseline = rss_bytes()

    def load_from_redis() -> dict[str, torch.Tensor]:
        for start in range(0, len(chunks), depth):
            batch = chunks[start : start + depth]
            pipe = r.pipeline(transaction=False)
            for ref in batch:
                pipe.get(ref.id)
            for ref, value in zip(batch, pipe.execute()):
                if value is None or len(value) != ref.stored_size or crc32c(value) != ref.crc32c:
                    raise RuntimeError(f"redis chunk #{ref.index} {ref.id} is missing or fails its size/CRC32C check")
                data = np.frombuffer(value, dtype=np.uint8)
                for s in plan.segments[ref.index]:
                    views[s.tensor][s.tensor_offset : s.tensor_offset + s.length] = data[s.chunk_offset : s.chunk_offset + s.length]
        return targets

    seconds, peak, was_reset, cpu_s, tensors = _measure(load_from_redis, baseline)
    notes = [] if was_reset else ["VmHWM could not be reset"]
    if not redis.utils.HIREDIS_AVAILABLE:
        notes.append("hiredis NOT available: redis-py's pure-Python parser was used")
    exact = source.compare(tensors) if check else None
    r.close()
    return [{"row": "redis", "seconds": seconds, "peak_rss_above": peak, "baseline_rss": baseline, "cpu_s": cpu_s,
             "bit_exact": exact, "notes": notes, "report": {"chunks": len(chunks), "pipeline": depth,
                                                            "hiredis": bool(redis.utils.HIREDIS_AVAILABLE)}}]


def child_memcpy(spec: dict[str, Any], check: bool) -> list[dict[str, Any]]:
    import torch

    source = Source(spec)
    src = source.read_into_new()  # the bytes, in memory before the baseline (as the cluster holds them for the others)
    dst = {k: torch.empty_like(v) for k, v in src.items()}  # preallocated, pages not yet touched
    gc.collect()
    baseline = rss_bytes()

    def copy() -> dict[str, torch.Tensor]:
        for k, v in src.items():
            dst[k].copy_(v)
        return dst

    rows: list[dict[str, Any]] = []
    for row in ("memcpy_fresh", "memcpy"):  # the first copy faults the pages in; the second is the copy alone
        seconds, peak, was_reset, cpu_s, out = _measure(copy, baseline)
        notes = [] if was_reset else ["VmHWM could not be reset"]
        exact = source.compare(out) if check and row == "memcpy" else None
        rows.append({"row": row, "seconds": seconds, "peak_rss_above": peak, "baseline_rss": baseline, "cpu_s": cpu_s,
                     "bit_exact": exact, "notes": notes, "report": {}})
    return rows


CHILDREN = {"worker": child_worker, "pull": child_pull, "redis": child_redis, "memcpy": child_memcpy}


def child_main(kind: str, spec_path: str, out_path: str, check: bool) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        rows = CHILDREN[kind](spec, check)
        result: dict[str, Any] = {"kind": kind, "ok": True, "rows": rows, "pid": os.getpid()}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which goes on with the other methods
        result = {"kind": kind, "ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out_path).write_text(json.dumps(result))
    return 0 if result["ok"] else 1


# ----------------------------------------------------------------------------------- parent side

def run_child(kind: str, spec_path: Path, out_dir: Path, tag: str, check: bool) -> dict[str, Any]:
    out = out_dir / f"{tag}-{kind}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-spec", str(spec_path),
           "--child-out", str(out)] + (["--child-check"] if check else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(REPO), timeout=CHILD_TIMEOUT_S, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "ok": False, "error": f"child timed out after {CHILD_TIMEOUT_S:.0f} s", "traceback": ""}
    if not out.exists():
        return {"kind": kind, "ok": False, "error": f"child exited {proc.returncode} without a result",
                "traceback": (proc.stdout + proc.stderr)[-4000:]}
    result: dict[str, Any] = json.loads(out.read_text())
    if proc.stderr.strip():
        result["stderr"] = proc.stderr[-2000:]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="model size in MiB, bf16 (default 512)")
    p.add_argument("--rounds", type=int, default=4, help="rounds; every method once per round, balanced order (default 4: one full design)")
    p.add_argument("--dir", type=Path, default=None, help="parent folder for the run's working folder (default: the system temp dir)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every measurement to FILE as JSON")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every 'paramserver serve' (repeatable, e.g. --server-arg=--cache-mb=1024); "
                        "default: none, the servers' own defaults")
    p.add_argument("--pipeline", type=int, default=32, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--child-spec", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--child-check", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args.child, args.child_spec, args.child_out, args.child_check)
    if args.rounds < 1 or args.mib < 1:
        p.error("--rounds and --mib must be >= 1")

    # SIGTERM (a timeout, a CI cancel) unwinds through the finally below: cluster and Redis stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    from chunking.config import ChunkingConfig
    from chunking.pack import pack
    from chunking.synthetic import synthetic_state_dict
    from deploy.local import LocalCluster, LocalClusterConfig
    from deploy.redis_baseline import RedisServer
    from paramserver.client.push import push

    t_start = time.perf_counter()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-load-", dir=args.dir))
    cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3, extra_args=tuple(args.server_arg)))
    redis_server: RedisServer | None = None
    failed = False
    try:
        print(f"generating a {args.mib} MiB bf16 model ...", flush=True)
        state = synthetic_state_dict(args.mib * MiB, dtype=torch.bfloat16, seed=0)
        names = sorted(state)
        index, offset = [], 0
        with open(root / "source.bin", "wb") as f:
            for name in names:
                t = state[name]
                nbytes = t.numel() * t.element_size()
                index.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                              "offset": offset, "nbytes": nbytes})
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
                offset += nbytes
        model_bytes = offset
        print(f"model: {len(state)} tensors, {model_bytes / MiB:.1f} MiB ({model_bytes} bytes)", flush=True)

        t0 = time.perf_counter()
        cluster.up(wait=120)
        print(f"cluster up in {time.perf_counter() - t0:.1f} s: {cluster.seed}"
              f"{' (server args: ' + ' '.join(args.server_arg) + ')' if args.server_arg else ' (server defaults)'}", flush=True)
        t0 = time.perf_counter()
        pushed = push(cluster.seed, state, model=MODEL, tag=TAG)
        push_s = time.perf_counter() - t0
        print(f"push: v{pushed.version}, {pushed.bytes_total / MiB:.0f} MiB, {pushed.chunks_unique} chunks in {push_s:.1f} s "
              f"(R={pushed.replication}, W={pushed.write_quorum})", flush=True)

        # Redis: the same chunks (same ChunkingConfig as the push: 256 KiB raw), keyed by content id.
        packed = pack(state, model=MODEL, config=ChunkingConfig())
        man = packed.manifest
        if man.total_bytes != model_bytes or len(man.unique_chunks()) != pushed.chunks_unique or man.raw_bytes != pushed.bytes_total:
            raise SystemExit(f"packed model ({len(man.unique_chunks())} chunks, {man.raw_bytes} B) differs from the push "
                             f"({pushed.chunks_unique} chunks, {pushed.bytes_total} B)")
        (root / "manifest.bin").write_bytes(man.in_format(2).to_bytes())  # one file for the Redis loader
        redis_server = RedisServer(root)
        rc = redis_server.client()
        t0 = time.perf_counter()
        pipe = rc.pipeline(transaction=False)
        for i, chunk in enumerate(packed.chunks(unique=True)):
            pipe.set(chunk.ref.id, chunk.data)
            if i % args.pipeline == args.pipeline - 1:
                pipe.execute()
        pipe.execute()
        redis_used = int(rc.info("memory")["used_memory"])
        rc.close()
        print(f"redis: {len(man.unique_chunks())} chunks SET on port {redis_server.port} in {time.perf_counter() - t0:.1f} s "
              f"(used_memory {redis_used / MiB:.0f} MiB, no persistence)", flush=True)
        chunk_size = man.chunk_size
        del state, packed, man, chunk, pipe
        gc.collect()

        spec = {"seed": cluster.seed, "cluster_root": str(cluster.root), "source_file": str(root / "source.bin"),
                "manifest_file": str(root / "manifest.bin"), "tensors": index, "redis_port": redis_server.port,
                "pipeline": args.pipeline}
        spec_path = root / "spec.json"
        spec_path.write_text(json.dumps(spec))
        out_dir = root / "results"
        out_dir.mkdir()

        # Warm-up, not measured: one pull reads every chunk once, so that no method pays for the
        # servers' first reads of the pushed segments (the push writes them with O_DIRECT, past the
        # page cache) while Redis already holds every chunk in memory; else whichever method runs
        # first in round 1 pays for the disk.
        t0 = time.perf_counter()
        warm = run_child("pull", spec_path, out_dir, "warmup", False)
        print(f"warm-up pull (not measured): {time.perf_counter() - t0:.1f} s with the child's start"
              f"{'' if warm['ok'] else ', FAILED: ' + warm['error']}", flush=True)

        measurements: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
        errors: list[dict[str, Any]] = []
        exact: dict[str, str] = {}
        for round_no, order in enumerate(balanced_orders(KINDS, args.rounds)):
            for kind in order:
                check = not any(measurements[row] for row in ROWS_OF_KIND[kind])  # once per method: its first good run
                result = run_child(kind, spec_path, out_dir, f"r{round_no + 1}", check)
                if not result["ok"]:
                    errors.append({"round": round_no + 1, **result})
                    print(f"round {round_no + 1}: {kind}: FAILED: {result['error']}\n{result.get('traceback', '')}", flush=True)
                    continue
                for m in result["rows"]:
                    m["round"] = round_no + 1
                    measurements[m["row"]].append(m)
                    if m["bit_exact"] is not None:
                        exact[m["row"]] = m["bit_exact"]
                    print(f"round {round_no + 1}: {ROWS[m['row']].strip()}: {m['seconds']:.3f} s, "
                          f"{model_bytes / m['seconds'] / 1e9:.2f} GB/s, peak RSS +{m['peak_rss_above'] / MiB:.0f} MiB "
                          f"({m['peak_rss_above'] / model_bytes:.2f}x model)"
                          f"{'; bit-exact: ' + m['bit_exact'] if m['bit_exact'] is not None else ''}"
                          f"{'; ' + '; '.join(m['notes']) if m['notes'] else ''}", flush=True)
        redis_server.stop()
        redis_server = None
    except BaseException:
        failed = True
        raise
    finally:
        if redis_server is not None:
            redis_server.stop()
        cluster.down()
        if failed:
            print(f"working folder kept for the logs: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    # ------------------------------------------------------------------------- summary
    summary: dict[str, dict[str, Any]] = {}
    for row, ms in measurements.items():
        if not ms:
            continue
        med = statistics.median(m["seconds"] for m in ms)
        summary[row] = {
            "seconds": [m["seconds"] for m in ms], "median_s": med, "median_gbps": model_bytes / med / 1e9,
            "median_cpu_ns_per_byte": statistics.median(m["cpu_s"] for m in ms) / model_bytes * 1e9,
            "peak_rss_above_max": max(m["peak_rss_above"] for m in ms),
            "peak_rss_ratio_max": max(m["peak_rss_above"] for m in ms) / model_bytes,
            "peak_rss_ratio_each": [m["peak_rss_above"] / model_bytes for m in ms],
            "bit_exact": exact.get(row, "n/a" if row == "memcpy_fresh" else "not checked"),
        }

    cores = os.cpu_count() or 1
    print()
    print(f"bench_load: {model_bytes / MiB:.0f} MiB bf16 model, {chunk_size // 1024} KiB chunks, 3 servers R={pushed.replication} "
          f"W={pushed.write_quorum}, {args.rounds} rounds (balanced order), {cores} cores, torch {torch.__version__}, "
          f"Python {platform.python_version()}")
    w = max(len(v) for v in ROWS.values())
    head = (f"{'method':{w}s}  {'s per round':>20s}  {'median s':>8s}  {'GB/s':>6s}  {'CPU ns/B':>8s}  "
            f"{'peak RSS above base (worst)':>27s}  bit-exact")
    print(head)
    print("-" * len(head))
    for row, label in ROWS.items():
        s = summary.get(row)
        if s is None:
            print(f"{label:{w}s}  {'FAILED':>20s}")
            continue
        per_round = " ".join(f"{x:.3f}" for x in s["seconds"])
        rss = f"{s['peak_rss_above_max'] / MiB:.0f} MiB = {ceil3(s['peak_rss_ratio_max'])}x model"
        print(f"{label:{w}s}  {per_round:>20s}  {s['median_s']:8.3f}  {s['median_gbps']:6.2f}  "
              f"{s['median_cpu_ns_per_byte']:8.2f}  {rss:>27s}  {s['bit_exact']}")

    def ratio(a: str, b: str) -> float | None:
        if a in summary and b in summary:
            return float(summary[b]["median_s"] / summary[a]["median_s"])  # throughput of a / throughput of b
        return None

    def vs(a: str, b: str) -> str:
        if a in summary and b in summary:
            return f"{summary[a]['median_gbps']:.2f} vs {summary[b]['median_gbps']:.2f} GB/s"
        return ""

    targets = []
    for label, value, want, kind, detail in [
        ("worker cold / Redis", ratio("worker_cold", "redis"), 1.5, ">=", vs("worker_cold", "redis")),
        ("worker cold / pull", ratio("worker_cold", "pull"), 0.9, ">=", vs("worker_cold", "pull")),
        ("memory tier / memcpy", ratio("worker_memory", "memcpy"), 0.5, ">=", vs("worker_memory", "memcpy")),
        ("worker cold peak RSS / model bytes (default memory tier)",
         summary["worker_cold"]["peak_rss_ratio_max"] if "worker_cold" in summary else None, 1.3, "<=",
         f"+{summary['worker_cold']['peak_rss_above_max'] / MiB:.0f} MiB for {model_bytes / MiB:.0f} MiB, worst round"
         if "worker_cold" in summary else ""),
    ]:
        if value is None:
            verdict, shown = "n/a (a method failed)", "-"
        elif kind == ">=":
            verdict, shown = ("PASS" if value >= want else "BELOW"), floor3(value) + "x"
        else:
            verdict, shown = ("PASS" if value <= want else "BELOW"), ceil3(value) + "x"
        targets.append({"target": label, "value": value, "want": f"{kind} {want}", "verdict": verdict, "detail": detail})
        targets[-1]["shown"] = shown

    print()
    print("ratios of median throughput (and peak RSS), unrounded verdicts; values shown truncated toward the target's failing side")
    print("peak RSS of each method above its child's baseline, worst round, / model bytes: " + ", ".join(
        f"{row.replace('_', ' ')} {ceil3(s['peak_rss_ratio_max'])}x" for row, s in summary.items() if row != "memcpy_fresh"))
    info = ratio("worker_memory", "memcpy_fresh")
    if info is not None:
        print(f"info (no target): memory tier / memcpy into fresh tensors (first touch) = {floor3(info)}x")
    print()
    print("targets")
    for target in targets:
        print(f"  {target['target']:57s} {target['shown']:>7s}  target {target['want']:>7s}x  {target['verdict']:5s}  "
              f"({target['detail']})")
    bad_exact = {row: v for row, v in exact.items() if v != "ok"}
    if bad_exact:
        print(f"  bit-exactness FAILED: {bad_exact}")
    for e in errors:
        print(f"  round {e['round']} {e['kind']} failed: {e['error']}")
    print(f"total wall time {time.perf_counter() - t_start:.0f} s")

    if args.json is not None:
        args.json.write_text(json.dumps({
            "model_bytes": model_bytes, "mib": args.mib, "rounds": args.rounds, "chunk_size": chunk_size,
            "replication": pushed.replication, "write_quorum": pushed.write_quorum, "server_args": args.server_arg,
            "push_seconds": push_s, "cores": cores, "summary": summary, "targets": targets,
            "measurements": measurements, "errors": errors,
        }, indent=2))
        print(f"wrote {args.json}")
    return 1 if errors or bad_exact else 0


if __name__ == "__main__":
    sys.exit(main())
