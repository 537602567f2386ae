"""A model's output tensor as JSON values, without losing what JSON can hold exactly.

``y.float().tolist()`` turned int64 outputs above 2**24 (ids, counts, checksums) and float64 ones
into float32 approximations. Integers and booleans stay what they are, float64 stays float64; the
narrower floats (half, bfloat16, float8) widen to float32, which holds each of their values exactly.
Complex outputs become pairs ``[real, imaginary]`` in a last dimension of 2.
"""
from __future__ import annotations

from typing import Any

import torch


def json_values(t: torch.Tensor) -> Any:
    """``t`` as nested lists (a number for a 0-d tensor) of Python ints, bools and floats."""
    t = t.detach().cpu()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return t.tolist()


__all__ = ["json_values"]
