"""Forward-pass heat: the order a model reads its weights, reported at most every period."""
from __future__ import annotations

import torch

from chunking import ChunkingConfig, pack
from worker.forward_heat import ForwardHeat


class FakeSink:
    def __init__(self) -> None:
        self.reports: list[tuple[str, int, list[tuple[int, int, int]]]] = []

    def report_heat(self, model: str, version: int, entries: list[tuple[int, int, int]]) -> int:
        self.reports.append((model, version, list(entries)))
        return 1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Layers of at least one 4 KiB chunk each, so every layer owns its own chunks.
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))


def test_forward_passes_record_chunks_in_the_order_layers_run() -> None:
    module = _model().eval()
    manifest = pack(module.state_dict(), model="m", config=ChunkingConfig(chunk_size=4096)).manifest
    now = [0.0]
    sink = FakeSink()
    heat = ForwardHeat(module, manifest, version=3, sink=sink, report_every_s=10.0, clock=lambda: now[0])
    assert heat.hooked_modules == 3  # two Linear layers and the BatchNorm; ReLU owns no tensors

    with torch.no_grad():
        module(torch.randn(2, 64))
        module(torch.randn(2, 64))
    assert not heat.report_if_due()  # not due yet: nothing is sent from inside the period
    now[0] = 11.0
    assert heat.report_if_due()
    model, version, entries = sink.reports[0]
    assert (model, version) == ("m", 3)
    order = [index for index, _count, _rank in sorted(entries, key=lambda e: e[2])]
    first_layer = set(manifest.chunks_of_tensor("0.weight")) | set(manifest.chunks_of_tensor("0.bias"))
    last_layer = set(manifest.chunks_of_tensor("3.weight")) | set(manifest.chunks_of_tensor("3.running_mean"))
    assert first_layer <= set(order[: len(first_layer)])  # the first layer's chunks come first
    assert max(order.index(i) for i in first_layer) < min(order.index(i) for i in last_layer)
    assert all(count == 2 for index, count, _ in entries if index in set(manifest.chunks_of_tensor("2.weight")))

    now[0] = 30.0
    assert not heat.report_if_due()  # nothing new since the last report
    heat.detach()
    with torch.no_grad():
        module(torch.randn(2, 64))
    assert not heat.report_if_due(force=True)  # detached: the pass was not recorded
    assert len(sink.reports) == 1


def test_a_retired_heat_is_due_when_its_last_holder_releases_it() -> None:
    module = _model().eval()
    manifest = pack(module.state_dict(), model="m", config=ChunkingConfig(chunk_size=4096)).manifest
    sink = FakeSink()
    heat = ForwardHeat(module, manifest, version=1, sink=sink)
    heat.hold()
    heat.hold()
    assert not heat.retire() and heat.retired  # two requests still run on this version
    with torch.no_grad():
        module(torch.randn(2, 64))  # a held request's pass after the swap still records
    assert not heat.release()
    assert heat.release()  # the last holder: the caller sends the final report
    assert heat.report_if_due(force=True)
    assert {index for index, _count, _rank in sink.reports[0][2]} == set(range(len(manifest.chunks)))

    idle = ForwardHeat(module, manifest, version=2, sink=sink)
    assert idle.retire()  # nobody holds it: report at once
