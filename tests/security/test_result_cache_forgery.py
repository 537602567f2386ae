"""Forged result-cache entries are never served (issue 41).

A Redis that answered a GET with a well-formed entry (``PDR1|200|...|{"output":"X"}``) had ``X``
served by the worker as ``hit_l2`` with the real model's fingerprint. L2 entries now carry an
HMAC under a key the workers share and Redis never sees: a forged, altered or moved entry is a
miss, counted (``pdparams_result_cache_l2_rejected_total``), never served. ``rediss://`` with
the AUTH password from a file works.

A real one-server cluster, real ``redis-server`` processes and real ``paramworker serve``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.certs import issue, make_ca
from deploy.local import free_port
from deploy.redis_baseline import RedisServer
from tests.integration.serve_models import slow_net_weights
from tests.integration.test_serve_cache import Worker, expected, post
from tests.integration.test_worker_harness import Cluster, running_cluster
from worker.result_cache import CachedResult
from worker.result_store import VALUE_PREFIX

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed (Debian: apt-get install -y redis-server)")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("forged-cache"), servers=1) as c:
        c.push(slow_net_weights(11), "forge", tag="prod")
        yield c


def secret_file(path: Path, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return str(path)


def ready(worker: Worker) -> Worker:
    """Once the model is fully loaded: a cold start's answers are never cached."""
    deadline = time.monotonic() + 60
    while worker.health().get("state") != "ready":
        assert time.monotonic() < deadline, worker.health()
        time.sleep(0.1)
    return worker


def key_flags(tmp_path: Path) -> tuple[str, ...]:
    import worker.result_cache

    if not hasattr(worker.result_cache, "EntrySeal"):  # the code before issue 41 (no such flag): to see this test fail there
        return ()
    return ("--result-cache-key-file", secret_file(tmp_path / "result-cache.key", "k" * 44))


def test_a_forged_l2_entry_is_a_miss_counted_and_never_served(cluster: Cluster, tmp_path: Path) -> None:
    redis_server = RedisServer(tmp_path)
    rc = redis_server.client()
    worker = None
    try:
        worker = ready(Worker(cluster, "forge:prod", "--result-cache-redis", f"redis://127.0.0.1:{redis_server.port}/0",
                              "--result-cache-mb", "0", *key_flags(tmp_path), forward_s=0.0))  # no L1: every request asks Redis
        conn = worker.connection()
        a, b = [[1.0, 2.0, 3.0, 4.0]], [[-1.0, 0.5, 0.25, 8.0]]
        want_a, want_b = expected(slow_net_weights(11), a), expected(slow_net_weights(11), b)
        status, body, _ = post(conn, {"input": a})
        assert status == 200 and body["cache"] == "computed" and body["output"] == want_a
        assert post(conn, {"input": a})[1]["cache"] == "hit_l2"  # the worker's own entry verifies
        (key_a,) = rc.keys(VALUE_PREFIX + "*")
        status, body, _ = post(conn, {"input": b})
        assert status == 200 and body["output"] == want_b
        (key_b,) = set(rc.keys(VALUE_PREFIX + "*")) - {key_a}

        # 1. What a hostile or shared Redis answers: a well-formed entry it made up.
        forged = CachedResult(200, b'{"output":"X"}', 0.01, time.time() + 300).encode()
        rc.set(key_a, forged, px=300_000)
        status, body, _ = post(conn, {"input": a})
        assert status == 200 and body["output"] == want_a and body["cache"] == "computed", body
        # 2. A real entry of another request, moved under this key.
        rc.set(key_b, rc.get(key_a), px=300_000)
        status, body, _ = post(conn, {"input": b})
        assert status == 200 and body["output"] == want_b and body["cache"] == "computed", body
        # Counted; the forged value was replaced by a real one, served again from L2.
        assert worker.metrics()["pdparams_result_cache_l2_rejected_total"] >= 2
        assert rc.get(key_a) != forged
        status, body, _ = post(conn, {"input": a})
        assert status == 200 and body["cache"] == "hit_l2" and body["output"] == want_a
        conn.close()
    finally:
        if worker is not None:
            worker.stop()
        redis_server.stop()


def test_redis_without_the_key_file_is_refused_at_start(cluster: Cluster, tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as info:
        Worker(cluster, "forge:prod", "--result-cache-redis", "redis://127.0.0.1:1/0", shared_key=False)
    assert "--result-cache-key-file" in str(info.value) and "Traceback" not in str(info.value)


class TlsRedis:
    """redis-server on a TLS port only, with a password (in its 0600 config file, not its argv)."""

    def __init__(self, root: Path, password: str) -> None:
        ca = make_ca(root / "tls")
        server = issue(root / "tls", ca, "redis", hosts=["127.0.0.1"], server=True, client=False)
        self.ca = ca.cert
        self.port = free_port()
        conf = root / "redis.conf"
        secret_file(conf, "\n".join([
            "bind 127.0.0.1", "port 0", f"tls-port {self.port}", f"tls-cert-file {server.cert}",
            f"tls-key-file {server.key}", f"tls-ca-cert-file {ca.cert}", "tls-auth-clients no",
            f"requirepass {password}", 'save ""', "appendonly no", f"dir {root}",
        ]))
        exe = shutil.which("redis-server")
        assert exe is not None
        self.proc = subprocess.Popen([exe, str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def client(self, password: str) -> Any:
        import redis

        c = redis.Redis(host="127.0.0.1", port=self.port, ssl=True, ssl_ca_certs=str(self.ca), password=password,
                        socket_timeout=10)
        deadline = time.monotonic() + 20
        while True:
            try:
                c.ping()
                return c
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    out = self.proc.stdout.read().decode() if self.proc.poll() is not None and self.proc.stdout else ""
                    pytest.skip(f"this redis-server does not start with TLS: {out[-500:]}")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def test_rediss_with_the_password_from_a_file(cluster: Cluster, tmp_path: Path) -> None:
    import redis

    password = "redis-password-" + "p" * 24
    server = TlsRedis(tmp_path, password)
    worker = None
    try:
        rc = server.client(password)
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, ssl=True, ssl_ca_certs=str(server.ca), socket_timeout=10)
        with pytest.raises(redis.AuthenticationError):  # the Redis really wants the password
            anonymous.get("x")
        url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={server.ca}"
        worker = ready(Worker(cluster, "forge:prod", "--result-cache-redis", url, "--result-cache-mb", "0",
                              *key_flags(tmp_path), "--result-cache-redis-password-file",
                              secret_file(tmp_path / "redis.password", password), forward_s=0.0))
        conn = worker.connection()
        x = [[0.5, 0.5, 0.5, 0.5]]
        first = post(conn, {"input": x})[1]
        second = post(conn, {"input": x})[1]
        assert (first["cache"], second["cache"]) == ("computed", "hit_l2") and first["output"] == second["output"]
        assert rc.keys(VALUE_PREFIX + "*")
        assert worker.metrics()["pdparams_result_cache_l2_errors_total"] == 0
        assert password not in " ".join(worker.proc.args)  # type: ignore[arg-type]
        conn.close()
    finally:
        if worker is not None:
            worker.stop()
        server.stop()
