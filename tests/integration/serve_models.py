"""Factories for the ``paramworker serve`` tests (built on the meta device by the worker)."""
from __future__ import annotations

import os
import time

import torch


class SlowNet(torch.nn.Module):
    """A small MLP whose forward also sleeps ``PDPARAMS_TEST_FORWARD_S`` seconds (default 0.02):
    it stands for GPU time, which does not use the host's CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 2)
        self.pause = float(os.environ.get("PDPARAMS_TEST_FORWARD_S", "0.02"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.pause)
        return self.b(torch.relu(self.a(x)))


def slow_net() -> torch.nn.Module:
    return SlowNet()


def slow_net_weights(seed: int) -> dict[str, torch.Tensor]:
    """A seeded state dict for ``slow_net`` (what the serving tests push)."""
    torch.manual_seed(seed)
    return slow_net().state_dict()
