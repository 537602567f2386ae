"""The worker's fetch path over the servers' bulk ports, and its fallback to GetChunks."""
from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator

import pytest
import torch

from tests.integration.test_worker_harness import Cluster, running_cluster
from paramserver.client.session import ClusterClient
from paramserver.client.errors import ConfigError as WorkerError
from worker.loader import load

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("bulkworker")) as c:
        yield c


def layers(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(256, 1024, generator=g) for i in range(n)}


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


def dead_address() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    return address


def test_load_reads_every_chunk_over_bulk(cluster: Cluster) -> None:
    want = layers(6, seed=21)
    cluster.push(want, "wbulk", tag="prod")
    with ClusterClient(cluster.seed) as c:
        assert all(m.bulk_address for m in c.members().values())
        loaded = load(c, "wbulk:prod")
        assert_bit_exact(loaded.tensors, want)
        assert c.transport.stats.bulk_bytes == c.stats.stored_bytes > 0 and c.transport.stats.bulk_fallbacks == 0


def test_content_verification_mode_loads_bit_exact(cluster: Cluster) -> None:
    want = layers(2, seed=22)
    cluster.push(want, "wcontent", tag="prod")
    with ClusterClient(cluster.seed, verify="content") as c:
        assert_bit_exact(load(c, "wcontent:prod").tensors, want)
    with pytest.raises(WorkerError, match="verify must be one of"):
        ClusterClient(cluster.seed, verify="none")


def test_bulk_off_reads_over_grpc(cluster: Cluster) -> None:
    want = layers(2, seed=23)
    cluster.push(want, "wgrpc", tag="prod")
    with ClusterClient(cluster.seed, bulk=False) as c:
        assert_bit_exact(load(c, "wgrpc:prod").tensors, want)
        assert c.transport.stats.bulk_bytes == 0 and c.stats.stored_bytes > 0


def test_unreachable_bulk_ports_fall_back_to_grpc_and_are_remembered(cluster: Cluster) -> None:
    want = layers(4, seed=24)
    cluster.push(want, "wfall", tag="prod")
    dead = dead_address()
    with ClusterClient(cluster.seed) as c:
        c.config = dataclasses.replace(c.config, refresh_interval_s=3600)  # keep the doctored view
        view = c.view()
        for sid, m in list(view.members.items()):  # every member advertises a bulk port where nothing listens
            broken = type(m)()
            broken.CopyFrom(m)
            broken.bulk_address = dead
            view.members[sid] = broken
        loaded = load(c, "wfall:prod")
        assert_bit_exact(loaded.tensors, want)
        assert c.transport.stats.bulk_bytes == 0 and c.transport.stats.bulk_fallbacks >= 1
        assert c.transport.bulk is not None and c.transport.bulk.client(dead) is None  # parked after the failure
