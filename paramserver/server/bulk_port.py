"""The bulk read port of a server: answers the protocol of ``paramserver.wire.bulk_frames``.

Reads go through ``ChunkStore.get`` (hot cache, CRC32C checked on every disk read): a corrupt
chunk is answered CORRUPT and never sent, and the store quarantines it and queues its repair
exactly as on the gRPC path. Tokens follow the gRPC rule for reads.
"""
from __future__ import annotations

import hmac
import logging
import socket
import threading
from dataclasses import dataclass

from paramserver.server.auth import AuthConfig
from paramserver.server.errors import ChunkCorruptError, ChunkNotFoundError, ConfigError, InvalidChunkError
from paramserver.server.store import ChunkStore
from paramserver.wire.auth import ADMIN_TOKEN_ENV, READ_TOKEN_ENV
from paramserver.wire.bulk_frames import (
    CORRUPT, ERROR, HELLO, ID_BYTES, MAGIC, MAX_BATCH_ITEMS, MAX_IDS, MAX_TOKEN_BYTES, MISSING, OK, REQUEST, SEND_BATCH_BYTES,
    SOCKET_BUFFER_BYTES, VERSION, W_BAD_HELLO, W_OK, W_UNAUTHENTICATED, ProtocolError, encode_batch, encode_header, encode_message,
    encode_welcome, recv_bytes, send_all,
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

    def validate(self) -> BulkServerConfig:
        if not 1 <= self.max_connections <= 4096:
            raise ConfigError(f"bulk max_connections must be 1..4096, got {self.max_connections}")
        if self.idle_timeout_s <= 0 or self.io_timeout_s <= 0:
            raise ConfigError("bulk idle_timeout_s and io_timeout_s must be > 0")
        return self


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
                conn, _peer = self._sock.accept()
            except OSError:
                return  # closed by stop()
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, f"too many bulk connections (limit {self.config.max_connections}); use GetChunks or retry later")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="bulk-conn", daemon=True).start()

    @staticmethod
    def _refuse(conn: socket.socket, message: str) -> None:
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
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            conn.settimeout(self.config.io_timeout_s)
            if self._handshake(conn):
                self._requests(conn)
        except (OSError, EOFError, ProtocolError) as exc:
            log.debug("bulk connection ended: %s", exc)
        except Exception:
            log.exception("bulk connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _handshake(self, conn: socket.socket) -> bool:
        magic, version, token_len = HELLO.unpack(recv_bytes(conn, HELLO.size))
        if magic != MAGIC:
            conn.sendall(encode_welcome(W_BAD_HELLO, "not a bulk hello (bad magic): this port speaks the paramserver bulk protocol, "
                                                     "use the gRPC port for gRPC"))
            return False
        if version != VERSION or token_len > MAX_TOKEN_BYTES:
            conn.sendall(encode_welcome(W_BAD_HELLO, f"bulk protocol version {version} is not served here "
                                                     f"(this server speaks {VERSION}); fall back to GetChunks"))
            return False
        token = recv_bytes(conn, token_len).decode("utf-8", "replace")
        problem = check_token(token, self.auth)
        if problem is not None:
            conn.sendall(encode_welcome(W_UNAUTHENTICATED, problem))
            return False
        conn.sendall(encode_welcome(W_OK))
        return True

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
            conn.settimeout(self.config.io_timeout_s)
            if len(first) < REQUEST.size:
                first += recv_bytes(conn, REQUEST.size - len(first))
            (count,) = REQUEST.unpack(first)
            if count == 0:
                return
            if count > MAX_IDS:
                self._error(conn, f"a bulk request carries at most {MAX_IDS} ids, got {count}; split it")
                return
            try:
                raw_ids = recv_bytes(conn, count * ID_BYTES)
            except EOFError:
                return  # truncated request: nothing to answer
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
