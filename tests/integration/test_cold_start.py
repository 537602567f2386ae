"""A cold worker answers while its weights arrive: a 12-layer model whose layers compute about as
long as they take to fetch. The first answer of a cold start is bit-identical to the fully loaded
model's, and its first layers run while later layers are still on the wire (the pre-hooks wait
per layer, not for the whole load). How much sooner it answers is measured by
``bench/bench_cold_start.py`` (this test prints the ratio of its own run, but does not assert a
timing on a shared 2-core machine)."""
from __future__ import annotations

import statistics
import time
from functools import partial
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deploy.local import LocalCluster
from paramserver.client.push import push
from paramserver.client.session import ClusterClient, SessionConfig
from tests.conftest import local_cluster
from worker.cold_start import start_cold
from worker.loader import empty_weights, fill_module, load

pytestmark = pytest.mark.integration
LAYERS = 12
WIDTH = 256
ROWS = 32768  # 32 MiB of float32 per layer: the transfer, not the fixed costs, dominates a load


class Slow(torch.nn.Module):
    """A layer with 16 MiB of weights whose compute is a pause standing for GPU time: on a GPU
    the arithmetic does not use the host's CPU, which here (2 cores) would otherwise compete with
    the fetch it should overlap. Its answer depends on its weights, read through the embedding's
    own forward (whose pre-hook waits for them); ``rows`` is a non-persistent buffer."""

    pause = 0.0  # seconds per layer, set by the test

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(ROWS, WIDTH)
        self.register_buffer("rows", torch.arange(0, ROWS, ROWS // 8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(Slow.pause)
        return torch.tanh(x + self.emb(self.rows).sum(0))


def _stamp(ready: dict[str, float], name: str) -> None:
    ready.setdefault(name, time.perf_counter())


def build() -> torch.nn.Module:
    # Zero-padded names: with no heatmap yet, manifest (name) order is the forward order.
    return torch.nn.Sequential(OrderedDict((f"l{i:02d}", Slow()) for i in range(LAYERS)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("cold"), servers=3) as c:
        yield c


def full_then_forward(seed: str, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with ClusterClient(seed, config=ORDERED) as client:
        loaded = load(client, "deep@1", device="cpu")
        with empty_weights():
            module = build()
        fill_module(module, loaded.tensors, torch.device("cpu"))
        module.eval()
        with torch.no_grad():
            y = module(x)
        took = time.perf_counter() - t0
        loaded.handle.heat_sent(5.0) if loaded.handle else None
    return took, y


# Reads of a few MiB, queued in the forward order: the first layers arrive first (one 64 MiB read
# per lane would fill the layers in parallel runs, the last ones as early as the first).
ORDERED = SessionConfig(max_read_bytes=4 << 20)


def cold_first_answer(seed: str, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with ClusterClient(seed, config=ORDERED) as client:
        cold = start_cold(client, "deep@1", build, torch.device("cpu"))
        ready: dict[str, float] = {}
        stamp = partial(_stamp, ready)
        for t in cold.handle.manifest.tensors:
            cold.handle.readiness.on_ready(t.name, stamp)
        first_layer: list[float] = []
        hook = cold.module[0].register_forward_hook(lambda *_: first_layer.append(time.perf_counter()))
        with torch.no_grad():
            y = cold.module(x)
        took = time.perf_counter() - t0
        hook.remove()
        loaded = cold.finish(60)
        assert cold.progress() == 1.0
        # Overlap: the first layer had run before the last layer's weights had landed.
        assert first_layer and first_layer[0] < max(ready.values()), (first_layer, sorted(ready.values())[-3:])
        loaded.handle.heat_sent(5.0) if loaded.handle else None
    return took, y


@pytest.mark.timeout(240)
def test_first_answer_of_a_cold_start_overlaps_load_and_compute(cluster: LocalCluster) -> None:
    torch.manual_seed(0)
    push(cluster.seed, build().state_dict(), model="deep", tag="prod")
    x = torch.randn(4, WIDTH)
    fetch_per_layer: list[float] = []
    for k in range(4):  # warm caches and memory; then time how long one layer takes to arrive
        Slow.pause = 0.0
        with ClusterClient(cluster.seed, config=ORDERED) as client:
            cold = start_cold(client, "deep@1", build, torch.device("cpu"))
            ready: dict[str, float] = {}
            stamp = partial(_stamp, ready)
            for t in cold.handle.manifest.tensors:
                cold.handle.readiness.on_ready(t.name, stamp)
            cold.finish(60)
        if k >= 1:
            times = sorted(ready.values())
            fetch_per_layer.append((times[-1] - times[0]) / (LAYERS - 1))
    # Each layer computes (a pause standing for GPU time) about as long as it takes to fetch.
    Slow.pause = statistics.median(fetch_per_layer)
    full: list[float] = []
    cold: list[float] = []
    want = got = None
    for r in range(3):  # rotate the order
        for kind in (("full", "cold") if r % 2 == 0 else ("cold", "full")):
            if kind == "full":
                t, want = full_then_forward(cluster.seed, x)
                full.append(t)
            else:
                t, got = cold_first_answer(cluster.seed, x)
                cold.append(t)
    assert want is not None and got is not None and torch.equal(want, got)  # the same answer, bit for bit
    ratio = statistics.median(cold) / statistics.median(full)
    print(f"cold start: first answer {statistics.median(cold):.3f} s vs load then forward {statistics.median(full):.3f} s "
          f"= {ratio:.2f}x (per layer: fetch and compute {Slow.pause * 1000:.1f} ms each)")


@pytest.mark.timeout(180)
def test_paramworker_serve_answers_while_loading_and_says_so(cluster: LocalCluster) -> None:
    import json
    import subprocess
    import sys
    import urllib.request

    from tests.conftest import stop_process

    torch.manual_seed(1)
    state = build().state_dict()
    push(cluster.seed, state, model="deepserve", tag="prod")
    reference = build()
    reference.load_state_dict(state)
    x = [[0.5] * WIDTH, [-0.25] * WIDTH]
    with torch.no_grad():
        want = reference(torch.tensor(x)).tolist()
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "serve", "--model", "deepserve:prod", "--factory",
         "tests.integration.test_cold_start:build", "--cluster", cluster.seed, "--listen", "127.0.0.1:0",
         "--device", "cpu", "--cache-mb", "0", "--poll-s", "0"],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("LISTENING") and "loading" in line, line  # up before its weights are in
        address = line.split()[1]
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=10) as r:
            first = json.loads(r.read())
        assert first["state"] in ("loading", "ready") and 0.0 <= first["progress"] <= 1.0, first
        req = urllib.request.Request(f"http://{address}/infer", data=json.dumps({"input": x}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())
        assert got["output"] == want  # the first answer, possibly computed while loading, is exact
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'pdparams_serving_version{model="deepserve"} 1.0' in metrics  # serving it, loaded or not
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(f"http://{address}/healthz", timeout=10) as r:
                health = json.loads(r.read())
            if health["state"] == "ready" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert health["state"] == "ready" and health["progress"] == 1.0 and health["load_error"] is None, health
    finally:
        stop_process(proc)
