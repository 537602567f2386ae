"""The real publish and load operations, shaped as Workload callables.

The models are self-verifying: every tensor is generated from a seed that the
model carries in its ``seed`` tensor, so a loader can check bit-exactness of
whatever version it got without asking the publisher. The publisher pushes
with ``paramserver.client.push.push`` (parent "head", then moves the tag); each loader
keeps one ``paramserver.client.session.ClusterClient`` for its whole life, because the
monotonic-reads guard (invariant 4) lives in the client.

Every client here is made from the cluster's ``ClientSettings`` (``LocalCluster.client_settings()``):
its addresses, the admin token for writes and the read token for reads, and under ``--tls`` the
cluster's CA and the client certificate, so a drill runs against a TLS cluster as against a plain one.

Imports of paramserver/worker are lazy: the framework and its unit tests do
not need a server build.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from .framework import Loaded, Published

if TYPE_CHECKING:
    from paramserver.client.config import ClientSettings


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


@dataclass(frozen=True)
class PublisherConfig:
    """How the drill's publisher talks to the cluster: short deadlines, so a silent server costs seconds, not minutes."""

    # Unary calls (HasChunks, ListVersions, CommitVersion, ...): the most a cut-off server costs a call whose
    # request it had acknowledged (a request sent after the cut fails sooner, on the channel keepalive's
    # TCP timeout). A silent leader costs less still: leader_call moves as soon as a member names a newer one.
    rpc_timeout_s: float = 1.0
    commit_deadline_s: float = 8.0  # CommitVersion retries on UNAVAILABLE this long, then the publish fails
    publisher: str = "drill"

    def validate(self) -> None:
        if self.rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be > 0, got {self.rpc_timeout_s}")
        if self.commit_deadline_s <= 0:
            raise ValueError(f"commit_deadline_s must be > 0, got {self.commit_deadline_s}")


class Publisher:
    """publish(i): push version seed=i of spec.model and move spec.tag to it (a Workload publish callable).

    ``prefer(addresses)`` puts those servers first in the seed list, so a drill
    that cuts the network can point the publisher at the side it can reach
    (``paramserver.client.push`` asks every seed at once and takes the first answer).
    """

    def __init__(self, settings: "ClientSettings", spec: ModelSpec = ModelSpec(),
                 config: PublisherConfig = PublisherConfig()) -> None:
        spec.validate()
        config.validate()
        if not settings.cluster:
            raise ValueError("a publisher needs at least one server address")
        self.spec = spec
        self.config = config
        self.settings = settings
        self._all = list(settings.cluster)
        self._order = list(settings.cluster)
        self._lock = threading.Lock()

    @property
    def seeds(self) -> list[str]:
        with self._lock:
            return list(self._order)

    def prefer(self, addresses: Sequence[str] | None) -> None:
        """Seeds in this order first, then the rest; None restores the original order."""
        with self._lock:
            first = [a for a in (addresses or []) if a in self._all]
            self._order = first + [a for a in self._all if a not in first]

    def __call__(self, i: int) -> Published:
        from paramserver.client.push import PushOptions, push

        state = make_state(self.spec, i)
        c = self.config
        seeds = tuple(self.seeds)
        cluster = replace(self.settings.cluster_options(write=True), seeds=seeds, timeout_s=c.rpc_timeout_s)
        rep = push(seeds, state, model=self.spec.model, tag=self.spec.tag, parent="head", publisher=c.publisher,
                   options=PushOptions(commit_deadline_s=c.commit_deadline_s), cluster=cluster)
        return Published(self.spec.model, int(rep.version), self.spec.tag, nbytes=int(rep.bytes_total), seed=i)


def verify_loaded(spec: ModelSpec, tensors: Mapping[str, torch.Tensor]) -> tuple[int, bool, int]:
    """(seed, bit-exact, bytes) of loaded tensors: the seed tensor says which weights they must equal."""
    seed = int(tensors["seed"][0]) if "seed" in tensors else -1
    ok = seed >= 0 and digest(tensors) == digest(make_state(spec, seed))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return seed, ok, nbytes


def load_version(settings: "ClientSettings", spec: ModelSpec, version: int, seed: int | None = None) -> Loaded:
    """Load spec.model@version with a fresh worker client (no cache) and verify it; seed: the expected one."""
    from paramserver.client.session import ClusterClient
    from worker.loader import load

    with ClusterClient(settings=settings) as client:
        got = load(client, f"{spec.model}@{version}", device="cpu")
    found, ok, nbytes = verify_loaded(spec, got.tensors)
    if seed is not None and found != seed:
        ok = False
    return Loaded(spec.model, f"@{version}", int(got.info.number), nbytes=nbytes, verified=ok,
                  detail="" if ok else f"v{version}: got weights of seed {found}, expected seed {seed}")


class LoaderPool:
    """load(k, i): loader k loads spec.model:spec.tag with its own long-lived ClusterClient and verifies it."""

    def __init__(self, settings: "ClientSettings", spec: ModelSpec = ModelSpec()) -> None:
        spec.validate()
        self.settings = settings
        self.spec = spec
        self._clients: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _client(self, k: int) -> Any:
        from paramserver.client.session import ClusterClient

        with self._lock:
            if k not in self._clients:
                self._clients[k] = ClusterClient(settings=self.settings)
            return self._clients[k]

    def __call__(self, k: int, i: int) -> Loaded:
        from worker.loader import load

        got = load(self._client(k), f"{self.spec.model}:{self.spec.tag}", device="cpu")
        seed, ok, nbytes = verify_loaded(self.spec, got.tensors)
        return Loaded(self.spec.model, self.spec.tag, int(got.info.number), nbytes=nbytes, verified=ok,
                      detail="" if ok else f"bytes differ from what seed {seed} pushed")

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
