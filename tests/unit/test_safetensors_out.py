"""Writing a pull straight into a .safetensors file (paramserver.client.safetensors_out)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from chunking.assembler import Assembler
from chunking.config import ChunkingConfig
from chunking.pack import pack
from paramserver.client.safetensors_out import SafetensorsOut, header_bytes, supported


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(600, 1000, generator=g),  # several chunks, page-sized tensor
        "h": torch.randn(3, 5, generator=g).half(),  # odd element count: 30 bytes
        "bf": torch.randn(7, generator=g).bfloat16(),
        "q": torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g),
        "d": torch.randn(3, generator=g).double(),  # 8-byte elements after odd-sized ones in manifest order
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "flags": torch.tensor([True, False]),
        "i64": torch.arange(5),
    }


def fill(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> SafetensorsOut:
    packed = pack(state, model="m", config=ChunkingConfig())
    out = SafetensorsOut(path, packed.manifest, metadata)
    asm = Assembler(packed.manifest, out.targets.tensors, private_targets=True)
    for chunk in packed.chunks():
        asm.add_stored(chunk.ref, chunk.data)
    asm.raise_if_incomplete()
    del asm
    return out


def test_filled_file_loads_bit_exact_with_safetensors_and_keeps_metadata(tmp_path: Path) -> None:
    state = mixed()
    out = fill(tmp_path / "sub" / "m.safetensors", state, {"model": "m", "version": "3"})
    assert not (tmp_path / "sub" / "m.safetensors").exists()  # nothing at the final name before commit
    out.commit()
    got = load_file(str(tmp_path / "sub" / "m.safetensors"))
    assert set(got) == set(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert as_bytes(got[name]) == as_bytes(t), name
    with safe_open(str(tmp_path / "sub" / "m.safetensors"), "pt") as f:
        assert f.metadata() == {"model": "m", "version": "3"}
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["m.safetensors"]  # no temp file left


def test_every_tensor_starts_at_a_multiple_of_its_element_size() -> None:
    packed = pack(mixed(), model="m", config=ChunkingConfig())
    head, offsets = header_bytes(packed.manifest, {})
    assert len(head) % 8 == 0
    for t in packed.manifest.tensors:
        assert (len(head) + offsets[t.name]) % torch.tensor([], dtype=getattr(torch, t.dtype)).element_size() == 0
    end = max(offsets[t.name] + t.nbytes for t in packed.manifest.tensors)
    assert end == sum(t.nbytes for t in packed.manifest.tensors)  # no holes, as the format requires


def test_abort_leaves_nothing(tmp_path: Path) -> None:
    packed = pack({"w": torch.randn(100)}, model="m", config=ChunkingConfig())
    out = SafetensorsOut(tmp_path / "x.safetensors", packed.manifest, {})
    out.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_dtype_safetensors_cannot_store_is_refused_by_name(tmp_path: Path) -> None:
    if not hasattr(torch, "complex32"):
        pytest.skip("this torch has no complex32")
    packed = pack({"c": torch.zeros(2, dtype=torch.complex32)}, model="m", config=ChunkingConfig())
    assert not supported(packed.manifest)
    with pytest.raises(ValueError, match="complex32"):
        SafetensorsOut(tmp_path / "x.safetensors", packed.manifest, {})
    assert list(tmp_path.iterdir()) == []
