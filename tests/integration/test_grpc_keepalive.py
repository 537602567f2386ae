"""Client keepalive against the servers' ping enforcement, over real gRPC on 127.0.0.1.

Clients ping every CLIENT_KEEPALIVE_TIME_MS (1 s) so a silent peer is noticed in about 2 s. A
server that expects pings less often counts each early one as a strike and, past
grpc.http2.max_ping_strikes, answers GOAWAY "too_many_pings", dropping the client's connection
(gRPC core doc/keepalive.md). This checks that ours keeps an idle client connected through
several pings, and (the control) that the same client IS cut off by the old enforcement
(4 s minimum between pings), so the check can see a GOAWAY when there is one.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from paramserver.wire.grpc_options import (
    CLIENT_KEEPALIVE_TIME_MS,
    SERVER_MIN_PING_INTERVAL_MS,
    channel_options,
    server_options,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

IDLE_S = 5.5  # five client pings; the old enforcement strikes out on the fourth (about 4 s)


def _serve(options: list[tuple[str, int | str]]) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)  # bytes in, bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {"Echo": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


class Watched:
    """A client channel with our options whose connectivity changes are recorded."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        self.states: list[grpc.ChannelConnectivity] = []
        self.channel.subscribe(self.states.append, try_to_connect=True)
        self.echo = self.channel.unary_unary("/t.Echo/Echo")

    def dropped_after_ready(self) -> list[grpc.ChannelConnectivity]:
        seen = self.states[self.states.index(grpc.ChannelConnectivity.READY) + 1:]
        return [s for s in seen if s != grpc.ChannelConnectivity.READY]


@pytest.fixture
def servers() -> Iterator[tuple[int, int]]:
    ours, ours_port = _serve(server_options())
    old = [(k, 4_000 if k == "grpc.http2.min_ping_interval_without_data_ms" else v) for k, v in server_options()]
    strict, strict_port = _serve(old)
    try:
        yield ours_port, strict_port
    finally:
        ours.stop(None)
        strict.stop(None)


def test_enforcement_accepts_the_client_pings() -> None:
    assert SERVER_MIN_PING_INTERVAL_MS < CLIENT_KEEPALIVE_TIME_MS
    opts = dict(server_options())
    assert opts["grpc.keepalive_permit_without_calls"] == 1  # idle connections ping without strikes
    assert opts["grpc.http2.min_ping_interval_without_data_ms"] == SERVER_MIN_PING_INTERVAL_MS
    assert opts["grpc.http2.max_ping_strikes"] > 0  # a client pinging far faster is still cut off
    client = dict(channel_options())
    assert client["grpc.keepalive_time_ms"] == CLIENT_KEEPALIVE_TIME_MS
    assert client["grpc.http2.max_pings_without_data"] == 0  # keeps pinging an idle connection


def test_an_idle_client_stays_connected_through_its_pings(servers: tuple[int, int]) -> None:
    ours_port, strict_port = servers
    ours, strict = Watched(ours_port), Watched(strict_port)
    try:
        assert ours.echo(b"a", timeout=5) == b"a" and strict.echo(b"b", timeout=5) == b"b"
        time.sleep(IDLE_S)  # no calls: only keepalive pings cross either connection
        assert ours.dropped_after_ready() == [], f"our server dropped an idle client: {ours.states}"
        assert ours.echo(b"c", timeout=5) == b"c"
        # The control: a server expecting pings at most every 4 s sends GOAWAY too_many_pings.
        assert strict.dropped_after_ready(), f"the control saw no GOAWAY, so the check proves nothing: {strict.states}"
    finally:
        ours.channel.close()
        strict.channel.close()
