"""Metadata plane benchmark: commit latency and throughput with and without fsync, and failover time.

    .venv/bin/python bench/bench_consensus.py [--commits 500] [--writers 8] [--kills 10] [--idle 4.0]

Runs a 3-node cluster of real processes (python -m consensus.devnode) on 127.0.0.1, once with
the durable Raft state of the default (every commit synced on every server before it is
acknowledged) and once with --no-fsync (the baseline: tests and drills only), and prints the
two side by side with their ratio. Latencies are measured by this process and include the
JSON-over-pipe hop to the node. The failover rounds run on the default (fsync) cluster.
Failover: kill -9 of the leader -> the next write committed through a survivor, after
``--idle`` seconds without writes (longer than pysyncobj's default connectionTimeout, the
condition under which an idle follower link used to drop the vote request).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from consensus.errors import Conflict, MetadataError
from deploy.devcluster import DevCluster, DevNode, wait_until

MANIFEST = "ab" * 32


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def sequential(node: DevNode, model: str, count: int) -> tuple[list[float], float]:
    latencies = []
    parent = None
    start = time.perf_counter()
    for _ in range(count):
        t = time.perf_counter()
        parent = node.call("commit_version", model=model, manifest_id=MANIFEST, parent=parent, publisher="bench",
                           nbytes=1 << 20, chunk_count=4)["number"]
        latencies.append(time.perf_counter() - t)
    return latencies, time.perf_counter() - start


def concurrent(node: DevNode, writers: int, per_writer: int) -> tuple[list[float], float]:
    """Per-commit latencies and commits/s of ``writers`` threads committing at once."""
    latencies: list[float] = []

    def run(w: int) -> None:
        parent = None
        for _ in range(per_writer):
            t = time.perf_counter()
            parent = node.call("commit_version", model=f"conc{w}", manifest_id=MANIFEST, parent=parent,
                               publisher=f"w{w}", nbytes=1, chunk_count=1)["number"]
            latencies.append(time.perf_counter() - t)  # list.append is atomic
    start = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(run, range(writers)))
    return latencies, writers * per_writer / (time.perf_counter() - start)


Figures = dict[str, tuple[float, float, float]]  # row -> (p50 s, p99 s, commits/s)


def commit_figures(cluster: DevCluster, commits: int, writers: int) -> Figures:
    leader = cluster.leader()
    follower = next(n for n in cluster.alive() if n is not leader)
    sequential(leader, "warmup", 20)
    rows: Figures = {}
    lat, total = sequential(leader, "seq-leader", commits)
    rows[f"via leader, {commits} sequential"] = (percentile(lat, .5), percentile(lat, .99), commits / total)
    lat, total = sequential(follower, "seq-follower", commits)
    rows[f"via follower, {commits} sequential"] = (percentile(lat, .5), percentile(lat, .99), commits / total)
    before = [n.call("status") for n in cluster.nodes]
    lat, rate = concurrent(leader, writers, max(1, commits // writers))
    after = [n.call("status") for n in cluster.nodes]
    rows[f"via leader, {writers} concurrent writers"] = (percentile(lat, .5), percentile(lat, .99), rate)
    if after[0]["fsync"]:
        for b, a in zip(before, after):
            syncs = a["journal_syncs"] - b["journal_syncs"]
            spent = a["journal_sync_seconds"] - b["journal_sync_seconds"]
            role = "leader  " if a["server_id"] == leader.server_id else "follower"
            print(f"  group commit, {writers} writers, {a['server_id']} ({role}): {len(lat) / max(1, syncs):.1f} commits "
                  f"per journal sync, {spent / max(1, syncs) * 1e3:.2f} ms per sync")
    return rows


def print_side_by_side(durable: Figures, baseline: Figures) -> None:
    def cell(f: tuple[float, float, float]) -> str:
        return f"p50 {f[0] * 1e3:6.2f} ms  p99 {f[1] * 1e3:6.2f} ms  {f[2]:5.0f}/s"
    width = max(len(k) for k in durable)
    print(f"{'commit':<{width}}  {'fsync (default)':<37}  {'--no-fsync (unsafe baseline)':<37}  fsync/no-fsync")
    for row, f in durable.items():
        b = baseline[row]
        print(f"{row:<{width}}  {cell(f):<37}  {cell(b):<37}  p50 x{f[0] / b[0]:.2f}, rate x{f[2] / b[2]:.2f}")


def failover_once(cluster: DevCluster, round_no: int, idle: float) -> float:
    leader = cluster.leader()
    survivor = next(n for n in cluster.alive() if n is not leader)
    time.sleep(idle)  # let every link go quiet (pysyncobj's connectionTimeout is 3.5 s)
    model = f"failover{round_no}"
    t0 = time.perf_counter()
    leader.kill()
    while True:
        try:
            survivor.call("commit_version", wait=30, model=model, manifest_id=MANIFEST, parent=None,
                          publisher="bench", nbytes=1, chunk_count=1)
            break
        except Conflict:
            break  # an earlier attempt did commit; its answer was lost in the election
        except (MetadataError, TimeoutError):
            if time.perf_counter() - t0 > 60:
                raise
    elapsed = time.perf_counter() - t0
    leader.start()
    wait_until(lambda: leader.call("get_version", model=model, number=1), 60, what="restarted node catching up")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commits", type=int, default=500)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--idle", type=float, default=4.0)
    args = parser.parse_args()

    figures: dict[str, Figures] = {}
    for mode, extra in (("fsync", []), ("no-fsync", ["--no-fsync"])):
        with tempfile.TemporaryDirectory(prefix=f"bench-consensus-{mode}-") as tmp:
            cluster = DevCluster(Path(tmp), size=3, extra_args=extra)
            try:
                cluster.start()
                figures[mode] = commit_figures(cluster, args.commits, args.writers)
                if mode == "fsync" and args.kills:
                    times = []
                    for i in range(args.kills):
                        times.append(failover_once(cluster, i, args.idle))
                        print(f"  failover {i + 1}/{args.kills}: {times[-1]:.3f} s", flush=True)
                    print(f"failover (kill -9 leader -> next committed write, {len(times)} kills, idle {args.idle}s, "
                          f"fsync): median {statistics.median(times):.3f} s  max {max(times):.3f} s")
            finally:
                cluster.close()
    print_side_by_side(figures["fsync"], figures["no-fsync"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
