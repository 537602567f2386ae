"""The bulk port of a server: answers the read and write protocols of ``paramserver.wire.bulk_frames``.

Reads go through ``ChunkStore.get`` (hot cache, CRC32C checked on every disk read): a corrupt
chunk is answered CORRUPT and never sent, and the store quarantines it and queues its repair
exactly as on the gRPC path. Tokens follow the gRPC rule for reads.

Silent or slow clients cannot fill the port: the hello must arrive in full within
``hello_timeout_s`` (a deadline for the whole hello, not per byte), and one client IP holds at
most ``max_per_ip`` connections. Connections still owing their hello are held apart from the
served ones (``max_connections`` counts only connections whose hello was accepted): at most
``max_pending`` of them, and a new one pushes out the oldest once that one has had
``EVICT_AFTER_S`` for its hello (a burst of fresh connections is not cut short: the newcomer is
refused instead), so connections that never say hello cannot lock clients out. A refused connection is
answered "bad hello" with the reason and logged at WARNING with its address (at most one line
per reason every few seconds). An ``accept`` that fails (out of file descriptors) is retried
after a pause, never the end of the port.

Writes (a hello with the write magic; :class:`_WriteSession`) need the admin token. Each PUT is
received straight into one fresh buffer, stored with one ``ChunkStore.put_many`` (one group
fsync) and acknowledged per chunk only once ``put_many`` returned (durable). A connection's
receiver reads the next PUTs while ``store_workers`` threads store the earlier ones, so the disk
stays busy; acks still go out in PUT order. Memory is bounded by ``write_buffer_bytes`` over all
write sessions (a PUT waits for room), sessions by ``max_write_connections``, a PUT by
MAX_PUT_ITEMS / MAX_PUT_BYTES; a PUT must arrive in full within ``io_timeout_s`` plus its size at
``min_write_rate`` bytes per second. A malformed PUT gets an ERROR frame (after the acks of the
PUTs before it) and the connection is closed; a bad chunk gets an error ack naming it while the
others of its PUT are stored. With ``forward_to`` (the peers' bulk addresses), a PUT whose route
names next hops is forwarded there as it is stored here (chain replication), and its ACKS carry
every hop's acks; without it, hops are answered FAILED and the client sends to them itself.
"""
from __future__ import annotations

import hmac
import logging
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Mapping, cast

import numpy as np

from chunking.hashing import hex_ids
from paramserver.server.auth import AuthConfig
from paramserver.server.dataplane import RateLimitedLog
from paramserver.server.errors import (
    ChunkCorruptError, ChunkError, ChunkTransferCorruptError, ConfigError, ParamServerError,
    StoreFullError,
)
from paramserver.server.repair import RepairQueue
from paramserver.server.store import ChunkStore
from paramserver.wire.address import split_host_port
from paramserver.wire.auth import ADMIN_TOKEN_ENV, READ_TOKEN_ENV
from paramserver.wire.bulk_frames import (
    A_ACKS, ACK_HEAD, ALREADY_PRESENT, CORRUPT, CORRUPT_IN_TRANSIT, ERROR, FAILED, FULL, HELLO, ID_BYTES, INVALID,
    E_BUSY, E_MALFORMED, MAGIC, MAX_IDS, MAX_PUT_BYTES, MAX_PUT_ITEMS, MAX_ROUTE_BYTES, MAX_TOKEN_BYTES, MISSING, OK,
    PUT_HEAD, PUT_ITEM, READ_VERSIONS, REQUEST, SEND_BATCH_BYTES, SOCKET_BUFFER_BYTES, STORED, W_BAD_HELLO, W_OK,
    W_UNAUTHENTICATED, WELCOME, WRITE_MAGIC, WRITE_VERSION, ProtocolError, PutBatch, decode_acks, decode_route,
    encode_ack_error, encode_acks, encode_batch, encode_header, encode_message, encode_put, encode_route,
    encode_welcome, encode_write_hello, encode_write_welcome, recv_ack_frame, recv_exact, recv_exact_by, send_all,
    batch_items,
)

log = logging.getLogger(__name__)
_ACCEPT_PAUSE_S, _ACCEPT_PAUSE_MAX_S = 0.05, 1.0  # after a failed accept (out of file descriptors)
EVICT_AFTER_S = 1.0  # a pending connection this old may be pushed out for a new one (a hello takes milliseconds)


def check_token(token: str, auth: AuthConfig) -> str | None:
    """None when reads are allowed with ``token``, else the message (never echoing the token).

    The rule of paramserver.server.auth for reads: open without a read token; otherwise the read
    token or the admin token.
    """
    if auth.read_token is None:
        return None
    given = token.encode()
    for expected in (auth.read_token, auth.admin_token):
        if expected is not None and token and hmac.compare_digest(given, expected.encode()):
            return None
    problem = "no token was sent" if not token else "the token sent is wrong"
    return (f"bulk reads need the read token or the admin token (--token, ${READ_TOKEN_ENV} or ${ADMIN_TOKEN_ENV}) "
            f"in the bulk hello; {problem}")


def check_write_token(token: str, auth: AuthConfig) -> str | None:
    """None when writes are allowed with ``token``, else the message (never echoing the token).

    The rule of paramserver.server.auth for writes: open without an admin token; otherwise the
    admin token, and only it (the read token is not enough).
    """
    if auth.admin_token is None:
        return None
    if token and hmac.compare_digest(token.encode(), auth.admin_token.encode()):
        return None
    problem = "no token was sent" if not token else "the token sent is not the admin token"
    return f"bulk writes need the admin token (paramctl --token or ${ADMIN_TOKEN_ENV}) in the bulk hello; {problem}"


_BULK_KEYS: tuple[tuple[str, type], ...] = (
    ("max_connections", int), ("max_pending", int), ("max_per_ip", int), ("hello_timeout_s", float), ("idle_timeout_s", float),
    ("io_timeout_s", float), ("max_write_connections", int), ("write_buffer_bytes", int), ("store_workers", int),
    ("min_write_rate", int),
)
CONFIG_KEYS = ("bulk_writes", *(f"bulk_{name}" for name, _ in _BULK_KEYS))  # a server config's keys for the bulk port


def _long_token(length: int) -> str:
    return (f"the hello declares a token of {length} bytes, over the limit of {MAX_TOKEN_BYTES}; send the cluster's "
            "read or admin token")


@dataclass(frozen=True)
class BulkServerConfig:
    max_connections: int = 64  # connections served at once (past their hello)
    max_pending: int = 64  # connections still owing their hello; the oldest is dropped for a new one
    idle_timeout_s: float = 300.0  # a connection with no request for this long is closed
    io_timeout_s: float = 30.0  # one send or the rest of a frame must not take longer
    hello_timeout_s: float = 5.0  # the whole hello must arrive within this
    max_per_ip: int = 16  # connections one client address may hold
    writes: bool = True  # serve write sessions (PUT); off: a write hello is refused and clients use PutChunks
    max_write_connections: int = 16  # write sessions at once (each holds up to store_workers + 1 PUTs)
    write_buffer_bytes: int = 256 << 20  # received PUT payloads held at once, over all write sessions
    store_workers: int = 2  # PUTs of one session stored at once (their fsyncs are grouped by the store)
    min_write_rate: int = 1 << 20  # bytes/s: a PUT must arrive within io_timeout_s + its size at this rate

    def validate(self) -> BulkServerConfig:
        if not 1 <= self.max_connections <= 4096:
            raise ConfigError(f"bulk max_connections must be 1..4096, got {self.max_connections}")
        if not 1 <= self.max_per_ip <= 4096:
            raise ConfigError(f"bulk max_per_ip must be 1..4096, got {self.max_per_ip}")
        if not 1 <= self.max_pending <= 4096:
            raise ConfigError(f"bulk max_pending must be 1..4096, got {self.max_pending}")
        if self.idle_timeout_s <= 0 or self.io_timeout_s <= 0 or self.hello_timeout_s <= 0:
            raise ConfigError("bulk idle_timeout_s, io_timeout_s and hello_timeout_s must be > 0")
        if not 1 <= self.max_write_connections <= 4096:
            raise ConfigError(f"bulk max_write_connections must be 1..4096, got {self.max_write_connections}")
        if self.write_buffer_bytes < MAX_PUT_BYTES:
            raise ConfigError(f"bulk write_buffer_bytes must be at least {MAX_PUT_BYTES} (one PUT of the largest chunk), "
                              f"got {self.write_buffer_bytes}")
        if not 1 <= self.store_workers <= 16:
            raise ConfigError(f"bulk store_workers must be 1..16, got {self.store_workers}")
        if self.min_write_rate < 1024:
            raise ConfigError(f"bulk min_write_rate must be at least 1024 bytes/s, got {self.min_write_rate}")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> BulkServerConfig:
        """From a server config file's extra keys ``bulk_max_connections``, ``bulk_max_pending``, ``bulk_max_per_ip``,
        ``bulk_hello_timeout_s``, ``bulk_idle_timeout_s``, ``bulk_io_timeout_s``, ``bulk_writes`` (bool),
        ``bulk_max_write_connections``, ``bulk_write_buffer_bytes``, ``bulk_store_workers`` and
        ``bulk_min_write_rate``."""
        values: dict[str, float | int | bool] = {}
        for name, kind in _BULK_KEYS:
            value = extra.get(f"bulk_{name}")
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
                raise ConfigError(f"bulk_{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
            values[name] = kind(value)
        writes = extra.get("bulk_writes")
        if writes is not None:
            if not isinstance(writes, bool):
                raise ConfigError(f"bulk_writes must be true or false, got {writes!r}")
            values["writes"] = writes
        return cls(**values).validate()  # type: ignore[arg-type]


def _recv_by(conn: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes that must all arrive before ``deadline`` (time.monotonic): TimeoutError else."""
    buf = bytearray(n)
    recv_exact_by(conn, memoryview(buf), deadline)
    return bytes(buf)


class _Budget:
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


class BulkServer:
    """Threaded TCP server of the bulk read and write protocols; a thread per connection, bounded.

    ``repair_queue``: told when a fresh verified copy of a chunk arrived (as PutChunks does).
    ``forward_to``: the bulk addresses a PUT may be forwarded to (the other members'); None: this
    server does not forward (chain hops are answered FAILED and the client sends to them itself).
    """

    def __init__(self, store: ChunkStore, auth: AuthConfig, listen: str = "127.0.0.1:0",
                 config: BulkServerConfig = BulkServerConfig(), *, server_id: str = "",
                 repair_queue: RepairQueue | None = None, forward_to: Callable[[], Collection[str]] | None = None,
                 on_read: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.on_read = on_read  # told the id of every chunk served (hot-chunk read rates)
        self.auth = auth.validate()
        self.config = config.validate()
        # The name error acks give this server: the store knows it when the caller does not say.
        self.server_id = server_id or str(getattr(store, "server_id", "") or "")
        self.repair_queue = repair_queue
        self.forward_to = forward_to
        self._write_slots = threading.BoundedSemaphore(self.config.max_write_connections)
        self.budget = _Budget(self.config.write_buffer_bytes)
        self.write_stats = {"sessions": 0, "puts": 0, "chunks": 0, "bytes": 0, "errors": 0, "forwarded": 0,
                            "buffers_reused": 0}
        # Receive buffers no one refers to any more, shared by every write session (see
        # _WriteSession._recycle): a push opens new sessions, and a buffer of its own would be fresh
        # memory the kernel faults in and zeroes page by page on every push.
        self._spare: list[np.ndarray] = []
        self._spare_lock = threading.Lock()
        try:
            bind_host, bind_port = split_host_port(listen)
        except ValueError:
            raise ConfigError(f"bulk listen address must be HOST:PORT (port 0 picks a free one), got {listen!r}") from None
        host = listen.rpartition(":")[0]  # as given, brackets kept: it is put back into addresses
        self._sock = socket.create_server((bind_host, bind_port), backlog=128, reuse_port=False)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(self.config.max_connections)
        self._per_ip: dict[str, int] = {}  # open connections by client address (under _lock)
        self._peer_of: dict[socket.socket, tuple[str, int]] = {}  # accepted, until its thread takes it
        self._pending: dict[socket.socket, float] = {}  # owing their hello -> accepted at, oldest first (under _lock)
        self._refusals = RateLimitedLog(log)
        self.refused = 0  # connections refused (limits, hello timeout)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="bulk-accept", daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> BulkServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        pause = _ACCEPT_PAUSE_S
        while not self._stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError as exc:
                if self._stopped.is_set():
                    return  # closed by stop()
                # EMFILE, ENFILE, ENOBUFS, ECONNABORTED...: the port must outlive them.
                self._refusals.warning("accept_failed", "bulk port accept failed: server=%s error=%s; retrying in %gs",
                                       self.address, exc, pause)
                self._stopped.wait(pause)
                pause = min(_ACCEPT_PAUSE_MAX_S, pause * 2)
                continue
            pause = _ACCEPT_PAUSE_S
            ip = str(peer[0])
            with self._lock:
                mine = self._per_ip.get(ip, 0)
                if mine < self.config.max_per_ip:
                    self._per_ip[ip] = mine + 1
            if mine >= self.config.max_per_ip:
                self._refuse(conn, peer, "per_ip_limit",
                             f"too many bulk connections from this address (limit {self.config.max_per_ip} per client "
                             "address); reuse them, use GetChunks, or retry later")
                continue
            now = time.monotonic()
            with self._lock:
                oldest: socket.socket | None = None
                if len(self._pending) >= self.config.max_pending:
                    first, since = next(iter(self._pending.items()))
                    if now - since >= EVICT_AFTER_S:
                        oldest = first
                        del self._pending[first]
                full = len(self._pending) >= self.config.max_pending
                if not full:
                    self._peer_of[conn] = (ip, int(peer[1]) if len(peer) > 1 else 0)
                    self._pending[conn] = now
            if oldest is not None:
                self._log_refusal(peer, "pending_limit", f"more than {self.config.max_pending} connections owed their "
                                                         "hello; the oldest was dropped")
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread's receive ends, and the thread cleans up
                except OSError:
                    pass
            if full:
                self._drop_ip(ip)
                self._refuse(conn, peer, "pending_limit",
                             f"{self.config.max_pending} connections are still owed their hello here; retry in a moment")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="bulk-conn", daemon=True).start()

    def _drop_ip(self, ip: str) -> None:
        with self._lock:
            left = self._per_ip.get(ip, 1) - 1
            if left > 0:
                self._per_ip[ip] = left
            else:
                self._per_ip.pop(ip, None)

    def _log_refusal(self, peer: object, reason: str, message: str) -> None:
        self.refused += 1
        address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
        self._refusals.warning(reason, "bulk connection refused: address=%s server=%s reason=%s detail=%s",
                               address, self.address, reason, message)

    def _refuse(self, conn: socket.socket, peer: object, reason: str, message: str) -> None:
        self._log_refusal(peer, reason, message)
        try:
            conn.settimeout(1.0)
            conn.sendall(encode_welcome(W_BAD_HELLO, message))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
            peer = self._peer_of.pop(conn)
        served = False  # holds one of the max_connections slots
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            try:
                mode = self._handshake(conn, peer)
            except TimeoutError:
                self._log_refusal(peer, "hello_timeout", f"no complete hello within {self.config.hello_timeout_s:g} s")
                return
            finally:
                with self._lock:
                    self._pending.pop(conn, None)
            served = mode is not None
            conn.settimeout(self.config.io_timeout_s)
            if mode is not None and mode.startswith("read:"):
                self._requests(conn, batch_items(int(mode[len("read:"):])))
            elif mode is not None and mode.startswith("write:"):
                try:
                    with self._lock:
                        self.write_stats["sessions"] += 1
                    _WriteSession(self, conn, peer, mode[len("write:"):]).run()
                finally:
                    self._write_slots.release()
        except (OSError, EOFError, ProtocolError) as exc:
            log.debug("bulk connection ended: %s", exc)
        except Exception:
            log.exception("bulk connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._pending.pop(conn, None)
            conn.close()
            self._drop_ip(str(peer[0]))
            if served:
                self._slots.release()

    def _handshake(self, conn: socket.socket, peer: tuple[str, int]) -> str | None:
        """"read:" + the protocol version, or "write:" + the token, once welcomed; None when turned
        away (answered and logged)."""
        deadline = time.monotonic() + self.config.hello_timeout_s
        magic, version, token_len = HELLO.unpack(_recv_by(conn, HELLO.size, deadline))
        if magic == WRITE_MAGIC:
            return self._write_handshake(conn, peer, version, token_len, deadline)
        if magic != MAGIC:
            return self._turn_away(conn, peer, W_BAD_HELLO, "bad_hello",
                                   "not a bulk hello (bad magic): this port speaks the paramserver bulk protocol, "
                                   "use the gRPC port for gRPC")
        if version not in READ_VERSIONS:
            return self._turn_away(conn, peer, W_BAD_HELLO, "bad_hello", f"bulk protocol version {version} is not served here "
                                                                         f"(this server speaks {', '.join(map(str, READ_VERSIONS))}); "
                                                                         "fall back to GetChunks")
        if token_len > MAX_TOKEN_BYTES:
            return self._turn_away(conn, peer, W_BAD_HELLO, "bad_hello", _long_token(token_len))
        token = _recv_by(conn, token_len, deadline).decode("utf-8", "replace")
        conn.settimeout(self.config.io_timeout_s)
        problem = check_token(token, self.auth)
        if problem is not None:
            return self._turn_away(conn, peer, W_UNAUTHENTICATED, "unauthenticated", problem)
        if not self._slots.acquire(blocking=False):
            return self._turn_away(conn, peer, W_BAD_HELLO, "connection_limit", self._full_message())
        try:
            conn.sendall(encode_welcome(W_OK))
        except BaseException:
            self._slots.release()
            raise
        return f"read:{version}"

    def _full_message(self) -> str:
        return f"too many bulk connections (limit {self.config.max_connections}); use GetChunks or retry later"

    def _write_handshake(self, conn: socket.socket, peer: tuple[str, int], version: int, token_len: int,
                         deadline: float) -> str | None:
        def away(status: int, reason: str, message: str) -> str | None:
            return self._turn_away(conn, peer, status, reason, message, welcome=encode_write_welcome)

        if version != WRITE_VERSION:
            return away(W_BAD_HELLO, "bad_hello", f"bulk write protocol version {version} is not served here (this server speaks "
                                                  f"{WRITE_VERSION}); fall back to PutChunks")
        if token_len > MAX_TOKEN_BYTES:
            return away(W_BAD_HELLO, "bad_hello", _long_token(token_len))
        token = _recv_by(conn, token_len, deadline).decode("utf-8", "replace")
        conn.settimeout(self.config.io_timeout_s)
        problem = check_write_token(token, self.auth)
        if problem is not None:
            return away(W_UNAUTHENTICATED, "unauthenticated", problem)
        if not self.config.writes:
            return away(W_BAD_HELLO, "writes_off", "bulk writes are off on this server; use PutChunks")
        if not self._slots.acquire(blocking=False):
            return away(W_BAD_HELLO, "connection_limit", self._full_message())
        if not self._write_slots.acquire(blocking=False):
            self._slots.release()
            return away(W_BAD_HELLO, "write_limit", f"too many bulk write sessions (limit {self.config.max_write_connections}); "
                                                    "use PutChunks or retry later")
        try:
            conn.sendall(encode_write_welcome(W_OK))
        except BaseException:
            self._write_slots.release()
            self._slots.release()
            raise
        return "write:" + token  # forwarded hops are opened with the client's own token

    def _turn_away(self, conn: socket.socket, peer: tuple[str, int], status: int, reason: str, message: str,
                   welcome: Callable[[int, str], bytes] = encode_welcome) -> str | None:
        """Answer a refused hello; None (the connection is not served)."""
        self._log_refusal(peer, reason, message)
        conn.settimeout(self.config.io_timeout_s)
        conn.sendall(welcome(status, message))
        return None

    def _error(self, conn: socket.socket, message: str) -> None:
        raw = encode_message(message)
        send_all(conn, encode_batch([encode_header(ERROR, stored_size=len(raw))], [raw]))

    def _requests(self, conn: socket.socket, max_items: int) -> None:
        while not self._stopped.is_set():
            conn.settimeout(self.config.idle_timeout_s)
            try:
                first = conn.recv(REQUEST.size, socket.MSG_WAITALL)
            except TimeoutError:
                return  # idle: the client reconnects when it needs us again
            if not first:
                return
            deadline = time.monotonic() + self.config.io_timeout_s  # for the rest of the request, all of it
            if len(first) < REQUEST.size:
                first += _recv_by(conn, REQUEST.size - len(first), deadline)
            (count,) = REQUEST.unpack(first)
            if count == 0:
                return
            if count > MAX_IDS:
                self._error(conn, f"a bulk request carries at most {MAX_IDS} ids, got {count}; split it")
                return
            try:
                raw_ids = _recv_by(conn, count * ID_BYTES, deadline)
            except EOFError:
                return  # truncated request: nothing to answer
            conn.settimeout(self.config.io_timeout_s)
            self._answer(conn, hex_ids(raw_ids), max_items)

    def _answer(self, conn: socket.socket, ids: list[str], max_items: int) -> None:
        # Each batch is read from the store in one call (adjacent small records in one pread), so
        # it is cut first, by the records' sizes: at most ``max_items``, closed once it holds
        # SEND_BATCH_BYTES, as a batch of chunks read one by one would be.
        ends = np.cumsum(self.store.record_sizes(ids))
        start = 0
        while start < len(ids):
            # the first id that brings the batch to SEND_BATCH_BYTES closes it
            before = int(ends[start - 1]) if start else 0
            stop = min(int(np.searchsorted(ends, before + SEND_BATCH_BYTES, side="left")) + 1, start + max_items, len(ids))
            block = ids[start:stop]
            headers: list[bytes] = []
            payloads: list[bytes | memoryview] = []
            for chunk_id, chunk in zip(block, self.store.get_many(block)):
                if isinstance(chunk, ChunkCorruptError):  # the store quarantined it and queued a repair
                    payload = encode_message(str(chunk))
                    head = encode_header(CORRUPT, stored_size=len(payload))
                elif isinstance(chunk, ChunkError):  # not stored here, or not a content id
                    payload = encode_message(str(chunk))
                    head = encode_header(MISSING, stored_size=len(payload))
                else:
                    payload = chunk.data
                    head = encode_header(OK, chunk.codec, chunk.raw_size, len(payload), chunk.crc32c)
                    if self.on_read is not None:
                        self.on_read(chunk_id)
                headers.append(head)
                payloads.append(payload)
            send_all(conn, encode_batch(headers, payloads))
            start = stop


# ------------------------------------------------------------------ write sessions

_STOP = object()
# Receive buffers the server keeps for the next PUTs, over all sessions: room for the PUTs that
# one session holds at once (receiving plus store_workers storing) of a few sessions.
_SPARE_BYTES, _SPARE_MAX_BYTES = 48 << 20, 16 << 20
Ack = tuple[int, str, int]  # (status, message, free_bytes)


class _Refused(Exception):
    """A PUT this session will not take; ``error_class`` goes into the ERROR frame."""

    def __init__(self, message: str, error_class: int = E_MALFORMED) -> None:
        super().__init__(message)
        self.error_class = error_class


class _ForwardFailed(Exception):
    pass


class _Forwarder:
    """This server's write session to the next hop of a chain: PUTs out (in order), ACKS back by seq."""

    def __init__(self, address: str, token: str, io_timeout_s: float, ack_timeout_s: float) -> None:
        self.address = address
        self.ack_timeout_s = ack_timeout_s
        try:
            self.sock = socket.create_connection(split_host_port(address), timeout=min(3.0, io_timeout_s))
        except (OSError, ValueError) as exc:
            raise _ForwardFailed(f"cannot connect to {address}: {exc}") from None
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            self.sock.settimeout(io_timeout_s)
            self.sock.sendall(encode_write_hello(token))
            head = bytearray(WELCOME.size)
            recv_exact(self.sock, memoryview(head))
            magic, status, n = WELCOME.unpack(head)
            message = bytearray(n)
            recv_exact(self.sock, memoryview(message))
            if magic != WRITE_MAGIC or status != W_OK:
                raise _ForwardFailed(f"{address} refused the write session: {message.decode('utf-8', 'replace') or status}")
        except (OSError, EOFError) as exc:
            self.sock.close()
            raise _ForwardFailed(f"handshake with {address} failed: {exc}") from None
        except BaseException:
            self.sock.close()
            raise
        self._rsock = self.sock.dup()  # the reader's own object: timeouts are per object
        self.seq = 0
        self.error: str | None = None
        self._results: dict[int, list[Ack]] = {}
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="bulk-forward-acks", daemon=True)
        self._reader.start()

    def send(self, batch: PutBatch, rest: list[str]) -> int:
        assert batch.buffer is not None
        with self._send_lock:
            if self.error is not None:
                raise _ForwardFailed(self.error)
            self.seq += 1
            seq = self.seq
            try:
                send_all(self.sock, encode_put(seq, [batch.items], [batch.buffer], len(batch.buffer), encode_route(rest),
                                               count=len(batch.ids)))
            except (OSError, ValueError) as exc:
                self._fail(f"sending to {self.address} failed: {exc}")
                raise _ForwardFailed(f"sending to {self.address} failed: {exc}") from None
        return seq

    def wait(self, seq: int) -> list[Ack]:
        deadline = time.monotonic() + self.ack_timeout_s
        with self._cond:
            while seq not in self._results:
                if self.error is not None:
                    raise _ForwardFailed(self.error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _ForwardFailed(f"{self.address} sent no acks within {self.ack_timeout_s:g} s")
                self._cond.wait(min(left, 1.0))
            return self._results.pop(seq)

    def _fail(self, message: str) -> None:
        with self._cond:
            if self.error is None:
                self.error = message
            self._cond.notify_all()

    def _read(self) -> None:
        head = bytearray(ACK_HEAD.size)
        hv = memoryview(head)
        sock = self._rsock
        try:
            while True:
                sock.settimeout(1.0)
                try:
                    n = sock.recv_into(hv, ACK_HEAD.size)
                except TimeoutError:
                    if self.error is not None:
                        return
                    continue
                if n == 0:
                    raise EOFError("closed")
                frame = recv_ack_frame(sock, head, n, time.monotonic() + self.ack_timeout_s)
                if frame.kind != A_ACKS:
                    raise ProtocolError(f"{self.address} ended the forwarded session: {frame.messages.decode('utf-8', 'replace')}")
                acks = decode_acks(frame.items, frame.messages)
                with self._cond:
                    self._results[frame.seq] = acks
                    self._cond.notify_all()
        except (OSError, EOFError, ProtocolError) as exc:
            self._fail(f"forwarding to {self.address} failed: {exc}")

    def close(self) -> None:
        self._fail("closed")
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(timeout=5)
        self._rsock.close()


class _WriteSession:
    """One write connection: this thread receives PUTs, ``store_workers`` threads store them, acks go out in order."""

    def __init__(self, server: BulkServer, conn: socket.socket, peer: tuple[str, int], token: str) -> None:
        self.server = server
        self.store = server.store
        self.cfg = server.config
        self.conn = conn
        self.peer = peer
        self.token = token
        self.where = f"server {server.server_id}" if server.server_id else f"bulk server {server.address}"
        # Acks are sent on a duplicate of the socket: its timeout is its own (the receiver's changes with each read).
        self.tx = conn.dup()
        self.tx.settimeout(self.cfg.io_timeout_s)
        self.queue: queue.Queue[object] = queue.Queue(maxsize=1)  # received, waiting for a worker
        self.workers: list[threading.Thread] = []
        self._send_lock = threading.Lock()
        self._done: dict[int, bytes] = {}
        self._next_ack = 1
        self._send_failed = False
        self._forwarders: dict[str, _Forwarder | str] = {}  # next hop -> its session, or why it failed
        self._fwd_lock = threading.Lock()

    # ------------------------------------------------------------ receiving

    def run(self) -> None:
        refused: _Refused | None = None
        expected = 1
        try:
            while not self.server._stopped.is_set():
                batch = self._receive(expected)
                if batch is None:
                    break
                expected += 1
                if len(self.workers) < self.cfg.store_workers and len(self.workers) < expected - 1:
                    t = threading.Thread(target=self._work, name="bulk-store", daemon=True)
                    t.start()
                    self.workers.append(t)
                self.queue.put(batch)  # blocks while every worker is busy: we stop reading, the client's window fills
        except _Refused as exc:
            refused = exc
        except (OSError, EOFError) as exc:
            log.debug("bulk write session ended: %s", exc)
        finally:
            for _ in self.workers:
                self.queue.put(_STOP)
            for t in self.workers:
                t.join()
            if refused is not None:
                with self.server._lock:
                    self.server.write_stats["errors"] += 1
                self.server._refusals.warning("bad_put", "bulk write refused: address=%s:%s server=%s reason=%s",
                                              self.peer[0], self.peer[1], self.server.address, str(refused))
                with self._send_lock:
                    if not self._send_failed:
                        try:
                            self.tx.sendall(encode_ack_error(expected, f"{self.where}: {refused}", refused.error_class))
                        except OSError:
                            pass
            with self._fwd_lock:
                forwarders = [f for f in self._forwarders.values() if isinstance(f, _Forwarder)]
                self._forwarders.clear()
            for f in forwarders:
                f.close()
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
                raise _Refused(f"a PUT carries at most {MAX_PUT_ITEMS} chunks, got {count}; split it")
            if seq != expected:
                raise _Refused(f"PUT number {seq} out of order: expected {expected}")
            if payload_bytes > MAX_PUT_BYTES:
                raise _Refused(f"a PUT carries at most {MAX_PUT_BYTES} payload bytes, this one declares {payload_bytes}; split it")
            if route_len > MAX_ROUTE_BYTES:
                raise _Refused(f"a PUT route has at most {MAX_ROUTE_BYTES} bytes, got {route_len}")
            rest = bytearray(route_len + count * PUT_ITEM.size)
            recv_exact_by(conn, memoryview(rest), deadline)
            try:
                route = decode_route(bytes(rest[:route_len]))
                batch = PutBatch(seq, bytes(rest[route_len:]), route)
            except ProtocolError as exc:
                raise _Refused(str(exc)) from None
            if batch.payload_bytes != payload_bytes:
                raise _Refused(f"PUT {seq} declares {payload_bytes} payload bytes, its chunks {batch.payload_bytes}")
            if not self.server.budget.acquire(payload_bytes, time.monotonic() + self.cfg.io_timeout_s):
                raise _Refused(f"no room for a PUT of {payload_bytes} bytes within {self.cfg.io_timeout_s:g} s (the server's "
                               f"write buffers, {self.cfg.write_buffer_bytes} bytes, are full); retry later", E_BUSY)
            try:
                array = self._buffer(payload_bytes)
                buf: memoryview = array.data[:payload_bytes]
                recv_exact_by(conn, buf, time.monotonic() + self.cfg.io_timeout_s + payload_bytes / self.cfg.min_write_rate)
            except BaseException:
                self.server.budget.release(payload_bytes)
                raise
            batch.buffer = buf
            batch.array = array
            return batch
        except TimeoutError as exc:
            raise _Refused(f"PUT not received in time ({exc})", E_BUSY) from None

    # ------------------------------------------------------------ storing

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            batch = cast(PutBatch, item)
            try:
                frame = self._handle(batch)
            except Exception as exc:  # a bug must not take the session (or the server) down
                log.exception("bulk PUT %d failed", batch.seq)
                message = f"{self.where}: could not store the PUT: {type(exc).__name__}: {exc}"
                frame = encode_acks(batch.seq, 1 + len(batch.route), [(FAILED, message, 0)] * (len(batch.ids) * (1 + len(batch.route))))
            finally:
                self.server.budget.release(batch.payload_bytes)
                batch.buffer = None
                array, batch.array = batch.array, None
            self._recycle(array)
            self._deliver(batch.seq, frame)

    def _buffer(self, n: int) -> np.ndarray:
        """A receive buffer of at least ``n`` bytes: a spare one that fits, else a new one (uninitialised: every
        byte is received into it)."""
        server = self.server
        with server._spare_lock:
            for i, a in enumerate(server._spare):
                if n <= len(a) <= 2 * n + (1 << 20):
                    with server._lock:
                        server.write_stats["buffers_reused"] += 1
                    return server._spare.pop(i)
        return np.empty(-(-n // (1 << 20)) * (1 << 20), dtype=np.uint8)  # whole MiB: PUTs of a little more still fit

    def _recycle(self, array: object) -> None:
        """Keep ``array`` for the next PUT only when nothing else refers to it: the store may keep views of
        the bytes it was given (every memoryview of the buffer holds a reference to it), and those must
        never change. Here the only references are this frame's and getrefcount's own."""
        if not isinstance(array, np.ndarray) or sys.getrefcount(array) != 3:
            return  # 3: the caller's local, this parameter, getrefcount's argument
        if len(array) > _SPARE_MAX_BYTES:
            return
        server = self.server
        with server._spare_lock:
            spare = server._spare
            while spare and sum(len(a) for a in spare) + len(array) > _SPARE_BYTES:
                spare.pop(0)  # the oldest goes: what the PUTs of now need is kept
            spare.append(array)

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
        hops = batch.route
        waiter: tuple[_Forwarder, int] | str | None = None
        if hops:
            waiter = self._forward(batch)  # first: the next hop receives while we store
        local = self._store(batch)
        if not hops:
            return encode_acks(batch.seq, 1, local)
        n = len(batch.ids)
        down: list[Ack]
        if isinstance(waiter, tuple):
            forwarder, fseq = waiter
            try:
                down = forwarder.wait(fseq)
                if len(down) != n * len(hops):
                    raise _ForwardFailed(f"{forwarder.address} answered {len(down)} acks for {n} chunks x {len(hops)} replicas")
            except _ForwardFailed as exc:
                self._drop_forwarder(hops[0], str(exc))
                down = self._hops_failed(hops, n, str(exc))
        else:
            down = self._hops_failed(hops, n, waiter or "not forwarded")
        merged: list[Ack] = []
        for k in range(n):
            merged.append(local[k])
            merged.extend(down[k * len(hops) : (k + 1) * len(hops)])
        return encode_acks(batch.seq, 1 + len(hops), merged)

    def _hops_failed(self, hops: list[str], n: int, why: str) -> list[Ack]:
        return [(FAILED, f"{self.where} could not forward to {hop}: {why}; send it there directly", 0)
                for _k in range(n) for hop in hops]

    def _forward(self, batch: PutBatch) -> tuple[_Forwarder, int] | str:
        hop, rest = batch.route[0], batch.route[1:]
        allowed = self.server.forward_to
        if allowed is None:
            return "this server does not forward bulk writes (chain replication is off here)"
        if hop in (self.server.address,) or hop in rest or hop not in allowed():
            return f"{hop} is not the bulk address of another member"
        with self._fwd_lock:
            found = self._forwarders.get(hop)
            if found is None:
                try:
                    found = _Forwarder(hop, self.token, self.cfg.io_timeout_s, ack_timeout_s=max(60.0, 2 * self.cfg.io_timeout_s))
                except _ForwardFailed as exc:
                    found = str(exc)
                self._forwarders[hop] = found
        if isinstance(found, str):
            return found
        try:
            seq = found.send(batch, rest)
        except _ForwardFailed as exc:
            self._drop_forwarder(hop, str(exc))
            return str(exc)
        with self.server._lock:
            self.server.write_stats["forwarded"] += 1
        return found, seq

    def _drop_forwarder(self, hop: str, why: str) -> None:
        with self._fwd_lock:
            found = self._forwarders.get(hop)
            self._forwarders[hop] = why  # this session does not try that hop again
        if isinstance(found, _Forwarder):
            found.close()

    def _store(self, batch: PutBatch) -> list[Ack]:
        """Per-chunk acks of one PUT, after ``put_many`` returned (the stored chunks are durable)."""
        chunks = batch.chunks()
        n = len(chunks)
        out: list[Ack | None] = [None] * n
        first: dict[str, int] = {}
        for k, c in enumerate(chunks):
            first.setdefault(c.id, k)  # a chunk sent twice in one PUT is stored (and answered) once
        todo = sorted(first.values())
        where = self.where
        while todo:
            present = [self.store.has(chunks[k].id) for k in todo]
            try:
                results = self.store.put_many([chunks[k] for k in todo])
            except ChunkError as exc:  # invalid, damaged in transit, unknown codec: the ones before it are stored
                j = next((i for i, k in enumerate(todo) if chunks[k].id == exc.chunk_id), None)
                if j is None:
                    for k in todo:
                        out[k] = (FAILED, f"{where}: {exc}", 0)
                    break
                for i in range(j):
                    out[todo[i]] = (ALREADY_PRESENT if present[i] else STORED, "", 0)
                status = CORRUPT_IN_TRANSIT if isinstance(exc, ChunkTransferCorruptError) else INVALID
                out[todo[j]] = (status, f"{where}: {exc}", 0)
                todo = todo[j + 1 :]
                continue
            except StoreFullError as exc:
                for k in todo:
                    out[k] = (FULL, f"{where}: {exc}", exc.free_bytes)
                break
            except (ParamServerError, OSError) as exc:
                for k in todo:
                    out[k] = (FAILED, f"{where}: could not store chunk {chunks[k].id}: {exc}", 0)
                break
            for i, k in enumerate(todo):
                out[k] = (STORED if results[i] else ALREADY_PRESENT, "", 0)
            break
        acks: list[Ack] = []
        stored = nbytes = 0
        for k in range(n):
            ack = out[k] if out[k] is not None else out[first[chunks[k].id]]
            assert ack is not None
            acks.append(ack)
            if ack[0] in (STORED, ALREADY_PRESENT):
                stored += 1
                nbytes += len(chunks[k].data)
                if self.server.repair_queue is not None:
                    self.server.repair_queue.done(chunks[k].id)  # a fresh verified copy arrived
        with self.server._lock:
            stats = self.server.write_stats
            stats["puts"] += 1
            stats["chunks"] += stored
            stats["bytes"] += nbytes
        return acks


__all__ = ["CONFIG_KEYS", "BulkServer", "BulkServerConfig", "check_token", "check_write_token"]
