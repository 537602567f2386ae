"""The router's listening socket: accepting client connections, the connection cap, and the
serve loop around the aiohttp app (``worker.router.Router``).

aiohttp has no connection limit of its own; this module counts connections from accept to close
and answers those past the cap with a 503 before aiohttp spends anything on them.
"""
from __future__ import annotations

import asyncio
import resource
import signal
import sys
from collections.abc import Callable
from typing import cast

from aiohttp import web

from worker.admission import TOO_MANY_CONNECTIONS

DEFAULT_MAX_CONNECTIONS = 4096
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
    """Client connections from accept to close. aiohttp adds one to its own count only when the
    loop gets round to ``connection_made``: a burst accepted in one go was never refused."""

    def __init__(self) -> None:
        self.connections = 0
        self.refusing = 0  # _Overloaded connections still draining


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted in ``_Open`` until it is lost."""

    def __init__(self, inner: asyncio.Protocol, open_: _Open) -> None:
        self._inner = inner
        self._open = open_
        open_.connections += 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._open.connections -= 1
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


async def serve(app: web.Application, host: str, port: int, max_connections: int = DEFAULT_MAX_CONNECTIONS, *,
                on_refused: Callable[[], None] = lambda: None, banner: str = "", warning: str | None = None) -> int:
    """Serve ``app`` on HOST:PORT until SIGTERM or SIGINT. ``on_refused``: called for each connection
    refused past the cap; ``banner``: after ``LISTENING host:port``; ``warning``: printed once listening."""
    # keepalive_timeout: an idle client connection is closed after this, not aiohttp's hour.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    handlers = runner.server
    assert handlers is not None
    open_ = _Open()

    def protocol() -> asyncio.Protocol:
        # aiohttp has no connection limit: without one, a client holding connections open (a
        # request line trickled a byte at a time) takes every file descriptor.
        if open_.connections >= max_connections:
            on_refused()
            return _Overloaded(open_)
        return _Counted(handlers(), open_)

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


__all__ = ["DEFAULT_MAX_CONNECTIONS", "KEEPALIVE_S", "connection_cap", "serve"]
