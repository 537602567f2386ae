"""The real publish and load operations, shaped as Workload callables.

The models are self-verifying: every tensor is generated from a seed that the
model carries in its ``seed`` tensor, so a loader can check bit-exactness of
whatever version it got without asking the publisher. The publisher pushes
with ``paramserver.push.push`` (parent "head", then moves the tag); each loader
keeps one ``worker.client.ClusterClient`` for its whole life, because the
monotonic-reads guard (invariant 4) lives in the client.

Imports of paramserver/worker are lazy: the framework and its unit tests do
not need a server build.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .framework import Loaded, Published


@dataclass(frozen=True)
class ModelSpec:
    model: str = "drill"
    tag: str = "prod"
    tensors: int = 4
    tensor_bytes: int = 256 << 10  # per tensor; one 256 KiB chunk each by default
    changed_per_version: int = 1  # tensors that change between versions (the rest dedup)

    def validate(self) -> None:
        if not 1 <= self.tensors <= 1024:
            raise ValueError(f"tensors must be 1..1024, got {self.tensors}")
        if self.tensor_bytes < 4 or self.tensor_bytes % 4:
            raise ValueError(f"tensor_bytes must be a positive multiple of 4, got {self.tensor_bytes}")
        if not 0 <= self.changed_per_version <= self.tensors:
            raise ValueError(f"changed_per_version must be 0..tensors, got {self.changed_per_version}")


def make_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights for seed: tensor k changes only when its own generation does (dedup between versions)."""
    out: dict[str, torch.Tensor] = {"seed": torch.tensor([seed], dtype=torch.int64)}
    n = spec.tensor_bytes // 4
    for k in range(spec.tensors):
        # Tensors below changed_per_version take the seed; the others stay fixed across versions.
        generation = seed if k < spec.changed_per_version else 0
        g = torch.Generator().manual_seed(generation * 1_000_003 + k)
        out[f"layer{k}.weight"] = torch.randn(n, generator=g, dtype=torch.float32)
    return out


def digest(state: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def make_publisher(seeds: Sequence[str], spec: ModelSpec = ModelSpec(), token: str | None = None,
                   publisher: str = "drill") -> Callable[[int], Published]:
    """publish(i): push version seed=i of spec.model and move spec.tag to it."""
    from paramserver.push import push

    spec.validate()

    def publish(i: int) -> Published:
        state = make_state(spec, i)
        rep = push(list(seeds), state, model=spec.model, tag=spec.tag, parent="head", publisher=publisher, token=token)
        return Published(spec.model, int(rep.version), spec.tag, nbytes=int(rep.bytes_total))

    return publish


class LoaderPool:
    """load(k, i): loader k loads spec.model:spec.tag with its own long-lived ClusterClient and verifies it."""

    def __init__(self, seeds: Sequence[str], spec: ModelSpec = ModelSpec(), token: str | None = None) -> None:
        spec.validate()
        self.seeds = list(seeds)
        self.spec = spec
        self.token = token
        self._clients: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _client(self, k: int) -> Any:
        from worker.client import ClusterClient

        with self._lock:
            if k not in self._clients:
                self._clients[k] = ClusterClient(self.seeds, token=self.token)
            return self._clients[k]

    def __call__(self, k: int, i: int) -> Loaded:
        from worker.loader import load

        got = load(self._client(k), f"{self.spec.model}:{self.spec.tag}", device="cpu")
        tensors = got.tensors
        seed = int(tensors["seed"][0]) if "seed" in tensors else -1
        expected = digest(make_state(self.spec, seed)) if seed >= 0 else ""
        ok = seed >= 0 and digest(tensors) == expected
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return Loaded(self.spec.model, self.spec.tag, int(got.info.number), nbytes=nbytes, verified=ok,
                      detail="" if ok else f"bytes differ from what seed {seed} pushed")

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
