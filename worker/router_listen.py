"""The router's listening socket: accepting client connections, the connection caps, and the
serve loop around the aiohttp app (``worker.router.Router``).

aiohttp has no connection limit of its own; this module counts connections from accept to close
(``paramserver.wire.conn_limits``): at the total cap a connection that has not sent a complete
request yet is answered 503 and closed for the newcomer, and when every one has, the newcomer is
answered a 503 before aiohttp spends anything on it; one client address holds at most
``per_source`` connections that have sent a request (past that, 503).
"""
from __future__ import annotations

import asyncio
from http import HTTPStatus
import resource
import signal
import sys
from collections.abc import Callable
from typing import cast

from aiohttp import web, web_protocol

from paramserver.wire.conn_limits import ConnectionLimits, ConnectionTable
from worker.admission import TOO_MANY_CONNECTIONS

DEFAULT_MAX_CONNECTIONS = 4096
# Per client address: room for many users behind one NAT or proxy, not for one address to take all.
DEFAULT_MAX_CONNECTIONS_PER_SOURCE = 1024
KEEPALIVE_S = 30.0  # an idle client connection is closed after this
REFUSE_LINGER_S = 1.0  # how long a refused connection is read from, so that its 503 is not reset
REFUSE_DRAINING = 256  # refused connections read from at once; beyond, closed at once


def connection_cap(wanted: int, fd_limit: int | None = None) -> int:
    """At most ``wanted`` open client connections, and at most half the open-file limit: the rest
    is for the connections to workers and the cluster."""
    if fd_limit is None:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fd_limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
    return max(1, min(wanted, fd_limit // 2))


class _Open:
    """Client connections from accept to close, in the connection-limit table (per source address and
    in total). aiohttp adds one to its own count only when the loop gets round to a connection: the
    table is asked in ``connection_made``, one connection after another, so a burst is counted exactly."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.table: ConnectionTable[_Gated] = ConnectionTable(limits)
        self.refusing = 0  # _Overloaded connections still draining

    @property
    def connections(self) -> int:
        return len(self.table)


class _Gated(asyncio.Protocol):
    """One client connection: admitted by the table (then aiohttp's protocol, ``inner``, serves it) or
    answered by ``_Overloaded``. It becomes useful (never closed for a newcomer) once a request's
    line and headers have arrived in full (a blank line seen)."""

    def __init__(self, make_inner: Callable[[], asyncio.Protocol], open_: _Open, on_refused: Callable[[], None],
                 on_evicted: Callable[[], None]) -> None:
        self._make_inner = make_inner
        self._open = open_
        self._on_refused, self._on_evicted = on_refused, on_evicted
        self._inner: asyncio.Protocol | None = None
        self._refused: _Overloaded | None = None
        self.transport: asyncio.Transport | None = None
        self._tail: bytes | None = b""  # the last bytes seen, while waiting for the end of a request's headers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else str(peer)
        decision = self._open.table.offer(self, source)
        for victim in decision.evict:  # it sent no request yet: answered 503, its place is the newcomer's
            self._on_refused()
            self._on_evicted()
            victim.evict()
        if not decision.admit:
            self._on_refused()
            self._refused = _Overloaded(self._open)
            self._refused.connection_made(transport)
            return
        self._inner = self._make_inner()
        self._inner.connection_made(transport)

    def evict(self) -> None:
        """Answer the connection a 503 with a FIN, not a reset (a request it sent may be in flight):
        ``_Overloaded`` takes it over; aiohttp's protocol is told only when the connection ends."""
        if self._inner is None or self._refused is not None or self.transport is None:
            return
        self._open.table.remove(self)
        self._refused = _Overloaded(self._open)
        self._refused.connection_made(self.transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None or self._refused is not None:
            return  # a refused connection's request: dropped
        if self._tail is not None:
            if b"\r\n\r\n" in self._tail + data:
                self._tail = None
                if not self._open.table.useful(self):  # its address holds its share of requesting connections
                    self._on_refused()
                    self.evict()
                    return
            else:
                self._tail = (self._tail + data)[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused is not None:
            return self._refused.eof_received()
        return False if self._inner is None else self._inner.eof_received()

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._open.table.remove(self)
        if self._refused is not None:
            self._refused.connection_lost(exc)
        if self._inner is not None:
            self._inner.connection_lost(exc)


class _Overloaded(asyncio.Protocol):
    """A connection past the cap: a 503, before aiohttp spends anything on it. Closing with the
    client's request unread would send a reset that can overtake the 503, so the answer goes out
    with a FIN and what the client sent is read and dropped for up to REFUSE_LINGER_S; past
    REFUSE_DRAINING such connections at once, the rest are closed without the wait."""

    def __init__(self, open_: _Open) -> None:
        self._open = open_
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = self._transport = cast(asyncio.Transport, transport)
        t.write(TOO_MANY_CONNECTIONS)
        if self._open.refusing >= REFUSE_DRAINING or not t.can_write_eof():
            t.close()
            return
        self._open.refusing += 1
        t.write_eof()
        self._timer = asyncio.get_running_loop().call_later(REFUSE_LINGER_S, t.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request of a refused connection: dropped

    def eof_received(self) -> bool:
        return False  # the client is done too: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._open.refusing -= 1


class _JsonErrors(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering what never reached the app (a request line or headers
    that do not parse, headers over 8 KiB) as one-line JSON ``{"error": ...}`` like every other
    answer, instead of aiohttp's multi-line text page, and logging it at DEBUG (any client can send
    garbage; aiohttp logs each with a traceback)."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # an answer is under way: the connection is broken
            raise ConnectionError("the answer was being sent; cannot send the error instead")
        if status >= 500:
            self.logger.warning("error handling a request from %s: %r", request.remote, exc)
            text = HTTPStatus(status).phrase.lower() if status in HTTPStatus._value2member_map_ else "internal error"
        else:
            self.logger.debug("bad request from %s: %r", request.remote, exc)
            detail = (message or "").strip().splitlines()[0:1] or [""]
            text = f"bad request: {detail[0][:200] or HTTPStatus(status).phrase.lower()}"
        resp = web.json_response({"error": text}, status=status)
        resp.force_close()
        return resp


async def serve(app: web.Application, host: str, port: int, max_connections: int = DEFAULT_MAX_CONNECTIONS, *,
                on_refused: Callable[[], None] = lambda: None, banner: str = "", warning: str | None = None,
                per_source: int = DEFAULT_MAX_CONNECTIONS_PER_SOURCE, on_evicted: Callable[[], None] = lambda: None) -> int:
    """Serve ``app`` on HOST:PORT until SIGTERM or SIGINT: at most ``max_connections`` client
    connections, and ``per_source`` that have sent a request from one address (paramserver.wire.conn_limits).
    ``on_refused``: called for each connection answered 503 at a cap (evicted ones too); ``on_evicted``:
    for each one closed for a newcomer (it had sent no request); ``banner``: after ``LISTENING
    host:port``; ``warning``: printed once listening."""
    # keepalive_timeout: an idle client connection is closed after this, not aiohttp's hour.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    loop = asyncio.get_running_loop()
    handlers = runner.server
    assert handlers is not None
    open_ = _Open(ConnectionLimits(per_source, max_connections).within(max_connections))

    def protocol() -> asyncio.Protocol:
        # aiohttp has no connection limit: without one, a client holding connections open (a
        # request line trickled a byte at a time) takes every file descriptor.
        return _Gated(lambda: _JsonErrors(handlers, loop=loop, **handlers._kwargs), open_, on_refused, on_evicted)

    server: asyncio.Server | None = None
    try:  # cleanup closes the router's client session too, also when the bind fails
        server = await asyncio.get_running_loop().create_server(protocol, host, port, backlog=1024, reuse_address=True)
        sockets = getattr(server, "sockets", None) or []
        bound = sockets[0].getsockname()[:2] if sockets else (host, port)
        print(f"LISTENING {bound[0]}:{bound[1]}{banner}", flush=True)
        if warning is not None:  # warned once listening: a failed start stays one line
            print(warning, file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if server is not None:
            server.close()  # no new connections; cleanup then ends the open ones
        await runner.cleanup()
    return 0


__all__ = ["DEFAULT_MAX_CONNECTIONS", "DEFAULT_MAX_CONNECTIONS_PER_SOURCE", "KEEPALIVE_S", "connection_cap", "serve"]
