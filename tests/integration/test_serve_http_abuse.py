"""``paramworker serve`` against abusive HTTP clients, on a real 3-server cluster.

Slowloris (a request trickled a byte at a time is cut at its read deadline, so the connection slots
come back), request bodies bounded by a shared byte budget (503 with Retry-After, /healthz stays
fast), clients that vanish mid-request (no tracebacks in the log), and ``X-Pdparams-Want`` naming
another model (421) or a version the cluster lacks (404) on a worker with ``--other-versions``.
"""
from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import stop_process
from tests.integration.serve_models import slow_net_weights
from tests.integration.test_serve_cache import Worker, post
from tests.integration.test_worker_harness import REPO, Cluster, running_cluster

pytestmark = pytest.mark.integration

READ_DEADLINE_S = 4.0  # paramworker serve --request-read-timeout-s (default 10)
MAX_BODY = 4 << 20  # --max-body-bytes (default 64 MiB)
X = [[0.25, -1.0, 2.0, 0.5]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("serve-abuse")) as c:
        c.push(slow_net_weights(1), "abuse", tag="prod")
        yield c


def address(w: Worker) -> tuple[str, int]:
    host, port = w.address.rsplit(":", 1)
    return host, int(port)


def closed(s: socket.socket) -> bool:
    """True once the worker has closed ``s`` (EOF, a reset, or an answer followed by EOF)."""
    s.settimeout(0.02)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.mark.timeout(60)
def test_slowloris_request_is_cut_at_its_read_deadline_and_slots_come_back(
        cluster: Cluster, workers: list[Worker]) -> None:
    w = Worker(cluster, "abuse:prod", "--max-connections", "4", "--request-read-timeout-s", str(READ_DEADLINE_S))
    workers.append(w)
    request = b"a" * 1000  # a body trickled a byte at a time
    slow = [socket.create_connection(address(w), timeout=5) for _ in range(4)]
    for s in slow:  # whole headers: requests under way, never closed for a newcomer (issue 41)
        s.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    time.sleep(0.3)  # every slot taken: a fifth connection is answered 503, its request unread
    with socket.create_connection(address(w), timeout=5) as extra:
        extra.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        answer = b""
        while chunk := extra.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503") and b"too many open connections" in answer, answer
    started = time.monotonic()
    open_ = list(slow)
    pos = 0
    # One byte per connection every 0.5 s: far under the 30 s idle timeout, so before the read
    # deadline these held every slot for as long as they kept trickling.
    while open_ and time.monotonic() - started < READ_DEADLINE_S + 6:
        for s in list(open_):
            try:
                s.sendall(request[pos:pos + 1])
            except OSError:
                open_.remove(s)
                continue
            if closed(s):
                open_.remove(s)
        pos += 1
        time.sleep(0.5)
    took = time.monotonic() - started
    for s in slow:
        s.close()
    assert not open_, f"{len(open_)} trickling connections still open after {took:.1f} s"
    assert took < READ_DEADLINE_S + 4
    conn = w.connection()
    try:
        status, body, _ = post(conn, X)
    finally:
        conn.close()
    assert status == 200 and body["version"] == 1


@pytest.mark.timeout(60)
def test_request_bodies_share_a_byte_budget(cluster: Cluster, workers: list[Worker]) -> None:
    w = Worker(cluster, "abuse:prod", "--max-body-bytes", str(MAX_BODY))
    workers.append(w)
    length = MAX_BODY  # the largest body; the default budget is 4 of them
    part = b" " * (length - 1)
    stalled = [socket.create_connection(address(w), timeout=10) for _ in range(4)]

    def send(s: socket.socket) -> None:
        s.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(length).encode() + b"\r\n\r\n")
        s.sendall(part)  # one byte short: the worker waits for it (up to its read deadline)

    try:
        senders = [threading.Thread(target=send, args=(s,), daemon=True) for s in stalled]
        for t in senders:
            t.start()
        for t in senders:
            t.join(8)
        assert not any(t.is_alive() for t in senders), "the worker did not take the bodies in"
        # sendall returns with a few MiB still in socket buffers: give the worker a moment to read them
        until = time.monotonic() + 4
        while True:
            conn = w.connection()
            try:
                t0 = time.monotonic()
                status, body, headers = post(conn, X)
                took = time.monotonic() - t0
            finally:
                conn.close()
            if status != 200 or time.monotonic() > until:
                break
            time.sleep(0.2)
        assert status == 503, body
        assert int(headers["Retry-After"]) >= 1 and "overloaded" in body["error"]
        assert took < 3
        t0 = time.monotonic()
        assert w.health()["state"] == "ready"
        assert time.monotonic() - t0 < 1
    finally:
        for s in stalled:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the budget comes back with the connections
        conn = w.connection()
        try:
            status, body, _ = post(conn, X)
        finally:
            conn.close()
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200, body


def logging_worker(cluster: Cluster, ref: str, log: Path, *args: str) -> Worker:
    """A Worker whose combined stdout/stderr goes to ``log`` (test_serve_cache's Worker drains it away)."""
    w = Worker.__new__(Worker)
    with open(log, "w") as out:
        w.proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "serve", "--model", ref, "--factory", "tests.integration.serve_models:slow_net",
             "--cluster", cluster.seed, "--listen", "127.0.0.1:0", "--poll-s", "0.2", "--device", "cpu", "--cache-mb", "16",
             *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        first = log.read_text().partition("\n")
        if first[1]:
            if not first[0].startswith("LISTENING"):
                stop_process(w.proc)
                raise AssertionError(log.read_text()[-3000:])
            w.address = first[0].split()[1]
            return w
        if w.proc.poll() is not None:
            break
        time.sleep(0.1)
    stop_process(w.proc)
    raise AssertionError(log.read_text()[-3000:])


@pytest.mark.timeout(60)
def test_clients_that_vanish_mid_request_log_no_tracebacks(
        cluster: Cluster, workers: list[Worker], tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    w = logging_worker(cluster, "abuse:prod", log)
    workers.append(w)
    for _ in range(5):
        s = socket.create_connection(address(w), timeout=5)
        s.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n[[1,")
        time.sleep(0.1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        s.close()
    time.sleep(0.5)
    conn = w.connection()
    try:
        status, _, _ = post(conn, X)
    finally:
        conn.close()
    assert status == 200
    text = log.read_text()
    assert "Traceback" not in text and "ConnectionResetError" not in text, text[-3000:]


@pytest.mark.timeout(60)
def test_want_for_another_model_is_421_and_for_a_missing_version_404(
        cluster: Cluster, workers: list[Worker]) -> None:
    cluster.push(slow_net_weights(2), "foreign", tag="prod")
    cluster.push(slow_net_weights(3), "multi", tag="prod")
    cluster.push(slow_net_weights(4), "multi", tag="prod", parent=1)
    w = Worker(cluster, "multi:prod", "--other-versions", "2")
    workers.append(w)
    conn = w.connection()

    def want(ref: str) -> tuple[int, dict[str, object]]:
        conn.request("POST", "/infer", body=json.dumps(X).encode(), headers={"X-Pdparams-Want": ref})
        r = conn.getresponse()
        return r.status, json.loads(r.read())

    try:
        for _ in range(3):  # the same answer every time (a failed load leaves nothing behind)
            status, body = want("foreign@1")
            assert status == 421, body
            assert "foreign" in str(body["error"])
            status, body = want("multi@99")
            assert status == 404, body
        status, body = want("multi@1")  # another version of its own model still loads on demand
        assert status == 200 and body["version"] == 1 and body["model"] == "multi", body
        assert w.health()["version"] == 2
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_other_methods_and_malformed_requests_get_json_not_html(cluster: Cluster, workers: list[Worker]) -> None:
    """http.server answered PUT/HEAD/DELETE and malformed requests with an HTML error page."""
    w = Worker(cluster, "abuse:prod")
    workers.append(w)
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS"):
        conn = w.connection()
        try:
            conn.request(method, "/infer", body=b"[[1]]")
            r = conn.getresponse()
            assert r.status == 405 and r.getheader("Allow") == "GET, POST", (method, r.status)
            assert r.getheader("Content-Type") == "application/json"
            assert f"method {method} is not served here" in json.loads(r.read())["error"]
        finally:
            conn.close()
    conn = w.connection()
    try:
        conn.request("HEAD", "/healthz")
        r = conn.getresponse()
        assert r.status == 405 and r.read() == b""  # no body in an answer to HEAD
    finally:
        conn.close()
    for raw in (b"FROB /infer HTTP/1.1\r\nHost: x\r\n\r\n", b"GET\r\n\r\n", b"GET /x HTTP/9.9\r\n\r\n"):
        s = socket.create_connection(address(w), timeout=5)
        try:
            s.sendall(raw)
            data = b""
            while True:  # the worker closes the connection after the answer
                got = s.recv(65536)
                if not got:
                    break
                data += got
        finally:
            s.close()
        assert b"<html" not in data.lower(), data
        if data.startswith(b"HTTP/1"):
            head, _, body = data.partition(b"\r\n\r\n")
            assert b"application/json" in head, data
        else:
            body = data  # an HTTP/0.9-style request line gets the body alone
        assert "error" in json.loads(body), data
    assert "error" not in w.health()  # still serving

