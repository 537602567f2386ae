"""A server's aggregated heat survives its restart (DATA_DIR/heat.npz): a real one-server cluster."""
from __future__ import annotations

import signal
from pathlib import Path

import torch

from chunking import ChunkingConfig
from paramserver.client.push import push
from paramserver.client.rpc import ParamServerClient
from paramserver.server.heat import HEAT_FILE
from tests.conftest import local_cluster


def test_heat_reported_before_a_restart_is_served_after_it(tmp_path: Path) -> None:
    with local_cluster(tmp_path, servers=1, extra_args=("--no-fsync",)) as cluster:
        state = {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(10)}
        report = push(cluster.seed, state, model="warm", config=ChunkingConfig(chunk_size=64 * 1024))
        with ParamServerClient(cluster.addresses[0]) as c:
            chunks = int(c.get_version("warm", report.version).version.chunk_count)
            c.report_heat("warm", report.version, "w1", [(i, 3, chunks - 1 - i) for i in range(chunks)])
            c.report_heat("warm", report.version, "w2", [(0, 1, 0)])
            before = c.get_heat("warm", report.version)
        assert before.reports == 2 and len(before.entries) == chunks

        cluster.kill("ps1", signal.SIGTERM)  # a clean stop saves the heat it holds
        assert (Path(cluster.slot("ps1").data_dir) / HEAT_FILE).exists()
        cluster.restart("ps1")
        cluster.wait_ready(60)
        with ParamServerClient(cluster.addresses[0]) as c:
            after = c.get_heat("warm", report.version)
        assert after.reports == before.reports
        assert [(e.chunk_index, e.count, e.first_access_order) for e in after.entries] == \
            [(e.chunk_index, e.count, e.first_access_order) for e in before.entries]
