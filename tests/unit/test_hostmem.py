"""Arenas for pulled tensors (paramserver.client.hostmem) and the assembler's direct-receive path."""
from __future__ import annotations

import gc
import math
import mmap
import time
from pathlib import Path

import pytest
import torch

from chunking.assembler import Assembler
from chunking.config import ChunkingConfig
from chunking.errors import InvalidInput
from chunking.pack import pack
from paramserver.client.errors import ConfigError
from paramserver.client.hostmem import (
    ArenaPool, HostMemoryConfig, allocate_targets, arena_layout, free_page_reporting, retarget,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int64, torch.bool, torch.float64]


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(700, 1000, generator=gen),  # 2.8 MB: page aligned, many chunks
        "half": torch.randn(333, 77, generator=gen).half(),
        "bf": torch.randn(5, 3, 2, generator=gen).bfloat16(),
        "q": torch.randint(-128, 127, (4097,), dtype=torch.int8, generator=gen),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "flag": torch.tensor([True, False, True]),
    }


def test_layout_aligns_large_tensors_to_pages_and_packs_small_ones() -> None:
    offsets, size = arena_layout([10, 3 << 20, 1, 64])
    assert offsets[0] == 0
    assert offsets[1] % mmap.PAGESIZE == 0 and offsets[1] >= 10
    assert offsets[2] == offsets[1] + (3 << 20)
    assert offsets[3] % 64 == 0 and offsets[3] > offsets[2]
    assert size % mmap.PAGESIZE == 0 and size >= offsets[3] + 64
    assert arena_layout([])[1] == mmap.PAGESIZE


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="keep_bytes"):
        HostMemoryConfig(keep_bytes=-1).validate()
    with pytest.raises(ConfigError, match="keep_seconds"):
        HostMemoryConfig(keep_seconds=0).validate()


def test_targets_have_the_manifest_shapes_and_dtypes_and_can_be_filled_bit_exact() -> None:
    want = model()
    packed = pack(want, model="m", config=ChunkingConfig())
    pool = ArenaPool()
    targets = allocate_targets(packed.manifest, pool)
    assert list(targets.tensors) == [t.name for t in packed.manifest.tensors]
    for name, t in targets.tensors.items():
        assert t.dtype == want[name].dtype and t.shape == want[name].shape and t.is_contiguous()
    assert [t.data_ptr() for t in targets.fresh] == [targets.tensors["big"].data_ptr()]
    asm = Assembler(packed.manifest, targets.tensors)
    for chunk in packed.chunks():
        asm.add_stored(chunk.ref, chunk.data)
    asm.raise_if_incomplete()
    for name, t in want.items():
        assert as_bytes(targets.tensors[name]) == as_bytes(t), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_and_odd_shapes_fit_in_an_arena(dtype: torch.dtype) -> None:
    shapes = [(), (0,), (3, 0, 2), (1,), (7, 13), (1 << 18,)]
    state = {f"t{i}": (torch.arange(math.prod(s)) % 100).to(dtype).reshape(s) for i, s in enumerate(shapes)}
    packed = pack(state, model="m", config=ChunkingConfig())
    targets = allocate_targets(packed.manifest, ArenaPool())
    asm = Assembler(packed.manifest, targets.tensors)
    for chunk in packed.chunks():
        asm.add_stored(chunk.ref, chunk.data)
    asm.raise_if_incomplete()
    for name, t in state.items():
        got = targets.tensors[name]
        assert got.dtype == dtype and got.shape == t.shape
        assert as_bytes(got) == as_bytes(t)


def test_released_arena_is_reused_only_when_every_tensor_and_view_is_gone() -> None:
    pool = ArenaPool()
    area, _, fresh = pool.allocate([1 << 20])
    assert fresh and pool.mapped == 1
    t = torch.frombuffer(area, dtype=torch.uint8, count=1 << 20)
    view = t[10:20]
    del area, t
    _, _, fresh = pool.allocate([1 << 20])  # the view still holds the first arena
    assert fresh and pool.mapped == 2
    del view
    gc.collect()
    area, _, fresh = pool.allocate([1 << 20])
    assert not fresh and pool.reused == 1
    del area


def test_an_arena_view_outlives_the_tensors_and_retargets_only_when_they_are_gone() -> None:
    sd = model()
    packed = pack(sd, model="m", config=ChunkingConfig(chunk_size=64 << 10))
    pool = ArenaPool()
    targets = allocate_targets(packed.manifest, pool)
    assert targets.arena is not None
    arena = targets.arena
    for name, t in targets.tensors.items():
        t.copy_(sd[name])
    views = {name: t[1:] for name, t in targets.tensors.items() if t.dim()}  # a view holds the arena too
    del targets, t
    gc.collect()
    assert not pool.free_but_for(arena.view)
    del views
    gc.collect()
    # Only the arena's own view is left: the memory (and the bytes in it) may go to a new load.
    assert pool.free_but_for(arena.view)
    again = retarget(packed.manifest, arena)
    assert not again.fresh and not pool.free_but_for(arena.view)
    for name, t in again.tensors.items():
        assert as_bytes(t) == as_bytes(sd[name]), name
    # And the pool never hands it out while that view exists.
    del again
    gc.collect()
    _, _, fresh = pool.allocate([arena.view.nbytes])
    assert fresh
    assert not ArenaPool().free_but_for(arena.view)  # another pool's memory: never "free"


def test_a_much_smaller_request_does_not_take_a_large_arena() -> None:
    pool = ArenaPool()
    area, _, _ = pool.allocate([8 << 20])
    del area
    _, _, fresh = pool.allocate([1 << 20])
    assert fresh and pool.reused == 0


def test_released_arenas_are_unmapped_after_keep_seconds_and_beyond_keep_bytes() -> None:
    pool = ArenaPool(HostMemoryConfig(keep_seconds=0.2, keep_bytes=4 << 20))
    a, _, _ = pool.allocate([2 << 20])
    b, _, _ = pool.allocate([2 << 20])
    c, _, _ = pool.allocate([2 << 20])
    assert pool.held_bytes() == (3 * (2 << 20), 0)
    del a, b, c
    used, kept = pool.held_bytes()
    assert used == 0 and kept == 3 * (2 << 20)
    small, _, _ = pool.allocate([1])  # a sweep: 6 MiB released, 4 MiB may stay
    assert pool.held_bytes()[1] <= 4 << 20
    del small
    deadline = time.monotonic() + 5
    while pool.held_bytes() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)  # the timer sweeps without any further allocation
    assert pool.held_bytes() == (0, 0)


def test_keep_bytes_zero_keeps_nothing() -> None:
    pool = ArenaPool(HostMemoryConfig(keep_bytes=0))
    area, _, _ = pool.allocate([1 << 20])
    del area
    _, _, fresh = pool.allocate([1 << 20])
    assert fresh and pool.held_bytes() == (0, 0)


def test_direct_view_only_for_private_targets_and_whole_single_region_chunks() -> None:
    state = {"big": torch.randn(300_000), "a": torch.randn(10), "b": torch.randn(20)}
    packed = pack(state, model="m", config=ChunkingConfig())
    targets = allocate_targets(packed.manifest, ArenaPool()).tensors
    live = Assembler(packed.manifest, targets)
    assert all(live.direct_view(i) is None for i in range(len(packed.manifest.chunks)))
    asm = Assembler(packed.manifest, targets, private_targets=True)
    plan = packed.manifest.plan
    chunks = {c.ref.index: c for c in packed.chunks()}
    for i in range(plan.count):
        view = asm.direct_view(i)
        if len(plan.segments[i]) == 1 and plan.segments[i][0].length == plan.raw_sizes[i]:
            assert view is not None and len(view) == plan.raw_sizes[i]
            view[:] = chunks[i].data
            asm.commit_direct(i)
            assert asm.direct_view(i) is None  # written: no second direct receive
            with pytest.raises(ValueError, match="no direct view"):
                asm.commit_direct(i)
        else:
            assert view is None  # packed small tensors: through write_chunk
            asm.add_stored(chunks[i].ref, chunks[i].data)
    asm.raise_if_incomplete()
    for name, t in state.items():
        assert torch.equal(targets[name], t)


def test_commit_direct_fills_every_index_of_a_repeated_chunk() -> None:
    same = torch.randn(65536)  # exactly one 256 KiB chunk, used twice
    state = {"x": same, "y": same.clone()}
    packed = pack(state, model="m", config=ChunkingConfig())
    assert len({r.id for r in packed.manifest.chunks}) == 1 and len(packed.manifest.chunks) == 2
    targets = allocate_targets(packed.manifest, ArenaPool()).tensors
    asm = Assembler(packed.manifest, targets, private_targets=True)
    view = asm.direct_view(0)
    assert view is not None
    view[:] = next(iter(packed.chunks(unique=True))).data
    asm.commit_direct(0)
    asm.raise_if_incomplete()
    assert torch.equal(targets["x"], same) and torch.equal(targets["y"], same)


def test_wrong_target_still_refused_with_a_clear_error() -> None:
    packed = pack({"w": torch.randn(4, 4)}, model="m", config=ChunkingConfig())
    with pytest.raises(InvalidInput, match="needs"):
        Assembler(packed.manifest, {"w": torch.empty(4, 5)}, private_targets=True)


def fake_sys(root: Path, *, order: int | None, balloon_features: str | None, bound: bool = True,
             huge_page_bytes: int | None = None) -> Path:
    """A /sys with page reporting at ``order`` (None: not built in) and a virtio balloon."""
    if huge_page_bytes is not None:
        thp = root / "kernel/mm/transparent_hugepage"
        thp.mkdir(parents=True)
        (thp / "hpage_pmd_size").write_text(f"{huge_page_bytes}\n")
    if order is not None:
        params = root / "module/page_reporting/parameters"
        params.mkdir(parents=True)
        (params / "page_reporting_order").write_text(f"{order}\n")
    devices = root / "bus/virtio/devices"
    devices.mkdir(parents=True)
    blk = devices / "virtio0"  # not a balloon: its feature bit 5 means something else
    blk.mkdir()
    (blk / "device").write_text("0x0002\n")
    (blk / "driver").mkdir()
    (blk / "features").write_text("0" * 5 + "1" + "0" * 58 + "\n")
    if balloon_features is not None:
        dev = devices / "virtio1"
        dev.mkdir()
        (dev / "device").write_text("0x0005\n")
        (dev / "features").write_text(balloon_features + "\n")
        if bound:
            (dev / "driver").mkdir()
    return root


REPORTING = "0110010100000000000000000000000010000000000000000000000000000000"  # a Firecracker balloon's, bit 5 set
NOT_REPORTING = REPORTING[:5] + "0" + REPORTING[6:]


@pytest.mark.parametrize(("order", "features", "bound", "off"), [
    (9, REPORTING, True, True),  # huge-page-sized blocks go back to the host: huge pages off
    (9, NOT_REPORTING, True, False),  # a balloon without free page reporting
    (9, REPORTING, False, False),  # no driver bound: nothing reports
    (10, REPORTING, True, False),  # only blocks larger than a huge page are reported
    (None, REPORTING, True, False),  # a kernel without page reporting
    (9, None, True, False),  # no balloon at all (bare metal): only the block device's bit 5
])
def test_huge_pages_are_off_only_where_the_host_takes_free_huge_pages_back(
        tmp_path: Path, order: int | None, features: str | None, bound: bool, off: bool) -> None:
    why = free_page_reporting(fake_sys(tmp_path, order=order, balloon_features=features, bound=bound))
    assert (why is not None) == off, why
    if off:
        assert why is not None and "virtio1" in why and "order 9" in why


def test_the_huge_page_order_comes_from_the_kernel(tmp_path: Path) -> None:
    # Huge pages of 8 base pages' order more (as with larger base pages): reporting at order 10 concerns them.
    big = mmap.PAGESIZE << 10
    why = free_page_reporting(fake_sys(tmp_path / "a", order=10, balloon_features=REPORTING, huge_page_bytes=big))
    assert why is not None and "order 10" in why
    assert free_page_reporting(fake_sys(tmp_path / "b", order=11, balloon_features=REPORTING, huge_page_bytes=big)) is None


def test_free_page_reporting_of_a_missing_sys_is_none(tmp_path: Path) -> None:
    assert free_page_reporting(tmp_path / "nothing") is None


def test_an_explicit_huge_pages_setting_is_kept() -> None:
    assert ArenaPool(HostMemoryConfig(huge_pages=True)).huge_pages is True
    assert ArenaPool(HostMemoryConfig(huge_pages=False)).huge_pages is False
    auto = ArenaPool(HostMemoryConfig())
    assert auto.huge_pages == (free_page_reporting() is None)
    assert (auto.huge_pages_off_because is None) == auto.huge_pages
