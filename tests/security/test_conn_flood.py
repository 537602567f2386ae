"""Connection floods: connections that only connect (or only send a handshake) cannot lock clients out.

Issue 41: 4,200 TCP connections to a server's ``--listen`` port, each sending only the HTTP/2 preface
and an empty SETTINGS frame (no token needed), held gRPC's whole connection quota, and every new
client got UNAVAILABLE for about a minute. Now the gRPC port's gate (paramserver.server.grpc_gate)
caps connections per source address and in total, evicting connections that have not made a call
first; the HTTP fronts of the worker and the router do the same with connections that have not
sent a complete request.

Real processes (a ``deploy.local`` cluster, ``paramctl``, ``paramrouter``), real gRPC, 127.0.0.0/8
only; every flood is bounded in count and time.
"""
from __future__ import annotations

import http.client
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.rpc import ClientConfig, ParamServerClient

pytestmark = pytest.mark.integration

ADMIN, READ = "flood-admin-token-0123", "flood-read-token-0123"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS frame
FLOOD = 4_200  # the count: past gRPC's own total cap of 4,096
FLOOD_SECONDS = 90.0  # a flood never outlives this
CLIENT_ENVS = ("PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_TLS_CA", "PARAMS_TLS_CERT", "PARAMS_TLS_KEY",
               "PARAMS_VERIFY", "PARAMS_CONFIG")


def _room_for(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the flood needs {want} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class Flood:
    """Holds up to ``count`` connections from ``source`` to ``port``, each sent ``hello`` and then
    nothing; the ones the server closes are opened again (an attacker keeps the pressure on), at most
    ``rate`` a second, until stopped or ``FLOOD_SECONDS`` are up."""

    def __init__(self, port: int, count: int, hello: bytes, source: str = "127.0.0.1", rate: int = 3000) -> None:
        self.port, self.count, self.hello, self.source, self.rate = port, count, hello, source, rate
        self.opened = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def wait_opened(self, n: int, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while self.opened < n and time.monotonic() < end:
            time.sleep(0.1)
        assert self.opened >= n, f"the flood opened only {self.opened} connections"

    def _open(self) -> socket.socket | None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((self.source, 0))
            s.settimeout(2.0)
            s.connect(("127.0.0.1", self.port))
            s.sendall(self.hello)
            s.setblocking(False)
        except OSError:
            s.close()
            self.failed += 1
            return None
        self.opened += 1
        return s

    def _run(self) -> None:
        held = selectors.DefaultSelector()
        end = time.monotonic() + FLOOD_SECONDS
        try:
            while not self._stop.is_set() and time.monotonic() < end:
                started = time.monotonic()
                for key, _ in held.select(0):  # readable: the server's bytes, or its close
                    s = key.fileobj
                    assert isinstance(s, socket.socket)
                    try:
                        if s.recv(65536):
                            continue
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    held.unregister(s)
                    s.close()
                batch = min(self.count - len(held.get_map()), self.rate // 10)
                for _ in range(batch):
                    s = self._open()
                    if s is not None:
                        held.register(s, selectors.EVENT_READ)
                self._stop.wait(max(0.0, 0.1 - (time.monotonic() - started)))
        finally:
            for key in list(held.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            held.close()


class Forwarder:
    """A local port that relays to ``target`` from ``source``: a gRPC client from another address
    (grpcio cannot bind a client's source address)."""

    def __init__(self, target: tuple[str, int], source: str) -> None:
        self.target, self.source = target, source
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            out = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            out.bind((self.source, 0))
            out.connect(self.target)
            for a, b in ((conn, out), (out, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()


def _env(cluster: LocalCluster) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in CLIENT_ENVS}
    out["PARAMS_CONFIG"] = str(cluster.client_config_path)
    return out


def _paramctl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], env=_env(cluster),
                          capture_output=True, text=True, timeout=120)


def _first_call_seconds(address: str) -> float:
    """Seconds a new client takes from its channel's creation to its first answer."""
    t0 = time.monotonic()
    with ParamServerClient(ClientConfig(address, token=READ, timeout_s=10)) as client:
        assert client.server_status().server_id
    return time.monotonic() - t0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(LocalClusterConfig(root=tmp_path_factory.mktemp("flood"), servers=1, replication=1, admin_token=ADMIN,
                                        read_token=READ, extra_args=("--no-fsync",)))
    try:
        c.up(wait=90)
        yield c
    finally:
        c.down()


def test_a_preface_flood_from_one_address_locks_no_client_out(cluster: LocalCluster, tmp_path: Path) -> None:
    _room_for(FLOOD + 512)
    slot = cluster.slots[0]
    host, _, port_text = slot.grpc.rpartition(":")
    port = int(port_text)
    g = torch.Generator().manual_seed(41)
    model = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(512, 512, generator=g), "b": torch.randn(512, generator=g)}, str(model))
    base_fds = _fds(slot.pid)
    forwarder = Forwarder((host, port), "127.0.0.2")
    try:
        with Flood(port, FLOOD, PREFACE) as flood:
            flood.wait_opened(FLOOD)
            time.sleep(1.0)  # the server has taken them all in
            # A new client from the flood's own address, and one from another, get an answer at once.
            same = _first_call_seconds(slot.grpc)
            other = _first_call_seconds(forwarder.address)
            assert same < 2.0 and other < 2.0, (same, other)
            # A client pushes and pulls (bit-exact) while the flood goes on.
            pushed = _paramctl(cluster, "push", str(model), "--model", "flooded", "--tag", "prod", "--no-progress")
            assert pushed.returncode == 0, pushed.stderr
            out = tmp_path / "pulled.safetensors"
            pulled = _paramctl(cluster, "pull", "flooded:prod", "--out", str(out), "--no-bulk", "--no-progress")
            assert pulled.returncode == 0, pulled.stderr
            back, want = load_file(str(out)), load_file(str(model))
            assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want)
            assert _first_call_seconds(slot.grpc) < 2.0
            assert flood.opened > FLOOD, "the server closed none of the flood's connections"
            with ParamServerClient(ClientConfig(slot.grpc, token=READ, timeout_s=10)) as client:
                extra = client.server_status().extra
            limit = int(extra["grpc_connections_limit"])
            assert limit < FLOOD and int(extra["grpc_connections_open"]) <= limit, dict(extra)
            assert int(extra["grpc_connections_evicted"]) >= FLOOD - limit, dict(extra)
            # The flood holds at most the descriptors budgeted for connections (three each through the gate).
            held = _fds(slot.pid) - base_fds
            assert held < 3 * limit + 200, f"the flood holds {held} of the server's file descriptors (limit {limit})"
    finally:
        forwarder.close()
    assert _first_call_seconds(slot.grpc) < 2.0


# ---------------------------------------------------------------- HTTP: the router and the worker's front


def _get_healthz(address: str, source: str) -> tuple[int, float]:
    host, port = address.rsplit(":", 1)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        response.read()
        return response.status, time.monotonic() - t0
    finally:
        conn.close()


def test_an_http_flood_from_one_address_locks_no_client_out_of_the_router(tmp_path: Path) -> None:
    """2,000 connections that send a request line and then nothing, against a router capped at 1,024:
    before, every new client was answered 503 for as long as the flood lasted."""
    _room_for(2_000 + 512)
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENVS + ("PARAMS_ROUTER",)}
    proc = subprocess.Popen([sys.executable, "-m", "worker.router", "--listen", "127.0.0.1:0", "--max-connections", "1024"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("LISTENING"), line + proc.stdout.read()[-2000:]
        address = line.split()[1]
        port = int(address.rsplit(":", 1)[1])
        with Flood(port, 2_000, b"GET /healthz HTTP/1.1\r\n") as flood:
            flood.wait_opened(2_000)
            time.sleep(1.0)
            for source in ("127.0.0.1", "127.0.0.2", "127.0.0.1"):
                status, took = _get_healthz(address, source)
                assert status == 200 and took < 2.0, (source, status, took)
            assert flood.opened > 2_000, "the router closed none of the flood's connections"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _status_line(s: socket.socket) -> bytes:
    """The status line of one whole answer read from ``s`` (headers, then Content-Length bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += s.recv(4096)
    return head.split(b"\r\n")[0]


def test_an_http_flood_locks_no_client_out_of_the_worker_front() -> None:
    """The worker's HTTP front (worker.serve_http.HTTPFront, one thread per connection): connections
    that never send a whole request give way to a client; ones that did are kept, and past them a
    newcomer gets a 503."""
    from http.server import BaseHTTPRequestHandler

    from worker.serve_http import HTTPFront

    class Hello(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: object) -> None:
            pass

    front = HTTPFront(("127.0.0.1", 0), Hello, max_connections=32, per_source=16)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{front.server_address[1]}"
    try:
        with Flood(front.server_address[1], 200, b"GET /healthz HTTP/1.1\r\n") as flood:
            flood.wait_opened(200)
            time.sleep(0.5)
            for source in ("127.0.0.1", "127.0.0.2"):
                status, took = _get_healthz(address, source)
                assert status == 200 and took < 2.0, (source, status, took)
            assert front.open_connections() <= 32 and front.evicted > 100
        # Connections that made a request are kept: 16 from one address fill its share, and the
        # next from that address is answered 503 (not one of the 16 cut).
        kept = [socket.create_connection(("127.0.0.1", front.server_address[1]), timeout=5) for _ in range(16)]
        try:
            for s in kept:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _status_line(s) == b"HTTP/1.1 200 OK"
            with socket.create_connection(("127.0.0.1", front.server_address[1]), timeout=5) as extra:
                extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _status_line(extra).startswith(b"HTTP/1.1 503")
            for s in kept:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _status_line(s) == b"HTTP/1.1 200 OK"
        finally:
            for s in kept:
                s.close()
    finally:
        front.shutdown()
        front.server_close()
