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


# Manifest dtype name <-> safetensors dtype code, for the codes safetensors.torch reads back.
SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "complex64": "C64", "uint16": "U16", "uint32": "U32", "uint64": "U64",
}
FROM_SAFETENSORS: dict[str, str] = {code: name for name, code in SAFETENSORS_CODES.items()}


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
