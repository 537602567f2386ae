"""Loads onto a CUDA device against a real 3-server cluster; skipped where torch sees no GPU.

CI has no GPU: these run where one is lent (``bench/gpu_check.py`` is the measured half).
"""
from __future__ import annotations

import pytest
import torch

from paramserver.client.hostmem import default_pool
from paramserver.client.session import ClusterClient
from tests.integration.test_worker_cluster import assert_bit_exact, layers, mem_cache, mixed
from tests.integration.test_worker_harness import Cluster
from worker.config import PrefetchConfig
from worker.errors import TensorFailed
from worker.loader import load, start_load

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")]


def on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name, t in tensors.items():
        assert t.device.type == "cuda", f"{name} is on {t.device}"
    return {k: v.cpu() for k, v in tensors.items()}


def test_host_staged_cuda_load_is_bit_exact_pinned_and_taken_back(cluster: Cluster, client: ClusterClient) -> None:
    sd = {**layers(6, seed=11), **mixed(seed=12)}  # every dtype of mixed(), 0-d and empty included
    cluster.push(sd, "cudastaged", tag="prod")
    cache = mem_cache()
    first = start_load(client, "cudastaged:prod", "cuda:0", cache)
    assert first.upload is not None  # the tier holds the model: host-staged
    tensors, report = first.result(timeout=120)
    assert report.bytes_network == report.bytes_total > 0
    assert_bit_exact(on_cpu(tensors), sd)
    group = cache._groups[first.manifest.id]
    assert group.private and group.arena is not None
    assert default_pool().is_pinned(group.arena.view)
    assert default_pool().free_but_for(group.arena.view)
    second = start_load(client, "cudastaged:prod", "cuda:0", cache)
    assert second.prefetcher._trusted
    again, report2 = second.result(timeout=120)
    assert report2.bytes_memory == report2.bytes_total and report2.bytes_network == 0
    assert_bit_exact(on_cpu(again), sd)
    # a tensor handed out early is complete on the caller's stream
    third = start_load(client, "cudastaged:prod", "cuda:0", cache)
    name = "layers.0.weight"
    early = third.wait(name, timeout=60).clone()
    third.result(timeout=120)
    assert torch.equal(early.cpu().view(torch.uint8), sd[name].view(torch.uint8))


def test_per_chunk_cuda_load_is_bit_exact(cluster: Cluster, client: ClusterClient) -> None:
    sd = {**layers(4, seed=13), **mixed(seed=14)}
    cluster.push(sd, "cudachunks", tag="prod")
    never = PrefetchConfig(host_staging="never")
    cold = start_load(client, "cudachunks:prod", "cuda:0", mem_cache(), config=never)
    assert cold.upload is None
    assert_bit_exact(on_cpu(cold.result(timeout=120)[0]), sd)
    tiny = load(client, "cudachunks:prod", "cuda:0", mem_cache(mb=1))  # larger than the tier: per chunk under auto
    assert tiny.handle is not None and tiny.handle.upload is None
    assert_bit_exact(on_cpu(tiny.tensors), sd)


def test_failed_host_staged_load_fails_its_device_tensors(cluster: Cluster, client: ClusterClient) -> None:
    sd = layers(3, seed=15)
    cluster.push(sd, "cudafail", tag="prod")
    handle = start_load(client, "cudafail:prod", "cuda:0", mem_cache(), local=_boom)
    with pytest.raises(RuntimeError, match="planted"):
        handle.result(timeout=120)
    with pytest.raises(TensorFailed):
        handle.wait("layers.0.weight", timeout=10)


def _boom(_ref: object) -> None:
    raise RuntimeError("planted failure of the local source")
