"""``paramrouter`` with real ``paramworker serve --router`` processes against a real 3-server cluster.

A worker killed with requests in flight (each request succeeds on the other worker or fails with
a one-line 503; none outlives its deadline), and a deploy: ``paramctl prewarm`` then ``paramctl tag
--when-warm 2``, after which the two serving workers swap with zero network bytes.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import stop_process
from tests.integration.serve_models import slow_net_weights
from tests.integration.test_worker_harness import REPO, Cluster, running_cluster

pytestmark = pytest.mark.integration
FACTORY = "tests.integration.serve_models:slow_net"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("router")) as c:
        yield c


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_CONFIG", "PARAMS_ROUTER", "PARAMS_CLUSTER")}
    return {**env, **extra}


class Proc:
    """A process that prints ``LISTENING HOST:PORT ...`` first; its output is drained to a log."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("LISTENING"):
            stop_process(self.proc)
            raise AssertionError(line + self.proc.stdout.read()[-3000:])
        self.address = line.split()[1]
        self.url = f"http://{self.address}"
        out = self.proc.stdout

        def drain() -> None:
            with open(log, "a") as f:
                for chunk in out:
                    f.write(chunk)

        threading.Thread(target=drain, daemon=True).start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def request(address: str, method: str, path: str, body: object | None = None, timeout: float = 30.0,
            headers: dict[str, str] | None = None) -> tuple[int, Any]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw)
    finally:
        conn.close()


@pytest.fixture
def procs(workers: list[Any]) -> list[Proc]:
    """The routers and workers a test starts: conftest's ``workers`` list, stopped when the test ends."""
    return workers


def start_router(cluster: Cluster, tmp_path: Path, procs: list[Proc], *args: str) -> Proc:
    r = Proc(["-m", "worker.router", "--listen", "127.0.0.1:0", "--cluster", cluster.seed, *args], tmp_path / "router.log",
             clean_env())
    procs.append(r)
    return r


def start_worker(cluster: Cluster, tmp_path: Path, procs: list[Proc], ref: str, router: Proc, name: str,
                 forward_s: float = 0.02, *args: str) -> Proc:
    w = Proc(["-m", "worker", "serve", "--model", ref, "--factory", FACTORY, "--cluster", cluster.seed,
              "--listen", "127.0.0.1:0", "--poll-s", "0.2", "--device", "cpu", "--cache-mb", "16",
              "--router", router.url, "--worker-id", name, *args],
             tmp_path / f"{name}.log", clean_env(PDPARAMS_TEST_FORWARD_S=str(forward_s)))
    procs.append(w)
    return w


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def registered(router: Proc, n: int) -> bool:
    _, table = request(router.address, "GET", "/workers")
    return len([w for w in table["workers"] if w["loaded"] and not w.get("failed") and w.get("verified", True)]) >= n


# ------------------------------------------------------------------ worker killed mid-request


@pytest.mark.timeout(90)
def test_worker_killed_with_requests_in_flight_every_request_succeeds_elsewhere_or_fails_with_a_clear_503(
        cluster: Cluster, tmp_path: Path, procs: list[Proc]) -> None:
    cluster.push(slow_net_weights(1), "kill", tag="prod")
    router = start_router(cluster, tmp_path, procs)
    w1 = start_worker(cluster, tmp_path, procs, "kill:prod", router, "w1", 0.4, "--max-concurrency", "8")
    start_worker(cluster, tmp_path, procs, "kill:prod", router, "w2", 0.4, "--max-concurrency", "8")
    wait_for(lambda: registered(router, 2), 20, "two workers registered")
    deadline_s = 5.0

    def one(i: int) -> tuple[int, dict[str, Any], float, str]:
        t0 = time.monotonic()
        host, port = router.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=deadline_s + 10)
        try:
            conn.request("POST", "/infer/kill:prod", body=json.dumps({"input": [[float(i), 1.0, 2.0, 3.0]], "cache": False}),
                         headers={"Content-Type": "application/json", "X-Pdparams-Timeout-S": str(deadline_s)})
            r = conn.getresponse()
            raw = r.read()
            return r.status, json.loads(raw), time.monotonic() - t0, r.getheader("X-Pdparams-Worker") or ""
        finally:
            conn.close()

    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        time.sleep(0.2)  # requests are in flight on both workers now (each forward pass takes 0.4 s)
        w1.kill()
        results = [f.result() for f in futures]
    statuses = [s for s, _, _, _ in results]
    assert set(statuses) <= {200, 503}, results
    for status, body, elapsed, _worker in results:
        assert elapsed < deadline_s + 1.0, (status, body, elapsed)
        if status == 200:
            assert body["model"] == "kill" and "output" in body
        else:
            assert isinstance(body.get("error"), str) and "\n" not in body["error"], body
    assert statuses.count(200) >= 12, results  # w2 took the retries
    # after the kill, new requests go to w2 only
    for i in range(3):
        status, body = request(router.address, "POST", "/infer/kill:prod", {"input": [[9.0, 1.0, 2.0, float(i)]]})
        assert status == 200
    metrics = request_text(router.address, "/metrics")
    assert metric(metrics, "pdparams_router_retried_total") >= 1
    wait_for(lambda: not registered(router, 2), 10, "the killed worker dropped from the table")
    # no worker left: a clear 503 at once, not a hang
    for p in procs[1:]:
        p.stop()
    wait_for(lambda: not registered(router, 1), 10, "no worker in the table")
    t0 = time.monotonic()
    status, body = request(router.address, "POST", "/infer/kill:prod", {"input": [[1.0, 1.0, 2.0, 3.0]]})
    assert status == 503 and "no live worker" in body["error"] and time.monotonic() - t0 < 2.0, body


def request_text(address: str, path: str) -> str:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


# ------------------------------------------------------------------ deploy: pre-warm, then tag --when-warm


def paramctl(cluster: Cluster, router: Proc, *args: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=clean_env(PARAMS_CLUSTER=cluster.seed, PARAMS_ROUTER=router.url, **env))


@pytest.mark.timeout(90)
def test_prewarm_then_tag_when_warm_swaps_both_serving_workers_with_zero_network_bytes(
        cluster: Cluster, tmp_path: Path, procs: list[Proc]) -> None:
    v1 = cluster.push(slow_net_weights(2), "dep", tag="prod").version.number
    v2 = cluster.push(slow_net_weights(3), "dep", parent=v1).version.number
    admin = tmp_path / "admin.token"  # pre-warm needs the admin token on the router and on the workers
    admin.write_text("admin-token-1\n")
    router = start_router(cluster, tmp_path, procs, "--admin-token-file", str(admin))
    workers = [start_worker(cluster, tmp_path, procs, "dep:prod", router, f"d{i}", 0.02, "--admin-token-file", str(admin))
               for i in (1, 2)]
    wait_for(lambda: registered(router, 2), 20, "two workers registered")
    for w in workers:
        assert request(w.address, "GET", "/healthz")[1]["version"] == v1

    # --when-warm before any pre-warm: a bounded wait, exit 7, one line, and the tag stays put
    t0 = time.monotonic()
    early = paramctl(cluster, router, "tag", "dep", "prod", str(v2), "--when-warm", "2", "--warm-timeout-s", "1")
    assert early.returncode == 7, early.stderr
    assert early.stderr.count("\n") == 1 and "FAILED_PRECONDITION" in early.stderr and "not" not in early.stdout
    assert time.monotonic() - t0 < 15
    time.sleep(0.5)
    assert all(request(w.address, "GET", "/healthz")[1]["version"] == v1 for w in workers)

    refused = paramctl(cluster, router, "prewarm", f"dep@{v2}", "--workers", "2")
    assert refused.returncode == 5 and "admin token" in refused.stderr, refused.stderr
    warmed = paramctl(cluster, router, "prewarm", f"dep@{v2}", "--workers", "2", "--wait", "--warm-timeout-s", "30",
                      PARAMS_ADMIN_TOKEN="admin-token-1")
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    assert "fully cached on 2 workers" in warmed.stdout
    _, warm = request(router.address, "GET", f"/warm/dep@{v2}")
    assert warm["complete"] == 2 and all(r["bytes_cached"] == r["bytes_total"] > 0 for r in warm["workers"]), warm
    for w in workers:  # pre-warm does not swap
        h = request(w.address, "GET", "/healthz")[1]
        assert h["version"] == v1 and h["swaps"] == 0 and h["prewarm"][0]["state"] == "done"

    moved = paramctl(cluster, router, "tag", "dep", "prod", str(v2), "--when-warm", "2", "--warm-timeout-s", "30")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert f"dep:prod -> v{v2}" in moved.stdout

    def swapped() -> list[dict[str, Any]] | None:
        hs = [request(w.address, "GET", "/healthz")[1] for w in workers]
        return hs if all(h["version"] == v2 for h in hs) else None

    healths = wait_for(swapped, 20, "both workers on v2")
    for h in healths:
        swap = h["last_swap"]
        assert swap["version"] == v2 and swap["network"] == 0 and swap["total"] > 0, h
        assert swap["memory"] + swap["disk"] + swap["local"] == swap["total"], h
    # requests through the router land on v2 and name it
    status, body = request(router.address, "POST", "/infer/dep:prod", {"input": [[0.5, 1.0, -1.0, 2.0]]})
    assert status == 200 and body["version"] == v2, body


@pytest.mark.timeout(60)
def test_router_errors_are_one_line_json(cluster: Cluster, tmp_path: Path, procs: list[Proc]) -> None:
    admin = tmp_path / "admin.token"
    admin.write_text("admin-token-2\n")
    router = start_router(cluster, tmp_path, procs, "--admin-token-file", str(admin))
    status, body = request(router.address, "POST", "/infer/nosuchmodel:prod", {"input": [[1.0]]})
    assert status == 404 and "\n" not in body["error"]
    status, body = request(router.address, "POST", "/infer/bad::ref", {"input": [[1.0]]})
    assert status == 400
    status, body = request(router.address, "GET", "/nowhere")
    assert status == 404 and "POST /infer/MODEL:TAG" in body["error"]
    status, body = request(router.address, "POST", "/heartbeat", {"worker_id": "x"})
    assert status == 400 and "heartbeat" in body["error"]
    status, body = request(router.address, "POST", "/infer/x@1", {"input": [[1.0]]}, headers={"X-Pdparams-Timeout-S": "-1"})
    assert status == 400
    # A version the cluster does not have is 404 at once, not 503 "retry later" (nor a pre-warm that never completes).
    v1 = cluster.push(slow_net_weights(4), "exact", tag="prod").version.number
    for method, path, payload in (("POST", f"/infer/exact@{v1 + 98}", {"input": [[1.0]]}),
                                  ("POST", "/prewarm", {"ref": f"exact@{v1 + 98}", "workers": None}),
                                  ("GET", f"/warm/exact@{v1 + 98}", None)):
        status, body = request(router.address, method, path, payload, headers={"Authorization": "Bearer admin-token-2"})
        assert status == 404 and f"{v1 + 98}" in body["error"], (path, status, body)


def test_beats_need_the_worker_token_when_the_router_has_one(cluster: Cluster, tmp_path: Path, procs: list[Proc]) -> None:
    """Anyone who reached the router could beat for a made-up worker (every request then went to a
    URL of their choosing, bodies included) or make real workers leave: beats and leaves carry the
    worker token the router was given (not the cluster's read token, which readers hold too), which
    paramworker sends."""
    token = tmp_path / "worker.token"
    token.write_text("worker-token-1\n")
    cluster.push(slow_net_weights(5), "beat", tag="prod")
    router = start_router(cluster, tmp_path, procs, "--worker-token-file", str(token))
    for path, headers, problem in (("/heartbeat", {}, "no token was sent"),
                                   ("/heartbeat", {"Authorization": "Bearer wrong"}, "the token sent is wrong"),
                                   ("/leave", {}, "no token was sent")):
        status, body = request(router.address, "POST", path, {"worker_id": "evil"}, headers=headers)
        assert status == 401 and "worker token" in body["error"] and problem in body["error"], (path, status, body)
    start_worker(cluster, tmp_path, procs, "beat:prod", router, "w-beat", 0.02, "--worker-token-file", str(token))
    wait_for(lambda: registered(router, 1), 90, "the worker registered with its token")
    assert [w["worker_id"] for w in request(router.address, "GET", "/workers")[1]["workers"]] == ["w-beat"]


def test_a_body_that_trickles_in_is_cut_off_at_the_deadline(cluster: Cluster, tmp_path: Path, procs: list[Proc]) -> None:
    """The body was read outside the request deadline: stalled bodies held their connections for good."""
    import socket

    router = start_router(cluster, tmp_path, procs)
    host, port = router.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /infer/x@1 HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                  b"X-Pdparams-Timeout-S: 1\r\n\r\n{\"input\":")
        started = time.monotonic()
        answer = s.recv(4096).decode(errors="replace")
        took = time.monotonic() - started
    assert answer.startswith("HTTP/1.1 408") and "did not arrive within the deadline" in answer, answer
    assert took < 5, took


@pytest.mark.timeout(90)
def test_open_connections_are_capped_with_a_503_and_come_back(cluster: Cluster, tmp_path: Path, procs: list[Proc]) -> None:
    """aiohttp has no connection limit: request lines trickled byte by byte held a file descriptor each, for good."""
    import socket

    from worker.router_listen import connection_cap

    assert connection_cap(4096, fd_limit=1 << 20) == 4096 and connection_cap(4096, fd_limit=1024) == 512
    router = start_router(cluster, tmp_path, procs, "--max-connections", "4")
    host, port = router.address.rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
    try:
        for s in held:  # each made a request and stays open: never closed for a newcomer (issue 41)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: r\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 200")
        time.sleep(0.3)
        with socket.create_connection((host, int(port)), timeout=10) as extra:
            answer = b""
            while chunk := extra.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"].startswith("overloaded: too many open connections")
    finally:
        for s in held:
            s.close()
    wait_for(lambda: _healthz(router) == 200, 10, "the router to take connections again (the held ones closed)")
    # A burst: aiohttp counts a connection only once the loop runs its connection_made, so
    # connections accepted in one go all got in. Each sends a whole request at once: a refused
    # one must still read its 503 (closed with the request unread, it could get a reset instead).
    burst = [socket.create_connection((host, int(port)), timeout=10) for _ in range(24)]
    try:
        for s in burst:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: r\r\n\r\n")
        statuses = []
        for s in burst:
            head = s.recv(64)  # a reset here would raise ConnectionResetError
            statuses.append(int(head.split(b" ")[1]))
    finally:
        for s in burst:
            s.close()
    assert statuses.count(200) <= 4 and statuses.count(200) + statuses.count(503) == 24, statuses
    assert metric(request_text(router.address, "/metrics"), "pdparams_router_refused_connections_total") >= 20


def _healthz(router: Proc) -> int | None:
    try:
        return request(router.address, "GET", "/healthz", timeout=5)[0]
    except (OSError, http.client.HTTPException, json.JSONDecodeError):
        return None
