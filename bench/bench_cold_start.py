#!/usr/bin/env python
"""Cold start that overlaps load and compute (issue #14): time to the first answer of a cold start
(``worker.cold_start.start_cold``: the module runs while its weights arrive, each layer waiting
only for its own tensors) against "load fully, then run one forward", in one run.

    .venv/bin/python bench/bench_cold_start.py [--layers 12] [--layer-mib 64] [--rounds 5] [--dir DIR]

A default local 3-server cluster; a model of --layers layers of --layer-mib MiB each (an
embedding per layer, so the host's arithmetic is negligible) whose forward pauses per layer for
as long as one layer takes to arrive (measured first: the spread of the layers' ready times in
cold loads, divided by layers - 1), standing for GPU time, which does not use the host CPU the
fetch runs on. Both paths use a fresh ClusterClient each time (no worker cache; the servers'
page caches warm), reads of 4 MiB queued in forward order; rounds alternate which goes first;
medians. Target (issue #14): first answer <= 0.7x of load-then-forward; identical answers.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from functools import partial
from pathlib import Path

import torch

from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.push import push
from paramserver.client.session import ClusterClient, SessionConfig
from worker.cold_start import start_cold
from worker.loader import empty_weights, fill_module, load

WIDTH = 256
ORDERED = SessionConfig(max_read_bytes=4 << 20)


class Layer(torch.nn.Module):
    pause = 0.0

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(rows, WIDTH)
        self.register_buffer("rows", torch.arange(0, rows, max(1, rows // 8)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(Layer.pause)
        return torch.tanh(x + self.emb(self.rows).sum(0))


def factory(layers: int, rows: int) -> torch.nn.Module:
    return torch.nn.Sequential(OrderedDict((f"l{i:03d}", Layer(rows)) for i in range(layers)))


def _stamp(ready: dict[str, float], name: str) -> None:
    ready.setdefault(name, time.perf_counter())


def arrival_per_layer(seed: str, build: partial[torch.nn.Module], layers: int) -> float:
    with ClusterClient(seed, config=ORDERED) as client:
        cold = start_cold(client, "bench-cold@1", build, torch.device("cpu"))
        ready: dict[str, float] = {}
        for t in cold.handle.manifest.tensors:
            cold.handle.readiness.on_ready(t.name, partial(_stamp, ready))
        cold.finish(300)
    times = sorted(ready.values())
    return (times[-1] - times[0]) / max(1, layers - 1)


def full_then_forward(seed: str, build: partial[torch.nn.Module], x: torch.Tensor) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with ClusterClient(seed, config=ORDERED) as client:
        loaded = load(client, "bench-cold@1", device="cpu", report_heat=False)
        with empty_weights():
            module = build()
        fill_module(module, loaded.tensors, torch.device("cpu"))
        module.eval()
        with torch.no_grad():
            y = module(x)
        return time.perf_counter() - t0, y


def cold_first_answer(seed: str, build: partial[torch.nn.Module], x: torch.Tensor) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with ClusterClient(seed, config=ORDERED) as client:
        cold = start_cold(client, "bench-cold@1", build, torch.device("cpu"), report_heat=False)
        with torch.no_grad():
            y = cold.module(x)
        took = time.perf_counter() - t0
        cold.finish(300)
        return took, y


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    # 64 MiB layers (a 768 MiB model): small next to an LLM's, large enough that the fixed cost of a
    # load (client, resolve, manifest, heat: ~0.1 s here) does not dominate; --layer-mib 32 shows it.
    p.add_argument("--layer-mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="cluster folder (default: a temporary one)")
    args = p.parse_args()
    if not 2 <= args.layers <= 256 or not 1 <= args.layer_mib <= 1024 or not 1 <= args.rounds <= 50:
        print("bench_cold_start: --layers 2..256, --layer-mib 1..1024, --rounds 1..50", file=sys.stderr)
        return 2
    rows = args.layer_mib * (1 << 20) // (WIDTH * 4)
    build = partial(factory, args.layers, rows)
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-cold-"))
    cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=3))
    try:
        cluster.up()
        torch.manual_seed(0)
        push(cluster.seed, build().state_dict(), model="bench-cold", tag="prod")
        x = torch.randn(4, WIDTH)
        Layer.pause = 0.0
        spreads = [arrival_per_layer(cluster.seed, build, args.layers) for _ in range(4)][1:]  # the first warms up
        Layer.pause = statistics.median(spreads)
        full: list[float] = []
        cold: list[float] = []
        same = True
        for r in range(args.rounds):
            order = ("full", "cold") if r % 2 == 0 else ("cold", "full")
            for kind in order:
                if kind == "full":
                    t, want = full_then_forward(cluster.seed, build, x)
                    full.append(t)
                else:
                    t, got = cold_first_answer(cluster.seed, build, x)
                    cold.append(t)
            same = same and torch.equal(want, got)
    finally:
        cluster.down()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mf, mc = statistics.median(full), statistics.median(cold)
    ratio = mc / mf
    print(f"bench_cold_start: {args.layers} layers x {args.layer_mib} MiB on a local 3-server cluster, "
          f"{args.rounds} rounds (order alternating), medians")
    print(f"  per layer: arrival {Layer.pause * 1000:.1f} ms (cold loads, spread of ready times), compute pause the same")
    print(f"  load fully, then forward: {mf:.3f} s   (rounds: {', '.join(f'{t:.3f}' for t in full)})")
    print(f"  cold start, first answer: {mc:.3f} s   (rounds: {', '.join(f'{t:.3f}' for t in cold)})")
    print(f"  answers identical: {'yes' if same else 'NO'}")
    print(f"done-when: first answer / load-then-forward = {ratio:.3f}x (target <= 0.7) {'PASS' if ratio <= 0.7 and same else 'BELOW'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
