"""Formats 3 and 4: a split manifest (a root naming parts, and in format 4 a layout blob)
round-trips, proves every blob, and shares the parts of the tensors a fine-tune leaves alone."""
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
from chunking.manifest import BINARY_FORMAT, LAYOUT_SPLIT_FORMAT, SPLIT_FORMAT, Manifest, written_format
from chunking.pack import pack
from paramserver.server.gc import References

SMALL = 4096
FORMATS = pytest.mark.parametrize("fmt", [SPLIT_FORMAT, LAYOUT_SPLIT_FORMAT])


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {f"layer{i:02d}.weight": torch.randn(64, 257, generator=gen) for i in range(20)}  # 16.06 chunks each
    out |= {f"layer{i:02d}.bias": torch.randn(7, generator=gen).half() for i in range(20)}  # packed together
    out |= {"big": torch.randn(300, 1000, generator=gen).bfloat16(), "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3), "flags": torch.rand(33, generator=gen) > 0.5}
    return out


def _split(seed: int = 0, fmt: int = LAYOUT_SPLIT_FORMAT, **kw: Any) -> Manifest:
    m = pack(_state(seed), model="m", config=ChunkingConfig(chunk_size=SMALL), **kw).manifest
    return m if m.format_version == fmt else m.in_format(fmt)


def test_pack_splits_only_manifests_with_many_chunks() -> None:
    assert written_format(manifest_split.SPLIT_FROM_CHUNKS - 1) == BINARY_FORMAT
    assert written_format(manifest_split.SPLIT_FROM_CHUNKS) == LAYOUT_SPLIT_FORMAT
    small = pack({"w": torch.ones(10)}, model="m").manifest
    assert small.format_version == BINARY_FORMAT and small.parts == () and list(small.blobs()) == [small.id]


@FORMATS
def test_a_split_manifest_round_trips_through_its_blobs(fmt: int) -> None:
    m = _split(fmt=fmt)
    assert len(m.parts) > 3 and m.parts[0].start == 0 and m.parts[-1].stop == len(m.chunks)
    assert all(a.stop == b.start for a, b in zip(m.parts, m.parts[1:]))
    blobs = m.blobs()
    assert next(iter(blobs)) == m.id and content_id(blobs[m.id]) == m.id
    assert all(content_id(p.data) == p.id for p in m.parts)
    layout = [m.layout_blob[0]] if m.layout_blob else []
    assert (m.layout_blob is not None) == (fmt == LAYOUT_SPLIT_FORMAT)
    assert manifest_split.part_ids(m.to_bytes()) == tuple(dict.fromkeys(layout + [p.id for p in m.parts]))
    assert list(blobs) == list(dict.fromkeys([m.id, *layout, *(p.id for p in m.parts)]))
    assert manifest_split.part_ids(m.in_format(BINARY_FORMAT).to_bytes()) == ()
    back = Manifest.from_bytes(m.to_bytes(), expected_id=m.id, parts=blobs)
    assert back == m and back.id == m.id and back.tensors == m.tensors
    asked: list[str] = []

    def get(blob_id: str) -> bytes:
        asked.append(blob_id)
        return blobs[blob_id]

    assert Manifest.read(m.id, get) == m
    assert asked[0] == m.id and sorted(asked[1:]) == sorted(set(layout + [p.id for p in m.parts]))
    assert m.all_chunk_ids() >= set(blobs) - {m.id}
    # The same manifest in format 2 holds the same rows: the forms differ only in bytes.
    assert Manifest.from_bytes(m.in_format(BINARY_FORMAT).to_bytes()).chunks == m.chunks


@FORMATS
def test_a_fine_tune_shares_the_parts_of_the_tensors_it_left_alone(fmt: int) -> None:
    base = _split(fmt=fmt)
    tuned_state = _state()
    tuned_state["layer03.weight"] = tuned_state["layer03.weight"] + 1
    tuned = pack(tuned_state, model="m", version=2, config=ChunkingConfig(chunk_size=SMALL), previous=base).manifest
    tuned = tuned.in_format(fmt)
    old = {p.id for p in base.parts}
    new_parts = [p for p in tuned.parts if p.id not in old]
    assert len(new_parts) == 1 and len(tuned.parts) == len(base.parts)
    rows = set(tuned.chunks_of_tensor("layer03.weight"))
    assert rows <= set(range(new_parts[0].start, new_parts[0].stop))
    added = sum(len(b) for bid, b in tuned.blobs().items() if bid not in base.blobs())
    total = sum(len(b) for b in tuned.blobs().values())
    assert added < 0.5 * total
    if fmt == LAYOUT_SPLIT_FORMAT:
        # The layout is shared and the new part holds the changed tensor's rows alone, so the new
        # blobs are that part and a root of a few dozen bytes a part.
        assert tuned.layout_blob == base.layout_blob
        assert new_parts[0].stop - new_parts[0].start == len(rows)
        assert added == len(new_parts[0].data) + len(tuned.to_bytes()) < 0.15 * total


@FORMATS
def test_without_its_parts_a_root_is_refused_with_what_to_do(fmt: int) -> None:
    m = _split(fmt=fmt)
    with pytest.raises(ManifestError, match=f"split .format {fmt}.: fetch the blobs"):
        Manifest.from_bytes(m.to_bytes())
    with pytest.raises(ManifestError, match="a part of a split manifest, not a manifest"):
        Manifest.from_bytes(m.parts[0].data)
    blobs = m.blobs()
    del blobs[m.parts[1].id]
    with pytest.raises(ManifestError, match="part #1 .* was not supplied"):
        Manifest.from_bytes(m.to_bytes(), parts=blobs)


@FORMATS
def test_a_damaged_swapped_or_forged_part_is_refused(fmt: int) -> None:
    m = _split(fmt=fmt)
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
    root = (manifest_split.encode_root(m._header(), forged) if fmt == SPLIT_FORMAT else
            manifest_split.encode_root4(m._header(layout=False), m.layout_blob[0], forged))  # type: ignore[index]
    with pytest.raises(ManifestError, match="not cut where the tensor layout puts the cuts"):
        Manifest.from_bytes(root, parts={p.id: p.data for p in forged} | dict([m.layout_blob] if m.layout_blob else []))
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


@FORMATS
def test_orphan_collection_keeps_the_parts_of_a_split_manifest(fmt: int) -> None:
    m = _split(fmt=fmt)
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


@FORMATS
def test_a_manifest_of_no_chunks_splits_into_a_root_and_its_layout_alone(fmt: int) -> None:
    m = pack({"empty": torch.empty(0, 4), "none": torch.zeros(0)}, model="m").manifest.in_format(fmt)
    blobs = m.blobs()
    assert m.parts == () and list(blobs) == [m.id] + ([m.layout_blob[0]] if m.layout_blob else [])
    assert Manifest.read(m.id, blobs.__getitem__) == m


def test_part_bounds_of_format_4_give_every_large_tensor_parts_of_its_own() -> None:
    cs, big = SMALL, manifest_split.PART_MIN_CHUNKS
    # A norm in a chunk of its own, a large tensor, two small ones (3 and 1 chunks), a large one,
    # a 20-byte bias, a large one: the layout of a decoder layer.
    ranges, cursor = [], 0
    for chunks in (None, big + 4, 3, 1, big, None, big * 2):
        nbytes = 20 if chunks is None else chunks * cs
        ranges.append((cursor, nbytes))
        cursor = -(-(cursor + nbytes) // cs) * cs
    count = cursor // cs
    three = manifest_split.part_bounds(ranges, cs, count, rule=3)
    four = manifest_split.part_bounds(ranges, cs, count, rule=4)
    n = 1 + big + 4
    # Format 3 puts the norm with the large tensor after it, and the small ones with the large
    # one after them: a change to any of the small ones rewrites a large tensor's rows.
    assert three == [(0, n), (n, n + 4 + big), (n + 4 + big, count)]
    # Format 4 starts a part at each large tensor; small neighbours stay together.
    assert four == [(0, 1), (1, n), (n, n + 4), (n + 4, n + 4 + big), (n + 4 + big, n + 5 + big), (n + 5 + big, count)]
    assert manifest_split.part_bounds([], cs, 0, rule=4) == []


def _pinned() -> Manifest:
    """A manifest whose every field is fixed, so its bytes in each format are too."""
    from chunking.chunk_table import ChunkTable
    from chunking.layout import chunk_raw_sizes, place_tensors
    from chunking.manifest import TensorEntry

    shapes = [("a.norm", (7,)), ("a.weight", (300, 100)), ("b.bias", (5,)), ("b.weight", (40, 100)), ("c", (2000, 50))]
    offsets = place_tensors([(4 * int(np.prod(s)), 4) for _n, s in shapes], SMALL)
    tensors = tuple(TensorEntry(n, "float32", s, o, 4 * int(np.prod(s))) for (n, s), o in zip(shapes, offsets))
    raw = chunk_raw_sizes([(t.offset, t.nbytes) for t in tensors], SMALL)
    rng = np.random.default_rng(7)
    n = len(raw)
    table = ChunkTable(rng.integers(0, 256, (n, 32), dtype=np.uint8), raw, raw, rng.integers(0, 1 << 32, n, dtype=np.uint32),
                       np.zeros(n, np.uint8), ("raw",), np.ones(n, np.int64), np.full(n, 1.7e9))
    return Manifest(model="pinned", version=1, chunk_size=SMALL, format_version=BINARY_FORMAT, tensors=tensors,
                    chunks=table, fingerprint="0" * 64)


def test_the_bytes_of_each_format_are_pinned_so_manifests_already_stored_keep_their_ids() -> None:
    # Format 3 was the written form before format 4: roots and parts stored by earlier releases
    # must keep loading under their ids, so their encoding may never change.
    m = _pinned()
    ids = {fmt: m.in_format(fmt).id for fmt in (BINARY_FORMAT, SPLIT_FORMAT, LAYOUT_SPLIT_FORMAT)}
    assert ids == {  # formats 2 and 3 as the release before format 4 wrote them
        BINARY_FORMAT: "2db2ce01134630d6289848edfa343d1bbde1a349275adb76d86c92166e857bbb",
        SPLIT_FORMAT: "fefb7cc6b195529db41666de89b9cb9db6c49a203ad6bc998c4fcbdc5c4eade8",
        LAYOUT_SPLIT_FORMAT: "b609b9f4dfc0db6271d9270078f5e5b2f129b200cdbabdd28cc801031042c556",
    }
    for fmt in (SPLIT_FORMAT, LAYOUT_SPLIT_FORMAT):
        blobs = m.in_format(fmt).blobs()
        assert Manifest.read(ids[fmt], blobs.__getitem__).chunks == m.chunks


def _root4_with(data: bytes, separators: tuple[str, str] = (",", ":"), **changes: Any) -> bytes:
    """A format-4 root with header fields changed, its header re-laid (canonical unless ``separators`` say otherwise)."""
    prefix = len(manifest_split.ROOT4_MAGIC) + 4
    head_len = int.from_bytes(data[len(manifest_split.ROOT4_MAGIC) : prefix], "little")
    doc = json.loads(data[prefix : prefix + head_len]) | changes
    head = json.dumps(doc, sort_keys=True, separators=separators).encode()
    body = data[prefix + head_len + (-(prefix + head_len) % 8):]
    return manifest_split.ROOT4_MAGIC + len(head).to_bytes(4, "little") + head + bytes(-(prefix + len(head)) % 8) + body


def _no_fetch(blob_id: str) -> bytes:
    pytest.fail(f"{blob_id} was asked for before the root was refused")


def test_a_damaged_format_4_root_or_layout_is_refused_naming_what_is_wrong() -> None:
    m = _split()
    root, blobs = m.to_bytes(), m.blobs()
    layout_id, layout = m.layout_blob  # type: ignore[misc]
    cases: list[tuple[bytes, str]] = [
        (root[:10], "shorter than a root's prefix"),
        (root[:-8], "header describes"),
        (_root4_with(root, part_count=len(m.parts) + 1), "header describes"),
        (_root4_with(root, part_count=-1), "part_count must be an integer"),
        (_root4_with(root, layout="xyz"), "layout is not a content id"),
        (root[:12] + root[12:].replace(b'"model":', b'"model" :', 1), "not UTF-8 JSON"),
        (_root4_with(root, separators=(", ", ": ")), "not canonical JSON"),
        (root[:8] + ((1 << 20) + 1).to_bytes(4, "little") + root[12:], "over the 1048576-byte limit"),
        (root[:8] + (len(root) - 11).to_bytes(4, "little") + root[12:], "runs past the end"),
    ]
    prefix = len(manifest_split.ROOT4_MAGIC) + 4
    head_end = prefix + int.from_bytes(root[8:prefix], "little")
    ids_at = head_end + -head_end % 8
    pads = [p for p in (head_end, ids_at + 36 * len(m.parts)) if p % 8]  # the zeros after the header, after the counts
    zero_count = bytearray(root)
    zero_count[ids_at + 32 * len(m.parts) : ids_at + 32 * len(m.parts) + 4] = bytes(4)
    cases.append((bytes(zero_count), "chunk count is not 1"))
    for at in pads:
        cases.append((root[:at] + b"\x01" + root[at + 1 :], "padding is not zeros"))
    assert pads, "the root should have padding to check"
    for data, reason in cases:
        with pytest.raises(ManifestError, match=f"format-4 root is damaged: .*({reason})"):
            Manifest.from_bytes(data, parts=blobs)
    without = {k: v for k, v in blobs.items() if k != layout_id}
    with pytest.raises(ManifestError, match=f"layout blob {layout_id} was not supplied"):
        Manifest.from_bytes(root, parts=without)
    with pytest.raises(ManifestError, match="do not match the id"):
        Manifest.from_bytes(root, parts=dict(blobs, **{layout_id: layout + b" "}))
    # A layout that hashes to the id a forged root names, but is not canonical, is refused too.
    spaced = layout.replace(b'"tensors":', b'"tensors": ', 1)
    forged_root = _root4_with(root, layout=content_id(spaced))
    with pytest.raises(ManifestError, match="layout blob .* is damaged: it is not canonical JSON"):
        Manifest.from_bytes(forged_root, parts=dict(blobs, **{content_id(spaced): spaced}))
    not_layout = manifest_split.LAYOUT_MAGIC + b'{"kind":"part"}'
    with pytest.raises(ManifestError, match="not a layout"):
        Manifest.from_bytes(_root4_with(root, layout=content_id(not_layout)), parts={content_id(not_layout): not_layout} | blobs)
    # A format-4 root that says it is format 3 is refused, not misread.
    with pytest.raises(ManifestError, match="format_version 3 does not match its format-4 magic bytes"):
        Manifest.from_bytes(_root4_with(root, format_version=3), parts=blobs)
    # The tensors and files belong in the layout: a root that holds them is refused before any blob is asked for.
    tensors = json.loads(layout[len(manifest_split.LAYOUT_MAGIC):])["tensors"]
    for extra in ({"tensors": tensors}, {"files": []}, {"weight_files": ["a"], "tensor_file": []}):
        forged = _root4_with(root, **extra)
        with pytest.raises(ManifestError, match="format-4 root keys .* are missing or unexpected"):
            Manifest.read(content_id(forged), _no_fetch, root=forged)
    # A layout with a key that is not the layout's is refused.
    doc = json.loads(layout[len(manifest_split.LAYOUT_MAGIC):]) | {"model": "other"}
    odd = manifest_split.LAYOUT_MAGIC + json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(ManifestError, match=r"keys \['model'\] are missing or unexpected"):
        Manifest.from_bytes(_root4_with(root, layout=content_id(odd)), parts={content_id(odd): odd} | blobs)


def test_a_root_whose_parts_do_not_add_up_or_repeat_without_end_is_refused_before_joining() -> None:
    m = _split()
    blobs = m.blobs()
    layout_id = m.layout_blob[0]  # type: ignore[index]
    first = m.parts[0]
    # One part listed a million times: 4 TB of rows to join from a few kilobytes of blobs.
    repeated = [first] * 1_000_000
    forged = manifest_split.encode_root4(m._header(layout=False), layout_id, repeated)
    with pytest.raises(ManifestError, match="repeat its parts to at most 64x"):
        Manifest.read(content_id(forged), _no_fetch, root=forged)
    with pytest.raises(ManifestError, match="its parts hold 147000000 chunks but the tensors span"):
        Manifest.from_bytes(forged, parts=blobs)
    with pytest.raises(ValueError, match="repeat its parts to at most 64x"):  # even where a forged layout spans them
        manifest_split.join_parts([(first.id, first.stop - first.start)] * 1_000_000, blobs, "blake3")
    # A few repeats are legitimate (identical tensors share a part) but must add up to the tensors' span.
    short = manifest_split.encode_root4(m._header(layout=False), layout_id, m.parts[:-1])
    with pytest.raises(ManifestError, match=f"its parts hold {m.parts[-1].start} chunks but the tensors span {len(m.chunks)}"):
        Manifest.from_bytes(short, parts=blobs)


def test_identical_tensors_share_one_part_listed_twice() -> None:
    same = torch.arange(64 * 300, dtype=torch.float32).reshape(64, 300)  # 18.75 chunks: a part of its own
    state = {"a": same.clone(), "b": same.clone(), "c": torch.ones(3)}
    m = pack(state, model="twins", config=ChunkingConfig(chunk_size=SMALL)).manifest.in_format(LAYOUT_SPLIT_FORMAT)
    ids = [p.id for p in m.parts]
    assert ids[0] == ids[1] and len(set(ids)) == len(ids) - 1
    blobs = m.blobs()
    assert manifest_split.part_ids(m.to_bytes()).count(ids[0]) == 1
    assert Manifest.read(m.id, blobs.__getitem__) == m


def test_a_header_or_layout_nested_too_deep_is_refused_not_raised() -> None:
    deep: list[Any] = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]
    assert not manifest_binary.is_canonical_json({"kind": "layout", "tensors": deep}, b"{}")
    text = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match="not UTF-8 JSON"):
        manifest_split.decode_layout(manifest_split.LAYOUT_MAGIC + b'{"kind":"layout","tensors":' + text + b"}")
