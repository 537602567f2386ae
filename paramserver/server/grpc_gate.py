"""The gate in front of the gRPC port: connection limits per source address and in total.

grpcio has no hook at accept, so the gate owns the configured ``--listen`` address, applies
``paramserver.wire.conn_limits`` to each connection it accepts, and relays the bytes to the real
gRPC server, which listens on a unix socket in a private (0700) directory: a local user cannot go
around the gate. TLS passes through untouched (gRPC still terminates it).

"Useful" (a connection that is never evicted for a newcomer) is read from the client's first bytes
(``FirstCall``): in plaintext, an HTTP/2 HEADERS frame, that is, a call (the issue's flood sends the
24-byte preface and an empty SETTINGS frame, 33 bytes, then nothing; a real client's first call
follows its SETTINGS and WINDOW_UPDATE at once: 82 bytes, then 302 with the HEADERS). Under TLS
the frames are encrypted, so a connection is useful once its application-data records (after the
handshake) announce ``TLS_USEFUL_BYTES``: a handshake plus the preface and SETTINGS stays below
it, a first call passes it (figures at the constant).

The relay is one selector thread: non-blocking sockets, one shared 256 KiB read buffer, and a
side whose peer cannot take more (a full send buffer) is not read until the peer drains (the
remainder of one read is all that is ever held per direction). A half-close (EOF) on one side is
passed on as a shutdown of the other side's writing once what was read before it is delivered.

The backend connection of each client binds a unique abstract unix name (``unix-abstract:NAME`` in
gRPC's ``context.peer()``), so ``source_of`` maps a call back to its client's address.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable

from paramserver.wire.rate_limited_log import RateLimitedLog
from paramserver.wire.address import split_host_port
from paramserver.wire.conn_limits import ConnectionLimits, ConnectionTable

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS_FRAME = 0x1
TLS_HANDSHAKE_RECORD, TLS_APPLICATION_DATA = 0x16, 0x17
# Application-data bytes (TLS 1.3: the client's encrypted Finished, then HTTP/2) that make a TLS
# connection useful. Measured with grpcio 1.85 on loopback (TLS 1.3): a client's Finished, preface,
# SETTINGS and WINDOW_UPDATE announce 178 bytes, its first call's HEADERS take it to 488 (531 with
# a token); a flood's Finished, preface and empty SETTINGS announce 119 (162 with a SETTINGS ack
# and a PING). A client that pads past this with pings is treated as useful: the per-source cap
# still bounds it.
TLS_USEFUL_BYTES = 300
INSPECT_LIMIT = 64 << 10  # a client that has not made a call within this many bytes never will be "useful"
READ_BUFFER_BYTES = 256 << 10
BACKEND_BUFFER_BYTES = 1 << 20
ACCEPT_BATCH = 32  # connections accepted per wake-up before the relays get a turn
_ACCEPT_PAUSE_S = 0.05  # after a failed accept (out of file descriptors)
SOCKET_NAME = "grpc.sock"


class FirstCall:
    """Reads a client's first bytes until they show a call (see the module docstring); pure.

    Plaintext HTTP/2: the preface, then frame headers (9 bytes; payloads are skipped, not read)
    until a HEADERS frame. TLS: record headers (5 bytes) until the application-data records
    (the encrypted Finished, then HTTP/2) carry ``TLS_USEFUL_BYTES``."""

    __slots__ = ("_app", "_head", "_mode", "_seen", "_skip")

    def __init__(self) -> None:
        self._mode = "start"  # start -> h2 | tls | other | useful
        self._head = b""  # the preface, then a frame or record header, while incomplete
        self._seen = 0
        self._skip = 0  # bytes of the current frame's (record's) payload still to pass over
        self._app = 0  # TLS: application-data payload bytes announced so far

    def feed(self, data: bytes | memoryview) -> bool:
        """True once the bytes fed so far show a call (and for every call after)."""
        if self._mode == "useful":
            return True
        self._seen += len(data)
        if self._mode == "start":
            data = self._start(data)
        if self._mode in ("h2", "tls") and self._walk(memoryview(data)):
            self._mode = "useful"
        elif self._seen > INSPECT_LIMIT:
            self._mode = "other"  # stop looking: a client this far without a call is not useful
        return self._mode == "useful"

    def _start(self, data: bytes | memoryview) -> bytes | memoryview:
        if not self._head and len(data) and data[0] == TLS_HANDSHAKE_RECORD:
            self._mode = "tls"
            return data
        take = len(PREFACE) - len(self._head)
        self._head += bytes(data[:take])
        if not PREFACE.startswith(self._head):
            self._mode = "other"  # neither HTTP/2 nor TLS: gRPC closes it
        elif len(self._head) == len(PREFACE):
            self._mode, self._head = "h2", b""
        return data[take:]

    def _walk(self, view: memoryview) -> bool:
        size = 9 if self._mode == "h2" else 5
        pos, end = 0, len(view)
        while pos < end:
            if self._skip:
                step = min(self._skip, end - pos)
                self._skip -= step
                pos += step
                continue
            need = size - len(self._head)
            self._head += bytes(view[pos:pos + need])
            pos += need
            if len(self._head) < size:
                return False
            head, self._head = self._head, b""
            if size == 9:
                if head[3] == HEADERS_FRAME:
                    return True
                self._skip = int.from_bytes(head[:3], "big")
            else:
                self._skip = int.from_bytes(head[3:5], "big")
                if head[0] == TLS_APPLICATION_DATA:
                    self._app += self._skip
                    if self._app >= TLS_USEFUL_BYTES:
                        return True
        return False


class _Side:
    """One socket of a relayed pair. ``out``: bytes read from the other side, not yet written here."""

    __slots__ = ("events", "other", "out", "pair", "reading", "shut_after", "sock")

    def __init__(self, sock: socket.socket, pair: _Pair) -> None:
        self.sock = sock
        self.pair = pair
        self.other: _Side = self
        self.out: memoryview | None = None
        self.reading = True
        self.shut_after = False  # the other side's EOF: shut down writing here once ``out`` is flushed
        self.events = 0


class _Pair:
    __slots__ = ("backend", "client", "closed", "name", "sniff", "source")

    def __init__(self, client: socket.socket, backend: socket.socket, source: str, name: str) -> None:
        self.client = _Side(client, self)
        self.backend = _Side(backend, self)
        self.client.other, self.backend.other = self.backend, self.client
        self.source = source
        self.name = name
        self.sniff: FirstCall | None = FirstCall()
        self.closed = False


def private_backend_dir() -> str:
    """A fresh 0700 directory for the gRPC server's unix socket (short path: unix names hold 107 bytes)."""
    return tempfile.mkdtemp(prefix="pdparams-grpc-")


def _source(address: object) -> str:
    host = str(address[0]) if isinstance(address, tuple) and address else str(address)
    return host[7:] if host.startswith("::ffff:") else host  # an IPv4 client of a dual-stack port


class GrpcGate:
    """Owns ``listen`` and relays admitted connections to the gRPC server on ``backend_dir/grpc.sock``.

    ``on_refused``/``on_evicted``: told the reason ("per_source" or "total") of each refusal and eviction."""

    def __init__(self, listen: str, backend_dir: str, limits: ConnectionLimits, *,
                 on_refused: Callable[[str], None] = lambda reason: None,
                 on_evicted: Callable[[str], None] = lambda reason: None) -> None:
        self.limits = limits.validate()
        self.backend_dir = backend_dir
        self.backend_path = os.path.join(backend_dir, SOCKET_NAME)
        self._on_refused, self._on_evicted = on_refused, on_evicted
        host, port = split_host_port(listen)
        self._listener = self._bind(host, port)
        self.port: int = self._listener.getsockname()[1]
        self.table: ConnectionTable[_Pair] = ConnectionTable(limits)
        self._names: dict[str, str] = {}  # abstract backend name -> client source
        self._prefix = f"pdparams-gate-{os.getpid()}-{secrets.token_hex(6)}-"
        self._serial = 0
        self._pairs: set[_Pair] = set()
        self._listening = False  # the listener is registered with the selector
        self._buffer = bytearray(READ_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopped = False
        self._accept_paused_until = 0.0
        self._accepting = True
        self._refusals = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._loop, name=f"grpc-gate-{self.port}", daemon=True)

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if ":" not in host and not host.replace(".", "").isdigit():  # a name: its first local address
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        dual = family == socket.AF_INET6 and host == "::"
        sock = socket.create_server((host, port), family=family, backlog=4096, reuse_port=False, dualstack_ipv6=dual)
        sock.setblocking(False)
        return sock

    # ------------------------------------------------------------ life

    def start(self) -> GrpcGate:
        self._listen(True)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread.start()
        return self

    def close_listener(self) -> None:
        """No new connections (the relayed ones go on): the start of a graceful stop."""
        self._accepting = False
        self._wake()

    def stop(self) -> None:
        """Close the port and every relayed connection; remove the backend directory."""
        self._stopped = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        else:
            self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        shutil.rmtree(self.backend_dir, ignore_errors=True)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # ------------------------------------------------------------ what gRPC asks

    def source_of(self, peer: str) -> str | None:
        """The client address behind a relayed call's ``context.peer()`` (``unix-abstract:NAME``); None
        for a peer the gate does not know (a call that did not come through it)."""
        kind, _, name = peer.partition(":")
        return self._names.get(name) if kind == "unix-abstract" else None

    def stats(self) -> dict[str, int]:
        return {"open": len(self.table), "idle": self.table.idle_count(), "refused": self.table.refused,
                "evicted": self.table.evicted, "limit": self.limits.total, "limit_per_source": self.limits.per_source}

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            while not self._stopped:
                timeout = None
                if self._accept_paused_until:
                    timeout = max(0.0, self._accept_paused_until - time.monotonic())
                    if timeout == 0.0:
                        self._accept_paused_until = 0.0
                        self._listen(self._accepting)
                        continue
                accept = False
                for key, mask in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        accept = True
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        self._relay(key.data, mask)
                if accept and self._listening:
                    # After the relays: a client admitted a moment ago has its first bytes read
                    # before a burst of newcomers can push it out.
                    self._accept()
        except Exception:  # logged; the port is then closed rather than left half-alive
            log.exception("the gRPC gate on port %d failed", self.port)
        finally:
            for pair in list(self._pairs):
                self._close(pair)
            self._selector.close()
            self._listener.close()

    def _relay(self, side: _Side, mask: int) -> None:
        if side.pair.closed:
            return
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(side)
            if mask & selectors.EVENT_READ and not side.pair.closed:
                self._read(side)
        except Exception:  # one connection's failure ends that connection, not the port
            log.exception("gRPC gate: relaying a connection from %s failed; it is closed", side.pair.source)
            self._close(side.pair)

    def _listen(self, on: bool) -> None:
        if on != self._listening:
            if on:
                self._selector.register(self._listener, selectors.EVENT_READ, None)
            else:
                self._selector.unregister(self._listener)
            self._listening = on

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        if not self._accepting and self._listener.fileno() >= 0:
            self._listen(False)
            self._accept_paused_until = 0.0
            self._listener.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS...: pause accepting, never end the port
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                self._refusals.warning("accept_failed", "gRPC gate accept failed: port=%d error=%s; pausing %gs",
                                       self.port, exc, _ACCEPT_PAUSE_S)
                self._listen(False)
                self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S
                return
            self._admit(sock, _source(address))

    def _admit(self, sock: socket.socket, source: str) -> None:
        try:
            backend, name = self._dial()
        except OSError as exc:
            sock.close()
            self._refusals.warning("backend", "gRPC gate could not reach the gRPC server: port=%d error=%s", self.port, exc)
            return
        pair = _Pair(sock, backend, source, name)
        decision = self.table.offer(pair, source)
        for victim in decision.evict:
            self._on_evicted(decision.reason)
            self._close(victim)
        if not decision.admit:
            self._on_refused(decision.reason)
            self._refusals.warning(f"refused_{decision.reason}", "gRPC connection refused: source=%s port=%d reason=%s "
                                   "limit_per_source=%d limit_total=%d", source, self.port, decision.reason,
                                   self.limits.per_source, self.limits.total)
            pair.closed = True
            backend.close()
            sock.close()
            return
        self._names[name] = source
        self._pairs.add(pair)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._update(pair.client)
        self._update(pair.backend)

    def _dial(self) -> tuple[socket.socket, str]:
        """A connection to the gRPC server, bound to a fresh abstract name (its ``context.peer()``)."""
        self._serial += 1
        name = f"{self._prefix}{self._serial}"
        backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            backend.bind("\0" + name)
            backend.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BACKEND_BUFFER_BYTES)
            backend.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BACKEND_BUFFER_BYTES)
            backend.settimeout(1.0)  # a full accept queue on the gRPC server: wait a moment, not forever
            backend.connect(self.backend_path)
            backend.setblocking(False)
        except OSError:
            backend.close()
            raise
        return backend, name

    def _update(self, side: _Side) -> None:
        want = (selectors.EVENT_READ if side.reading and side.other.out is None else 0) | (
            selectors.EVENT_WRITE if side.out is not None else 0)
        if want == side.events:
            return
        if side.events == 0:
            self._selector.register(side.sock, want, side)
        elif want == 0:
            self._selector.unregister(side.sock)
        else:
            self._selector.modify(side.sock, want, side)
        side.events = want

    def _read(self, side: _Side) -> None:
        pair = side.pair
        try:
            n = side.sock.recv_into(self._buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(pair)
            return
        target = side.other
        if n == 0:
            side.reading = False
            if target.out is None:
                self._shut_write(target)
            else:
                target.shut_after = True
            self._update(side)
            self._maybe_done(pair)
            return
        data = self._view[:n]
        if side is pair.client and pair.sniff is not None and pair.sniff.feed(data):
            pair.sniff = None
            if not self.table.useful(pair):  # its address already holds its share of calling connections
                self._on_refused("per_source")
                self._refusals.warning("refused_per_source", "gRPC connection refused: source=%s port=%d reason=per_source "
                                       "limit_per_source=%d (connections that made calls)", pair.source, self.port,
                                       self.limits.per_source)
                self._close(pair)
                return
        try:
            sent = target.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(pair)
            return
        if sent < n:
            target.out = memoryview(bytes(data[sent:]))  # the shared buffer is reused by the next read
            self._update(target)
            self._update(side)

    def _flush(self, side: _Side) -> None:
        assert side.out is not None
        try:
            sent = side.sock.send(side.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(side.pair)
            return
        side.out = side.out[sent:] if sent < len(side.out) else None
        if side.out is None:
            if side.shut_after:
                self._shut_write(side)
            self._update(side.other)  # its reading resumes
        self._update(side)
        self._maybe_done(side.pair)

    def _shut_write(self, side: _Side) -> None:
        side.shut_after = False
        try:
            side.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _maybe_done(self, pair: _Pair) -> None:
        """Closed once gRPC has ended the connection and the client has been sent all it said (HTTP/2
        has no use for a half-open connection; a client gone without a FIN, which the server's
        keepalive found dead, would otherwise hold its place), or once both sides have ended."""
        if not pair.backend.reading and pair.client.out is None:
            self._close(pair)

    def _close(self, pair: _Pair) -> None:
        if pair.closed:
            return
        pair.closed = True
        self.table.remove(pair)
        self._names.pop(pair.name, None)
        self._pairs.discard(pair)
        for side in (pair.client, pair.backend):
            if side.events:
                try:
                    self._selector.unregister(side.sock)
                except (KeyError, ValueError):
                    pass
                side.events = 0
            side.sock.close()


__all__ = ["FirstCall", "GrpcGate", "PREFACE", "TLS_USEFUL_BYTES", "private_backend_dir"]
