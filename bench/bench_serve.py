#!/usr/bin/env python
"""Serving QPS and latency with the result cache off, L1 only, and L1 + Redis, plus a stampede (issue #13).

    .venv/bin/python bench/bench_serve.py [--seconds 10] [--warmup 2] [--rounds 3] [--clients 32] [--keys 10000]
                                          [--zipf 1.1] [--forward-ms 20] [--stampede 200] [--stampede-ttl 2]
                                          [--dir DIR] [--json FILE] [--worker-arg=--max-queue=64 ...]

One run. Starts a local 3-server cluster (deploy.local, secrets generated, scrubbing off, log level
WARNING), pushes ``bench/serve_model.py``'s ``slow_mlp()`` (a 16-wide MLP whose forward pass
sleeps until 20 ms have passed: the sleep stands for GPU time and releases the GIL, so the two CPU
cores are not what is measured) as slow:prod, starts a private redis-server (deploy.redis_baseline),
then, each round, every mode once in an order rotated by one each round:

  off       two ``paramworker serve`` processes with ``--result-cache-mb 0`` (no result cache);
  l1        the same with the default in-process L1 result cache, no Redis;
  l1+redis  the default L1 plus ``--result-cache-redis redis://127.0.0.1:PORT/0`` (one Redis shared
            by both workers).

Every mode-round starts cold: Redis FLUSHALL, two fresh worker processes (same flags otherwise:
``--device cpu --poll-s 0``, the workers' defaults for --max-concurrency, --max-queue and the
cache sizes, plus any --worker-arg). Then --clients client threads in this process (half of them
bound to each worker, one persistent ``http.client.HTTPConnection`` each, closed loop: the next
request leaves when the last answer is in) send ``POST /infer`` for inputs drawn from Zipf(--zipf)
over --keys distinct 16-float inputs (rank 1 the hottest). The first --warmup seconds are not
counted (connections, first requests; the caches begin to fill there, equally for every mode);
the next --seconds are: QPS = 200 answers completed in the window / window, p50 and p99 over
their latencies (client side: send to last byte). A 503 (shed) is counted, not timed; its
client waits Retry-After, at most 0.1 s, before its next request. Forward passes and the server's
own outcome counts come from both workers' GET /metrics read at the window's edges.

Figures per mode are medians over rounds; ratios are of those medians (and per round, paired).
Every answer's output is checked: the same input must get the same output in every mode and
round (cached answers = computed ones), and each input's output equals this process's own
forward pass of the same weights (within 1e-5).

Then the stampede: two fresh workers with L1 + Redis and ``--result-cache-ttl --stampede-ttl``;
the hottest input is requested 3 times from each worker (hot: computed once, hits after), then
left for TTL + 1 s so that it expires in both L1s and in Redis; then --stampede threads (half per
worker, connected beforehand, released by one barrier) send the identical request at once. It
prints the forward passes it caused (both workers' pdparams_forward_total before and after;
target exactly 1), the outcomes, and whether all answers were 200 with identical outputs.

Exit status 1 when a worker failed, requests failed, or an output check failed; a figure below
its target is reported, not an error. Compare figures within one run only: the machine is shared
and noisy (2 cores here: the client threads, the workers' HTTP threads, Redis and the servers
share them).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import http.client
import itertools
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.measure import ceil3, floor3  # noqa: E402 - after the path
from bench.serve_model import FORWARD_MS_ENV, WIDTH  # noqa: E402

if TYPE_CHECKING:
    import redis

MODEL, TAG = "slow", "prod"
REF = f"{MODEL}:{TAG}"
FACTORY = "serve_model:slow_mlp"  # imported by the workers from bench/ (on their PYTHONPATH)
MODES = ("off", "l1", "l1+redis")
MODE_TEXT = {"off": "cache off (--result-cache-mb 0)", "l1": "L1 only (default L1, no Redis)",
             "l1+redis": "L1 + Redis (shared by both workers)"}
OUTCOMES = ("hit_l1", "hit_l2", "joined", "computed")
WORKERS = 2
START_TIMEOUT_S = 120.0
HTTP_TIMEOUT_S = 60.0
RETRY_CAP_S = 0.1
REF_TOLERANCE = 1e-5
REQUIRED_FLAGS = ("--result-cache-mb", "--result-cache-ttl", "--result-cache-redis")
HEADERS = {"Content-Type": "application/json"}


class BenchError(RuntimeError):
    """A worker did not start or answer as the benchmark needs."""


# ----------------------------------------------------------------------------------- workers

class WorkerProc:
    """One ``paramworker serve`` process; its output goes to a log file, its address is read from it."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.cmd = cmd
        self.log_path = log_path
        self.address: str | None = None
        self._ready = threading.Event()
        self._tail: collections.deque[str] = collections.deque(maxlen=30)
        # Its own session: a Ctrl-C reaches the benchmark, which stops the workers in order.
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._drainer = threading.Thread(target=self._drain, name=f"drain-{self.proc.pid}", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "a") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self._tail.append(line.rstrip())
                if self.address is None and line.startswith("LISTENING"):
                    self.address = line.split()[1]
                    self._ready.set()
        self._ready.set()  # end of output: it exited

    def wait_ready(self, timeout: float) -> str:
        self._ready.wait(timeout)
        if self.address is None:
            state = f"exited {self.proc.returncode}" if self.proc.poll() is not None else f"no LISTENING line after {timeout:.0f} s"
            tail = "\n".join(self._tail)
            raise BenchError(f"worker {' '.join(self.cmd[3:])} {state}; log {self.log_path}; last lines:\n{tail}")
        return self.address

    def cpu_s(self) -> float:
        """user + system CPU seconds of the process so far (0 once it has gone)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._drainer.join(timeout=5)


@dataclass
class WorkerPair:
    workers: list[WorkerProc]
    addresses: list[str]
    start_s: float

    def stop(self) -> None:
        for w in self.workers:  # SIGTERM to all first, then wait: they stop in parallel
            if w.proc.poll() is None:
                w.proc.terminate()
        for w in self.workers:
            w.stop()


def worker_env(cluster_config: Path, forward_ms: float) -> dict[str, str]:
    # The cluster and its tokens come from the cluster's client config only, never from this shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}
    env["PARAMS_CONFIG"] = str(cluster_config)
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[FORWARD_MS_ENV] = repr(forward_ms)
    # The L2 key the workers sharing Redis authenticate its entries with (a file only they can read).
    key_file = cluster_config.parent / "result-cache.key"
    if not key_file.exists():
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32).hex().encode())
        os.close(fd)
    env["PARAMS_RESULT_CACHE_KEY_FILE"] = str(key_file)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # the MLP is tiny; one intra-op thread per worker on a small machine
    return env


def mode_args(mode: str, redis_url: str) -> list[str]:
    if mode == "off":
        return ["--result-cache-mb", "0"]
    if mode == "l1":
        return []
    if mode == "l1+redis":
        return ["--result-cache-redis", redis_url]
    raise ValueError(mode)


def start_workers(args: list[str], env: dict[str, str], log_dir: Path, name: str) -> WorkerPair:
    cmd = [sys.executable, "-m", "worker", "serve", "--model", REF, "--factory", FACTORY, "--listen", "127.0.0.1:0",
           "--device", "cpu", "--poll-s", "0", *args]
    t0 = time.perf_counter()
    workers: list[WorkerProc] = []
    try:
        for i in range(WORKERS):
            workers.append(WorkerProc(cmd, env, log_dir / f"{name}-w{i + 1}.log"))
        addresses = [w.wait_ready(START_TIMEOUT_S) for w in workers]
    except BaseException:
        WorkerPair(workers, [], 0.0).stop()
        raise
    pair = WorkerPair(workers, addresses, time.perf_counter() - t0)
    for address in addresses:
        metrics(address)  # /metrics answers before the clock starts (and the metric names are checked)
    return pair


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


# ----------------------------------------------------------------------------------- metrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics(address: str) -> Samples:
    """Every sample of the worker's GET /metrics, by (sample name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection(*split_address(address), timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    if resp.status != 200:
        raise BenchError(f"GET http://{address}/metrics answered {resp.status}: {text[:200]}")
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    if not any(name == "pdparams_forward_total" for name, _ in out):
        raise BenchError(f"GET http://{address}/metrics has no pdparams_forward_total (names: {sorted({n for n, _ in out})[:20]})")
    return out


def sample_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return float(sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls)))


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for (n, ls), v in samples.items():
        if n == name:
            out[dict(ls).get(label, "")] += v
    return dict(out)


def delta(after: list[Samples], before: list[Samples], name: str, **labels: str) -> float:
    return sum(sample_sum(a, name, **labels) - sample_sum(b, name, **labels) for a, b in zip(after, before))


def delta_by_label(after: list[Samples], before: list[Samples], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for a, b in zip(after, before):
        for k, v in by_label(a, name, label).items():
            out[k] += v
        for k, v in by_label(b, name, label).items():
            out[k] -= v
    return {k: v for k, v in out.items() if v}


# ----------------------------------------------------------------------------------- load

def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of an ascending list; nan when empty."""
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


class Workload:
    """The inputs, their request bodies and the Zipf sampler (rank 1 = key 0, the hottest)."""

    def __init__(self, keys: int, s: float, seed: int) -> None:
        rng = random.Random(seed)
        self.inputs = [[round(rng.uniform(-1.0, 1.0), 6) for _ in range(WIDTH)] for _ in range(keys)]
        self.bodies = [json.dumps({"input": [x]}).encode() for x in self.inputs]
        self.cdf: list[float] = list(itertools.accumulate(1.0 / float(rank) ** s for rank in range(1, keys + 1)))
        self.total = self.cdf[-1]

    def sample(self, rng: random.Random) -> int:
        return min(len(self.cdf) - 1, bisect.bisect_left(self.cdf, rng.random() * self.total))

    def mass_of_top(self, n: int) -> float:
        return self.cdf[min(n, len(self.cdf)) - 1] / self.total


@dataclass
class Outputs:
    """First output seen per key, over the whole run; answers that differ from it are counted."""

    first: dict[int, list[Any]] = field(default_factory=dict)
    mismatches: int = 0
    examples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, key: int, output: list[Any], where: str) -> bool:
        seen = self.first.setdefault(key, output)
        if seen is output or seen == output:
            return True
        with self.lock:
            self.mismatches += 1
            if len(self.examples) < 5:
                self.examples.append(f"key {key} ({where}): {output!r:.120} != first {seen!r:.120}")
        return False


@dataclass
class ThreadResult:
    latencies: list[float] = field(default_factory=list)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    shed: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    keepalive: bool | None = None


def client_loop(address: str, work: Workload, outputs: Outputs, seed: int, measure_from: float, stop_at: float,
                where: str, out: ThreadResult) -> None:
    rng = random.Random(seed)
    conn = http.client.HTTPConnection(*split_address(address), timeout=HTTP_TIMEOUT_S)
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            key = work.sample(rng)
            try:
                conn.request("POST", "/infer", body=work.bodies[key], headers=HEADERS)
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.HTTPException, OSError) as exc:
                conn.close()  # the next request() opens a fresh connection
                t1 = time.perf_counter()
                if t1 >= measure_from:
                    out.errors[type(exc).__name__] += 1
                continue
            t1 = time.perf_counter()
            if out.keepalive is None:
                out.keepalive = not resp.will_close
            counted = measure_from <= t1 <= stop_at
            if resp.status == 200:
                try:
                    body = json.loads(data)
                    output = body["output"]
                    outcome = str(body.get("cache", "none"))
                except (ValueError, KeyError, TypeError):
                    if counted:
                        out.errors["bad 200 body"] += 1
                    continue
                outputs.check(key, output, where)
                if counted:
                    out.latencies.append(t1 - t0)
                    out.outcomes[outcome] += 1
            elif resp.status == 503:
                if counted:
                    out.shed += 1
                try:
                    wait = float(resp.getheader("Retry-After") or 0)
                except ValueError:
                    wait = 0.0
                time.sleep(min(RETRY_CAP_S, max(0.0, wait)))
            else:
                if counted:
                    out.errors[f"HTTP {resp.status}"] += 1
    finally:
        conn.close()


def run_load(pair: WorkerPair, work: Workload, outputs: Outputs, clients: int, warmup_s: float, seconds: float,
             seed: int, where: str) -> dict[str, Any]:
    results = [ThreadResult() for _ in range(clients)]
    start = time.perf_counter() + 0.2  # time for the threads to start
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds
    threads = [threading.Thread(target=client_loop, name=f"client-{i}", daemon=True,
                                args=(pair.addresses[i % len(pair.addresses)], work, outputs, seed * 1000 + i,
                                      measure_from, stop_at, where, results[i]))
               for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, measure_from - time.perf_counter()))
    before = [metrics(a) for a in pair.addresses]
    cpu0 = [w.cpu_s() for w in pair.workers]
    client_cpu0, t_before = time.process_time(), time.perf_counter()
    time.sleep(max(0.0, stop_at - time.perf_counter()))
    client_cpu1, t_after = time.process_time(), time.perf_counter()
    cpu1 = [w.cpu_s() for w in pair.workers]
    after = [metrics(a) for a in pair.addresses]
    for t in threads:
        t.join(timeout=HTTP_TIMEOUT_S + 5)
    window = stop_at - measure_from
    lat = sorted(x for r in results for x in r.latencies)
    outcomes: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    for r in results:
        outcomes.update(r.outcomes)
        errors.update(r.errors)
    ok = len(lat)
    forwards = delta(after, before, "pdparams_forward_total")
    cpu_window = t_after - t_before
    return {
        "window_s": window, "ok": ok, "qps": ok / window,
        "p50_ms": percentile(lat, 0.50) * 1000, "p99_ms": percentile(lat, 0.99) * 1000,
        "mean_ms": (statistics.fmean(lat) * 1000) if lat else math.nan, "max_ms": (lat[-1] * 1000) if lat else math.nan,
        "shed": sum(r.shed for r in results), "errors": dict(errors), "outcomes": dict(outcomes),
        "forwards": forwards, "forwards_per_ok": forwards / ok if ok else math.nan,
        "server_outcomes": delta_by_label(after, before, "pdparams_infer_requests_total", "outcome"),
        "server_mean_ms": _server_mean_ms(after, before),
        "l1_bytes_end": sum(sample_sum(a, "pdparams_result_cache_bytes", level="l1") for a in after),
        "client_cpu": (client_cpu1 - client_cpu0) / cpu_window,
        "worker_cpu": [(b - a) / cpu_window for a, b in zip(cpu0, cpu1)],
        "keepalive": all(r.keepalive for r in results if r.keepalive is not None),
        "worker_start_s": pair.start_s,
    }


def _server_mean_ms(after: list[Samples], before: list[Samples]) -> float:
    n = delta(after, before, "pdparams_infer_seconds_count")
    return delta(after, before, "pdparams_infer_seconds_sum") / n * 1000 if n else math.nan


# ----------------------------------------------------------------------------------- stampede

def one_request(address: str, body: bytes) -> dict[str, Any]:
    conn = http.client.HTTPConnection(*split_address(address), timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("POST", "/infer", body=body, headers=HEADERS)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise BenchError(f"POST http://{address}/infer answered {resp.status}: {data[:200]!r}")
    result: dict[str, Any] = json.loads(data)
    return result


def run_stampede(pair: WorkerPair, work: Workload, n: int, ttl_s: float, rc: redis.Redis) -> dict[str, Any]:
    key, body = 0, work.bodies[0]
    hot = [one_request(a, body)["cache"] for _ in range(3) for a in pair.addresses]
    dbsize_hot = int(rc.dbsize())
    time.sleep(ttl_s + 1.0)
    dbsize_expired = int(rc.dbsize())
    before = [metrics(a) for a in pair.addresses]
    barrier = threading.Barrier(n, timeout=120)
    results: list[dict[str, Any]] = [{} for _ in range(n)]

    def fire(i: int) -> None:
        address = pair.addresses[i % len(pair.addresses)]
        conn = http.client.HTTPConnection(*split_address(address), timeout=HTTP_TIMEOUT_S)
        r = results[i]
        try:
            try:
                conn.connect()
            except OSError as exc:
                r["error"] = f"connect: {exc}"
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                r.setdefault("error", "barrier broken")
                return
            if "error" in r:
                return
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/infer", body=body, headers=HEADERS)
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.HTTPException, OSError) as exc:
                r["error"] = f"{type(exc).__name__}: {exc}"
                return
            r["latency"] = time.perf_counter() - t0
            r["status"] = resp.status
            if resp.status == 200:
                parsed = json.loads(data)
                r["outcome"] = str(parsed.get("cache", "none"))
                r["output"] = parsed.get("output")
        finally:
            conn.close()

    threads = [threading.Thread(target=fire, args=(i,), name=f"stampede-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HTTP_TIMEOUT_S + 130)
    time.sleep(0.2)
    after = [metrics(a) for a in pair.addresses]
    forwards = delta(after, before, "pdparams_forward_total")
    statuses = collections.Counter(r.get("status", "error") for r in results)
    outcomes = collections.Counter(r["outcome"] for r in results if "outcome" in r)
    outs = [json.dumps(r["output"]) for r in results if r.get("status") == 200]
    lat = sorted(r["latency"] for r in results if "latency" in r)
    follow = [one_request(a, body)["cache"] for a in pair.addresses]
    probe = latency_probe(pair.addresses[0], body)
    return {
        "requests": n, "key": key, "ttl_s": ttl_s, "waited_s": ttl_s + 1.0, "hot_outcomes": hot,
        "redis_dbsize_hot": dbsize_hot, "redis_dbsize_after_wait": dbsize_expired,
        "forwards": forwards, "statuses": {str(k): v for k, v in statuses.items()}, "outcomes": dict(outcomes),
        "all_ok": statuses.get(200, 0) == n, "identical": len(outs) == n and len(set(outs)) == 1,
        "p50_ms": percentile(lat, 0.5) * 1000, "max_ms": (lat[-1] * 1000) if lat else math.nan,
        "errors": [r["error"] for r in results if "error" in r][:5], "followup_outcomes": follow,
        "server_outcomes": delta_by_label(after, before, "pdparams_infer_requests_total", "outcome"),
        "probe": probe,
    }


def latency_probe(address: str, body: bytes, n: int = 15) -> dict[str, Any]:
    """Sequential requests for a cached input, one at a time: on one keep-alive connection, and each
    on a fresh connection. Shows the latency floor of a hit with nothing else running."""
    def timed(conn: http.client.HTTPConnection) -> tuple[float, str]:
        t0 = time.perf_counter()
        conn.request("POST", "/infer", body=body, headers=HEADERS)
        resp = conn.getresponse()
        data = resp.read()
        return (time.perf_counter() - t0) * 1000, str(json.loads(data).get("cache")) if resp.status == 200 else f"HTTP {resp.status}"

    kept = http.client.HTTPConnection(*split_address(address), timeout=HTTP_TIMEOUT_S)
    try:
        timed(kept)  # the connection's first answer
        keepalive = [timed(kept) for _ in range(n)]
    finally:
        kept.close()
    fresh = []
    for _ in range(n):
        conn = http.client.HTTPConnection(*split_address(address), timeout=HTTP_TIMEOUT_S)
        try:
            fresh.append(timed(conn))
        finally:
            conn.close()
    return {"keepalive_ms": [x for x, _ in keepalive], "fresh_ms": [x for x, _ in fresh],
            "keepalive_median_ms": statistics.median(x for x, _ in keepalive),
            "fresh_median_ms": statistics.median(x for x, _ in fresh),
            "outcomes": dict(collections.Counter(o for _, o in keepalive + fresh))}


# ----------------------------------------------------------------------------------- checks

def check_reference(outputs: Outputs, work: Workload, forward_ms: float) -> dict[str, Any]:
    """Each key's served output against this process's own forward pass of the pushed weights."""
    import torch

    from bench.serve_model import SlowMLP

    torch.manual_seed(0)
    ref = SlowMLP(forward_ms=forward_ms).eval()  # the weights pushed (same seed)
    exact = close = 0
    worst = 0.0
    bad: list[int] = []
    with torch.no_grad():
        for key, output in sorted(outputs.first.items()):
            want = ref.net(torch.tensor([work.inputs[key]], dtype=torch.float32))
            got = torch.tensor(output, dtype=torch.float32)
            if got.shape != want.shape:
                bad.append(key)
                continue
            diff = float((got - want).abs().max())
            worst = max(worst, diff)
            if diff == 0:
                exact += 1
            if diff <= REF_TOLERANCE:
                close += 1
            else:
                bad.append(key)
    return {"keys": len(outputs.first), "exact": exact, "within_tolerance": close, "max_abs_diff": worst,
            "bad_keys": bad[:10], "ok": not bad}


def preflight() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, "-m", "worker", "serve", "--help"], cwd=str(REPO), env=env,
                         capture_output=True, text=True, timeout=120)
    missing = [f for f in REQUIRED_FLAGS if f not in out.stdout]
    if out.returncode != 0 or missing:
        raise SystemExit(f"paramworker serve lacks {', '.join(missing) or '(--help failed)'}: this tree has no result cache "
                         f"(issue #13) yet; nothing to measure")


# ----------------------------------------------------------------------------------- main

def fmt_ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def fractions(outcomes: dict[str, int], ok: int) -> dict[str, float]:
    return {o: (outcomes.get(o, 0) / ok if ok else math.nan) for o in OUTCOMES}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per mode and round (default 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each window, not counted (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; every mode once per round, rotating order (default 3)")
    p.add_argument("--clients", type=int, default=32, help="concurrent client threads, half per worker (default 32)")
    p.add_argument("--keys", type=int, default=10_000, help="distinct inputs (default 10000)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the inputs' popularity (default 1.1)")
    p.add_argument("--forward-ms", type=float, default=20.0, help="duration of one forward pass, ms (default 20)")
    p.add_argument("--stampede", type=int, default=200, help="identical concurrent requests in the stampede, 0 skips it (default 200)")
    p.add_argument("--stampede-ttl", type=float, default=2.0, help="--result-cache-ttl of the stampede's workers, s (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and the clients' draws (default 0)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every 'paramworker serve' (repeatable, e.g. --worker-arg=--max-concurrency=2); "
                        "default: none, the workers' own defaults")
    p.add_argument("--dir", type=Path, default=None, help="parent folder for the run's working folder (default: the system temp dir)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every measurement to FILE as JSON")
    args = p.parse_args()
    if args.rounds < 1 or args.clients < 1 or args.keys < 1 or args.seconds <= 0 or args.warmup < 0:
        p.error("--rounds, --clients and --keys must be >= 1, --seconds > 0, --warmup >= 0")
    if args.zipf <= 0 or args.forward_ms < 0 or args.stampede < 0 or args.stampede_ttl <= 0:
        p.error("--zipf and --stampede-ttl must be > 0, --forward-ms and --stampede >= 0")

    t_start = time.perf_counter()
    # SIGTERM (a timeout, a CI cancel) unwinds through the finally below: workers, Redis and cluster stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from deploy.local import LocalCluster, LocalClusterConfig
    from deploy.redis_baseline import RedisServer

    if shutil.which("redis-server") is None:
        RedisServer(Path("."))  # exits with its one-line install hint
    preflight()

    import torch

    from bench.serve_model import SlowMLP
    from paramserver.client.push import push

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-serve-", dir=args.dir))
    logs = root / "logs"
    logs.mkdir()
    cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3, generate_secrets=True,
                                              extra_args=("--scrub-mb-per-s", "0", "--log-level", "WARNING")))
    redis_server: RedisServer | None = None
    pair: WorkerPair | None = None
    failed = False
    work = Workload(args.keys, args.zipf, args.seed)
    outputs = Outputs()
    rounds: list[dict[str, Any]] = []
    stampede: dict[str, Any] | None = None
    failures: list[str] = []
    est = args.rounds * len(MODES) * (args.seconds + args.warmup + 8) + (args.stampede_ttl + 15 if args.stampede else 0) + 20
    print(f"bench_serve: {WORKERS} workers, forward {args.forward_ms:g} ms, {args.clients} clients, Zipf({args.zipf:g}) over "
          f"{args.keys} inputs (top 1 = {work.mass_of_top(1):.1%} of draws, top 100 = {work.mass_of_top(100):.1%}, "
          f"top 1000 = {work.mass_of_top(1000):.1%}); {args.rounds} rounds x {len(MODES)} modes x ({args.warmup:g} s warm-up "
          f"+ {args.seconds:g} s); about {est:.0f} s", flush=True)
    try:
        t0 = time.perf_counter()
        cluster.up(wait=120)
        torch.manual_seed(0)
        model = SlowMLP(forward_ms=args.forward_ms)
        pushed = push(cluster.seed, model.state_dict(), model=MODEL, tag=TAG, token=cluster.config.admin_token)
        print(f"cluster up and {REF} v{pushed.version} pushed in {time.perf_counter() - t0:.1f} s", flush=True)
        redis_server = RedisServer(root)
        rc = redis_server.client()
        redis_url = f"redis://127.0.0.1:{redis_server.port}/0"
        env = worker_env(cluster.client_config_path, args.forward_ms)

        for round_no in range(args.rounds):
            shift = round_no % len(MODES)
            order = MODES[shift:] + MODES[:shift]
            for pos, mode in enumerate(order):
                name = f"r{round_no + 1}-{mode.replace('+', '-')}"
                rc.flushall()
                try:
                    pair = start_workers(mode_args(mode, redis_url) + list(args.worker_arg), env, logs, name)
                    m = run_load(pair, work, outputs, args.clients, args.warmup, args.seconds,
                                 seed=args.seed * 100_003 + round_no * 101 + MODES.index(mode), where=name)
                except BenchError as exc:
                    failures.append(f"round {round_no + 1} {mode}: {exc}")
                    print(f"round {round_no + 1} {mode}: FAILED: {exc}", flush=True)
                    continue
                finally:
                    if pair is not None:
                        pair.stop()
                        pair = None
                m.update({"mode": mode, "round": round_no + 1, "position": pos + 1})
                rounds.append(m)
                fr = fractions(m["outcomes"], m["ok"])
                errs = sum(m["errors"].values())
                print(f"round {round_no + 1} #{pos + 1} {mode:8s}: QPS {m['qps']:7.1f}  p50 {fmt_ms(m['p50_ms']):>7s} ms  "
                      f"p99 {fmt_ms(m['p99_ms']):>7s} ms  ok {m['ok']}  shed {m['shed']}  errors {errs}  "
                      + "  ".join(f"{o} {fr[o]:.0%}" for o in OUTCOMES)
                      + f"  forwards/req {m['forwards_per_ok']:.2f}  cpu client {m['client_cpu']:.0%} workers "
                      + "+".join(f"{c:.0%}" for c in m["worker_cpu"]) + f"  (workers up in {m['worker_start_s']:.1f} s)",
                      flush=True)
                if errs:
                    failures.append(f"round {round_no + 1} {mode}: request errors {m['errors']}")

        if args.stampede:
            rc.flushall()
            try:
                pair = start_workers(mode_args("l1+redis", redis_url) + ["--result-cache-ttl", f"{args.stampede_ttl:g}"]
                                     + list(args.worker_arg), env, logs, "stampede")
                stampede = run_stampede(pair, work, args.stampede, args.stampede_ttl, rc)
            except BenchError as exc:
                failures.append(f"stampede: {exc}")
                print(f"stampede: FAILED: {exc}", flush=True)
            finally:
                if pair is not None:
                    pair.stop()
                    pair = None
        rc.close()
    except BaseException:
        failed = True
        raise
    finally:
        if pair is not None:
            pair.stop()
        if redis_server is not None:
            redis_server.stop()
        cluster.down()
        if failed or failures:
            print(f"working folder kept for the logs: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    # ------------------------------------------------------------------------- summary
    reference = check_reference(outputs, work, args.forward_ms) if outputs.first else None
    summary: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        ms = [m for m in rounds if m["mode"] == mode]
        if not ms:
            continue
        ok = sum(m["ok"] for m in ms)
        outcomes: collections.Counter[str] = collections.Counter()
        for m in ms:
            outcomes.update(m["outcomes"])
        summary[mode] = {
            "qps": [m["qps"] for m in ms], "p50_ms": [m["p50_ms"] for m in ms], "p99_ms": [m["p99_ms"] for m in ms],
            "median_qps": statistics.median(m["qps"] for m in ms),
            "median_p50_ms": statistics.median(m["p50_ms"] for m in ms),
            "median_p99_ms": statistics.median(m["p99_ms"] for m in ms),
            "ok": ok, "shed": sum(m["shed"] for m in ms), "errors": sum(sum(m["errors"].values()) for m in ms),
            "fractions": fractions(dict(outcomes), ok), "outcomes": dict(outcomes),
            "forwards_per_ok": sum(m["forwards"] for m in ms) / ok if ok else math.nan,
        }

    print()
    print(f"bench_serve: {WORKERS} x paramworker serve ({' '.join(args.worker_arg) or 'worker defaults'}), model {REF} "
          f"(slow_mlp, forward {args.forward_ms:g} ms), {args.clients} closed-loop clients (half per worker, keep-alive "
          f"{'yes' if all(m['keepalive'] for m in rounds) else 'NO: the workers closed connections'}), Zipf({args.zipf:g}) "
          f"over {args.keys} inputs, {args.rounds} rounds (order rotated), {os.cpu_count()} cores, Python "
          f"{platform.python_version()}")
    print(f"each mode-round starts cold (fresh workers, Redis flushed); {args.warmup:g} s warm-up excluded, then "
          f"{args.seconds:g} s measured; latency client side; medians over rounds")
    head = (f"{'mode':38s} {'QPS per round':>22s} {'QPS':>7s} {'p50 ms':>7s} {'p99 ms':>7s}  "
            + " ".join(f"{o:>8s}" for o in OUTCOMES) + f" {'fwd/req':>7s} {'shed':>5s} {'err':>4s}")
    print(head)
    print("-" * len(head))
    for mode in MODES:
        s = summary.get(mode)
        if s is None:
            print(f"{MODE_TEXT[mode]:38s} {'FAILED':>22s}")
            continue
        per_round = " ".join(f"{q:.1f}" for q in s["qps"])
        print(f"{MODE_TEXT[mode]:38s} {per_round:>22s} {s['median_qps']:7.1f} {fmt_ms(s['median_p50_ms']):>7s} "
              f"{fmt_ms(s['median_p99_ms']):>7s}  " + " ".join(f"{s['fractions'][o]:8.1%}" for o in OUTCOMES)
              + f" {s['forwards_per_ok']:7.3f} {s['shed']:5d} {s['errors']:4d}")

    ratios: dict[str, Any] = {}
    if "off" in summary:
        off = summary["off"]
        print()
        for mode in ("l1", "l1+redis"):
            if mode not in summary:
                continue
            s = summary[mode]
            paired = [a["qps"] / b["qps"] for a in rounds if a["mode"] == mode
                      for b in rounds if b["mode"] == "off" and b["round"] == a["round"] and b["qps"] > 0]
            ratios[mode] = {"qps": s["median_qps"] / off["median_qps"] if off["median_qps"] else math.nan,
                            "p99": s["median_p99_ms"] / off["median_p99_ms"] if off["median_p99_ms"] else math.nan,
                            "p50": s["median_p50_ms"] / off["median_p50_ms"] if off["median_p50_ms"] else math.nan,
                            "qps_paired_by_round": paired}
            r = ratios[mode]
            print(f"{mode + '/off':13s}  QPS {floor3(r['qps'])}x (per round {' '.join(f'{x:.2f}' for x in paired)})   "
                  f"p50 {ceil3(r['p50'])}x   p99 {ceil3(r['p99'])}x")

    if stampede is not None:
        st = stampede
        verdict = "OK" if st["forwards"] == 1 else "NOT 1"
        print()
        print(f"stampede: {st['requests']} identical concurrent requests (half per worker, one barrier) for the hottest input, "
              f"{st['waited_s']:g} s after it was made hot (TTL {st['ttl_s']:g} s; hot: {', '.join(st['hot_outcomes'])}; "
              f"Redis keys {st['redis_dbsize_hot']} -> {st['redis_dbsize_after_wait']} after the wait)")
        print(f"  forward passes caused: {st['forwards']:g} (target exactly 1) {verdict}; outcomes "
              + ", ".join(f"{k} {v}" for k, v in sorted(st["outcomes"].items()))
              + f"; HTTP {', '.join(f'{k}: {v}' for k, v in sorted(st['statuses'].items()))}; all 200: "
              f"{'yes' if st['all_ok'] else 'NO'}; identical outputs: {'yes' if st['identical'] else 'NO'}; "
              f"latency p50 {fmt_ms(st['p50_ms'])} ms, max {fmt_ms(st['max_ms'])} ms; next request per worker: "
              f"{', '.join(st['followup_outcomes'])}")
        if st["errors"]:
            print(f"  errors: {st['errors']}")
        pr = st["probe"]
        print("  info: hit latency, one request at a time, hottest input (outcomes "
              + ", ".join(f"{k} {v}" for k, v in sorted(pr["outcomes"].items()))
              + f"): median {pr['keepalive_median_ms']:.1f} ms on one keep-alive connection (after its first answer), "
              f"{pr['fresh_median_ms']:.1f} ms on a fresh connection each")
        if pr["keepalive_median_ms"] > 20 and pr["keepalive_median_ms"] > 5 * pr["fresh_median_ms"]:
            print("  note: keep-alive answers wait ~40 ms more than fresh-connection ones: the look of Nagle + delayed ACK "
                  "(an answer's headers and body written to the socket in two writes); every client here uses keep-alive, "
                  "so this floor is in the cached modes' p50")
        if not st["all_ok"] or not st["identical"]:
            failures.append("stampede: not every answer was a 200 with the same output")

    print()
    if outputs.mismatches:
        failures.append(f"{outputs.mismatches} answers differ from the first answer for their input")
        print(f"output check: {outputs.mismatches} answers differ from the first one for their input: {outputs.examples}")
    else:
        print(f"output check: every answer for an input equal to its first answer (all modes, rounds, stampede: "
              f"{len(outputs.first)} inputs)", end="")
    if reference is not None:
        if not reference["ok"]:
            failures.append(f"outputs differ from the local forward pass: keys {reference['bad_keys']}")
        print(f"; vs this process's forward pass: {reference['exact']}/{reference['keys']} exact, "
              f"{reference['within_tolerance']}/{reference['keys']} within {REF_TOLERANCE:g} (max |diff| "
              f"{reference['max_abs_diff']:.2g})")
    else:
        print()

    done: dict[str, Any] = {}
    if "off" in summary and "l1+redis" in summary:
        r = ratios["l1+redis"]
        p99_lower = summary["l1+redis"]["median_p99_ms"] < summary["off"]["median_p99_ms"]
        done = {"qps_ratio": r["qps"], "target": 1.5, "pass": r["qps"] >= 1.5, "p99_lower": p99_lower,
                "p99_ms": {"l1+redis": summary["l1+redis"]["median_p99_ms"], "off": summary["off"]["median_p99_ms"]}}
        print(f"done-when: QPS l1+redis/off = {floor3(r['qps'])}x (target >= 1.5) {'PASS' if done['pass'] else 'BELOW'}; "
              f"p99 lower: {'yes' if p99_lower else 'no'} ({fmt_ms(summary['l1+redis']['median_p99_ms'])} vs "
              f"{fmt_ms(summary['off']['median_p99_ms'])} ms)")
    else:
        print("done-when: n/a (a mode failed in every round)")
    for f in failures:
        print(f"  failed: {f}")
    print(f"total wall time {time.perf_counter() - t_start:.0f} s")

    if args.json is not None:
        args.json.write_text(json.dumps({
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "workers": WORKERS, "cores": os.cpu_count(), "summary": summary, "ratios": ratios, "done_when": done,
            "stampede": stampede, "reference_check": reference, "mismatches": outputs.mismatches,
            "rounds": rounds, "failures": failures,
        }, indent=2, default=str))
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
