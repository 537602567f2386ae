"""worker.admission.Refuser: a connection past the cap reads its whole 503, never a reset."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from worker.admission import TOO_MANY_CONNECTIONS, Refuser


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s


def refused_connection(listener: socket.socket, refuser: Refuser, request: bytes) -> socket.socket:
    client = socket.create_connection(listener.getsockname(), timeout=5)
    client.sendall(request)  # in the server's receive buffer, unread, when the server answers
    server_side, _ = listener.accept()
    time.sleep(0.05)
    refuser.refuse(server_side)
    return client


def wait_drained(refuser: Refuser, within: float) -> None:
    """Until the refuser holds no socket, for at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while refuser.draining and time.monotonic() < deadline:
        time.sleep(0.02)


def read_all(client: socket.socket) -> bytes:
    answer = b""
    while chunk := client.recv(65536):  # a reset here would raise ConnectionResetError
        answer += chunk
    return answer


def test_a_refused_client_with_its_request_unread_gets_the_whole_503_then_eof(listener: socket.socket) -> None:
    refuser = Refuser(linger_s=2.0)
    request = b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100_000
    clients = [refused_connection(listener, refuser, request) for _ in range(3)]
    try:
        for c in clients:
            c.shutdown(socket.SHUT_WR)  # the client is done: the server closes before its linger ends
            assert read_all(c) == TOO_MANY_CONNECTIONS
        wait_drained(refuser, 1.5)
        assert refuser.draining == 0
    finally:
        for c in clients:
            c.close()


def test_a_client_that_never_finishes_is_closed_after_the_linger(listener: socket.socket) -> None:
    refuser = Refuser(linger_s=0.3)
    client = refused_connection(listener, refuser, b"GET / HTTP/1.1\r\n")  # no end, no FIN
    try:
        assert client.recv(len(TOO_MANY_CONNECTIONS)) == TOO_MANY_CONNECTIONS
        t0 = time.monotonic()
        while refuser.draining and time.monotonic() - t0 < 2:
            time.sleep(0.02)
        assert refuser.draining == 0 and 0.1 < time.monotonic() - t0 < 1.5
    finally:
        client.close()


def test_past_max_draining_a_refused_connection_is_closed_at_once(listener: socket.socket) -> None:
    refuser = Refuser(linger_s=5.0, max_draining=1)
    first = refused_connection(listener, refuser, b"GET / HTTP/1.1\r\n")
    second = refused_connection(listener, refuser, b"GET / HTTP/1.1\r\n")
    try:
        assert refuser.draining == 1
        assert second.recv(len(TOO_MANY_CONNECTIONS)) == TOO_MANY_CONNECTIONS  # still answered, then closed
    finally:
        first.close()
        second.close()


def test_a_failed_drain_thread_lets_the_next_refusal_start_another(listener: socket.socket) -> None:
    calls = [0]

    def clock() -> float:  # the drain thread's first look at the clock fails, once
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("clock gone")
        return time.monotonic()

    refuser = Refuser(linger_s=0.3, clock=clock)
    first = refused_connection(listener, refuser, b"GET / HTTP/1.1\r\n\r\n")
    try:
        assert first.recv(len(TOO_MANY_CONNECTIONS)) == TOO_MANY_CONNECTIONS
        wait_drained(refuser, 2)
        assert refuser.draining == 0  # what the failed thread held is closed
        second = refused_connection(listener, refuser, b"GET / HTTP/1.1\r\n")
        try:
            assert second.recv(len(TOO_MANY_CONNECTIONS)) == TOO_MANY_CONNECTIONS
            wait_drained(refuser, 2)
            assert refuser.draining == 0  # a new thread drained it after its linger
        finally:
            second.close()
    finally:
        first.close()
