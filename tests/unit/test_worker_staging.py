from __future__ import annotations

import threading

import pytest
import torch

from worker.config import PrefetchConfig
from worker.errors import BufferTooSmall, ConfigError, StagingTimeout
from worker.staging import COMPLETED, Copier, StagingPool, byte_view


class FakeFence:
    """Stands in for a CUDA event: completes when the test says so."""

    def __init__(self) -> None:
        self.complete = False
        self.synced = 0

    def done(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.synced += 1
        self.complete = True


def test_pool_reuses_buffers_and_applies_back_pressure() -> None:
    pool = StagingPool(4096, 2, pin=False)
    a = pool.acquire()
    b = pool.acquire()
    assert a.slot != b.slot and pool.allocated == 2 and pool.in_use == 2
    with pytest.raises(StagingTimeout, match="staging_buffers"):
        pool.acquire(timeout=0)
    a.release()
    c = pool.acquire(timeout=0)
    assert c is a  # reused, not reallocated
    assert pool.allocated == 2


def test_blocked_acquire_wakes_on_release() -> None:
    pool = StagingPool(4096, 1, pin=False)
    held = pool.acquire()
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(timeout=30)))
    t.start()
    held.release()
    t.join(timeout=30)
    assert got and got[0] is held


def test_buffer_is_reused_only_after_its_fence_completes() -> None:
    pool = StagingPool(4096, 2, pin=False)
    a = pool.acquire()
    b = pool.acquire()
    fence = FakeFence()
    a.release(fence)
    assert pool.in_use == 2  # still waiting on its copy
    b.release()
    assert pool.acquire(timeout=0) is b
    # Nothing free: acquire waits for the oldest pending copy instead of timing out.
    assert pool.acquire(timeout=0) is a
    assert fence.synced == 1


def test_double_release_is_refused() -> None:
    pool = StagingPool(4096, 1, pin=False)
    buf = pool.acquire()
    buf.release()
    with pytest.raises(ValueError, match="twice"):
        buf.release()


def test_pool_pins_only_with_cuda() -> None:
    pool = StagingPool(4096, 1)
    assert pool.pinned == torch.cuda.is_available()
    assert pool.acquire().tensor.is_pinned() == pool.pinned


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64, torch.int64]
)
def test_copier_fills_any_dtype_bit_exact(dtype: torch.dtype) -> None:
    src = (torch.arange(24 * 7) % 5).to(dtype).reshape(24, 7)
    dst = torch.empty_like(src)
    raw = byte_view(src).numpy().tobytes()
    pool = StagingPool(4096, 1, pin=False)
    copier = Copier("cpu")
    buf = pool.acquire()
    # Two chunks of one tensor, staged back to back at an offset, copied into its byte view.
    half = len(raw) // 2
    buf.write(100, raw[:half])
    buf.write(100 + half, raw[half:])
    dst_bytes = byte_view(dst)
    fence = copier.copy_from(buf, [(100, dst_bytes[:half]), (100 + half, dst_bytes[half:])])
    assert fence is COMPLETED and fence.done()
    assert torch.equal(dst, src)
    assert pool.in_use == 0


def test_byte_view_edge_cases_and_size_checks() -> None:
    assert byte_view(torch.tensor(3.0)).numel() == 4
    assert byte_view(torch.empty(0, 5)).numel() == 0
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(4, 4).t())
    buf = StagingPool(4096, 1, pin=False).acquire()
    with pytest.raises(BufferTooSmall, match="staging_buffer_bytes"):
        buf.write(4000, b"x" * 200)
    with pytest.raises(BufferTooSmall):
        Copier().copy(buf.view(0, 10), torch.empty(11, dtype=torch.uint8))


def test_prefetch_config_validates() -> None:
    PrefetchConfig().validate()
    assert StagingPool.from_config(PrefetchConfig(staging_buffer_bytes=8192, staging_buffers=3), pin=False).count == 3
    with pytest.raises(ConfigError, match="staging_buffers"):
        PrefetchConfig(staging_buffers=0).validate()
    with pytest.raises(ConfigError):
        PrefetchConfig(staging_buffer_bytes=100).validate()
