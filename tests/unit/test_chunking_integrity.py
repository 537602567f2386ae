"""Corrupt chunks and manifests are detected and named, never loaded."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import zstandard

from chunking import (
    ChunkCorrupt,
    ChunkingConfig,
    DecompressionBomb,
    Manifest,
    ManifestError,
    crc32c,
    decode_chunk,
    pack,
    unpack,
)
from chunking.codec import encode_chunk, shuffle, unshuffle_into
from tests.unit.chunking_helpers import random_tensor

SMALL = 4096


def _model(codec: str):  # type: ignore[no-untyped-def]
    sd = {
        "enc.weight": random_tensor(torch.float32, (2500,), 1),
        "enc.bias": torch.linspace(-1, 1, 300, dtype=torch.bfloat16),
        "dec.weight": torch.linspace(0, 1, 1800, dtype=torch.float16),
    }
    return sd, pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL, codec=codec))


@pytest.mark.parametrize("codec", ["off", "on"])
def test_any_single_flipped_byte_is_detected_and_named(codec: str) -> None:
    sd, result = _model(codec)
    manifest = result.manifest
    clean = result.source()
    rng = random.Random(1234)
    for _ in range(300):
        ref = rng.choice(manifest.chunks)
        data = bytearray(clean[ref.id])
        pos = rng.randrange(len(data))
        data[pos] ^= rng.randrange(1, 256)
        source = dict(clean)
        source[ref.id] = bytes(data)
        with pytest.raises(ChunkCorrupt) as info:
            unpack(manifest, source)
        err = info.value
        assert err.chunk_id == ref.id
        assert set(err.tensors) == set(manifest.tensors_of_chunk(ref.index))
        assert ref.id in str(err) and err.tensors[0] in str(err)


def test_truncated_or_padded_chunks_are_detected() -> None:
    _, result = _model("off")
    ref = result.manifest.chunks[0]
    data = result.chunk(0).data
    for bad in (data[:-1], data + b"\0", b""):
        with pytest.raises(ChunkCorrupt, match="stored size"):
            decode_chunk(ref, bad)


def test_content_id_is_checked_even_when_crc_matches() -> None:
    _, result = _model("off")
    ref = result.manifest.chunks[0]
    data = bytearray(result.chunk(0).data)
    data[10] ^= 0xFF
    forged = ref._replace(crc32c=crc32c(bytes(data)))
    with pytest.raises(ChunkCorrupt, match="content hash"):
        decode_chunk(forged, bytes(data))


def test_decompression_bomb_is_refused() -> None:
    ref0 = pack({"w": torch.linspace(0, 1, 1024)}, model="m", config=ChunkingConfig(chunk_size=SMALL, codec="on")).manifest.chunks[0]
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (64 << 20))
    ref = ref0._replace(stored_size=len(bomb), crc32c=crc32c(bomb), codec="zstd")
    with pytest.raises(DecompressionBomb, match="more than the declared"):
        decode_chunk(ref, bomb)
    blind = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\0" * 8192)
    ref = ref0._replace(stored_size=len(blind), crc32c=crc32c(blind), codec="zstd")
    with pytest.raises(DecompressionBomb, match="does not declare"):
        decode_chunk(ref, blind)


def test_decode_into_out_buffer() -> None:
    _, result = _model("on")
    for ref in result.manifest.chunks:
        out = bytearray(ref.raw_size)
        assert decode_chunk(ref, result.chunk(ref.index).data, out=out) is out
        assert bytes(out) == bytes(result.raw_chunk(ref.index))


@pytest.mark.parametrize("width", [2, 4, 8, 16])
def test_shuffle_inverts_with_odd_tails(width: int) -> None:
    raw = np.random.default_rng(width).integers(0, 256, 1000 + width // 2, dtype=np.uint8)
    out = np.empty_like(raw)
    unshuffle_into(shuffle(raw, width), width, out)
    assert np.array_equal(out, raw)


def test_auto_keeps_raw_when_zstd_saves_little() -> None:
    noise = np.random.default_rng(0).integers(0, 256, SMALL, dtype=np.uint8).tobytes()
    assert encode_chunk(noise, ChunkingConfig(codec="auto"), 4)[0] == "raw"
    assert encode_chunk(bytes(SMALL), ChunkingConfig(codec="auto"), 4)[0] == "zstd+shuffle4"
    assert encode_chunk(bytes(SMALL), ChunkingConfig(codec="auto", shuffle=False), 4)[0] == "zstd"


# -- manifests ---------------------------------------------------------------

def _manifest_bytes(format_version: int = 1) -> tuple[Manifest, bytes]:
    """A manifest in ``format_version`` (1, JSON, by default: the tests below edit its document)."""
    _, result = _model("auto")
    manifest = result.manifest.in_format(format_version)
    return manifest, manifest.to_bytes()


@pytest.mark.parametrize("format_version", [1, 2])
def test_manifest_round_trips_and_checks_its_id(format_version: int) -> None:
    m, b = _manifest_bytes(format_version)
    assert Manifest.from_bytes(b, expected_id=m.id) == m
    assert m.id != m.with_version(7).id
    with pytest.raises(ManifestError, match="do not match the id"):
        Manifest.from_bytes(b, expected_id=m.with_version(7).id)


def test_unknown_format_version_is_refused_clearly() -> None:
    _, b = _manifest_bytes()
    doc = json.loads(b)
    doc["format_version"] = 99
    with pytest.raises(ManifestError, match="format version 99 is not supported.*Upgrade"):
        Manifest.from_bytes(json.dumps(doc).encode())


@pytest.mark.parametrize("format_version", [1, 2])
def test_every_truncation_is_refused(format_version: int) -> None:
    _, b = _manifest_bytes(format_version)
    for cut in list(range(0, len(b), max(1, len(b) // 300))) + [len(b) - 1]:
        with pytest.raises(ManifestError):
            Manifest.from_bytes(b[:cut])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("chunks"),
        lambda d: d["chunks"].pop(),
        lambda d: d["chunks"][0].__setitem__(0, "zz"),
        lambda d: d["chunks"][0].__setitem__(1, 5),
        lambda d: d["chunks"][0].__setitem__(3, "lz4"),
        lambda d: d["chunks"][0].__setitem__(4, -1),
        lambda d: d["tensors"][0].__setitem__(1, "float128"),
        lambda d: d["tensors"][0].__setitem__(2, [-1]),
        lambda d: d["tensors"][0].__setitem__(4, 3),
        lambda d: d["tensors"][1].__setitem__(3, 0),
        lambda d: d["tensors"].append(d["tensors"][0]),
        lambda d: d.__setitem__("chunk_size", 1000),
        lambda d: d.__setitem__("hash_algorithm", "md5"),
        lambda d: d.__setitem__("extra", 1),
    ],
)
def test_malformed_manifests_are_refused(mutate) -> None:  # type: ignore[no-untyped-def]
    _, b = _manifest_bytes()
    doc = json.loads(b)
    mutate(doc)
    with pytest.raises(ManifestError, match="malformed|not supported"):
        Manifest.from_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def test_non_canonical_bytes_and_garbage_are_refused() -> None:
    _, b = _manifest_bytes()
    with pytest.raises(ManifestError, match="canonical"):
        Manifest.from_bytes(json.dumps(json.loads(b), indent=1).encode())
    for junk in (b"", b"\xff\xfe", b"[]", b"null", b'{"format_version": 1}'):
        with pytest.raises(ManifestError):
            Manifest.from_bytes(junk)


def test_with_version_restamps_only_new_chunks() -> None:
    sd, first = _model("off")
    sd2 = dict(sd, **{"enc.bias": torch.zeros(300, dtype=torch.bfloat16)})
    second = pack(sd2, model="m", version=0, previous=first.manifest, config=ChunkingConfig(chunk_size=SMALL)).manifest
    stamped = second.with_version(2)
    assert {c.introduced_in for c in stamped.chunks} == {1, 2}
    assert all((c.introduced_in == 2) == (c.id not in set(first.manifest.chunk_ids())) for c in stamped.chunks)


def test_forged_huge_offset_is_refused_without_planning_it() -> None:
    _, b = _manifest_bytes()
    doc = json.loads(b)
    doc["tensors"][-1][3] = 1 << 62
    with pytest.raises(ManifestError, match="chunks listed"):
        Manifest.from_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def test_pack_refuses_names_and_stamps_a_manifest_cannot_hold() -> None:
    from chunking import InvalidInput

    with pytest.raises(InvalidInput, match="not valid Unicode"):
        pack({"bad\ud800": torch.ones(1)}, model="m")
    with pytest.raises(InvalidInput, match="finite"):
        pack({"a": torch.ones(1)}, model="m", created_at=float("nan"))


def test_shuffle_width_always_divides_the_chunk() -> None:
    cfg = ChunkingConfig(codec="on")
    assert encode_chunk(bytes(4102), cfg, 4)[0] == "zstd+shuffle2"
    assert encode_chunk(bytes(4101), cfg, 8)[0] == "zstd"
    sd = {"a": torch.zeros(1000), "b": torch.zeros(3, dtype=torch.int8)}
    for ref in pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL, codec="on")).manifest.chunks:
        width = int(ref.codec.removeprefix("zstd+shuffle") or 1) if ref.codec != "zstd" else 1
        assert ref.raw_size % width == 0


def test_crc32c_is_castagnoli_on_every_buffer_type() -> None:
    import array

    import numpy as np

    from chunking.hashing import crc32c

    # The standard check value of CRC-32C ("123456789"), and the same bytes in every form a chunk takes.
    check = b"123456789"
    assert crc32c(check) == 0xE3069283 and crc32c(b"") == 0
    assert crc32c(bytearray(check)) == crc32c(memoryview(check)) == crc32c(np.frombuffer(check, np.uint8)) == 0xE3069283
    floats = np.arange(1000, dtype=np.float32)
    assert crc32c(floats) == crc32c(floats.tobytes()) == crc32c(memoryview(floats)) == crc32c(array.array("f", floats.tolist()))
    # iSCSI's published example (RFC 3720, B.4): 32 bytes of zeros
    assert crc32c(bytes(32)) == 0x8A9136AA
