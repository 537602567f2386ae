"""Bulk chunk reads over plain TCP: the fast path for chunk bytes, next to gRPC GetChunks.

Why: gRPC-Python's receive path costs 1-2 ns per byte on each side; a loopback TCP stream
read with ``recv_into`` a preallocated buffer costs a fraction of that. gRPC stays the wire
contract and the control plane: this port only *reads* chunks, it is advertised in the
member record (``bulk_address``), it is off when TLS is configured (it has no encryption),
and clients fall back to GetChunks on any error here.

Protocol, version 2. All integers little-endian; one TCP connection per (client, server),
long-lived and reused for many requests.

    client -> server  HELLO    magic "PDBK" | version u16 | token_len u16 | token (utf-8, <= 1024 B)
    server -> client  WELCOME  magic "PDBK" | status u8 (0 ok, 1 unauthenticated, 2 bad hello)
                               | msg_len u16 | message (utf-8)
                      Not ok: the server closes the connection after the message.
    client -> server  REQUEST  count u32 (1..MAX_IDS) | count x 32-byte binary chunk ids
                      count 0 is a polite goodbye: the server closes the connection.
    server -> client  the answers for the requested ids, in request order, in BATCHes:
                      BATCH    count u32 (1..MAX_BATCH_ITEMS) | payload_bytes u32
                               | count x HEADER | the count payloads back to back
                      HEADER   status u8 | codec_len u8 | codec 18s (ascii, zero padded)
                               | raw_size u64 | stored_size u64 | crc32c u32       (40 bytes)
                      payload  ``stored_size`` bytes: the stored (encoded) chunk when status is
                               OK; a utf-8 message saying why when MISSING or CORRUPT.
                      payload_bytes is the sum of the batch's stored_size fields.
                      ERROR (status 3) in a header: the request was malformed (bad count,
                      truncated ids); its payload is the message; the server closes.

Why batches (version 1 sent a header before each chunk): the client learns where a whole
batch (~4 MiB) goes from one small read, then receives all of it with one scatter read
(``recvmsg_into``) straight into the destination buffers: two system calls and a few
Python steps per batch instead of two calls per chunk.

Reads go through ``ChunkStore.get`` (hot cache, CRC32C checked on every disk read): a corrupt
chunk is answered CORRUPT and never sent, and the store quarantines it and queues its repair
(``on_corrupt``) exactly as on the gRPC path. Tokens follow paramserver.auth: when a read token
is set, the read or the admin token is needed; with no read token reads are open.
"""
from __future__ import annotations

import hmac
import logging
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Sequence

from .auth import ADMIN_TOKEN_ENV, READ_TOKEN_ENV, AuthConfig
from .errors import ChunkCorruptError, ChunkNotFoundError, ConfigError, InvalidChunkError
from .store import MAX_CODEC_LEN, ChunkStore

log = logging.getLogger(__name__)

MAGIC = b"PDBK"
VERSION = 2
MAX_TOKEN_BYTES = 1024
MAX_IDS = 4096
ID_BYTES = 32

HELLO = struct.Struct("<4sHH")
WELCOME = struct.Struct("<4sBH")
REQUEST = struct.Struct("<I")
HEADER = struct.Struct(f"<BB{MAX_CODEC_LEN}sQQI")  # 40 bytes
BATCH = struct.Struct("<II")
MAX_BATCH_ITEMS = 64  # well under IOV_MAX (1024) for the client's scatter read
MAX_MESSAGE_BYTES = 4096  # a MISSING / CORRUPT / ERROR payload
MAX_CHUNK_BYTES = 65 << 20  # chunking's largest chunk is 64 MiB
# A server closes a batch once it holds SEND_BATCH_BYTES (or MAX_BATCH_ITEMS), so no batch is
# larger than that plus one chunk; a client refuses a batch declaring more than this.
MAX_BATCH_BYTES = (16 << 20) + MAX_CHUNK_BYTES

# WELCOME status
W_OK, W_UNAUTHENTICATED, W_BAD_HELLO = 0, 1, 2
# per-chunk HEADER status
OK, MISSING, CORRUPT, ERROR = 0, 1, 2, 3
STATUS_NAMES = {OK: "OK", MISSING: "MISSING", CORRUPT: "CORRUPT", ERROR: "ERROR"}

# Close a batch at this much chunk data: one sendmsg, no copies, and one scatter read for the client.
SEND_BATCH_BYTES = 2 << 20
SOCKET_BUFFER_BYTES = 8 << 20


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow."""


def encode_hello(token: str | None) -> bytes:
    raw = (token or "").encode()
    if len(raw) > MAX_TOKEN_BYTES:
        raise ConfigError(f"token is {len(raw)} bytes; the bulk protocol takes at most {MAX_TOKEN_BYTES}")
    return HELLO.pack(MAGIC, VERSION, len(raw)) + raw


def encode_welcome(status: int, message: str = "") -> bytes:
    raw = message.encode()[:4096]
    return WELCOME.pack(MAGIC, status, len(raw)) + raw


def encode_request(ids: Sequence[str]) -> bytes:
    if not 0 < len(ids) <= MAX_IDS:
        raise ValueError(f"a bulk request carries 1..{MAX_IDS} ids, got {len(ids)}; split it")
    raw = [bytes.fromhex(i) for i in ids]
    if any(len(r) != ID_BYTES for r in raw):
        raise ValueError(f"bulk requests carry {ID_BYTES}-byte content ids (64 hex digits)")
    return REQUEST.pack(len(ids)) + b"".join(raw)


def encode_header(status: int, codec: str = "", raw_size: int = 0, stored_size: int = 0, crc: int = 0) -> bytes:
    c = codec.encode("ascii")
    return HEADER.pack(status, len(c), c, raw_size, stored_size, crc)


def decode_header(buf: bytes | memoryview) -> tuple[int, str, int, int, int]:
    """(status, codec, raw_size, stored_size, crc32c); ProtocolError when it cannot be a header."""
    status, codec_len, codec, raw_size, stored_size, crc = HEADER.unpack(buf)
    if status not in STATUS_NAMES or codec_len > MAX_CODEC_LEN:
        raise ProtocolError(f"bad chunk header (status {status}, codec length {codec_len})")
    return status, bytes(codec[:codec_len]).decode("ascii", "replace"), raw_size, stored_size, crc


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOFError when the peer closes first."""
    n = len(view)
    # MSG_WAITALL: most chunks arrive in one call instead of a loop of partial reads
    got = sock.recv_into(view, n, socket.MSG_WAITALL)
    while got < n:
        if got == 0 and n:
            raise EOFError(f"connection closed after 0 of {n} bytes")
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_into_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view, in order, with scatter reads; EOFError when the peer closes first."""
    pending = [v for v in views if len(v)]
    want = sum(len(v) for v in pending)
    got = 0
    while pending:
        n = sock.recvmsg_into(pending, 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise EOFError(f"connection closed after {got} of {want} bytes")
        got += n
        k = 0
        while k < len(pending) and n >= len(pending[k]):
            n -= len(pending[k])
            k += 1
        pending = pending[k:]
        if n:
            pending[0] = pending[0][n:]


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def send_all(sock: socket.socket, buffers: list[bytes | memoryview]) -> None:
    """sendmsg that finishes partial sends, without joining the buffers."""
    bufs: list[bytes | memoryview] = list(buffers)
    while bufs:
        sent = sock.sendmsg(bufs)
        while bufs and sent >= len(bufs[0]):
            sent -= len(bufs[0])
            bufs.pop(0)
        if bufs and sent:
            bufs[0] = memoryview(bufs[0])[sent:]


def check_token(token: str, auth: AuthConfig) -> str | None:
    """None when reads are allowed with ``token``, else the message (never echoing the token).

    The rule of paramserver.auth for reads: open without a read token; otherwise the read
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
        except Exception:  # noqa: BLE001 - one connection's failure must not end the server
            log.exception("bulk connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _handshake(self, conn: socket.socket) -> bool:
        magic, version, token_len = HELLO.unpack(recv_bytes(conn, HELLO.size))
        if magic != MAGIC:
            conn.sendall(encode_welcome(W_BAD_HELLO, "not a bulk hello (bad magic): this port speaks the paramserver bulk protocol, use the gRPC port for gRPC"))
            return False
        if version != VERSION or token_len > MAX_TOKEN_BYTES:
            conn.sendall(encode_welcome(W_BAD_HELLO, f"bulk protocol version {version} is not served here (this server speaks {VERSION}); fall back to GetChunks"))
            return False
        token = recv_bytes(conn, token_len).decode("utf-8", "replace")
        problem = check_token(token, self.auth)
        if problem is not None:
            conn.sendall(encode_welcome(W_UNAUTHENTICATED, problem))
            return False
        conn.sendall(encode_welcome(W_OK))
        return True

    def _error(self, conn: socket.socket, message: str) -> None:
        raw = _message(message)
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
                payload = _message(str(exc))
                head = encode_header(MISSING, stored_size=len(payload))
            except ChunkCorruptError as exc:  # the store quarantined it and queued a repair
                payload = _message(str(exc))
                head = encode_header(CORRUPT, stored_size=len(payload))
            except InvalidChunkError as exc:
                payload = _message(str(exc))
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


def encode_batch(headers: list[bytes], payloads: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """The buffers of one BATCH (for sendmsg): its head and headers joined, then the payloads."""
    size = sum(len(p) for p in payloads)
    return [BATCH.pack(len(headers), size) + b"".join(headers), *payloads]


def _message(text: str) -> bytes:
    return text.encode()[:MAX_MESSAGE_BYTES]



__all__ = [
    "BulkServer", "BulkServerConfig", "ProtocolError", "MAGIC", "VERSION", "MAX_IDS", "HEADER", "HELLO", "WELCOME",
    "REQUEST", "BATCH", "MAX_BATCH_ITEMS", "MAX_BATCH_BYTES", "MAX_CHUNK_BYTES", "MAX_MESSAGE_BYTES", "encode_batch", "OK", "MISSING", "CORRUPT", "ERROR", "STATUS_NAMES", "W_OK", "W_UNAUTHENTICATED", "W_BAD_HELLO",
    "encode_hello", "encode_welcome", "encode_request", "encode_header", "decode_header", "recv_exact", "recv_into_all", "check_token",
]
