#!/usr/bin/env python
"""Pull a 1 GiB model from a local 3-server cluster and compare, in the same run, with
(a) the same 256 KiB chunks read from Redis (redis-py + hiredis, pipeline 32) and
(b) safetensors.torch.load_file of the same model from local disk. The pull runs over the
servers' bulk TCP ports (paramserver.wire.bulk_frames) and over gRPC GetChunks, each with CRC32C and with
CRC32C + BLAKE3 verification. Also prints push GB/s.

    python bench/bench_pull.py [--size-mib 1024] [--rounds 5] [--streams 3] [--server-cache-mib 1024] [--fsync] [--scrub-mb-per-s 0]

Starts its own cluster (deploy.local) and its own redis-server on 127.0.0.1 with
a free port, in a temporary folder, and stops both. The machine is noisy:
compare figures within one run only. Each round runs every method once, in turn, starting
one method later than the round before (whatever runs first after a pause or after the
push is slower); each figure is the best (and the median) of --rounds. Pulls after the first
reuse the memory the previous pull released (paramserver.client.hostmem), as a process that loads
version after version does; one row shows a pull into fresh memory every time.
"""
from __future__ import annotations

import argparse
import os
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable



from chunking.config import ChunkingConfig
from chunking.pack import pack
from chunking.synthetic import synthetic_state_dict
from deploy.local import LocalCluster, LocalClusterConfig
from deploy.redis_baseline import RedisServer
from paramserver.client.pull import PullOptions, pull_tensors
from paramserver.client.push import push

MiB = 1 << 20


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of this process and of ``pids`` (all their threads), from /proc.

    The machine is shared: wall-clock figures swing 2-3x with the neighbours' load, while the
    CPU that each method spends per byte does not. Linux only; 0 for pids that are gone.
    """
    total = sum(os.times()[:2])
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024, help="model size in MiB (default 1024)")
    p.add_argument("--rounds", type=int, default=5, help="timed runs per method; the best is reported (default 5)")
    p.add_argument("--streams", type=int, default=PullOptions().streams_per_server, help="GetChunks streams per server")
    p.add_argument("--message-kib", type=int, default=PullOptions().message_bytes // 1024, help="GetChunks message size in KiB")
    p.add_argument("--pipeline", type=int, default=32, help="Redis pipeline depth (default 32)")
    p.add_argument("--fsync", action="store_true", help="servers fsync every chunk write (default: --no-fsync; affects push only)")
    p.add_argument(
        "--server-cache-mib", type=int, default=1024,
        help="each server's hot-chunk cache (default 1024, so the model stays in memory as it does in Redis; "
        "with less than a server's share of the model a sequential pull cycles the LRU and every read goes to disk)",
    )  # fmt: skip
    p.add_argument(
        "--scrub-mb-per-s", type=int, default=0,
        help="servers' background scrub rate (default 0: off; it verifies the store at a fixed rate whatever the "
        "clients do, and on 2 cores its CPU would be charged to the pull rows)",
    )  # fmt: skip
    p.add_argument("--dir", type=Path, default=None, help="working folder (default: a temporary folder)")
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-pull-", dir=args.dir))
    redis_server: RedisServer | None = None
    server_args = ("--cache-mb", str(args.server_cache_mib), "--scrub-mb-per-s", str(args.scrub_mb_per_s),
                   *(() if args.fsync else ("--no-fsync",)))
    cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3, extra_args=server_args))
    rows: list[tuple[str, float, float, int]] = []
    try:
        print(f"generating a {args.size_mib} MiB float32 model ...", flush=True)
        state = synthetic_state_dict(args.size_mib * MiB, seed=0)
        model_file = root / "model.safetensors"
        from safetensors.torch import load_file, save_file

        save_file(state, str(model_file))
        cluster.up(wait=120)
        print(f"cluster up: {cluster.seed}", flush=True)

        t0 = time.perf_counter()
        report = push(cluster.seed, state, model="bench", tag="prod")
        push_s = time.perf_counter() - t0
        print(
            f"push: {report.bytes_total / MiB:.0f} MiB in {push_s:.2f} s = {report.gbps:.2f} GB/s end to end "
            f"(upload {report.upload_gbps:.2f} GB/s over the wire, R={report.replication}, {report.wire_bytes / MiB:.0f} MiB sent; "
            f"{'fsync' if args.fsync else 'no fsync'})",
            flush=True,
        )

        base = PullOptions(streams_per_server=args.streams, message_bytes=args.message_kib * 1024)
        methods: list[tuple[str, Callable[[], int]]] = []
        for name, options in [
            ("pull, bulk TCP (CRC32C verify + assemble)", dataclasses.replace(base, verify="crc", bulk=True)),
            ("pull, bulk TCP --verify content (+BLAKE3)", dataclasses.replace(base, verify="content", bulk=True)),
            ("pull, bulk TCP, fresh memory every pull", dataclasses.replace(base, verify="crc", bulk=True, recycle_memory=False)),
            ("pull, gRPC GetChunks (CRC32C verify + assemble)", dataclasses.replace(base, verify="crc", bulk=False)),
            ("pull, gRPC GetChunks --verify content", dataclasses.replace(base, verify="content", bulk=False)),
        ]:

            def do_pull(options: PullOptions = options) -> int:
                tensors, r = pull_tensors(cluster.seed, "bench:prod", options=options)
                del tensors
                if options.bulk and r.bulk_bytes != r.bytes_fetched:
                    print(f"  note: only {r.bulk_bytes} of {r.bytes_fetched} bytes came over bulk ({r.bulk_fallbacks} fallbacks)")
                return r.bytes_total

            methods.append((name, do_pull))

        # (a) Redis: the same stored chunks, keyed by content id.
        packed = pack(state, model="bench", config=ChunkingConfig())
        redis_server = RedisServer(root)
        r = redis_server.client()
        ids = [c.id for c in packed.manifest.unique_chunks()]
        pipe = r.pipeline(transaction=False)
        for i, chunk in enumerate(packed.chunks(unique=True)):
            pipe.set(chunk.ref.id, chunk.data)
            if i % args.pipeline == args.pipeline - 1:
                pipe.execute()
        pipe.execute()
        del packed
        import redis.utils

        hiredis = "yes" if redis.utils.HIREDIS_AVAILABLE else "NO"
        print(f"redis: {len(ids)} chunks loaded on port {redis_server.port} (hiredis {hiredis})", flush=True)

        def do_redis() -> int:
            n = 0
            for start in range(0, len(ids), args.pipeline):
                pipe = r.pipeline(transaction=False)
                for cid in ids[start : start + args.pipeline]:
                    pipe.get(cid)
                for value in pipe.execute():
                    n += len(value)
            return n

        methods.append((f"redis GET, pipeline {args.pipeline} (bytes only, no verify)", do_redis))

        # (b) Local disk (page cache warm: the file was just written and read).
        def do_load() -> int:
            # load_file maps the file lazily; copying every tensor out makes it read every byte,
            # as a pull does (the page cache is warm: the file was just written).
            tensors = load_file(str(model_file))
            return sum(t.clone().numel() * t.element_size() for t in tensors.values())

        methods.append(("safetensors load_file + read (local disk, warm)", do_load))

        # The machine is noisy: every round runs every method once, in turn, so that a busy
        # spell hits them all alike; each figure is the best (and the median) over the rounds.
        for _name, fn in methods:
            fn()  # warm-up: server caches, page cache, Redis, connections
        times: dict[str, list[float]] = {name: [] for name, _fn in methods}
        cpu: dict[str, list[float]] = {name: [] for name, _fn in methods}
        sizes: dict[str, int] = {}
        # CPU of the client (this process) plus the servers it reads from: the 3 paramservers, or redis-server.
        server_pids = [slot.pid for slot in cluster.slots if slot.pid]
        pids_of = {name: ([redis_server.proc.pid] if name.startswith("redis") else [] if name.startswith("safetensors") else server_pids)
                   for name, _fn in methods}
        for round_no in range(args.rounds):
            shift = round_no % len(methods)
            for name, fn in methods[shift:] + methods[:shift]:
                c0 = cpu_seconds(pids_of[name])
                t0 = time.perf_counter()
                sizes[name] = fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(cpu_seconds(pids_of[name]) - c0)
                print(f"round {round_no + 1}: {name}: {sizes[name] / times[name][-1] / 1e9:.2f} GB/s, "
                      f"{cpu[name][-1] / sizes[name] * 1e9:.2f} CPU ns/B", flush=True)
        rows = [(name, min(times[name]), statistics.median(times[name]), sizes[name]) for name, _fn in methods]
        cpu_ns = {name: min(cpu[name]) / sizes[name] * 1e9 for name, _fn in methods}
        r.close()
        redis_server.stop()
        redis_server = None

        print()
        cores = os.cpu_count() or 1
        print(f"{'method':48s} {'best GB/s':>10s} {'median GB/s':>12s} {'CPU ns/B':>9s} {f'GB/s on {cores} idle cores':>22s}")
        for name, best, median, nbytes in rows:
            # client + server CPU per byte: a figure the neighbours' load does not move much
            print(f"{name:48s} {nbytes / best / 1e9:10.2f} {nbytes / median / 1e9:12.2f} {cpu_ns[name]:9.2f} {cores / cpu_ns[name]:22.2f}")
        gbps = [nbytes / best / 1e9 for _name, best, _m, nbytes in rows]
        bulk_gbps, bulk_content_gbps, fresh_gbps, grpc_gbps, grpc_content_gbps, redis_gbps, disk_gbps = gbps
        print()
        print(f"bulk pull / redis = {bulk_gbps / redis_gbps:.2f}x  (target >= 1.0x, goal 1.5x); "
              f"--verify content {bulk_content_gbps / redis_gbps:.2f}x")
        print(f"bulk pull into fresh memory / redis = {fresh_gbps / redis_gbps:.2f}x (the first pull of a process)")
        print(f"gRPC pull / redis = {grpc_gbps / redis_gbps:.2f}x; --verify content {grpc_content_gbps / redis_gbps:.2f}x")
        print(f"bulk / gRPC       = {bulk_gbps / grpc_gbps:.2f}x")
        names = [name for name, *_ in rows]
        bulk_cpu, redis_cpu, grpc_cpu = cpu_ns[names[0]], cpu_ns[names[5]], cpu_ns[names[3]]
        print(f"CPU per byte (client + servers): bulk {bulk_cpu:.2f} ns/B, gRPC {grpc_cpu:.2f}, redis {redis_cpu:.2f}; "
              f"redis / bulk = {redis_cpu / bulk_cpu:.2f}x (above 1: the bulk pull needs less CPU per byte than Redis)")
        print(f"bulk pull / local disk = {bulk_gbps / disk_gbps:.2f}x; gRPC pull / local disk = {grpc_gbps / disk_gbps:.2f}x")
        print(f"push              = {report.gbps:.2f} GB/s end to end, {report.upload_gbps:.2f} GB/s over the wire")
        return 0
    finally:
        if redis_server is not None:
            redis_server.stop()
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
