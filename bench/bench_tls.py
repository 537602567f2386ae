#!/usr/bin/env python
"""Pull GB/s of one model from a plaintext cluster (bulk TCP ports, and gRPC GetChunks) against a
mutual-TLS cluster (gRPC GetChunks only: the bulk port is plaintext, so it stays off under TLS).

    python bench/bench_tls.py [--size-mib 256] [--rounds 5] [--verify crc]

Starts two local 3-server clusters in a temporary folder (``deploy.local``; the TLS one with
``--tls``: a private CA, per-server certificates, servers calling each other over mutual TLS),
pushes the same model to both, then pulls it into memory round after round, each round running
the three methods in turn and starting one later than the round before. Prints best and median
GB/s per method and the ratios, from the same run (the machine is noisy: compare within a run).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from chunking.synthetic import synthetic_state_dict
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.cluster_view import ClusterOptions
from paramserver.client.pull import PullOptions, pull_tensors
from paramserver.client.push import push

MiB = 1 << 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256, help="model size in MiB (default 256)")
    p.add_argument("--rounds", type=int, default=5, help="pulls per method (default 5)")
    p.add_argument("--verify", choices=("crc", "content"), default="crc", help="verification mode of the pulls (default crc)")
    args = p.parse_args()

    server_args = ("--no-fsync", "--cache-mb", str(max(256, 2 * args.size_mib)), "--scrub-mb-per-s", "0")
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp:
        plain = LocalCluster(LocalClusterConfig(root=Path(tmp) / "plain", servers=3, extra_args=server_args))
        tls = LocalCluster(LocalClusterConfig(root=Path(tmp) / "tls", servers=3, extra_args=server_args, tls=True))
        try:
            plain.up(wait=120)
            tls.up(wait=120)
            state = synthetic_state_dict(args.size_mib * MiB, seed=0)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            plain_opts = plain.client_settings().validate().cluster_options(write=True)
            tls_opts = tls.client_settings().validate().cluster_options(write=True)
            for name, opts in (("plaintext", plain_opts), ("mutual TLS", tls_opts)):
                t0 = time.perf_counter()
                push(opts.seeds, state, model="bench", tag="prod", cluster=opts)
                print(f"pushed {nbytes / MiB:.0f} MiB to the {name} cluster in {time.perf_counter() - t0:.1f} s")
            del state

            base = PullOptions(verify=args.verify)
            methods: list[tuple[str, Callable[[], float]]] = []

            def method(label: str, opts: ClusterOptions, options: PullOptions, want_bulk: bool) -> None:
                def run() -> float:
                    tensors, report = pull_tensors(opts.seeds, "bench:prod", options=options, cluster=opts)
                    assert report.bytes_total == nbytes, (report.bytes_total, nbytes)
                    assert (report.bulk_bytes > 0) == want_bulk, f"{label}: bulk bytes {report.bulk_bytes}"
                    del tensors
                    return report.gbps
                methods.append((label, run))

            method("plaintext, bulk TCP", plain_opts, dataclasses.replace(base, bulk=True), True)
            method("plaintext, gRPC GetChunks", plain_opts, dataclasses.replace(base, bulk=False), False)
            method("mutual TLS, gRPC GetChunks", tls_opts, dataclasses.replace(base, bulk=True), False)
            for _, run in methods:  # warm-up: the first pull of a process pays for fresh memory
                run()
            results: dict[str, list[float]] = {label: [] for label, _ in methods}
            for r in range(args.rounds):
                for i in range(len(methods)):
                    label, run = methods[(r + i) % len(methods)]
                    results[label].append(run())
        finally:
            tls.down()
            plain.down()

    print(f"\npull of a {nbytes / MiB:.0f} MiB model into memory, verify={args.verify}, 3 servers each, {args.rounds} rounds:")
    width = max(len(label) for label in results)
    for label, values in results.items():
        print(f"  {label:<{width}}  best {max(values):5.2f} GB/s  median {statistics.median(values):5.2f} GB/s  "
              f"({', '.join(f'{v:.2f}' for v in values)})")
    bulk, grpc_plain, grpc_tls = (results[label] for label, _ in methods)
    print(f"  TLS gRPC / plaintext bulk: best {max(grpc_tls) / max(bulk):.2f}x, "
          f"median {statistics.median(grpc_tls) / statistics.median(bulk):.2f}x")
    print(f"  TLS gRPC / plaintext gRPC: best {max(grpc_tls) / max(grpc_plain):.2f}x, "
          f"median {statistics.median(grpc_tls) / statistics.median(grpc_plain):.2f}x (the cost of TLS itself)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
