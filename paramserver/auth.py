"""Optional bearer tokens and TLS.

Server side, :class:`TokenAuthInterceptor` checks the ``authorization:
Bearer <token>`` metadata: writes need the admin token, reads the read token
or the admin token; the gRPC health service is always open so probes work
without secrets. A token that is not configured leaves its class of RPC open.
Client side, :func:`token_interceptor` attaches a token on insecure channels;
with TLS use :func:`channel_credentials`, which adds it as call credentials.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import grpc

from .errors import ConfigError
from .proto import SERVICE_NAME

AUTH_HEADER = "authorization"
ADMIN_TOKEN_ENV = "PARAMS_ADMIN_TOKEN"
READ_TOKEN_ENV = "PARAMS_READ_TOKEN"

# RPCs that change state. Workers' reports (heat, corruption) are reads here:
# a worker holding only the read token must be able to send them.
WRITE_METHODS = frozenset(
    f"/{SERVICE_NAME}/{name}"
    for name in ("PutChunks", "CommitVersion", "SetTag", "RollbackTag", "DeleteTag", "AddMember", "RemoveMember")
)
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class AuthConfig:
    admin_token: str | None = None
    read_token: str | None = None

    def validate(self) -> AuthConfig:
        if self.read_token and not self.admin_token:
            raise ConfigError("a read token without an admin token would leave writes open; set an admin token too")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.admin_token or self.read_token)


def _bearer(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _matches(given: str | None, expected: str | None) -> bool:
    return given is not None and expected is not None and hmac.compare_digest(given.encode(), expected.encode())


def check_call(method: str, metadata: Iterable[tuple[str, Any]] | None, config: AuthConfig) -> str | None:
    """None when the call may proceed, else the UNAUTHENTICATED message (never echoing the token)."""
    if method.startswith(OPEN_PREFIXES):
        return None
    token = _bearer(metadata)
    is_write = method in WRITE_METHODS
    if is_write:
        if config.admin_token is None or _matches(token, config.admin_token):
            return None
        expected = f"the admin token (paramctl --token or ${ADMIN_TOKEN_ENV})"
    else:
        if config.read_token is None:
            return None  # only writes are protected
        if _matches(token, config.read_token) or _matches(token, config.admin_token):
            return None
        expected = f"the read token or the admin token (--token, ${READ_TOKEN_ENV} or ${ADMIN_TOKEN_ENV})"
    name = method.rsplit("/", 1)[-1]
    problem = "no token was sent" if token is None else "the token sent is wrong"
    return f"{name} needs {expected} as 'authorization: Bearer <token>' metadata; {problem}"


def _abort_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort, **kwargs)
    return grpc.unary_unary_rpc_method_handler(abort, **kwargs)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, config: AuthConfig) -> None:
        self.config = config.validate()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or not self.config.enabled:
            return handler
        message = check_call(handler_call_details.method, handler_call_details.invocation_metadata, self.config)
        return handler if message is None else _abort_handler(handler, message)


# ------------------------------------------------------------------ client side


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._pair = (AUTH_HEADER, f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = list(details.metadata or ())
        metadata.append(self._pair)
        return _CallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):  # type: ignore[no-untyped-def]
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def token_interceptor(token: str) -> grpc.UnaryUnaryClientInterceptor:
    """Interceptor that adds ``authorization: Bearer <token>`` to every call."""
    return _TokenClientInterceptor(token)


def token_metadata(token: str | None) -> list[tuple[str, str]]:
    return [] if not token else [(AUTH_HEADER, f"Bearer {token}")]


# ------------------------------------------------------------------ TLS


def _read(path: str | Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file {path}: {exc.strerror}") from exc


def server_credentials(cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> grpc.ServerCredentials:
    """TLS server credentials; with ``client_ca`` clients must present a certificate it signed."""
    cert_bytes, key_bytes = _read(cert), _read(key)
    assert cert_bytes is not None and key_bytes is not None
    ca = _read(client_ca)
    return grpc.ssl_server_credentials([(key_bytes, cert_bytes)], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(
    ca: str | Path | None = None,
    token: str | None = None,
    client_cert: str | Path | None = None,
    client_key: str | Path | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials (system roots when ``ca`` is None), with the token as call credentials."""
    creds = grpc.ssl_channel_credentials(_read(ca), _read(client_key), _read(client_cert))
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


__all__ = [
    "AuthConfig",
    "TokenAuthInterceptor",
    "check_call",
    "token_interceptor",
    "token_metadata",
    "server_credentials",
    "channel_credentials",
    "WRITE_METHODS",
    "AUTH_HEADER",
    "ADMIN_TOKEN_ENV",
    "READ_TOKEN_ENV",
]
