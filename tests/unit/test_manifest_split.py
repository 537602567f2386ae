"""Format 3: a split manifest (a root naming parts) round-trips, proves every blob, and shares
the parts of the tensors a fine-tune leaves alone."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from chunking import manifest_binary, manifest_split
from chunking.config import ChunkingConfig
from chunking.errors import ManifestError
from chunking.hashing import content_id
from chunking.manifest import BINARY_FORMAT, SPLIT_FORMAT, Manifest, written_format
from chunking.pack import pack
from paramserver.server.gc import References

SMALL = 4096


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {f"layer{i:02d}.weight": torch.randn(64, 257, generator=gen) for i in range(20)}  # 16.06 chunks each
    out |= {f"layer{i:02d}.bias": torch.randn(7, generator=gen).half() for i in range(20)}  # packed together
    out |= {"big": torch.randn(300, 1000, generator=gen).bfloat16(), "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3), "flags": torch.rand(33, generator=gen) > 0.5}
    return out


def _split(seed: int = 0, **kw: Any) -> Manifest:
    m = pack(_state(seed), model="m", config=ChunkingConfig(chunk_size=SMALL), **kw).manifest
    return m if m.format_version == SPLIT_FORMAT else m.in_format(SPLIT_FORMAT)


def test_pack_splits_only_manifests_with_many_chunks() -> None:
    assert written_format(manifest_split.SPLIT_FROM_CHUNKS - 1) == BINARY_FORMAT
    assert written_format(manifest_split.SPLIT_FROM_CHUNKS) == SPLIT_FORMAT
    small = pack({"w": torch.ones(10)}, model="m").manifest
    assert small.format_version == BINARY_FORMAT and small.parts == () and list(small.blobs()) == [small.id]


def test_a_split_manifest_round_trips_through_its_blobs() -> None:
    m = _split()
    assert len(m.parts) > 3 and m.parts[0].start == 0 and m.parts[-1].stop == len(m.chunks)
    assert all(a.stop == b.start for a, b in zip(m.parts, m.parts[1:]))
    blobs = m.blobs()
    assert next(iter(blobs)) == m.id and content_id(blobs[m.id]) == m.id
    assert all(content_id(p.data) == p.id for p in m.parts)
    assert manifest_split.part_ids(m.to_bytes()) == tuple(dict.fromkeys(p.id for p in m.parts))
    assert manifest_split.part_ids(m.in_format(BINARY_FORMAT).to_bytes()) == ()
    back = Manifest.from_bytes(m.to_bytes(), expected_id=m.id, parts=blobs)
    assert back == m and back.id == m.id and back.tensors == m.tensors
    asked: list[str] = []

    def get(blob_id: str) -> bytes:
        asked.append(blob_id)
        return blobs[blob_id]

    assert Manifest.read(m.id, get) == m
    assert asked[0] == m.id and sorted(asked[1:]) == sorted(set(p.id for p in m.parts))
    # The same manifest in format 2 holds the same rows: the forms differ only in bytes.
    assert Manifest.from_bytes(m.in_format(BINARY_FORMAT).to_bytes()).chunks == m.chunks


def test_a_fine_tune_shares_the_parts_of_the_tensors_it_left_alone() -> None:
    base = _split()
    tuned_state = _state()
    tuned_state["layer03.weight"] = tuned_state["layer03.weight"] + 1
    tuned = pack(tuned_state, model="m", version=2, config=ChunkingConfig(chunk_size=SMALL), previous=base).manifest
    tuned = tuned.in_format(SPLIT_FORMAT)
    old = {p.id for p in base.parts}
    new_parts = [p for p in tuned.parts if p.id not in old]
    assert len(new_parts) == 1 and len(tuned.parts) == len(base.parts)
    rows = set(tuned.chunks_of_tensor("layer03.weight"))
    assert rows <= set(range(new_parts[0].start, new_parts[0].stop))
    added = sum(len(b) for bid, b in tuned.blobs().items() if bid not in base.blobs())
    assert added < 0.5 * sum(len(b) for b in tuned.blobs().values())


def test_without_its_parts_a_root_is_refused_with_what_to_do() -> None:
    m = _split()
    with pytest.raises(ManifestError, match="split .format 3.: fetch the parts"):
        Manifest.from_bytes(m.to_bytes())
    with pytest.raises(ManifestError, match="a part of a split manifest, not a manifest"):
        Manifest.from_bytes(m.parts[0].data)
    blobs = m.blobs()
    del blobs[m.parts[1].id]
    with pytest.raises(ManifestError, match="part #1 .* was not supplied"):
        Manifest.from_bytes(m.to_bytes(), parts=blobs)


def test_a_damaged_swapped_or_forged_part_is_refused() -> None:
    m = _split()
    blobs = m.blobs()
    a, b = m.parts[1], m.parts[2]
    swapped = dict(blobs, **{a.id: b.data})
    with pytest.raises(ManifestError, match=f"part #1 .{a.id}.: its bytes do not match its id"):
        Manifest.from_bytes(m.to_bytes(), parts=swapped)
    flipped = bytearray(a.data)
    flipped[-9] ^= 1
    with pytest.raises(ManifestError, match="do not match its id"):
        Manifest.from_bytes(m.to_bytes(), parts=dict(blobs, **{a.id: bytes(flipped)}))
    # A root whose parts are cut elsewhere than the layout says (two parts merged into one) is
    # not the canonical form, even with every id proven.
    t = m.chunks
    cols = manifest_binary.Columns(t.digests, t.crc32c, t.stored_size, t.codec_index, t.introduced_in, t.created_at)
    merged_bounds = [(m.parts[0].start, m.parts[1].stop)] + [(p.start, p.stop) for p in m.parts[2:]]
    forged = manifest_split.split_columns(cols, t.codecs, merged_bounds, "blake3")
    root = manifest_split.encode_root(m._header(), forged)
    with pytest.raises(ManifestError, match="not cut where the tensor layout puts the cuts"):
        Manifest.from_bytes(root, parts={p.id: p.data for p in forged})
    # The root is proven by its id before any part is asked for.
    with pytest.raises(ManifestError, match="do not match the id"):
        Manifest.read("0" * 64, lambda blob_id: blobs[m.id] if blob_id == "0" * 64 else pytest.fail("asked for a part"))


def _with_header(data: bytes, header: bytes) -> bytes:
    """``data`` (format-2 container bytes) with its header replaced by ``header``."""
    prefix = len(manifest_binary.MAGIC) + 4
    old = prefix + int.from_bytes(data[len(manifest_binary.MAGIC) : prefix], "little")
    body = data[old + (-old % 8):]
    return (manifest_binary.MAGIC + len(header).to_bytes(4, "little") + header
            + bytes(-(prefix + len(header)) % 8) + body)


def test_a_part_not_in_canonical_form_is_refused() -> None:
    n = 5
    cols = manifest_binary.Columns(np.zeros((n, 32), np.uint8), np.zeros(n, np.uint32), np.ones(n, np.uint32),
                                   np.zeros(n, np.uint8), np.asarray([1, 1, 2, 2, 2], np.int64), np.zeros(n, np.float64))
    data = manifest_binary.encode({"kind": "part", "codecs": ["raw"]}, cols)
    assert manifest_split.decode_part(data)[0] == ["raw"]
    # A header that is valid JSON but not canonical (spaces after separators).
    header, _ = manifest_binary.decode(data)
    spaced = _with_header(data, json.dumps(header, sort_keys=True).encode())
    manifest_binary.decode(spaced)  # the lenient decoder takes it
    with pytest.raises(ValueError, match="not canonical JSON"):
        manifest_split.decode_part(spaced)
    # Two neighbouring runs of one value: introduced_in [1, 1] in place of [1, 2].
    values = (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    at = data.index(values)
    not_maximal = data[:at] + (1).to_bytes(8, "little") * 2 + data[at + 16:]
    manifest_binary.decode(not_maximal)
    with pytest.raises(ValueError, match="not maximal"):
        manifest_split.decode_part(not_maximal)
    # Padding that is not zeros (the header's, then a column's: stored_size is 20 bytes + 4).
    prefix = 12 + int.from_bytes(data[8:12], "little")
    stored_at = prefix + (-prefix % 8) + n * 32 + n * 4 + (-(n * 4) % 8)
    padded = bytearray(data)
    padded[stored_at + n * 4] = 1
    manifest_binary.decode(bytes(padded))
    with pytest.raises(ValueError, match="padding is not zeros"):
        manifest_split.decode_part(bytes(padded))
    if -prefix % 8:
        padded = bytearray(data)
        padded[prefix] = 1
        with pytest.raises(ValueError, match="padding is not zeros"):
            manifest_split.decode_part(bytes(padded))


def test_part_bounds_cut_at_aligned_tensor_starts_and_never_pass_the_maximum() -> None:
    cs = SMALL
    # Three big tensors of 20, 40 and 5 chunks, then small ones packed together, then a huge one.
    ranges, cursor = [], 0
    for chunks in (20, 40, 5):
        ranges.append((cursor, chunks * cs))
        cursor += chunks * cs
    for _ in range(10):
        ranges.append((cursor, 100))
        cursor += 100
    cursor = -(-cursor // cs) * cs
    huge = manifest_split.PART_MAX_CHUNKS * 2 + 7
    ranges.append((cursor, huge * cs))
    count = cursor // cs + huge
    bounds = manifest_split.part_bounds(ranges, cs, count)
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(0 < stop - start <= manifest_split.PART_MAX_CHUNKS for start, stop in bounds)
    starts = [s for s, _ in bounds]
    # The 40-chunk tensor starts a part (the one before has >= PART_MIN_CHUNKS), so does the
    # 5-chunk one; the small ones and the huge one join it (fewer than PART_MIN_CHUNKS so far),
    # and the huge one is cut every PART_MAX_CHUNKS.
    big = manifest_split.PART_MAX_CHUNKS
    assert starts == [0, 20, 60, 60 + big, 60 + 2 * big]
    assert manifest_split.part_bounds([], cs, 0) == []


class _Plane:
    def __init__(self, versions: dict[str, list[str]]) -> None:
        self.versions = versions

    def list_models(self) -> SimpleNamespace:
        return SimpleNamespace(value=list(self.versions))

    def list_versions(self, model: str) -> SimpleNamespace:
        return SimpleNamespace(value=[SimpleNamespace(manifest_id=mid, number=i + 1) for i, mid in enumerate(self.versions[model])])


def test_orphan_collection_keeps_the_parts_of_a_split_manifest() -> None:
    m = _split()
    blobs = m.blobs()
    refs = References(_Plane({"m": [m.id]}), lambda blob_id: blobs[blob_id])()  # type: ignore[arg-type]
    assert refs is not None
    assert set(blobs) <= refs and set(m.chunk_ids()) <= refs


def test_references_are_made_again_only_when_the_committed_versions_change() -> None:
    m = _split()
    blobs = m.blobs()
    plane = _Plane({"m": [m.id]})
    references = References(plane, lambda blob_id: blobs[blob_id])  # type: ignore[arg-type]
    first = references()
    assert first is not None and references() is first  # asked every few seconds: the same answer, not a new union
    plane.versions["m"] = []  # the version was deleted
    assert references() == frozenset()
    plane.versions["m"] = [m.id]
    again = references()
    assert again == first and again is not first


class _Stub:
    """GetManifest of a server that sends at most ``per_reply`` parts (or none: an older one)."""

    def __init__(self, blobs: dict[str, bytes], per_reply: int) -> None:
        self.blobs, self.per_reply, self.calls = blobs, per_reply, 0

    def GetManifest(self, request: Any, timeout: float) -> SimpleNamespace:  # noqa: N802 - the gRPC method's name
        self.calls += 1
        if request.part_ids:
            return SimpleNamespace(parts=[self.blobs[i] for i in request.part_ids[: self.per_reply]])
        return SimpleNamespace(data=self.blobs[request.manifest_id], parts=[])


@pytest.mark.parametrize("per_reply", [0, 1, 3, 1000])
def test_parts_are_asked_for_in_bulk_until_every_one_came(per_reply: int) -> None:
    from paramserver.client.rpc import ParamServerClient

    m = _split()
    blobs = m.blobs()
    client = ParamServerClient("127.0.0.1:9")
    stub = _Stub(blobs, per_reply)
    client.stub = stub  # type: ignore[assignment]
    try:
        ids = [p.id for p in m.parts]
        assert client.get_manifest_parts(ids + ids[:2]) == {p.id: p.data for p in m.parts}
        want_calls = 2 * len(ids) if per_reply == 0 else -(-len(ids) // per_reply)
        assert stub.calls == want_calls
        stub.calls = 0
        got = Manifest.read(m.id, lambda i: blobs[i], get_parts=client.get_manifest_parts, parallel=4)
        assert got == m
    finally:
        client.close()


def test_a_part_whose_codec_table_is_not_names_is_refused() -> None:
    n = 2
    cols = manifest_binary.Columns(np.zeros((n, 32), np.uint8), np.zeros(n, np.uint32), np.ones(n, np.uint32),
                                   np.zeros(n, np.uint8), np.ones(n, np.int64), np.zeros(n, np.float64))
    forged = manifest_binary.encode({"kind": "part", "codecs": [["raw"]]}, cols)
    with pytest.raises(ValueError, match="other than names"):
        manifest_split.decode_part(forged)


def test_a_manifest_of_no_chunks_splits_into_a_root_alone() -> None:
    m = pack({"empty": torch.empty(0, 4), "none": torch.zeros(0)}, model="m").manifest.in_format(SPLIT_FORMAT)
    assert m.parts == () and list(m.blobs()) == [m.id]
    assert Manifest.read(m.id, lambda blob_id: m.to_bytes()) == m
