"""The gRPC gate's relay (paramserver.server.grpc_gate) in front of a plain unix echo server:
bytes both ways under backpressure, half-close, limits at accept, and the peer-name mapping."""
from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from paramserver.server.grpc_gate import PREFACE, SOCKET_NAME, GrpcGate
from paramserver.wire.conn_limits import ConnectionLimits


def _echo(listener: socket.socket, peers: list[str]) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        peers.append(conn.getpeername())

        def serve(c: socket.socket = conn) -> None:
            with c:
                while data := c.recv(1 << 16):
                    c.sendall(data)
                c.shutdown(socket.SHUT_WR)  # EOF passed on: the client's half-close came through

        threading.Thread(target=serve, daemon=True).start()


def _closed(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[tuple[GrpcGate, list[str]]]:
    backend = tmp_path / "b"
    backend.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(backend / SOCKET_NAME))
    listener.listen(64)
    peers: list[str] = []
    threading.Thread(target=_echo, args=(listener, peers), daemon=True).start()
    g = GrpcGate("127.0.0.1:0", str(backend), ConnectionLimits(per_source=2, total=3)).start()
    try:
        yield g, peers
    finally:
        g.stop()
        listener.close()
    assert not backend.exists()  # the gate removes its backend directory


def test_bytes_go_both_ways_under_backpressure_and_a_half_close_passes(gate: tuple[GrpcGate, list[str]]) -> None:
    g, peers = gate
    payload = os.urandom(24 << 20)  # far more than the socket buffers: the relay must hold back and resume
    with socket.create_connection(("127.0.0.1", g.port), timeout=20) as c:
        def send() -> None:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        got = hashlib.sha256()
        n = 0
        while data := c.recv(1 << 20):
            got.update(data)
            n += len(data)
        sender.join()
    assert n == len(payload) and got.digest() == hashlib.sha256(payload).digest()


def test_limits_at_accept_and_the_peer_mapping(gate: tuple[GrpcGate, list[str]]) -> None:
    g, peers = gate
    idle = [socket.create_connection(("127.0.0.1", g.port), timeout=5) for _ in range(3)]
    for s in idle:
        s.sendall(PREFACE)
    time.sleep(0.3)
    assert g.stats()["open"] == 3
    names = [(p if isinstance(p, str) else p.decode())[1:] for p in peers]  # abstract names: a NUL, then the name
    assert [g.source_of(f"unix-abstract:{n}") for n in names] == ["127.0.0.1"] * 3
    assert g.source_of("ipv4:127.0.0.1:5") is None and g.source_of("unix-abstract:nobody") is None
    # A fourth pushes out the oldest idle one (which sees its connection closed) ...
    with socket.create_connection(("127.0.0.1", g.port), timeout=5) as fourth:
        fourth.sendall(PREFACE + (5).to_bytes(3, "big") + bytes([1, 4, 0, 0, 0, 1]) + b"hdrs!")  # a HEADERS frame: a call
        assert fourth.recv(64).startswith(PREFACE)  # echoed through the gate
        assert _closed(idle[0])
        assert g.source_of(f"unix-abstract:{names[0]}") is None  # forgotten with its connection
        stats = g.stats()
        assert stats["evicted"] == 1 and stats["open"] == 3 and stats["idle"] == 2
    for s in idle:
        s.close()


def test_a_connection_the_server_ended_is_closed_even_if_the_client_never_does(tmp_path: Path) -> None:
    """gRPC closes a connection (its keepalive found the client dead, a handshake timeout): the gate
    closes the client's side too, rather than waiting for a FIN that a vanished client never sends."""
    backend = tmp_path / "b"
    backend.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(backend / SOCKET_NAME))
    listener.listen(4)
    g = GrpcGate("127.0.0.1:0", str(backend), ConnectionLimits()).start()
    try:
        with socket.create_connection(("127.0.0.1", g.port), timeout=5) as c:
            server_side, _ = listener.accept()
            server_side.sendall(b"bye")
            server_side.close()  # the server ends it; the client says nothing and never closes
            assert c.recv(16) == b"bye" and _closed(c)
            deadline = time.monotonic() + 5
            while g.stats()["open"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert g.stats()["open"] == 0
    finally:
        g.stop()
        listener.close()
