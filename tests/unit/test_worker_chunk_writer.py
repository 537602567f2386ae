"""The worker's ChunkWriter finds the chunks it can receive in place (one whole tensor region)
from the tensor layout, per tensor rather than per chunk; the answer must equal the segment plan's."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from chunking import ChunkingConfig, pack
from chunking.layout import ChunkSegments, plan_chunks
from worker.config import PrefetchConfig
from worker.prefetch import ChunkWriter
from worker.readiness import TensorReadiness

DTYPES = [torch.uint8, torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("seed", range(40))
def test_in_place_regions_match_the_segment_plan(seed: int) -> None:
    rng = random.Random(seed)
    sd = {}
    for i in range(rng.randrange(1, 12)):
        dtype = rng.choice(DTYPES)
        nbytes = rng.choice([0, 1, 8, 100, 1000, 4096, 5000, 8192, 9000, 2048])
        sd[f"t{i:02d}"] = torch.full((nbytes // dtype.itemsize,), seed, dtype=dtype)
    if all(t.numel() == 0 for t in sd.values()):
        sd["last"] = torch.ones(3)
    manifest = pack(sd, model="m", config=ChunkingConfig(chunk_size=4096)).manifest
    targets = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in manifest.tensors}
    writer = ChunkWriter(manifest, targets, TensorReadiness({}), PrefetchConfig())
    plan = manifest.plan
    for index in range(len(manifest.chunks)):
        segments = plan.segments[index]
        whole = len(segments) == 1 and segments[0].chunk_offset == 0 and segments[0].length == plan.raw_sizes[index]
        region = writer.region(index)
        assert (region is not None) == whole, (index, segments)
        if region is not None:
            s = segments[0]
            expected = targets[manifest.tensors[s.tensor].name].reshape(-1).view(torch.uint8).numpy()
            expected = expected[s.tensor_offset : s.tensor_offset + s.length]
            got = np.frombuffer(region, np.uint8)
            assert len(got) == len(expected) and np.shares_memory(got, expected)


def test_segments_are_worked_out_on_access_and_match_an_eager_cut() -> None:
    ranges = [(0, 10_000), (12_288, 3), (12_291, 1), (16_384, 0), (16_384, 40_000)]
    plan = plan_chunks(ranges, 4096)
    assert isinstance(plan.segments, ChunkSegments) and len(plan.segments) == plan.count
    eager = []
    for c in range(plan.count):
        base = c * 4096
        eager.append(tuple((t, max(o, base) - base, max(o, base) - o, min(o + n, base + 4096) - max(o, base))
                           for t, (o, n) in enumerate(ranges) if n and o < base + 4096 and o + n > base))
    got = [tuple((s.tensor, s.chunk_offset, s.tensor_offset, s.length) for s in plan.segments[c]) for c in range(plan.count)]
    assert got == eager
    assert plan.segments[-1] == plan.segments[plan.count - 1]
    with pytest.raises(IndexError):
        plan.segments[plan.count]


def test_an_empty_tensor_anywhere_does_not_trouble_the_writer() -> None:
    import dataclasses

    manifest = pack({"a": torch.ones(3000), "b": torch.empty(0)}, model="m", config=ChunkingConfig(chunk_size=4096)).manifest
    far = tuple(dataclasses.replace(t, offset=1 << 70) if t.nbytes == 0 else t for t in manifest.tensors)
    moved = dataclasses.replace(manifest, tensors=far)
    moved.check()  # an empty tensor's offset names no bytes
    targets = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in moved.tensors}
    writer = ChunkWriter(moved, targets, TensorReadiness({}), PrefetchConfig())
    assert [writer.region(i) is not None for i in range(len(moved.chunks))] == [True, True, True]
