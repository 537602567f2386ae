#!/usr/bin/env python
"""Hot-chunk replication on and off: bytes served per server under concurrent cold loads (issue #14, fleet bench part b).

    .venv/bin/python bench/bench_hot_chunks.py [--servers 3] [--replication 2] [--mib 1] [--loads 6] [--waves 6]
                                               [--pace 0.5] [--dir DIR] [--json FILE]

One run, two clusters one after the other: a local cluster (deploy.local, --no-fsync) of --servers
servers with R = --replication, started with ``--hot-chunks off``, then a fresh one with
``--hot-chunks on`` (hot-chunk settings below, the same for both). On each: push one synthetic
bf16 model of --mib MiB (256 KiB chunks), then --waves waves, --pace seconds apart, of --loads
concurrent cold loads: each load is ``worker.loader.load(ClusterClient(...), "hot:prod", "cpu")``
in its own thread with a fresh client (no cache; the client asks the servers' hot chunks at most
every 0.5 s). Bytes served per server are the clients' ``stats.by_server`` summed; skew is
max/mean over the servers. Printed per mode: MiB per server, the skew over all waves and over
waves 2.. (wave 1 cannot use extra copies: its own reads are what makes the chunks hot), the bytes
read from extra copies, and for "on" the seconds until every extra copy was dropped after the last
wave (ServerStatus hot_extra_chunks 0 on every server). The ratio line compares on with off.

Why R=2 on 3 servers: with R=3 every server already holds every chunk and there is nowhere to
put an extra copy. Why a small model by default: the planner already balances one load's bytes
over the replicas (least-loaded by bytes), so a many-chunk model is near max/mean 1.0 either way;
skew comes from a small hot set read by many clients that each make the same choice (a 1 MiB
model is 4 chunks: every load reads 2 chunks from one server, 1 from each other), which is what
hot-chunk copies plus the salted tie-break spread. Try --mib 64 to see the balanced case.

Compare figures within one run only: the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402 - after the path

from chunking.synthetic import synthetic_state_dict  # noqa: E402
from deploy.local import LocalCluster, LocalClusterConfig  # noqa: E402
from paramserver.client.push import push  # noqa: E402
from paramserver.client.rpc import ClientConfig, ParamServerClient  # noqa: E402
from paramserver.client.session import ClusterClient, SessionConfig  # noqa: E402
from worker.loader import load  # noqa: E402

MiB = 1 << 20
MODEL, TAG = "hot", "prod"
# Hot-chunk settings for both runs (config file keys, paramserver/server/hot_chunks/config.py): short
# time constants so that a bench of a few seconds shows the whole cycle, hot then cool.
HOT_SETTINGS = {
    "hot_interval_s": 0.25, "hot_tau_s": 2.0, "hot_rate": 1.0, "hot_cool_rate": 0.25, "hot_cool_s": 1.0,
    "hot_lease_s": 2.0, "hot_extra_copies": 2,
}


def skew(by_server: dict[str, int], servers: list[str]) -> float:
    values = [by_server.get(s, 0) for s in servers]
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 0.0


def add(into: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def wave(seeds: list[str], loads: int) -> tuple[dict[str, int], int, float]:
    """``loads`` concurrent cold loads; (bytes by server, bytes from extra copies, seconds)."""
    clients = [ClusterClient(seeds, config=SessionConfig(hot_refresh_s=0.5, worker_id=f"bench-{i}")) for i in range(loads)]
    for c in clients:
        c.view()  # connect before the clock: the wave measures loads, not discovery
    errors: list[BaseException] = []
    start = threading.Barrier(loads + 1)

    def one(c: ClusterClient) -> None:
        try:
            start.wait()
            load(c, f"{MODEL}:{TAG}", device="cpu")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    served: dict[str, int] = {}
    extra = 0
    for c in clients:
        add(served, c.stats.by_server)
        extra += c.stats.extra_bytes
        c.close()
    if errors:
        raise errors[0]
    return served, extra, seconds


def extras_held(cluster: LocalCluster) -> int:
    total = 0
    for address in cluster.addresses:
        client = ParamServerClient(ClientConfig(address, timeout_s=2.0))
        try:
            total += int(client.server_status().extra.get("hot_extra_chunks", "0"))
        finally:
            client.close()
    return total


def run_mode(mode: str, args: argparse.Namespace, root: Path, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    config = root / f"hot-{mode}.json"
    config.write_text(json.dumps(HOT_SETTINGS))
    extra_args = ("--no-fsync", "--log-level", "WARNING", "--config", str(config), "--hot-chunks", mode)
    cluster = LocalCluster(LocalClusterConfig(root=root / mode, servers=args.servers, replication=args.replication,
                                              extra_args=extra_args))
    cluster.up(wait=90.0)
    try:
        seeds = cluster.addresses
        push(seeds, state, model=MODEL, tag=TAG)
        servers = sorted(s.server_id for s in cluster.slots)
        waves: list[dict[str, Any]] = []
        for n in range(args.waves):
            if n:
                time.sleep(args.pace)
            served, extra, seconds = wave(seeds, args.loads)
            waves.append({"by_server": served, "extra_bytes": extra, "seconds": seconds})
        total: dict[str, int] = {}
        later: dict[str, int] = {}
        for n, w in enumerate(waves):
            add(total, w["by_server"])
            if n:
                add(later, w["by_server"])
        cleanup_s: float | None = None
        if mode == "on":
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.cleanup_timeout:
                if extras_held(cluster) == 0:
                    cleanup_s = time.monotonic() - t0
                    break
                time.sleep(0.25)
        return {
            "mode": mode, "servers": servers, "by_server": total, "skew": skew(total, servers),
            "skew_after_first_wave": skew(later, servers) if later else None,
            "extra_bytes": sum(w["extra_bytes"] for w in waves), "wave_seconds": [round(w["seconds"], 3) for w in waves],
            "wave_skews": [round(skew(w["by_server"], servers), 3) for w in waves], "cleanup_s": cleanup_s,
        }
    finally:
        cluster.down()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--replication", type=int, default=2)
    p.add_argument("--mib", type=float, default=1.0, help="model size in MiB (default 1: 4 chunks of 256 KiB)")
    p.add_argument("--loads", type=int, default=6, help="concurrent cold loads per wave (default 6)")
    p.add_argument("--waves", type=int, default=6)
    p.add_argument("--pace", type=float, default=0.5, help="seconds between waves (default 0.5)")
    p.add_argument("--cleanup-timeout", type=float, default=60.0)
    p.add_argument("--dir", type=Path, help="cluster folders (default: a temporary one)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.replication >= args.servers:
        print(f"note: R={args.replication} on {args.servers} servers: every server holds every chunk, no extra copy "
              "can be placed; expect on == off", file=sys.stderr)
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-hot-"))
    root.mkdir(parents=True, exist_ok=True)
    state = synthetic_state_dict(total_bytes=int(args.mib * MiB), dtype=torch.bfloat16, seed=3)
    print(f"{args.servers} servers, R={args.replication}, model {args.mib:g} MiB, {args.waves} waves of {args.loads} "
          f"concurrent cold loads, {args.pace:g} s apart; hot settings {HOT_SETTINGS}")
    try:
        results = [run_mode(mode, args, root, state) for mode in ("off", "on")]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    for r in results:
        per = "  ".join(f"{s} {r['by_server'].get(s, 0) / MiB:6.2f}" for s in r["servers"])
        after = r["skew_after_first_wave"]
        print(f"hot chunks {r['mode']:>3}: MiB served {per} | skew max/mean {r['skew']:.3f} (waves 2..: "
              f"{after:.3f}) | from extra copies {r['extra_bytes'] / MiB:.2f} MiB | per-wave skew {r['wave_skews']}"
              + (f" | extras all dropped {r['cleanup_s']:.1f} s after the last wave" if r["cleanup_s"] is not None
                 else (" | extras NOT dropped within the timeout" if r["mode"] == "on" else "")))
    off, on = results
    late = on["skew_after_first_wave"] / off["skew_after_first_wave"]
    excess = (on["skew"] - 1) / (off["skew"] - 1) if off["skew"] > 1 else float("nan")
    print(f"ratio on/off: skew max/mean {on['skew'] / off['skew']:.3f} (waves 2..: {late:.3f}); "
          f"excess skew (max/mean - 1) {excess:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
