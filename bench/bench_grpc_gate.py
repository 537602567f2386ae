#!/usr/bin/env python
"""What the gRPC port's connection gate costs: the same server read through the gate (its --listen
port) and straight from the unix socket behind it, in one run.

Starts one server (python -m paramserver.server.dataplane_dev), pushes --dataset-mib of random
256 KiB chunks, then per round, in rotated order (gate, direct / direct, gate):
- "stream": GetChunks of the whole data set on one channel (GB/s; the gRPC-only data path,
  paramctl pull --no-bulk), and
- "connect": --connects fresh channels, each timed from creation to its first ServerStatus
  answer (what a new client waits for).
Prints medians and the gate/direct ratios. The machine is noisy: compare within one run only.

    python bench/bench_grpc_gate.py [--dataset-mib 256] [--rounds 6] [--connects 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from chunking.hashing import content_id
from paramserver.client.rpc import ParamServerClient, make_chunk
from paramserver.wire.grpc_options import channel_options
from paramserver.wire.proto import pb, pb_grpc

MiB = 1 << 20
CHUNK = 256 << 10


def _channel(address: str) -> grpc.Channel:
    # The same channel for both paths (the clients' options); ParamServerClient takes HOST:PORT only.
    return grpc.insecure_channel(address, options=channel_options())


def stream_gbps(address: str, ids: list[str]) -> float:
    with _channel(address) as channel:
        stub = pb_grpc.ParamServerStub(channel)
        stub.ServerStatus(pb.ServerStatusRequest(), timeout=10, wait_for_ready=True)
        t0 = time.perf_counter()
        nbytes = sum(len(c.data) for reply in stub.GetChunks(pb.GetChunksRequest(ids=ids)) for c in reply.chunks)
        return nbytes / (time.perf_counter() - t0) / 1e9


def connect_ms(address: str) -> float:
    t0 = time.perf_counter()
    with _channel(address) as channel:
        pb_grpc.ParamServerStub(channel).ServerStatus(pb.ServerStatusRequest(), timeout=10, wait_for_ready=True)
        return (time.perf_counter() - t0) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset-mib", type=int, default=256, help="distinct chunk bytes pushed and streamed per measure (default 256)")
    p.add_argument("--rounds", type=int, default=6, help="rounds; each measures both paths, order rotated (default 6)")
    p.add_argument("--connects", type=int, default=20, help="fresh connections timed per path per round (default 20)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-gate-") as tmp:
        port_file, backend_file = Path(tmp) / "port", Path(tmp) / "backend"
        proc = subprocess.Popen([sys.executable, "-m", "paramserver.server.dataplane_dev", "--data-dir", f"{tmp}/data",
                                 "--port-file", str(port_file), "--backend-file", str(backend_file), "--no-fsync"],
                                stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("bench_grpc_gate: the server did not start")
                time.sleep(0.05)
            paths = {"gate": f"127.0.0.1:{port_file.read_text()}", "direct": f"unix:{backend_file.read_text()}"}
            seeder = ParamServerClient(paths["gate"])
            seeder.wait_ready(10)
            chunks = [make_chunk(content_id(d), d) for d in (os.urandom(CHUNK) for _ in range(args.dataset_mib * MiB // CHUNK))]
            ids = [c.id for c in chunks]
            seeder.put_chunks(chunks, batch_bytes=4 * MiB)
            seeder.close()
            del chunks
            stream_gbps(paths["direct"], ids)  # warm the server's cache and page cache once
            gbps: dict[str, list[float]] = {k: [] for k in paths}
            ms: dict[str, list[float]] = {k: [] for k in paths}
            for rnd in range(args.rounds):
                order = ["gate", "direct"] if rnd % 2 == 0 else ["direct", "gate"]
                for name in order:
                    gbps[name].append(stream_gbps(paths[name], ids))
                    ms[name].extend(connect_ms(paths[name]) for _ in range(args.connects))
            print(f"{args.dataset_mib} MiB of 256 KiB chunks, {args.rounds} rounds (order rotated), "
                  f"{args.connects} fresh connections per path per round; one server, loopback, no TLS")
            for name in paths:
                print(f"  {name:6}  stream median {statistics.median(gbps[name]):.3f} GB/s (min {min(gbps[name]):.3f}, "
                      f"max {max(gbps[name]):.3f})   connect + first call median {statistics.median(ms[name]):.2f} ms")
            print(f"  gate/direct: stream {statistics.median(gbps['gate']) / statistics.median(gbps['direct']):.3f}x, "
                  f"connect {statistics.median(ms['gate']) / statistics.median(ms['direct']):.3f}x")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
