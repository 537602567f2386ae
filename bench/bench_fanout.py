#!/usr/bin/env python
"""A fleet cold-starting at once, with and without worker peers (issue #42), in one run.

    .venv/bin/python bench/bench_fanout.py [--model-mb 512] [--fleets 1,3,6] [--rounds 1] [--dir DIR] [--json FILE]

Starts a default local 3-server cluster (deploy.local, secrets generated), pushes one model of
--model-mb MiB (``bench/fanout_model.py``: 64 MiB float32 layers and odd tensors), saved first to a
.safetensors file. Then, for each fleet size N in --fleets and each mode (peers on, peers off: the
workers' ``--no-peers``), order rotated per round: starts N ``paramworker serve`` processes at the
same moment and times each from its spawn to its load report (what a user waits for: a fresh
process, its connections, the whole load). Per configuration it prints the last worker's time, the
median, and the bytes the three servers sent during it (``ServerStatus.served_bytes`` deltas, in
copies of the model). Each worker's loaded weights are checked bit-exact against the pushed file
(``GET /weights/digest``: BLAKE3 of every tensor as loaded, against BLAKE3 of the file's tensors),
not only by the load's own checks. After the largest fleet with peers is ready, a further worker
starts and reports what share of its bytes came from peers.

Bars (issue 42): with peers, the servers send <= 1.5x the model for 6 workers; the last worker of
6 ready no later than 1.25x the peers-off time in the same run; the late worker >= 90% from peers.
Exit status 1 when a process failed or a digest differed; a figure below its bar is reported, not
an error. The machine is shared (2 cores run everything here): compare within one run only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
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
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
MODEL = "fanout"
FACTORY = "fanout_model:build"
MODES = ("peers", "no-peers")


class BenchError(RuntimeError):
    pass


class Worker:
    """One ``paramworker serve`` process: spawned at once, ready when its load report is printed."""

    def __init__(self, name: str, peers: bool, env: dict[str, str], log: Path, admin_token: str | None) -> None:
        self.name = name
        self.log = log
        self.admin_token = admin_token
        cmd = [sys.executable, "-m", "worker", "serve", "--model", f"{MODEL}:prod", "--factory", FACTORY, "--listen",
               "127.0.0.1:0", "--device", "cpu", "--poll-s", "0", "--result-cache-mb", "0", "--worker-id", name,
               *([] if peers else ["--no-peers"])]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.address = ""
        self.ready_s: float | None = None
        self.listening_s: float | None = None  # spawn -> its HTTP port up (process start, imports, cluster view)
        self.load_s: float | None = None  # the load itself, as its report says
        self.report = ""
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "a") as f:
            for line in self.proc.stdout:
                f.write(line)
                self.lines.append(line)
                if line.startswith("LISTENING") and not self.address:
                    self.address = line.split()[1]
                    self.listening_s = time.perf_counter() - self.t0
                if line.startswith(f"{MODEL} v") and self.ready_s is None:  # the load report (LoadReport.summary)
                    self.ready_s = time.perf_counter() - self.t0
                    self.report = line.strip()
                    m = re.search(r" in ([0-9.]+) s = ", line)
                    self.load_s = float(m.group(1)) if m else None
                    self._ready.set()
        self._ready.set()

    def wait(self, timeout: float) -> float:
        if not self._ready.wait(timeout) or self.ready_s is None:
            tail = "".join(self.lines[-5:]).strip()[-400:]
            raise BenchError(f"{self.name}: no load report within {timeout:g} s (exit {self.proc.poll()}): {tail}")
        return self.ready_s

    def get(self, path: str) -> bytes:
        host, port = self.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        try:
            conn.request("GET", path, headers=headers)
            reply = conn.getresponse()
            body = reply.read()
            if reply.status != 200:
                raise BenchError(f"{self.name}: GET {path}: HTTP {reply.status} {body[:200]!r}")
            return body
        finally:
            conn.close()

    def load_bytes(self) -> dict[str, float]:
        """pdparams_load_bytes_total by tier, from the worker's /metrics."""
        out: dict[str, float] = {}
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith("pdparams_load_bytes_total{"):
                labels, _, value = line.partition("} ")
                tier = labels.split('tier="', 1)[1].split('"', 1)[0]
                out[tier] = out.get(tier, 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a live process (/proc/PID/stat), 0 when it is gone."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served_bytes(cluster: Any) -> int:
    """The chunk bytes every server has sent since it started (ServerStatus.served_bytes)."""
    from paramserver.client.rpc import ClientConfig, ParamServerClient

    total = 0
    for address in [slot.grpc for slot in cluster.slots]:
        with ParamServerClient(ClientConfig(address, token=cluster.config.admin_token)) as c:
            total += int(c.server_status().served_bytes)
    return total


def check_digests(w: Worker, want: dict[str, str]) -> str | None:
    got = json.loads(w.get(f"/weights/digest?model={MODEL}"))
    tensors = got.get("tensors", got)
    bad = sorted(k for k in want if tensors.get(k) != want[k])
    extra = sorted(set(tensors) - set(want))
    if bad or extra:
        return f"{w.name}: weights differ from the pushed file: {bad[:5]} {extra[:5]}"
    return None


def run_fleet(n: int, mode: str, env: dict[str, str], logs: Path, admin: str | None, cluster: Any, model_bytes: int,
              want: dict[str, str], late: bool, timeout: float, tag: str) -> dict[str, Any]:
    before = served_bytes(cluster)
    servers_cpu = sum(cpu_seconds(slot.pid) for slot in cluster.slots)
    workers = [Worker(f"{tag}-w{i}", mode == "peers", env, logs / f"{tag}-w{i}.log", admin) for i in range(n)]
    result: dict[str, Any] = {"workers": n, "mode": mode}
    try:
        times = [w.wait(timeout) for w in workers]
        after = served_bytes(cluster)
        # CPU the fleet and the servers spent until the last worker was ready (2 cores run all of it here).
        result["cpu_s"] = {"workers": sum(cpu_seconds(w.proc.pid) for w in workers),
                           "servers": sum(cpu_seconds(slot.pid) for slot in cluster.slots) - servers_cpu}
        result.update(last_s=max(times), median_s=statistics.median(times), egress_copies=(after - before) / model_bytes,
                      reports=[w.report for w in workers], listening_s=[w.listening_s for w in workers],
                      load_s=[w.load_s for w in workers])
        result["digest_errors"] = [e for e in (check_digests(w, want) for w in workers) if e]
        shares = []
        for w in workers:
            tiers = w.load_bytes()
            shares.append(tiers.get("peer", 0.0) / max(1.0, sum(tiers.values())))
        result["peer_share"] = shares
        if late:
            extra = Worker(f"{tag}-late", True, env, logs / f"{tag}-late.log", admin)
            try:
                before_late = served_bytes(cluster)
                result["late_s"] = extra.wait(timeout)
                result["late_egress_copies"] = (served_bytes(cluster) - before_late) / model_bytes
                tiers = extra.load_bytes()
                result["late_peer_share"] = tiers.get("peer", 0.0) / max(1.0, sum(tiers.values()))
                err = check_digests(extra, want)
                if err:
                    result["digest_errors"].append(err)
            finally:
                extra.stop()
    finally:
        for w in workers:
            w.stop()
        time.sleep(1.0)  # let the leaves reach the servers before the next fleet
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[1])
    p.add_argument("--model-mb", type=int, default=512, help="model size, a multiple of 64 MiB (default 512)")
    p.add_argument("--fleets", default="1,3,6", help="fleet sizes, comma-separated (default 1,3,6)")
    p.add_argument("--rounds", type=int, default=1, help="rounds; every configuration once per round, order rotated (default 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a worker may take to be ready (default 300)")
    p.add_argument("--dir", type=Path, default=None, help="parent folder of the run's working folder (default: system temp)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the measurements to FILE")
    args = p.parse_args()
    fleets = [int(x) for x in args.fleets.split(",") if x.strip()]
    if args.model_mb < 64 or args.model_mb % 64 or not fleets or min(fleets) < 1 or args.rounds < 1:
        p.error("--model-mb a multiple of 64, --fleets sizes >= 1, --rounds >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from safetensors.torch import save_file

    from bench import fanout_model
    from deploy.local import LocalCluster, LocalClusterConfig
    from worker.weights_digest import file_digests
    from paramserver.client.push import push

    layers = args.model_mb // 64
    root = Path(tempfile.mkdtemp(prefix="bench-fanout-", dir=args.dir))
    logs = root / "logs"
    logs.mkdir()
    configs = [(n, mode) for n in fleets for mode in MODES]
    print(f"bench_fanout: 3 servers, a {args.model_mb} MiB model ({layers} float32 layers + odd tensors); fleets "
          f"{', '.join(map(str, fleets))} x peers on/off, {args.rounds} round(s), order rotated; then one late worker",
          flush=True)
    cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3, generate_secrets=True,
                                              extra_args=("--scrub-mb-per-s", "0", "--log-level", "WARNING")))
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        cluster.up(wait=120)
        weights = root / "model.safetensors"
        save_file(fanout_model.state_dict(layers), str(weights))
        want = file_digests(weights)  # BLAKE3 of each tensor's bytes in the pushed file
        model_bytes = weights.stat().st_size
        push(cluster.seed, weights, model=MODEL, tag="prod", token=cluster.config.admin_token)
        path = [str(BENCH), str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        env = {**os.environ, "PARAMS_CONFIG": str(cluster.client_config_path), "PYTHONPATH": os.pathsep.join(path),
               fanout_model.LAYERS_ENV: str(layers)}
        if cluster.config.admin_token:
            env["PARAMS_ADMIN_TOKEN"] = cluster.config.admin_token  # the digest endpoint wants it
        biggest = max(fleets)
        for rnd in range(args.rounds):
            k = rnd % len(configs)
            for n, mode in configs[k:] + configs[:k]:
                tag = f"r{rnd + 1}-{mode}-{n}"
                r = run_fleet(n, mode, env, logs, cluster.config.admin_token, cluster, model_bytes, want,
                              late=(n == biggest and mode == "peers"), timeout=args.timeout, tag=tag)
                r["round"] = rnd + 1
                results.append(r)
                failures += r["digest_errors"]
                late = (f"; late worker {r['late_s']:.2f} s, {r['late_peer_share']:.1%} from peers, servers "
                        f"{r['late_egress_copies']:.2f}x") if "late_s" in r else ""
                loads = [x for x in r["load_s"] if x is not None]
                print(f"round {rnd + 1} {n} worker(s) {mode:8s}: last ready {r['last_s']:6.2f} s, median {r['median_s']:6.2f} s "
                      f"(the load itself: median {statistics.median(loads) if loads else float('nan'):5.2f} s, "
                      f"max {max(loads) if loads else float('nan'):5.2f} s), "
                      f"servers sent {r['egress_copies']:5.2f}x the model, peer share "
                      f"{statistics.mean(r['peer_share']):.1%}{late}; CPU s workers {r['cpu_s']['workers']:.1f} servers "
                      f"{r['cpu_s']['servers']:.1f}; digests "
                      f"{'ok' if not r['digest_errors'] else 'DIFFER'}", flush=True)
    except BenchError as exc:
        failures.append(str(exc))
    finally:
        cluster.down()
        if failures:
            print(f"working folder kept for the logs: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nmedians over {args.rounds} round(s)   last ready, s (on / off / ratio)   servers sent, copies (on / off)")
    summary: dict[str, Any] = {}
    for n in fleets:
        on = [r for r in results if r["workers"] == n and r["mode"] == "peers"]
        off = [r for r in results if r["workers"] == n and r["mode"] == "no-peers"]
        if not on or not off:
            continue
        s = {"on_last_s": statistics.median(r["last_s"] for r in on), "off_last_s": statistics.median(r["last_s"] for r in off),
             "on_copies": statistics.median(r["egress_copies"] for r in on),
             "off_copies": statistics.median(r["egress_copies"] for r in off)}
        s["ratio"] = s["on_last_s"] / s["off_last_s"]
        summary[str(n)] = s
        print(f"  {n} worker(s)              {s['on_last_s']:7.2f} / {s['off_last_s']:7.2f} / {s['ratio']:.2f}x"
              f"            {s['on_copies']:5.2f} / {s['off_copies']:5.2f}")
    six = summary.get("6")
    if six:
        print(f"bar: servers send <= 1.5x for 6 workers with peers: {six['on_copies']:.2f}x "
              f"{'met' if six['on_copies'] <= 1.5 else 'NOT met'}")
        print(f"bar: last of 6 ready <= 1.25x the peers-off time: {six['ratio']:.2f}x {'met' if six['ratio'] <= 1.25 else 'NOT met'}")
    lates = [r["late_peer_share"] for r in results if "late_peer_share" in r]
    if lates:
        share = statistics.median(lates)
        print(f"bar: a late worker takes >= 90% of its bytes from peers: {share:.1%} {'met' if share >= 0.9 else 'NOT met'}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
                                         "summary": summary, "failures": failures}, indent=2))
    for f in failures:
        print(f"FAILED: {f}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
