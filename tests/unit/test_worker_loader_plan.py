"""Load planning without a network: cache tiers first, heatmap order, readiness, reuse of old tensors."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from chunking.diff import diff
from chunking.chunk_table import ChunkRows
from chunking.pack import pack
from chunking.synthetic import finetune
from paramserver.client.fetch import ChunkSink, FetchEngine, FetchStats
from paramserver.client.fetch_plan import Want, Wants
from paramserver.client.transport import MemoryTransport
from paramserver.client.verify import Verifier
from worker.config import CacheConfig, PrefetchConfig
from worker.errors import TensorFailed
from worker.heatmap import HeatReport
from worker.loader import empty_targets
from worker.prefetch import Prefetcher, unique_order
from worker.swap import tensor_source
from worker.tiered_cache import TieredCache


class FakeClient:
    """The client's real fetch engine over an in-memory transport: one server holding ``stored``."""

    def __init__(self, stored: dict[str, bytes]) -> None:
        self.stored = stored
        self.asked: list[str] = []

    def fetch(self, chunks: ChunkRows, sink: ChunkSink, *, algorithm: str = "blake3",
              tensors_of: object = None) -> FetchStats:
        refs = list(chunks.refs())
        self.asked.extend(r.id for r in refs)
        held = {r.id: (r.codec, r.crc32c, self.stored[r.id]) for r in refs}
        engine = FetchEngine(MemoryTransport({"fake": held}), Verifier("crc", algorithm))
        wants = Wants.of([Want(r.id, r.stored_size, ("fake",)) for r in refs])
        return engine.fetch(chunks, wants, ["fake"], sink)


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        **{f"layer{i}.weight": torch.randn(256, 300, generator=g) for i in range(10)},
        "half": torch.randn(77, 3, generator=g).half(),
        "bf": torch.randn(1025, generator=g).bfloat16(),
        "int8": torch.randint(-128, 127, (13, 11), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def run(packed, cache=None, heat=None, local=None, client=None):  # type: ignore[no-untyped-def]
    targets = empty_targets(packed.manifest, torch.device("cpu"))
    client = client if client is not None else FakeClient(packed.source())
    p = Prefetcher(packed.manifest, targets, client=client, cache=cache, heat=heat, local=local)
    counters = p.run()
    return targets, counters, client, p


def test_network_load_is_bit_exact_and_fills_the_cache() -> None:
    sd = model()
    packed = pack(sd, model="m")
    cache = TieredCache.from_config(CacheConfig(memory_bytes=64 << 20))
    targets, counters, _, _ = run(packed, cache)
    assert all(same(targets[k], v) for k, v in sd.items())
    assert counters.bytes["network"] == packed.manifest.raw_bytes
    again, counters2, client2, _ = run(packed, cache, client=FakeClient({}))
    assert all(same(again[k], v) for k, v in sd.items())
    assert counters2.bytes["network"] == 0 and client2.asked == []
    assert counters2.bytes["memory"] == packed.manifest.raw_bytes


def test_disk_tier_serves_after_memory_is_gone(tmp_path: Path) -> None:
    sd = model()
    packed = pack(sd, model="m")
    cfg = CacheConfig(memory_bytes=64 << 20, disk_dir=str(tmp_path), disk_bytes=64 << 20, disk_fsync=False)
    run(packed, TieredCache.from_config(cfg))
    fresh = TieredCache.from_config(cfg)  # a restarted worker: empty memory, same disk
    targets, counters, client, _ = run(packed, fresh, client=FakeClient({}))
    assert all(same(targets[k], v) for k, v in sd.items())
    assert counters.bytes["disk"] == packed.manifest.raw_bytes and client.asked == []


def test_heatmap_order_with_repeated_ids_matches_the_row_by_row_rule() -> None:
    # Zero tensors repeat one chunk id; the report names rows out of order, twice, and past the end.
    from chunking.config import ChunkingConfig
    from worker.heatmap import prefetch_order

    sd = {f"z{i}": torch.zeros(3000 + i, dtype=torch.float32) for i in range(4)}
    sd |= {f"r{i}": torch.arange(1200 * (i + 1), dtype=torch.float32) for i in range(3)}
    manifest = pack(sd, model="m", config=ChunkingConfig(chunk_size=4096)).manifest
    table = manifest.chunks
    n = len(table)
    assert len(table.first_rows) < n  # there are repeats
    rng = np.random.default_rng(3)
    picked = [int(i) for i in rng.permutation(n)[: n // 2]]
    heat = HeatReport.from_entries("m", 1, [(i, 1, rank) for rank, i in enumerate(picked + [n + 5])])
    want, seen = [], set()
    for index in prefetch_order(heat, range(n)):
        if table.ids[index] not in seen:
            seen.add(table.ids[index])
            want.append(int(table.first_of[index]))  # each id named by its first row, in heat order
    assert unique_order(manifest, heat).tolist() == want
    assert unique_order(manifest, None).tolist() == table.first_rows.tolist()


def test_heatmap_order_is_the_fetch_order() -> None:
    packed = pack(model(), model="m")
    n = len(packed.manifest.chunks)
    order = list(reversed(range(n)))
    heat = HeatReport.from_entries("m", 1, [(i, 1, rank) for rank, i in enumerate(order)])
    first_of = packed.manifest.chunks.first_of
    assert unique_order(packed.manifest, heat)[:3].tolist() == [int(first_of[i]) for i in order[:3]]
    _, _, client, _ = run(packed, heat=heat)
    assert client.asked[0] == packed.manifest.chunks[order[0]].id


class Shuffled(FakeClient):
    """Delivers the chunks of each fetch in a shuffled order: replicas' streams interleave."""

    def fetch(self, chunks: ChunkRows, sink: ChunkSink, *, algorithm: str = "blake3",
              tensors_of: object = None) -> FetchStats:
        rows = chunks.rows.copy()
        np.random.default_rng(3).shuffle(rows)
        return super().fetch(ChunkRows(chunks.table, rows), sink, algorithm=algorithm)


@pytest.mark.parametrize("with_heat", [False, True])
def test_the_heat_a_load_reports_is_the_order_it_asked_in_not_the_order_chunks_arrived(with_heat: bool) -> None:
    packed = pack(model(), model="m")
    table = packed.manifest.chunks
    n = len(table)
    heat = HeatReport.from_entries("m", 1, [(i, 1, rank) for rank, i in enumerate(reversed(range(n)))]) if with_heat else None
    client = Shuffled(packed.source())
    _, _, _, p = run(packed, heat=heat, client=client)
    asked = unique_order(packed.manifest, heat).tolist()  # distinct ids, first row of each, in fetch order
    assert client.asked != [table.ids[r] for r in asked]  # they arrived in another order
    reported = p.recorder.snapshot()
    # Every row is reported once; rows of one id share its rank, and ties go to the lower row.
    want = sorted(range(n), key=lambda r: (asked.index(int(table.first_of[r])), r))
    assert list(reported.indices) == want
    assert set(reported.counts) == {1}


def test_tensor_ready_before_the_load_ends() -> None:
    packed = pack(model(), model="m")
    first = packed.manifest.chunks[0]
    name0 = packed.manifest.tensors_of_chunk(0)[0]
    seen: dict[str, bool] = {}
    gate = threading.Event()

    class Slow(FakeClient):
        def fetch(self, chunks, sink, **kw):  # type: ignore[no-untyped-def]
            super().fetch(ChunkRows(chunks.table, chunks.rows[:1]), sink, **kw)
            gate.wait(5)
            return super().fetch(ChunkRows(chunks.table, chunks.rows[1:]), sink, **kw)

    targets = empty_targets(packed.manifest, torch.device("cpu"))
    p = Prefetcher(packed.manifest, targets, client=Slow(packed.source()))
    t = threading.Thread(target=p.run)
    t.start()
    p.readiness.wait(name0, timeout=5)
    seen["early"] = not p.readiness.is_ready(packed.manifest.tensors_of_chunk(len(packed.manifest.chunks) - 1)[-1])
    gate.set()
    t.join(10)
    assert first.index == 0 and seen["early"]
    assert p.counters.first_tensor_s is not None


def test_corrupt_bytes_never_reach_a_ready_tensor() -> None:
    packed = pack(model(), model="m")
    stored = packed.source()
    victim = packed.manifest.chunks[3]
    bad = bytearray(stored[victim.id])
    bad[100] ^= 0xFF
    stored[victim.id] = bytes(bad)
    targets = empty_targets(packed.manifest, torch.device("cpu"))
    p = Prefetcher(packed.manifest, targets, client=FakeClient(stored))
    with pytest.raises(Exception, match="corrupt"):
        p.run()
    with pytest.raises(TensorFailed):
        p.readiness.wait(packed.manifest.tensors_of_chunk(victim.index)[0], timeout=1)


def test_swap_reuses_unchanged_chunks_from_old_tensors() -> None:
    old_sd = model()
    new_sd = finetune(old_sd, fraction=0.1, seed=3)
    old = pack(old_sd, model="m")
    new = pack(new_sd, model="m", previous=old.manifest)
    old_targets, _, _, _ = run(old)
    d = diff(old.manifest, new.manifest)
    shared = set(d.shared)
    src = tensor_source(old.manifest, old_targets)
    client = FakeClient(new.source())
    targets, counters, _, _ = run(new, local=lambda r: src(r) if r.id in shared else None, client=client)
    assert all(same(targets[k], v) for k, v in new_sd.items())
    assert set(client.asked) == set(d.added)
    assert counters.bytes["network"] == d.added_bytes and counters.bytes["local"] == d.shared_bytes


def test_tensor_source_refuses_modified_tensors() -> None:
    packed = pack(model(), model="m")
    targets, _, _, _ = run(packed)
    src = tensor_source(packed.manifest, targets)
    ref = packed.manifest.chunks[0]
    assert src(ref) is not None
    targets[packed.manifest.tensors_of_chunk(0)[0]].view(-1)[0] += 1
    assert src(ref) is None


def test_prefetch_config_validates() -> None:
    with pytest.raises(ValueError, match="max_streams_in_flight"):
        PrefetchConfig(max_streams_in_flight=0).validate()


def private_run(packed, cache, client=None):  # type: ignore[no-untyped-def]
    """A load into fresh host-arena tensors the load owns (as worker.loader does on CPU)."""
    from paramserver.client.hostmem import allocate_targets

    targets = dict(allocate_targets(packed.manifest).tensors)
    client = client if client is not None else FakeClient(packed.source())
    p = Prefetcher(packed.manifest, targets, client=client, cache=cache, private_targets=True)
    return targets, p.run(), client


def test_memory_tier_holds_views_of_the_loaded_tensors_not_copies() -> None:
    from worker.tiered_cache import HeldChunk

    sd = model()
    packed = pack(sd, model="m")
    cache = TieredCache.from_config(CacheConfig(memory_bytes=64 << 20))
    targets, _, _ = private_run(packed, cache)
    assert all(same(targets[k], v) for k, v in sd.items())
    held = [cache.held(r.id) for r in packed.manifest.unique_chunks()]
    views = [h for h in held if isinstance(h, HeldChunk)]
    assert views, "no chunk was kept as a view"
    # Each view points into the loaded tensors' memory: no second copy of those bytes.
    ptrs = {t.untyped_storage().data_ptr() for t in targets.values() if t.numel()}
    base = min(ptrs)
    assert all(base <= np.frombuffer(h.view, np.uint8).ctypes.data < base + (1 << 30) for h in views)
    # What the tier is charged covers the whole load it keeps alive.
    assert cache.memory.bytes >= packed.manifest.raw_bytes


def test_a_load_is_one_entry_of_the_memory_tier_referenced_by_its_hits() -> None:
    from worker.tiered_cache import HeldChunk

    sd = model()
    packed = pack(sd, model="m")
    cache = TieredCache.from_config(CacheConfig(memory_bytes=64 << 20))
    private_run(packed, cache)
    unique = packed.manifest.unique_chunks()
    held = [r for r in unique if isinstance(cache.held(r.id), HeldChunk)]
    assert held and cache.stats()["memory"]["held_chunks"] == len(held)
    # One entry for every chunk that lies in the tensors, plus a copy of each one that does not.
    assert cache.memory.stats().entries == 1 + (len(unique) - len(held))
    hits = cache.memory.stats().hits
    assert cache.get(held[0].id).tier == "memory" and cache.memory.stats().hits == hits + 1
    assert cache.in_memory_many([held[0].id, "ff" * 32]) == [True, False]
    # A batch of lookups references the group once and counts every hit and the miss.
    before, lookups = cache.memory.stats(), cache.stats()["total"]["lookups"]
    answers = cache.get_many([r.id for r in held] + ["ff" * 32])
    assert [a.tier for a in answers] == ["memory"] * len(held) + [None]
    assert all(isinstance(a.value, HeldChunk) and a.value.intact() for a in answers[:-1])
    after = cache.memory.stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (len(held), 1)
    assert cache.stats()["total"]["lookups"] == lookups + len(held) + 1
    assert cache.stats()["total"]["misses"] >= 1


def test_a_tensor_changed_in_place_never_leaks_into_the_next_load() -> None:
    sd = model()
    packed = pack(sd, model="m")
    cache = TieredCache.from_config(CacheConfig(memory_bytes=64 << 20))
    targets, _, _ = private_run(packed, cache)
    targets["layer3.weight"].add_(1.0)  # the user trains in place
    again, counters, client = private_run(packed, cache)
    assert all(same(again[k], v) for k, v in sd.items())
    assert counters.bytes["network"] > 0 and client.asked  # the changed chunks came from the cluster
    assert counters.bytes["memory"] > 0


def test_views_of_one_load_are_evicted_together() -> None:
    from worker.tiered_cache import HeldChunk

    sd = model()
    packed = pack(sd, model="m")
    cache = TieredCache.from_config(CacheConfig(memory_bytes=packed.manifest.raw_bytes + (1 << 20)))
    private_run(packed, cache)
    assert any(isinstance(cache.held(r.id), HeldChunk) for r in packed.manifest.unique_chunks())
    for i in range(3):  # other data pushes the load's chunks out: all of its views go at once
        cache.memory.put(f"{i:064x}", bytes(packed.manifest.raw_bytes // 2))
        cache.memory.put(f"{i:064x}", bytes(packed.manifest.raw_bytes // 2))
    assert not any(isinstance(cache.held(r.id), HeldChunk) for r in packed.manifest.unique_chunks())


def test_a_model_larger_than_the_memory_tier_goes_around_it() -> None:
    sd = model()
    packed = pack(sd, model="m")
    small = TieredCache.from_config(CacheConfig(memory_bytes=packed.manifest.raw_bytes // 2))
    targets, counters, _ = private_run(packed, small)
    assert all(same(targets[k], v) for k, v in sd.items()) and counters.bytes["network"] == packed.manifest.raw_bytes
    # No copy of half the model on top of the loaded one (the next in-order load would evict
    # each before reaching it).
    assert small.memory.bytes == 0
    targets, counters, _, _ = run(packed, small)  # targets the caller owns: nothing received in place
    assert all(same(targets[k], v) for k, v in sd.items()) and small.memory.bytes == 0
