"""A cold start's pre-hooks (worker.cold_start.attach_waits) wait for the tensors a forward reads,
tied ones included, with an in-memory stand-in for the load handle."""
from __future__ import annotations

import torch

from worker.cold_start import attach_waits


class Handle:
    """The part of LoadHandle the hooks use: the tensors being filled, and a wait per name."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.waited: list[str] = []

    def wait(self, name: str, timeout: float | None = None) -> torch.Tensor:
        self.waited.append(name)
        return self.tensors[name]


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # the checkpoint holds embed.weight only

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_a_tied_weight_is_waited_for_by_the_module_that_reads_it_under_another_name() -> None:
    m = Tied()
    handle = Handle({"embed.weight": m.embed.weight.data})
    hooks = attach_waits(m, handle, 1.0)
    m.head(torch.zeros(1, 4))  # the head alone: it reads embed.weight through the tie
    assert handle.waited == ["embed.weight"]
    handle.waited.clear()
    m(torch.tensor([1]))
    assert handle.waited == ["embed.weight", "embed.weight"]
    for h in hooks:
        h.remove()


def test_a_module_waits_for_its_own_tensors_only_and_empty_ones_are_waited_by_name() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 0))
    handle = Handle({k: v.data for k, v in m.state_dict().items()})
    attach_waits(m, handle, 1.0)
    m[0](torch.zeros(1, 3))
    assert handle.waited == ["0.weight", "0.bias"]
    handle.waited.clear()
    m[1](torch.zeros(1, 2))
    assert handle.waited == ["1.weight", "1.bias"]
