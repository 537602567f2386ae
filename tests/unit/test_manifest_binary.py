"""Manifest format 2 (binary columns): round trips bit-exact, still reads format 1, refuses damage."""
from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
import torch

from chunking import ChunkingConfig, Manifest, ManifestError, pack, unpack
from chunking.chunk_table import ChunkRows, ChunkTable
from chunking.dtypes import DTYPES
from chunking.layout import chunk_raw_sizes, place_tensors, plan_chunks
from chunking.manifest_binary import MAGIC
from tests.unit.chunking_helpers import assert_bit_exact, random_tensor

SMALL = 4096


def _state_dict() -> dict[str, torch.Tensor]:
    sd = {f"t.{name}": random_tensor(dtype, (3, 1001), i) for i, (name, dtype) in enumerate(sorted(DTYPES.items()))}
    sd |= {"empty": torch.empty(0, 5), "scalar": torch.tensor(2.5, dtype=torch.float64),
           "zeros": torch.zeros(5 * SMALL, dtype=torch.uint8), "zeros.again": torch.zeros(3 * SMALL, dtype=torch.uint8)}
    return sd


@pytest.mark.parametrize("codec", ["off", "auto", "on"])
def test_format_2_round_trips_every_dtype_bit_exact(codec: str) -> None:
    sd = _state_dict()
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL, codec=codec), created_at=1.5e9)
    manifest = result.manifest
    data = manifest.to_bytes()
    assert manifest.format_version == 2 and data.startswith(MAGIC)
    again = Manifest.from_bytes(data, expected_id=manifest.id)
    assert again == manifest and again.to_bytes() == data
    assert list(again.chunks) == list(manifest.chunks)
    assert again.unique_chunks() == manifest.unique_chunks()
    assert len(again.unique_chunks()) < len(again.chunks), "repeated zero chunks are listed once"
    assert_bit_exact(unpack(again, result.source()), sd)


def test_format_1_manifests_still_load_with_their_bytes_and_id() -> None:
    sd = _state_dict()
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL, codec="auto"))
    old = result.manifest.in_format(1)
    data = old.to_bytes()
    assert json.loads(data)["format_version"] == 1
    loaded = Manifest.from_bytes(data, expected_id=old.id)
    assert loaded.format_version == 1 and loaded.to_bytes() == data and loaded.id == old.id
    assert loaded.in_format(2) == result.manifest and loaded.in_format(2).id == result.manifest.id
    assert_bit_exact(unpack(loaded, result.source()), sd)
    assert len(result.manifest.to_bytes()) < len(data)


def test_with_version_keeps_the_format_and_restamps() -> None:
    sd = _state_dict()
    first = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL)).manifest
    sd2 = dict(sd, scalar=torch.tensor(3.5, dtype=torch.float64))
    second = pack(sd2, model="m", version=0, previous=first, config=ChunkingConfig(chunk_size=SMALL)).manifest
    stamped = second.with_version(4)
    assert stamped.format_version == 2
    assert {c.introduced_in for c in stamped.chunks} == {1, 4}
    assert Manifest.from_bytes(stamped.to_bytes(), expected_id=stamped.id) == stamped


def test_any_flipped_byte_is_refused_under_its_id() -> None:
    manifest = pack(_state_dict(), model="m", config=ChunkingConfig(chunk_size=SMALL, codec="auto")).manifest
    data = manifest.to_bytes()
    rng = random.Random(7)
    for _ in range(300):
        damaged = bytearray(data)
        damaged[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        with pytest.raises(ManifestError):
            Manifest.from_bytes(bytes(damaged), expected_id=manifest.id)


def _header(data: bytes) -> tuple[dict, bytes]:  # type: ignore[type-arg]
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    body = data[start + n:]
    pad = -(start + n) % 8
    return json.loads(data[start:start + n]), body[pad:]


def _with_header(doc: dict, columns: bytes) -> bytes:  # type: ignore[type-arg]
    head = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    pre = MAGIC + struct.pack("<I", len(head)) + head
    return pre + bytes(-len(pre) % 8) + columns


def test_forged_counts_and_tables_are_refused_before_allocating() -> None:
    manifest = pack(_state_dict(), model="m", config=ChunkingConfig(chunk_size=SMALL)).manifest
    doc, columns = _header(manifest.to_bytes())
    assert _with_header(doc, columns) == manifest.to_bytes()
    forged = [
        (dict(doc, chunk_count=(1 << 32) - 1), "describes"),
        (dict(doc, runs=[1, 1, 1 << 31]), "describes"),
        (dict(doc, runs=[1, 1]), "run counts"),
        (dict(doc, codecs=["lz4"]), "codec table"),
        (dict(doc, format_version=3), "not supported"),
        (dict(doc, extra=1), "unexpected"),
        (dict(doc, chunk_size=1000), "chunk_size"),
    ]
    for bad, why in forged:
        with pytest.raises(ManifestError, match=why):
            Manifest.from_bytes(_with_header(bad, columns))
    for junk in (MAGIC, MAGIC + b"\xff\xff\xff\xff", MAGIC + struct.pack("<I", 2) + b"[]"):
        with pytest.raises(ManifestError, match="format-2 bytes are damaged"):
            Manifest.from_bytes(junk)


def test_runs_that_are_not_maximal_are_not_canonical() -> None:
    """Two adjacent runs of the same value decode to the same chunks; only the maximal encoding is accepted."""
    manifest = pack(_state_dict(), model="m", config=ChunkingConfig(chunk_size=SMALL)).manifest
    data = manifest.to_bytes()
    doc, columns = _header(data)
    n = doc["chunk_count"]
    assert doc["runs"][1] == 1
    fixed = n * 32 + 2 * (n * 4 + -(n * 4) % 8)  # digests, CRCs, stored sizes; each column padded to 8
    k0 = doc["runs"][0]
    codec_part = k0 * 4 + (-(k0 * 4) % 8) + k0 + (-k0 % 8)
    start = fixed + codec_part
    counts, value = struct.unpack_from("<I", columns, start)[0], struct.unpack_from("<Q", columns, start + 8)[0]
    assert counts == n
    split = struct.pack("<II", n - 1, 1) + struct.pack("<QQ", value, value)
    rest = columns[start + 16:]
    forged = _with_header(dict(doc, runs=[k0, 2, doc["runs"][2]]), columns[:start] + split + rest)
    with pytest.raises(ManifestError, match="canonical"):
        Manifest.from_bytes(forged)


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_raw_sizes_match_the_plan(seed: int) -> None:
    rng = random.Random(seed)
    cs = rng.choice([4096, 8192, 65536])
    sizes = [(rng.choice([0, 1, 3, rng.randrange(1, 3 * cs), rng.randrange(cs, 5 * cs)]), rng.choice([1, 2, 4, 8]))
             for _ in range(rng.randrange(1, 40))]
    sizes = [(nb - nb % elem, elem) for nb, elem in sizes]
    ranges = list(zip(place_tensors(sizes, cs), (nb for nb, _ in sizes)))
    try:
        want = plan_chunks(ranges, cs).raw_sizes
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc)[:20]):
            chunk_raw_sizes(ranges, cs)
        return
    assert chunk_raw_sizes(ranges, cs).tolist() == list(want)


def test_first_rows_find_repeats_even_when_ids_share_a_prefix() -> None:
    rng = np.random.default_rng(3)
    digests = rng.integers(0, 256, (500, 32), dtype=np.uint8)
    digests[100] = digests[7]
    digests[400] = digests[7]
    digests[250, :8] = digests[9, :8]  # same first 8 bytes, different id
    n = len(digests)
    table = ChunkTable(digests, np.ones(n), np.ones(n), np.zeros(n, np.uint32), np.zeros(n, np.uint8), ("raw",),
                       np.ones(n, np.int64), np.zeros(n))
    ids = table.ids
    assert table.first_rows.tolist() == [i for i, x in enumerate(ids) if ids.index(x) == i]
    assert 250 in table.first_rows.tolist() and 100 not in table.first_rows.tolist()
    # The row-level views a fetch uses, against their per-id definitions.
    assert table.repeats == {7: (7, 100, 400)}
    assert table.rows_of(7) == (7, 100, 400) and table.rows_of(9) == (9,)
    assert table.first_row_of == {cid: ids.index(cid) for cid in ids}
    assert [int(k) for k in table.ring_keys] == [int(cid[:16], 16) for cid in ids]
    assert table.raw_rows.all()
    picked = ChunkRows.of(table)
    assert picked.rows.tolist() == table.first_rows.tolist()
    assert [r.id for r in picked.refs()] == [ids[i] for i in table.first_rows.tolist()]
    with pytest.raises(IndexError):
        ChunkRows.of(table, [0, n])
    own = ChunkRows.of_refs([table[400], table[9]])
    assert own.rows.tolist() == [0, 1] and own.table.ids == (ids[400], ids[9])


def test_a_reordered_or_padded_codec_table_is_not_canonical() -> None:
    manifest = pack(_state_dict(), model="m", config=ChunkingConfig(chunk_size=SMALL, codec="auto")).manifest
    doc, columns = _header(manifest.to_bytes())
    assert len(doc["codecs"]) >= 2
    unused = next(c for c in ("raw", "zstd", "zstd+shuffle2", "zstd+shuffle16") if c not in doc["codecs"])
    with pytest.raises(ManifestError, match="codec table"):
        Manifest.from_bytes(_with_header(dict(doc, codecs=doc["codecs"] + [unused]), columns))
    # The same chunks with the table reversed and the run values remapped: another encoding, refused.
    n, k0 = doc["chunk_count"], doc["runs"][0]
    start = n * 32 + 2 * (n * 4 + -(n * 4) % 8) + k0 * 4 + -(k0 * 4) % 8
    values = bytearray(columns[start : start + k0])
    last = len(doc["codecs"]) - 1
    remapped = bytes(last - v for v in values)
    forged = columns[:start] + remapped + columns[start + k0:]
    with pytest.raises(ManifestError, match="codec table"):
        Manifest.from_bytes(_with_header(dict(doc, codecs=doc["codecs"][::-1]), forged))


@pytest.mark.parametrize("field, value", [(1, 2**64), (2, 2**64), (2, 2**32), (5, 2**63)])
def test_format_1_numbers_out_of_range_are_malformed_not_a_crash(field: int, value: int) -> None:
    manifest = pack(_state_dict(), model="m", config=ChunkingConfig(chunk_size=SMALL)).manifest.in_format(1)
    doc = json.loads(manifest.to_bytes())
    doc["chunks"][0][field] = value
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def test_a_lone_surrogate_in_a_name_is_malformed_not_a_crash() -> None:
    manifest = pack(_state_dict(), model="m", config=ChunkingConfig(chunk_size=SMALL)).manifest
    doc, columns = _header(manifest.to_bytes())
    head = json.dumps(dict(doc, model="\ud800"), sort_keys=True, separators=(",", ":")).encode()  # ASCII escapes
    pre = MAGIC + struct.pack("<I", len(head)) + head
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_bytes(pre + bytes(-len(pre) % 8) + columns)
