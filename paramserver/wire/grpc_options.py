"""Channel and server options shared by every paramserver endpoint.

Message limits are explicit so an oversized message fails fast with
RESOURCE_EXHAUSTED instead of at gRPC's 4 MiB default. Bigger HTTP/2 windows
and frames keep a single stream moving at loopback speed: measured here 0.6
GB/s with 256 KiB messages on defaults, 0.8-1.3 GB/s with 1 MiB messages and
larger frames.
"""
from __future__ import annotations

from paramserver.wire.limits import DEFAULT_MAX_MESSAGE_BYTES

MiB = 1 << 20

Options = list[tuple[str, int | str]]

# Client channel keepalive: ping every connection this often, and drop it when a ping is not
# acknowledged within the timeout. The servers must accept pings this often:
# SERVER_MIN_PING_INTERVAL_MS below CLIENT_KEEPALIVE_TIME_MS, or they GOAWAY the clients.
CLIENT_KEEPALIVE_TIME_MS = 1_000
CLIENT_KEEPALIVE_TIMEOUT_MS = 1_000
SERVER_MIN_PING_INTERVAL_MS = CLIENT_KEEPALIVE_TIME_MS // 2


def _common(max_message_bytes: int) -> Options:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.max_frame_size", 16 * MiB - 1),  # the HTTP/2 maximum
        ("grpc.http2.lookahead_bytes", 64 * MiB),
        ("grpc.http2.bdp_probe", 1),
        ("grpc.max_concurrent_streams", 256),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


# A connection that has not finished its HTTP/2 (and TLS) handshake by then is closed: gRPC's
# 120 s default let a client hold a file descriptor per bare TCP connect for two minutes.
SERVER_HANDSHAKE_TIMEOUT_MS = 10_000


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *, max_connections: int | None = None) -> Options:
    """``max_connections``: open connections past it are closed as they are accepted (gRPC core's
    connection quota), so clients cannot take the file descriptors the chunk store and Raft need."""
    extra: Options = [] if max_connections is None else [("grpc.max_allowed_incoming_connections", max_connections)]
    return _common(max_message_bytes) + extra + [
        ("grpc.server_handshake_timeout_ms", SERVER_HANDSHAKE_TIMEOUT_MS),
        ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Ping enforcement (gRPC core's keepalive guide, doc/keepalive.md): a ping received sooner
        # than min_ping_interval_without_data_ms after the previous one, while the server sends no
        # data, is a strike, and after max_ping_strikes strikes the server answers GOAWAY
        # "too_many_pings" (the client's calls on that connection fail). Clients ping every
        # CLIENT_KEEPALIVE_TIME_MS (below), so the minimum is half that, room for timer jitter;
        # the strike count keeps its default, so a client pinging far faster is still cut off.
        # keepalive_permit_without_calls (in _common) lets idle connections ping without strikes.
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Options:
    return _common(max_message_bytes) + [
        ("grpc.enable_retries", 1),
        # A peer that went silent (a partition, a cut cable, a host gone behind a switch) fails
        # the calls and streams on its connection within about 2 s (a ping after 1 s without
        # an answer, 1 s to acknowledge it) instead of hanging them until their deadline (bulk
        # streams have none). Which member to ask instead is ClusterView.leader_call's job.
        ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", CLIENT_KEEPALIVE_TIMEOUT_MS),
        # Each client object gets its own connection, so parallel pulls from
        # several client objects do not share one HTTP/2 connection's window.
        ("grpc.use_local_subchannel_pool", 1),
    ]


__all__ = [
    "CLIENT_KEEPALIVE_TIMEOUT_MS",
    "CLIENT_KEEPALIVE_TIME_MS",
    "SERVER_HANDSHAKE_TIMEOUT_MS",
    "SERVER_MIN_PING_INTERVAL_MS",
    "channel_options",
    "server_options",
]
