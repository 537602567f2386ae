"""Bulk chunk reads and writes over plain TCP: the fast path for chunk bytes, next to gRPC
GetChunks and PutChunks.

Why: gRPC-Python's receive path costs 1-2 ns per byte on each side; a loopback TCP stream
read with ``recv_into`` a preallocated buffer costs a fraction of that. gRPC stays the wire
contract and the control plane: this port only moves chunk bytes (reads, and writes in write
sessions, below), it is advertised in the member record (``bulk_address``), it is off when TLS
is configured (it has no encryption), and clients fall back to GetChunks / PutChunks on any
error here.

Read protocol, version 3 (version 2 is the same with at most 64 items per batch; servers serve
both, a client whose version-3 hello is refused says hello again in version 2). All integers
little-endian; one TCP connection per (client, server), long-lived and reused for many requests.

    client -> server  HELLO    magic "PDBK" | version u16 | token_len u16 | token (utf-8, <= 1024 B)
    server -> client  WELCOME  magic "PDBK" | status u8 (0 ok, 1 unauthenticated, 2 bad hello)
                               | msg_len u16 | message (utf-8)
                      Not ok: the server closes the connection after the message.
    client -> server  REQUEST  count u32 (1..MAX_IDS) | count x 32-byte binary chunk ids
                      count 0 is a polite goodbye: the server closes the connection.
    server -> client  the answers for the requested ids, in request order, in BATCHes:
                      BATCH    count u32 (1..batch_items(version)) | payload_bytes u32
                               | count x HEADER | the count payloads back to back
                      HEADER   status u8 | codec_len u8 | codec 18s (ascii, zero padded)
                               | raw_size u64 | stored_size u64 | crc32c u32       (40 bytes)
                      payload  ``stored_size`` bytes: the stored (encoded) chunk when status is
                               OK; a utf-8 message saying why when MISSING or CORRUPT.
                      payload_bytes is the sum of the batch's stored_size fields.
                      ERROR (status 3) in a header: the request was malformed (bad count,
                      truncated ids); its payload is the message; the server closes.

Why batches (version 1 sent a header before each chunk): the client learns where a whole
batch (~2 MiB) goes from one small read, then receives all of it with one scatter read
(``recvmsg_into``) straight into the destination buffers: two system calls and a few
Python steps per batch instead of two calls per chunk. Version 3 lets a batch of 4 KiB chunks
fill those 2 MiB (512 items, not 64), so the steps per batch are paid an eighth as often.

Reads go through ``ChunkStore.get`` (hot cache, CRC32C checked on every disk read): a corrupt
chunk is answered CORRUPT and never sent, and the store quarantines it and queues its repair
(``on_corrupt``) exactly as on the gRPC path. Tokens follow paramserver.server.auth: when a read token
is set, the read or the admin token is needed; with no read token reads are open.

Write sessions (bulk write protocol, version 1), on the same port. A connection whose hello
carries the magic "PDBW" instead of "PDBK" is a write session; reads (PDBK, version 2) are
unchanged. Writes need the admin token (paramserver.server.auth: open only when the server has
no admin token); the read token is not enough.

    client -> server  HELLO    magic "PDBW" | version u16 (WRITE_VERSION) | token_len u16 | token
    server -> client  WELCOME  magic "PDBW" | status u8 | msg_len u16 | message    (as for reads;
                      a server without bulk writes answers a PDBK welcome "bad hello": the
                      client falls back to gRPC PutChunks)
    client -> server  PUT      PUT_HEAD: count u32 (0..MAX_PUT_ITEMS) | seq u32 | payload_bytes u64
                               | route_len u32 (<= MAX_ROUTE_BYTES)
                               | route (utf-8: the bulk addresses this batch is to be forwarded to,
                                 in chain order, separated by ","; empty: store here only)
                               | count x PUT_ITEM | the count payloads back to back
                      PUT_ITEM id 32s (binary content id) | flags u8 (0) | codec_len u8 | codec 18s
                               | raw_size u64 | stored_size u64 | crc32c u32          (72 bytes)
                      seq: 1, 2, 3, ... per connection; payload_bytes = the sum of stored_size,
                      at most MAX_PUT_BYTES; a stored_size at most MAX_CHUNK_BYTES.
                      count 0 is a goodbye: the server answers what it holds, then closes.
    server -> client  ACKS     ACK_HEAD: kind u8 (A_ACKS) | pad | replicas u16 | seq u32 | count u32
                               | msg_bytes u32 | count x replicas x ACK_ITEM | messages
                      ACK_ITEM status u8 | pad | msg_len u16 | free_bytes u64             (12 bytes)
                      One ACKS per PUT, in PUT order, sent only once every chunk it acknowledges
                      is durable (fsync, or written with --no-fsync). Items are chunk-major: for
                      chunk k, replica 0 (this server), then each hop of the route in order.
                      status: STORED, ALREADY_PRESENT, or an error naming the chunk in its message:
                      INVALID (bytes do not match the id, bad codec, raw size over the cap),
                      CORRUPT_IN_TRANSIT (CRC32C of the received bytes is wrong: send it again),
                      FULL (free_bytes: what that server's disk has left), FAILED (the server
                      could not store or forward it: retry elsewhere or later).
                      ERROR    ACK_HEAD with kind A_ERROR, count 0, replicas = its class
                               (E_MALFORMED: the PUT broke the protocol - counts, sizes, seq, time;
                               E_BUSY: no room for it in time), the message; the server closes after it.

A batch is received with one read of its head and items and one read of all its payloads
straight into one buffer, stored with one ``ChunkStore.put_many`` (one group fsync) and answered
with one ACKS: a few system calls and Python steps per batch, none per byte.
"""
from __future__ import annotations

import socket
import struct
import time
from typing import Sequence

import numpy as np

from chunking.hashing import hex_ids
from paramserver.wire.chunk_record import ChunkRecord
from paramserver.wire.errors import ConfigError, ProtocolError  # ProtocolError: re-exported, its home is errors
from paramserver.wire.limits import MAX_CODEC_LEN

MAGIC = b"PDBK"
VERSION = 3
READ_VERSIONS = (2, 3)  # what a server serves
MAX_TOKEN_BYTES = 1024
MAX_IDS = 4096
ID_BYTES = 32

HELLO = struct.Struct("<4sHH")
WELCOME = struct.Struct("<4sBH")
REQUEST = struct.Struct("<I")
HEADER = struct.Struct(f"<BB{MAX_CODEC_LEN}sQQI")  # 40 bytes
BATCH = struct.Struct("<II")
MAX_BATCH_ITEMS = 512  # version 3; under IOV_MAX (1024) for the client's scatter read
_BATCH_ITEMS = {2: 64, 3: MAX_BATCH_ITEMS}
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


# ---- write sessions (see the module docstring)
WRITE_MAGIC = b"PDBW"
WRITE_VERSION = 1
PUT_HEAD = struct.Struct("<IIQI")  # count, seq, payload_bytes, route_len (20 bytes)
PUT_ITEM = struct.Struct(f"<32sBB{MAX_CODEC_LEN}sQQI")  # 72 bytes
ACK_HEAD = struct.Struct("<BxHIII")  # kind, replicas (ERROR: its class), seq, count, msg_bytes (16 bytes)
ACK_ITEM = struct.Struct("<BxHQ")  # status, msg_len, free_bytes (12 bytes)
# The same layouts as numpy dtypes: a whole batch's items are decoded in one call.
PUT_ITEM_DTYPE = np.dtype([("id", "V32"), ("flags", "u1"), ("codec_len", "u1"), ("codec", f"S{MAX_CODEC_LEN}"),
                           ("raw_size", "<u8"), ("stored_size", "<u8"), ("crc", "<u4")])
ACK_ITEM_DTYPE = np.dtype([("status", "u1"), ("pad", "u1"), ("msg_len", "<u2"), ("free_bytes", "<u8")])
assert PUT_ITEM_DTYPE.itemsize == PUT_ITEM.size and ACK_ITEM_DTYPE.itemsize == ACK_ITEM.size
MAX_PUT_ITEMS = 512  # chunks per PUT: with the head, the client's sendmsg stays under IOV_MAX (1024)
MAX_PUT_BYTES = MAX_BATCH_BYTES  # payload of one PUT: 16 MiB of small chunks, or one chunk of up to 64 MiB
MAX_ROUTE_BYTES = 1024
MAX_ROUTE_HOPS = 8
# ACK kinds and per-chunk statuses
A_ACKS, A_ERROR = 0, 1
# ERROR classes (the replicas field of an ERROR frame): the PUT broke the protocol / the server is busy
E_MALFORMED, E_BUSY = 0, 1
STORED, ALREADY_PRESENT, INVALID, CORRUPT_IN_TRANSIT, FULL, FAILED = 0, 1, 2, 3, 4, 5
ACK_NAMES = {STORED: "STORED", ALREADY_PRESENT: "ALREADY_PRESENT", INVALID: "INVALID",
             CORRUPT_IN_TRANSIT: "CORRUPT_IN_TRANSIT", FULL: "FULL", FAILED: "FAILED"}
ACK_OK = frozenset({STORED, ALREADY_PRESENT})
# The client keeps at most this many PUTs in flight per connection unless told otherwise.
DEFAULT_WRITE_WINDOW = 8


def batch_items(version: int) -> int:
    """The most items a BATCH may hold on a read connection of that protocol version."""
    return _BATCH_ITEMS[version]


def encode_hello(token: str | None, version: int = VERSION) -> bytes:
    raw = (token or "").encode()
    if len(raw) > MAX_TOKEN_BYTES:
        raise ConfigError(f"token is {len(raw)} bytes; the bulk protocol takes at most {MAX_TOKEN_BYTES}")
    return HELLO.pack(MAGIC, version, len(raw)) + raw


def encode_welcome(status: int, message: str = "") -> bytes:
    raw = message.encode()[:4096]
    return WELCOME.pack(MAGIC, status, len(raw)) + raw


def encode_request(ids: Sequence[str]) -> bytes:
    # One conversion for the whole request (thousands of 4 KiB chunks' ids), after a length check
    # of each id so that ids of wrong lengths cannot run together into valid-looking ones.
    if set(map(len, ids)) != {2 * ID_BYTES}:
        raise ValueError(f"bulk requests carry {ID_BYTES}-byte content ids (64 hex digits)")
    return encode_request_digests(np.frombuffer(bytes.fromhex("".join(ids)), dtype=np.uint8).reshape(-1, ID_BYTES))


def encode_request_digests(digests: np.ndarray) -> bytes:
    """A REQUEST for the binary ids in the rows of ``digests`` (an (n, 32) uint8 array)."""
    if not 0 < len(digests) <= MAX_IDS:
        raise ValueError(f"a bulk request carries 1..{MAX_IDS} ids, got {len(digests)}; split it")
    if digests.ndim != 2 or digests.shape[1] != ID_BYTES:
        raise ValueError(f"bulk requests carry {ID_BYTES}-byte content ids")
    return REQUEST.pack(len(digests)) + np.ascontiguousarray(digests, dtype=np.uint8).tobytes()


def encode_header(status: int, codec: str = "", raw_size: int = 0, stored_size: int = 0, crc: int = 0) -> bytes:
    c = codec.encode("ascii")
    return HEADER.pack(status, len(c), c, raw_size, stored_size, crc)


def decode_header(buf: bytes | memoryview) -> tuple[int, str, int, int, int]:
    """(status, codec, raw_size, stored_size, crc32c); ProtocolError when it cannot be a header."""
    if len(buf) != HEADER.size:
        raise ProtocolError(f"a chunk header is {HEADER.size} bytes, got {len(buf)}")
    return decode_headers(buf)[0]


def decode_headers(buf: bytes | bytearray | memoryview) -> list[tuple[int, str, int, int, int]]:
    """``decode_header`` of each header packed in ``buf`` (a batch's): ``decode_header_columns`` as rows."""
    h = decode_header_columns(buf)
    return list(zip(h.status.tolist(), h.codecs, h.raw_size.tolist(), h.stored_size.tolist(), h.crc32c.tolist()))


# HEADER as a numpy record, to decode a batch's headers as columns
HEADER_DTYPE = np.dtype([("status", "u1"), ("codec_len", "u1"), ("codec", f"S{MAX_CODEC_LEN}"), ("raw_size", "<u8"),
                         ("stored_size", "<u8"), ("crc32c", "<u4")])
assert HEADER_DTYPE.itemsize == HEADER.size


class Headers:
    """A batch's headers as columns (``decode_header_columns``); ``codecs`` are names, one per header."""

    __slots__ = ("codecs", "crc32c", "raw_size", "status", "stored_size", "is_raw")

    def __init__(self, status: np.ndarray, codecs: list[str], is_raw: np.ndarray, raw_size: np.ndarray,
                 stored_size: np.ndarray, crc32c: np.ndarray) -> None:
        self.status = status
        self.codecs = codecs
        self.is_raw = is_raw
        self.raw_size = raw_size
        self.stored_size = stored_size
        self.crc32c = crc32c


def decode_header_columns(buf: bytes | bytearray | memoryview) -> Headers:
    """A batch's headers as columns, with one array pass per field (ProtocolError when one cannot be
    a header): a batch of 4 KiB chunks pays little per header beyond its codec name's look-up."""
    if len(buf) % HEADER.size:
        raise ProtocolError(f"chunk headers are {HEADER.size} bytes each, got {len(buf)} bytes")
    rec = np.frombuffer(buf, dtype=HEADER_DTYPE)
    status, codec_len, codec = rec["status"], rec["codec_len"], rec["codec"]
    if len(rec) and (int(status.max()) >= len(STATUS_NAMES) or int(codec_len.max()) > MAX_CODEC_LEN
                     or bool((np.char.str_len(codec) != codec_len).any())):
        bad = int(np.flatnonzero((status >= len(STATUS_NAMES)) | (codec_len > MAX_CODEC_LEN)
                                 | (np.char.str_len(codec) != codec_len))[0])
        raise ProtocolError(f"bad chunk header (status {int(status[bad])}, codec length {int(codec_len[bad])})")
    raw_size, stored_size = rec["raw_size"], rec["stored_size"]
    if len(rec) and max(int(raw_size.max()), int(stored_size.max())) >= 1 << 62:
        raise ProtocolError("a chunk header declares a size beyond any chunk")
    names = []
    for raw in codec.tolist():
        name = _CODEC_BY_BYTES.get(raw)
        if name is None:
            name = raw.decode("ascii", "replace")
            if len(_CODEC_BY_BYTES) < 64:  # a handful of distinct values: remembered
                _CODEC_BY_BYTES[raw] = name
        names.append(name)
    return Headers(status, names, codec == b"raw", raw_size.astype(np.int64), stored_size.astype(np.int64), rec["crc32c"])


_CODEC_BY_BYTES: dict[bytes, str] = {}


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


def send_all(sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
    """sendmsg that finishes partial sends, without joining the buffers."""
    bufs: list[bytes | bytearray | memoryview] = list(buffers)
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



def encode_write_hello(token: str | None) -> bytes:
    raw = (token or "").encode()
    if len(raw) > MAX_TOKEN_BYTES:
        raise ConfigError(f"token is {len(raw)} bytes; the bulk protocol takes at most {MAX_TOKEN_BYTES}")
    return HELLO.pack(WRITE_MAGIC, WRITE_VERSION, len(raw)) + raw


def encode_write_welcome(status: int, message: str = "") -> bytes:
    raw = message.encode()[:4096]
    return WELCOME.pack(WRITE_MAGIC, status, len(raw)) + raw


def encode_put_item(chunk_id: str, codec: str, raw_size: int, stored_size: int, crc: int) -> bytes:
    """One PUT_ITEM; ValueError when the id is not 64 hex digits or the codec does not fit."""
    raw_id = bytes.fromhex(chunk_id)
    c = codec.encode("ascii")
    if len(raw_id) != ID_BYTES:
        raise ValueError(f"chunk id {chunk_id!r} is not a {ID_BYTES}-byte content id (64 hex digits)")
    if not 0 < len(c) <= MAX_CODEC_LEN:
        raise ValueError(f"chunk {chunk_id}: codec {codec!r} does not fit the bulk header (1..{MAX_CODEC_LEN} ascii bytes)")
    return PUT_ITEM.pack(raw_id, 0, len(c), c, raw_size, stored_size, crc)


def encode_route(hops: Sequence[str]) -> bytes:
    raw = ",".join(hops).encode()
    if len(hops) > MAX_ROUTE_HOPS or len(raw) > MAX_ROUTE_BYTES or any("," in h or not h for h in hops):
        raise ValueError(f"a route names at most {MAX_ROUTE_HOPS} non-empty HOST:PORT addresses in {MAX_ROUTE_BYTES} bytes")
    return raw


def decode_route(raw: bytes) -> list[str]:
    if not raw:
        return []
    hops = raw.decode("utf-8", "replace").split(",")
    if len(hops) > MAX_ROUTE_HOPS or any(not h for h in hops):
        raise ProtocolError(f"a route names at most {MAX_ROUTE_HOPS} non-empty addresses")
    return hops


def encode_put(seq: int, items: Sequence[bytes], payloads: Sequence[bytes | bytearray | memoryview], payload_bytes: int,
               route: bytes = b"", count: int | None = None) -> list[bytes | bytearray | memoryview]:
    """The buffers of one PUT (for sendmsg): its head, route and items joined, then the payloads as they are.

    ``count``: the number of chunks when ``items`` is not one PUT_ITEM per chunk (already joined ones)."""
    n = len(items) if count is None else count
    return [PUT_HEAD.pack(n, seq, payload_bytes, len(route)) + route + b"".join(items), *payloads]


class PutBatch:
    """One received PUT: the items decoded column-wise and the payloads in one buffer."""

    __slots__ = ("seq", "ids", "codecs", "raw_sizes", "stored_sizes", "crcs", "buffer", "route", "items", "array")

    def __init__(self, seq: int, items: bytes, route: list[str]) -> None:
        arr = np.frombuffer(items, dtype=PUT_ITEM_DTYPE)
        n = len(arr)
        self.seq = seq
        self.route = route
        self.items = items  # as received: a forwarded PUT carries them unchanged
        if n and int(arr["codec_len"].max()) > MAX_CODEC_LEN:
            k = int(np.argmax(arr["codec_len"] > MAX_CODEC_LEN))
            raise ProtocolError(f"PUT item {k}: codec length {int(arr['codec_len'][k])} is over {MAX_CODEC_LEN}")
        if n and int(arr["stored_size"].max()) > MAX_CHUNK_BYTES:
            k = int(np.argmax(arr["stored_size"] > MAX_CHUNK_BYTES))
            raise ProtocolError(f"PUT item {k}: stored_size {int(arr['stored_size'][k])} is over {MAX_CHUNK_BYTES}")
        hexes = arr["id"].tobytes().hex()
        self.ids = [hexes[i : i + 2 * ID_BYTES] for i in range(0, len(hexes), 2 * ID_BYTES)]
        self.codecs = [bytes(c[:n_]).decode("ascii", "replace") for c, n_ in zip(arr["codec"].tolist(), arr["codec_len"].tolist())]
        self.raw_sizes: list[int] = arr["raw_size"].tolist()
        self.stored_sizes: list[int] = arr["stored_size"].tolist()
        self.crcs: list[int] = arr["crc"].tolist()
        self.buffer: memoryview | None = None  # the payloads, back to back (set by the receiver)
        self.array: object = None  # the receiver's own handle on the memory behind ``buffer``

    @property
    def payload_bytes(self) -> int:
        return sum(self.stored_sizes)

    def chunks(self) -> list[ChunkRecord]:
        """One record per chunk, the bytes as read-only views of the buffer."""
        assert self.buffer is not None
        view = self.buffer.toreadonly()
        out = []
        at = 0
        for cid, codec, raw, size, crc in zip(self.ids, self.codecs, self.raw_sizes, self.stored_sizes, self.crcs):
            out.append(ChunkRecord(cid, codec, raw, crc, view[at : at + size]))
            at += size
        return out


def encode_acks(seq: int, replicas: int, acks: Sequence[tuple[int, str, int]]) -> bytes:
    """One ACKS frame: ``acks`` are (status, message, free_bytes), chunk-major, ``replicas`` per chunk."""
    msgs = [m.encode()[:MAX_MESSAGE_BYTES] if m else b"" for _s, m, _f in acks]
    count = len(acks) // max(1, replicas)
    arr = np.zeros(len(acks), dtype=ACK_ITEM_DTYPE)
    if acks:
        arr["status"] = [a[0] for a in acks]
        arr["msg_len"] = [len(m) for m in msgs]
        arr["free_bytes"] = [max(0, a[2]) for a in acks]
    body = b"".join(msgs)
    return ACK_HEAD.pack(A_ACKS, replicas, seq, count, len(body)) + arr.tobytes() + body


def encode_ack_error(seq: int, message: str, error_class: int = E_MALFORMED) -> bytes:
    raw = encode_message(message)
    return ACK_HEAD.pack(A_ERROR, error_class, seq, 0, len(raw)) + raw


def decode_acks(items: bytes | bytearray, messages: bytes | bytearray) -> list[tuple[int, str, int]]:
    """(status, message, free_bytes) per ACK_ITEM; ProtocolError when the lengths disagree."""
    arr = np.frombuffer(items, dtype=ACK_ITEM_DTYPE)
    lens = arr["msg_len"].tolist()
    if sum(lens) != len(messages):
        raise ProtocolError(f"ACKS declares {len(messages)} message bytes, its items {sum(lens)}")
    statuses = arr["status"].tolist()
    bad = [s for s in statuses if s not in ACK_NAMES]
    if bad:
        raise ProtocolError(f"ACKS carries unknown status {bad[0]}")
    out = []
    at = 0
    for status, n, free in zip(statuses, lens, arr["free_bytes"].tolist()):
        out.append((status, bytes(messages[at : at + n]).decode("utf-8", "replace") if n else "", free))
        at += n
    return out


def recv_exact_by(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` before ``deadline`` (time.monotonic): TimeoutError after it, EOFError when the peer closes first."""
    n = len(view)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{got} of {n} bytes arrived in time")
        sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes that must all arrive before ``deadline`` (time.monotonic): TimeoutError else."""
    buf = bytearray(n)
    recv_exact_by(sock, memoryview(buf), deadline)
    return bytes(buf)


def next_request(conn: socket.socket, idle_timeout_s: float, io_timeout_s: float) -> list[str] | None:
    """The ids of the next read request on a read session (hex), or None when the session is over:
    idle for ``idle_timeout_s`` (the client reconnects when it needs the port again), closed, a
    polite goodbye (a request of 0 ids), a truncated request, or one of more than MAX_IDS ids (then
    answered with an ERROR batch first). The rest of a request must arrive within ``io_timeout_s``."""
    conn.settimeout(idle_timeout_s)
    try:
        first = conn.recv(REQUEST.size, socket.MSG_WAITALL)
    except TimeoutError:
        return None
    if not first:
        return None
    deadline = time.monotonic() + io_timeout_s  # for the rest of the request, all of it
    try:
        if len(first) < REQUEST.size:
            first += recv_by(conn, REQUEST.size - len(first), deadline)
        (count,) = REQUEST.unpack(first)
        if count == 0:
            return None
        if count > MAX_IDS:
            raw = encode_message(f"a bulk request carries at most {MAX_IDS} ids, got {count}; split it")
            conn.settimeout(io_timeout_s)
            send_all(conn, encode_batch([encode_header(ERROR, stored_size=len(raw))], [raw]))
            return None
        raw_ids = recv_by(conn, count * ID_BYTES, deadline)
    except EOFError:
        return None  # truncated: nothing to answer
    conn.settimeout(io_timeout_s)
    return hex_ids(raw_ids)


class AckFrame:
    """An ACKS or ERROR frame as read off a write connection (``recv_ack_frame``)."""

    __slots__ = ("kind", "replicas", "seq", "count", "items", "messages")

    def __init__(self, kind: int, replicas: int, seq: int, count: int, items: bytearray, messages: bytearray) -> None:
        self.kind, self.replicas, self.seq, self.count = kind, replicas, seq, count
        self.items, self.messages = items, messages


def recv_ack_frame(sock: socket.socket, head: bytearray, got: int, deadline: float) -> AckFrame:
    """The rest of the frame whose first ``got`` head bytes are in ``head`` (the caller waited for
    them), by ``deadline``; its declared sizes are checked before anything is allocated.

    Raises ProtocolError for sizes out of bounds, TimeoutError / EOFError / OSError as recv_exact_by."""
    if got < ACK_HEAD.size:
        recv_exact_by(sock, memoryview(head)[got:], deadline)
    kind, replicas, seq, count, msg_bytes = ACK_HEAD.unpack(head)
    if kind == A_ACKS:
        if not 0 < count <= MAX_PUT_ITEMS or not 0 < replicas <= 64:
            raise ProtocolError(f"ACKS of {count} chunks x {replicas} replicas")
        if msg_bytes > MAX_MESSAGE_BYTES * count * replicas:
            raise ProtocolError(f"ACKS declares {msg_bytes} message bytes")
    elif msg_bytes > MAX_MESSAGE_BYTES or count:
        raise ProtocolError(f"ERROR frame declares {count} items and {msg_bytes} message bytes")
    items = bytearray(count * replicas * ACK_ITEM.size if kind == A_ACKS else 0)
    recv_exact_by(sock, memoryview(items), deadline)
    messages = bytearray(msg_bytes)
    recv_exact_by(sock, memoryview(messages), deadline)
    return AckFrame(kind, replicas, seq, count, items, messages)


__all__ = [
    "AckFrame", "recv_ack_frame",
    "BATCH", "CORRUPT", "ERROR", "HEADER", "HELLO", "MAGIC", "MAX_BATCH_BYTES", "MAX_BATCH_ITEMS", "MAX_CHUNK_BYTES", "MAX_IDS",
    "MAX_MESSAGE_BYTES", "MISSING", "OK", "REQUEST", "STATUS_NAMES", "VERSION", "WELCOME", "W_BAD_HELLO", "W_OK",
    "W_UNAUTHENTICATED", "ProtocolError", "decode_header",
    "decode_headers", "encode_batch", "encode_header", "encode_hello", "encode_message",
    "encode_request",
    "encode_welcome", "next_request", "recv_by", "recv_bytes", "recv_exact", "recv_into_all", "send_all",
    "A_ACKS", "A_ERROR", "ACK_HEAD", "ACK_ITEM", "ACK_ITEM_DTYPE", "ACK_NAMES", "ACK_OK", "ALREADY_PRESENT", "CORRUPT_IN_TRANSIT",
    "DEFAULT_WRITE_WINDOW", "E_BUSY", "E_MALFORMED", "FAILED", "FULL", "INVALID", "MAX_PUT_BYTES", "MAX_PUT_ITEMS",
    "MAX_ROUTE_BYTES", "MAX_ROUTE_HOPS",
    "PUT_HEAD", "PUT_ITEM", "PUT_ITEM_DTYPE", "STORED", "WRITE_MAGIC", "WRITE_VERSION", "PutBatch", "decode_acks", "decode_route",
    "encode_ack_error", "encode_acks", "encode_put", "encode_put_item", "encode_route", "encode_write_hello",
    "encode_write_welcome", "recv_exact_by",
]
