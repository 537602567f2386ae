"""The router's registration and the worker's and router's HTTP ports under attack: real
``paramrouter`` and ``paramworker serve`` processes on a real 3-server cluster, 127.0.0.1 only.

- A forged beat naming an attacker's URL plus a leave of the real worker, sent with the cluster's
  read token, made every request go to the attacker; now both are refused and requests keep going
  to the real worker.
- A process with the worker token but not worker W's instance secret cannot leave for W or take its
  id, and a URL that does not answer ``GET /identity`` as the worker its beat names is not routed to.
- ``POST /prewarm`` without the admin token: 401 on the worker and on the router.
- ``ab -k`` (HTTP/1.0 keep-alive) against a worker and a router: 0 failures; HTTP/1.0 without
  keep-alive is answered and closed.
- Deeply nested JSON: 400 one-line JSON, never a 500 or a dropped connection.
- ``--listen`` off loopback without the port's credential: refused at start, exit 2, naming the flag.
"""
from __future__ import annotations

import http.client
import json
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import stop_process
from tests.integration.serve_models import slow_net_weights
from tests.integration.test_router import FACTORY, Proc, clean_env, request, wait_for
from tests.integration.test_worker_harness import REPO, Cluster, running_cluster

pytestmark = pytest.mark.integration

READ_TOKEN = "read-token-of-every-reader"
WORKER_TOKEN = "worker-token-only-workers-hold"
ADMIN_TOKEN = "admin-token-only-operators-hold"
X = {"input": [[0.25, -1.0, 2.0, 0.5]]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("router-auth")) as c:
        c.push(slow_net_weights(7), "hj", tag="prod")
        yield c


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokens")
    out = {}
    for name, value in (("read", READ_TOKEN), ("worker", WORKER_TOKEN), ("admin", ADMIN_TOKEN)):
        path = out[name] = root / f"{name}.token"
        path.write_text(value + "\n")
        path.chmod(0o600)
    return out


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in started:
            p.stop()


def router(cluster: Cluster, tmp_path: Path, procs: list[Proc], *args: str) -> Proc:
    r = Proc(["-m", "worker.router", "--listen", "127.0.0.1:0", "--cluster", cluster.seed, *args], tmp_path / "router.log",
             clean_env())
    procs.append(r)
    return r


def worker(cluster: Cluster, tmp_path: Path, procs: list[Proc], name: str, *args: str) -> Proc:
    w = Proc(["-m", "worker", "serve", "--model", "hj:prod", "--factory", FACTORY, "--cluster", cluster.seed,
              "--listen", "127.0.0.1:0", "--poll-s", "0.5", "--device", "cpu", "--cache-mb", "16", "--worker-id", name, *args],
             tmp_path / f"{name}.log", clean_env(PDPARAMS_TEST_FORWARD_S="0.001"))
    procs.append(w)
    return w


def routable(r: Proc) -> list[str]:
    return [w["worker_id"] for w in request(r.address, "GET", "/workers")[1]["workers"]
            if w["loaded"] and w.get("verified", True) and not w.get("failed")]


class Attacker:
    """The attacker's HTTP server: answers every /infer with output "X" (and counts them), and
    /identity with whatever ``identity`` says (None: 404)."""

    def __init__(self, identity: dict[str, Any] | None = None) -> None:
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if identity is None:
                    self._answer(404, {"error": "no"})
                else:
                    self._answer(200, identity)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.hits += 1
                self._answer(200, {"output": "X", "model": "hj", "version": 1})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def forged_beat(worker_id: str, url: str) -> dict[str, Any]:
    return {"worker_id": worker_id, "url": url, "serves": "hj:prod", "loaded": [{"model": "hj", "version": 1}],
            "queue": 0, "running": 0, "max_queue": 64}


def post(r: Proc, path: str, body: object, **headers: str) -> tuple[int, dict[str, Any]]:
    return request(r.address, "POST", path, body, headers=headers)


def infer_ten(r: Proc) -> list[tuple[int, str, object]]:
    out = []
    for i in range(10):
        host, port = r.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("POST", "/infer/hj:prod", body=json.dumps({"input": [[float(i), 1.0, 2.0, 3.0]], "cache": False}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            body = json.loads(resp.read())
            out.append((resp.status, resp.getheader("X-Pdparams-Worker") or "", body.get("output")))
        finally:
            conn.close()
    return out


# ------------------------------------------------------------------ hijack


@pytest.mark.timeout(120)
def test_a_forged_beat_and_leave_with_the_read_token_are_refused_and_requests_stay_with_the_real_worker(
        cluster: Cluster, tokens: dict[str, Path], tmp_path: Path, procs: list[Proc]) -> None:
    r = router(cluster, tmp_path, procs, "--token-file", str(tokens["read"]), "--worker-token-file", str(tokens["worker"]))
    worker(cluster, tmp_path, procs, "w-real", "--router", r.url, "--token-file", str(tokens["read"]),
           "--worker-token-file", str(tokens["worker"]))
    wait_for(lambda: routable(r) == ["w-real"], 60, "the real worker registered and verified")
    attacker = Attacker()
    try:
        # The attack of the issue: the read token (every reader holds it) on a beat naming the
        # attacker's URL, then a leave of the real worker. "a-evil" sorts first: routed, it wins ties.
        auth = {"Authorization": f"Bearer {READ_TOKEN}", "X-Pdparams-Instance": secrets.token_hex(32)}
        status, body = post(r, "/heartbeat", forged_beat("a-evil", attacker.url), **auth)
        assert status == 401 and "worker token" in body["error"] and "\n" not in body["error"], body
        status, body = post(r, "/leave", {"worker_id": "w-real"}, **auth)
        assert status == 401, body
        status, body = post(r, "/heartbeat", forged_beat("w-real", attacker.url), **auth)
        assert status == 401, body
        # another worker's credential (the worker token) without w-real's instance secret: 409
        other = {"Authorization": f"Bearer {WORKER_TOKEN}", "X-Pdparams-Instance": secrets.token_hex(32)}
        status, body = post(r, "/leave", {"worker_id": "w-real"}, **other)
        assert status == 409 and "another instance secret" in body["error"], body
        status, body = post(r, "/heartbeat", forged_beat("w-real", attacker.url), **other)
        assert status == 409, body
        answers = infer_ten(r)
        assert all(s == 200 and wid == "w-real" and out != "X" for s, wid, out in answers), answers
        assert attacker.hits == 0 and routable(r) == ["w-real"]
    finally:
        attacker.close()


@pytest.mark.timeout(120)
def test_another_process_cannot_leave_for_a_worker_and_a_url_that_does_not_answer_as_the_worker_is_not_routed(
        cluster: Cluster, tokens: dict[str, Path], tmp_path: Path, procs: list[Proc]) -> None:
    """A router without a worker token (loopback): what stops a local process is the binding of the
    id to the worker's instance secret and the check of the URL. (With the worker token the same
    holds for a holder of it that is not W.)"""
    r = router(cluster, tmp_path, procs)
    real = worker(cluster, tmp_path, procs, "w-real", "--router", r.url)
    wait_for(lambda: routable(r) == ["w-real"], 60, "the real worker registered and verified")
    attacker = Attacker(identity={"worker_id": "a-evil", "proof": "0" * 64})
    try:
        mine = {"X-Pdparams-Instance": secrets.token_hex(32)}
        # W's id, another secret: neither its leave nor a beat moving W to the attacker's URL is taken
        status, body = post(r, "/leave", {"worker_id": "w-real"}, **mine)
        assert status == 409 and "\n" not in body["error"], body
        status, body = post(r, "/heartbeat", forged_beat("w-real", attacker.url), **mine)
        assert status == 409, body
        # new ids whose URLs do not answer as them: one the attacker's (a wrong proof), one the real
        # worker's own URL (it answers, but as w-real under its own secret)
        for wid, url in (("a-evil", attacker.url), ("a-fake", real.url)):
            status, body = post(r, "/heartbeat", forged_beat(wid, url), **mine)
            assert status == 200, body

        def checked() -> bool:
            rows = {w["worker_id"]: w for w in request(r.address, "GET", "/workers")[1]["workers"]}
            return rows.keys() >= {"a-evil", "a-fake"} and not rows["a-evil"]["verified"] and not rows["a-fake"]["verified"]

        wait_for(checked, 10, "both forged workers listed as not verified")
        answers = infer_ten(r)
        assert all(s == 200 and wid == "w-real" and out != "X" for s, wid, out in answers), answers
        assert attacker.hits == 0
        r.stop()  # its log is complete once it has stopped
        log = wait_for(lambda: (lambda t: t if "a-fake" in t else None)((tmp_path / "router.log").read_text()), 10,
                       "the router's log")
        assert "'a-evil' is not routed to" in log and "'a-fake' is not routed to" in log, log[-2000:]
    finally:
        attacker.close()


# ------------------------------------------------------------------ pre-warm


@pytest.mark.timeout(120)
def test_prewarm_needs_the_admin_token_on_the_worker_and_on_the_router(
        cluster: Cluster, tokens: dict[str, Path], tmp_path: Path, procs: list[Proc]) -> None:
    r = router(cluster, tmp_path, procs, "--admin-token-file", str(tokens["admin"]))
    w = worker(cluster, tmp_path, procs, "w-warm", "--router", r.url, "--admin-token-file", str(tokens["admin"]))
    wait_for(lambda: routable(r) == ["w-warm"], 60, "the worker registered")
    for target, path, body in ((w, "/prewarm", {"model": "hj", "version": 1}),
                               (r, "/prewarm", {"ref": "hj@1", "workers": None})):
        for headers in ({}, {"Authorization": f"Bearer {READ_TOKEN}"}):
            status, answer = post(target, path, body, **headers)
            assert status == 401 and "admin token" in answer["error"] and "\n" not in answer["error"], (path, answer)
    assert request(w.address, "GET", "/healthz")[1]["prewarm"] == []  # nothing was fetched
    status, answer = post(r, "/prewarm", {"ref": "hj@1", "workers": None}, Authorization=f"Bearer {ADMIN_TOKEN}")
    assert status == 200 and answer["workers"] == [{"worker_id": "w-warm", "accepted": True}], answer
    status, answer = post(w, "/prewarm", {"model": "hj", "version": 1}, Authorization=f"Bearer {ADMIN_TOKEN}")
    assert status == 202, answer


# ------------------------------------------------------------------ HTTP conformance


def ab(url: str, body: Path) -> str:
    run = subprocess.run(["ab", "-k", "-n", "500", "-c", "8", "-s", "10", "-p", str(body), "-T", "application/json", url],
                         capture_output=True, text=True, timeout=60)
    return run.stdout + run.stderr


def http10(address: str, keep_alive: bool) -> tuple[bytes, bool]:
    """(the answer's head, whether the connection was closed after it) of an HTTP/1.0 GET /healthz."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\n" + (b"Connection: keep-alive\r\n" if keep_alive else b"") + b"\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        while len(rest) < length:
            rest += s.recv(65536)
        s.settimeout(1.0)
        try:
            closed = s.recv(1) == b""
        except TimeoutError:
            closed = False
        return head, closed


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("ab") is None, reason="ApacheBench (apache2-utils) is not installed")
def test_ab_keep_alive_completes_without_failures_on_the_worker_and_the_router(
        cluster: Cluster, tmp_path: Path, procs: list[Proc]) -> None:
    r = router(cluster, tmp_path, procs)
    w = worker(cluster, tmp_path, procs, "w-ab", "--router", r.url)
    wait_for(lambda: routable(r) == ["w-ab"], 60, "the worker registered")
    body = tmp_path / "body.json"
    body.write_text(json.dumps({**X, "cache": False}))  # every answer the same length: ab counts others as failed
    for target, url in ((w, f"{w.url}/infer"), (r, f"{r.url}/infer/hj:prod")):
        out = ab(url, body)
        assert re.search(r"Complete requests:\s+500\b", out) and re.search(r"Failed requests:\s+0\b", out), out[-1500:]
        assert re.search(r"Keep-Alive requests:\s+500\b", out), out[-1500:]
        assert not re.search(r"Non-2xx responses", out), out[-1500:]
        head, closed = http10(target.address, keep_alive=True)
        assert re.search(rb"(?i)\r\nconnection: keep-alive", head) and not closed, head
        head, closed = http10(target.address, keep_alive=False)
        assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0] and closed, head


@pytest.mark.timeout(120)
def test_deeply_nested_json_is_a_one_line_400_on_the_router_and_the_worker(
        cluster: Cluster, tokens: dict[str, Path], tmp_path: Path, procs: list[Proc]) -> None:
    r = router(cluster, tmp_path, procs, "--admin-token-file", str(tokens["admin"]))
    w = worker(cluster, tmp_path, procs, "w-nest", "--admin-token-file", str(tokens["admin"]))
    nested = b"[" * 200_000 + b"]" * 200_000
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    instance = {"X-Pdparams-Instance": secrets.token_hex(32)}
    cases = [(r, "/heartbeat", instance), (r, "/leave", instance), (r, "/prewarm", admin), (w, "/infer", {}), (w, "/prewarm", admin)]
    for target, path, headers in cases:
        host, port = target.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            body = nested if path != "/prewarm" or target is r else b"[" * 2000 + b"]" * 2000  # the worker's limit: 4 KiB
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        assert resp.status == 400, (path, resp.status, raw[:300])
        assert raw.count(b"\n") == 0 and isinstance(json.loads(raw)["error"], str), (path, raw[:300])
    # What never reaches the app (a request line that does not parse, headers past the limit) is
    # one-line JSON too (aiohttp's own answer was a multi-line text page).
    for target in (r, w):
        for garbage in (b"\x16\x03\x01 not http\r\n\r\n", b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"):
            status, body = raw_exchange(target.address, garbage)
            assert 400 <= status < 500, (target.address, status, body[:300])
            assert body.count(b"\n") == 0 and isinstance(json.loads(body)["error"], str), (target.address, body[:300])
    assert request(r.address, "GET", "/healthz")[0] == 200 and request(w.address, "GET", "/healthz")[0] == 200


def raw_exchange(address: str, data: bytes) -> tuple[int, bytes]:
    """Send ``data`` as it is; the answer's status and body (read to the close)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


# ------------------------------------------------------------------ listeners


def start_and_wait(args: list[str], timeout: float = 30.0) -> tuple[int | None, str]:
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env())
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out + err
    except subprocess.TimeoutExpired:
        stop_process(proc)
        return None, "still running"


@pytest.mark.timeout(120)
def test_listening_off_loopback_needs_the_ports_credential_or_insecure(tokens: dict[str, Path]) -> None:
    code, out = start_and_wait(["-m", "worker.router", "--listen", "0.0.0.0:0"])
    assert code == 2 and out.count("\n") == 1 and "--listen 0.0.0.0:0" in out and "--worker-token-file" in out \
        and "--insecure" in out, (code, out)
    code, out = start_and_wait(["-m", "worker.router", "--listen", "0.0.0.0:0", "--worker-token-file", str(tokens["worker"])])
    assert code == 2 and "--admin-token-file" in out, (code, out)
    code, out = start_and_wait(["-m", "worker", "serve", "--model", "hj:prod", "--factory", FACTORY, "--cluster",
                                "127.0.0.1:1", "--listen", "0.0.0.0:0", "--device", "cpu"])
    assert code == 2 and out.count("\n") == 1 and "--listen 0.0.0.0:0" in out and "--admin-token-file" in out, (code, out)
    # --insecure: it starts, with a warning naming what is open
    proc = subprocess.Popen([sys.executable, "-m", "worker.router", "--listen", "0.0.0.0:0", "--insecure"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("LISTENING")
        assert proc.stderr is not None and "running open (--insecure)" in proc.stderr.readline()
    finally:
        stop_process(proc)
