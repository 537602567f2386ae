"""Host-staged loads onto a device: each host tensor goes up whole, as soon as it has landed.

A load onto a CUDA device whose model the memory tier will hold lands its chunks in a host arena
exactly as a CPU load does (received in place, the tier keeps that arena, a later load of the
same manifest is given it back) and then moves each tensor up in one copy. Against landing every
chunk through a staging buffer, that is one DMA per tensor instead of a host copy, a copy
launch and an event per chunk, and the memory tier holds the host bytes once, page-locked.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import numpy as np
import torch

from worker.readiness import TensorReadiness
from worker.staging import Copier, byte_view


class DeviceUpload:
    """Host tensors of one load go to their device tensors one whole tensor at a time, each as soon
    as its own chunks have landed on the host (``host_readiness``), on the copier's side stream.

    The host tensors lie in a page-locked arena, so each is one asynchronous DMA copy straight from
    where its chunks landed: no staging copy, no per-chunk copy. ``readiness`` tracks the device
    tensors (a tensor is one "chunk" there, fenced by the event after the copies issued with it).
    Until ``go()`` (the arena is pinned) uploads are held back; ``finish()`` issues any still held
    and waits for all of them.
    """

    def __init__(self, host: Mapping[str, torch.Tensor], device_tensors: Mapping[str, torch.Tensor],
                 host_readiness: TensorReadiness, device: torch.device | str) -> None:
        self._host = dict(host)
        self.tensors = dict(device_tensors)
        names = list(self._host)
        self._index = {name: i for i, name in enumerate(names)}
        self.readiness = TensorReadiness({n: ([i] if self._host[n].numel() else []) for i, n in enumerate(names)})
        self.copier = Copier(device)
        if self.copier.stream is not None:
            # The device tensors were allocated on the current stream.
            self.copier.stream.wait_stream(torch.cuda.current_stream(self.copier.device))
        self._lock = threading.Lock()
        self._go = False
        self._held: list[str] = []
        self.first_at: float | None = None  # perf_counter when the first device tensor became usable
        host_readiness.listen(self._ready)

    def _ready(self, names: list[str]) -> None:
        with self._lock:
            if not self._go:
                self._held += names
                return
        self._upload(names)

    def _upload(self, names: list[str]) -> None:
        """One copy per tensor, issued together; one fence for them all."""
        host = self._host
        names = [n for n in names if n in host]
        if not names:  # finished or failed meanwhile
            return
        self.copier.copy_many((byte_view(host[n]), byte_view(self.tensors[n])) for n in names)
        self.readiness.mark_landed_many(np.array([self._index[n] for n in names], dtype=np.int64), self.copier.fence())
        with self._lock:
            if self.first_at is None:
                self.first_at = time.perf_counter()

    def go(self) -> None:
        """Upload from now on as tensors become ready, and the ones that became ready before."""
        with self._lock:
            self._go = True
            held, self._held = self._held, []
        if held:
            self._upload(held)

    def finish(self) -> None:
        """Every host tensor has landed: upload what is left, wait for the copies, drop the host
        tensors. Raises if a tensor never went up (a copy that raised elsewhere)."""
        self.go()
        self.copier.synchronize()
        self._host = {}
        missing = self.readiness.pending()
        if missing:
            raise RuntimeError(f"{len(missing)} tensors never reached {self.copier.device} (first: {missing[0]!r}); "
                               "the load failed, retry it")

    def fail(self, error: BaseException) -> None:
        """The load failed: every device tensor fails with ``error`` (as every host tensor did),
        and the copies already issued are waited for before the host tensors are let go: their
        arena may be unpinned and unmapped once nothing holds it."""
        with self._lock:
            self._go = False  # nothing more goes up
            self._held = []
        for i in range(len(self._index)):
            self.readiness.mark_failed(i, error)
        try:
            self.copier.synchronize()
        except Exception:  # noqa: BLE001 - a broken CUDA context: the load's own error is the one to report
            pass
        self._host = {}


__all__ = ["DeviceUpload"]
