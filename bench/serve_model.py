"""The model bench_serve.py serves (issue #13): a small MLP whose forward pass takes ~20 ms.

    paramworker serve --model slow:prod --factory serve_model:slow_mlp ...   (bench/ on PYTHONPATH)

The sleep stands for GPU time: ``time.sleep`` releases the GIL, so what the benchmark measures is
the serving path (queueing, the result cache, single-flight), not the machine's CPU cores. The
forward pass sleeps until ``forward_ms`` have passed since it began, whatever the batch size
(the MLP itself takes microseconds). ``forward_ms`` is a plain attribute, not a parameter or
buffer: a module built on the meta device and filled from the cluster has it too. The env
variable BENCH_SERVE_FORWARD_MS sets it (default 20) in the serving processes.
"""
from __future__ import annotations

import os
import time

import torch

FORWARD_MS_ENV = "BENCH_SERVE_FORWARD_MS"
DEFAULT_FORWARD_MS = 20.0
WIDTH = 16  # input and output features


class SlowMLP(torch.nn.Module):
    def __init__(self, width: int = WIDTH, hidden: int = 64, forward_ms: float = DEFAULT_FORWARD_MS) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, width),
        )
        self.forward_ms = float(forward_ms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y: torch.Tensor = self.net(x)
        left = self.forward_ms / 1000.0 - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)  # "GPU time": releases the GIL
        return y


def forward_ms_from_env() -> float:
    raw = os.environ.get(FORWARD_MS_ENV, "")
    if not raw:
        return DEFAULT_FORWARD_MS
    value = float(raw)
    if not 0 <= value <= 10_000:
        raise ValueError(f"{FORWARD_MS_ENV}={raw!r}: want 0 to 10000 (ms)")
    return value


def slow_mlp() -> torch.nn.Module:
    """Factory for ``paramworker serve --factory serve_model:slow_mlp``."""
    return SlowMLP(forward_ms=forward_ms_from_env())


__all__ = ["FORWARD_MS_ENV", "SlowMLP", "WIDTH", "slow_mlp"]
