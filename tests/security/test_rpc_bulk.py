"""The bulk read port cannot be filled by silent sockets (issue 11, weaker point).

It waited 30 s for each hello with no per-client cap, so 64 silent sockets (its connection
limit) shut every other client out. Now one client address holds at most 16 connections, the
whole hello must arrive within 5 s (a slow drip of bytes does not extend it), and refusals are
logged at WARNING with the address. A real one-server cluster (deploy.local); the "attacker"
connects from 127.0.0.2 and 127.0.0.3, the honest client from 127.0.0.1.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest

from chunking.hashing import content_id
from deploy.local import LocalCluster
from tests.conftest import local_cluster
from paramserver.client.bulk_transport import BulkClient
from paramserver.client.rpc import ParamServerClient, make_chunk
from paramserver.server.bulk_port import BulkServerConfig
from paramserver.wire.bulk_frames import HELLO, MAGIC, OK, VERSION, W_BAD_HELLO, WELCOME

ADMIN, READ, SECRET = "admin-token-bulk", "read-token-bulk", "cluster-secret-bulk-0123456789"
DEFAULTS = BulkServerConfig()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("rpc-bulk")
    with local_cluster(root, servers=1, admin_token=ADMIN, read_token=READ, secret=SECRET, extra_args=("--no-fsync",)) as c:
        yield c


@pytest.fixture(scope="module")
def bulk_address(cluster: LocalCluster) -> str:
    with ParamServerClient(cluster.addresses[0], token=READ) as c:
        address = c.cluster_info().members[0].bulk_address
    assert address
    return address


def connect_from(source: str, address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.settimeout(5)
    s.connect((host, int(port)))
    return s


def state(s: socket.socket, wait: float) -> str:
    """"open" (nothing to read within ``wait``), "closed", or "refused: <message>"."""
    s.settimeout(wait)
    try:
        head = s.recv(WELCOME.size)
    except TimeoutError:
        return "open"
    except ConnectionError:
        return "closed"
    if not head:
        return "closed"
    magic, status, n = WELCOME.unpack(head.ljust(WELCOME.size, b"\0"))
    message = s.recv(n).decode(errors="replace") if n else ""
    return f"refused: {message}" if magic == MAGIC and status == W_BAD_HELLO else f"status {status}: {message}"


def test_silent_sockets_cannot_fill_the_port(cluster: LocalCluster, bulk_address: str) -> None:
    data = os.urandom(50_000)
    cid = content_id(data)
    with ParamServerClient(cluster.addresses[0], token=ADMIN) as admin:
        admin.put_chunks([make_chunk(cid, data)])
    silent = [connect_from("127.0.0.2", bulk_address) for _ in range(64)]
    try:
        time.sleep(0.5)
        states = [state(s, 0.05) for s in silent]  # the refused have their answer by now
        refused = [x for x in states if x.startswith("refused")]
        assert states.count("open") == DEFAULTS.max_per_ip, states
        assert len(refused) == 64 - DEFAULTS.max_per_ip and "from this address" in refused[0]
        # An honest client on another address is served over the bulk port meanwhile.
        client = BulkClient(bulk_address, token=READ)
        try:
            items = list(client.fetch([cid]))
        finally:
            client.close()
        assert items[0].status == OK and bytes(items[0].data) == data
        # The silent ones are closed once the hello timeout has passed.
        deadline = time.monotonic() + DEFAULTS.hello_timeout_s + 5
        still = [s for s, st in zip(silent, states) if st == "open"]
        while still and time.monotonic() < deadline:
            still = [s for s in still if state(s, 0.2) == "open"]
        assert not still, f"{len(still)} silent connections still open after {DEFAULTS.hello_timeout_s + 5:.0f} s"
    finally:
        for s in silent:
            s.close()
    log = Path(cluster.slots[0].log_file).read_text()
    assert "bulk connection refused: address=127.0.0.2:" in log and "reason=per_ip_limit" in log
    assert "reason=hello_timeout" in log
    assert sum("reason=per_ip_limit" in line for line in log.splitlines()) < 10  # rate-limited, not 48 lines


def test_a_hello_dripped_byte_by_byte_is_cut_off(bulk_address: str) -> None:
    s = connect_from("127.0.0.3", bulk_address)
    hello = HELLO.pack(MAGIC, VERSION, 4) + b"abcd"
    started = time.monotonic()
    cut = None
    try:
        for byte in hello:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                cut = time.monotonic() - started
                break
            if state(s, 0.8) != "open":
                cut = time.monotonic() - started
                break
    finally:
        s.close()
    assert cut is not None and cut < DEFAULTS.hello_timeout_s + 3, f"a {len(hello)}-byte hello dripped over {cut} s was accepted"
