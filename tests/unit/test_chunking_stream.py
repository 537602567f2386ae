"""pack_stream: the same chunks and manifest as pack(), handed out block by block while it runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chunking.config import ChunkingConfig
from chunking.errors import ChunkingError
from chunking.hashing import content_id
from chunking.pack import pack, pack_stream


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a.weight": torch.randn(300, 257, generator=g),  # spans chunks, odd shape
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),  # shares a chunk with others
        "c.empty": torch.empty(0, 5),
        "d.scalar": torch.tensor(2.5, dtype=torch.float64),
        "e.ints": torch.arange(10_000, dtype=torch.int32),
    }


@pytest.mark.parametrize("codec", ["off", "on"])
def test_stream_matches_pack_and_hands_out_the_stored_bytes(codec: str) -> None:
    config = ChunkingConfig(chunk_size=16 << 10, codec=codec)  # type: ignore[arg-type]
    want = pack(_state(), model="m", config=config, created_at=1.0)
    stream = pack_stream(_state(), model="m", config=config, created_at=1.0, threads=2)
    seen = []
    for block in stream.blocks():
        assert block
        for ref, data in block:
            stored = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8).tobytes()
            assert stored == want.chunk(ref.index).data
            if ref.codec == "raw":
                assert content_id(stored, config.hash_algorithm) == ref.id
            seen.append(ref)
    got = stream.result()
    assert got.manifest.to_bytes() == want.manifest.to_bytes()
    assert [r.id for r in seen] == [r.id for r in want.manifest.chunks]
    assert got.chunk(0).data == want.chunk(0).data  # random access afterwards, for re-sends


def test_a_stream_reads_once_and_result_needs_every_block() -> None:
    config = ChunkingConfig(chunk_size=4 << 10)
    stream = pack_stream(_state(), model="m", config=config)
    blocks = stream.blocks()
    next(blocks)
    with pytest.raises(ChunkingError, match="before its blocks were all read"):
        stream.result()
    for _ in blocks:
        pass
    with pytest.raises(ChunkingError, match="only once"):
        next(stream.blocks())
    assert stream.result().manifest.chunks
    # result() alone runs the whole pack
    assert pack_stream(_state(), model="m", config=config).result().manifest.id == stream.result().manifest.id


def test_a_raw_chunk_inside_one_tensor_is_a_view_not_a_copy() -> None:
    big = torch.arange(1 << 16, dtype=torch.int64)  # 512 KiB: whole chunks inside it
    stream = pack_stream({"big": big}, model="m", config=ChunkingConfig(chunk_size=64 << 10))
    block = next(stream.blocks())
    _ref, data = block[1]
    assert isinstance(data, np.ndarray) and np.shares_memory(data, big.numpy().view(np.uint8))
