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
(``on_corrupt``) exactly as on the gRPC path. Tokens follow paramserver.server.auth: when a read token
is set, the read or the admin token is needed; with no read token reads are open.
"""
from __future__ import annotations

import socket
import struct
from typing import Sequence

from paramserver.wire.errors import ConfigError
from paramserver.wire.limits import MAX_CODEC_LEN

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


def encode_batch(headers: list[bytes], payloads: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """The buffers of one BATCH (for sendmsg): its head and headers joined, then the payloads."""
    size = sum(len(p) for p in payloads)
    return [BATCH.pack(len(headers), size) + b"".join(headers), *payloads]


def encode_message(text: str) -> bytes:
    """A MISSING / CORRUPT / ERROR payload, cut to the protocol's limit."""
    return text.encode()[:MAX_MESSAGE_BYTES]



__all__ = [
    "BATCH", "CORRUPT", "ERROR", "HEADER", "HELLO", "MAGIC", "MAX_BATCH_BYTES", "MAX_BATCH_ITEMS", "MAX_CHUNK_BYTES", "MAX_IDS",
    "MAX_MESSAGE_BYTES", "MISSING", "OK", "REQUEST", "STATUS_NAMES", "VERSION", "WELCOME", "W_BAD_HELLO", "W_OK",
    "W_UNAUTHENTICATED", "ProtocolError", "decode_header", "encode_batch", "encode_header", "encode_hello", "encode_message",
    "encode_request",
    "encode_welcome", "recv_bytes", "recv_exact", "recv_into_all", "send_all",
]
