"""The bulk port's listener: accepts connections, holds them to their limits, reads the hello and
hands each to its session (``reads`` or ``writes``). Answers the protocols of ``paramserver.wire.bulk_frames``.

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

Tokens follow the gRPC rules (``config.check_token`` for reads, ``check_write_token`` for
writes). Write sessions are bounded by ``max_write_connections`` and served only with
``writes`` on; with ``forward_to`` (the peers' bulk addresses) a PUT whose route names next hops
is forwarded there (``chain``); without it, hops are answered FAILED and the client sends to them
itself.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Collection

from paramserver.server.auth import AuthConfig
from paramserver.server.bulk_port.config import BulkServerConfig, check_token, check_write_token, long_token
from paramserver.server.bulk_port.reads import ReadSessions, recv_by
from paramserver.server.bulk_port.writes import Budget, WritePort, WriteSession
from paramserver.wire.rate_limited_log import RateLimitedLog
from paramserver.server.errors import ConfigError
from paramserver.server.repair import RepairQueue
from paramserver.server.served_bytes import ServedBytes
from paramserver.server.store import ChunkStore
from paramserver.wire.address import split_host_port
from paramserver.wire.bulk_frames import (
    HELLO, MAGIC, MAX_TOKEN_BYTES, READ_VERSIONS, SOCKET_BUFFER_BYTES, W_BAD_HELLO, W_OK, W_UNAUTHENTICATED, WRITE_MAGIC,
    WRITE_VERSION, ProtocolError, batch_items, encode_welcome, encode_write_welcome,
)

log = logging.getLogger(__name__)
_ACCEPT_PAUSE_S, _ACCEPT_PAUSE_MAX_S = 0.05, 1.0  # after a failed accept (out of file descriptors)
_DEFAULTS = BulkServerConfig()
EVICT_AFTER_S = 1.0  # a pending connection this old may be pushed out for a new one (a hello takes milliseconds)


class BulkServer:
    """Threaded TCP server of the bulk read and write protocols; a thread per connection, bounded.

    ``repair_queue``: told when a fresh verified copy of a chunk arrived (as PutChunks does).
    ``forward_to``: the bulk addresses a PUT may be forwarded to (the other members'); None: this
    server does not forward (chain hops are answered FAILED and the client sends to them itself).
    ``served``: counts the chunk bytes read sessions send (path "bulk"; None: a counter of its own).
    """

    def __init__(self, store: ChunkStore, auth: AuthConfig, listen: str = "127.0.0.1:0",
                 config: BulkServerConfig = _DEFAULTS, *, server_id: str = "",
                 repair_queue: RepairQueue | None = None, forward_to: Callable[[], Collection[str]] | None = None,
                 on_read: Callable[[str], None] | None = None, served: ServedBytes | None = None) -> None:
        self.store = store
        self.served = served or ServedBytes()  # chunk bytes the read sessions sent
        self.on_read = on_read  # told the id of every chunk served (hot-chunk read rates)
        self.auth = auth.validate()
        self.config = config.validate()
        # The name error acks give this server: the store knows it when the caller does not say.
        self.server_id = server_id or str(getattr(store, "server_id", "") or "")
        self.repair_queue = repair_queue
        self.forward_to = forward_to
        self._write_slots = threading.BoundedSemaphore(self.config.max_write_connections)
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
        self._reads = ReadSessions(store, self.config, self._stopped, on_read, self.served)
        where = f"server {self.server_id}" if self.server_id else f"bulk server {self.address}"
        self._writes = WritePort(store, self.config, where, self.address, repair_queue, forward_to, self._stopped,
                                 self._lock, self._refusals, Budget(self.config.write_buffer_bytes))
        # The write sessions' shared state, under the names the server has always shown.
        self.budget = self._writes.budget
        self.write_stats = self._writes.stats
        self._spare = self._writes.spare

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
                self._reads.serve(conn, batch_items(int(mode[len("read:"):])))
            elif mode is not None and mode.startswith("write:"):
                try:
                    with self._lock:
                        self.write_stats["sessions"] += 1
                    WriteSession(self._writes, conn, peer, mode[len("write:"):]).run()
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
        magic, version, token_len = HELLO.unpack(recv_by(conn, HELLO.size, deadline))
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
            return self._turn_away(conn, peer, W_BAD_HELLO, "bad_hello", long_token(token_len))
        token = recv_by(conn, token_len, deadline).decode("utf-8", "replace")
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
            return away(W_BAD_HELLO, "bad_hello", long_token(token_len))
        token = recv_by(conn, token_len, deadline).decode("utf-8", "replace")
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


__all__ = ["EVICT_AFTER_S", "BulkServer"]
