#!/usr/bin/env python
"""Throughput probe for GetChunks on loopback: pick the coalescing default.

Starts one data-plane server process (python -m paramserver.server.dataplane_dev),
pushes a data set of random 256 KiB chunks, then streams about --total-mib
through GetChunks for each message size and prints GB/s (push GB/s too).
The machine is noisy: compare figures within one run only.

    python bench/probe_getchunks.py [--dataset-mib 128] [--total-mib 512] [--sizes 256K,1M,2M,4M]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chunking.hashing import content_id
from paramserver.client.rpc import ParamServerClient, make_chunk
from paramserver.wire.proto import pb

KiB, MiB = 1024, 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": KiB, "M": MiB}.get(text[-1], 1)
    return int(text.rstrip("KM")) * mult


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset-mib", type=int, default=128, help="distinct chunk bytes pushed (default 128)")
    p.add_argument("--total-mib", type=int, default=512, help="bytes streamed per message size (default 512)")
    p.add_argument("--chunk-kib", type=int, default=256, help="chunk size (default 256)")
    p.add_argument("--sizes", default="256K,1M,2M,4M", help="GetChunks max_message_bytes values")
    p.add_argument("--cache-mib", type=int, default=256, help="server hot cache (default 256; 0 = read from disk every time)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen(
            [sys.executable, "-m", "paramserver.server.dataplane_dev", "--data-dir", f"{tmp}/data", "--port-file", str(port_file),
             "--no-fsync", "--cache-bytes", str(args.cache_mib * MiB)],
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("server did not start")
                time.sleep(0.05)
            client = ParamServerClient(f"127.0.0.1:{port_file.read_text()}")
            client.wait_ready(10)
            n = args.dataset_mib * MiB // (args.chunk_kib * KiB)
            chunks = []
            for _ in range(n):
                data = os.urandom(args.chunk_kib * KiB)
                chunks.append(make_chunk(content_id(data), data))
            ids = [c.id for c in chunks]
            t0 = time.perf_counter()
            reply = client.put_chunks(chunks, batch_bytes=4 * MiB)
            dt = time.perf_counter() - t0
            print(f"push: {reply.bytes_stored / MiB:.0f} MiB in {dt:.2f} s = {reply.bytes_stored / dt / 1e9:.2f} GB/s "
                  "(no fsync, ingest verifies CRC32C + BLAKE3)")
            del chunks
            list(client.get_chunks(ids))  # warm the server cache / page cache
            rounds = max(1, args.total_mib // args.dataset_mib)
            print(f"GetChunks: {rounds} x {args.dataset_mib} MiB of {args.chunk_kib} KiB chunks per message size")
            for size_text in args.sizes.split(","):
                size = parse_size(size_text)
                t0 = time.perf_counter()
                nbytes = messages = 0
                for _ in range(rounds):
                    for reply in client.stub.GetChunks(client_request(ids, size)):
                        messages += 1
                        for c in reply.chunks:
                            nbytes += len(c.data)
                dt = time.perf_counter() - t0
                print(f"  max_message_bytes {size_text:>5}: {nbytes / dt / 1e9:5.2f} GB/s  ({messages} messages, {dt:.2f} s)")
            client.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return 0


def client_request(ids: list[str], size: int) -> pb.GetChunksRequest:
    return pb.GetChunksRequest(ids=ids, max_message_bytes=size)


if __name__ == "__main__":
    sys.exit(main())
