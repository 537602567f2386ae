"""Fixtures the worker's integration modules share: one real 3-server cluster per module."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from paramserver.client.session import ClusterClient
from tests.integration.test_worker_harness import Cluster, running_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("workercluster")) as c:
        yield c


@pytest.fixture()
def client(cluster: Cluster) -> Iterator[ClusterClient]:
    with ClusterClient(cluster.seed) as c:
        yield c


@pytest.fixture
def workers() -> Iterator[list[Any]]:
    """Worker processes a test starts (append them; anything with ``stop()``), stopped when it ends."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for w in started:
            w.stop()
