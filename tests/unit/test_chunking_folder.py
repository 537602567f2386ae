"""Model folders in the chunking layer: shards read through memory maps, files as chunks, the
manifest's optional folder parts (round trip, path safety, old manifests unchanged)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from chunking.config import ChunkingConfig
from chunking.errors import InvalidInput, ManifestError
from chunking.folder import map_safetensors, open_folder, pack_folder_stream
from chunking.manifest import Manifest
from chunking.pack import pack

KiB = 1 << 10


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(33, 17, generator=g),
        "b.bf16": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "c.int": torch.randint(-5, 5, (11,), generator=g, dtype=torch.int64),
        "d.scalar": torch.tensor(3.5),
        "e.empty": torch.empty(0, 4),
        "f.bool": torch.rand(9, generator=g) > 0.5,
        "g.f16": torch.randn(5, 3, generator=g).half(),
    }


def make_folder(root: Path) -> dict[str, torch.Tensor]:
    t = tensors(0)
    names = sorted(t)
    save_file({n: t[n] for n in names[:4]}, str(root / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({n: t[n] for n in names[4:]}, str(root / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({"hidden": 33}))
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "vocab.txt").write_bytes(os.urandom(3 * 64 * KiB + 5))  # several chunks of 64 KiB
    (root / "empty.txt").write_bytes(b"")
    return t


def test_shards_are_memory_mapped_bit_exact_for_every_dtype(tmp_path: Path) -> None:
    t = tensors(1)
    save_file(t, str(tmp_path / "m.safetensors"))
    got = map_safetensors(tmp_path / "m.safetensors")
    assert set(got) == set(t)
    for name, want in t.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert got[name].reshape(-1).view(torch.uint8).tolist() == want.reshape(-1).view(torch.uint8).tolist()  # bits


def test_folder_packs_tensors_and_files_and_round_trips(tmp_path: Path) -> None:
    make_folder(tmp_path)
    folder = open_folder(tmp_path)
    assert [w.path for w in folder.weight_files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [f.path for f in folder.files] == ["config.json", "empty.txt", "tokenizer/vocab.txt"]
    stream = pack_folder_stream(tmp_path, model="m", config=ChunkingConfig(chunk_size=64 * KiB))
    refs = [ref for block in stream.blocks() for ref, _data in block]
    result = stream.result()
    m = result.manifest
    assert [f.path for f in m.files] == ["config.json", "empty.txt", "tokenizer/vocab.txt"]
    vocab = m.file("tokenizer/vocab.txt")
    assert vocab is not None and len(vocab.chunks) == 4 and vocab.size == 3 * 64 * KiB + 5
    assert m.file("empty.txt") is not None and m.file("empty.txt").chunks == ()  # type: ignore[union-attr]
    assert m.weight_files == tuple(w.path for w in folder.weight_files)
    shard_of = {t.name: m.weight_files[k] for t, k in zip(m.tensors, m.tensor_file)}
    assert shard_of["a.weight"].startswith("model-00001") and shard_of["g.f16"].startswith("model-00002")
    assert len(refs) == len(m.chunks) + sum(len(f.chunks) for f in m.files)
    again = Manifest.from_bytes(m.to_bytes(), expected_id=m.id)
    assert again == m
    assert m.all_chunk_ids() >= {c.id for c in vocab.chunks}
    # every chunk can be made again for a re-send (file chunks read again from the file)
    for ref in refs:
        assert len(result.chunk(ref.index).data) == ref.stored_size


def test_a_changed_config_is_another_fingerprint(tmp_path: Path) -> None:
    make_folder(tmp_path)
    first = pack_folder_stream(tmp_path, model="m").result().manifest
    (tmp_path / "config.json").write_text(json.dumps({"hidden": 34}))
    second = pack_folder_stream(tmp_path, model="m").result().manifest
    assert first.chunks == second.chunks and first.fingerprint != second.fingerprint


def test_a_plain_manifest_keeps_its_bytes(tmp_path: Path) -> None:
    m = pack(tensors(2), model="m").manifest
    raw = m.to_bytes()
    assert b'"files"' not in raw and b'"weight_files"' not in raw
    assert Manifest.from_bytes(raw, expected_id=m.id) == m


@pytest.mark.parametrize("bad", ["../escape", "/etc/passwd", "a/./b", "a\\b", "C:evil", "x\ny", ""])
def test_unsafe_file_paths_in_a_manifest_are_refused(tmp_path: Path, bad: str) -> None:
    make_folder(tmp_path)
    m = pack_folder_stream(tmp_path, model="m").result().manifest
    forged = dataclasses.replace(m, files=(dataclasses.replace(m.files[0], path=bad), *m.files[1:]))
    with pytest.raises(ManifestError, match="file path"):
        Manifest.from_bytes(forged.to_bytes())


def test_symlinks_and_duplicate_tensors_are_refused(tmp_path: Path) -> None:
    make_folder(tmp_path)
    (tmp_path / "link.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(InvalidInput, match="symlink"):
        open_folder(tmp_path)
    (tmp_path / "link.json").unlink()
    save_file({"a.weight": torch.zeros(1)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(InvalidInput, match="in both"):
        open_folder(tmp_path).tensors()
    empty = tmp_path / "none"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(InvalidInput, match="no .safetensors"):
        open_folder(empty)


def test_a_truncated_shard_is_a_clear_error(tmp_path: Path) -> None:
    save_file(tensors(3), str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-100])
    with pytest.raises(InvalidInput, match="data_offsets"):
        map_safetensors(tmp_path / "m.safetensors")
    (tmp_path / "m.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(InvalidInput, match="header length"):
        map_safetensors(tmp_path / "m.safetensors")


@pytest.mark.parametrize("fmt", [2, 4])
def test_each_shards_metadata_is_kept_in_the_manifest(tmp_path: Path, fmt: int) -> None:
    """A folder pull wrote {"format": "pt"} plus provenance into every shard, dropping what the
    shards held (a PEFT marker, a custom key, another format)."""
    t = tensors(2)
    names = sorted(t)
    save_file({n: t[n] for n in names[:3]}, str(tmp_path / "a.safetensors"), metadata={"format": "pt", "custom": "x"})
    save_file({n: t[n] for n in names[3:]}, str(tmp_path / "b.safetensors"), metadata={"peft": "yes", "format": "tf"})
    m = pack_folder_stream(tmp_path, model="m", config=ChunkingConfig(chunk_size=64 * KiB)).result().manifest
    assert m.weight_file_metadata == ((("custom", "x"), ("format", "pt")), (("format", "tf"), ("peft", "yes")))
    again = Manifest.from_bytes(m.in_format(fmt).to_bytes()) if fmt == 2 else None
    if again is not None:
        assert again.weight_file_metadata == m.weight_file_metadata
    else:
        blobs = m.in_format(4).blobs()
        root = m.in_format(4)
        read = Manifest.read(root.id, lambda i: blobs[i], get_parts=lambda ids: {i: blobs[i] for i in ids})
        assert read.weight_file_metadata == m.weight_file_metadata
    # a folder without shard metadata keeps the manifest bytes it had (no key at all)
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file(t, str(bare / "model.safetensors"))
    plain = pack_folder_stream(bare, model="m", config=ChunkingConfig(chunk_size=64 * KiB)).result().manifest
    assert plain.weight_file_metadata == () and b"weight_file_metadata" not in plain.to_bytes()


def test_shard_metadata_that_is_not_strings_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    raw = (tmp_path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8:8 + n])
    doc["__metadata__"] = {"n": 3}
    head = json.dumps(doc).encode()
    head += b" " * (-len(head) % 8)
    (tmp_path / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])
    with pytest.raises(InvalidInput, match="__metadata__ must map strings to strings"):
        pack_folder_stream(tmp_path, model="m", config=ChunkingConfig(chunk_size=64 * KiB)).result()
