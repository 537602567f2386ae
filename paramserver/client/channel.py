"""Channels to parameter servers: the ONE gRPC channel factory (tokens, TLS, mutual TLS).

:func:`open_channel` is what every client-side connection goes through: the client stack's
:class:`~paramserver.client.rpc.ParamServerClient`, the raw GetChunks transport and, through
``paramserver.server.cluster.PeerSet``, the servers' calls to each other. On a plaintext channel
the token travels in an interceptor; with TLS it is sent as call credentials.

:func:`diagnose_tls` explains a connection that gRPC only reports as "Socket closed": it redoes
the TLS handshake with the ``ssl`` module and says what the server objected to (no client
certificate, one from another CA, an untrusted server certificate, TLS against plaintext).
"""
from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from paramserver.client.errors import ConfigError
from paramserver.wire.address import split_host_port
from paramserver.wire.auth import AUTH_HEADER, read_tls_file
from paramserver.wire.grpc_options import channel_options
from paramserver.wire.limits import DEFAULT_MAX_MESSAGE_BYTES

_Continuation = Callable[[grpc.ClientCallDetails, Any], Any]


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._pair = (AUTH_HEADER, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = (*(details.metadata or ()), self._pair)
        return _CallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression)

    # The continuations are generic over the request and response types, which the token does not touch.
    def intercept_unary_unary(self, continuation: _Continuation, client_call_details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: _Continuation, client_call_details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: _Continuation, client_call_details: grpc.ClientCallDetails,
                               request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: _Continuation, client_call_details: grpc.ClientCallDetails,
                                request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: tuple[tuple[str, str | bytes], ...] | None,
                 credentials: grpc.CallCredentials | None, wait_for_ready: bool | None, compression: grpc.Compression | None) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def token_interceptor(token: str) -> grpc.UnaryUnaryClientInterceptor:
    """Interceptor that adds ``authorization: Bearer <token>`` to every call."""
    return _TokenClientInterceptor(token)


def channel_credentials(
    ca: str | Path | None = None,
    token: str | None = None,
    client_cert: str | Path | None = None,
    client_key: str | Path | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials (system roots when ``ca`` is None), with the token as call credentials.

    ``client_cert``/``client_key`` (PEM files) are presented to servers that ask for one (mutual TLS).
    """
    creds = grpc.ssl_channel_credentials(read_tls_file(ca), read_tls_file(client_key), read_tls_file(client_cert))
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


def open_channel(
    address: str,
    *,
    token: str | None = None,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    tls: bool = False,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.Channel:
    """The one way a client (or a server calling its peers) opens a gRPC channel.

    TLS is on when ``tls`` is true or any of ``tls_ca``/``tls_cert`` is given: the server's
    certificate must chain to ``tls_ca`` (the system roots when None) and ``tls_cert``/``tls_key``
    are the client certificate for mutual TLS. Otherwise the channel is plaintext. The token, if
    any, goes with every call. Options (message limits, windows, keepalive) come from
    ``paramserver.wire.grpc_options``.
    """
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("a client certificate needs its key: give tls_cert and tls_key together")
    options = channel_options(max_message_bytes)
    if tls or tls_ca is not None or tls_cert is not None:
        return grpc.secure_channel(address, channel_credentials(tls_ca, token, tls_cert, tls_key), options=options)
    channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, token_interceptor(token)) if token else channel


# ------------------------------------------------------------------ diagnosis

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + an empty SETTINGS frame
_TLS_FLAGS = "--tls-ca/--tls-cert/--tls-key (or PARAMS_TLS_CA/PARAMS_TLS_CERT/PARAMS_TLS_KEY, or tls_* in the client config)"


def _ssl_reason(exc: ssl.SSLError) -> str:
    return str(getattr(exc, "reason", None) or getattr(exc, "verify_message", None) or exc).lower().replace("_", " ")


def diagnose_tls(
    address: str,
    *,
    tls: bool,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    timeout_s: float = 2.0,
) -> str | None:
    """Why ``address`` refuses this client's TLS setup, in one sentence; None when TLS is not the problem.

    gRPC reports a refused client certificate, like a plaintext client at a TLS port, only as
    "Socket closed". This redoes the handshake with the ``ssl`` module (and, with TLS 1.3, reads
    the server's verdict on the client certificate, which comes after the handshake). A server
    that cannot be reached at all (refused, timed out) returns None: that is not a TLS problem.
    """
    try:
        host, port = split_host_port(address)
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except (OSError, ValueError):
        return None
    with raw:
        raw.settimeout(timeout_s)
        use_tls = tls or tls_ca is not None or tls_cert is not None
        if not use_tls:
            # A plaintext client: does the server speak TLS?
            probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            probe.check_hostname = False
            probe.verify_mode = ssl.CERT_NONE
            try:
                with probe.wrap_socket(raw, server_hostname=host or None):
                    pass
            except ssl.SSLError as exc:
                if "certificate required" not in _ssl_reason(exc) and "alert" not in _ssl_reason(exc):
                    return None
            except OSError:
                return None
            return f"{address} serves TLS but this client connects in plaintext: set {_TLS_FLAGS}"
        try:
            context = ssl.create_default_context(cafile=str(tls_ca) if tls_ca is not None else None)
            context.set_alpn_protocols(["h2"])
            if tls_cert is not None and tls_key is not None:
                context.load_cert_chain(str(tls_cert), str(tls_key))
        except (OSError, ssl.SSLError) as exc:
            return f"the TLS files cannot be used ({exc}); check {_TLS_FLAGS}"
        try:
            with context.wrap_socket(raw, server_hostname=host) as conn:
                conn.sendall(_H2_PREFACE)
                try:
                    if conn.recv(9):
                        return None  # the server accepted us and answered: TLS is fine
                except TimeoutError:
                    return None
                except ssl.SSLError as exc:
                    return _refused(address, exc, tls_cert is not None)
                except OSError:
                    # Closed without an alert right after the handshake: the client certificate was refused.
                    return _refused(address, None, tls_cert is not None)
                return _refused(address, None, tls_cert is not None)
        except ssl.SSLCertVerificationError as exc:
            where = f"the CA in {tls_ca}" if tls_ca is not None else "the system's root certificates"
            return f"{address} presented a certificate that {where} does not accept ({exc.verify_message}); check --tls-ca"
        except ssl.SSLError as exc:
            reason = _ssl_reason(exc)
            if "wrong version" in reason or "record" in reason or "packet length" in reason or "http request" in reason:
                return f"{address} does not speak TLS (a plaintext cluster?): leave out {_TLS_FLAGS}"
            return _refused(address, exc, tls_cert is not None)
        except OSError:
            return None


def _refused(address: str, exc: ssl.SSLError | None, had_cert: bool) -> str:
    why = f" ({_ssl_reason(exc)})" if exc is not None else ""
    if not had_cert:
        return (f"{address} requires a client certificate{why} and none was given: "
                f"pass --tls-cert/--tls-key (or PARAMS_TLS_CERT/PARAMS_TLS_KEY, or tls_cert/tls_key in the client config)")
    return (f"{address} refused the client certificate{why}: it must be signed by the cluster's CA; "
            f"check --tls-cert/--tls-key (PARAMS_TLS_CERT/PARAMS_TLS_KEY)")


__all__ = ["channel_credentials", "diagnose_tls", "open_channel", "token_interceptor"]
