"""Names of the torch dtypes a manifest may carry, and their element sizes."""
from __future__ import annotations

import torch

from chunking.errors import InvalidInput

# Quantized and bit-packed "bits*" dtypes carry extra state (scales) or have no
# stable byte layout, so they are refused rather than silently mangled.
_CANDIDATES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool", "complex32", "complex64", "complex128",
)

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _CANDIDATES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Manifest name of a torch dtype, e.g. torch.bfloat16 -> "bfloat16"."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidInput(
            f"dtype {dtype} is not supported: convert the tensor to one of {', '.join(DTYPES)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for a manifest dtype name."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise InvalidInput(f"dtype {name!r} is unknown to this torch build: upgrade torch or re-pack the model") from None


def element_size(name: str) -> int:
    return torch_dtype(name).itemsize
