#!/usr/bin/env python
"""One-GPU check of the worker's CUDA path, one table (issue #16).

    .venv/bin/python bench/gpu_check.py [--gib 2.0] [--rounds 3] [--dir DIR] [--json FILE]

Starts a local 3-server cluster on this machine (deploy.local, its defaults), pushes a synthetic
bf16 model of --gib GiB (chunking.synthetic) and a small torch.nn module's state dict, then, on
cuda:0 (or on cpu when this machine has no CUDA device: "no CUDA device: GPU rows skipped"):

  1. the real CLI, ``python -m worker load MODEL:TAG --cluster ... --device DEV --json``, once,
     for its exit code; then ``worker.loader.start_load`` (what ``load`` runs) into DEV through a
     fresh ``TieredCache``, compared bit for bit with the source on DEV (source tensors moved to
     DEV, ``torch.equal`` on uint8 views);
  2. memory-tier -> DEV GB/s: loads through the same, now warm, TieredCache, next to a plain torch
     copy of the same bytes into preallocated DEV tensors (on CUDA: pinned host tensors,
     ``copy_(non_blocking=True)``, synchronize; on CPU: ``copy_`` into touched tensors) and, on
     CUDA, ``safetensors.torch.load_file(path, device="cuda:0")`` from a warm page cache; --rounds
     rounds in rotating order, medians; memory tier / pinned copy against the >= 0.7x target
     (PASS/BELOW, GPU only; on CPU the ratio is shown for information);
  3. time to first tensor: ``start_load`` then ``handle.wait(first tensor)`` vs ``handle.result()``,
     how many tensors were still loading when the first was handed out, and that tensor's bytes
     as they were at that moment (a copy taken right after ``wait``) compared with the source;
  4. ``load_into`` of a module built on the meta device, then a forward pass on DEV compared with
     the same module on CPU (and its state dict compared bit for bit);
  5. peak pinned host memory over the worker's loads (``torch.cuda.host_memory_stats``), and what
     the worker's StagingPool allocated.

Exit status: 0 when every check holds (a BELOW ratio is a figure, not a failed check); 1 when a
check fails (bytes differ, forward mismatch, CLI exit != 0, a load raised or timed out) or the
set-up failed. Every wait is bounded; the cluster is stopped at the end whatever happens.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MiB = 1 << 20
GiB = 1 << 30
MODEL, TAG = "gpucheck", "prod"
REF = f"{MODEL}:{TAG}"
MLP_MODEL = "gpucheck-mlp"
MLP_REF = f"{MLP_MODEL}:{TAG}"
TARGET_RATIO = 0.7  # memory tier -> GPU vs pinned copy_

CLUSTER_UP_S = 120.0
CLI_TIMEOUT_S = 180.0
LOAD_TIMEOUT_S = 180.0  # one load of the model (cold, from the network) or one load_into
WAIT_TIMEOUT_S = 120.0  # handle.wait(first tensor)


# ----------------------------------------------------------------------------------- helpers

class Report:
    """Rows of the table, the checks among them, and everything measured (for --json)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}

    def row(self, what: str, device: str, result: str, verdict: str, **extra: Any) -> None:
        self.rows.append({"what": what, "device": device, "result": result, "verdict": verdict, **extra})
        print(f"  [{verdict}] {what}: {result}", flush=True)

    def check(self, what: str, device: str, ok: bool, result: str, **extra: Any) -> bool:
        self.row(what, device, result, "OK" if ok else "FAIL", check=True, **extra)
        return ok

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["verdict"] == "FAIL"]


def u8(t: Any) -> Any:
    """Flat uint8 view of a tensor's bytes (any dtype; 0-d and empty included)."""
    import torch

    t = t.detach()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.contiguous().reshape(-1).view(torch.uint8)


def compare_one(name: str, want: Any, got: Any, device: Any) -> str | None:
    """None when ``got`` (on ``device``) has ``want``'s dtype, shape and bytes; else what differs."""
    import torch

    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{name}: {got.dtype} {list(got.shape)}, source {want.dtype} {list(want.shape)}"
    if got.device != device:
        return f"{name}: on {got.device}, not {device}"
    w, g = u8(want.to(device)), u8(got)  # the comparison runs on the device
    if not torch.equal(w, g):
        return f"{name}: {int((w != g).sum())} of {w.numel()} bytes differ"
    return None


def compare(source: dict[str, Any], tensors: dict[str, Any], device: Any) -> str:
    """"ok" when ``tensors`` are the source's, bit for bit, on ``device``; else the first difference."""
    if set(tensors) != set(source):
        return (f"tensor names differ: {len(set(tensors) - set(source))} extra, "
                f"{len(set(source) - set(tensors))} missing")
    for name in sorted(source):
        bad = compare_one(name, source[name], tensors[name], device)
        if bad is not None:
            return bad
    return "ok"


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` in a daemon thread, waited for at most ``timeout`` seconds (then TimeoutError)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=run, name=f"gpu-check-{what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{what} not finished after {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def staging_of(handle: Any) -> dict[str, Any] | None:
    """What the load's StagingPool allocated (None: the load used none, as on CPU)."""
    pool = getattr(getattr(getattr(handle, "prefetcher", None), "writer", None), "pool", None)
    if pool is None:
        return None
    return {"buffers": int(pool.allocated), "count": int(pool.count), "buffer_bytes": int(pool.buffer_bytes),
            "bytes": int(pool.allocated) * int(pool.buffer_bytes), "pinned": bool(pool.pinned),
            "acquire_waits": int(pool.acquire_waits)}


def host_stats() -> dict[str, Any] | None:
    """torch's pinned host allocator statistics, where this torch (with CUDA) has them."""
    import torch

    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        return dict(torch.cuda.host_memory_stats())
    except Exception:  # noqa: BLE001 - older torch, or no CUDA host allocator
        return None


def stat(stats: dict[str, Any] | None, what: str, kind: str) -> int | None:
    """``allocated_bytes.peak`` and the like, tolerating other torch versions' key spellings."""
    if not stats:
        return None
    for key, value in stats.items():
        if what in key and key.endswith("." + kind) and isinstance(value, (int, float)):
            return int(value)
    return None


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def build_mlp() -> Any:
    """The small module of check 4: Linear, LayerNorm and BatchNorm1d (persistent buffers), GELU."""
    import torch

    nn = torch.nn
    return nn.Sequential(
        nn.Linear(256, 1024), nn.LayerNorm(1024), nn.GELU(),
        nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.GELU(),
        nn.Linear(1024, 64),
    )


def machine_line(device: Any) -> str:
    import torch

    cores = os.cpu_count() or 1
    base = f"torch {torch.__version__}, Python {platform.python_version()}, {cores} cores"
    if device.type != "cuda":
        return f"machine: no CUDA device ({base}, CUDA build: {torch.version.cuda or 'none'})"
    props = torch.cuda.get_device_properties(device)
    return (f"machine: {torch.cuda.get_device_name(device)} ({device}, {props.total_memory / GiB:.0f} GiB, "
            f"sm_{props.major}{props.minor}), CUDA {torch.version.cuda}, {base}")


# ----------------------------------------------------------------------------------- the checks

class Run:
    def __init__(self, args: argparse.Namespace, device: Any, rep: Report) -> None:
        self.args = args
        self.device = device
        self.dev = str(device)
        self.cuda = device.type == "cuda"
        self.rep = rep
        self.source: dict[str, Any] = {}
        self.model_bytes = 0
        self.seed = ""
        self.cluster_root: Path | None = None
        self.staging: list[dict[str, Any]] = []

    # ---- 1. the CLI
    def cli(self, client_config: Path) -> None:
        cmd = [sys.executable, "-m", "worker", "load", REF, "--cluster", self.seed, "--device", self.dev,
               "--json", "--no-progress"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}  # this cluster only
        env["PARAMS_CONFIG"] = str(client_config)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        shown = f"python -m worker load {REF} --cluster ... --device {self.dev} --json"
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.rep.check(f"CLI: {shown}", self.dev, False, f"timed out after {CLI_TIMEOUT_S:.0f} s")
            return
        wall = time.perf_counter() - t0
        report: dict[str, Any] | None = None
        for line in reversed(proc.stdout.strip().splitlines()):
            try:
                report = json.loads(line)
                break
            except ValueError:
                continue
        self.rep.data["cli"] = {"cmd": cmd, "rc": proc.returncode, "wall_s": wall, "report": report,
                                "stderr": proc.stderr[-2000:]}
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            self.rep.check(f"CLI: {shown}", self.dev, False, f"exit {proc.returncode}: {tail}")
            return
        if report is None:
            self.rep.check(f"CLI: {shown}", self.dev, False, "exit 0 but no JSON summary on stdout")
            return
        ok = report.get("bytes_total") == self.model_bytes and report.get("device") == self.dev
        self.rep.check(
            f"CLI: {shown}", self.dev, ok,
            f"exit 0, {fmt_bytes(report.get('bytes_total'))} on {report.get('device')} in {report.get('seconds', 0):.2f} s "
            f"= {report.get('gbps', 0):.2f} GB/s (network {fmt_bytes(report.get('bytes_network'))}); process {wall:.1f} s"
            + ("" if ok else f"; expected {self.model_bytes} bytes on {self.dev}"))

    # ---- 1 + 3: a load through start_load, with time to first tensor
    def timed_load(self, client: Any, cache: Any, label: str, tier: str, host_staging: str = "auto") -> dict[str, Any] | None:
        """start_load, wait(first tensor), result(): timestamps, the tensors' check, the first tensor's.
        ``host_staging``: PrefetchConfig.host_staging (auto: host-staged when the tier holds the model)."""

        from worker.config import PrefetchConfig
        from worker.loader import start_load

        what = f"{label} (start_load, {tier})"
        try:
            t0 = time.perf_counter()
            handle = start_load(client, REF, self.device, cache, config=PrefetchConfig(host_staging=host_staging))
            path = ("host-staged: pinned arena, one copy per tensor" if handle.upload is not None
                    else "staging pool: one copy per chunk")
            what = f"{label} (start_load, {tier}, {path})"
            t_started = time.perf_counter()
            man = handle.manifest
            first = next((t.name for i, t in enumerate(man.tensors) if man.plan.tensor_chunks[i]), man.tensors[0].name)
            early = handle.wait(first, timeout=WAIT_TIMEOUT_S)
            t_first = time.perf_counter()
            pending = len(handle.readiness.pending())
            snapshot = early.clone()  # its bytes at the moment it was handed out (on CUDA: ordered after its copies)
            tensors, report = handle.result(timeout=LOAD_TIMEOUT_S)
            sync(self.device)
            t_end = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - a failed check, reported; the other checks go on
            self.rep.check(f"bit-exact: {what}", self.dev, False, f"{type(exc).__name__}: {exc}")
            return None
        staging = staging_of(handle)
        if staging is not None:
            self.staging.append({"load": label, **staging})
        del handle
        exact = compare(self.source, tensors, self.device)
        src_tier = {"network": report.bytes_network, "memory tier": report.bytes_memory}[tier]
        notes = "" if src_tier == report.bytes_total else f" (only {fmt_bytes(src_tier)} of it from the {tier})"
        self.rep.check(f"bit-exact: {what} vs source", self.dev, exact == "ok",
                       f"{len(tensors)} tensors, {fmt_bytes(report.bytes_total)}, torch.equal on uint8 views on {self.dev}: "
                       f"{exact}; {report.seconds:.3f} s = {report.gbps:.2f} GB/s{notes}",
                       detail=exact)
        early_exact = compare_one(first, self.source[first], snapshot, self.device)
        n = len(tensors)
        before_end = pending > 0 and t_first < t_end
        self.rep.check(
            f"time to first tensor, {label} (its bytes at wait() checked)", self.dev, early_exact is None,
            f"wait({first!r}) at {(t_first - t0) * 1000:.1f} ms, result() at {(t_end - t0) * 1000:.1f} ms; "
            f"{pending} of {n} tensors still loading then -> usable before the end: {'yes' if before_end else 'no'}; "
            f"its bytes at wait(): {'ok' if early_exact is None else early_exact}; loader's time to first tensor "
            + (f"{report.first_tensor_s * 1000:.1f} ms" if report.first_tensor_s is not None else "n/a"))
        result = {"label": label, "tier": tier, "path": path, "first_tensor": first, "start_s": t_started - t0, "first_s": t_first - t0,
                  "end_s": t_end - t0, "pending_at_first": pending, "tensors": n, "usable_before_end": before_end,
                  "first_bit_exact": early_exact is None, "bit_exact": exact, "report": report.to_dict(),
                  "tensors_obj": tensors}
        del snapshot, early
        return result

    # ---- 4. load_into a meta module + forward
    def module_check(self, client: Any, ref_module: Any, state: dict[str, Any]) -> None:
        import torch

        from worker.loader import load_into

        what = f"load_into(meta module) + forward on {self.dev} vs the same module on cpu"
        try:
            with torch.device("meta"):
                module = build_mlp()
            report = bounded(lambda: load_into(module, client, MLP_REF, self.device), LOAD_TIMEOUT_S, "load_into")
            sd = module.state_dict()
            exact = compare(state, {k: v for k, v in sd.items()}, self.device)
            module.eval()
            x = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
            with torch.no_grad():
                want = ref_module(x)
                got = module(x.to(self.device))
                sync(self.device)
                got = got.cpu()
        except Exception as exc:  # noqa: BLE001 - a failed check, reported; the other checks go on
            self.rep.check(f"forward: {what}", self.dev, False, f"{type(exc).__name__}: {exc}")
            return
        # Same device: the same kernels on the same bytes; across devices: fp32 (TF32 off) rounding only.
        rtol, atol = (1e-5, 1e-6) if not self.cuda else (1e-3, 1e-4)
        same = torch.equal(got, want)
        close = same or torch.allclose(got, want, rtol=rtol, atol=atol)
        diff = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
        self.rep.data["module"] = {"bit_exact": exact, "max_abs_diff": diff, "identical": same, "rtol": rtol, "atol": atol,
                                   "report": report.to_dict(), "params": sum(v.numel() for v in state.values())}
        self.rep.check("bit-exact: load_into state dict vs source", self.dev, exact == "ok",
                       f"{len(state)} tensors ({sum(u8(v).numel() for v in state.values()) / MiB:.1f} MiB) on {self.dev}: {exact}",
                       detail=exact)
        self.rep.check(f"forward: {what}", self.dev, close and exact == "ok",
                       f"output {tuple(got.shape)}: {'identical' if same else f'max |diff| {diff:.3g}'} "
                       f"(tolerance rtol {rtol:g}, atol {atol:g}); load {report.seconds * 1000:.1f} ms")

    # ---- 2. memory tier vs a plain copy (and safetensors on CUDA), rotating rounds
    def rounds(self, client: Any, cache: Any, st_path: Path | None) -> dict[str, list[float]]:
        import torch

        from worker.loader import start_load

        dev = self.device
        # The baseline's bytes: on CUDA pinned host tensors, on CPU the source itself (already in memory).
        if self.cuda:
            host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in self.source.items()}
            for k, v in self.source.items():
                host[k].copy_(v)
        else:
            host = self.source
        dst = {k: torch.empty(v.shape, dtype=v.dtype, device=dev) for k, v in self.source.items()}

        def plain_copy() -> None:
            for k, v in host.items():
                dst[k].copy_(v, non_blocking=self.cuda)
            sync(dev)

        plain_copy()  # first touch of the destination, outside the clock
        if compare(self.source, dst, dev) != "ok":
            raise RuntimeError("the baseline copy itself is not bit-exact")
        if st_path is not None:
            with open(st_path, "rb", buffering=0) as f:  # into the page cache, outside the clock
                while f.read(64 * MiB):
                    pass

        tier_notes: list[str] = []

        def memory_tier() -> None:
            handle = start_load(client, REF, dev, cache)
            tensors, report = handle.result(timeout=LOAD_TIMEOUT_S)
            sync(dev)
            if report.bytes_memory != report.bytes_total:
                tier_notes.append(f"{fmt_bytes(report.bytes_total - report.bytes_memory)} not from the memory tier")
            self.rep.data.setdefault("memory_tier_reports", []).append(report.to_dict())
            del tensors, handle

        def safetensors_load() -> None:
            from safetensors.torch import load_file

            out = load_file(str(st_path), device=self.dev)
            sync(dev)
            del out

        methods: dict[str, Callable[[], None]] = {"memory_tier": memory_tier, "pinned_copy" if self.cuda else "copy": plain_copy}
        if st_path is not None:
            methods["safetensors"] = safetensors_load
        times: dict[str, list[float]] = {m: [] for m in methods}
        names = list(methods)
        for r in range(self.args.rounds):
            shift = r % len(names)
            order = names[shift:] + names[:shift]
            for m in order:
                gc.collect()
                t0 = time.perf_counter()
                methods[m]()
                times[m].append(time.perf_counter() - t0)
            print(f"  round {r + 1}: " + ", ".join(f"{m} {times[m][-1]:.3f} s" for m in order), flush=True)
        dst.clear()  # the baseline's tensors (not del: plain_copy's closure holds the names)
        if self.cuda:
            host.clear()  # the pinned copies; on CPU host is the source itself
        self.rep.data["rounds"] = times
        self.rep.data["memory_tier_notes"] = tier_notes
        return times


def profile_load(client: Any, cache: Any, device: Any, out: Path) -> None:
    """One memory-tier load under cProfile (where the time goes between start_load and result())."""
    import cProfile
    import io
    import pstats

    from worker.loader import start_load

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    handle = start_load(client, REF, device, cache)
    t1 = time.perf_counter()
    tensors, _report = handle.result(timeout=LOAD_TIMEOUT_S)
    sync(device)
    prof.disable()
    t2 = time.perf_counter()
    del tensors, handle
    text = io.StringIO()
    text.write(f"start_load {1000 * (t1 - t0):.1f} ms, start_load to result() {1000 * (t2 - t0):.1f} ms (profiled)\n")
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    out.write_text(text.getvalue())
    print(f"profile of one memory-tier load written to {out}", flush=True)


# ----------------------------------------------------------------------------------- table

def print_table(rep: Report, header: list[str]) -> None:
    print()
    for line in header:
        print(line)
    w = max(len(r["what"]) for r in rep.rows) if rep.rows else 10
    dw = max([len(r["device"]) for r in rep.rows] + [6])
    head = f"{'check / measurement':{w}s}  {'device':{dw}s}  {'verdict':7s}  result"
    print(head)
    print("-" * min(160, len(head) + 60))
    for r in rep.rows:
        print(f"{r['what']:{w}s}  {r['device']:{dw}s}  {r['verdict']:7s}  {r['result']}")


# ----------------------------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="model size in GiB, bf16 (default 2.0)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the GB/s comparison, rotating order (default 3)")
    p.add_argument("--dir", type=Path, default=None,
                   help="parent folder for the run's working folder (default: the system temp dir)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every figure and check to FILE")
    p.add_argument("--profile", type=Path, default=None, metavar="FILE",
                   help="after the rounds, profile one more memory-tier load with cProfile (Python 3.12+ sees the "
                        "load's own threads too; 3.11 only start_load) and write its 40 costliest calls by "
                        "cumulative time to FILE")
    args = p.parse_args()
    if args.rounds < 1 or not args.gib > 0:
        p.error("--rounds must be >= 1 and --gib > 0")

    # SIGTERM (a timeout, a CI cancel) unwinds through the finally below: the cluster stops.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    from chunking.synthetic import synthetic_state_dict
    from deploy.local import LocalCluster, LocalClusterConfig
    from paramserver.client.push import push
    from paramserver.client.session import ClusterClient
    from worker.config import CacheConfig
    from worker.tiered_cache import TieredCache

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0") if cuda else torch.device("cpu")
    rep = Report()
    header = [machine_line(device)]
    print(header[0], flush=True)
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context, outside every clock
        # the forward check compares fp32 with the CPU's: no TF32 in matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        header.append("no CUDA device: GPU rows skipped")
        print(header[-1], flush=True)

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.dir))
    cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3))
    run = Run(args, device, rep)
    client = None
    keep = False
    setup_error: str | None = None
    try:
        # ---- set-up: the source, the cluster, the pushes
        total = int(args.gib * GiB)
        print(f"generating a {args.gib:g} GiB bf16 model ...", flush=True)
        state = synthetic_state_dict(total, dtype=torch.bfloat16, seed=0,
                                     tensor_bytes=min(16 * MiB, max(1 * MiB, total // 32)))
        run.source = state
        run.model_bytes = sum(u8(t).numel() for t in state.values())
        st_path: Path | None = None
        if cuda:
            from safetensors.torch import save_file

            st_path = root / "model.safetensors"
            save_file(state, str(st_path))
        torch.manual_seed(1234)
        ref_module = build_mlp()
        with torch.no_grad():
            bn = ref_module[4]
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.num_batches_tracked.fill_(3)
        ref_module.eval()
        mlp_state = {k: v.detach().clone().contiguous() for k, v in ref_module.state_dict().items()}

        t0 = time.perf_counter()
        cluster.up(wait=CLUSTER_UP_S)
        print(f"cluster up in {time.perf_counter() - t0:.1f} s: {cluster.seed}", flush=True)
        run.seed = cluster.seed
        t0 = time.perf_counter()
        pushed = push(cluster.seed, state, model=MODEL, tag=TAG)
        push_s = time.perf_counter() - t0
        push(cluster.seed, mlp_state, model=MLP_MODEL, tag=TAG)
        model_line = (f"model: {run.model_bytes / GiB:.3f} GiB bf16 ({run.model_bytes} bytes), {len(state)} tensors, "
                      f"{pushed.chunks_unique} chunks; pushed v{pushed.version} in {push_s:.1f} s to 3 servers "
                      f"(R={pushed.replication}, W={pushed.write_quorum}); {args.rounds} rounds, rotating order, medians")
        header.append(model_line)
        print(model_line, flush=True)
        rep.data.update({"model_bytes": run.model_bytes, "tensors": len(state), "chunks": pushed.chunks_unique,
                         "push_seconds": push_s, "replication": pushed.replication, "write_quorum": pushed.write_quorum})

        # ---- 1. the CLI, once
        print("checks:", flush=True)
        run.cli(cluster.client_config_path)

        # ---- 1 + 3 + 4 + 5: the API, through one TieredCache big enough for the model
        client = ClusterClient(cluster.seed)
        cache = TieredCache.from_config(CacheConfig(memory_bytes=max(CacheConfig().memory_bytes, 2 * run.model_bytes + 64 * MiB)))
        before = host_stats()
        if cuda and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        loads = []
        cold = run.timed_load(client, cache, "cold load", "network")
        if cold is not None:
            del cold["tensors_obj"]  # on CPU the memory tier still holds views of them
            loads.append(cold)
        warm = run.timed_load(client, cache, "memory-tier load", "memory tier")
        if warm is not None:
            del warm["tensors_obj"]
            loads.append(warm)
        if cuda:  # the per-chunk path (a model larger than the tier, load_into) on the same bytes
            chunked = run.timed_load(client, cache, "memory-tier load", "memory tier", host_staging="never")
            if chunked is not None:
                del chunked["tensors_obj"]
                loads.append(chunked)
        gc.collect()
        run.module_check(client, ref_module, mlp_state)
        sync(device)
        after = host_stats()
        rep.data["loads"] = loads

        # ---- 5. pinned host memory over the worker's loads (before the baseline pins its own)
        pool = max(run.staging, key=lambda s: s["bytes"]) if run.staging else None
        pool_s = (f"StagingPool {pool['buffers']} of {pool['count']} x {fmt_bytes(pool['buffer_bytes'])} "
                  f"{'pinned' if pool['pinned'] else 'NOT pinned'} = {fmt_bytes(pool['bytes'])}, "
                  f"{pool['acquire_waits']} acquire waits" if pool else "")
        if cuda:
            from paramserver.client.hostmem import default_pool

            peak = stat(after, "allocated_bytes", "peak")
            base = stat(before, "allocated_bytes", "current") or 0
            arenas = default_pool().pinned_bytes()
            rep.data["pinned_arena_bytes"] = arenas
            if peak is not None:
                shown = (f"{fmt_bytes(arenas)} in page-locked host arenas (the memory tier's copy of the model) + "
                         f"{fmt_bytes(peak)} peak from torch's pinned allocator (host_memory_stats allocated_bytes, "
                         f"{fmt_bytes(base)} before the loads); {pool_s or 'no StagingPool seen'}")
            else:
                shown = f"torch.cuda.host_memory_stats not available in torch {torch.__version__}; {pool_s or 'no StagingPool seen'}"
            rep.row("peak pinned host memory over the worker's loads", run.dev, shown, "info")
            rep.row("peak device memory over the worker's loads", run.dev,
                    f"{fmt_bytes(torch.cuda.max_memory_allocated(device))} allocated (torch.cuda.max_memory_allocated) "
                    f"for a {fmt_bytes(run.model_bytes)} model", "info")
            rep.data["pinned"] = {"before": before, "after": after, "peak_bytes": peak}
        else:
            rep.row("pinned host memory", run.dev,
                    "none: without CUDA chunks land straight in host tensors, no StagingPool"
                    + (f" ({pool_s})" if pool else ""), "info")
        rep.data["staging"] = run.staging

        # ---- 2. GB/s, rounds in rotating order
        print(f"rounds ({args.rounds}):", flush=True)
        try:
            times = run.rounds(client, cache, st_path)
        except Exception as exc:  # noqa: BLE001 - a failed check, reported; the other checks go on
            rep.check(f"memory tier -> {run.dev} GB/s rounds", run.dev, False, f"{type(exc).__name__}: {exc}")
            times = {}
        if times:
            med = {m: statistics.median(ts) for m, ts in times.items()}
            each = {m: " ".join(f"{t:.3f}" for t in ts) for m, ts in times.items()}
            notes = rep.data.get("memory_tier_notes") or []
            rep.row(f"memory tier -> {run.dev} (second load, same warm TieredCache)", run.dev,
                    f"{gbps(run.model_bytes, med['memory_tier']):.2f} GB/s, median {med['memory_tier']:.3f} s "
                    f"(rounds: {each['memory_tier']} s; start_load to result(), fresh tensors)"
                    + (f"; {notes[0]}" if notes else ""), "info")
            base_key = "pinned_copy" if cuda else "copy"
            base_label = ("torch pinned host -> preallocated device copy_(non_blocking=True) + synchronize" if cuda
                          else "torch copy_ into preallocated (touched) cpu tensors")
            rep.row(base_label, run.dev, f"{gbps(run.model_bytes, med[base_key]):.2f} GB/s, median {med[base_key]:.3f} s "
                    f"(rounds: {each[base_key]} s)", "info")
            if "safetensors" in med:
                rep.row(f'safetensors.torch.load_file(device="{run.dev}"), page cache warm', run.dev,
                        f"{gbps(run.model_bytes, med['safetensors']):.2f} GB/s, median {med['safetensors']:.3f} s "
                        f"(rounds: {each['safetensors']} s)", "info")
            ratio = med[base_key] / med["memory_tier"]
            if cuda:
                rep.row(f"ratio memory tier / pinned copy (target >= {TARGET_RATIO}x)", run.dev, f"{ratio:.3f}x",
                        "PASS" if ratio >= TARGET_RATIO else "BELOW", ratio=ratio)
                if "safetensors" in med:
                    rep.row("ratio memory tier / safetensors load_file", run.dev,
                            f"{med['safetensors'] / med['memory_tier']:.3f}x", "info")
            else:
                rep.row("ratio memory tier / copy_ (the 0.7x target is for the GPU path)", run.dev, f"{ratio:.3f}x", "info",
                        ratio=ratio)
            rep.data["medians_s"] = med
            rep.data["medians_gbps"] = {m: gbps(run.model_bytes, s) for m, s in med.items()}
            rep.data["ratio_memory_tier_vs_copy"] = ratio
        if args.profile is not None:
            profile_load(client, cache, device, args.profile)
    except BaseException as exc:
        keep = True
        if isinstance(exc, Exception):
            setup_error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        else:
            raise
    finally:
        if client is not None:
            client.close()
        cluster.down()
        if keep:
            print(f"working folder kept for the logs: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    if setup_error is not None:
        rep.check("run (set-up, pushes, checks) raised", str(device), False, setup_error)
    print_table(rep, header)
    failed = rep.failed
    print()
    print(f"{len([r for r in rep.rows if r.get('check')]) - len(failed)} checks OK, {len(failed)} failed; "
          f"total wall time {time.perf_counter() - t_start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "machine": header[0], "cuda": cuda, "device": str(device), "torch": torch.__version__,
            "cuda_version": torch.version.cuda, "gib": args.gib, "rounds": args.rounds, "rows": rep.rows,
            "failed": [r["what"] for r in failed], "ok": not failed, **rep.data,
        }, indent=2, default=str))
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
