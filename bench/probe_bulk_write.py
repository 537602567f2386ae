#!/usr/bin/env python
"""Bulk write path: client-parallel fan-out vs chain replication, next to pipelined Redis SET (issue #12).

    .venv/bin/python bench/probe_bulk_write.py [--mib 512] [--rounds 3] [--fsync on,off] [--modes parallel,chain,redis]
                                               [--batch-mib 4] [--window 8] [--json FILE]

The parent packs a synthetic bf16 model of --mib MiB (chunking.synthetic, seed 0, ChunkingConfig())
and materialises its distinct stored chunks before any clock. Then, each round, in an order rotated
by one per round, for each fsync setting:

  parallel  SendSession(SendOptions(chain=False)): the client sends every PUT to each of the 3 replicas;
  chain     SendSession(SendOptions(chain=True)): the client sends each PUT once, to a head that turns
            per PUT; each server forwards to the next (route in the PUT) and acks for the whole chain;
  redis     redis-py + hiredis, SET pipelined 32 deep, of the same chunks into a fresh redis-server
            (no persistence, one copy): the baseline of the issue.

The servers are 3 fresh processes of this script (``--serve``: a ChunkStore with fsync on or off and
a BulkServer that may forward to the other two), started for one measurement and stopped after it;
no Raft, no gRPC: this measures the write path alone. The clock runs from the first submit to
finish() returning (every chunk acked, durably, by all 3 replicas). Figures: model bytes / seconds,
median over rounds; CPU: the client's own (getrusage) and the 3 servers' (utime + stime from
/proc/PID/stat), per model byte. Every measurement checks that every server holds every chunk (a
bulk read of each, CRC-checked) after the clock. Compare figures of one run only: the machine is
shared and noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.measure import stat_cpu_s  # noqa: E402 - after the path

TOKEN = "probe-admin-token"


# ------------------------------------------------------------------ server child


def serve_main(a: argparse.Namespace) -> int:
    from paramserver.server.auth import AuthConfig
    from paramserver.server.bulk_port import BulkServer, BulkServerConfig
    from paramserver.server.store import ChunkStore

    store = ChunkStore(a.dir, cache_bytes=0, fsync=a.fsync == "on", server_id=a.id)
    peers = frozenset(p for p in a.peers.split(",") if p)
    server = BulkServer(store, AuthConfig(admin_token=TOKEN), a.listen, BulkServerConfig(store_workers=a.store_workers), server_id=a.id,
                        forward_to=lambda: peers).start()
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    print("ready", server.address, flush=True)
    while not stop[0]:
        time.sleep(0.1)
    server.stop()
    store.close()
    return 0


# ------------------------------------------------------------------ helpers


def free_port() -> int:
    from deploy.local import free_port as fp

    return fp()


def proc_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += stat_cpu_s(f"/proc/{pid}/stat")
        except (OSError, IndexError, ValueError):
            pass
    return total


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class MiniCluster:
    def __init__(self, root: Path, fsync: str, store_workers: int = 2) -> None:
        self.root = root
        ports = [free_port() for _ in range(3)]
        self.addresses = [f"127.0.0.1:{p}" for p in ports]
        self.procs: list[subprocess.Popen[str]] = []
        for i, address in enumerate(self.addresses):
            d = root / f"s{i}"
            d.mkdir(parents=True)
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "--serve", "--id", f"s{i}", "--dir", str(d), "--listen", address,
                 "--peers", ",".join(self.addresses), "--fsync-mode", fsync, "--store-workers", str(store_workers)],
                stdout=subprocess.PIPE, text=True, start_new_session=True))  # fmt: skip
        for p in self.procs:
            line = p.stdout.readline() if p.stdout else ""
            if not line.startswith("ready"):
                self.stop()
                raise SystemExit(f"a probe server did not start: {line!r}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def load_chunks(mib: int) -> tuple[list[Any], int]:
    import torch

    from chunking.config import ChunkingConfig
    from chunking.pack import pack
    from chunking.synthetic import synthetic_state_dict
    from paramserver.client.rpc import ChunkData

    state = synthetic_state_dict(mib << 20, dtype=torch.bfloat16, seed=0)
    packed = pack(state, model="probe", config=ChunkingConfig())
    chunks = []
    for ref in packed.manifest.unique_chunks():
        c = packed.chunk(ref.index)
        chunks.append(ChunkData(ref.id, ref.codec, ref.raw_size, ref.crc32c, c.data))
    return chunks, packed.manifest.raw_bytes


def check_stored(addresses: list[str], chunks: list[Any]) -> str:
    from chunking.hashing import crc32c
    from paramserver.client.bulk_transport import BulkClient
    from paramserver.wire.bulk_frames import OK

    want = {c.id: c.crc32c for c in chunks}
    for address in addresses:
        client = BulkClient(address, TOKEN)
        try:
            bad = sum(1 for item in client.fetch(list(want)) if item.status != OK or crc32c(item.data) != want[item.id])
        finally:
            client.close()
        if bad:
            return f"{address}: {bad} of {len(want)} chunks missing or wrong"
    return "ok"


def measure_send(chain: bool, fsync: str, chunks: list[Any], model_bytes: int, root: Path, a: argparse.Namespace) -> dict[str, Any]:
    from paramserver.client.push_plan import AckLedger
    from paramserver.client.push_sender import SendOptions, SendSession
    from paramserver.wire.proto import pb

    cluster = MiniCluster(root, fsync, a.store_workers)
    try:
        ids = [f"s{i}" for i in range(3)]
        members = {s: pb.Member(server_id=s, grpc_address="127.0.0.1:1", bulk_address=addr) for s, addr in zip(ids, cluster.addresses)}
        view = SimpleNamespace(members=members, options=SimpleNamespace(token=TOKEN, tls=False, tls_ca=None, tls_cert=None),
                               server_client=lambda s: (_ for _ in ()).throw(RuntimeError("no gRPC in this probe")))
        ledger = AckLedger({c.id: ids for c in chunks}, 2)
        options = SendOptions(chain=chain, batch_bytes=a.batch_mib << 20, window=a.window)
        cpu0, scpu0, t0 = self_cpu_s(), proc_cpu_s(cluster.pids), time.perf_counter()
        with SendSession(view, ledger, options, lambda n: None) as session:  # type: ignore[arg-type]
            for k, c in enumerate(chunks):
                session.submit(c, ids[k % 3:] + ids[: k % 3])  # ring-like orders, as the real placement gives
            failed = session.finish()
            stats = session.stats
        seconds = time.perf_counter() - t0
        cpu, scpu = self_cpu_s() - cpu0, proc_cpu_s(cluster.pids) - scpu0
        full = sum(1 for c in chunks if ledger.count(c.id) == 3)
        check = check_stored(cluster.addresses, chunks)
        return {"seconds": seconds, "gbps": model_bytes / seconds / 1e9, "client_ns_per_b": cpu / model_bytes * 1e9,
                "server_ns_per_b": scpu / model_bytes * 1e9, "failed": {k: str(v) for k, v in failed.items()},
                "acked_by_all": f"{full}/{len(chunks)}", "check": check, "chain_puts": stats.chain_puts,
                "chain_off": stats.chain_off, "puts": stats.bulk_puts}
    finally:
        cluster.stop()


def measure_redis(chunks: list[Any], model_bytes: int, root: Path) -> dict[str, Any]:
    import redis
    import redis.utils

    from deploy.redis_baseline import RedisServer

    server = RedisServer(root)
    try:
        r = server.client()
        values = [c.data for c in chunks]
        cpu0, scpu0, t0 = self_cpu_s(), proc_cpu_s([server.proc.pid]), time.perf_counter()
        for start in range(0, len(chunks), 32):
            pipe = r.pipeline(transaction=False)
            for c, v in zip(chunks[start : start + 32], values[start : start + 32]):
                pipe.set(c.id, v)
            pipe.execute()
        seconds = time.perf_counter() - t0
        cpu, scpu = self_cpu_s() - cpu0, proc_cpu_s([server.proc.pid]) - scpu0
        check = "ok" if r.dbsize() == len(chunks) else f"dbsize {r.dbsize()} != {len(chunks)}"
        return {"seconds": seconds, "gbps": model_bytes / seconds / 1e9, "client_ns_per_b": cpu / model_bytes * 1e9,
                "server_ns_per_b": scpu / model_bytes * 1e9, "check": check, "hiredis": bool(redis.utils.HIREDIS_AVAILABLE)}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fsync", default="on,off", help="fsync settings to measure: on, off or on,off")
    p.add_argument("--modes", default="parallel,chain,redis")
    p.add_argument("--batch-mib", type=int, default=4)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--store-workers", type=int, default=2, help="BulkServerConfig.store_workers of the servers")
    p.add_argument("--json")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--id", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--listen", help=argparse.SUPPRESS)
    p.add_argument("--peers", default="", help=argparse.SUPPRESS)
    p.add_argument("--fsync-mode", dest="fsync_mode", default="on", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        a.fsync = a.fsync_mode
        return serve_main(a)
    modes = [m for m in a.modes.split(",") if m]
    fsyncs = [f for f in a.fsync.split(",") if f]
    rows = [(m, f) for m in modes for f in (fsyncs if m != "redis" else ["-"])]
    t = time.perf_counter()
    chunks, model_bytes = load_chunks(a.mib)
    print(f"model: {model_bytes / 2**20:.0f} MiB bf16, {len(chunks)} distinct chunks ({sum(len(c.data) for c in chunks) / 2**20:.0f} MiB "
          f"stored), packed in {time.perf_counter() - t:.1f}s; batch {a.batch_mib} MiB, window {a.window}, store workers "
          f"{a.store_workers}; {os.cpu_count()} CPUs",
          flush=True)
    results: dict[str, list[dict[str, Any]]] = {f"{m}/{f}": [] for m, f in rows}
    tmp = Path(tempfile.mkdtemp(prefix="probe-bulk-write-"))
    try:
        for rnd in range(a.rounds):
            order = rows[rnd % len(rows):] + rows[: rnd % len(rows)]
            for mode, fsync in order:
                where = tmp / f"r{rnd}-{mode}-{fsync}"
                where.mkdir()
                if mode == "redis":
                    r = measure_redis(chunks, model_bytes, where)
                else:
                    r = measure_send(mode == "chain", fsync, chunks, model_bytes, where, a)
                results[f"{mode}/{fsync}"].append(r)
                print(f"round {rnd + 1} {mode:8s} fsync={fsync:3s} {r['gbps']:.3f} GB/s  {r['seconds']:.2f}s  "
                      f"client {r['client_ns_per_b']:.2f} ns/B  servers {r['server_ns_per_b']:.2f} ns/B  check={r['check']}"
                      + (f"  failed={r['failed']}" if r.get("failed") else "")
                      + (f"  chain_off={r['chain_off'][:80]}" if r.get("chain_off") else ""), flush=True)
                shutil.rmtree(where, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nmedians over", a.rounds, "rounds (model bytes / s; CPU per model byte):")
    summary = {}
    for key, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("gbps", "seconds", "client_ns_per_b", "server_ns_per_b")}
        summary[key] = med
        print(f"  {key:16s} {med['gbps']:.3f} GB/s  client {med['client_ns_per_b']:.2f} ns/B  servers {med['server_ns_per_b']:.2f} ns/B"
              f"  (rounds: {', '.join(format(r['gbps'], '.3f') for r in rs)})")
    if "redis/-" in summary:
        for key, med in summary.items():
            if key != "redis/-":
                print(f"  {key:16s} / redis = {med['gbps'] / summary['redis/-']['gbps']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "medians": summary}, indent=1))
    bad = [r for rs in results.values() for r in rs if r["check"] != "ok" or r.get("failed")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
