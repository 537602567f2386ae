"""``paramworker serve`` with its result cache, against a real 3-server cluster and a real redis-server.

Stampede (two workers, one Redis: one forward pass for 200 identical requests), version safety
across a ``paramctl tag`` move, Redis killed under load (no failed request; the breaker opens
and closes), and overload (503 quickly beyond the queue, bounded memory, instant recovery).
"""
from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from deploy.redis_baseline import RedisServer
from tests.conftest import stop_process
from tests.integration.serve_models import slow_net, slow_net_weights
from tests.integration.test_worker_harness import REPO, Cluster, running_cluster

pytestmark = pytest.mark.integration

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed (Debian: apt-get install -y redis-server)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("serve-cache")) as c:
        yield c


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.client()  # waits until it answers
    try:
        yield server
    finally:
        server.stop()


def expected(state: dict[str, torch.Tensor], x: Sequence[Sequence[float]]) -> list[list[float]]:
    net = slow_net()
    net.load_state_dict(state)
    net.pause = 0.0  # type: ignore[assignment]
    with torch.no_grad():
        out: list[list[float]] = net(torch.tensor(x)).float().tolist()
        return out


def shared_key_file() -> str:
    """One L2 key file (0600) for every worker these tests start: workers sharing a Redis share it."""
    global _KEY_FILE
    if _KEY_FILE is None:
        folder = tempfile.mkdtemp(prefix="pdparams-result-key-")
        _KEY_FILE = os.path.join(folder, "result-cache.key")
        fd = os.open(_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_urlsafe(32).encode())
        os.close(fd)
    return _KEY_FILE


_KEY_FILE: str | None = None


class Worker:
    def __init__(self, cluster: Cluster, ref: str, *args: str, forward_s: float = 0.02, shared_key: bool = True) -> None:
        """``shared_key``: with --result-cache-redis, the workers' shared L2 key (PARAMS_RESULT_CACHE_KEY_FILE)."""
        env = {**os.environ, "PDPARAMS_TEST_FORWARD_S": str(forward_s)}
        env.pop("PARAMS_RESULT_CACHE_KEY_FILE", None)
        if shared_key:
            env["PARAMS_RESULT_CACHE_KEY_FILE"] = shared_key_file()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "serve", "--model", ref, "--factory", "tests.integration.serve_models:slow_net",
             "--cluster", cluster.seed, "--listen", "127.0.0.1:0", "--poll-s", "0.2", "--device", "cpu", "--cache-mb", "16",
             *args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("LISTENING"):
            stop_process(self.proc)
            raise AssertionError(line + self.proc.stdout.read()[-3000:])
        self.address = line.split()[1]
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drain, so it never blocks on a pipe

    def stop(self) -> None:
        stop_process(self.proc)

    def connection(self) -> http.client.HTTPConnection:
        host, port = self.address.rsplit(":", 1)
        return http.client.HTTPConnection(host, int(port), timeout=30)

    def get(self, path: str) -> bytes:
        conn = self.connection()
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """sample name + sorted labels -> value, e.g. 'pdparams_infer_requests_total{outcome=hit_l1}'."""
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(self.get("/metrics").decode()):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.get("/healthz"))
        return result

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the first load is complete: while a cold start answers, the result cache is bypassed."""
        deadline = time.monotonic() + timeout
        while self.health()["state"] != "ready":
            assert time.monotonic() < deadline, f"not ready within {timeout:g} s: {self.health()}"
            time.sleep(0.05)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0


def post(conn: http.client.HTTPConnection, body: object) -> tuple[int, dict[str, Any], dict[str, str]]:
    conn.request("POST", "/infer", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    return r.status, json.loads(data), dict(r.getheaders())


# ------------------------------------------------------------------ stampede


@needs_redis
@pytest.mark.timeout(180)
def test_stampede_of_200_identical_requests_runs_one_forward_pass_across_two_workers(
        cluster: Cluster, redis_server: RedisServer, workers: list[Worker]) -> None:
    state = slow_net_weights(1)
    cluster.push(state, "stamp", tag="prod")
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    for _ in range(2):
        workers.append(Worker(cluster, "stamp:prod", "--result-cache-redis", url, "--result-cache-ttl", "2",
                              forward_s=0.1))
    x = [[0.25, -1.0, 2.0, 0.5]]
    want = expected(state, x)

    def stampede() -> list[tuple[int, dict[str, Any]]]:
        gate = threading.Barrier(200)

        def one(i: int) -> tuple[int, dict[str, Any]]:
            conn = workers[i % 2].connection()
            try:
                conn.connect()
                gate.wait(30)
                status, body, _ = post(conn, {"input": x})
                return status, body
            finally:
                conn.close()

        with ThreadPoolExecutor(200) as pool:
            return list(pool.map(one, range(200)))

    def forwards() -> float:
        return sum(w.metrics()["pdparams_forward_total"] for w in workers)

    for round_name in ("cold key", "key that just expired"):
        before = forwards()
        answers = stampede()
        assert all(status == 200 for status, _ in answers), [b for s, b in answers if s != 200][:3]
        assert all(body["output"] == want for _, body in answers), round_name
        assert {json.dumps(body["output"]) for _, body in answers} == {json.dumps(want)}
        assert forwards() - before == 1, f"{round_name}: {forwards() - before} forward passes"
        outcomes = {o: sum(1 for _, b in answers if b["cache"] == o) for o in ("computed", "joined", "hit_l1", "hit_l2")}
        assert outcomes["computed"] == 1 and sum(outcomes.values()) == 200, outcomes
        time.sleep(2.5)  # past the TTL (2 s plus at most 10% jitter): the next round meets an expired key
    m = workers[0].metrics()
    assert m["pdparams_infer_requests_total{outcome=error}"] == 0 and m["pdparams_infer_requests_total{outcome=shed}"] == 0


# ------------------------------------------------------------------ version safety


@pytest.mark.timeout(180)
def test_after_a_tag_move_no_response_carries_the_old_versions_result(cluster: Cluster, workers: list[Worker]) -> None:
    old, new = slow_net_weights(2), slow_net_weights(3)
    v1 = cluster.push(old, "ver", tag="prod").version.number
    v2 = cluster.push(new, "ver", parent=v1).version.number
    worker = Worker(cluster, "ver:prod", forward_s=0.0)
    workers.append(worker)
    x = [[1.0, 2.0, 3.0, 4.0]]
    want = {v1: expected(old, x), v2: expected(new, x)}
    assert want[v1] != want[v2]
    worker.wait_ready()  # a cold start answers without the result cache until its load is done
    conn = worker.connection()
    for _ in range(5):  # warm: v1's answer is cached
        status, body, _ = post(conn, {"input": x})
        assert status == 200 and body["version"] == v1 and body["output"] == want[v1]
    assert body["cache"] == "hit_l1"
    fp1 = body["fingerprint"]
    full = {**os.environ, "PARAMS_CLUSTER": cluster.seed}
    for name in ("PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_CONFIG"):
        full.pop(name, None)
    moved = subprocess.run([sys.executable, "-m", "paramserver.client.ctl", "tag", "ver", "prod", str(v2)],
                           env=full, capture_output=True, text=True, timeout=60)
    assert moved.returncode == 0, moved.stderr
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, body, _ = post(conn, {"input": x})
        assert status == 200
        assert body["output"] == want[body["version"]]  # every answer matches the version it names
        seen.append((body["version"], body["cache"]))
        if body["version"] == v2 and worker.health()["version"] == v2:
            break
    assert worker.health()["version"] == v2, seen[-5:]
    for _ in range(20):  # after the swap: never the old version's result, though it is still cached
        status, body, _ = post(conn, {"input": x})
        assert status == 200 and body["version"] == v2 and body["output"] == want[v2]
        assert body["fingerprint"] != fp1
    conn.close()


# ------------------------------------------------------------------ Redis dies under load


@needs_redis
@pytest.mark.timeout(180)
def test_redis_killed_under_load_fails_no_request_and_the_breaker_opens_and_closes(
        cluster: Cluster, tmp_path: Path, workers: list[Worker]) -> None:
    state = slow_net_weights(4)
    cluster.push(state, "flaky", tag="prod")
    redis_server = RedisServer(tmp_path)
    redis_server.client()
    port = redis_server.port
    try:
        worker = Worker(cluster, "flaky:prod", "--result-cache-redis", f"redis://127.0.0.1:{port}/0",
                        "--max-concurrency", "4", forward_s=0.005)
        workers.append(worker)
        stop = threading.Event()
        failures: list[str] = []
        done = [0]
        lock = threading.Lock()

        def client(k: int) -> None:
            conn = worker.connection()
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    status, body, _ = post(conn, {"input": [[float(k), float(i), 0.0, 1.0]]})  # misses: Redis is asked every time
                    if status != 200:
                        failures.append(f"{status} {body}")
                except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                    failures.append(repr(exc))
                    conn.close()
                    conn = worker.connection()
                with lock:
                    done[0] += 1
            conn.close()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        time.sleep(2)
        redis_server.proc.kill()  # SIGKILL mid-run
        redis_server.proc.wait(10)
        time.sleep(3)
        redis_server = RedisServer(tmp_path, port=port)  # back on the same address
        redis_server.client()
        deadline = time.monotonic() + 20
        m = worker.metrics()
        while time.monotonic() < deadline and m["pdparams_result_cache_breaker_transitions_total{state=closed}"] < 1:
            time.sleep(0.5)
            m = worker.metrics()
        time.sleep(1)
        stop.set()
        for t in threads:
            t.join(30)
        assert not failures, failures[:5]
        assert done[0] > 100
        m = worker.metrics()
        assert m["pdparams_result_cache_breaker_transitions_total{state=open}"] >= 1
        assert m["pdparams_result_cache_breaker_transitions_total{state=closed}"] >= 1
        assert m["pdparams_result_cache_breaker_open"] == 0
        assert m["pdparams_result_cache_l2_errors_total"] >= 1
        assert m["pdparams_infer_requests_total{outcome=error}"] == 0
        assert worker.health()["result_cache"]["breaker"] == "closed"
        assert redis_server.client().dbsize() > 0  # written through again after it came back
    finally:
        redis_server.stop()


# ------------------------------------------------------------------ overload


@pytest.mark.timeout(180)
def test_overload_sheds_quickly_keeps_memory_bounded_and_recovers_at_once(cluster: Cluster, workers: list[Worker]) -> None:
    state = slow_net_weights(5)
    cluster.push(state, "busy", tag="prod")
    # One forward pass at a time, 50 ms each: 20 requests/s is what this worker sustains.
    worker = Worker(cluster, "busy:prod", "--max-queue", "8", "--queue-timeout-s", "2", "--result-cache-mb", "0",
                    forward_s=0.05)
    workers.append(worker)
    conn = worker.connection()
    assert post(conn, [[0.0, 0.0, 0.0, 0.0]])[0] == 200
    rss_before = worker.rss_bytes()
    results: list[tuple[int, float, str]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 4.0

    def client(k: int) -> None:
        c = worker.connection()
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            started = time.monotonic()
            try:
                status, _body, headers = post(c, {"input": [[float(k), float(i), 1.0, 2.0]]})
                retry = headers.get("Retry-After", "")
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                status, retry = 0, repr(exc)
                c.close()
                c = worker.connection()
            with lock:
                results.append((status, time.monotonic() - started, retry))
        c.close()

    began = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    took = time.monotonic() - began
    ok = [r for r in results if r[0] == 200]
    shed = [r for r in results if r[0] == 503]
    other = [r for r in results if r[0] not in (200, 503)]
    shed_latency = sorted(r[1] for r in shed)
    print(f"overload: offered {len(results) / took:.0f} requests/s for {took:.1f} s; {len(ok)} answered, {len(shed)} shed, "
          f"p99 of a 503 {shed_latency[int(len(shed_latency) * 0.99) - 1] * 1000 if shed else 0:.1f} ms")
    assert not other, other[:5]
    assert len(results) / took >= 10 * 20, f"offered {len(results) / took:.0f} requests/s, not 10x the sustainable 20/s"
    assert ok and shed
    assert all(r[2].isdigit() and int(r[2]) >= 1 for r in shed)  # Retry-After on every 503
    assert shed_latency[int(len(shed_latency) * 0.99) - 1] < 0.5, shed_latency[-5:]
    assert max(r[1] for r in ok) < 2 + 0.05 * 9 + 1  # an accepted request waits at most the queue timeout
    assert worker.rss_bytes() - rss_before < 64 << 20
    started = time.monotonic()
    status, body, _ = post(conn, [[1.0, 1.0, 1.0, 1.0]])
    assert status == 200 and time.monotonic() - started < 1.0  # recovered at once
    assert body["output"] == expected(state, [[1.0, 1.0, 1.0, 1.0]])
    m = worker.metrics()
    assert m["pdparams_infer_requests_total{outcome=shed}"] == len(shed)
    assert m["pdparams_infer_queue"] == 0
    conn.close()
