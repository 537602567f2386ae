"""Metadata plane benchmark: commit latency and throughput, and failover time.

    .venv/bin/python bench/bench_consensus.py [--commits 500] [--kills 10] [--idle 4.0]

Runs a 3-node cluster of real processes (python -m consensus.devnode) on 127.0.0.1.
Latencies are measured by this process and include the JSON-over-pipe hop to the node.
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

from consensus.errors import Conflict, MetadataError  # noqa: E402
from tests.integration.consensus_harness import Cluster, DevNode, wait_until  # noqa: E402

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


def concurrent(node: DevNode, writers: int, per_writer: int) -> float:
    def run(w: int) -> None:
        parent = None
        for _ in range(per_writer):
            parent = node.call("commit_version", model=f"conc{w}", manifest_id=MANIFEST, parent=parent,
                               publisher=f"w{w}", nbytes=1, chunk_count=1)["number"]
    start = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(run, range(writers)))
    return writers * per_writer / (time.perf_counter() - start)


def failover_once(cluster: Cluster, round_no: int, idle: float) -> float:
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

    with tempfile.TemporaryDirectory(prefix="bench-consensus-") as tmp:
        cluster = Cluster(Path(tmp), size=3)
        try:
            cluster.start()
            leader = cluster.leader()
            follower = next(n for n in cluster.alive() if n is not leader)
            sequential(leader, "warmup", 20)

            lat, total = sequential(leader, "seq-leader", args.commits)
            print(f"commit via leader   ({args.commits} sequential): p50 {percentile(lat, .5) * 1e3:.2f} ms  "
                  f"p99 {percentile(lat, .99) * 1e3:.2f} ms  {args.commits / total:.0f} commits/s")
            lat, total = sequential(follower, "seq-follower", args.commits)
            print(f"commit via follower ({args.commits} sequential): p50 {percentile(lat, .5) * 1e3:.2f} ms  "
                  f"p99 {percentile(lat, .99) * 1e3:.2f} ms  {args.commits / total:.0f} commits/s")
            rate = concurrent(leader, args.writers, max(1, args.commits // args.writers))
            print(f"commit via leader   ({args.writers} concurrent writers): {rate:.0f} commits/s")

            times = []
            for i in range(args.kills):
                times.append(failover_once(cluster, i, args.idle))
                print(f"  failover {i + 1}/{args.kills}: {times[-1]:.3f} s", flush=True)
            if times:
                print(f"failover (kill -9 leader -> next committed write, {len(times)} kills, idle {args.idle}s): "
                      f"median {statistics.median(times):.3f} s  max {max(times):.3f} s")
        finally:
            cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
