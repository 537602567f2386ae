"""Pack -> unpack is bit-exact for every dtype, shape, name and codec."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunking import ChunkingConfig, ChunkMissing, InvalidInput, Manifest, load_source, pack, unpack
from tests.unit.chunking_helpers import ALL_DTYPES, assert_bit_exact, bits, random_tensor

CODECS = ["off", "auto", "on"]
SMALL = 4096  # the smallest chunk size makes many boundaries with little data

names = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12
) | st.from_regex(r"[a-z]{1,6}(\.[a-z0-9_]{1,6}){0,3}", fullmatch=True)
shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple) | st.sampled_from(
    [(), (0,), (3, 0, 2), (1500,), (64, 33), (5000,)]
)


@st.composite
def state_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    keys = draw(st.lists(names, min_size=1, max_size=8, unique=True))
    return {
        k: random_tensor(draw(st.sampled_from(ALL_DTYPES)), draw(shapes), draw(st.integers(0, 2**32 - 1)))
        for k in keys
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sd=state_dicts(), codec=st.sampled_from(CODECS), shuffle=st.booleans())
def test_random_state_dicts_round_trip_bit_exact(sd: dict[str, torch.Tensor], codec: str, shuffle: bool) -> None:
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL, codec=codec, shuffle=shuffle))
    manifest = Manifest.from_bytes(result.manifest.to_bytes(), expected_id=result.manifest.id)
    assert manifest == result.manifest
    assert_bit_exact(unpack(manifest, result.source()), sd)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips(dtype: torch.dtype, codec: str) -> None:
    sd = {
        "big.weight": random_tensor(dtype, (3 * SMALL // dtype.itemsize + 7,), 1),
        "small.bias": random_tensor(dtype, (3, 5), 2),
        "scalar": random_tensor(dtype, (), 3),
        "empty": random_tensor(dtype, (0, 4), 4),
    }
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL, codec=codec))
    if codec == "on":
        assert all(c.codec.startswith("zstd") for c in result.manifest.chunks)
    assert_bit_exact(unpack(result.manifest, result.source()), sd)


def test_large_tensors_start_on_chunk_boundaries_and_own_their_chunks() -> None:
    sd = {"a": torch.ones(10), "b": torch.ones(SMALL // 4 * 2 + 3), "c": torch.ones(7, dtype=torch.float64)}
    m = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL)).manifest
    by_name = {t.name: t for t in m.tensors}
    assert by_name["b"].offset % SMALL == 0
    assert by_name["c"].offset % SMALL == 0, "the tensor after a large one starts on the next boundary"
    for index in m.chunks_of_tensor("b"):
        assert m.tensors_of_chunk(index) == ("b",)


def test_unchanged_large_tensor_keeps_its_chunk_ids_when_others_change() -> None:
    big = random_tensor(torch.float32, (5000,), 7)
    cfg = ChunkingConfig(chunk_size=SMALL)
    m1 = pack({"a.small": torch.zeros(3), "m.big": big}, model="m", config=cfg).manifest
    m2 = pack({"a.small": torch.ones(77), "b.new": torch.ones(9), "m.big": big}, model="m", config=cfg).manifest
    def ids(m: Manifest) -> list[str]:
        return [m.chunks[i].id for i in m.chunks_of_tensor("m.big")]

    assert ids(m1) == ids(m2)


def test_views_noncontiguous_and_shared_storage_store_each_tensors_own_bytes() -> None:
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    cplx = torch.randn(4, dtype=torch.complex64)
    sd = {
        "t": base.t(),  # non-contiguous
        "row": base[2],  # shares storage with base
        "slice": base[1:3, 2:5],
        "base": base,
        "conj": cplx.conj(),  # lazy conjugate view
        "neg": torch.randn(3)._neg_view() if hasattr(torch.Tensor, "_neg_view") else torch.randn(3),
    }
    out = unpack(pack(sd, model="m").manifest, pack(sd, model="m").source())
    for k, v in sd.items():
        assert bits(out[k]) == bits(v.resolve_conj().resolve_neg().contiguous()), k
        assert torch.equal(out[k], v)


def test_unpack_fills_preallocated_target_and_checks_it() -> None:
    sd = {"w": random_tensor(torch.bfloat16, (3000,), 1), "b": random_tensor(torch.int64, (7,), 2)}
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL))
    target = {"w": torch.zeros(3000, dtype=torch.bfloat16), "b": torch.zeros(7, dtype=torch.int64)}
    out = unpack(result.manifest, result.source(), target=target)
    assert out["w"].data_ptr() == target["w"].data_ptr()
    assert_bit_exact(out, sd)
    with pytest.raises(InvalidInput, match="manifest needs"):
        unpack(result.manifest, result.source(), target={"w": torch.zeros(3000), "b": target["b"]})
    with pytest.raises(InvalidInput, match="no tensor"):
        unpack(result.manifest, result.source(), target={"w": target["w"]})


def test_missing_chunks_are_reported_with_their_tensors() -> None:
    sd = {"w": random_tensor(torch.float32, (3000,), 1)}
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL))
    source = result.source()
    gone = result.manifest.chunks[1].id
    del source[gone]
    with pytest.raises(ChunkMissing) as info:
        unpack(result.manifest, source)
    assert info.value.chunk_ids == (gone,) and info.value.tensors == ("w",)


def test_repeated_chunks_are_fetched_once_and_fill_every_index() -> None:
    sd = {"z1": torch.zeros(SMALL), "z2": torch.zeros(SMALL)}
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL))
    assert len(set(result.manifest.chunk_ids())) == 1 < len(result.manifest.chunks)
    calls = []

    class Source:
        def get_chunks(self, refs):  # type: ignore[no-untyped-def]
            calls.append(len(refs))
            return [(r, result.chunk(r.index).data) for r in refs]

    assert_bit_exact(unpack(result.manifest, Source()), sd)
    assert calls == [1]


def test_parallel_unpack_matches(tmp_path: Path) -> None:
    sd = {f"l{i}": random_tensor(torch.float16, (SMALL * 3 + i,), i) for i in range(6)}
    result = pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL, codec="auto"), threads=3)
    assert pack(sd, model="m", config=ChunkingConfig(chunk_size=SMALL, codec="auto"), threads=1).manifest == result.manifest
    assert_bit_exact(unpack(result.manifest, result.source(), threads=3), sd)


def test_lazy_chunks_match_kept_ones_and_filter_by_id() -> None:
    sd = {"w": torch.linspace(0, 1, 20000)}
    cfg = ChunkingConfig(chunk_size=SMALL, codec="on")
    kept = pack(sd, model="m", config=cfg)
    lazy = pack(sd, model="m", config=cfg, keep_stored_bytes=0)
    assert [c.data for c in kept.chunks()] == [c.data for c in lazy.chunks()]
    wanted = {kept.manifest.chunks[2].id}
    assert [c.ref.index for c in lazy.chunks(wanted)] == [2]


def test_files_load_like_state_dicts(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    sd = {"layer.0.weight": random_tensor(torch.bfloat16, (40, 40), 1), "bn.num_batches_tracked": torch.tensor(5)}
    save_file(sd, str(tmp_path / "m.safetensors"))
    torch.save(sd, tmp_path / "m.pt")
    torch.save({"state_dict": sd, "epoch": 3}, tmp_path / "ckpt.bin")
    want = pack(sd, model="m").manifest
    for name in ("m.safetensors", "m.pt", "ckpt.bin"):
        assert pack(tmp_path / name, model="m").manifest == want, name
        assert_bit_exact(dict(sorted(load_source(tmp_path / name).items())), sd)
    (tmp_path / "x.txt").write_text("nope")
    with pytest.raises(InvalidInput, match="unknown weights file type"):
        load_source(tmp_path / "x.txt")
    with pytest.raises(InvalidInput, match="does not exist"):
        load_source(tmp_path / "missing.pt")
    with pytest.raises(InvalidInput, match="not a tensor"):
        load_source({"a": 3})  # type: ignore[dict-item]


def test_unsupported_tensors_are_refused() -> None:
    with pytest.raises(InvalidInput, match="dense"):
        pack({"s": torch.eye(3).to_sparse()}, model="m")
    with pytest.raises(InvalidInput, match="meta"):
        pack({"m": torch.empty(3, device="meta")}, model="m")


def test_empty_model_has_no_chunks() -> None:
    result = pack({"e": torch.empty(0)}, model="m")
    assert result.manifest.chunks == ()
    assert_bit_exact(unpack(Manifest.from_bytes(result.manifest.to_bytes()), {}), {"e": torch.empty(0)})


def test_torch_files_with_pickled_objects_are_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "cfg": Path("x")}, tmp_path / "obj.pt")
    with pytest.raises(InvalidInput, match="Only tensors are accepted"):
        load_source(tmp_path / "obj.pt")
    (tmp_path / "junk.bin").write_bytes(b"junk")
    with pytest.raises(InvalidInput, match="weights-only"):
        load_source(tmp_path / "junk.bin")


def test_weights_changed_after_pack_are_not_shipped_under_old_ids() -> None:
    from chunking import ChunkingError

    w = torch.zeros(3000)
    result = pack({"w": w}, model="m", config=ChunkingConfig(chunk_size=SMALL))
    w[0] = 1.0
    with pytest.raises(ChunkingError, match="changed after pack"):
        list(result.chunks())
