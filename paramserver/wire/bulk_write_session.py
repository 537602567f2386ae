"""The writer's side of a bulk write session, shared by both bulk writers: a client's
``BulkWriter`` and a server forwarding a PUT to the next hop of a chain.

``open_write_session`` connects, says the write hello and reads the WELCOME: a socket ready for
PUTs, or a :class:`~paramserver.wire.errors.WriteSessionError` saying at which stage it failed
(each writer turns that into its own error). ``read_ack_frame`` waits for the next frame on the
session's reader socket and decodes it: the acks of one PUT (:class:`Acks`), or the ERROR frame
by which the server ended the session (:class:`SessionEnded`).
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from paramserver.wire.bulk_frames import (
    A_ACKS, ACK_HEAD, SOCKET_BUFFER_BYTES, W_OK, WELCOME, WRITE_MAGIC, decode_acks, encode_write_hello, recv_ack_frame,
    recv_exact,
)
from paramserver.wire.errors import WriteSessionError

Ack = tuple[int, str, int]  # (status, message, free_bytes), as the server sent it
_POLL_S = 1.0  # a reader waiting for acks looks this often whether it should stop


def open_write_session(address: str, host: str, port: int, token: str | None, *, connect_timeout_s: float,
                       io_timeout_s: float) -> socket.socket:
    """A write session to ``host:port`` (``address`` names it in errors), welcomed; its timeout is ``io_timeout_s``.

    Raises WriteSessionError: stage "connect", "handshake" or "refused" (with the welcome's status).
    """
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as exc:
        raise WriteSessionError(address, "connect", str(exc)) from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.settimeout(io_timeout_s)
        sock.sendall(encode_write_hello(token))
        head = bytearray(WELCOME.size)
        recv_exact(sock, memoryview(head))
        magic, status, n = WELCOME.unpack(head)
        message = bytearray(n)
        recv_exact(sock, memoryview(message))
        if magic != WRITE_MAGIC or status != W_OK:
            # A server that serves bulk reads only answers a read welcome ("bad magic").
            raise WriteSessionError(address, "refused", message.decode("utf-8", "replace"), status)
    except (OSError, EOFError) as exc:
        sock.close()
        raise WriteSessionError(address, "handshake", str(exc)) from None
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(frozen=True, slots=True)
class Acks:
    """The ACKS of one PUT: ``count`` chunks x ``replicas`` acks, chunk-major."""

    seq: int
    count: int
    replicas: int
    acks: list[Ack]


@dataclass(frozen=True, slots=True)
class SessionEnded:
    """The server's ERROR frame: it refused PUT ``seq`` and closed the session."""

    seq: int
    error_class: int  # E_MALFORMED, E_BUSY...
    message: str


def read_ack_frame(sock: socket.socket, frame_timeout_s: float, stop: Callable[[], bool]) -> Acks | SessionEnded | None:
    """The next frame on ``sock`` (a reader's own socket object: its timeout is changed here), or
    None once ``stop()`` is true while none is arriving (it is asked every second).

    Once a frame has begun, the rest must arrive within ``frame_timeout_s``. Raises EOFError when
    the server closed, OSError / TimeoutError as the socket does, ProtocolError for a frame this
    protocol does not allow.
    """
    head = bytearray(ACK_HEAD.size)
    hv = memoryview(head)
    while True:
        sock.settimeout(_POLL_S)  # an idle session waits for the next PUT; stalls are the senders' watch
        try:
            n = sock.recv_into(hv, ACK_HEAD.size)
        except TimeoutError:
            if stop():
                return None
            continue
        if n == 0:
            raise EOFError("closed by the server")
        frame = recv_ack_frame(sock, head, n, time.monotonic() + frame_timeout_s)
        if frame.kind != A_ACKS:
            return SessionEnded(frame.seq, frame.replicas, frame.messages.decode("utf-8", "replace"))
        return Acks(frame.seq, frame.count, frame.replicas, decode_acks(frame.items, frame.messages))


__all__ = ["Ack", "Acks", "SessionEnded", "open_write_session", "read_ack_frame"]
