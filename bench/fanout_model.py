"""The model bench_fanout.py pushes and serves: wide square layers (64 MiB each in float32) plus odd
tensors (a bfloat16 vector of odd length, a 0-d buffer, an empty one), so the fleet's bit-exactness
check covers more than one shape and dtype.

    paramworker serve --model fanout:prod --factory fanout_model:build ...   (bench/ on PYTHONPATH)

``BENCH_FANOUT_LAYERS`` (default 8: 512 MiB) sets the number of layers in the serving processes.
"""
from __future__ import annotations

import os

import torch

LAYERS_ENV = "BENCH_FANOUT_LAYERS"
WIDTH = 4096  # a layer is WIDTH x WIDTH float32: 64 MiB


class Wide(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))
        self.odd = torch.nn.Parameter(torch.zeros(1001, dtype=torch.bfloat16))
        self.register_buffer("scale", torch.tensor(1.0))
        self.register_buffer("empty", torch.zeros(0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        scale = self.get_buffer("scale")
        return x * scale


def state_dict(layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights bench_fanout.py pushes (random, from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.weight": torch.randn(WIDTH, WIDTH, generator=g) for i in range(layers)}
    out["odd"] = torch.randn(1001, generator=g).to(torch.bfloat16)
    out["scale"] = torch.tensor(1.5)
    out["empty"] = torch.zeros(0, 3)
    return out


def build() -> torch.nn.Module:
    """Factory for ``paramworker serve --factory fanout_model:build``."""
    return Wide(int(os.environ.get(LAYERS_ENV, "8")))


__all__ = ["LAYERS_ENV", "WIDTH", "Wide", "build", "state_dict"]
