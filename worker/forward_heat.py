"""Heat from forward passes: which chunks a model reads, and in what order, while it runs.

A load records the order chunks land; this records the order the *model* touches its
weights. Forward pre-hooks on every submodule that owns parameters or buffers record the
chunk indices of those tensors, so the aggregated heatmap tells the next worker which
chunks its first layers need first. Reports go to the servers at most every
``report_every_s`` seconds, from whoever calls ``report_if_due`` (the serve loop), never
from inside a forward pass.

A swap retires the old version's heat, but requests that took the old module may still be
queued or running on it: they ``hold`` the heat for the whole request, and a retired heat is
reported once the last holder ``release``s it (whoever sees ``retire``/``release`` return True
sends the final report), so no pass that ran on a version is lost to the swap.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from chunking.manifest import Manifest

from .heatmap import HeatmapRecorder


class HeatSink(Protocol):
    def report_heat(self, model: str, version: int, entries: Any) -> int: ...


class ForwardHeat:
    def __init__(
        self,
        module: torch.nn.Module,
        manifest: Manifest,
        *,
        version: int,
        sink: HeatSink | None = None,
        report_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if report_every_s <= 0:
            raise ValueError(f"report_every_s must be > 0, got {report_every_s}")
        self.recorder = HeatmapRecorder(manifest.model, version)
        self.sink = sink
        self.report_every_s = report_every_s
        self._clock = clock
        self._last_report = clock()
        self._lock = threading.Lock()
        self._holders = 0
        self._retired = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        known = manifest.tensor_index
        for prefix, sub in module.named_modules():
            names = [n for n, _ in sub.named_parameters(recurse=False)] + [n for n, _ in sub.named_buffers(recurse=False)]
            full = [f"{prefix}.{n}" if prefix else n for n in names]
            indices = tuple(dict.fromkeys(i for name in full if name in known for i in manifest.chunks_of_tensor(name)))
            if indices:
                self._handles.append(sub.register_forward_pre_hook(self._hook(indices)))

    def _hook(self, indices: tuple[int, ...]) -> Callable[..., None]:
        record_many = self.recorder.record_many

        def hook(_module: torch.nn.Module, _args: Any) -> None:
            record_many(indices)

        return hook

    @property
    def hooked_modules(self) -> int:
        return len(self._handles)

    def hold(self) -> None:
        """A request took the module this heat records; until ``release`` its passes still count."""
        with self._lock:
            self._holders += 1

    def release(self) -> bool:
        """The request is done; True when this heat is retired and nobody holds it: report it now."""
        with self._lock:
            self._holders -= 1
            return self._retired and self._holders == 0

    def retire(self) -> bool:
        """A newer version took over; True when nobody holds this heat: report it now."""
        with self._lock:
            self._retired = True
            return self._holders == 0

    @property
    def retired(self) -> bool:
        return self._retired

    def report_if_due(self, force: bool = False) -> bool:
        """Send what was recorded since the last report; True when a report went out."""
        with self._lock:
            now = self._clock()
            if self.sink is None or (not force and now - self._last_report < self.report_every_s):
                return False
            entries = self.recorder.wire_entries(reset=True)
            self._last_report = now
        if not len(entries):
            return False
        return self.sink.report_heat(self.recorder.model, self.recorder.version, entries) > 0

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


__all__ = ["ForwardHeat", "HeatSink"]
