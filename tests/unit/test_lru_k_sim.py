from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

_SPEC = importlib.util.spec_from_file_location("cache_sim", Path(__file__).resolve().parents[2] / "bench" / "cache_sim.py")
assert _SPEC is not None and _SPEC.loader is not None
cache_sim = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cache_sim)


def lruk(capacity: int, working_set: int):
    return lambda clock: cache_sim.LRUKCache(
        capacity, correlated_reference_period=0.002, retained_information_period=1e9,
        max_retained_history=4 * working_set, clock=clock,
    )


def test_serving_trace_is_deterministic_and_lru_k_beats_lru_on_a_small_cache() -> None:
    trace = cache_sim.serving_trace(np.random.default_rng(3), 0.25)
    assert trace == cache_sim.serving_trace(np.random.default_rng(3), 0.25)
    working_set = len(set(trace))
    capacity = int(working_set * 0.1) * cache_sim.CHUNK
    lru = cache_sim.replay(trace, lambda _c: cache_sim.LRUCache(capacity))
    k2 = cache_sim.replay(trace, lruk(capacity, working_set))
    assert k2 > lru * 1.1


def test_full_size_cache_hits_everything_but_compulsory_misses() -> None:
    trace = cache_sim.zipf_trace(np.random.default_rng(1), 0.05)
    working_set = len(set(trace))
    capacity = working_set * cache_sim.CHUNK
    expected = 1 - working_set / len(trace)
    assert abs(cache_sim.replay(trace, lambda _c: cache_sim.LRUCache(capacity)) - expected) < 1e-9
    assert abs(cache_sim.replay(trace, lruk(capacity, working_set)) - expected) < 1e-9
