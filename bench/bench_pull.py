#!/usr/bin/env python
"""Pull a 1 GiB model from a local 3-server cluster and compare, in the same run, with
(a) the same 256 KiB chunks read from Redis (redis-py + hiredis, pipeline 32) and
(b) safetensors.torch.load_file of the same model from local disk. Also prints push GB/s.

    python bench/bench_pull.py [--size-mib 1024] [--rounds 3] [--streams 3] [--server-cache-mib 1024] [--fsync]

Starts its own cluster (deploy.local) and its own redis-server on 127.0.0.1 with
a free port, in a temporary folder, and stops both. The machine is noisy:
compare figures within one run only. Each figure is the best of --rounds.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable


from chunking.config import ChunkingConfig
from chunking.pack import pack
from chunking.synthetic import synthetic_state_dict
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.pull import PullOptions, pull_tensors
from paramserver.push import push

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def best_of(rounds: int, fn: Callable[[], int]) -> tuple[float, float, int]:
    """(best seconds, median seconds, bytes) over ``rounds`` runs of ``fn`` (which returns bytes moved)."""
    times = []
    nbytes = 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        nbytes = fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), nbytes


class RedisServer:
    def __init__(self, root: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed: apt-get install redis-server (Debian), then run again")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(root), "--protected-mode", "yes", "--maxmemory", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=60)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return client
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit("redis-server did not start")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024, help="model size in MiB (default 1024)")
    p.add_argument("--rounds", type=int, default=3, help="timed runs per method; the best is reported (default 3)")
    p.add_argument("--streams", type=int, default=PullOptions().streams_per_server, help="GetChunks streams per server")
    p.add_argument("--message-kib", type=int, default=PullOptions().message_bytes // 1024, help="GetChunks message size in KiB")
    p.add_argument("--pipeline", type=int, default=32, help="Redis pipeline depth (default 32)")
    p.add_argument("--fsync", action="store_true", help="servers fsync every chunk write (default: --no-fsync; affects push only)")
    p.add_argument(
        "--server-cache-mib", type=int, default=1024,
        help="each server's hot-chunk cache (default 1024, so the model stays in memory as it does in Redis; "
        "with less than a server's share of the model a sequential pull cycles the LRU and every read goes to disk)",
    )  # fmt: skip
    p.add_argument("--dir", type=Path, default=None, help="working folder (default: a temporary folder)")
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-pull-", dir=args.dir))
    redis_server: RedisServer | None = None
    server_args = ("--cache-mb", str(args.server_cache_mib), *(() if args.fsync else ("--no-fsync",)))
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

        options = PullOptions(streams_per_server=args.streams, message_bytes=args.message_kib * 1024)
        pull_tensors(cluster.seed, "bench:prod", options=options)  # warm server caches and page cache

        def do_pull() -> int:
            tensors, r = pull_tensors(cluster.seed, "bench:prod", options=options)
            del tensors
            return r.bytes_total

        rows.append(("paramserver pull (BLAKE3 verify + assemble)", *best_of(args.rounds, do_pull)))
        crc_options = PullOptions(streams_per_server=args.streams, message_bytes=args.message_kib * 1024, verify="crc")

        def do_pull_crc() -> int:
            tensors, r = pull_tensors(cluster.seed, "bench:prod", options=crc_options)
            del tensors
            return r.bytes_total

        rows.append(("paramserver pull --verify crc (CRC32C + assemble)", *best_of(args.rounds, do_pull_crc)))

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
        import redis.utils

        print(f"redis: {len(ids)} chunks loaded on port {redis_server.port} (hiredis {'yes' if redis.utils.HIREDIS_AVAILABLE else 'NO'})", flush=True)

        def do_redis() -> int:
            n = 0
            for start in range(0, len(ids), args.pipeline):
                pipe = r.pipeline(transaction=False)
                for cid in ids[start : start + args.pipeline]:
                    pipe.get(cid)
                for value in pipe.execute():
                    n += len(value)
            return n

        do_redis()  # warm-up
        rows.append((f"redis GET, pipeline {args.pipeline} (bytes only, no verify)", *best_of(args.rounds, do_redis)))
        r.close()
        redis_server.stop()
        redis_server = None

        # (b) Local disk (page cache warm: the file was just written and read).
        def do_load() -> int:
            # load_file maps the file lazily; copying every tensor out makes it read every byte,
            # as a pull does (the page cache is warm: the file was just written).
            tensors = load_file(str(model_file))
            return sum(t.clone().numel() * t.element_size() for t in tensors.values())

        do_load()
        rows.append(("safetensors load_file + read (local disk, warm)", *best_of(args.rounds, do_load)))

        print()
        print(f"{'method':48s} {'best GB/s':>10s} {'median GB/s':>12s}")
        for name, best, median, nbytes in rows:
            print(f"{name:48s} {nbytes / best / 1e9:10.2f} {nbytes / median / 1e9:12.2f}")
        gbps = {name: nbytes / best / 1e9 for name, best, _m, nbytes in rows}
        pull_gbps, crc_gbps, redis_gbps, disk_gbps = (gbps[name] for name, *_ in rows)
        print()
        print(f"pull / redis      = {pull_gbps / redis_gbps:.2f}x   (target >= 1.0x, goal 1.5x); with --verify crc {crc_gbps / redis_gbps:.2f}x")
        print(f"pull / local disk = {pull_gbps / disk_gbps:.2f}x; with --verify crc {crc_gbps / disk_gbps:.2f}x")
        print(f"push              = {report.gbps:.2f} GB/s end to end, {report.upload_gbps:.2f} GB/s over the wire")
        return 0
    finally:
        if redis_server is not None:
            redis_server.stop()
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
