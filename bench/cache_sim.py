"""Replay chunk-access traces through LRU and LRU-K (K=2) at several cache sizes.

    .venv/bin/python bench/cache_sim.py [--seed 7] [--scale 1.0]

Traces (deterministic for a seed):
  serving  6 served models (400 chunks each, Zipf(0.5) popularity); each request reads 32 chunks
           of its model, Zipf(0.4)-skewed (forward passes re-reading hot chunks); every 30
           requests a full load of one of 30 cold models scans its 800 chunks once. LRU lets each
           scan flush the hot set; LRU-K keeps chunks seen twice and lets once-seen scan chunks
           go first. Once the cache holds the hot set plus several cold models, LRU's recency
           wins back the occasional cold re-load, and the two converge.
  loop     one model loaded over and over: a cyclic scan, the worst case for LRU.
  zipf     independent Zipf(0.9) accesses over many chunks.

Every chunk is 256 KiB; a cache size is a fraction of the trace's working set (distinct chunks).
The clock advances 1 ms per access; the correlated reference period is 2 ms.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.lru import LRUCache
from worker.lru_k import LRUKCache

CHUNK = 256 * 1024
SIZES = (0.10, 0.20, 0.30, 0.50, 0.75, 1.00)
_VALUE = b"\0"  # one shared object; sizes are passed explicitly


def zipf_probs(n: int, alpha: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    probs: np.ndarray = p / p.sum()
    return probs


def serving_trace(rng: np.random.Generator, scale: float) -> list[int]:
    hot_models, hot_chunks = 6, int(400 * scale)
    cold_models, cold_chunks = 30, int(800 * scale)
    reads_per_request, scan_every, requests = 32, 30, int(2500 * scale)
    model_p = zipf_probs(hot_models, 0.5)
    chunk_p = zipf_probs(hot_chunks, 0.4)
    perms = [rng.permutation(hot_chunks) for _ in range(hot_models)]  # hot chunks differ per model
    cold_base = hot_models * hot_chunks
    trace: list[int] = []
    models = rng.choice(hot_models, size=requests, p=model_p)
    for n, m in enumerate(models):
        picks = rng.choice(hot_chunks, size=reads_per_request, p=chunk_p)
        base = int(m) * hot_chunks
        trace.extend(base + int(perms[m][c]) for c in picks)
        if n % scan_every == scan_every - 1:
            cold = int(rng.integers(cold_models))
            start = cold_base + cold * cold_chunks
            trace.extend(range(start, start + cold_chunks))  # full load of a cold model
    return trace


def loop_trace(rng: np.random.Generator, scale: float) -> list[int]:
    n = int(1000 * scale)
    return list(range(n)) * 40


def zipf_trace(rng: np.random.Generator, scale: float) -> list[int]:
    n = int(5000 * scale)
    keys = rng.permutation(n)
    return [int(keys[i]) for i in rng.choice(n, size=int(60000 * scale), p=zipf_probs(n, 0.9))]


class TickClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def lru_cache(capacity: int, _clock: TickClock) -> LRUCache:
    return LRUCache(capacity)


def lru2_cache(capacity: int, working_set: int, clock: TickClock) -> LRUKCache:
    return LRUKCache(
        capacity,
        k=2,
        correlated_reference_period=0.002,
        retained_information_period=1e9,  # bounded by count below
        max_retained_history=4 * working_set,
        clock=clock,
    )


def replay(trace: list[int], make: Callable[[TickClock], LRUCache | LRUKCache]) -> float:
    clock = TickClock()
    cache = make(clock)
    get, put = cache.get, cache.put
    hits = 0
    for key in trace:
        clock.t += 0.001
        if get(key) is None:
            put(key, _VALUE, CHUNK)
        else:
            hits += 1
    return hits / len(trace)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply trace lengths and sizes (0.2 for a quick run)")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    traces = {
        "serving": serving_trace(np.random.default_rng(args.seed), args.scale),
        "loop": loop_trace(np.random.default_rng(args.seed), args.scale),
        "zipf": zipf_trace(np.random.default_rng(args.seed), args.scale),
    }
    print(f"{'trace':8} {'refs':>7} {'chunks':>7} {'cache':>6} {'MiB':>7} {'LRU':>7} {'LRU-2':>7} {'LRU-2/LRU':>10}")
    for name, trace in traces.items():
        working_set = len(set(trace))
        for frac in SIZES:
            capacity = max(1, int(working_set * frac)) * CHUNK
            lru = replay(trace, partial(lru_cache, capacity))
            lruk = replay(trace, partial(lru2_cache, capacity, working_set))
            ratio = f"{lruk / lru:10.2f}" if lru > 0 else f"{'inf' if lruk > 0 else '-':>10}"
            print(f"{name:8} {len(trace):7d} {working_set:7d} {frac:6.0%} {capacity / 2**20:7.0f} "
                  f"{lru:7.1%} {lruk:7.1%} {ratio}")
    print(f"seed {args.seed}, scale {args.scale}, {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
