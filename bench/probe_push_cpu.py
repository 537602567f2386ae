#!/usr/bin/env python
"""Where a push's CPU goes: per-thread CPU of the client and of each server during one push (issue #12).

    .venv/bin/python bench/probe_push_cpu.py [--mib 512] [--runs 2] [--dir DIR] [--server-arg=--no-fsync ...]

Each run starts a FRESH default local cluster (deploy.local: 3 servers, R=3, W=2, plus any
--server-arg), pushes a synthetic bf16 model of --mib MiB (chunking.synthetic, seed 0) with
``paramserver.client.push.push`` and samples every 20 ms, from a thread of its own, the CPU time
(utime + stime, /proc/PID/task/TID/stat) of every thread of this process and of the three
servers. It prints the push's throughput (model bytes / wall seconds) and, per process, its CPU
seconds over the push and in "cores" (CPU seconds / wall seconds), the client's by thread name
(pack, dedup, bulk senders and ack readers; "monitor" is this probe's own sampler). A process that
uses well under one core per process while the push is slow is waiting, not computing: on the
disk (compare --server-arg=--direct-writes=on and =off), on the window, or on the other side.

A diagnostic, not a benchmark: no baseline, no rotation; bench/bench_push.py is the benchmark.
Every cluster is stopped after its run, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.measure import stat_cpu_s
from chunking.synthetic import synthetic_state_dict
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.push import push

def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (comm, CPU seconds) of every live thread of ``pid``."""
    out: dict[int, tuple[str, float]] = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            cpu = stat_cpu_s(f"{base}/{tid}/stat")
            with open(f"{base}/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue  # the thread ended between listdir and open
        out[int(tid)] = (comm, cpu)
    return out


class Sampler:
    """The last CPU reading of every thread seen, so threads that end during the push still count."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.before = {pid: thread_cpu(pid) for pid in pids}
        self.seen: dict[int, dict[int, tuple[str, float]]] = collections.defaultdict(dict)
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="monitor", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        for t in threading.enumerate():
            if t.native_id:
                self.names[t.native_id] = t.name
        for pid in self.pids:
            for tid, (comm, cpu) in thread_cpu(pid).items():
                name = self.names.get(tid, comm) if pid == os.getpid() else comm
                self.seen[pid][tid] = (name, cpu)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(0.02)

    def by_name(self, pid: int) -> dict[str, float]:
        """CPU seconds over the push, summed per thread name without its numeric suffix."""
        agg: dict[str, float] = collections.defaultdict(float)
        for tid, (name, cpu) in self.seen[pid].items():
            start = self.before[pid].get(tid, ("", 0.0))[1]
            agg[name.rstrip("0123456789_").split("-127.0.0.1")[0]] += cpu - start
        return dict(agg)


def one_run(args: argparse.Namespace, state: dict[str, torch.Tensor], nbytes: int, run: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="probe-push-", dir=args.dir))
    cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3, extra_args=tuple(args.server_arg)))
    try:
        cluster.up(wait=60)
        pids = [s.pid for s in cluster.slots if s.pid]
        with Sampler([os.getpid(), *pids]) as sampler:
            t0 = time.perf_counter()
            report = push(cluster.seed, state, model="probe", tag="t", token=cluster.config.admin_token)
            wall = time.perf_counter() - t0
        print(f"run {run}: push of {nbytes / 2**20:.0f} MiB in {wall:.3f} s = {nbytes / wall / 1e9:.3f} GB/s "
              f"(pack {report.pack_seconds:.3f} s, commit {report.commit_seconds:.3f} s)")
        for pid in [os.getpid(), *pids]:
            parts = sampler.by_name(pid)
            total = sum(parts.values())
            who = "client  " if pid == os.getpid() else f"server {pid}"
            detail = ", ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v >= 0.01)
            print(f"  {who}: {total:.2f} s CPU = {total / wall:.2f} cores ({detail})")
    finally:
        cluster.down()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=512, help="model size in MiB, bf16 (default 512)")
    p.add_argument("--runs", type=int, default=2, help="pushes, each into a fresh cluster (default 2)")
    p.add_argument("--dir", default=None, help="parent folder of the clusters' data dirs (default: the system temp dir)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every 'paramserver serve' (repeatable, e.g. --server-arg=--no-fsync)")
    p.add_argument("--keep", action="store_true", help="keep the clusters' folders")
    args = p.parse_args()
    if args.mib < 1 or args.runs < 1:
        p.error("--mib and --runs must be >= 1")
    state = synthetic_state_dict(args.mib << 20, dtype=torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"probe_push_cpu: {nbytes / 2**20:.0f} MiB bf16, fresh 3-server cluster per run (R=3, W=2), "
          f"server args: {' '.join(args.server_arg) or '(defaults)'}; {os.cpu_count()} cores")
    try:
        for run in range(1, args.runs + 1):
            one_run(args, state, nbytes, run)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
