"""Client of the bulk write protocol (write sessions of paramserver.wire.bulk_frames).

A :class:`BulkWriter` is one authenticated write session to one server's bulk port. ``put``
sends one PUT (a batch of chunks) with a single ``sendmsg`` of the head and the chunks' own
buffers (no copy in Python, one copy into the kernel) and returns at once; a reader thread
receives the ACKS, in PUT order, and hands each to ``on_acks``. At most ``window`` PUTs are
unacknowledged at a time: ``put`` blocks while the window is full, which is the backpressure a
slow server puts on the producer. Any failure of the connection (refused hello, reset, an
ERROR frame, no ack within ``ack_timeout_s``) is a :class:`BulkWriteError` carrying the gRPC
status code it corresponds to, so callers treat both transports alike; the PUTs not yet
acknowledged stay available (``unacked``) for a fallback to send them elsewhere.
"""
from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from paramserver.client.bulk_transport import split_address
from paramserver.client.errors import BulkWriteError, BulkWriteRefused
from paramserver.wire.bulk_frames import (
    ACK_NAMES,
    DEFAULT_WRITE_WINDOW,
    E_BUSY,
    MAX_PUT_ITEMS,
    PUT_HEAD,
    W_UNAUTHENTICATED,
    ProtocolError,
    encode_put,
    encode_route,
    send_all,
)
from paramserver.wire.bulk_write_session import Ack, SessionEnded, open_write_session, read_ack_frame
from paramserver.wire.errors import WriteSessionError



class WriteBatch:
    """One PUT: its chunks (any objects; the caller's), where it goes, and when it was sent."""

    __slots__ = ("seq", "chunks", "nbytes", "route", "payload")

    def __init__(self, seq: int, chunks: Sequence[Any], nbytes: int, route: tuple[str, ...], payload: object = None) -> None:
        self.seq = seq
        self.chunks = chunks
        self.nbytes = nbytes
        self.route = route  # the servers after the first, in chain order (empty: this server only)
        self.payload = payload  # the caller's own bookkeeping


OnAcks = Callable[[WriteBatch, list[Ack], int], None]  # (batch, acks chunk-major, replicas per chunk)


class BulkWriter:
    """One write session; ``put`` from one thread at a time, acks on the session's reader thread."""

    def __init__(self, address: str, token: str | None, on_acks: OnAcks, *, window: int = DEFAULT_WRITE_WINDOW,
                 connect_timeout_s: float = 3.0, io_timeout_s: float = 30.0, ack_timeout_s: float = 120.0,
                 on_change: Callable[[], None] | None = None) -> None:
        self.address = address
        self.window = max(1, window)
        self.io_timeout_s = io_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self._on_acks = on_acks
        self._on_change = on_change or (lambda: None)
        self.error: BulkWriteError | None = None
        self.acked_batches = 0
        self.sent_bytes = 0
        self._seq = 0
        self._inflight: deque[WriteBatch] = deque()
        self._last_progress = time.monotonic()
        self._cond = threading.Condition()
        self._closed = False
        self.sock = self._connect(token, connect_timeout_s)
        # The reader has its own socket object: timeouts are per object, and the sender's stays io_timeout_s.
        self._rsock = self.sock.dup()
        self._sendq: deque[tuple[WriteBatch, list[bytes | bytearray | memoryview]]] = deque()
        self._reader = threading.Thread(target=self._read, name=f"bulk-acks-{address}", daemon=True)
        self._reader.start()
        # Sends on their own thread: a producer feeding several servers is never stuck in one slow
        # server's sendmsg while the others run dry (the window bounds what waits here).
        self._sender = threading.Thread(target=self._send_loop, name=f"bulk-send-{address}", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------ connection

    def _connect(self, token: str | None, connect_timeout_s: float) -> socket.socket:
        address = self.address
        try:
            host, port = split_address(address)
        except Exception as exc:  # noqa: BLE001 - BulkUnavailable from the read side: same meaning
            raise BulkWriteRefused(address, str(exc), grpc.StatusCode.UNAVAILABLE) from None
        try:
            return open_write_session(address, host, port, token, connect_timeout_s=connect_timeout_s,
                                      io_timeout_s=self.io_timeout_s)
        except WriteSessionError as exc:
            if exc.stage == "connect":
                raise BulkWriteRefused(address, f"cannot connect: {exc.detail}", grpc.StatusCode.UNAVAILABLE) from None
            if exc.stage == "handshake":
                raise BulkWriteRefused(address, f"handshake failed: {exc.detail}", grpc.StatusCode.UNAVAILABLE) from None
            if exc.status == W_UNAUTHENTICATED:
                raise BulkWriteRefused(address, exc.detail, grpc.StatusCode.UNAUTHENTICATED) from None
            # A server that serves bulk reads only answers a read welcome ("bad magic").
            raise BulkWriteRefused(address, exc.detail or f"welcome status {exc.status}", grpc.StatusCode.UNIMPLEMENTED) from None

    def close(self, goodbye: bool = False) -> None:
        """End the session. ``goodbye``: tell the server first (after every ack arrived)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self.error is None:
                self.error = BulkWriteError(self.address, "session closed", grpc.StatusCode.CANCELLED)
            self._cond.notify_all()
        if goodbye and threading.current_thread() is not self._sender:
            self._sender.join(timeout=5)  # it stops once the closed flag is set and nothing is queued
            try:
                self.sock.sendall(PUT_HEAD.pack(0, 0, 0, 0))
            except OSError:
                pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        me = threading.current_thread()
        for t in (self._reader, self._sender):
            if t is not me:
                t.join(timeout=5)
        self._rsock.close()

    # ------------------------------------------------------------ sending

    def put(self, chunks: Sequence[Any], items: Sequence[bytes], payloads: Sequence[bytes | bytearray | memoryview], nbytes: int,
            route: Sequence[str] = (), route_addresses: Sequence[str] = (), payload: object = None,
            abort: threading.Event | None = None) -> WriteBatch:
        """Queue one PUT of ``len(items)`` chunks (PUT_ITEMs ready-made, their stored bytes in ``payloads``)
        for the session's sender thread.

        ``route``: the servers after this one (kept on the batch); ``route_addresses``: their bulk
        addresses, the PUT's route. Blocks while ``window`` PUTs are queued or unacknowledged;
        raises the session's BulkWriteError once it has failed.
        """
        if not 0 < len(items) <= MAX_PUT_ITEMS:
            raise ValueError(f"a PUT carries 1..{MAX_PUT_ITEMS} chunks, got {len(items)}")
        raw_route = encode_route(list(route_addresses))
        with self._cond:
            self._wait_room(abort)
            self._seq += 1
            batch = WriteBatch(self._seq, chunks, nbytes, tuple(route), payload)
            if not self._inflight:
                self._last_progress = time.monotonic()
            self._inflight.append(batch)
            self._sendq.append((batch, encode_put(batch.seq, items, payloads, nbytes, raw_route)))
            self.sent_bytes += nbytes
            self._cond.notify_all()
        return batch

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._sendq and not self._closed and self.error is None:
                    self._cond.wait(0.5)
                if not self._sendq or self.error is not None:
                    return
                batch, bufs = self._sendq.popleft()
            try:
                send_all(self.sock, bufs)
            except OSError as exc:
                self._fail(BulkWriteError(self.address, f"send of PUT {batch.seq} failed: {exc}", grpc.StatusCode.UNAVAILABLE))
                return

    def _wait_room(self, abort: threading.Event | None) -> None:
        while True:
            if self.error is not None:
                raise self.error
            if abort is not None and abort.is_set():
                raise BulkWriteError(self.address, "aborted", grpc.StatusCode.CANCELLED)
            if len(self._inflight) < self.window:
                return
            self._check_stall()
            self._cond.wait(0.2)

    def _check_stall(self) -> None:
        if self._inflight and time.monotonic() - self._last_progress > self.ack_timeout_s:
            self._fail_locked(BulkWriteError(self.address, f"no acks for {self.ack_timeout_s:g} s with {len(self._inflight)} PUTs "
                                             "in flight", grpc.StatusCode.DEADLINE_EXCEEDED))
            raise self.error  # type: ignore[misc]

    def drain(self, timeout_s: float, abort: threading.Event | None = None) -> bool:
        """Wait (at most ``timeout_s``) until every PUT is acknowledged; True when none is left.
        Raises the session's BulkWriteError once it has failed."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._inflight:
                if self.error is not None:
                    raise self.error
                if abort is not None and abort.is_set():
                    raise BulkWriteError(self.address, "aborted", grpc.StatusCode.CANCELLED)
                self._check_stall()
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.2))
            if self.error is not None and not self._closed:
                raise self.error
            return True

    def poll(self) -> int:
        """PUTs still unacknowledged; raises the session's BulkWriteError once it has failed (or stalled)."""
        with self._cond:
            if self.error is not None:
                raise self.error
            self._check_stall()
            return len(self._inflight)

    def unacked(self) -> list[WriteBatch]:
        with self._cond:
            return list(self._inflight)

    @property
    def inflight(self) -> int:
        with self._cond:
            return len(self._inflight)

    # ------------------------------------------------------------ acks

    def _fail(self, error: BulkWriteError) -> None:
        with self._cond:
            self._fail_locked(error)

    def _fail_locked(self, error: BulkWriteError) -> None:
        if self.error is None:
            self.error = error
        self._cond.notify_all()
        self._on_change()

    def _read(self) -> None:
        sock = self._rsock
        try:
            while True:
                try:
                    got = read_ack_frame(sock, self.io_timeout_s, self._is_closed)
                except (OSError, EOFError) as exc:
                    with self._cond:
                        closed, pending = self._closed, len(self._inflight)
                    if not closed:
                        why = f"connection lost with {pending} PUTs unacknowledged ({exc})" if pending else f"connection lost ({exc})"
                        self._fail(BulkWriteError(self.address, why, grpc.StatusCode.UNAVAILABLE))
                    return
                if got is None:
                    return
                if isinstance(got, SessionEnded):
                    code = grpc.StatusCode.UNAVAILABLE if got.error_class == E_BUSY else grpc.StatusCode.INVALID_ARGUMENT
                    self._fail(BulkWriteError(self.address, f"the server ended the session: {got.message}", code))
                    return
                seq, count, replicas = got.seq, got.count, got.replicas
                with self._cond:
                    if not self._inflight or self._inflight[0].seq != seq:
                        want = self._inflight[0].seq if self._inflight else None
                        raise ProtocolError(f"ACKS for PUT {seq}, expected {want}")
                    batch = self._inflight[0]
                    if count != len(batch.chunks) or replicas != 1 + len(batch.route):
                        raise ProtocolError(f"ACKS of {count} x {replicas} for PUT {seq} of {len(batch.chunks)} chunks x "
                                            f"{1 + len(batch.route)} replicas")
                self._on_acks(batch, got.acks, replicas)
                with self._cond:
                    self._inflight.popleft()
                    self.acked_batches += 1
                    self._last_progress = time.monotonic()
                    self._cond.notify_all()
                self._on_change()
        except ProtocolError as exc:
            self._fail(BulkWriteError(self.address, f"bad reply: {exc}", grpc.StatusCode.INTERNAL))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        except Exception as exc:  # noqa: BLE001 - a bug in on_acks must fail the session, not hang its producer
            self._fail(BulkWriteError(self.address, f"{type(exc).__name__}: {exc}", grpc.StatusCode.INTERNAL))

    def _is_closed(self) -> bool:
        with self._cond:
            return self._closed


def ack_name(status: int) -> str:
    return ACK_NAMES.get(status, str(status))


__all__ = ["Ack", "BulkWriteError", "BulkWriteRefused", "BulkWriter", "OnAcks", "WriteBatch", "ack_name"]
