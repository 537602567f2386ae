"""Serve while the weights are still arriving: a module whose forward waits only for what it uses.

:func:`start_cold` starts a load in the background (``worker.loader.start_load``: chunks in
heatmap order, which the forward passes recorded, so the first layers come first), builds the
module under ``empty_weights()`` with its parameters pointing at the tensors being filled, and
puts a forward pre-hook on every submodule that owns weights: it blocks until that submodule's
own tensors have landed (per-tensor readiness; on CUDA it also orders the caller's stream after
the copies). A request can therefore run layer 1 while layer 12 is still on the wire. Once the
load is complete, :meth:`ColdStart.finish` removes the hooks and hands over the ``LoadedModel``.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from paramserver.client.cluster_view import in_thread
from paramserver.client.session import ClusterClient
from worker.config import PrefetchConfig
from worker.loader import LoadedModel, LoadHandle, empty_weights, fill_module, resolve_device, start_load
from worker.tiered_cache import TieredCache


class ColdStart:
    """A module being filled by ``handle``; usable at once (its forward waits per submodule)."""

    def __init__(self, handle: LoadHandle, module: torch.nn.Module, wait_s: float = 600.0) -> None:
        self.handle = handle
        self.module = module
        self.wait_s = wait_s
        self._total = sum(t.nbytes for t in handle.manifest.tensors) or 1
        self._sizes = {t.name: t.nbytes for t in handle.manifest.tensors}
        self._hooks: list[RemovableHandle] = attach_waits(module, handle, wait_s)

    def progress(self) -> float:
        """Fraction of the weights' bytes whose tensors are ready."""
        pending = self.handle.readiness.pending()
        return 1.0 - sum(self._sizes.get(n, 0) for n in pending) / self._total

    def finish(self, timeout: float | None = None) -> LoadedModel:
        """Wait for the whole load (raises what it raised); the hooks go, the module stays usable."""
        tensors, report = self.handle.result(timeout)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return LoadedModel(tensors, self.handle.manifest, self.handle.info, report, self.handle)


def attach_waits(module: torch.nn.Module, handle: LoadHandle, wait_s: float) -> list[RemovableHandle]:
    """A forward pre-hook per submodule that owns loaded tensors: wait for exactly those.

    A tensor counts by its storage, not only by its name: a submodule whose weight is tied to
    another's (``lm_head.weight`` filled from ``embed.weight``) waits for the tensor it reads."""
    loading = set(handle.tensors)
    by_storage: dict[int, list[str]] = {}
    for name, t in handle.tensors.items():
        if t.numel() and t.device.type != "meta":
            by_storage.setdefault(t.data_ptr(), []).append(name)
    hooks: list[RemovableHandle] = []
    for prefix, sub in module.named_modules():
        own = [*sub.named_parameters(recurse=False, remove_duplicate=False),
               *sub.named_buffers(recurse=False, remove_duplicate=False)]
        wanted: dict[str, None] = {}  # ordered, without repeats
        for n, t in own:
            full = f"{prefix}.{n}" if prefix else n
            if full in loading:
                wanted[full] = None
            if t is not None and t.numel() and t.device.type != "meta":
                wanted.update(dict.fromkeys(by_storage.get(t.data_ptr(), ())))
        names = tuple(wanted)
        if not names:
            continue

        def wait(_m: torch.nn.Module, _args: Any, names: tuple[str, ...] = names) -> None:
            for name in names:
                handle.wait(name, wait_s)

        hooks.append(sub.register_forward_pre_hook(wait))
    return hooks


def _abandon(starting: Future[LoadHandle]) -> None:
    """The module could not be built or filled: let a load that started end (its client is the caller's)."""
    try:
        starting.result().result()
    except BaseException:  # noqa: BLE001 - the factory's error is the one to report
        pass


def start_cold(client: ClusterClient, ref: str, factory: Callable[[], torch.nn.Module], device: torch.device,
               cache: TieredCache | None = None, *, config: PrefetchConfig = PrefetchConfig(), strict: bool = True,
               wait_s: float = 600.0, report_heat: bool = True) -> ColdStart:
    """Start loading ``ref`` and return a module built by ``factory`` that can run right away.

    The module is built (on this thread: a factory may rely on thread-local torch state) while
    the load resolves ``ref``, reads the manifest and allocates; neither needs the other."""
    device = resolve_device(device)  # here: a bare "cuda" means this thread's current device
    starting = in_thread(partial(start_load, client, ref, device, cache, config=config, report_heat=report_heat),
                         "paramworker-cold-start-load")
    try:
        with empty_weights():
            module = factory()
    except BaseException:
        _abandon(starting)
        raise
    try:
        handle = starting.result()
    except BaseException:
        if not starting.done():  # interrupted while waiting: the load still runs on the caller's client
            _abandon(starting)
        raise
    try:
        fill_module(module, handle.tensors, device, strict, values_ready=False)
        module.eval()
    except BaseException:
        _abandon(starting)
        raise
    return ColdStart(handle, module, wait_s)


__all__ = ["ColdStart", "attach_waits", "start_cold"]
