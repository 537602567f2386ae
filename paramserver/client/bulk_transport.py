"""Client of the bulk chunk-read protocol (paramserver.wire.bulk_frames): recv_into straight into caller buffers.

A ``BulkClient`` keeps a small pool of authenticated connections to one server's bulk
port; ``fetch`` borrows one for a request and returns it when the reply has been read in
full. Any failure raises a ``BulkError`` subclass and closes that connection; the caller
falls back to gRPC GetChunks. Chunk bytes are *not* verified here: callers check them
against the manifest before they reach a tensor.
"""
from __future__ import annotations

import select
import socket
import threading
import time
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from paramserver.client.arrivals import Into, ReadIds
from paramserver.client.errors import BulkError, BulkProtocolFailure, BulkUnauthenticated, BulkUnavailable
from paramserver.wire.address import split_host_port
from paramserver.wire.bulk_frames import (
    BATCH,
    HEADER,
    MAX_BATCH_BYTES,
    MAX_CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    MAGIC,
    MAX_IDS,
    OK,
    ERROR,
    SOCKET_BUFFER_BYTES,
    STATUS_NAMES,
    VERSION,
    W_BAD_HELLO,
    W_OK,
    W_UNAUTHENTICATED,
    WELCOME,
    batch_items,
    Headers,
    ProtocolError,
    decode_header_columns,
    encode_hello,
    encode_request_digests,
    recv_exact,
    recv_into_all,
)

# Refuse a declared payload larger than this: chunking's largest chunk is 64 MiB.
MAX_PAYLOAD_BYTES = MAX_CHUNK_BYTES


class BulkItem(NamedTuple):
    id: str
    status: int  # bulk.OK / MISSING / CORRUPT
    codec: str
    raw_size: int
    crc32c: int
    data: memoryview  # OK: the stored bytes (caller's buffer or a reused one); else the reason, utf-8

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, str(self.status))

    @property
    def message(self) -> str:
        return "" if self.status == OK else bytes(self.data).decode("utf-8", "replace")


def split_address(address: str) -> tuple[str, int]:
    try:
        return split_host_port(address)
    except ValueError:
        raise BulkUnavailable(address, "address must be HOST:PORT") from None


class _Conn:
    def __init__(self, address: str, token: str | None, connect_timeout_s: float, io_timeout_s: float) -> None:
        self.address = address
        # A server from before version 3 refuses its hello: say hello again in version 2.
        for version in (VERSION, 2):
            self.sock, status, message = self._hello(token, version, connect_timeout_s, io_timeout_s)
            if status == W_OK:
                break
            self.sock.close()
            if status == W_UNAUTHENTICATED:
                raise BulkUnauthenticated(address, message)
            if status != W_BAD_HELLO or version == 2:
                raise BulkProtocolFailure(address, message or f"welcome status {status}")
        self.max_items = batch_items(version)
        self.scratch = bytearray(0)  # reused receive buffer when the caller gives none
        self.header = bytearray(HEADER.size)

    def _hello(self, token: str | None, version: int, connect_timeout_s: float,
               io_timeout_s: float) -> tuple[socket.socket, int, str]:
        address = self.address
        host, port = split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except OSError as exc:
            raise BulkUnavailable(address, f"cannot connect: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            sock.settimeout(io_timeout_s)
            sock.sendall(encode_hello(token, version))
            head = bytearray(WELCOME.size)
            recv_exact(sock, memoryview(head))
            magic, status, n = WELCOME.unpack(head)
            if magic != MAGIC:
                raise BulkProtocolFailure(address, "the peer is not a bulk server (bad magic in its welcome)")
            message = bytearray(n)
            recv_exact(sock, memoryview(message))
        except (OSError, EOFError) as exc:
            sock.close()
            raise BulkUnavailable(address, f"handshake failed: {exc}") from None
        except BaseException:
            sock.close()
            raise
        return sock, status, message.decode("utf-8", "replace")

    def buffer(self, n: int) -> memoryview:
        if len(self.scratch) < n:
            self.scratch = bytearray(max(n, 2 * len(self.scratch)))
        return memoryview(self.scratch)[:n]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class BulkClient:
    """Pooled connections to one bulk address; thread-safe (one request per connection at a time)."""

    def __init__(self, address: str, token: str | None = None, *, connect_timeout_s: float = 3.0,
                 io_timeout_s: float = 30.0, max_idle: int = 8) -> None:
        split_address(address)
        self.address = address
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> _Conn:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            # An idle connection has nothing to read; readable means the server closed it
            # (idle timeout, restart): drop it rather than fail the request on it.
            if not select.select([conn.sock], [], [], 0)[0]:
                return conn
            conn.close()
        return _Conn(self.address, self.token, self.connect_timeout_s, self.io_timeout_s)

    def _give(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def fetch(self, ids: ReadIds | Sequence[str], into: Into | None = None) -> Iterator[BulkItem]:
        """Yield one BulkItem per id, in order (``fetch_batches``, an item at a time).

        Without ``into`` the bytes land in a buffer that a later item may reuse, so consume each
        item before asking for the next. Raises BulkError; a generator closed early closes its
        connection.
        """
        for batch in self.fetch_batches(ids, into):
            h = batch.headers
            for k, data in enumerate(batch.data):
                yield BulkItem(batch.ids[k], int(h.status[k]), h.codecs[k], int(h.raw_size[k]), int(h.crc32c[k]), data)

    def fetch_batches(self, ids: ReadIds | Sequence[str], into: Into | None = None) -> Iterator[BulkBatch]:
        """The answers as the batches the server sent (up to MAX_BATCH_ITEMS items each, in order),
        so a caller can handle each batch at once; a batch's scratch bytes are reused by the next.

        ``into(first, ok_raw, stored_sizes)`` is called once per batch, before its bytes arrive,
        with the position (in ``ids``) of the batch's first item and, per item, whether it is an
        OK raw chunk and its stored size; it may return, per item, a writable memoryview of
        exactly that size to receive the chunk into (the item's ``data`` is then that view)."""
        if not isinstance(ids, ReadIds):
            try:
                ids = ReadIds.of_hex(ids)
            except ValueError as exc:
                raise BulkProtocolFailure(self.address, f"cannot encode the request: {exc}") from None
        for start in range(0, len(ids), MAX_IDS):
            yield from self._fetch_batch(ids[start : start + MAX_IDS], start, into)

    def _fetch_batch(self, ids: ReadIds, offset: int, into: Into | None) -> Iterator[BulkBatch]:
        if not len(ids):
            return
        try:
            request = encode_request_digests(ids.digests)
        except ValueError as exc:
            raise BulkProtocolFailure(self.address, f"cannot encode the request: {exc}") from None
        conn = self._take()
        finished = False
        try:
            try:
                conn.sock.sendall(request)
            except OSError as exc:
                # A pooled connection the server closed while idle: one fresh try.
                conn.close()
                conn = _Conn(self.address, self.token, self.connect_timeout_s, self.io_timeout_s)
                try:
                    conn.sock.sendall(request)
                except OSError as exc2:
                    raise BulkUnavailable(self.address, f"send failed: {exc2} (after {exc})") from None
            done = 0
            while done < len(ids):
                batch = self._read_batch(conn, ids, offset, done, into)
                done += len(batch.data)
                yield batch
            finished = True
        except (OSError, EOFError) as exc:
            raise BulkUnavailable(self.address, f"connection failed: {exc}") from None
        finally:
            if finished:
                self._give(conn)
            else:
                conn.close()  # mid-reply: the stream position is unknown

    def _read_batch(self, conn: _Conn, ids: ReadIds, offset: int, first: int, into: Into | None) -> BulkBatch:
        """Read one BATCH answering ``ids[first:first + count]``: its headers, then every payload
        in one scatter read straight into its destination."""
        head = memoryview(conn.header)[: BATCH.size]
        recv_exact(conn.sock, head)
        count, payload_bytes = BATCH.unpack(head)
        if not 0 < count <= min(conn.max_items, len(ids) - first):
            raise BulkProtocolFailure(self.address, f"a batch of {count} answers, but {len(ids) - first} ids are unanswered "
                                                    f"(at most {conn.max_items} per batch)")
        if payload_bytes > MAX_BATCH_BYTES:
            raise BulkProtocolFailure(self.address, f"a batch declares {payload_bytes} payload bytes, over {MAX_BATCH_BYTES}")
        raw_headers = bytearray(count * HEADER.size)
        recv_exact(conn.sock, memoryview(raw_headers))
        try:
            h = decode_header_columns(raw_headers)
        except ProtocolError as exc:
            raise BulkProtocolFailure(self.address, str(exc)) from None
        ok = h.status == OK
        sizes = h.stored_size
        over = np.flatnonzero(sizes > np.where(ok, MAX_PAYLOAD_BYTES, MAX_MESSAGE_BYTES))
        if len(over):
            k = int(over[0])
            what = f"chunk {ids.hex[first + k]}" if ok[k] else f"a {STATUS_NAMES[int(h.status[k])]} message"
            raise BulkProtocolFailure(self.address, f"{what} declares {int(sizes[k])} bytes, over "
                                                    f"{MAX_PAYLOAD_BYTES if ok[k] else MAX_MESSAGE_BYTES}")
        if int(sizes.sum()) != payload_bytes:
            raise BulkProtocolFailure(self.address, f"batch declares {payload_bytes} payload bytes, its headers {int(sizes.sum())}")
        # Where each payload goes: the caller's buffer (into) or a slice of the reused scratch.
        given = into(offset + first, ok & h.is_raw, sizes) if into is not None else None
        if given is not None and len(given) != count:
            raise BulkProtocolFailure(self.address, f"into() gave {len(given)} buffers for a batch of {count}")
        sizes_list: list[int] = sizes.tolist()
        in_place = np.zeros(count, dtype=bool)
        offered: Sequence[memoryview | None] = given if given is not None else [None] * count
        scratch = conn.buffer(sum(n for v, n in zip(offered, sizes_list) if v is None))
        views: list[memoryview] = []
        at = 0
        for k, (view, n) in enumerate(zip(offered, sizes_list)):
            if view is None:
                views.append(scratch[at : at + n])
                at += n
                continue
            if len(view) != n:
                # The caller expected another size: the server's copy differs from what it asked for.
                raise BulkProtocolFailure(self.address, f"into() gave {len(view)} bytes for chunk {ids.hex[first + k]}, "
                                                        f"which has {n}")
            views.append(view)
            in_place[k] = True
        recv_into_all(conn.sock, views)
        if (h.status == ERROR).any():
            k = int(np.flatnonzero(h.status == ERROR)[0])
            raise BulkProtocolFailure(self.address, "server refused the request: " + bytes(views[k]).decode("utf-8", "replace"))
        return BulkBatch(offset + first, ids[first : first + count], h, views, in_place)


class BulkBatch:
    """One BATCH: items ``first .. first + len(data) - 1`` of the ids asked for, as columns."""

    __slots__ = ("data", "first", "headers", "in_place", "_ids")

    def __init__(self, first: int, ids: ReadIds, headers: Headers, data: list[memoryview], in_place: np.ndarray) -> None:
        self.first = first
        self._ids = ids
        self.headers = headers
        self.data = data  # OK: the stored bytes; else the reason, utf-8
        self.in_place = in_place  # the item's data is the buffer into() gave

    @property
    def ids(self) -> list[str]:
        return self._ids.hex


class BulkPool:
    """One BulkClient per address, and a memory of addresses that failed recently."""

    def __init__(self, token: str | None = None, *, down_for_s: float = 30.0, io_timeout_s: float = 30.0,
                 connect_timeout_s: float = 3.0) -> None:
        self.token = token
        self.down_for_s = down_for_s
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._clients: dict[str, BulkClient] = {}
        self._down: dict[str, float] = {}
        self._lock = threading.Lock()

    def client(self, address: str) -> BulkClient | None:
        """The client for ``address``, or None when it is empty or failed less than down_for_s ago."""
        if not address:
            return None
        with self._lock:
            until = self._down.get(address)
            if until is not None:
                if time.monotonic() < until:
                    return None
                del self._down[address]
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = BulkClient(address, self.token, io_timeout_s=self.io_timeout_s,
                                                             connect_timeout_s=self.connect_timeout_s)
            return client

    def mark_broken(self, address: str) -> None:
        with self._lock:
            self._down[address] = time.monotonic() + self.down_for_s
            client = self._clients.pop(address, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


__all__ = ["BulkBatch", "BulkClient", "BulkPool", "BulkItem", "BulkError", "BulkUnavailable", "BulkUnauthenticated",
           "BulkProtocolFailure"]
