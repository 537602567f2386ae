"""Per-tensor BLAKE3 of a loaded version's tensors: ``GET /weights/digest`` on ``paramworker serve``.

A benchmark or an operator checks the weights a worker really holds against the file that was
pushed (hash each tensor's bytes of the safetensors file the same way, ``file_digests``), not
only by the load's own checks: a worker that read chunks from peers must hold the same bytes.
The digest is of each tensor's bytes as laid out in memory (safetensors' little-endian, C order),
so a tensor's digest is the content id of its data section in the file.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from chunking.hashing import content_id
from worker.staging import byte_view

ALGORITHM = "blake3"


def tensor_digest(tensor: torch.Tensor) -> str:
    """BLAKE3 (hex) of one tensor's bytes (copied to the host first when it is on a device)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return content_id(byte_view(data.contiguous()).numpy().data, ALGORITHM)


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{name: BLAKE3 hex} for every tensor, by name."""
    return {name: tensor_digest(tensors[name]) for name in sorted(tensors)}


def file_digests(path: str | Path) -> dict[str, str]:
    """The same digests of a safetensors file's tensors (what was pushed)."""
    from safetensors.torch import load_file

    return tensor_digests(load_file(str(path)))


def digest_answer(model: str, version: int, manifest_id: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The JSON body of ``GET /weights/digest``."""
    return {"model": model, "version": version, "manifest_id": manifest_id, "algorithm": ALGORITHM,
            "tensors": tensor_digests(tensors)}


__all__ = ["ALGORITHM", "digest_answer", "file_digests", "tensor_digest", "tensor_digests"]
