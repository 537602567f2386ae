"""A ResNet-50-sized model round-trips bit-exactly and its tensors complete one by one."""
from __future__ import annotations

import pytest
import torch

from chunking import Assembler, ChunkingConfig, Manifest, pack, unpack
from chunking.synthetic import ResNet50, resnet50_state_dict
from chunking.unpack import empty_like_manifest
from tests.unit.chunking_helpers import assert_bit_exact


def test_resnet50_has_the_reference_parameter_count() -> None:
    assert sum(p.numel() for p in ResNet50().parameters()) == 25_557_032


@pytest.mark.slow
@pytest.mark.parametrize("codec,dtype", [("off", torch.float32), ("auto", torch.bfloat16)])
def test_resnet50_round_trip(codec: str, dtype: torch.dtype) -> None:
    sd = resnet50_state_dict(seed=0, dtype=dtype)
    result = pack(sd, model="resnet50", config=ChunkingConfig(codec=codec))
    manifest = Manifest.from_bytes(result.manifest.to_bytes(), expected_id=result.manifest.id)
    assert manifest.total_bytes == sum(v.nbytes for v in sd.values())
    out = unpack(manifest, result.source())
    assert_bit_exact(out, sd)
    model = ResNet50().to(dtype)
    model.load_state_dict(out)


def test_assembler_reports_each_tensor_once_when_its_chunks_land() -> None:
    sd = {"a": torch.randn(70000), "b": torch.randn(10), "c": torch.randn(5), "e": torch.empty(0)}
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=1 << 16))
    m = result.manifest
    seen: list[str] = []
    asm = Assembler(m, empty_like_manifest(m), on_tensor_ready=seen.append)
    assert seen == ["e"] and not asm.done
    for ref in reversed(m.chunks):
        asm.add_stored(ref, result.chunk(ref.index).data)
        asm.add_stored(ref, result.chunk(ref.index).data)  # duplicates are harmless
        for name in seen:
            assert set(m.chunks_of_tensor(name)) <= {r.index for r in m.chunks} - {r.index for r in asm.missing_chunks()}
    assert asm.done and sorted(seen) == ["a", "b", "c", "e"] and len(seen) == 4
    assert asm.ready_tensors() == tuple(seen)


def test_sources_may_yield_views_into_one_message_buffer() -> None:
    sd = {"a": torch.randn(50000), "b": torch.arange(300, dtype=torch.int32)}
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=1 << 14, codec="auto"))
    # Like a gRPC message carrying several chunks: one buffer, many memoryview slices.
    parts = [(c.ref, c.data) for c in result.chunks(unique=True)]
    message = bytearray(b"".join(d for _, d in parts))
    views, pos = [], 0
    for ref, data in parts:
        views.append((ref, memoryview(message)[pos : pos + len(data)]))
        pos += len(data)

    class Source:
        def get_chunks(self, refs):  # type: ignore[no-untyped-def]
            return reversed(views)

    assert_bit_exact(unpack(result.manifest, Source()), sd)


def test_write_chunk_accepts_tensors_and_fills_non_cpu_style_targets() -> None:
    sd = {"a": torch.randn(9000), "b": torch.randn(3)}
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=1 << 12))
    m = result.manifest
    target = empty_like_manifest(m)
    asm = Assembler(m, target)
    # Route tensor "a" through the Tensor.copy_ path that CUDA targets use.
    a = m.tensor_index["a"]
    asm._dev[a], asm._cpu[a] = target["a"].view(torch.uint8), None
    for ref in m.chunks:
        asm.write_chunk(ref.index, torch.from_numpy(result.raw_chunk(ref.index).copy()))
    assert asm.done
    assert_bit_exact(target, sd)
