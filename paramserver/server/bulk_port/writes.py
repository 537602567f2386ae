"""Write sessions of the bulk port: PUTs received, stored through ``paramserver.server.ingest``, acked in order.

Each PUT is received straight into one fresh (or spare) buffer, stored with one
``ChunkStore.put_many`` per retry (one group fsync; ``ingest`` decides every chunk exactly as
PutChunks does) and acknowledged per chunk only once it returned (durable). A connection's
receiver reads the next PUTs while ``store_workers`` threads store the earlier ones, so the disk
stays busy; acks still go out in PUT order. Memory is bounded by ``write_buffer_bytes`` over all
write sessions (:class:`Budget`: a PUT waits for room). A malformed PUT gets an ERROR frame
(after the acks of the PUTs before it) and the connection is closed; a bad chunk gets an error
ack naming it while the others of its PUT are stored. A PUT whose route names next hops is
forwarded (``chain``) as it is stored here.
"""
from __future__ import annotations

import logging
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from paramserver.server.bulk_port.chain import Chain, Waiter
from paramserver.server.bulk_port.config import BulkServerConfig
from paramserver.wire.rate_limited_log import RateLimitedLog
from paramserver.server.errors import PutRefused
from paramserver.server.ingest import Kind, ingest
from paramserver.server.repair import RepairQueue
from paramserver.server.store import ChunkStore
from paramserver.wire.bulk_frames import (
    ALREADY_PRESENT, CORRUPT_IN_TRANSIT, E_BUSY, FAILED, FULL, INVALID, MAX_PUT_BYTES, MAX_PUT_ITEMS,
    MAX_ROUTE_BYTES, PUT_HEAD, PUT_ITEM, STORED, ProtocolError, PutBatch, decode_route, encode_ack_error, encode_acks,
    recv_exact_by,
)
from paramserver.wire.bulk_write_session import Ack

log = logging.getLogger(__name__)

_STOP = object()
# Receive buffers the server keeps for the next PUTs, over all sessions: room for the PUTs that
# one session holds at once (receiving plus store_workers storing) of a few sessions.
_SPARE_BYTES, _SPARE_MAX_BYTES = 48 << 20, 16 << 20
# The ACK status of each outcome (a bulk PUT carries no hot copies: REFUSED does not occur).
_ACK_STATUS = {Kind.STORED: STORED, Kind.PRESENT: ALREADY_PRESENT, Kind.INVALID: INVALID,
               Kind.CORRUPT_IN_TRANSIT: CORRUPT_IN_TRANSIT, Kind.FULL: FULL, Kind.FAILED: FAILED, Kind.REFUSED: FAILED}


class Budget:
    """Bytes of received PUT payloads held at once, over all write sessions."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, deadline: float) -> bool:
        n = min(n, self.capacity)
        with self._cond:
            while self.used + n > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= min(n, self.capacity)
            self._cond.notify_all()


@dataclass
class WritePort:
    """What every write session of one bulk server shares (the server holds one)."""

    store: ChunkStore
    config: BulkServerConfig
    where: str  # how error acks name this server
    address: str
    repair_queue: RepairQueue | None
    forward_to: Callable[[], Collection[str]] | None
    stopped: threading.Event
    lock: threading.Lock  # the server's: guards ``stats``
    refusals: RateLimitedLog
    budget: Budget
    stats: dict[str, int] = field(default_factory=lambda: {
        "sessions": 0, "puts": 0, "chunks": 0, "bytes": 0, "errors": 0, "forwarded": 0, "buffers_reused": 0})
    # Receive buffers no one refers to any more, shared by every write session (see recycle): a
    # push opens new sessions, and a buffer of its own would be fresh memory the kernel faults in
    # and zeroes page by page on every push.
    spare: list[np.ndarray] = field(default_factory=list)
    spare_lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.stats[key] += n

    def buffer(self, n: int) -> np.ndarray:
        """A receive buffer of at least ``n`` bytes: a spare one that fits, else a new one (uninitialised: every
        byte is received into it)."""
        with self.spare_lock:
            for i, a in enumerate(self.spare):
                if n <= len(a) <= 2 * n + (1 << 20):
                    self.count("buffers_reused")
                    return self.spare.pop(i)
        return np.empty(-(-n // (1 << 20)) * (1 << 20), dtype=np.uint8)  # whole MiB: PUTs of a little more still fit

    def recycle(self, array: object) -> None:
        """Keep ``array`` for the next PUT only when nothing else refers to it: the store may keep views of
        the bytes it was given (every memoryview of the buffer holds a reference to it), and those must
        never change. Here the only references are the caller's and getrefcount's own."""
        if not isinstance(array, np.ndarray) or sys.getrefcount(array) != 3:
            return  # 3: the caller's local, this parameter, getrefcount's argument
        if len(array) > _SPARE_MAX_BYTES:
            return
        with self.spare_lock:
            spare = self.spare
            while spare and sum(len(a) for a in spare) + len(array) > _SPARE_BYTES:
                spare.pop(0)  # the oldest goes: what the PUTs of now need is kept
            spare.append(array)


class WriteSession:
    """One write connection: this thread receives PUTs, ``store_workers`` threads store them, acks go out in order."""

    def __init__(self, port: WritePort, conn: socket.socket, peer: tuple[str, int], token: str) -> None:
        self.port = port
        self.cfg = port.config
        self.conn = conn
        self.peer = peer
        self.where = port.where
        # Acks are sent on a duplicate of the socket: its timeout is its own (the receiver's changes with each read).
        self.tx = conn.dup()
        self.tx.settimeout(self.cfg.io_timeout_s)
        self.queue: queue.Queue[object] = queue.Queue(maxsize=1)  # received, waiting for a worker
        self.workers: list[threading.Thread] = []
        self._send_lock = threading.Lock()
        self._done: dict[int, bytes] = {}
        self._next_ack = 1
        self._send_failed = False
        self.chain = Chain(token=token, own_address=port.address, where=port.where, forward_to=port.forward_to,
                           io_timeout_s=self.cfg.io_timeout_s, on_forwarded=lambda: port.count("forwarded"))

    # ------------------------------------------------------------ receiving

    def run(self) -> None:
        refused: PutRefused | None = None
        expected = 1
        try:
            while not self.port.stopped.is_set():
                batch = self._receive(expected)
                if batch is None:
                    break
                expected += 1
                if len(self.workers) < self.cfg.store_workers and len(self.workers) < expected - 1:
                    t = threading.Thread(target=self._work, name="bulk-store", daemon=True)
                    t.start()
                    self.workers.append(t)
                self.queue.put(batch)  # blocks while every worker is busy: we stop reading, the client's window fills
        except PutRefused as exc:
            refused = exc
        except (OSError, EOFError) as exc:
            log.debug("bulk write session ended: %s", exc)
        finally:
            for _ in self.workers:
                self.queue.put(_STOP)
            for t in self.workers:
                t.join()
            if refused is not None:
                self.port.count("errors")
                self.port.refusals.warning("bad_put", "bulk write refused: address=%s:%s server=%s reason=%s",
                                           self.peer[0], self.peer[1], self.port.address, str(refused))
                with self._send_lock:
                    if not self._send_failed:
                        try:
                            self.tx.sendall(encode_ack_error(expected, f"{self.where}: {refused}", refused.error_class))
                        except OSError:
                            pass
            self.chain.close()
            self.tx.close()

    def _receive(self, expected: int) -> PutBatch | None:
        """The next PUT, received in full; None on a goodbye, a close or an idle connection."""
        conn = self.conn
        head = bytearray(PUT_HEAD.size)
        view = memoryview(head)
        conn.settimeout(self.cfg.idle_timeout_s)
        try:
            n = conn.recv_into(view, PUT_HEAD.size)
        except TimeoutError:
            return None  # idle: the client reconnects when it needs us again
        if n == 0:
            return None
        deadline = time.monotonic() + self.cfg.io_timeout_s
        try:
            if n < PUT_HEAD.size:
                recv_exact_by(conn, view[n:], deadline)
            count, seq, payload_bytes, route_len = PUT_HEAD.unpack(head)
            if count == 0:
                return None  # goodbye
            if count > MAX_PUT_ITEMS:
                raise PutRefused(f"a PUT carries at most {MAX_PUT_ITEMS} chunks, got {count}; split it")
            if seq != expected:
                raise PutRefused(f"PUT number {seq} out of order: expected {expected}")
            if payload_bytes > MAX_PUT_BYTES:
                raise PutRefused(f"a PUT carries at most {MAX_PUT_BYTES} payload bytes, this one declares {payload_bytes}; split it")
            if route_len > MAX_ROUTE_BYTES:
                raise PutRefused(f"a PUT route has at most {MAX_ROUTE_BYTES} bytes, got {route_len}")
            rest = bytearray(route_len + count * PUT_ITEM.size)
            recv_exact_by(conn, memoryview(rest), deadline)
            try:
                route = decode_route(bytes(rest[:route_len]))
                batch = PutBatch(seq, bytes(rest[route_len:]), route)
            except ProtocolError as exc:
                raise PutRefused(str(exc)) from None
            if batch.payload_bytes != payload_bytes:
                raise PutRefused(f"PUT {seq} declares {payload_bytes} payload bytes, its chunks {batch.payload_bytes}")
            if not self.port.budget.acquire(payload_bytes, time.monotonic() + self.cfg.io_timeout_s):
                raise PutRefused(f"no room for a PUT of {payload_bytes} bytes within {self.cfg.io_timeout_s:g} s (the server's "
                              f"write buffers, {self.cfg.write_buffer_bytes} bytes, are full); retry later", E_BUSY)
            try:
                array = self.port.buffer(payload_bytes)
                buf: memoryview = array.data[:payload_bytes]
                recv_exact_by(conn, buf, time.monotonic() + self.cfg.io_timeout_s + payload_bytes / self.cfg.min_write_rate)
            except BaseException:
                self.port.budget.release(payload_bytes)
                raise
            batch.buffer = buf
            batch.array = array
            return batch
        except TimeoutError as exc:
            raise PutRefused(f"PUT not received in time ({exc})", E_BUSY) from None

    # ------------------------------------------------------------ storing

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            assert isinstance(item, PutBatch)
            batch = item
            try:
                frame = self._handle(batch)
            except Exception as exc:  # a bug must not take the session (or the server) down
                log.exception("bulk PUT %d failed", batch.seq)
                message = f"{self.where}: could not store the PUT: {type(exc).__name__}: {exc}"
                frame = encode_acks(batch.seq, 1 + len(batch.route), [(FAILED, message, 0)] * (len(batch.ids) * (1 + len(batch.route))))
            finally:
                self.port.budget.release(batch.payload_bytes)
                batch.buffer = None
                array, batch.array = batch.array, None
            self.port.recycle(array)
            self._deliver(batch.seq, frame)

    def _deliver(self, seq: int, frame: bytes) -> None:
        with self._send_lock:
            self._done[seq] = frame
            while self._next_ack in self._done:
                out = self._done.pop(self._next_ack)
                self._next_ack += 1
                if self._send_failed:
                    continue
                try:
                    self.tx.sendall(out)
                except OSError as exc:
                    self._send_failed = True  # the client is gone: what it sent is stored (orphans until committed)
                    log.debug("bulk acks not delivered: %s", exc)

    def _handle(self, batch: PutBatch) -> bytes:
        waiter: Waiter | None = None
        if batch.route:
            waiter = self.chain.forward(batch)  # first: the next hop receives while we store
        local = self._store(batch)
        if not batch.route:
            return encode_acks(batch.seq, 1, local)
        return encode_acks(batch.seq, 1 + len(batch.route), self.chain.merge(batch, waiter, local))

    def _store(self, batch: PutBatch) -> list[Ack]:
        """Per-chunk acks of one PUT, after ``put_many`` returned (the stored chunks are durable)."""
        port = self.port
        done = ingest(port.store, batch.chunks(), where=self.where, repair_queue=port.repair_queue)
        with port.lock:
            stats = port.stats
            stats["puts"] += 1
            stats["chunks"] += done.stored + done.present
            stats["bytes"] += done.accepted_bytes
        return [(_ACK_STATUS[o.kind], o.message, o.free_bytes) for o in done.outcomes]


__all__ = ["Budget", "WritePort", "WriteSession"]
