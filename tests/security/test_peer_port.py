"""The peer port under attack (worker.peer_port): tokens, garbage, connection caps, stalled readers.

Everything runs against a real PeerPort in this process on 127.0.0.0/8 (127.0.0.2 is another
source address), bounded in count and time.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from chunking.hashing import content_id
from paramserver.client.bulk_transport import BulkClient, BulkPool, BulkProtocolFailure, BulkUnauthenticated
from paramserver.wire import bulk_frames as bf
from tests.peer_helpers import chunks, loading
from worker.peer_port import PeerPort, PeerPortConfig
from worker.peer_shelf import PeerShelf

TOKEN = "cluster-read-token"
MiB = 1 << 20


@pytest.fixture
def shelf() -> PeerShelf:
    return PeerShelf(None)


def served(shelf: PeerShelf, n: int = 3, size: int = 10_000) -> tuple[list[str], list[bytes]]:
    datas = chunks(n, size=size, seed=n)
    m, _, _ = loading(shelf, datas, list(range(n)))
    return list(m.chunks.ids), datas


def reads_fine(port: PeerPort, ids: list[str], datas: list[bytes]) -> bool:
    client = BulkClient(port.address, TOKEN)
    try:
        return [bytes(i.data) for i in client.fetch(ids) if i.status == bf.OK] == datas
    finally:
        client.close()


def dial(port: PeerPort, source: str = "127.0.0.1", timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port.port), timeout=timeout, source_address=(source, 0))
    sock.settimeout(timeout)
    return sock


def welcome(sock: socket.socket) -> tuple[int, str]:
    head = bf.recv_bytes(sock, bf.WELCOME.size)
    magic, status, n = bf.WELCOME.unpack(head)
    assert magic in (bf.MAGIC, bf.WRITE_MAGIC)
    return status, bf.recv_bytes(sock, n).decode()


@pytest.fixture
def port(shelf: PeerShelf) -> Iterator[PeerPort]:
    with PeerPort(shelf, PeerPortConfig(hello_timeout_s=1.0, max_connections_per_source=4, max_connections=16,
                                        peer_wait_s=1.0), TOKEN) as p:
        yield p


@pytest.mark.parametrize("token", [None, "", "wrong-token", TOKEN + "x"])
def test_no_or_wrong_token_is_refused_with_one_line(shelf: PeerShelf, port: PeerPort, token: str | None) -> None:
    ids, _ = served(shelf)
    with pytest.raises(BulkUnauthenticated) as refused:
        list(BulkPool(token).client(port.address).fetch(ids))  # type: ignore[union-attr]
    message = str(refused.value)
    assert "read token" in message and "\n" not in message
    assert ("no token was sent" if not token else "the token sent is wrong") in message
    assert TOKEN not in message and (not token or token not in message)
    sock = dial(port)  # the raw answer: status 1, then the port closes
    sock.sendall(bf.encode_hello(token))
    assert welcome(sock)[0] == bf.W_UNAUTHENTICATED
    assert sock.recv(1) == b""
    assert port.refused["unauthenticated"] == 2  # the client (which does not retry a refused token), the raw hello
    assert port.served_chunks == 0


def test_a_port_without_a_token_serves_any_reader(shelf: PeerShelf) -> None:
    ids, datas = served(shelf)
    with PeerPort(shelf, PeerPortConfig(), None) as open_port:
        client = BulkClient(open_port.address, "anything")
        assert [bytes(i.data) for i in client.fetch(ids)] == datas
        client.close()


GARBAGE_HELLOS = [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not our protocol
    bf.HELLO.pack(bf.MAGIC, 99, 0),  # unknown version
    bf.HELLO.pack(bf.MAGIC, 3, 65535) + b"x" * 100,  # a token over the limit
    bf.HELLO.pack(bf.WRITE_MAGIC, 1, len(TOKEN)) + TOKEN.encode(),  # a write session: reads only here
    bf.HELLO.pack(bf.MAGIC, 3, 10) + b"shor",  # truncated token, then silence
    b"PDB",  # truncated hello
    os.urandom(64),
    b"",  # connect, send nothing
]


def test_garbage_hellos_do_not_crash_it(shelf: PeerShelf, port: PeerPort) -> None:
    ids, datas = served(shelf)
    socks = []
    for raw in GARBAGE_HELLOS:
        sock = dial(port)
        sock.sendall(raw)
        socks.append(sock)
    deadline = time.monotonic() + 5.0
    for sock in socks:  # every one is answered or closed within the hello timeout (1 s)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        sock.close()
    assert time.monotonic() < deadline
    assert port.refused["bad_hello"] >= 4 and port.refused["hello_timeout"] >= 2
    assert reads_fine(port, ids, datas)


def test_garbage_requests_do_not_crash_it(shelf: PeerShelf, port: PeerPort) -> None:
    ids, datas = served(shelf)

    def session() -> socket.socket:
        sock = dial(port)
        sock.sendall(bf.encode_hello(TOKEN))
        assert welcome(sock) == (bf.W_OK, "")
        return sock

    # too many ids: an ERROR batch, then the port closes
    sock = session()
    sock.sendall(struct.pack("<I", bf.MAX_IDS + 1))
    count, size = bf.BATCH.unpack(bf.recv_bytes(sock, bf.BATCH.size))
    status = bf.decode_header(bf.recv_bytes(sock, bf.HEADER.size))[0]
    assert count == 1 and status == bf.ERROR and "at most" in bf.recv_bytes(sock, size).decode()
    assert sock.recv(1) == b""
    # ids that are no content id anyone holds, random bytes: MISSING each, and the session goes on
    sock = session()
    sock.sendall(bf.REQUEST.pack(3) + os.urandom(3 * bf.ID_BYTES))
    count, size = bf.BATCH.unpack(bf.recv_bytes(sock, bf.BATCH.size))
    headers = bf.decode_headers(bf.recv_bytes(sock, count * bf.HEADER.size))
    bf.recv_bytes(sock, size)
    assert count == 3 and {h[0] for h in headers} == {bf.MISSING}
    sock.sendall(bf.REQUEST.pack(1) + bytes.fromhex(ids[0]))
    count, size = bf.BATCH.unpack(bf.recv_bytes(sock, bf.BATCH.size))
    assert bf.decode_header(bf.recv_bytes(sock, bf.HEADER.size))[0] == bf.OK
    assert bf.recv_bytes(sock, size) == datas[0]
    # a request cut short, a request of random bytes, a half-sent count: each ends its connection only
    for raw in (bf.REQUEST.pack(5) + os.urandom(40), os.urandom(4096), b"\x01\x00"):
        sock = session()
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)  # the port may have answered and closed already (4096 random bytes)
            sock.settimeout(5.0)
            while sock.recv(1 << 16):
                pass
        except (ConnectionResetError, BrokenPipeError, OSError) as exc:
            assert not isinstance(exc, TimeoutError), "the port held a garbage request open"
        sock.close()
    assert reads_fine(port, ids, datas)


def test_per_source_connection_cap(shelf: PeerShelf, port: PeerPort) -> None:
    ids, datas = served(shelf)
    held = []
    for _ in range(4):  # the cap (4) of welcomed connections from 127.0.0.1
        sock = dial(port)
        sock.sendall(bf.encode_hello(TOKEN))
        assert welcome(sock)[0] == bf.W_OK
        held.append(sock)
    over = dial(port)
    status, message = welcome(over)  # refused at accept: the source holds its cap
    assert status == bf.W_BAD_HELLO and "too many peer connections from this address" in message
    assert "\n" not in message
    with pytest.raises(BulkProtocolFailure):
        list(BulkClient(port.address, TOKEN).fetch(ids))
    # another source is not affected
    other = dial(port, "127.0.0.2")
    other.sendall(bf.encode_hello(TOKEN))
    assert welcome(other)[0] == bf.W_OK
    # one gone: room again
    held.pop().close()
    deadline = time.monotonic() + 5.0
    while port.connections > 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reads_fine(port, ids, datas)
    assert port.refused["per_source"] >= 1
    for sock in [*held, other, over]:
        sock.close()


def test_a_stalled_reader_does_not_block_others(shelf: PeerShelf) -> None:
    big_ids, _ = served(shelf, n=24, size=MiB)  # 24 MiB a request: more than the socket buffers hold
    ids, datas = served(shelf, n=5, size=200_000)
    config = PeerPortConfig(max_sessions=4, io_timeout_s=2.0, peer_wait_s=1.0)
    with PeerPort(shelf, config, TOKEN) as port:
        stalled = []
        for _ in range(3):  # three readers that ask for everything and never read
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port.port))
            sock.sendall(bf.encode_hello(TOKEN))
            assert welcome(sock)[0] == bf.W_OK
            sock.sendall(bf.encode_request(big_ids))
            stalled.append(sock)
        time.sleep(0.5)  # their sends are blocked by now
        results: list[bool] = []
        t0 = time.monotonic()
        readers = [threading.Thread(target=lambda: results.append(reads_fine(port, ids, datas))) for _ in range(3)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(10.0)
        assert results == [True, True, True]
        assert time.monotonic() - t0 < 1.5  # before the stalled ones are cut (io_timeout 2 s)
        # and the stalled ones are cut once a send has waited io_timeout_s
        deadline = time.monotonic() + 8.0
        while port.connections > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert port.connections == 0
        for sock in stalled:
            sock.close()
    assert content_id(datas[0]) == ids[0]


class FailingAccepts:
    """The listening socket, whose first accepts fail as they do when the process is out of file descriptors."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self.sock = sock
        self.failures = failures

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            self.failures -= 1
            raise OSError(24, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


def test_accept_errors_are_retried(shelf: PeerShelf) -> None:
    ids, datas = served(shelf)
    port = PeerPort(shelf, PeerPortConfig(), TOKEN)
    failing = FailingAccepts(port._sock, 3)  # type: ignore[arg-type]
    port._sock = failing  # type: ignore[assignment]
    with port:
        assert reads_fine(port, ids, datas)
    assert failing.failures == 0
