"""Shared helpers for the chunking unit tests."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from chunking.dtypes import DTYPES


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bit patterns (NaNs included), bool kept to 0/1."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=n, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # complex32 is "experimental" but stores fine
        t = torch.empty(shape, dtype=dtype)
    t.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(raw))
    return t


def bits(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == sorted(want), "unpack returns tensors in manifest (sorted) order"
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, name
        assert tuple(g.shape) == tuple(w.shape), name
        assert bits(g) == bits(w), name


ALL_DTYPES = [DTYPES[n] for n in DTYPES]
