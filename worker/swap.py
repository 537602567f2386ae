"""Hot swap: follow a tag, load the new version beside the old one, then switch atomically.

Only chunks the new manifest adds cross the network: unchanged chunks come from the cache or,
when the cache no longer holds them, from the tensors of the version being served (re-verified
by content id, since a caller may have modified those tensors in place). The old version keeps
serving until every tensor of the new one has landed; the switch is one reference assignment
under a lock, so a reader sees either the old model or the new one, never a mix.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from chunking.diff import diff
from chunking.hashing import Buffer, content_id
from chunking.manifest import ChunkRef, Manifest
from paramserver.client.session import ClusterClient
from worker.config import PrefetchConfig
from worker.loader import LoadedModel, ModelRef, load, resolve_device, resolve_ref
from worker.prefetch import LocalSource
from worker.tiered_cache import TieredCache


def _only(ids: set[str], source: LocalSource) -> LocalSource:
    """``source``, asked only for the chunks in ``ids`` (None for the others)."""
    def local(ref: ChunkRef) -> Buffer | None:
        return source(ref) if ref.id in ids else None
    return local


def tensor_source(manifest: Manifest, tensors: Mapping[str, torch.Tensor]) -> LocalSource:
    """Raw chunk bytes rebuilt from loaded tensors, returned only when they still match the chunk id."""
    by_id = manifest.chunks.first_row_of
    plan = manifest.plan
    names = [t.name for t in manifest.tensors]

    def read(ref: ChunkRef) -> Buffer | None:
        index = by_id.get(ref.id)
        if index is None:
            return None
        out = np.empty(plan.raw_sizes[index], dtype=np.uint8)
        # Alignment gaps between tensors are zero bytes in the chunk.
        out[:] = 0
        for s in plan.segments[index]:
            t = tensors.get(names[s.tensor])
            if t is None:
                return None
            flat = t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            piece = flat[s.tensor_offset : s.tensor_offset + s.length]
            out[s.chunk_offset : s.chunk_offset + s.length] = piece.cpu().numpy()
        if content_id(out, manifest.hash_algorithm) != ref.id:
            return None
        return out

    return read


class HotSwapper:
    """Serves one ``MODEL:TAG``; ``check()`` loads a moved tag's new version and swaps it in."""

    def __init__(
        self,
        client: ClusterClient,
        ref: str | ModelRef,
        device: str | torch.device | None = "cpu",
        cache: TieredCache | None = None,
        *,
        config: PrefetchConfig = PrefetchConfig(),
        on_swap: Callable[[LoadedModel, LoadedModel | None], None] | None = None,
    ) -> None:
        self.client = client
        self.ref = ModelRef.parse(ref) if isinstance(ref, str) else ref
        self.device = resolve_device(device)
        self.cache = cache
        self.config = config
        self.on_swap = on_swap
        self._lock = threading.Lock()
        self._check_lock = threading.Lock()
        self._current: LoadedModel | None = None
        self.swaps = 0
        self.last_error: BaseException | None = None

    @property
    def current(self) -> LoadedModel:
        with self._lock:
            if self._current is None:
                raise RuntimeError("nothing loaded yet: call start() first")
            return self._current

    def start(self) -> LoadedModel:
        """Load the version the reference points at now."""
        loaded = load(self.client, self.ref, self.device, self.cache, config=self.config)
        self._install(loaded)
        return loaded

    def check(self) -> LoadedModel | None:
        """If the tag moved, load the new version (old one still served) and swap; returns the new one."""
        with self._check_lock:
            info = resolve_ref(self.client, self.ref)
            with self._lock:
                old = self._current
            if old is not None and old.info.manifest_id == info.manifest_id and old.info.number == info.number:
                return None
            local: LocalSource | None = None
            kwargs: dict[str, Any] = {}
            if old is not None:
                manifest = self.client.manifest(info.manifest_id)
                shared = set(diff(old.manifest, manifest).shared)
                from_old = tensor_source(old.manifest, old.tensors)
                local = _only(shared, from_old)
                kwargs["manifest"] = manifest
            new = load(self.client, self.ref, self.device, self.cache, config=self.config, info=info, local=local, **kwargs)
            self._install(new)
            return new

    def install(self, new: LoadedModel) -> None:
        """Make ``new`` (loaded elsewhere, e.g. a cold start) the version served; runs ``on_swap``."""
        self._install(new)

    def _install(self, new: LoadedModel) -> None:
        # on_swap (building the served module) runs first: when it fails, the old version stays
        # current, so the next check() tries the new one again instead of taking it as served.
        with self._lock:
            old = self._current
        if self.on_swap is not None:
            self.on_swap(new, old)
        with self._lock:
            self._current = new
            self.swaps += old is not None

    def follow(self, interval_s: float, stop: threading.Event) -> threading.Thread:
        """Poll the tag every ``interval_s`` until ``stop`` is set; errors are kept in ``last_error``
        and the old version keeps serving."""
        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    self.check()
                    self.last_error = None
                except Exception as exc:  # noqa: BLE001 - keep serving the old version
                    self.last_error = exc

        thread = threading.Thread(target=loop, name="paramworker-follow", daemon=True)
        thread.start()
        return thread


__all__ = ["HotSwapper", "tensor_source"]
