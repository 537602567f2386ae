"""A version's tensors as an iterator: each ``(name, tensor)`` as soon as its own chunks have landed.

What an inference engine's weight loading wants (vLLM's ``model.load_weights(weights)``, SGLang's,
or a hand-written ``for name, t in weights: param.copy_(t)``): the engine applies its own renames,
fused projections and sharding to each tensor, so the loader only has to hand tensors over, and
the earlier it hands the first one, the more of the copy into the engine overlaps the fetch.

``stream_weights`` starts an ordinary load (``worker.loader.start_load``: the servers' heatmap
orders the fetch, the memory and disk tiers and the peers serve what they hold, every chunk is
verified before its bytes reach a tensor) and yields each tensor the moment the load's
readiness tracker marks it complete, so the order is the fetch's (heatmap) order. Nothing is
written to disk except by a disk tier the caller configured.

The tensors live in host memory (``device="cpu"``): the engine copies each into its own parameter.
They stay valid after the iteration; ``WeightStream.report`` says where the bytes came from.
"""
from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import torch

from worker.loader import Cluster, LoadHandle, LoadReport, ModelRef, start_load

# How often a consumer waiting for the next tensor looks whether the load ended (failed): a failed
# chunk marks its tensors failed without a readiness event.
_POLL_S = 0.2


class WeightStream:
    """Iterate ``(name, tensor)`` of one load in the order its tensors complete.

    One pass: iterating a second time raises. ``timeout_s`` bounds the wait for each next tensor
    (None: as long as the load runs; the load's own fetch timeouts end a stuck one).
    """

    def __init__(self, handle: LoadHandle, timeout_s: float | None = None) -> None:
        self.handle = handle
        self._timeout_s = timeout_s
        self._ready: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._started = False
        # Registered before the scan in __iter__: a tensor completing in between is reported by
        # both, and the iterator yields it once.
        handle.readiness.listen(self._on_ready)

    def _on_ready(self, names: list[str]) -> None:
        for name in names:
            self._ready.put(name)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.handle.manifest.tensors]

    @property
    def report(self) -> LoadReport:
        """The load's report (where the bytes came from, how long it took); after the iteration."""
        return self.handle.result()[1]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a WeightStream is iterated once; call stream_weights again for another pass")
        self._started = True
        handle, readiness = self.handle, self.handle.readiness
        names = self.names
        left = set(names)
        for name in names:  # what completed before the listener was in place (empty tensors at once)
            if readiness.is_ready(name):
                self._ready.put(name)
        waited = 0.0
        while left:
            try:
                name = self._ready.get(timeout=_POLL_S)
            except queue.Empty:
                if handle.done():
                    handle.result()  # raises the load's error (a chunk no replica could serve, ...)
                    late = [n for n in names if n in left and readiness.is_ready(n)]
                    if not late:  # ended without error yet something is missing: a bug, said plainly
                        raise RuntimeError(f"load ended with {len(left)} tensor(s) never ready, e.g. {sorted(left)[:3]}") from None
                    for n in late:
                        self._ready.put(n)
                    continue
                waited += _POLL_S
                if self._timeout_s is not None and waited >= self._timeout_s:
                    raise TimeoutError(f"no tensor of {handle.info.model} v{handle.info.number} completed in "
                                       f"{self._timeout_s:.0f} s; {len(left)} of {len(names)} still loading") from None
                continue
            if name not in left:
                continue
            left.discard(name)
            waited = 0.0
            readiness.wait(name, 0)  # raises TensorFailed if a chunk feeding it failed
            yield name, handle.tensors[name]
        handle.result()


def stream_weights(
    cluster: Cluster | ModelRef = None,
    ref: str | ModelRef | None = None,
    *,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> WeightStream:
    """``for name, tensor in stream_weights("m:prod"): ...``: the tensors of ``ref`` as each completes.

    The cluster, token and TLS come as for ``load_state_dict`` (arguments > environment >
    ``PARAMS_CONFIG``); ``kwargs`` are ``start_load``'s (``cache``, ``config``, ``peers``, ``info``,
    ``manifest``, ...). The load runs on host memory (``device`` is always cpu).
    """
    if kwargs.pop("device", "cpu") not in ("cpu", None):
        raise ValueError("stream_weights loads into host memory: the engine copies each tensor to its device; drop device=")
    handle = start_load(cluster, ref, "cpu", **kwargs)
    return WeightStream(handle, timeout_s)


__all__ = ["WeightStream", "stream_weights"]
