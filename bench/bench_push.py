#!/usr/bin/env python
"""Push vs pipelined Redis SET vs safetensors save + fsync, with server CPU and peak client RSS (issue #12).

    .venv/bin/python bench/bench_push.py [--mib 512] [--big-mib 2048] [--rounds 4] [--dir DIR] [--json FILE]
                                         [--server-arg=--cache-mb=1024 ...]

One run. The parent writes a synthetic bf16 model of --mib MiB (chunking.synthetic, seed 0) to a
raw source file, then measures, each in a fresh child process of this script, every round:

  1. push, fsync on: ``paramserver.client.push.push(seed, state, model=..., tag=..., token=...)``
     into a FRESH default local cluster (deploy.local: 3 servers, R=3, W=2, the servers' own
     defaults, i.e. fsync on; plus any --server-arg), started for this one measurement in its own
     folder (no dedup, no scrub backlog, no dirty pages of an earlier round) and stopped after it;
  2. push, no fsync: the same with every server started with ``--no-fsync`` (whose chunk writes then
     go through the page cache, ``--direct-writes auto``; fsync on writes around it, O_DIRECT);
  3. Redis SET: redis-py with the hiredis parser, SET pipelined 32 at a time into a fresh
     redis-server (deploy.redis_baseline: no persistence, one copy), of the same 256 KiB chunks
     (``chunking.pack.pack`` with ChunkingConfig(): keys = the content ids, values = the raw
     chunk bytes; both computed before the clock, values as views into the mapped model where a
     chunk lies inside one tensor) - the strict baseline;
  4. safetensors: ``safetensors.torch.save_file(state, path)`` + fsync of the file, on local disk.

Rounds run the four in orders from a balanced (Williams) design (over every 4 rounds each runs in
each position and right after each other one once: bench.measure.balanced_orders); figures are medians over rounds and
throughput is model bytes / seconds. Then, once (not rotated), a push of a --big-mib MiB model
(seed 1) into a fresh default cluster, for its peak client RSS (0 skips it).

Each child maps the source file before anything is timed: one ``np.memmap(mode="c")`` per
tensor (MAP_PRIVATE, file-backed, never written), wrapped with ``torch.from_numpy`` and viewed as
bf16, and reads one byte of every page so that the model's pages are resident - as file-backed
pages (RssFile), not anonymous memory. Peak RSS: the child's BASELINE is its VmRSS after its
imports (torch, numpy, the paramserver client / redis / safetensors modules) and after the model
is mapped and its pages touched - so the baseline includes the whole model as file-backed
resident pages. A push child takes it before any connection to the cluster (channels, threads and
connecting are the push's own); the Redis child after its pack (ids), its chunk views and its
connection (PING). The child then resets the
kernel's high-water mark (/proc/self/clear_refs), runs the timed operation and reads VmHWM; the
figure is VmHWM - baseline: what the operation itself added (its buffers, copies, gRPC channels,
threads), worst over rounds.

CPU per byte: client = the child's own user + system CPU (getrusage, all its threads) across the
timed operation; server = the sum over the 3 paramserver processes (or the redis-server) of the
utime + stime deltas in /proc/PID/stat, read by the child right before and right after the timed
operation; both divided by the model's bytes (ns/B). For the push that is up to the moment
push() returns (W=2 acks per chunk + commit): work a replica does after that is not counted.

Every push is checked bit-exact after its timing and RSS reading: pulled back with
``paramserver.client.pull.pull_tensors`` and compared byte for byte with the source, the 2 GiB one
too; the Redis row checks DBSIZE and the stored byte count, the safetensors row reads its file back
and compares. Failures of one measurement (a push that raises, a cluster that does not start, a
child that times out) are reported with their error and the run goes on; the exit status is 1 if
any measurement failed or any check was not bit-exact. Every cluster and redis-server is stopped
after its measurement and on SIGTERM / Ctrl-C. Compare figures within one run only: the machine is
shared and noisy.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import mmap
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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from deploy.local import LocalCluster
    from deploy.redis_baseline import RedisServer

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.measure import (  # noqa: E402 - after the path
    balanced_orders, ceil3, floor3, hwm_bytes, proc_status_kib, reset_hwm, rss_bytes, stat_cpu_s,
)

MiB = 1 << 20
GiB = 1 << 30
MODEL, TAG = "bench", "prod"
REF = f"{MODEL}:{TAG}"
CLUSTER_WAIT_S = 120.0  # a fresh 3-server cluster elects a leader in seconds
BIG_RSS_LIMIT = 1 * GiB  # issue #12: the 2 GiB push keeps client RSS under 1 GiB above the baseline

# Rotated measurements, in round-1 order; "push_big" runs once after the rounds.
KINDS = ("push_fsync", "push_nofsync", "redis", "safetensors")
CHILD_OF = {"push_fsync": "push", "push_nofsync": "push", "push_big": "push", "redis": "redis", "safetensors": "safetensors"}


def row_labels(big_mib: int) -> dict[str, str]:
    return {
        "push_fsync": "push R=3, fsync on (server defaults)",
        "push_nofsync": "push R=3, servers --no-fsync",
        "redis": "Redis SET (hiredis, pipe 32, 1 copy, no persist)",
        "safetensors": "safetensors save_file + fsync (local)",
        "push_big": f"push {big_mib} MiB R=3, fsync on (once)",
    }


def child_timeout_s(mib: int) -> float:
    """Bounded wait for one child: imports, mapping, the timed operation and its check (a pull)."""
    return 90.0 + 0.2 * mib  # 512 MiB: 192 s, 2 GiB: 500 s (the push ran at ~0.05 GB/s before issue #12)


# ----------------------------------------------------------------------------------- measuring

def rss_parts() -> dict[str, int]:
    return {"rss": rss_bytes(), "anon": proc_status_kib("RssAnon") * 1024, "file": proc_status_kib("RssFile") * 1024}


def proc_cpu_s(pids: list[int]) -> tuple[float, list[int]]:
    """Sum of utime + stime (all threads) of ``pids`` from /proc/PID/stat, and the pids that are gone."""
    total, gone = 0.0, []
    for pid in pids:
        try:
            total += stat_cpu_s(f"/proc/{pid}/stat")
        except OSError:
            gone.append(pid)
    return total, gone


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def timed(fn: Callable[[], Any], baseline: int, server_pids: list[int]) -> dict[str, Any]:
    """Run ``fn()`` once: seconds, peak RSS above ``baseline``, client and server CPU, its result."""
    was_reset = reset_hwm()
    server0, _ = proc_cpu_s(server_pids)
    client0 = self_cpu_s()
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    client1 = self_cpu_s()
    server1, gone = proc_cpu_s(server_pids)
    peak = hwm_bytes() - baseline
    notes = [] if was_reset else ["VmHWM could not be reset: the peak includes the child's earlier work"]
    if gone:
        notes.append(f"server process(es) {gone} were gone after the operation: server CPU is incomplete")
    return {"seconds": seconds, "peak_rss_above": peak, "client_cpu_s": client1 - client0,
            "server_cpu_s": (server1 - server0) if server_pids else None, "notes": notes, "result": result,
            "rss_after": rss_parts()}


# ----------------------------------------------------------------------------------- child side

def map_source(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model as file-backed tensors: one private (copy-on-write) memmap per tensor, every page touched."""
    import numpy as np
    import torch

    out: dict[str, torch.Tensor] = {}
    for t in spec["tensors"]:
        dtype = getattr(torch, t["dtype"])
        if not t["nbytes"]:
            out[t["name"]] = torch.empty(t["shape"], dtype=dtype)
            continue
        arr = np.memmap(spec["source_file"], dtype=np.uint8, mode="c", offset=t["offset"], shape=(t["nbytes"],))
        int(arr[:: mmap.PAGESIZE].sum())  # one read per page: resident, file-backed, counted in the baseline
        out[t["name"]] = torch.from_numpy(arr).view(dtype).reshape(t["shape"])
    return out


def compare(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> str:
    """"ok" when ``got`` has exactly ``want``'s names, dtypes, shapes and bytes; else what differs."""
    import torch

    if set(got) != set(want):
        return f"tensor names differ: {len(set(got) - set(want))} extra, {len(set(want) - set(got))} missing"
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or list(g.shape) != list(w.shape):
            return f"{name}: {g.dtype} {list(g.shape)}, source {w.dtype} {list(w.shape)}"
        if g.device.type != "cpu":
            return f"{name}: on {g.device}, not cpu"
        if not w.numel():
            continue
        a = w.contiguous().reshape(-1).view(torch.uint8)
        b = g.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(a, b):
            return f"{name}: {int((a != b).sum())} of {a.numel()} bytes differ"
    return "ok"


def scalars(obj: Any) -> dict[str, Any]:
    """The plain fields of a report (a dataclass or any object), for the JSON output."""
    items = ({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj)
             else dict(vars(obj)) if hasattr(obj, "__dict__") else {})
    return {k: v for k, v in items.items() if isinstance(v, (bool, int, float, str, type(None)))}


def child_push(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy  # noqa: F401 - loaded (and its memory counted) before the RSS baseline
    import torch  # noqa: F401

    from paramserver.client.pull import pull_tensors
    from paramserver.client.push import push

    state = map_source(spec)
    gc.collect()
    base = rss_parts()
    seed, token = spec["seed"], spec["token"]
    m = timed(lambda: push(seed, state, model=MODEL, tag=TAG, token=token), base["rss"], spec["server_pids"])
    report = m.pop("result")
    notes: list[str] = m.pop("notes")
    rep = scalars(report)
    if rep.get("bytes_total", spec["model_bytes"]) != spec["model_bytes"]:
        notes.append(f"push reported {rep['bytes_total']} model bytes, the source has {spec['model_bytes']}")
    if rep.get("chunks_deduplicated"):
        notes.append(f"{rep['chunks_deduplicated']} chunks were deduplicated: the cluster was not fresh")
    if rep.get("replication", 3) != 3:
        notes.append(f"R={rep['replication']}, not 3")
    if getattr(report, "unreachable", ()):
        notes.append(f"unreachable servers during the push: {', '.join(report.unreachable)}")
    del report
    # Bit-exact check, after the timing and the RSS reading: pull the version back and compare.
    t0 = time.perf_counter()
    try:
        pulled, _ = pull_tensors(seed, REF, token=token)
        exact = compare(state, pulled)
        del pulled
    except Exception as exc:  # noqa: BLE001 - a failed check is reported in the row, the push figure stands
        exact = f"pull for the check failed: {type(exc).__name__}: {exc}"
    return {**m, "baseline": base, "bit_exact": exact, "check_s": time.perf_counter() - t0, "notes": notes, "report": rep}


def child_redis(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy  # noqa: F401 - loaded before the RSS baseline
    import redis
    import redis.utils

    from chunking.config import ChunkingConfig
    from chunking.pack import pack

    state = map_source(spec)
    packed = pack(state, model=MODEL, config=ChunkingConfig())  # content ids: before the clock
    refs = packed.manifest.unique_chunks()
    keys = [ref.id for ref in refs]
    values = [packed.raw_chunk(ref.index).data for ref in refs]  # views into the mapped model (copies at tensor edges)
    raw_bytes = sum(len(v) for v in values)
    r = redis.Redis(host="127.0.0.1", port=spec["redis_port"], socket_timeout=60)
    r.ping()
    depth = spec["pipeline"]
    gc.collect()
    base = rss_parts()

    def set_all() -> None:
        for start in range(0, len(keys), depth):
            pipe = r.pipeline(transaction=False)
            for key, value in zip(keys[start : start + depth], values[start : start + depth]):
                pipe.set(key, value)
            if not all(pipe.execute()):
                raise RuntimeError(f"a SET of the batch at chunk {start} was refused")

    m = timed(set_all, base["rss"], [spec["redis_pid"]])
    m.pop("result")
    notes: list[str] = m.pop("notes")
    if not redis.utils.HIREDIS_AVAILABLE:
        notes.append("hiredis NOT available: redis-py's pure-Python parser was used")
    if raw_bytes != spec["model_bytes"]:
        notes.append(f"the chunks hold {raw_bytes} bytes, the model {spec['model_bytes']}")
    # Check (not timed): every key there, with its bytes.
    stored = 0
    for start in range(0, len(keys), 256):
        pipe = r.pipeline(transaction=False)
        for key in keys[start : start + 256]:
            pipe.strlen(key)
        stored += sum(int(n) for n in pipe.execute())
    dbsize = int(r.dbsize())
    exact = "ok" if dbsize == len(keys) and stored == raw_bytes else (
        f"redis holds {dbsize} keys / {stored} B, want {len(keys)} / {raw_bytes}")
    r.close()
    return {**m, "baseline": base, "bit_exact": exact, "notes": notes,
            "report": {"chunks": len(keys), "chunk_bytes": raw_bytes, "pipeline": depth, "hiredis": bool(redis.utils.HIREDIS_AVAILABLE)}}


def child_safetensors(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy  # noqa: F401 - loaded before the RSS baseline
    import safetensors.torch

    state = map_source(spec)
    path = spec["out_file"]
    gc.collect()
    base = rss_parts()
    parts: dict[str, float] = {}

    def save() -> None:
        t0 = time.perf_counter()
        safetensors.torch.save_file(state, path)
        parts["save_s"] = time.perf_counter() - t0
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        parts["fsync_s"] = time.perf_counter() - t0 - parts["save_s"]

    m = timed(save, base["rss"], [])
    m.pop("result")
    notes: list[str] = m.pop("notes")
    try:
        exact = compare(state, safetensors.torch.load_file(path))
    except Exception as exc:  # noqa: BLE001 - reported in the row
        exact = f"reading the file back failed: {type(exc).__name__}: {exc}"
    return {**m, "baseline": base, "bit_exact": exact, "notes": notes,
            "report": {**parts, "file_bytes": os.path.getsize(path)}}


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "push": child_push, "redis": child_redis, "safetensors": child_safetensors}


def child_main(kind: str, spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result: dict[str, Any] = {"ok": True, **CHILDREN[kind](spec), "pid": os.getpid()}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which goes on with the other measurements
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out_path).write_text(json.dumps(result))
    return 0 if result["ok"] else 1


# ----------------------------------------------------------------------------------- parent side

class Terminated(BaseException):
    """SIGTERM: unwinds through every finally (clusters and Redis stopped)."""


def on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def run_child(kind: str, spec: dict[str, Any], mdir: Path, timeout: float) -> dict[str, Any]:
    spec_path, out = mdir / "spec.json", mdir / "result.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-spec", str(spec_path), "--child-out", str(out)]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:  # subprocess.run kills the child on a timeout and on any exception here (SIGTERM, Ctrl-C)
        proc = subprocess.run(cmd, env=env, cwd=str(REPO), timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        return {"ok": False, "error": f"child timed out after {timeout:.0f} s (killed)",
                "traceback": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    if not out.exists():
        return {"ok": False, "error": f"child exited {proc.returncode} without a result", "traceback": (proc.stdout + proc.stderr)[-4000:]}
    result: dict[str, Any] = json.loads(out.read_text())
    if proc.stderr.strip():
        result["stderr"] = proc.stderr[-2000:]
    return result


def write_source(state: dict[str, torch.Tensor], path: Path) -> tuple[list[dict[str, Any]], int]:
    """Tensors in name order, raw, back to back; their index (name, dtype, shape, offset, nbytes)."""
    import torch

    index, offset = [], 0
    with open(path, "wb") as f:
        for name in sorted(state):
            t = state[name]
            nbytes = t.numel() * t.element_size()
            index.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                          "offset": offset, "nbytes": nbytes})
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            offset += nbytes
        f.flush()
        os.fsync(f.fileno())
    return index, offset


def make_source(mib: int, seed: int, path: Path) -> dict[str, Any]:
    import torch

    from chunking.synthetic import synthetic_state_dict

    t0 = time.perf_counter()
    state = synthetic_state_dict(mib * MiB, dtype=torch.bfloat16, seed=seed)
    index, nbytes = write_source(state, path)
    n = len(state)
    del state
    gc.collect()
    print(f"model {path.name}: {n} bf16 tensors, {nbytes / MiB:.1f} MiB ({nbytes} bytes), written in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return {"source_file": str(path), "tensors": index, "model_bytes": nbytes}


class Bench:
    """The measurements of one run; every cluster / redis-server it starts is stopped by ``close``."""

    def __init__(self, root: Path, server_args: list[str], pipeline: int) -> None:
        self.root = root
        self.server_args = server_args
        self.pipeline = pipeline
        self.live_clusters: list[LocalCluster] = []
        self.live_redis: list[RedisServer] = []
        self.keep = False  # keep the working folder (logs of a failed measurement)

    def close(self) -> None:
        for server in list(self.live_redis):
            server.stop()
        for cluster in list(self.live_clusters):
            cluster.down()
        self.live_redis.clear()
        self.live_clusters.clear()

    def measure(self, row: str, label: str, source: dict[str, Any], mib: int) -> dict[str, Any]:
        mdir = self.root / f"{label}-{row}"
        mdir.mkdir()
        os.sync()  # no writeback of an earlier measurement (or of the source) inside this one
        try:
            if row.startswith("push"):
                return self._push(row, mdir, source, mib)
            if row == "redis":
                return self._redis(mdir, source, mib)
            return run_child("safetensors", {**source, "out_file": str(mdir / "model.safetensors")}, mdir, child_timeout_s(mib))
        finally:
            for leftover in ("model.safetensors", "cluster"):
                p = mdir / leftover
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.exists():
                    p.unlink()

    def _push(self, row: str, mdir: Path, source: dict[str, Any], mib: int) -> dict[str, Any]:
        from deploy.local import LauncherError, LocalCluster, LocalClusterConfig

        extra = tuple(self.server_args) + (("--no-fsync",) if row == "push_nofsync" else ())
        cluster = LocalCluster(LocalClusterConfig(root=mdir / "cluster", servers=3, extra_args=extra))
        self.live_clusters.append(cluster)
        result: dict[str, Any] = {"ok": False, "error": "not run"}
        try:
            t0 = time.perf_counter()
            try:
                cluster.up(wait=CLUSTER_WAIT_S)
            except LauncherError as exc:
                result = {"ok": False, "error": f"the fresh cluster did not start: {exc}", "traceback": ""}
                return result
            up_s = time.perf_counter() - t0
            spec = {**source, "seed": cluster.seed, "token": cluster.config.admin_token,
                    "server_pids": [s.pid for s in cluster.slots if s.pid]}
            result = run_child("push", spec, mdir, child_timeout_s(mib))
            result["cluster_up_s"] = up_s
            result["server_args"] = list(extra)
            gone = sorted({s.server_id for s in cluster.slots} - set(cluster.running()))
            if gone:
                note = f"server(s) {', '.join(gone)} had exited by the end of the measurement"
                result.setdefault("notes", []).append(note)
                if not result.get("ok"):
                    result["error"] += f" ({note})"
            return result
        finally:
            cluster.down()
            self.live_clusters.remove(cluster)
            if not result.get("ok") or result.get("bit_exact") != "ok":
                self.keep = True  # the servers' logs stay under the working folder
                logs = self.root / "logs"
                logs.mkdir(exist_ok=True)
                for log in (mdir / "cluster").glob("*.log"):
                    shutil.copy(log, logs / f"{mdir.name}-{log.name}")

    def _redis(self, mdir: Path, source: dict[str, Any], mib: int) -> dict[str, Any]:
        from deploy.redis_baseline import RedisServer

        try:
            server = RedisServer(mdir)  # a fresh redis-server per round: empty, no persistence
        except SystemExit as exc:  # not installed
            return {"ok": False, "error": str(exc), "traceback": ""}
        self.live_redis.append(server)
        try:
            try:
                server.client().close()  # up and answering
            except SystemExit as exc:
                return {"ok": False, "error": str(exc), "traceback": ""}
            spec = {**source, "redis_port": server.port, "redis_pid": server.proc.pid, "pipeline": self.pipeline}
            return run_child("redis", spec, mdir, child_timeout_s(mib))
        finally:
            server.stop()
            self.live_redis.remove(server)


def ns_per_b(seconds: float | None, nbytes: int) -> float | None:
    return None if seconds is None else seconds * 1e9 / nbytes


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="model size in MiB, bf16, for the rotated rows (default 512)")
    p.add_argument("--big-mib", type=int, default=2048, help="size of the once-only push for peak client RSS (default 2048; 0 skips it)")
    p.add_argument("--rounds", type=int, default=4, help="rounds; every rotated method once per round, balanced order (default 4)")
    p.add_argument("--dir", type=Path, default=None, help="parent folder for the run's working folder (default: the system temp dir)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every measurement to FILE as JSON")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every 'paramserver serve' of every cluster (repeatable, e.g. --server-arg=--cache-mb=1024); "
                        "default: none, the servers' own defaults")
    p.add_argument("--pipeline", type=int, default=32, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--child-spec", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args.child, args.child_spec, args.child_out)
    if args.rounds < 1 or args.mib < 1 or args.big_mib < 0 or args.pipeline < 1:
        p.error("--rounds and --mib must be >= 1, --big-mib >= 0")

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return run(args)
    except Terminated:
        print("bench_push: terminated (SIGTERM); clusters and redis-server stopped", file=sys.stderr)
        return 143


def run(args: argparse.Namespace) -> int:
    import torch

    t_start = time.perf_counter()
    load0 = os.getloadavg()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-push-", dir=args.dir))
    labels = row_labels(args.big_mib)
    bench = Bench(root, list(args.server_arg), args.pipeline)
    measurements: dict[str, list[dict[str, Any]]] = {row: [] for row in labels}
    errors: list[dict[str, Any]] = []
    failed = False
    model_bytes = big_bytes = 0

    def record(row: str, label: str, result: dict[str, Any], nbytes: int) -> None:
        if not result.get("ok"):
            errors.append({"row": row, "round": label, **result})
            tail = result.get("traceback", "")[-2500:]  # the whole of it goes to --json
            print(f"{label}: {labels[row]}: FAILED: {result['error']}\n{tail}".rstrip(), flush=True)
            return
        result["row"], result["round"] = row, label
        measurements[row].append(result)
        srv = ns_per_b(result["server_cpu_s"], nbytes)
        print(f"{label}: {labels[row]}: {result['seconds']:.3f} s, {nbytes / result['seconds'] / 1e9:.3f} GB/s, "
              f"CPU/B server {'-' if srv is None else f'{srv:.2f}'} ns, client {ns_per_b(result['client_cpu_s'], nbytes):.2f} ns, "
              f"peak RSS +{result['peak_rss_above'] / MiB:.0f} MiB (baseline {result['baseline']['rss'] / MiB:.0f} MiB, of which "
              f"{result['baseline']['file'] / MiB:.0f} file-backed); bit-exact: {result['bit_exact']}"
              f"{'; ' + '; '.join(result['notes']) if result.get('notes') else ''}", flush=True)

    try:
        source = make_source(args.mib, 0, root / "source.bin")
        model_bytes = source["model_bytes"]
        print(f"working folder {root}; every push into a fresh 3-server cluster"
              f"{' (server args: ' + ' '.join(args.server_arg) + ')' if args.server_arg else ' (server defaults)'}", flush=True)
        for round_no, order in enumerate(balanced_orders(KINDS, args.rounds)):
            for row in order:
                label = f"round {round_no + 1}"
                record(row, label, bench.measure(row, f"r{round_no + 1}", source, args.mib), model_bytes)
        (root / "source.bin").unlink()
        if args.big_mib:
            big_source = make_source(args.big_mib, 1, root / "source-big.bin")
            big_bytes = big_source["model_bytes"]
            record("push_big", "once", bench.measure("push_big", "big", big_source, args.big_mib), big_bytes)
            (root / "source-big.bin").unlink()
    except BaseException:
        failed = True
        raise
    finally:
        bench.close()
        if failed or bench.keep:
            for model_file in root.glob("source*.bin"):
                model_file.unlink()
            print(f"working folder kept for the logs: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    # ------------------------------------------------------------------------- summary
    summary: dict[str, dict[str, Any]] = {}
    for row, ms in measurements.items():
        if not ms:
            continue
        nbytes = big_bytes if row == "push_big" else model_bytes
        med = statistics.median(m["seconds"] for m in ms)
        srv = [m["server_cpu_s"] for m in ms if m["server_cpu_s"] is not None]
        bad = [m["bit_exact"] for m in ms if m["bit_exact"] != "ok"]
        summary[row] = {
            "model_bytes": nbytes, "seconds": [m["seconds"] for m in ms], "median_s": med, "median_gbps": nbytes / med / 1e9,
            "server_cpu_ns_per_b": statistics.median(srv) * 1e9 / nbytes if srv else None,
            "client_cpu_ns_per_b": statistics.median(m["client_cpu_s"] for m in ms) * 1e9 / nbytes,
            "peak_rss_above_max": max(m["peak_rss_above"] for m in ms),
            "baseline_rss": max(m["baseline"]["rss"] for m in ms),
            "bit_exact": "ok" if not bad else bad[0], "runs": len(ms),
        }

    cores = os.cpu_count() or 1
    print()
    print(f"bench_push: {model_bytes / MiB:.0f} MiB bf16 model, 256 KiB chunks, fresh 3-server cluster per push (R=3, W=2), "
          f"{args.rounds} rounds (balanced order){f', then {big_bytes / MiB:.0f} MiB once' if big_bytes else ''}; {cores} cores, "
          f"load {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; torch {torch.__version__}, Python {platform.python_version()}")
    if not any(a.startswith(("--direct-writes", "--config")) for a in args.server_arg):
        print("servers' chunk writes: --direct-writes auto = around the page cache (O_DIRECT) with fsync, through it with --no-fsync")
    w = max(len(v) for v in labels.values())
    head = (f"{'method':{w}s}  {'s per round':>23s}  {'median s':>8s}  {'GB/s':>6s}  {'srv ns/B':>8s}  {'cli ns/B':>8s}  "
            f"{'peak RSS +base':>14s}  bit-exact")
    print(head)
    print("-" * len(head))
    for row, label in labels.items():
        if row == "push_big" and not args.big_mib:
            continue
        s = summary.get(row)
        if s is None:
            print(f"{label:{w}s}  {'FAILED':>23s}")
            continue
        per_round = " ".join(f"{x:.3f}" for x in s["seconds"])
        srv_ns = "-" if s["server_cpu_ns_per_b"] is None else f"{s['server_cpu_ns_per_b']:.2f}"
        print(f"{label:{w}s}  {per_round:>23s}  {s['median_s']:8.3f}  {s['median_gbps']:6.3f}  {srv_ns:>8s}  "
              f"{s['client_cpu_ns_per_b']:8.2f}  {s['peak_rss_above_max'] / MiB:10.0f} MiB  {s['bit_exact']}")

    def ratio(a: str, b: str) -> float | None:
        """Median throughput of a / median throughput of b (same model bytes)."""
        if a in summary and b in summary:
            return float(summary[b]["median_s"] / summary[a]["median_s"])
        return None

    def vs(a: str, b: str) -> str:
        if a in summary and b in summary:
            return f"{summary[a]['median_gbps']:.3f} vs {summary[b]['median_gbps']:.3f} GB/s"
        return ""

    big = summary.get("push_big")
    checks: list[tuple[str, float | None, float, str, str, str]] = [
        ("push (fsync on) / Redis SET", ratio("push_fsync", "redis"), 1.0, ">=", "x", vs("push_fsync", "redis")),
        ("push (--no-fsync) / Redis SET", ratio("push_nofsync", "redis"), 1.5, ">=", "x", vs("push_nofsync", "redis")),
    ]
    if args.big_mib:
        checks.append((f"push {args.big_mib} MiB: peak client RSS above baseline", big["peak_rss_above_max"] / GiB if big else None,
                       BIG_RSS_LIMIT / GiB, "<", " GiB",
                       f"+{big['peak_rss_above_max'] / MiB:.0f} MiB over a {big['baseline_rss'] / MiB:.0f} MiB baseline "
                       f"that holds the mapped model" if big else ""))
    targets: list[dict[str, Any]] = []
    for name, value, want, op, unit, detail in checks:
        if value is None:
            verdict, shown = "n/a (a measurement failed)", "-"
        elif op == ">=":
            verdict, shown = ("PASS" if value >= want else "BELOW"), floor3(value) + unit
        else:
            verdict, shown = ("PASS" if value < want else "BELOW"), ceil3(value) + unit
        targets.append({"target": name, "value": value, "want": f"{op} {want:g}{unit}", "verdict": verdict, "shown": shown,
                        "detail": detail})

    print()
    print("ratios of median throughput (model bytes / s), unrounded verdicts; values shown truncated toward the target's failing side")
    for name, a, b in (("push (fsync on) / safetensors save + fsync", "push_fsync", "safetensors"),
                       ("push (--no-fsync) / safetensors save + fsync", "push_nofsync", "safetensors")):
        value = ratio(a, b)
        if value is not None:
            print(f"info (no target): {name} = {floor3(value)}x ({vs(a, b)})")
    for row in ("push_fsync", "push_nofsync"):
        if row in summary:
            print(f"info (no target): {labels[row]}: peak client RSS +{summary[row]['peak_rss_above_max'] / MiB:.0f} MiB "
                  f"for {model_bytes / MiB:.0f} MiB, worst round")
    print()
    print("targets")
    for t in targets:
        print(f"  {t['target']:52s} {t['shown']:>10s}  target {t['want']:>7s}  {t['verdict']:5s}"
              f"{'  (' + t['detail'] + ')' if t['detail'] else ''}")
    bad_exact = {f"{m['round']} {m['row']}": m["bit_exact"] for ms in measurements.values() for m in ms if m["bit_exact"] != "ok"}
    if bad_exact:
        print(f"  bit-exactness FAILED: {bad_exact}")
    for e in errors:
        print(f"  {e['round']} {e['row']} failed: {e['error']}")
    print(f"total wall time {time.perf_counter() - t_start:.0f} s")

    if args.json is not None:
        args.json.write_text(json.dumps({
            "model_bytes": model_bytes, "big_model_bytes": big_bytes, "mib": args.mib, "big_mib": args.big_mib,
            "rounds": args.rounds, "server_args": args.server_arg, "pipeline": args.pipeline, "cores": cores,
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "summary": summary, "targets": targets,
            "measurements": measurements, "errors": errors, "wall_s": time.perf_counter() - t_start,
        }, indent=2))
        print(f"wrote {args.json}")
    return 1 if errors or bad_exact else 0


if __name__ == "__main__":
    sys.exit(main())
