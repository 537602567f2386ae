#!/usr/bin/env python
"""A fleet behind paramrouter (issue #14, part a): affinity on against random choice, side by side in one run.

    .venv/bin/python bench/bench_fleet.py [--seconds 15] [--warmup 3] [--rounds 2] [--clients 8] [--zipf 1.1]
                                          [--forward-ms 20] [--other-versions 1] [--dir DIR] [--json FILE]

One run. Starts a local 3-server cluster (deploy.local, secrets generated, scrubbing off), pushes
three models (``bench/serve_model.py``'s ``slow_mlp``, different weights: m0, m1, m2, each tagged
prod), starts 4 ``paramworker serve`` processes (m0 on two of them, m1 and m2 on one each; result
cache off so every request runs a forward pass of --forward-ms; ``--other-versions`` lets a worker
load a version it does not follow on demand, least recently used dropped first: the cost a
request pays on a worker that does not hold its version) and two routers side by side, both fed
by every worker's heartbeats: ``paramrouter`` (affinity) and ``paramrouter --no-affinity``
(uniformly random among the workers that can answer). Each round runs both modes, order rotated:
--clients closed-loop client threads send ``POST /infer/MODEL:prod`` with the model drawn from
Zipf(--zipf) over the three (m0 the most popular) through that mode's router. The first --warmup
seconds are not counted; over the next --seconds: answers per second, p50 and p99 (client side),
non-200 answers, and the affinity hit ratio (share of routed requests answered by a worker that
already held the version, from the router's own counters, pdparams_router_affinity_hits_total /
pdparams_router_routed_total, taken at the window's edges). Figures per mode are medians over
rounds. Targets: affinity on >= 90% hits, p99 lower than random.

Exit status 1 when a process failed or requests failed outright; a figure below target is reported,
not an error. The machine is shared and noisy: compare within one run only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
FACTORY = "serve_model:slow_mlp"
MODELS = ("m0", "m1", "m2")
PLACEMENT = ("m0", "m0", "m1", "m2")  # the model each of the 4 workers follows
MODES = ("affinity", "random")
HITS, ROUTED = "pdparams_router_affinity_hits_total", "pdparams_router_routed_total"


class BenchError(RuntimeError):
    pass


class Proc:
    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.address = ""

    def wait_ready(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        out = self.proc.stdout
        result: list[str] = []

        def first() -> None:
            result.append(out.readline())

        t = threading.Thread(target=first, daemon=True)
        t.start()
        t.join(timeout)
        line = result[0] if result else ""
        if not line.startswith("LISTENING"):
            self.stop()
            raise BenchError(f"{self.log.name}: not ready: {line.strip()[:300]}")
        self.address = line.split()[1]

        def drain() -> None:
            with open(self.log, "a") as f:
                for chunk in out:
                    f.write(chunk)

        threading.Thread(target=drain, daemon=True).start()
        return self.address

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def get(address: str, path: str) -> bytes:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def counters(address: str, *names: str) -> list[float]:
    """Values of ``names`` from one read of ``/metrics`` (one read: a consistent pair)."""
    found = dict.fromkeys(names, 0.0)
    for line in get(address, "/metrics").decode().splitlines():
        name, _, value = line.partition(" ")
        if name in found:
            found[name] = float(value)
    return [found[n] for n in names]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def run_load(router: str, clients: int, warmup_s: float, seconds: float, weights: list[float], seed: int) -> dict[str, Any]:
    start = time.monotonic()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds
    lat: list[float] = []
    statuses: dict[int, int] = {}
    errors: list[str] = []
    lock = threading.Lock()
    edge: dict[str, float] = {}

    def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        host, port = router.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        while time.monotonic() < stop_at:
            model = rng.choices(MODELS, weights)[0]
            body = json.dumps({"input": [[rng.random() for _ in range(16)]], "cache": False}).encode()
            t0 = time.monotonic()
            try:
                conn.request("POST", f"/infer/{model}:prod", body=body,
                             headers={"Content-Type": "application/json", "X-Pdparams-Timeout-S": "20"})
                r = conn.getresponse()
                r.read()
                status = r.status
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            t1 = time.monotonic()
            if t0 >= measure_from and t1 <= stop_at:
                with lock:
                    lat.append(t1 - t0)
                    statuses[status] = statuses.get(status, 0) + 1
        conn.close()

    def edges() -> None:
        time.sleep(max(0.0, measure_from - time.monotonic()))
        edge["hits0"], edge["routed0"] = counters(router, HITS, ROUTED)
        time.sleep(max(0.0, stop_at - time.monotonic()))
        edge["hits1"], edge["routed1"] = counters(router, HITS, ROUTED)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    watcher = threading.Thread(target=edges, daemon=True)
    for t in [*threads, watcher]:
        t.start()
    for t in [*threads, watcher]:
        t.join(seconds + warmup_s + 60)
    routed = edge.get("routed1", 0.0) - edge.get("routed0", 0.0)
    hits = edge.get("hits1", 0.0) - edge.get("hits0", 0.0)
    ok = statuses.get(200, 0)
    return {"qps": ok / seconds, "p50_ms": percentile(lat, 0.5) * 1000, "p99_ms": percentile(lat, 0.99) * 1000,
            "answers": len(lat), "ok": ok, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "errors": len(errors), "error_sample": errors[:3], "routed": routed, "hit_ratio": hits / routed if routed else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[1])
    p.add_argument("--seconds", type=float, default=15.0, help="measured seconds per mode and round (default 15)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each window, not counted (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; both modes once per round, order rotated (default 2)")
    p.add_argument("--clients", type=int, default=8, help="closed-loop client threads (default 8)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the three models' popularity (default 1.1)")
    p.add_argument("--forward-ms", type=float, default=20.0, help="one forward pass, ms (default 20)")
    p.add_argument("--other-versions", type=int, default=1,
                   help="each worker's --other-versions: versions it loads on demand besides its own (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None, help="parent folder of the run's working folder (default: system temp)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the measurements to FILE")
    args = p.parse_args()
    if args.rounds < 1 or args.clients < 1 or args.seconds <= 0 or args.warmup < 0 or args.zipf <= 0:
        p.error("--rounds and --clients >= 1, --seconds > 0, --warmup >= 0, --zipf > 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    from bench.serve_model import SlowMLP
    from deploy.local import LocalCluster, LocalClusterConfig
    from paramserver.client.push import push

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-fleet-", dir=args.dir))
    logs = root / "logs"
    logs.mkdir()
    weights = zipf_weights(len(MODELS), args.zipf)
    est = 30 + args.rounds * len(MODES) * (args.seconds + args.warmup + 2)
    print(f"bench_fleet: 3 servers, 4 workers ({', '.join(f'w{i}={m}' for i, m in enumerate(PLACEMENT))}), 2 routers "
          f"(affinity, random); Zipf({args.zipf:g}) over {', '.join(f'{m} {w:.0%}' for m, w in zip(MODELS, weights))}; "
          f"forward {args.forward_ms:g} ms, result cache off, --other-versions {args.other_versions}, {args.clients} clients; "
          f"{args.rounds} rounds x 2 modes x ({args.warmup:g} + {args.seconds:g} s); about {est:.0f} s", flush=True)
    cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3, generate_secrets=True,
                                              extra_args=("--scrub-mb-per-s", "0", "--log-level", "WARNING")))
    procs: list[Proc] = []
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        t0 = time.perf_counter()
        cluster.up(wait=120)
        for i, model in enumerate(MODELS):
            torch.manual_seed(i)
            push(cluster.seed, SlowMLP(forward_ms=args.forward_ms).state_dict(), model=model, tag="prod",
                 token=cluster.config.admin_token)
        path = [str(BENCH), str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        env = {**os.environ, "PARAMS_CONFIG": str(cluster.client_config_path), "BENCH_SERVE_FORWARD_MS": str(args.forward_ms),
               "PYTHONPATH": os.pathsep.join(path)}
        routers: dict[str, str] = {}
        for mode in MODES:
            r = Proc([sys.executable, "-m", "worker.router", "--listen", "127.0.0.1:0", *(["--no-affinity"] if mode == "random" else [])],
                     env, logs / f"router-{mode}.log")
            procs.append(r)
            routers[mode] = r.wait_ready(30)
        for i, model in enumerate(PLACEMENT):
            w = Proc([sys.executable, "-m", "worker", "serve", "--model", f"{model}:prod", "--factory", FACTORY, "--listen",
                      "127.0.0.1:0", "--device", "cpu", "--poll-s", "0", "--result-cache-mb", "0", "--other-versions",
                      str(args.other_versions), "--worker-id", f"w{i}",
                      *[a for url in routers.values() for a in ("--router", f"http://{url}")]], env, logs / f"w{i}.log")
            procs.append(w)
        for w in procs[len(MODES):]:
            w.wait_ready(60)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            # A router routes to a worker once its URL has answered as it ("verified"), not at its first beat.
            if all(sum(1 for w in json.loads(get(a, "/workers"))["workers"] if w.get("verified")) == len(PLACEMENT)
                   for a in routers.values()):
                break
            time.sleep(0.2)
        else:
            raise BenchError("not every worker registered with both routers within 15 s")
        print(f"cluster, 3 models, 2 routers and 4 workers up in {time.perf_counter() - t0:.1f} s", flush=True)
        for rnd in range(args.rounds):
            order = MODES[rnd % 2:] + MODES[:rnd % 2]
            for mode in order:
                m = run_load(routers[mode], args.clients, args.warmup, args.seconds, weights, args.seed * 100 + rnd)
                m.update({"mode": mode, "round": rnd + 1})
                results.append(m)
                bad = {k: v for k, v in m["statuses"].items() if k != "200"}
                print(f"round {rnd + 1} {mode:8s}: hits {m['hit_ratio']:6.1%}  QPS {m['qps']:6.1f}  p50 {m['p50_ms']:7.1f} ms  "
                      f"p99 {m['p99_ms']:7.1f} ms  answers {m['answers']}  non-200 {bad or 0}  errors {m['errors']}", flush=True)
                if m["errors"] or m["ok"] == 0:
                    failures.append(f"round {rnd + 1} {mode}: {m['errors']} failed requests {m['error_sample']}")
        for p_ in procs:
            if p_.proc.poll() is not None:
                failures.append(f"{p_.log.name} exited with {p_.proc.returncode}")
    except BenchError as exc:
        failures.append(str(exc))
    finally:
        for p_ in procs:
            p_.stop()
        cluster.down()
        if failures:
            print(f"working folder kept for the logs: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    summary: dict[str, Any] = {}
    for mode in MODES:
        rows = [r for r in results if r["mode"] == mode]
        if rows:
            summary[mode] = {k: statistics.median(r[k] for r in rows) for k in ("hit_ratio", "qps", "p50_ms", "p99_ms")}
    if len(summary) == 2:
        a, r = summary["affinity"], summary["random"]
        print(f"\nmedians over {args.rounds} rounds          affinity     random   ratio (affinity/random)")
        print(f"  affinity hit ratio             {a['hit_ratio']:8.1%}   {r['hit_ratio']:8.1%}   target >= 90% with affinity: "
              f"{'met' if a['hit_ratio'] >= 0.9 else 'NOT met'}")
        print(f"  p99 latency, ms                {a['p99_ms']:8.1f}   {r['p99_ms']:8.1f}   {a['p99_ms'] / r['p99_ms']:.2f}x  target lower: "
              f"{'met' if a['p99_ms'] < r['p99_ms'] else 'NOT met'}")
        print(f"  p50 latency, ms                {a['p50_ms']:8.1f}   {r['p50_ms']:8.1f}   {a['p50_ms'] / r['p50_ms']:.2f}x")
        print(f"  answers per second             {a['qps']:8.1f}   {r['qps']:8.1f}   {a['qps'] / r['qps']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": results,
                                         "summary": summary, "failures": failures}, indent=2))
    for f in failures:
        print(f"FAILED: {f}", flush=True)
    print(f"logs in {logs}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
