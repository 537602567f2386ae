"""The peer port: other workers of the cluster read chunks from this one (issue 42, fleet fan-out).

Without TLS it speaks the servers' bulk READ protocol (paramserver.wire.bulk_frames: hello, then
requests of ids answered in batches), so a peer reads it with the client's unchanged BulkClient.
Under TLS it is a gRPC server with mutual TLS that implements only ``GetChunks`` of the ParamServer
service (worker.peer_grpc). What it serves comes from a ``PeerShelf`` (worker.peer_shelf): chunks of
loads in progress as they land, then the cache tiers; a chunk a load is still fetching is waited for
up to ``peer_wait_s``. Every chunk goes out as codec "raw" with the CRC32C of its raw bytes; readers
verify it by content id all the same.

Why it stays out of the worker's way: the credential is the cluster's read token (the one this
worker reads the cluster with, compared in constant time; none configured: any, and the exposure
check keeps such a port on loopback unless --insecure); connections are bounded in total and per
source address (paramserver.wire.conn_limits); batches being sent are bounded by ``max_sessions``
(each at most SEND_BATCH_BYTES plus one chunk), so bytes in flight are too; a reader that stops
reading is cut after ``io_timeout_s``; serving threads lower their own priority so the worker's own
loads and requests run first. Bytes go out with ``sendmsg`` over memoryviews of where they lie.

TWIN: the read-session loop below mirrors paramserver/server/bulk_port (listener.py ``_handshake``,
reads.py ``ReadSessions``), which the worker layer may not import; the frames themselves are shared
(paramserver.wire.bulk_frames).
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np

from paramserver.wire.address import split_host_port
from paramserver.wire.bulk_frames import (
    HELLO, MAGIC, MAX_TOKEN_BYTES, MISSING, OK, READ_VERSIONS, SEND_BATCH_BYTES,
    SOCKET_BUFFER_BYTES, W_BAD_HELLO, W_OK, W_UNAUTHENTICATED, WRITE_MAGIC, ProtocolError, batch_items, encode_batch,
    encode_header, encode_message, encode_welcome, encode_write_welcome, next_request, recv_by, send_all,
)
from paramserver.wire.conn_limits import ConnectionLimits, ConnectionTable
from paramserver.wire.rate_limited_log import RateLimitedLog
from worker.errors import ConfigError
from worker.peer_common import MISSING_MESSAGE, PeerCounters, PeerPortConfig, TLSFiles, check_token, lower_priority
from worker.peer_grpc import PeerGrpcServer
from worker.peer_shelf import Found, PeerShelf

log = logging.getLogger(__name__)

_ACCEPT_PAUSE_S, _ACCEPT_PAUSE_MAX_S = 0.05, 1.0  # after a failed accept (out of file descriptors)


_DEFAULTS = PeerPortConfig()


class PeerPort:
    """``PeerPort(shelf, config, token, tls).start()``; ``address`` is the bound HOST:PORT."""

    def __init__(self, shelf: PeerShelf, config: PeerPortConfig = _DEFAULTS, token: str | None = None,
                 tls: TLSFiles | None = None) -> None:
        self.shelf = shelf
        self.config = config.validate()
        self.token = token or None
        if self.token is not None and len(self.token.encode()) > MAX_TOKEN_BYTES:
            raise ConfigError(f"the cluster token is over {MAX_TOKEN_BYTES} bytes; the bulk protocol carries at most that")
        self.counters = PeerCounters()
        self._sessions = threading.BoundedSemaphore(self.config.max_sessions)
        self._stopped = threading.Event()
        self._refusals = RateLimitedLog(log)
        host, port = split_host_port(self.config.listen)
        self.host = self.config.listen.rpartition(":")[0]  # as given, brackets kept
        self._grpc: PeerGrpcServer | None = None
        self._sock: socket.socket | None = None
        if tls is not None:
            self._grpc = PeerGrpcServer(shelf, self.config, self.token, tls, self.counters)
            self.port = self._grpc.port
        else:
            try:
                self._sock = socket.create_server((host, port), backlog=128, reuse_port=False)
            except OSError as exc:
                raise ConfigError(f"cannot listen on {self.config.listen} for the peer port: {exc.strerror or exc}; "
                                  "pick another --peer-listen") from None
            self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._table: ConnectionTable[socket.socket] = ConnectionTable(
            ConnectionLimits(per_source=self.config.max_connections_per_source, total=self.config.max_connections))
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name="peer-accept", daemon=True)

    # ------------------------------------------------------------ public

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def tls(self) -> bool:
        return self._grpc is not None

    @property
    def served_bytes(self) -> int:
        return self.counters.served_bytes

    @property
    def served_chunks(self) -> int:
        return self.counters.served_chunks

    @property
    def refused(self) -> dict[str, int]:
        with self.counters._lock:
            return dict(self.counters.refused)

    @property
    def connections(self) -> int:
        if self._grpc is not None:
            return self._grpc.active
        with self._lock:
            return len(self._conns)

    def start(self) -> PeerPort:
        if self._grpc is not None:
            self._grpc.start()
        else:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._grpc is not None:
            self._grpc.stop()
            return
        assert self._sock is not None
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn)
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def __enter__(self) -> PeerPort:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        assert self._sock is not None
        pause = _ACCEPT_PAUSE_S
        while not self._stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError as exc:
                if self._stopped.is_set():
                    return
                # EMFILE, ENFILE, ENOBUFS, ECONNABORTED...: the port must outlive them.
                self._refusals.warning("accept_failed", "peer port accept failed: port=%s error=%s; retrying in %gs",
                                       self.address, exc, pause)
                self._stopped.wait(pause)
                pause = min(_ACCEPT_PAUSE_MAX_S, pause * 2)
                continue
            pause = _ACCEPT_PAUSE_S
            source = str(peer[0])
            with self._lock:
                admission = self._table.offer(conn, source)
                if admission.admit:
                    self._conns.add(conn)
            for victim in admission.evict:
                self._refused(victim, "evicted", "a connection that never said hello gave way to a newcomer")
                _shutdown(victim)  # its thread's receive ends, and the thread cleans up
            if not admission.admit:
                self._turn_away(conn, source, W_BAD_HELLO, admission.reason, self._full(admission.reason))
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, source), name="peer-conn", daemon=True).start()
            except RuntimeError:  # cannot start a thread: give the connection back
                self._forget(conn)
                conn.close()

    def _full(self, reason: str) -> str:
        if reason == "per_source":
            return (f"too many peer connections from this address (limit {self.config.max_connections_per_source}); "
                    "reuse them or read from the servers")
        return f"too many peer connections (limit {self.config.max_connections}); read from the servers or retry later"

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._table.remove(conn)
            self._conns.discard(conn)

    def _refused(self, source: object, reason: str, message: str) -> None:
        self.counters.refuse(reason)
        self._refusals.warning(reason, "peer connection refused: port=%s reason=%s detail=%s", self.address, reason, message)

    def _turn_away(self, conn: socket.socket, source: str, status: int, reason: str, message: str,
                   welcome: bytes | None = None) -> None:
        self._refused(source, reason, message)
        try:
            conn.settimeout(1.0)
            conn.sendall(welcome if welcome is not None else encode_welcome(status, message))
        except OSError:
            pass

    def _serve(self, conn: socket.socket, source: str) -> None:
        lower_priority()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            try:
                version = self._handshake(conn, source)
            except TimeoutError:
                self._refused(source, "hello_timeout", f"no complete hello within {self.config.hello_timeout_s:g} s")
                return
            if version is not None:
                self._session(conn, batch_items(version))
        except (OSError, EOFError, ProtocolError) as exc:
            log.debug("peer connection ended: %s", exc)
        except Exception:  # a bug here must end one connection, never the port
            log.exception("peer connection failed")
        finally:
            self._forget(conn)
            conn.close()

    def _handshake(self, conn: socket.socket, source: str) -> int | None:
        """The read protocol version once welcomed; None when turned away (answered and counted)."""
        deadline = time.monotonic() + self.config.hello_timeout_s
        magic, version, token_len = HELLO.unpack(recv_by(conn, HELLO.size, deadline))
        version = int(version)
        if magic == WRITE_MAGIC:
            message = "a worker's peer port serves reads only; write to the servers"
            self._turn_away(conn, source, W_BAD_HELLO, "bad_hello", message, encode_write_welcome(W_BAD_HELLO, message))
            return None
        if magic != MAGIC:
            self._turn_away(conn, source, W_BAD_HELLO, "bad_hello",
                            "not a bulk hello (bad magic): a worker's peer port speaks the paramserver bulk read protocol")
            return None
        if version not in READ_VERSIONS:
            self._turn_away(conn, source, W_BAD_HELLO, "bad_hello", f"bulk protocol version {version} is not served here "
                            f"(this peer speaks {', '.join(map(str, READ_VERSIONS))})")
            return None
        if token_len > MAX_TOKEN_BYTES:
            self._turn_away(conn, source, W_BAD_HELLO, "bad_hello", f"the hello declares a token of {token_len} bytes, "
                            f"over the limit of {MAX_TOKEN_BYTES}; send the cluster's read token")
            return None
        token = recv_by(conn, token_len, deadline).decode("utf-8", "replace")
        problem = check_token(token, self.token)
        if problem is not None:
            self._turn_away(conn, source, W_UNAUTHENTICATED, "unauthenticated", problem)
            return None
        with self._lock:
            useful = self._table.useful(conn)
        if not useful:
            self._turn_away(conn, source, W_BAD_HELLO, "per_source", self._full("per_source"))
            return None
        conn.settimeout(self.config.io_timeout_s)
        conn.sendall(encode_welcome(W_OK))
        return version

    def _session(self, conn: socket.socket, max_items: int) -> None:
        while not self._stopped.is_set():
            ids = next_request(conn, self.config.idle_timeout_s, self.config.io_timeout_s)
            if ids is None:
                return
            self._answer(conn, ids, max_items)

    def _answer(self, conn: socket.socket, ids: list[str], max_items: int) -> None:
        # Batches are cut as the servers cut theirs (at most max_items, closed once they hold
        # SEND_BATCH_BYTES), by the sizes the shelf knows before anything is waited for or read;
        # an id of unknown size (the disk tier's, or nobody's) is looked up alone, so a batch never
        # holds more than SEND_BATCH_BYTES plus one chunk of copies read from disk.
        wait_until = time.monotonic() + self.config.peer_wait_s
        sizes = self.shelf.raw_sizes(ids)
        known = sizes > 0
        ends = np.cumsum(sizes)
        ahead: dict[int, Found | None] = {}  # looked up, not yet sent
        start = 0
        while start < len(ids):
            before = int(ends[start - 1]) if start else 0
            stop = min(int(np.searchsorted(ends, before + SEND_BATCH_BYTES, side="left")) + 1, start + max_items, len(ids))
            headers: list[bytes] = []
            payloads: list[bytes | memoryview] = []
            size = ok_bytes = ok_chunks = 0
            k = start
            while k < stop and size < SEND_BATCH_BYTES:
                if k not in ahead:
                    end = k + 1
                    if known[k]:  # the run of known sizes from here, in one look-up (and one wait)
                        end = k + int(np.argmin(known[k:stop])) if not known[k:stop].all() else stop
                    ahead.update(zip(range(k, end), self.shelf.find(ids[k:end], wait_until)))
                found = ahead.pop(k)
                if found is None:
                    payload: bytes | memoryview = encode_message(MISSING_MESSAGE)
                    headers.append(encode_header(MISSING, stored_size=len(payload)))
                    size += len(payload)
                else:
                    payload = found.view
                    n = payload.nbytes
                    headers.append(encode_header(OK, "raw", n, n, found.crc))
                    size += n
                    ok_bytes += n
                    ok_chunks += 1
                payloads.append(payload)
                k += 1
            if not self._sessions.acquire(timeout=self.config.io_timeout_s):
                raise TimeoutError(f"no send slot within {self.config.io_timeout_s:g} s (limit {self.config.max_sessions})")
            try:
                send_all(conn, encode_batch(headers, payloads))
            finally:
                self._sessions.release()
            self.counters.served(ok_chunks, ok_bytes, len(headers) - ok_chunks)
            start = k


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


__all__ = ["PeerCounters", "PeerPort", "PeerPortConfig", "TLSFiles", "check_token"]
