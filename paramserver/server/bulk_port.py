"""The bulk read port of a server: answers the protocol of ``paramserver.wire.bulk_frames``.

Reads go through ``ChunkStore.get`` (hot cache, CRC32C checked on every disk read): a corrupt
chunk is answered CORRUPT and never sent, and the store quarantines it and queues its repair
exactly as on the gRPC path. Tokens follow the gRPC rule for reads.

Silent or slow clients cannot fill the port: the hello must arrive in full within
``hello_timeout_s`` (a deadline for the whole hello, not per byte), and one client IP holds at
most ``max_per_ip`` connections. A refused connection is answered "bad hello" with the reason
and logged at WARNING with its address (at most one line per reason every few seconds).
"""
from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Mapping

from paramserver.server.auth import AuthConfig
from paramserver.server.dataplane import RateLimitedLog
from paramserver.server.errors import ChunkCorruptError, ChunkNotFoundError, ConfigError, InvalidChunkError
from paramserver.server.store import ChunkStore
from paramserver.wire.auth import ADMIN_TOKEN_ENV, READ_TOKEN_ENV
from paramserver.wire.bulk_frames import (
    CORRUPT, ERROR, HELLO, ID_BYTES, MAGIC, MAX_BATCH_ITEMS, MAX_IDS, MAX_TOKEN_BYTES, MISSING, OK, REQUEST, SEND_BATCH_BYTES,
    SOCKET_BUFFER_BYTES, VERSION, W_BAD_HELLO, W_OK, W_UNAUTHENTICATED, ProtocolError, encode_batch, encode_header, encode_message,
    encode_welcome, send_all,
)

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class BulkServerConfig:
    max_connections: int = 64
    idle_timeout_s: float = 300.0  # a connection with no request for this long is closed
    io_timeout_s: float = 30.0  # one send or the rest of a frame must not take longer
    hello_timeout_s: float = 5.0  # the whole hello must arrive within this
    max_per_ip: int = 16  # connections one client address may hold

    def validate(self) -> BulkServerConfig:
        if not 1 <= self.max_connections <= 4096:
            raise ConfigError(f"bulk max_connections must be 1..4096, got {self.max_connections}")
        if not 1 <= self.max_per_ip <= 4096:
            raise ConfigError(f"bulk max_per_ip must be 1..4096, got {self.max_per_ip}")
        if self.idle_timeout_s <= 0 or self.io_timeout_s <= 0 or self.hello_timeout_s <= 0:
            raise ConfigError("bulk idle_timeout_s, io_timeout_s and hello_timeout_s must be > 0")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> BulkServerConfig:
        """From a server config file's extra keys ``bulk_max_connections``, ``bulk_max_per_ip``,
        ``bulk_hello_timeout_s``, ``bulk_idle_timeout_s`` and ``bulk_io_timeout_s``."""
        values: dict[str, float | int] = {}
        for name, kind in (("max_connections", int), ("max_per_ip", int), ("hello_timeout_s", float),
                           ("idle_timeout_s", float), ("io_timeout_s", float)):
            value = extra.get(f"bulk_{name}")
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
                raise ConfigError(f"bulk_{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
            values[name] = kind(value)
        return cls(**values).validate()  # type: ignore[arg-type]


def _recv_by(conn: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes that must all arrive before ``deadline`` (time.monotonic): TimeoutError else."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{got} of {n} bytes arrived in time")
        conn.settimeout(left)
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


class BulkServer:
    """Threaded TCP server of the bulk read protocol; a thread per connection, bounded."""

    def __init__(self, store: ChunkStore, auth: AuthConfig, listen: str = "127.0.0.1:0",
                 config: BulkServerConfig = BulkServerConfig()) -> None:
        self.store = store
        self.auth = auth.validate()
        self.config = config.validate()
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"bulk listen address must be HOST:PORT (port 0 picks a free one), got {listen!r}")
        self._sock = socket.create_server((host.strip("[]"), int(port)), backlog=128, reuse_port=False)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(self.config.max_connections)
        self._per_ip: dict[str, int] = {}  # open connections by client address (under _lock)
        self._peer_of: dict[socket.socket, tuple[str, int]] = {}  # accepted, until its thread takes it
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
        while not self._stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed by stop()
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
            if not self._slots.acquire(blocking=False):
                self._drop_ip(ip)
                self._refuse(conn, peer, "connection_limit",
                             f"too many bulk connections (limit {self.config.max_connections}); use GetChunks or retry later")
                continue
            with self._lock:
                self._peer_of[conn] = (ip, int(peer[1]) if len(peer) > 1 else 0)
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
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            try:
                ok = self._handshake(conn, peer)
            except TimeoutError:
                self._log_refusal(peer, "hello_timeout", f"no complete hello within {self.config.hello_timeout_s:g} s")
                return
            conn.settimeout(self.config.io_timeout_s)
            if ok:
                self._requests(conn)
        except (OSError, EOFError, ProtocolError) as exc:
            log.debug("bulk connection ended: %s", exc)
        except Exception:
            log.exception("bulk connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._drop_ip(str(peer[0]))
            self._slots.release()

    def _handshake(self, conn: socket.socket, peer: tuple[str, int]) -> bool:
        deadline = time.monotonic() + self.config.hello_timeout_s
        magic, version, token_len = HELLO.unpack(_recv_by(conn, HELLO.size, deadline))
        if magic != MAGIC:
            return self._turn_away(conn, peer, W_BAD_HELLO, "bad_hello",
                                   "not a bulk hello (bad magic): this port speaks the paramserver bulk protocol, "
                                   "use the gRPC port for gRPC")
        if version != VERSION or token_len > MAX_TOKEN_BYTES:
            return self._turn_away(conn, peer, W_BAD_HELLO, "bad_hello", f"bulk protocol version {version} is not served here "
                                                                         f"(this server speaks {VERSION}); fall back to GetChunks")
        token = _recv_by(conn, token_len, deadline).decode("utf-8", "replace")
        conn.settimeout(self.config.io_timeout_s)
        problem = check_token(token, self.auth)
        if problem is not None:
            return self._turn_away(conn, peer, W_UNAUTHENTICATED, "unauthenticated", problem)
        conn.sendall(encode_welcome(W_OK))
        return True

    def _turn_away(self, conn: socket.socket, peer: tuple[str, int], status: int, reason: str, message: str) -> bool:
        self._log_refusal(peer, reason, message)
        conn.settimeout(self.config.io_timeout_s)
        conn.sendall(encode_welcome(status, message))
        return False

    def _error(self, conn: socket.socket, message: str) -> None:
        raw = encode_message(message)
        send_all(conn, encode_batch([encode_header(ERROR, stored_size=len(raw))], [raw]))

    def _requests(self, conn: socket.socket) -> None:
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
            self._answer(conn, [raw_ids[i : i + ID_BYTES].hex() for i in range(0, len(raw_ids), ID_BYTES)])

    def _answer(self, conn: socket.socket, ids: list[str]) -> None:
        headers: list[bytes] = []
        payloads: list[bytes | memoryview] = []
        batch_bytes = 0
        for chunk_id in ids:
            try:
                chunk = self.store.get(chunk_id)
            except ChunkNotFoundError as exc:
                payload = encode_message(str(exc))
                head = encode_header(MISSING, stored_size=len(payload))
            except ChunkCorruptError as exc:  # the store quarantined it and queued a repair
                payload = encode_message(str(exc))
                head = encode_header(CORRUPT, stored_size=len(payload))
            except InvalidChunkError as exc:
                payload = encode_message(str(exc))
                head = encode_header(MISSING, stored_size=len(payload))
            else:
                payload = chunk.data
                head = encode_header(OK, chunk.codec, chunk.raw_size, len(payload), chunk.crc32c)
            headers.append(head)
            payloads.append(payload)
            batch_bytes += len(payload)
            if batch_bytes >= SEND_BATCH_BYTES or len(headers) >= MAX_BATCH_ITEMS:
                send_all(conn, encode_batch(headers, payloads))
                headers, payloads, batch_bytes = [], [], 0
        if headers:
            send_all(conn, encode_batch(headers, payloads))


__all__ = ["BulkServer", "BulkServerConfig", "check_token"]
