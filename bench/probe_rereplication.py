#!/usr/bin/env python
"""How soon a restarted server gets the copies it missed while it was down (re-replication).

    .venv/bin/python bench/probe_rereplication.py [--down-s 30] [--runs 1]

Each run starts a fresh local cluster (deploy.local: 3 servers, R=3, W=2, ``--anti-entropy-interval
0.5 --no-fsync``), kills ps3, pushes a small model (it commits on the W=2 replicas left), leaves ps3
down for --down-s seconds, restarts it from its data dir and prints how long after the restart
ps3 holds every chunk of that version placed on it (polled with HasChunks every 0.2 s).

While ps3 is down, the other servers' re-replication passes fail on it every 0.5 s and their gRPC
channels to it fall into reconnect back-off (1 s, growing by 1.6x, up to 2 min). A pass that
then fails UNAVAILABLE tries once more on a fresh channel (``PeerSet.reconnect``), so the copies
arrive within about a pass of the restart instead of when the old channel's back-off ends.
A diagnostic: no baseline; compare runs of one session only.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from chunking.pack import pack
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.push import push
from paramserver.client.rpc import ParamServerClient
from paramserver.wire.ring import Ring, RingConfig


def one_run(down_s: float, run: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="probe-rerep-"))
    cluster = LocalCluster(LocalClusterConfig(root=root, servers=3, extra_args=("--anti-entropy-interval", "0.5", "--no-fsync")))
    try:
        cluster.up(wait=90)
        info = ParamServerClient(cluster.addresses[0]).cluster_info()
        ring = Ring(sorted(m.server_id for m in info.members), RingConfig(vnodes=info.ring.vnodes))
        address = next(m.grpc_address for m in info.members if m.server_id == "ps3")
        cluster.kill("ps3")
        cluster.wait_ready(60, servers=["ps1", "ps2"])
        g = torch.Generator().manual_seed(run)
        state = {f"w{i}": torch.randn(300_000, generator=g) for i in range(4)}
        push(cluster.seed, state, model="rerep", tag="t", token=cluster.config.admin_token)
        r = min(info.ring.replication_factor, len(ring))
        ids = [ref.id for ref in pack(state, model="rerep").manifest.unique_chunks() if "ps3" in ring.replicas(ref.id, r)]
        time.sleep(down_s)
        t0 = time.monotonic()
        cluster.restart("ps3")
        ps3 = ParamServerClient(address)
        have = 0
        while time.monotonic() - t0 < 180:
            try:
                have = sum(ps3.has_chunks(ids, timeout=1.0))
            except Exception:  # noqa: BLE001 - not serving yet
                have = 0
            if have == len(ids):
                break
            time.sleep(0.2)
        ps3.close()
        done = "all" if have == len(ids) else f"only {have} of"
        print(f"run {run}: ps3 down {down_s:.0f} s; {done} {len(ids)} of its chunks on it "
              f"{time.monotonic() - t0:.1f} s after its restart (its own start included)", flush=True)
    finally:
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--down-s", type=float, default=30.0, help="seconds ps3 stays down after the push (default 30)")
    p.add_argument("--runs", type=int, default=1, help="runs, each on a fresh cluster (default 1)")
    args = p.parse_args()
    if args.down_s < 0 or args.runs < 1:
        p.error("--down-s must be >= 0 and --runs >= 1")
    print(f"probe_rereplication: {os.cpu_count()} cores")
    try:
        for run in range(1, args.runs + 1):
            one_run(args.down_s, run)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
